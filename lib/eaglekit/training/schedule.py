"""The learning rate as a pure function of the step: linear warmup, then a cosine (or the peak held).

equal_steps and equal_epochs decay over all their steps. until_converged holds the peak after warmup
(a cosine over the cap would make the stopping point, and tau, depend on the cap, since the decay itself
ends the gains) until its anneal starts at the step S it converged (eaglekit.training.stopping), then
decays over the anneal's length (`anneal_length`). The scheduler state is the step number, so a resumed
run recomputes the same rate.
"""

from __future__ import annotations

import math

from eaglekit.config import TrainingParams


def anneal_length(decay_steps: int | None, decay_fraction: float, decay_start: int) -> int:
    """Steps of until_converged's anneal after converging at step `decay_start`: decay_steps if set, else
    decay_fraction x the steps taken to converge, round(decay_fraction * decay_start), at least 1 when the
    fraction is > 0. 0: no anneal (stop at convergence). Pure."""
    if decay_steps is not None:
        return decay_steps
    return max(1, round(decay_fraction * decay_start)) if decay_fraction > 0 else 0


def learning_rate_at(step: int, max_learning_rate: float, min_learning_rate: float, warmup_steps: int, total_steps: int | None,
                     decay_start: int | None = None) -> float:
    """Linear warmup to the peak, then cosine down to the floor at `total_steps`; with total_steps None
    (until_converged: no known length) the peak holds after warmup. The cosine starts at `decay_start`
    (default: the end of warmup; until_converged's anneal starts where it converged). Pure."""
    if step < warmup_steps:
        return max_learning_rate * (step + 1) / (warmup_steps + 1)
    if total_steps is None:
        return max_learning_rate
    if step >= total_steps:
        return min_learning_rate
    start = warmup_steps if decay_start is None else max(decay_start, warmup_steps)
    progress = max(0, step - start) / max(1, total_steps - start)
    return min_learning_rate + 0.5 * (1.0 + math.cos(math.pi * progress)) * (max_learning_rate - min_learning_rate)


def decay_window(training: TrainingParams, decay_start: int | None, total_steps: int) -> tuple[int | None, int | None]:
    """(total_steps, decay_start) for learning_rate_at: equal_* decay over all their steps; until_converged
    holds the peak (the cap is no length to decay over) until its anneal starts, then decays over its
    length."""
    if training.schedule != "until_converged":
        return total_steps, None
    if decay_start is None:
        return None, None
    return decay_start + anneal_length(training.decay_steps, training.decay_fraction, decay_start), decay_start


def step_learning_rate(step: int, training: TrainingParams, decay_start: int | None, total_steps: int) -> float:
    """The learning rate of optimizer step `step` under the params' schedule. Pure."""
    return learning_rate_at(step, training.learning_rate, training.min_learning_rate, training.warmup_steps,
                            *decay_window(training, decay_start, total_steps))
