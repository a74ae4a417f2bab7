"""When a draft stops training: the progress it has made and the stopping rule, as pure functions.

until_converged trains until held-out tau has not improved by `min_improvement` for `patience`
evaluations, with `max_steps` as a cap; the best checkpoint by held-out tau is kept. Improvement is judged
on the mean of the last `smoothing_evaluations` taus, not on one: on a small held-out set one tau moves
by several hundredths between evaluations, so a lucky one set a reference the next could not beat and
stopped rising drafts (docs/recipe_ablation.md). A draft stopped by the cap was still improving and its
tau is a lower bound (`stopped` "step_cap"). By default the stop becomes an anneal (warmup-stable-decay):
once patience runs out at step S the learning rate falls by a cosine over `anneal_length` steps
(eaglekit.training.schedule), and training stops at the first evaluation after it ends (still
"converged"). The length is a function of S and the settings, so a run resumed mid-anneal keeps it.

The functions take a `TrainProgress` and return a new one (checkpoints hold its dict form,
`TrainProgress.to_dict`; `TrainProgress.from_dict` reads it back). `training`: the params section (a
`TrainSettings` reads as its params and does too).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from eaglekit.config import TrainingParams
from eaglekit.training.schedule import anneal_length
from eaglekit.training.settings import TrainSettings

Rule = TrainingParams | TrainSettings


@dataclass
class TrainProgress:
    """A draft's training state, checkpointed as a dict of floats, ints and None (`to_dict`).

    improved_step / reference_accept_length: the last evaluation whose smoothed tau beat the previous
    reference by min_improvement (patience counts from it); best_*: the plain maximum (the kept checkpoint);
    recent_accept_lengths: the taus the smoothed one averages; decay_start: the step until_converged's
    anneal began, None before; stopped: "converged", "step_cap" or None (still training, or interrupted).
    """

    step: int = 0
    samples_seen: int = 0
    best_accept_length: float = -math.inf
    best_step: int = -1
    improved_step: int = 0
    reference_accept_length: float = -math.inf
    recent_accept_lengths: list[float] = field(default_factory=list)
    smoothed_accept_length: float = -math.inf
    decay_start: int | None = None
    stopped: str | None = None

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> "TrainProgress":
        """From a checkpoint's "progress" (older checkpoints lack later keys: they take the defaults)."""
        known = {item.name for item in dataclasses.fields(cls)}
        return cls(**{name: value for name, value in state.items() if name in known})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def plateaued(state: TrainProgress, training: Rule) -> bool:
    """until_converged: `patience` evaluations passed without an improvement."""
    return training.schedule == "until_converged" and state.step - state.improved_step >= training.patience * training.eval_interval


def should_stop(state: TrainProgress, training: Rule, total_steps: int) -> str | None:
    """After an evaluation: "converged" when `patience` evaluations passed without an improvement (with an
    anneal: when the anneal that then started has ended), "step_cap" at the last step, else None.
    Pure (a function of the saved progress), so resume agrees."""
    anneal = lambda start: anneal_length(training.decay_steps, training.decay_fraction, start)  # noqa: E731
    if state.decay_start is not None and state.step >= state.decay_start + anneal(state.decay_start):
        return "converged"
    if state.decay_start is None and anneal(state.step) == 0 and plateaued(state, training):
        return "converged"
    if state.step >= total_steps:
        return "step_cap"
    return None


def record_evaluation(state: TrainProgress, accept_length: float, training: Rule,
                      total_steps: int) -> TrainProgress:
    """The training state after the held-out evaluation at state.step scored `accept_length`. Pure.

    best_accept_length/best_step: the plain maximum (the checkpoint kept). Stopping looks at the smoothed
    tau, the mean of the last `smoothing_evaluations` taus: an improvement is a smoothed tau above the
    reference (the smoothed tau of the last improvement) by more than min_improvement; `should_stop`
    counts patience from the last one. A lucky evaluation lifts the mean by a fraction of its luck instead
    of fixing a reference the next ones cannot reach, and an unlucky one no longer reads as a plateau.
    With an anneal (`anneal_length` > 0), the first plateau starts it (decay_start) instead of stopping.
    `state` is left as it was: the result is a new TrainProgress.
    """
    recent = (list(state.recent_accept_lengths) + [accept_length])[-training.smoothing_evaluations :]
    updated = dataclasses.replace(state, recent_accept_lengths=recent, smoothed_accept_length=sum(recent) / len(recent))
    if accept_length > state.best_accept_length:
        updated.best_accept_length, updated.best_step = accept_length, state.step
    if updated.smoothed_accept_length > state.reference_accept_length + training.min_improvement or state.step == 0:
        updated.reference_accept_length, updated.improved_step = updated.smoothed_accept_length, state.step
    if (updated.decay_start is None and anneal_length(training.decay_steps, training.decay_fraction, state.step)
            and plateaued(updated, training)):
        updated.decay_start = state.step  # converged at the peak: anneal from here, then stop
    updated.stopped = should_stop(updated, training, total_steps)
    return updated


def anneal_note(state: TrainProgress, training: Rule, total_steps: int) -> str:
    """The held-out log line's note at the evaluation that starts the anneal ("" at any other), saying
    when a step cap will cut it (the draft then ends "step_cap", a lower bound)."""
    if state.stopped or state.decay_start is None or state.decay_start != state.step:
        return ""
    end = state.decay_start + anneal_length(training.decay_steps, training.decay_fraction, state.decay_start)
    cut = f", past the step cap {total_steps}: raise max_steps or it ends capped mid-anneal" if end > total_steps else ""
    return f": converged at the peak, annealing the lr until step {end}{cut}"
