"""Evaluate an exported draft against its target on a prompts file, for one or more serving topologies.

What `eaglekit evaluate` runs, per prompt: plain greedy decoding (the reference output and the baseline
speed), then for each topology the real speculative loop (`speculative.decode_with_topology`: the chain loop
or SGLang's tree loop) and the offline estimate (`offline_estimate.offline_tree_acceptance`) on the prompt +
the greedy continuation. Greedy and speculative runs alternate per prompt, so load on the machine hits both
alike.

Three accept lengths per topology, each with a percentile-bootstrap interval over prompts:
- tau_loop: tokens per verification step the loop accepted, bonus included, prefill token excluded
  (sum(a_i + 1) / steps, before any cut by max_new_tokens or EOS): what the offline estimate predicts;
- tau_server: completion tokens / verification steps, as SGLang's meta_info counts it (the prefill token is a
  completion token without a verification step, and the last block is cut at the budget);
- tau_offline: 1 + E[accepted depth] over every start row of the greedy continuations (DESIGN's offline tau;
  for a chain the chain formula exactly).
All pool over prompts as sum/sum; the per-prompt rows hold each prompt's own values.

Inputs: an export folder in either format (`export.load_export` reads SGLang's and vLLM's configs), and a
JSONL prompts file, one conversation per line: the kit's schema ({"id", "messages": [...]}) or OpenAI's
({"messages": [...]} or a bare list of messages). A trailing assistant message is the reference answer and is
dropped: the target answers the conversation up to it.

One of stage 6's four evaluators (`eaglekit.analysis` says which is which).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from eaglekit.analysis.acceptance import (
    bootstrap_accept_length,
    bootstrap_ratio,
    chain_counts,
    percentile_interval,
    pooled_accept_length,
    server_accept_length,
)
from eaglekit.draft.model import Eagle3DraftModel
from eaglekit.analysis.tree import SGLANG_SLOTS
from eaglekit.io import InputError, read_jsonl, write_json
from eaglekit.analysis.offline_estimate import OfflineTreeAcceptance, offline_tree_acceptance
from eaglekit.analysis.speculative import GreedyResult, SpeculativeResult, decode_with_topology, greedy_decode, tokens_per_second
from eaglekit.topology import Topology

ROLES = ("system", "user", "assistant", "tool")


# ---------------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EvaluationPrompt:
    id: str
    messages: list[dict]


def read_prompts(path: str | Path, limit: int | None = None) -> list[EvaluationPrompt]:
    """Conversations from a JSONL file (kit schema or OpenAI messages), the trailing assistant turn dropped.

    Bad lines raise `InputError` naming the file, line and field.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: prompts file not found")
    prompts: list[EvaluationPrompt] = []
    for line, record in read_jsonl(path):
        if isinstance(record, list):
            messages, prompt_id = record, f"line{line}"
        elif isinstance(record, dict) and "messages" in record:
            messages, prompt_id = record["messages"], str(record.get("id", f"line{line}"))
        else:
            raise InputError(path, line, "messages", "expected an object with 'messages' (kit or OpenAI schema) or a list of messages")
        if not isinstance(messages, list) or not messages:
            raise InputError(path, line, "messages", "must be a non-empty list of {role, content} objects")
        for index, message in enumerate(messages):
            if not isinstance(message, dict) or message.get("role") not in ROLES:
                got = message.get("role") if isinstance(message, dict) else message
                raise InputError(path, line, f"messages[{index}].role", f"must be one of {list(ROLES)}, got {got!r}")
            if not isinstance(message.get("content", ""), (str, type(None))):
                raise InputError(path, line, f"messages[{index}].content", "must be a string (multimodal parts are not supported)")
        while messages and messages[-1]["role"] == "assistant":
            messages = messages[:-1]
        if not messages:
            raise InputError(path, line, "messages", "holds only assistant turns: nothing to answer")
        prompts.append(EvaluationPrompt(id=prompt_id, messages=[{**m, "content": m.get("content") or ""} for m in messages]))
        if limit is not None and len(prompts) >= limit:
            break
    if not prompts:
        raise InputError(path, None, None, "no prompts in the file")
    return prompts


def prompt_ids(tokenizer: Any, prompt: EvaluationPrompt) -> list[int]:
    """The tokens the target reads before answering (the kit's chat rendering, generation prompt added)."""
    from eaglekit.chat import prompt_token_ids

    return prompt_token_ids(tokenizer, prompt.messages)


def load_draft_for_target(draft_dir: str | Path, target: nn.Module) -> Eagle3DraftModel:
    """An export (SGLang or vLLM folder) rebuilt with the target's embeddings, checked against the target,
    in the target's dtype (a bf16 export runs in float32 next to a float32 target)."""
    from eaglekit.draft.export import cast_weights, check_against_target, load_export
    from eaglekit.training.finite import require_finite_draft

    embed = target.get_input_embeddings().weight.detach()
    draft = load_export(draft_dir, embed.cpu(), target_num_hidden_layers=int(target.config.num_hidden_layers))
    check_against_target(draft, target.config)
    require_finite_draft(draft, str(draft_dir))  # a NaN draft's argmax agrees by accident: no tau from it
    cast_weights(draft, embed.dtype)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(embed.cpu())  # full precision, not the export dtype load_export used
    return draft.to(embed.device).eval()


# ---------------------------------------------------------------------------------------------------
# the evaluation
# ---------------------------------------------------------------------------------------------------
@dataclass
class TopologyEvaluation:
    topology: Topology
    speculative: list[SpeculativeResult] = field(default_factory=list)
    offline: list[OfflineTreeAcceptance] = field(default_factory=list)


@dataclass
class Evaluation:
    """Everything measured: greedy references and, per topology, the loop and offline results per prompt."""

    prompt_ids: list[str]
    prompt_tokens: list[int]
    greedy: list[GreedyResult]
    topologies: list[TopologyEvaluation]
    num_resamples: int = 1000
    confidence: float = 0.95
    seed: int = 0

    def records(self) -> list[dict]:
        """One JSON-ready record per topology (the `--json` file's "topologies")."""
        return [topology_record(self, item) for item in self.topologies]


def evaluate_draft(
    target: nn.Module, draft: nn.Module, prompts: Sequence[Sequence[int]], topologies: Sequence[Topology],
    max_new_tokens: int, eos_token_ids: Sequence[int] = (), prompt_names: Sequence[str] | None = None,
    warmup: bool = True, num_resamples: int = 1000, confidence: float = 0.95, seed: int = 0,
    draft_attention: str = SGLANG_SLOTS,
) -> Evaluation:
    """Greedy, then each topology's loop, per prompt; then the offline estimate on the greedy continuations.
    draft_attention: how tree nodes attend earlier draft keys (`tree`; SGLang's per-slot layout by
    default)."""
    if not prompts:
        raise ValueError("no prompts given")
    if not topologies:
        raise ValueError("no topology given: pass e.g. Topology.parse('chain:3')")
    draft.eval()
    if warmup:  # first-call costs (allocations, kernels) out of the timings
        greedy_decode(target, prompts[0], min(max_new_tokens, 4), eos_token_ids)
        for topology in topologies:
            decode_with_topology(target, draft, prompts[0], topology, min(max_new_tokens, 4), eos_token_ids, draft_attention)
    results = [TopologyEvaluation(topology) for topology in topologies]
    greedy_results = []
    for prompt in prompts:
        greedy_results.append(greedy_decode(target, prompt, max_new_tokens, eos_token_ids))
        for item in results:
            item.speculative.append(decode_with_topology(target, draft, prompt, item.topology, max_new_tokens, eos_token_ids,
                                                         draft_attention))
    for prompt, greedy in zip(prompts, greedy_results):
        for item in results:
            item.offline.append(offline_tree_acceptance(target, draft, list(prompt) + greedy.output_ids, len(prompt), item.topology,
                                                        draft_attention))
    names = list(prompt_names) if prompt_names is not None else [str(index) for index in range(len(prompts))]
    return Evaluation(prompt_ids=names, prompt_tokens=[len(prompt) for prompt in prompts], greedy=greedy_results,
                      topologies=results, num_resamples=num_resamples, confidence=confidence, seed=seed)


def _ratio_interval(numerators: np.ndarray, denominators: np.ndarray, evaluation: Evaluation) -> tuple[float, float]:
    """Percentile bootstrap over prompts of sum(numerators) / sum(denominators)."""
    if len(numerators) == 0:
        return float("nan"), float("nan")
    replicates = bootstrap_ratio(numerators, denominators, evaluation.num_resamples, evaluation.seed)
    low, high = percentile_interval(replicates, evaluation.confidence)
    return float(low), float(high)


def topology_record(evaluation: Evaluation, item: TopologyEvaluation) -> dict:
    """The per-topology summary: the three taus with intervals, the lossless check, tokens/s, per-prompt
    rows."""
    topology = item.topology
    verified = [result for result in item.speculative if result.verification_steps > 0]
    steps = np.array([result.verification_steps for result in verified], dtype=np.float64)
    accepted_plus_bonus = np.array([sum(result.accepted_per_step) + result.verification_steps for result in verified], dtype=np.float64)
    completion = np.array([len(result.output_ids) for result in verified], dtype=np.float64)
    usable = [result.agreement for result in item.offline if result.agreement.shape[0] > 0]
    if usable:
        counts = chain_counts(usable, topology.steps)
        tau_offline = pooled_accept_length(counts)
        offline_low, offline_high = percentile_interval(
            bootstrap_accept_length(counts, evaluation.num_resamples, evaluation.seed).pooled_tau, evaluation.confidence)
    else:
        tau_offline = offline_low = offline_high = float("nan")
    generated = sum(len(result.output_ids) for result in item.speculative)
    tokens_per_s, greedy_tokens_per_s = tokens_per_second(item.speculative), tokens_per_second(evaluation.greedy)
    per_prompt = []
    for index, (result, greedy, offline) in enumerate(zip(item.speculative, evaluation.greedy, item.offline)):
        positions = int(offline.accepted_depths.shape[0])
        per_prompt.append({
            "prompt": evaluation.prompt_ids[index],
            "prompt_tokens": evaluation.prompt_tokens[index],
            "output_tokens": len(result.output_ids),
            "outputs_equal": result.output_ids == greedy.output_ids,
            "stop_reason": result.stop_reason,
            "verification_steps": result.verification_steps,
            "tau_loop": result.loop_accept_length,
            "tau_server": result.accept_length,
            "tau_offline": 1.0 + float(offline.accepted_depths.mean()) if positions else float("nan"),
            "offline_positions": positions,
            "tokens_per_s": result.tokens_per_second,
            "greedy_tokens_per_s": greedy.tokens_per_second,
        })
    tau_loop = float(accepted_plus_bonus.sum() / steps.sum()) if len(steps) else float("nan")
    # SGLang's completion_tokens / spec_verify_ct, as the held-out loop and live serving count it
    server = server_accept_length(completion, steps) if verified else None
    return {
        "topology": str(topology),
        **{key: value for key, value in topology.to_dict().items() if key != "topology"},
        "kind": topology.kind,
        "ceiling": topology.ceiling,
        "sglang_flags": topology.sglang_command_line,
        "vllm_speculative_config": topology.vllm_speculative_config("DRAFT_DIR"),
        "prompts": len(item.speculative),
        "prompts_without_verification": len(item.speculative) - len(verified),
        "verification_steps": int(steps.sum()),
        "tau_loop": tau_loop,
        "tau_loop_interval": list(_ratio_interval(accepted_plus_bonus, steps, evaluation)),
        "tau_loop_per_prompt_mean": float(np.mean(accepted_plus_bonus / steps)) if len(steps) else float("nan"),
        "tau_server": server.pooled if server else float("nan"),
        "tau_server_interval": list(_ratio_interval(completion, steps, evaluation)),
        "tau_server_per_prompt_mean": server.per_request_mean if server else float("nan"),
        "tau_offline": tau_offline,
        "tau_offline_interval": [float(offline_low), float(offline_high)],
        "offline_positions": int(sum(array.shape[0] for array in usable)),
        "tau_offline_vs_loop": (tau_offline - tau_loop) / tau_loop if len(steps) else float("nan"),
        "outputs_equal": all(row["outputs_equal"] for row in per_prompt),
        "generated_tokens": generated,
        "tokens_per_s": tokens_per_s,
        "greedy_tokens_per_s": greedy_tokens_per_s,
        "speedup": tokens_per_s / greedy_tokens_per_s,
        "confidence": evaluation.confidence,
        "per_prompt": per_prompt,
    }


# ---------------------------------------------------------------------------------------------------
# the command's printout and JSON
# ---------------------------------------------------------------------------------------------------
def format_report(records: Sequence[dict]) -> str:
    """Plain-text report: one block per topology, pooled then per prompt."""
    lines = []
    for record in records:
        low, high = record["tau_loop_interval"]
        server_low, server_high = record["tau_server_interval"]
        offline_low, offline_high = record["tau_offline_interval"]
        lines += [
            f"== {record['topology']}  (ceiling {record['ceiling']}; SGLang: {record['sglang_flags']}"
            + (f"; vLLM num_speculative_tokens {record['steps']})" if record["kind"] == "chain" else "; vLLM: chains only)"),
            (f"   tau loop    {record['tau_loop']:.3f}  [{low:.3f}, {high:.3f}]   (accepted + bonus per verification, "
             f"{record['verification_steps']} steps)"),
            (f"   tau server  {record['tau_server']:.3f}  [{server_low:.3f}, {server_high:.3f}]   (completion tokens / "
             "verification steps, as SGLang counts)"),
            (f"   tau offline {record['tau_offline']:.3f}  [{offline_low:.3f}, {offline_high:.3f}]   "
             f"({record['offline_positions']} start rows of the greedy continuations; "
             f"{100 * record['tau_offline_vs_loop']:+.1f}% vs loop)"),
            "   lossless    " + ("yes: every output equals plain greedy decoding" if record["outputs_equal"]
                                 else "NO: some outputs differ from plain greedy decoding"),
            (f"   tokens/s    {record['tokens_per_s']:.2f} speculative vs {record['greedy_tokens_per_s']:.2f} greedy "
             f"({record['speedup']:.2f}x)"),
            "   prompt                 tokens  out  steps  tau_loop  tau_server  tau_offline  equal",
        ]
        for row in record["per_prompt"]:
            lines.append(f"   {row['prompt'][:22]:<22} {row['prompt_tokens']:>6} {row['output_tokens']:>4} {row['verification_steps']:>6}"
                         f"  {row['tau_loop']:>8.3f}  {row['tau_server']:>10.3f}  {row['tau_offline']:>11.3f}  "
                         + ("yes" if row["outputs_equal"] else "NO"))
    return "\n".join(lines)


def run_evaluate(
    target_spec: str, draft_dir: str | Path, prompts_path: str | Path, topologies: Sequence[Topology], max_new_tokens: int,
    json_path: str | Path | None = None, limit: int | None = None, device: str = "cpu", dtype: str = "float32",
    num_resamples: int = 1000, seed: int = 0, draft_attention: str = SGLANG_SLOTS, trust_remote_code: bool = False,
) -> list[dict]:
    """What `eaglekit evaluate` does: load target (a folder or `embedded:NAME`; a multimodal wrapper's text
    model), draft export and prompts; evaluate; write `--json` ({"target", "draft", "prompts_file",
    "max_new_tokens", "topologies": [...]}). Returns the records."""
    from transformers import AutoTokenizer

    from eaglekit.target import resolve_model, target_layout

    prompts = read_prompts(prompts_path, limit)
    target_dir = resolve_model(target_spec)
    tokenizer = AutoTokenizer.from_pretrained(target_dir, trust_remote_code=trust_remote_code)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    layout = target_layout(target_dir, trust_remote_code=trust_remote_code)
    target = layout.load_text_model(dtype=torch_dtype).to(device).eval()
    draft = load_draft_for_target(draft_dir, target)
    eos_token_ids = sorted(_eos_ids(target, tokenizer))
    token_lists = [prompt_ids(tokenizer, prompt) for prompt in prompts]
    started = time.perf_counter()
    evaluation = evaluate_draft(target, draft, token_lists, topologies, max_new_tokens, eos_token_ids,
                                prompt_names=[prompt.id for prompt in prompts], num_resamples=num_resamples, seed=seed,
                                draft_attention=draft_attention)
    records = evaluation.records()
    if json_path is not None:
        write_json(json_path, {"target": str(target_spec), "draft": str(draft_dir), "prompts_file": str(prompts_path),
                               "max_new_tokens": max_new_tokens, "device": device, "dtype": dtype, "draft_attention": draft_attention,
                               "seconds": time.perf_counter() - started, "topologies": records})
    return records


def _eos_ids(target: nn.Module, tokenizer: Any) -> set[int]:
    """Every token that ends an answer: the tokenizer's EOS and the generation config's (chat models add
    end-of-turn)."""
    ids: set[int] = set()
    for value in (tokenizer.eos_token_id, getattr(getattr(target, "generation_config", None), "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(item) for item in value)
    return ids
