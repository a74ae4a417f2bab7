"""The data-size sweep: one draft per size on nested, dataset-stratified subsets, one held-out set for all."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from eaglekit.draft.model import Eagle3DraftModel
from eaglekit.training.loop import train_draft
from eaglekit.training.metrics import recent_gain
from eaglekit.training.settings import TrainSettings
from eaglekit.training.split import IndexedSubset, nested_subsets, split_heldout
from eaglekit.training.teacher import TargetArgmaxCache


def train_size_sweep(
    build_model: Callable[[], Eagle3DraftModel],
    target_lm_head: torch.Tensor,
    samples: Sequence[dict],
    sizes: Sequence[int],
    heldout_size: int,
    output_dir: str | Path,
    settings: TrainSettings,
    split_seed: int = 0,
    datasets: Sequence[str] | None = None,
    conversations: Sequence[str] | None = None,
    target_cache: TargetArgmaxCache | None = None,
    split: tuple[Sequence[int], Sequence[int]] | None = None,
) -> list[dict[str, Any]]:
    """One draft per data size on nested, dataset-stratified subsets, all scored on one held-out set.

    build_model() returns a fresh draft (same init each call). Each size trains into
    output_dir/size-<n>/ and resumes there. Returns one row per size: size, per-dataset counts, the
    schedule, steps used and the step cap, samples seen (and epochs), best step, best held-out simulated
    accept length, whether it converged and why it stopped, the last improvement (`recent_gain`: held-out
    tau gained over the last `patience` evaluations), checkpoint and metrics paths, held-out size.
    `datasets` (one name per sample) spares reading every sample just for its dataset name;
    `conversations` (one key per sample, `read_conversation_keys`) keeps split conversations on one side.
    `target_cache`: a cache the caller shares with other drafts on the same samples (None: one for this sweep).
    `split`: (held-out indices, training order) already made (`order.sweep_split`: prep's planned order);
    None splits here with `split_heldout`. The held-out indices are the samples that pick each size's best
    checkpoint and stop it: stage 5 passes the selection side only (`split.split_selection`), so the side
    stage 6 scores never chose what it scores.
    """
    output_dir = Path(output_dir)
    if datasets is None:
        datasets = [str(samples[index].get("dataset", "")) for index in range(len(samples))]
    elif len(datasets) != len(samples):
        raise ValueError(f"datasets names {len(datasets)} samples but there are {len(samples)}")
    datasets = [str(name) for name in datasets]
    heldout_indices, train_order = split or split_heldout(datasets, heldout_size, split_seed, conversations)
    subsets = nested_subsets(train_order, sizes)
    heldout = IndexedSubset(samples, heldout_indices)
    # One target argmax per sample for the whole sweep: the held-out set and the nested subsets recur in every size.
    target_cache = target_cache or TargetArgmaxCache(target_lm_head)
    rows = []
    for size, indices in subsets.items():
        result = train_draft(build_model(), target_lm_head, IndexedSubset(samples, indices), heldout, output_dir / f"size-{size:07d}", settings,
                             target_cache=target_cache)
        per_dataset: dict[str, int] = {}
        for index in indices:
            per_dataset[datasets[index]] = per_dataset.get(datasets[index], 0) + 1
        rows.append({
            "size": size, "samples_by_dataset": per_dataset, "schedule": settings.schedule, "steps": result.steps,
            "step_cap": result.step_cap, "samples_seen": result.samples_seen, "epochs": result.samples_seen / size,
            "best_step": result.best_step, "best_accept_length": result.best_accept_length,
            "converged": result.converged, "stopped": result.stopped, "improved_step": result.improved_step,
            **recent_gain(result.metrics_path, settings.patience),
            "best_checkpoint": str(result.best_checkpoint), "metrics_path": str(result.metrics_path), "heldout_size": len(heldout_indices),
        })
    return rows
