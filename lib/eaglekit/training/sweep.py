"""The data-size sweep: one draft per size on nested, dataset-stratified subsets, one held-out set for all,
and its progress in the log (`SweepProgress`: draft i of n, the sweep's time left)."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from eaglekit.draft.model import Eagle3DraftModel
from eaglekit.io import format_duration
from eaglekit.training.distributed import launched_world
from eaglekit.training.loop import TrainResult, train_draft
from eaglekit.training.metrics import recent_gain
from eaglekit.training.settings import TrainSettings
from eaglekit.training.split import IndexedSubset, nested_subsets, split_heldout
from eaglekit.training.teacher import TargetArgmaxCache

logger = logging.getLogger(__name__)


class SweepProgress:
    """'draft i of n' before each draft of a sweep trains, with the sweep's time left, and a line when it
    ends.

    drafts: (label, step cap) of every draft the sweep will train, in order (stage 5: the sizes, the extra
    seeds, the ablation). The time left is the remaining drafts' step caps at the seconds a step took so far
    (training and held-out evaluations, over the steps this process ran, so a resumed draft counts only what
    it ran): under until_converged a draft stops at its cap at the latest, so it is an upper bound ("at
    most"); before any step was timed it is "not yet known"."""

    def __init__(self, drafts: Sequence[tuple[str, int]], until_converged: bool, log: Callable[..., None] | None = None):
        self.drafts = list(drafts)
        self.until_converged = until_converged
        # one rank says it
        self.log = log or (logger.info if launched_world()[0] == 0 else (lambda *args: None))
        self.started_drafts = 0
        self.timed_steps = 0
        self.timed_seconds = 0.0
        self._draft_started: float | None = None
        self._label = ""

    def time_left(self) -> str:
        """The remaining drafts' time, from the next one to start on, as the log says it."""
        steps = sum(cap for _, cap in self.drafts[self.started_drafts:])
        if not self.timed_steps:
            return f"not yet known ({steps} steps at the step caps, none timed yet)"
        seconds = steps * self.timed_seconds / self.timed_steps
        bound = "at most " if self.until_converged else "about "
        return f"{bound}{format_duration(seconds)} ({steps} steps at {self.timed_seconds / self.timed_steps:.3g} s a step)"

    def start(self, label: str) -> None:
        total = max(len(self.drafts), self.started_drafts + 1)
        self.log("stage 5: draft %d of %d, %s; the sweep's time left %s", self.started_drafts + 1, total, label, self.time_left())
        self.started_drafts += 1
        self._draft_started, self._label = time.perf_counter(), label

    def finish(self, result: TrainResult) -> None:
        """The line for the draft `start` began."""
        seconds = time.perf_counter() - (self._draft_started or time.perf_counter())
        ran = result.steps - result.resumed_step
        if ran > 0:
            self.timed_steps += ran
            self.timed_seconds += seconds
        how = result.stopped or "stopped by stop_at_step"
        resumed = f", resumed at step {result.resumed_step}" if result.resumed_step else ""
        self.log("stage 5: draft %d of %d, %s, done: %d steps in %s%s, best held-out tau %.4f at step %d (%s)", self.started_drafts,
                 max(len(self.drafts), self.started_drafts), self._label, result.steps, format_duration(seconds), resumed,
                 result.best_accept_length, result.best_step, how)


def train_size_sweep(
    build_model: Callable[[], Eagle3DraftModel],
    target_lm_head: torch.Tensor,
    samples: Sequence[dict],
    sizes: Sequence[int],
    heldout_size: int,
    output_dir: str | Path,
    settings: TrainSettings,
    datasets: Sequence[str] | None = None,
    target_cache: TargetArgmaxCache | None = None,
    split: tuple[Sequence[int], Sequence[int]] | None = None,
    progress: SweepProgress | None = None,
    label: str = "",
) -> list[dict[str, Any]]:
    """One draft per data size on nested, dataset-stratified subsets, all scored on one held-out set.

    build_model() returns a fresh draft (same init each call). Each size trains into
    output_dir/size-<n>/ and resumes there. Returns one row per size: size, per-dataset counts, the
    schedule, steps used and the step cap, samples seen (and epochs), best step, best held-out simulated
    accept length, whether it converged and why it stopped, the last improvement (`recent_gain`: held-out
    tau gained over the last `patience` evaluations), checkpoint and metrics paths, held-out size.
    `datasets` (one name per sample) spares reading every sample just for its dataset name.
    `target_cache`: a cache the caller shares with other drafts on the same samples (None: one for this
    sweep).
    `split`: (held-out indices, training order) already made (`order.sweep_split`: prep's planned order);
    None splits here with `split_heldout` (seed 0, every sample its own conversation). The held-out
    indices are the samples that pick each size's best checkpoint and stop it: stage 5 passes the
    selection side only (`split.split_selection`), so the side stage 6 scores never chose what it scores.
    `progress`: the log's 'draft i of n' over a longer plan (stage 5's sizes, seeds and ablation); None, over
    these sizes. `label` follows each size's name in it (", seed 1").
    """
    output_dir = Path(output_dir)
    if datasets is None:
        datasets = [str(samples[index].get("dataset", "")) for index in range(len(samples))]
    elif len(datasets) != len(samples):
        raise ValueError(f"datasets names {len(datasets)} samples but there are {len(samples)}")
    datasets = [str(name) for name in datasets]
    heldout_indices, train_order = split or split_heldout(datasets, heldout_size, 0)
    subsets = nested_subsets(train_order, sizes)
    heldout = IndexedSubset(samples, heldout_indices)
    # One target argmax per sample for the whole sweep: the held-out set and the nested subsets recur in every
    # size.
    target_cache = target_cache or TargetArgmaxCache(target_lm_head)
    if progress is None:
        progress = SweepProgress([(f"size {size}{label}", settings.resolved_max_steps(size, launched_world()[1]))
                                  for size in subsets], settings.training.schedule == "until_converged")
    rows = []
    for size, indices in subsets.items():
        progress.start(f"size {size}{label}")
        result = train_draft(build_model(), target_lm_head, IndexedSubset(samples, indices), heldout, output_dir / f"size-{size:07d}",
                             settings, target_cache=target_cache)
        progress.finish(result)
        rows.append(result_row(result, dict(Counter(datasets[index] for index in indices)), settings, len(heldout_indices)))
    return rows


def result_row(result: TrainResult, samples_by_dataset: dict[str, int], settings: TrainSettings, heldout_size: int) -> dict[str, Any]:
    """A trained draft as one sweep row (what `record.DraftEntry.from_sweep_row` reads): its training samples
    by dataset, how long it trained and how it stopped, its best held-out tau and `heldout_size` (the samples
    that picked it), the last improvement (`recent_gain` over the last `patience` evaluations), checkpoint and
    metrics."""
    size = sum(samples_by_dataset.values())
    return {
        "size": size, "samples_by_dataset": dict(samples_by_dataset), "schedule": settings.schedule, "steps": result.steps,
        "step_cap": result.step_cap, "samples_seen": result.samples_seen, "epochs": result.samples_seen / size,
        "best_step": result.best_step, "best_accept_length": result.best_accept_length,
        "converged": result.converged, "stopped": result.stopped, "improved_step": result.improved_step,
        **recent_gain(result.metrics_path, settings.patience),
        "best_checkpoint": str(result.best_checkpoint), "metrics_path": str(result.metrics_path), "heldout_size": heldout_size,
    }
