"""Which topology to serve: offline tau and predicted speedup for a grid of chains and SGLang trees.

The cost model extends the break-even model of `break_even` (Leviathan et al.; speedup ~ tau T_target /
(T_verify + g T_draft)) to trees, where a verification scores T tokens and each draft step runs K nodes:

    cycle(S, K, T) = verify(T) + draft(tau) + (S - 1) draft(K)
    verify(T)      = verify_base + (T - 1) verify_token      one target forward over T tree tokens
    draft(n)       = draft_base + (n - 1) draft_node         one draft forward over n rows/nodes
    speedup        = tau T_target / cycle,                   break-even tau = cycle / T_target

(SGLang runs S draft forwards per cycle: the extend over the accepted rows, about tau of them, then S - 1
tree steps over K nodes.) With verify_token = draft_node = 0 this is the chain model of `break_even`, speedup
= tau T_target / (T_verify + g T_draft) with g = S. The four costs come from `measure_step_costs` (real
forwards of the target and the draft on this machine) or from the user's own server measurements
(`StepCosts(...)`).

tau comes from `tree.offline_tree_depths_grid` on held-out samples (captured features and the target's
argmax from its final hidden states): each top-k is grown once to the deepest S, so a whole grid costs little
more than its widest tree. Every topology of a sweep is scored on the same start rows (those with S_max
generated tokens after them), so the rows compare like with like.

One of stage 6's four evaluators (`eaglekit.analysis` says which is which).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd
import torch
from torch import nn

from eaglekit.analysis.acceptance import (
    bootstrap_accept_length,
    chain_counts,
    depth_agreement,
    percentile_interval,
    pooled_accept_length,
)
from eaglekit.analysis.tree import SGLANG_SLOTS, TreeKeyValues, offline_tree_depths_grid
from eaglekit.topology import Topology


# ---------------------------------------------------------------------------------------------------
# costs
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepCosts:
    """Seconds: a plain target decode step; a verification forward (base + per extra token); a draft forward
    (base + per extra node). `source` says where the numbers come from (measured where, or given)."""

    target_step_s: float
    verify_base_s: float
    verify_token_s: float
    draft_base_s: float
    draft_node_s: float
    source: str = "given"

    def __post_init__(self) -> None:
        for name in ("target_step_s", "verify_base_s", "draft_base_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be a positive time in seconds, got {getattr(self, name)}")
        for name in ("verify_token_s", "draft_node_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def verify_s(self, tokens: int) -> float:
        return self.verify_base_s + (tokens - 1) * self.verify_token_s

    def draft_s(self, nodes: float) -> float:
        return self.draft_base_s + max(nodes - 1.0, 0.0) * self.draft_node_s

    def cycle_s(self, topology: Topology, accept_length: float) -> float:
        """One draft-and-verify cycle: the verification, the draft extend over ~tau rows, S - 1 tree steps."""
        return (self.verify_s(topology.draft_tokens) + self.draft_s(accept_length)
                + (topology.steps - 1) * self.draft_s(topology.top_k))

    def predicted_speedup(self, topology: Topology, accept_length: float) -> float:
        return accept_length * self.target_step_s / self.cycle_s(topology, accept_length)

    def break_even_accept_length(self, topology: Topology) -> float:
        """tau at which speculation matches plain decoding: solves tau T_target = cycle(tau)."""
        fixed = self.verify_s(topology.draft_tokens) + (topology.steps - 1) * self.draft_s(topology.top_k)
        # cycle = fixed + draft_base + (tau - 1) draft_node (tau >= 1): linear in tau.
        slope = self.target_step_s - self.draft_node_s
        constant = fixed + self.draft_base_s - self.draft_node_s
        return constant / slope if slope > 0 else float("inf")

    def to_dict(self) -> dict:
        return asdict(self)


def _fit_line(sizes: Sequence[int], seconds: Sequence[float]) -> tuple[float, float]:
    """Least-squares seconds = base + (size - 1) per_item; returns (base, per_item), per_item >= 0."""
    x = np.asarray(sizes, dtype=np.float64) - 1.0
    y = np.asarray(seconds, dtype=np.float64)
    if len(set(sizes)) < 2:
        return float(y.mean()), 0.0
    per_item, base = (float(value) for value in np.polyfit(x, y, 1))
    if per_item <= 0:  # noise hid a size effect: a flat cost
        return float(y.mean()), 0.0
    if base <= 0:  # noise pushed the intercept below zero: keep the smallest measured time as the base
        return float(y.min()), float((y.max() - y.min()) / (x.max() - x.min()))
    return base, per_item


@torch.inference_mode()
def measure_step_costs(
    target: nn.Module, draft: nn.Module, context_length: int = 128, verify_tokens: Sequence[int] = (1, 4, 16, 32),
    draft_nodes: Sequence[int] = (1, 4, 16), repeats: int = 5, seed: int = 0,
) -> StepCosts:
    """Time real forwards on this machine: the target over 1..T new tokens after a `context_length` cache
    (a 4-D mask, as the tree loop verifies), the draft over n nodes after as many extend rows. Median of
    `repeats` per size, then a straight line per model. CPU timings on a shared machine are noisy."""
    from transformers import DynamicCache

    from eaglekit.draft.model import DraftKVCache
    from eaglekit.analysis.speculative import (
        device_of,
        check_draft_fits_target,
        crop_target_cache,
        target_forward,
    )

    capture_layer_ids = check_draft_fits_target(target, draft)
    device = device_of(target)
    generator = torch.Generator().manual_seed(seed)
    vocab = int(target.config.vocab_size)
    context = torch.randint(0, vocab, (1, context_length), generator=generator).to(device)
    cache = DynamicCache(config=target.config)
    _, aux = target_forward(target, context, cache, capture_layer_ids)
    dtype = next(target.parameters()).dtype

    synchronize = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def time_call(call) -> float:
        call()  # warm-up
        samples = []
        for _ in range(repeats):
            synchronize()
            started = time.perf_counter()
            call()
            synchronize()
            samples.append(time.perf_counter() - started)
        return float(np.median(samples))

    def verify(tokens: int) -> None:
        block = torch.randint(0, vocab, (1, tokens), generator=generator).to(device)
        causal = torch.ones(tokens, tokens, dtype=torch.bool, device=device).tril()
        visible = torch.cat([torch.ones(tokens, context_length, dtype=torch.bool, device=device), causal], dim=1)
        mask = torch.zeros(tokens, context_length + tokens, dtype=dtype, device=device).masked_fill(~visible, torch.finfo(dtype).min)
        positions = torch.arange(context_length, context_length + tokens, device=device).view(1, -1)
        target_forward(target, block, cache, capture_layer_ids, attention_mask=mask[None, None], position_ids=positions)
        crop_target_cache(cache, context_length)

    def plain_step() -> None:
        token = torch.randint(0, vocab, (1, 1), generator=generator).to(device)
        target(input_ids=token, cache=cache, use_cache=True, logits_to_keep=1)
        crop_target_cache(cache, context_length)

    verify_seconds = [time_call(lambda t=tokens: verify(t)) for tokens in verify_tokens]
    target_step = time_call(plain_step)
    draft_cache = DraftKVCache()
    draft.extend(context[:, 1:].contiguous() if context_length > 1 else context, aux[:, : max(context_length - 1, 1)], 0, draft_cache)
    hidden = int(draft.config.hidden_size)

    def draft_forward(nodes: int) -> None:
        key_values = TreeKeyValues(draft_cache.keys, draft_cache.values, torch.full((nodes,), draft_cache.length - 1, device=device))
        tokens = torch.randint(0, vocab, (1, nodes), generator=generator).to(device)
        states = torch.zeros(1, nodes, hidden, dtype=draft.fc.weight.dtype, device=device)
        positions = torch.full((1, nodes), draft_cache.length, device=device)
        draft.logits(draft.step(tokens, states, positions, key_values))

    draft_seconds = [time_call(lambda n=nodes: draft_forward(n)) for nodes in draft_nodes]
    verify_base, verify_token = _fit_line(verify_tokens, verify_seconds)
    draft_base, draft_node = _fit_line(draft_nodes, draft_seconds)
    return StepCosts(target_step_s=target_step, verify_base_s=verify_base, verify_token_s=verify_token,
                     draft_base_s=draft_base, draft_node_s=draft_node,
                     source=f"measured on {device.type} ({torch.get_num_threads()} threads), context {context_length}, median of {repeats}")


# ---------------------------------------------------------------------------------------------------
# tau over a grid
# ---------------------------------------------------------------------------------------------------
def default_topology_grid(max_steps: int = 6, top_ks: Sequence[int] = (2, 4, 8),
                          draft_tokens: Sequence[int] = (4, 8, 16, 32, 64)) -> list[Topology]:
    """Chains of 1..max_steps steps and every valid tree with S in 2..max_steps, K in top_ks, T in
    draft_tokens."""
    return [Topology.chain(steps) for steps in range(1, max_steps + 1)] + [
        Topology.tree(steps, top_k, tokens) for top_k in top_ks for steps in range(2, max_steps + 1)
        for tokens in draft_tokens if 2 <= tokens <= 1 + top_k + (steps - 1) * top_k ** 2]


@torch.no_grad()
def tree_depths_by_dataset(
    draft: nn.Module, target_lm_head: torch.Tensor, samples: Sequence[dict], topologies: Sequence[Topology],
    max_length: int = 2048, device: str | torch.device = "cpu", draft_attention: str = SGLANG_SLOTS,
) -> dict[Topology, dict[str, list[np.ndarray]]]:
    """Held-out accepted depths for every topology, grouped by dataset in sample order.

    samples: dicts with "dataset", "input_ids" (T,), "loss_mask" (T,), "aux_hidden_states" (T, 3H) and
    "final_hidden_states" (T, H) (what capture stores); the target's argmax is final @ target_lm_head (V, H).
    Start rows: t with tokens t + 2 .. t + 1 + S_max all generated by the target (loss_mask 1), as training's
    chain evaluation picks them for S_max steps. A sample with no such row contributes an empty array.
    Returns {topology: {dataset: [(P,) depths per sample]}}; `sweep_table` turns them into tau per topology
    (`acceptance.depth_agreement`, then chain counts read per depth).
    """
    if not topologies:
        raise ValueError("no topologies given")
    device = torch.device(device)
    deepest = max(topology.steps for topology in topologies)
    lm_head = target_lm_head.to(device).float()
    was_training = draft.training
    draft.eval()
    result: dict[Topology, dict[str, list[np.ndarray]]] = {topology: {} for topology in topologies}
    for sample in samples:
        length = min(int(torch.as_tensor(sample["input_ids"]).shape[0]), max_length)
        input_ids = torch.as_tensor(sample["input_ids"])[:length].long().to(device)
        loss_mask = torch.as_tensor(sample["loss_mask"])[:length].bool().to(device)
        aux = torch.as_tensor(sample["aux_hidden_states"])[:length].to(device).to(draft.fc.weight.dtype)
        target_argmax = (torch.as_tensor(sample["final_hidden_states"])[:length].to(device).float() @ lm_head.T).argmax(-1)
        rows = [t for t in range(length - 1 - deepest) if bool(loss_mask[t + 2 : t + 2 + deepest].all())]
        start_rows = torch.tensor(rows, dtype=torch.long, device=device)
        depths = offline_tree_depths_grid(draft, input_ids, aux, target_argmax, start_rows, list(topologies),
                                          draft_attention=draft_attention)
        dataset = str(sample.get("dataset", ""))
        for topology in topologies:
            result[topology].setdefault(dataset, []).append(depths[topology].cpu().numpy())
    draft.train(was_training)
    return result


def pool_datasets(depths_by_dataset: Mapping[str, Sequence[np.ndarray]]) -> list[np.ndarray]:
    """All samples of all datasets, in dataset order."""
    return [array for arrays in depths_by_dataset.values() for array in arrays]


# ---------------------------------------------------------------------------------------------------
# the sweep table, its recommendation and its figure
# ---------------------------------------------------------------------------------------------------
def sweep_table(
    depths_by_topology: Mapping[Topology, Sequence[np.ndarray]], costs: StepCosts, draft_dir: str = "DRAFT_DIR",
    num_resamples: int = 1000, confidence: float = 0.95, seed: int = 0,
) -> pd.DataFrame:
    """One row per topology: offline tau (pooled, bootstrap interval over samples), the cycle cost, break-even
    tau and predicted speedup (with the interval carried through tau), SGLang flags and the vLLM setting.

    depths_by_topology: {topology: [(P,) accepted depths per sample]} (`pool_datasets` of
    `tree_depths_by_dataset`, or the loop's offline results). Rows sorted by predicted speedup, best first.
    """
    rows = []
    for topology, arrays in depths_by_topology.items():
        usable = [depth_agreement(np.asarray(array), topology.steps) for array in arrays if len(array)]
        if not usable:
            raise ValueError(f"{topology}: no start rows to score; the held-out samples are shorter than S + 2 generated tokens")
        counts = chain_counts(usable, topology.steps)
        tau = pooled_accept_length(counts)
        low, high = percentile_interval(bootstrap_accept_length(counts, num_resamples, seed).pooled_tau, confidence)
        vllm = topology.vllm_speculative_config(draft_dir)
        rows.append({
            "topology": str(topology), "kind": topology.kind, "steps": topology.steps, "top_k": topology.top_k,
            "draft_tokens": topology.draft_tokens, "ceiling": topology.ceiling,
            "tau": tau, "tau_low": float(low), "tau_high": float(high), "positions": int(counts.positions.sum()),
            "cycle_s": costs.cycle_s(topology, tau), "break_even_tau": costs.break_even_accept_length(topology),
            "predicted_speedup": costs.predicted_speedup(topology, tau),
            "predicted_speedup_low": costs.predicted_speedup(topology, float(low)),
            "predicted_speedup_high": costs.predicted_speedup(topology, float(high)),
            "sglang_flags": topology.sglang_command_line,
            "vllm_setting": "" if vllm is None else json.dumps(vllm),
        })
    table = pd.DataFrame(rows)
    return table.sort_values("predicted_speedup", ascending=False, ignore_index=True)


def recommend(table: pd.DataFrame, costs: StepCosts) -> dict:
    """The topology to serve in SGLang (best predicted speedup) and the vLLM setting (best chain), with
    whether either beats plain decoding under these costs."""
    if table.empty:
        raise ValueError("empty sweep table")
    best = table.iloc[int(table["predicted_speedup"].to_numpy().argmax())]
    chains = table[table["kind"] == "chain"]
    best_chain = chains.iloc[int(chains["predicted_speedup"].to_numpy().argmax())] if not chains.empty else None
    record = {
        "costs": costs.to_dict(),
        "sglang": {"topology": best["topology"], "flags": best["sglang_flags"], "tau": float(best["tau"]),
                   "predicted_speedup": float(best["predicted_speedup"]),
                   "predicted_speedup_interval": [float(best["predicted_speedup_low"]), float(best["predicted_speedup_high"])],
                   "pays_off": bool(best["predicted_speedup"] > 1.0)},
    }
    if best_chain is not None:
        record["vllm"] = {"topology": best_chain["topology"], "num_speculative_tokens": int(best_chain["steps"]),
                          "speculative_config": best_chain["vllm_setting"], "tau": float(best_chain["tau"]),
                          "predicted_speedup": float(best_chain["predicted_speedup"]),
                          "pays_off": bool(best_chain["predicted_speedup"] > 1.0)}
    verdict = "pays off" if record["sglang"]["pays_off"] else "does not pay off under these costs (plain decoding is faster)"
    record["summary"] = (f"best: {best['topology']} (tau {best['tau']:.2f}, predicted {best['predicted_speedup']:.2f}x), {verdict}; "
                         f"SGLang {best['sglang_flags']}"
                         + (f"; vLLM num_speculative_tokens {int(best_chain['steps'])} "
                            f"(predicted {best_chain['predicted_speedup']:.2f}x)" if best_chain is not None else ""))
    return record


LOOP_CHECK_FIELDS = ("topology", "tau_loop", "tau_server", "tau_offline", "tau_offline_vs_loop", "outputs_equal",
                     "tokens_per_s", "greedy_tokens_per_s", "speedup")


def check_recommendation(
    recommendation: dict, target: nn.Module, draft: nn.Module, prompts: Sequence[dict], steps: int, max_new_tokens: int,
    eos_token_ids: Sequence[int] = (), num_resamples: int = 1000, confidence: float = 0.95, seed: int = 0,
) -> dict:
    """The recommended SGLang topology (and the chain of `steps` every other tau is reported for) through the
    real loop on `prompts` ([{"id", "input_ids"}]), on one torch thread: `recommendation` (from `recommend`)
    with "loop_check" added, one record per topology (LOOP_CHECK_FIELDS: loop vs offline tau, speed against
    plain greedy). Raises when a loop's output differs from plain greedy decoding."""
    from eaglekit.analysis.evaluate import evaluate_draft
    from eaglekit.analysis.speculative import one_torch_thread, raise_if_lossy

    topologies = list(dict.fromkeys([Topology.parse(recommendation["sglang"]["topology"]), Topology.chain(steps)]))
    with one_torch_thread():
        records = evaluate_draft(target, draft, [prompt["input_ids"] for prompt in prompts], topologies, max_new_tokens, eos_token_ids,
                                 prompt_names=[prompt["id"] for prompt in prompts], num_resamples=num_resamples,
                                 confidence=confidence, seed=seed).records()
    raise_if_lossy([record["topology"] for record in records if not record["outputs_equal"]], "for")
    return {**recommendation, "loop_check": [{key: record[key] for key in LOOP_CHECK_FIELDS} for record in records]}


def sweep_event(recommendation: dict) -> dict:
    """The `topology_sweep` metrics event: recommended SGLang topology and flags, predicted speedup, vLLM's
    num_speculative_tokens (None without a chain in the grid) and the loop check when there is one."""
    return {"event": "topology_sweep", "recommended": recommendation["sglang"]["topology"], "flags": recommendation["sglang"]["flags"],
            "predicted_speedup": recommendation["sglang"]["predicted_speedup"],
            "vllm_num_speculative_tokens": (recommendation.get("vllm") or {}).get("num_speculative_tokens"),
            "loop_check": recommendation.get("loop_check")}


def plot_topology_sweep(table: pd.DataFrame, recommended: str | None = None):
    """Two panels against draft tokens T (log scale), one line per top-k K (chains are K = 1, T = S + 1), each
    point the best S for that (K, T): offline tau (with its interval), and predicted speedup with the
    break-even line at 1. `recommended` (a topology string) is starred. Returns the matplotlib figure."""
    import matplotlib.pyplot as plt

    figure, (tau_axes, speed_axes) = plt.subplots(1, 2, figsize=(11, 4.2))
    for top_k, group in table.groupby("top_k"):
        best = group.sort_values("predicted_speedup", ascending=False).groupby("draft_tokens", as_index=False).first()
        best = best.sort_values("draft_tokens")
        label = "chain (K=1)" if top_k == 1 else f"tree K={top_k}"
        errors = np.vstack([best["tau"] - best["tau_low"], best["tau_high"] - best["tau"]])
        tau_axes.errorbar(best["draft_tokens"], best["tau"], yerr=errors, marker="o", capsize=3, label=label)
        speed_axes.plot(best["draft_tokens"], best["predicted_speedup"], marker="o", label=label)
    if recommended is not None and recommended in set(table["topology"]):
        row = table[table["topology"] == recommended].iloc[0]
        tau_axes.plot(row["draft_tokens"], row["tau"], marker="*", markersize=16, color="black", linestyle="none",
                      label=f"recommended {recommended}")
        speed_axes.plot(row["draft_tokens"], row["predicted_speedup"], marker="*", markersize=16, color="black", linestyle="none")
    speed_axes.axhline(1.0, color="grey", linestyle="--", label="break-even (plain decoding)")
    for axes in (tau_axes, speed_axes):
        axes.set_xscale("log", base=2)
        axes.set_xlabel("draft tokens verified per step T")
        axes.grid(alpha=0.3)
    tau_axes.set_ylabel("offline accept length tau (best S per point)")
    speed_axes.set_ylabel("predicted speedup over plain decoding")
    tau_axes.legend(fontsize=8)
    speed_axes.legend(fontsize=8)
    figure.tight_layout()
    return figure
