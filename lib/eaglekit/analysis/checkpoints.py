"""Stage 6's evaluation of stage-5 checkpoints: load a trained draft, cut held-out prompts, score offline
agreement by dataset, and compare the real speculative loop with plain greedy and the offline estimate.

The decoding itself (greedy, propose/verify/accept, chain and tree loops, the offline agreement primitives)
is `eaglekit.analysis.speculative`; this module only runs it over prompts and reports. Exported drafts (SGLang
or vLLM folders) are evaluated by `eaglekit.analysis.evaluate`.

One of stage 6's four evaluators (`eaglekit.analysis` says which is which).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from torch import nn

from eaglekit.analysis.acceptance import (
    acceptance_tables,
    chain_counts,
    pooled_accept_length,
    server_accept_length,
)
from eaglekit.capture import CapturedSamples
from eaglekit.draft.model import DraftConfig, Eagle3DraftModel
from eaglekit.analysis.offline_estimate import OfflineChainAgreement, offline_chain_agreement
from eaglekit.analysis.speculative import (GreedyResult, SpeculativeResult, greedy_decode, raise_if_lossy, speculative_decode,
                                           tokens_per_second)
from eaglekit.training.record import SweepRecord
from eaglekit.topology import Topology


# ---------------------------------------------------------------------------------------------------
# the comparison the notebook reports
# ---------------------------------------------------------------------------------------------------
@dataclass
class LoopReport:
    """Loop vs plain greedy vs offline estimate on the same prompts; `summary` is one flat record."""

    summary: dict
    per_prompt: list[dict]
    speculative: list[SpeculativeResult]
    greedy: list[GreedyResult]
    offline: list[OfflineChainAgreement]

    def require_lossless(self) -> None:
        """Raise when any speculative output differs from plain greedy decoding: the loop must be lossless."""
        raise_if_lossy([row["prompt"] for row in self.per_prompt if not row["outputs_equal"]], "on prompts")

    def per_prompt_table(self, prompts: Sequence[dict]) -> pd.DataFrame:
        """One row per prompt, named by the held-out prompts the loop ran on (`heldout_prompts`: id,
        dataset)."""
        if len(prompts) != len(self.per_prompt):
            raise ValueError(f"{len(prompts)} prompts given for a loop over {len(self.per_prompt)}")
        return pd.DataFrame(self.per_prompt).assign(id=[prompt["id"] for prompt in prompts],
                                                    dataset=[prompt["dataset"] for prompt in prompts])


def evaluate_speculative_loop(
    target: nn.Module, draft: Eagle3DraftModel, prompts: Sequence[Sequence[int]], steps: int, max_new_tokens: int,
    eos_token_ids: Sequence[int] = (), warmup: bool = True,
) -> LoopReport:
    """For each prompt: plain greedy, the speculative loop, and the offline chain estimate on the greedy
    output.

    Timings alternate greedy and speculative per prompt so load on the machine hits both alike; `warmup`
    runs each once on the first prompt first (untimed). Summary: topology, steps, draft tokens, the loop's
    server-style tau (pooled sum/sum and per-request mean, via `acceptance.server_accept_length`), the
    offline pooled tau and the gap, tokens/s of both loops and their ratio, and whether every output matched.
    Requests that ended on the prefill token had no verification step; they count in tokens/s but not in tau.
    """
    if not prompts:
        raise ValueError("no prompts given")
    draft.eval()
    if warmup:
        greedy_decode(target, prompts[0], min(max_new_tokens, 4), eos_token_ids)
        speculative_decode(target, draft, prompts[0], steps, min(max_new_tokens, 4), eos_token_ids)
    greedy_results, speculative_results, offline_results, rows = [], [], [], []
    for index, prompt in enumerate(prompts):
        greedy = greedy_decode(target, prompt, max_new_tokens, eos_token_ids)
        speculative = speculative_decode(target, draft, prompt, steps, max_new_tokens, eos_token_ids)
        offline = offline_chain_agreement(target, draft, list(prompt) + greedy.output_ids, len(prompt), steps)
        greedy_results.append(greedy)
        speculative_results.append(speculative)
        offline_results.append(offline)
        rows.append({
            "prompt": index,
            "prompt_tokens": len(prompt),
            "output_tokens": len(speculative.output_ids),
            "outputs_equal": speculative.output_ids == greedy.output_ids,
            "stop_reason": speculative.stop_reason,
            "verification_steps": speculative.verification_steps,
            "accept_length": speculative.accept_length,
            "offline_positions": int(offline.agreement.shape[0]),
            "greedy_tokens_per_second": greedy.tokens_per_second,
            "speculative_tokens_per_second": speculative.tokens_per_second,
        })
    summary = summarize(speculative_results, greedy_results, offline_results, steps)
    return LoopReport(summary=summary, per_prompt=rows, speculative=speculative_results, greedy=greedy_results, offline=offline_results)


def summarize(
    speculative: Sequence[SpeculativeResult], greedy: Sequence[GreedyResult], offline: Sequence[OfflineChainAgreement], steps: int
) -> dict:
    """One flat record: topology beside every tau (DESIGN), loop tau vs offline tau, tokens/s side by side."""
    verified = [result for result in speculative if result.verification_steps > 0]
    record: dict = {
        # topology, steps, top_k 1, draft_tokens k + 1 (SGLang's num_draft_tokens)
        **Topology.chain(steps).to_dict(),
        "requests": len(speculative),
        "requests_without_verification": len(speculative) - len(verified),
        "outputs_equal": all(s.output_ids == g.output_ids for s, g in zip(speculative, greedy)),
        "generated_tokens": sum(len(result.output_ids) for result in speculative),
    }
    if verified:
        server = server_accept_length([len(r.output_ids) for r in verified], [r.verification_steps for r in verified])
        record.update({"tau_loop_pooled": server.pooled, "tau_loop_per_request_mean": server.per_request_mean,
                       "verification_steps": server.verification_steps})
    else:
        record.update({"tau_loop_pooled": float("nan"), "tau_loop_per_request_mean": float("nan"), "verification_steps": 0})
    usable = [result.agreement for result in offline if result.agreement.shape[0] > 0]
    record["offline_positions"] = int(sum(array.shape[0] for array in usable))
    record["tau_offline_pooled"] = pooled_accept_length(chain_counts(usable, steps)) if usable else float("nan")
    record["tau_gap_loop_minus_offline"] = record["tau_loop_pooled"] - record["tau_offline_pooled"]
    record["greedy_tokens_per_second"] = tokens_per_second(greedy)
    record["speculative_tokens_per_second"] = tokens_per_second(speculative)
    record["speedup"] = record["speculative_tokens_per_second"] / record["greedy_tokens_per_second"]
    return record


# ---------------------------------------------------------------------------------------------------
# stage 6 inputs: trained drafts, held-out prompts, offline agreement by dataset
# ---------------------------------------------------------------------------------------------------
def load_draft_checkpoint(checkpoint_path: str | Path, target_embed_tokens: torch.Tensor) -> Eagle3DraftModel:
    """A trained draft from a stage-5 checkpoint (`training.save_checkpoint`), in eval mode.

    target_embed_tokens (V, H): the target's frozen embeddings, which checkpoints do not carry.
    """
    from eaglekit.training import load_checkpoint, load_draft_weights
    from eaglekit.training.finite import require_finite_draft

    checkpoint_path = Path(checkpoint_path)
    if not checkpoint_path.exists():
        raise FileNotFoundError(f"{checkpoint_path} not found: run stage 5 (training) first, or fix the path in training/sweep.json")
    checkpoint = load_checkpoint(checkpoint_path)
    if "draft_config" not in checkpoint:
        raise ValueError(f"{checkpoint_path}: no 'draft_config' in the checkpoint; it is not a stage-5 draft checkpoint")
    draft = Eagle3DraftModel(DraftConfig.from_dict(checkpoint["draft_config"]))
    if tuple(target_embed_tokens.shape) != (draft.config.vocab_size, draft.config.hidden_size):
        raise ValueError(f"{checkpoint_path}: target embeddings {tuple(target_embed_tokens.shape)} do not fit the draft "
                         f"(vocab {draft.config.vocab_size}, hidden {draft.config.hidden_size}); pass this draft's target")
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(target_embed_tokens.float())
    load_draft_weights(draft, checkpoint)
    # a NaN draft's argmax agrees by accident: no tau from it
    require_finite_draft(draft, str(checkpoint_path))
    return draft.eval()


def prompt_before_first_answer(input_ids: Sequence[int], loss_mask: Sequence[int]) -> list[int]:
    """The tokens before the first target-generated token (loss_mask 1): the prompt the target answered.

    For a multi-turn conversation this is the context of the first assistant turn, chat template included
    (the assistant header ends the prompt, as `add_generation_prompt` would)."""
    first = next((position for position, flag in enumerate(loss_mask) if int(flag) == 1), 0)
    return [int(token) for token in input_ids[:first]]


def heldout_prompts(samples: Sequence[dict], count: int, max_prompt_tokens: int) -> list[dict]:
    """Up to `count` prompts from held-out samples, in their order, one per sample.

    samples: dicts with "id", "dataset", "input_ids" (T,), "loss_mask" (T,). A sample is skipped when it
    has no generated token or its prompt is longer than `max_prompt_tokens` (the loop's cost grows with it).
    Returns [{"id", "dataset", "input_ids"}].
    """
    prompts = []
    for sample in samples:
        prompt = prompt_before_first_answer(torch.as_tensor(sample["input_ids"]).tolist(), torch.as_tensor(sample["loss_mask"]).tolist())
        if 0 < len(prompt) <= max_prompt_tokens:
            prompts.append({"id": str(sample["id"]), "dataset": str(sample.get("dataset", "")), "input_ids": prompt})
        if len(prompts) == count:
            break
    if not prompts:
        raise ValueError(f"no held-out sample has a prompt of 1..{max_prompt_tokens} tokens followed by a generated answer; "
                         "raise max_prompt_tokens or check the held-out set's loss masks")
    return prompts


def offline_agreements_by_dataset(
    draft: Eagle3DraftModel, target_lm_head: torch.Tensor, samples: Sequence[dict], steps: int,
    max_length: int = 2048, batch_size: int = 4, device: str | torch.device = "cpu",
) -> dict[str, list[np.ndarray]]:
    """Held-out chain agreement of one draft, grouped by dataset in sample order: {dataset: [(P, k) bool]}.

    Uses training's `per_position_agreement` (the draft unrolled as in training == serving, the target's
    argmax from the captured final hidden states @ target_lm_head (V, H)), so stage 5's held-out curve and
    stage 6's tables are one computation. Feed the result to
    `acceptance.acceptance_tables`/`sweep_acceptance`.
    """
    from eaglekit.training import per_position_agreement

    grouped: dict[str, list[np.ndarray]] = {}
    for sample in per_position_agreement(draft, target_lm_head, samples, steps, max_length, batch_size, device):
        grouped.setdefault(sample.dataset, []).append(sample.agreement)
    return grouped


def heldout_samples(sweep: SweepRecord, captured: CapturedSamples) -> list[dict]:
    """The samples every draft of the sweep was scored on (`sweep.heldout`), read from the capture in that
    order.

    A held-out key the capture does not hold means stage 4 ran again after stage 5: the error says so."""
    position_of = {key: position for position, key in enumerate(captured.keys)}
    missing = [key for key in sweep.heldout if key not in position_of]
    if missing:
        raise ValueError(f"{len(missing)} held-out samples of training/sweep.json are not in the capture, e.g. {missing[:3]}; "
                         "stage 5 and stage 4 of this run disagree: rerun stage 5")
    return [captured[position_of[key]] for key in sweep.heldout]


def offline_agreements_by_size(
    checkpoints: dict[int, Path], target_embed_tokens: torch.Tensor, target_lm_head: torch.Tensor, samples: Sequence[dict],
    steps: int, max_length: int = 2048, batch_size: int = 4,
) -> dict[int, dict[str, list[np.ndarray]]]:
    """{data size: {dataset: [(P, k) bool]}}: every checkpoint's held-out chain agreement, for
    `acceptance.sweep_acceptance`."""
    return {size: offline_agreements_by_dataset(load_draft_checkpoint(path, target_embed_tokens), target_lm_head, samples, steps,
                                                max_length, batch_size)
            for size, path in checkpoints.items()}


def score_ablation(
    sweep: SweepRecord, run_dir: str | os.PathLike, target_embed_tokens: torch.Tensor, target_lm_head: torch.Tensor,
    samples: Sequence[dict], steps: int, max_length: int = 2048, num_resamples: int = 1000, confidence: float = 0.95, seed: int = 0,
) -> pd.DataFrame | None:
    """Offline acceptance of each ablation variant of the sweep on the held-out samples: one row per (variant,
    dataset) as `acceptance.acceptance_tables` gives it, plus `variant` and `data_size`. None when stage 5
    trained no ablation."""
    if not sweep.ablation:
        return None
    tables = []
    for entry in sweep.ablation:
        # the file sweep.json recorded
        draft = load_draft_checkpoint(entry.verified_checkpoint(run_dir), target_embed_tokens)
        summary, _ = acceptance_tables(offline_agreements_by_dataset(draft, target_lm_head, samples, steps, max_length),
                                       steps, num_resamples, confidence, seed)
        tables.append(summary.assign(variant=entry.variant, data_size=entry.size))
    return pd.concat(tables, ignore_index=True)
