"""Break-even accept length and the speculative speedup (Leviathan et al. 2023) from measured timings.

Accept length tau follows DESIGN.md: tokens emitted per target verification step, bonus included.

Break-even (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding"):
with i.i.d. acceptance rate a, draft length g and cost ratio c = T_draft / T_target,

    speedup = (1 - a^(g+1)) / ((1 - a) (g c + 1)),      expected tau = (1 - a^(g+1)) / (1 - a).

With a measured tau and measured timings the same model reads speedup ~ tau * T_target / T_cycle,
T_cycle = T_verify + g T_draft, so speculation pays off when tau > T_cycle / T_target.

From throughput alone (baseline tok/s B, speculative tok/s S at measured tau): a plain step takes
T_target = 1/B and one speculative cycle emits tau tokens in T_cycle = tau/S, so the break-even
accept length is tau * B / S. The seed's case (B = 90, S = 82.3 at tau 2.1): T_target = 11.1 ms,
T_cycle = 25.5 ms, break-even tau = 2.30; the cycle costs 1.30 target steps (14.4 ms) more than a
plain step. Assumptions, stated on every result: the cycle cost does not depend on how many tokens
are accepted (verification scores all drafted tokens whatever happens), the baseline and the
speculative run share hardware, batch size, prompts and output lengths, and T_target is the
baseline's time per token. Splitting the overhead into verify and draft parts needs one more
assumption (T_verify ~ T_target, true when verification is memory-bound) and the draft length g.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
from scipy.optimize import brentq

# ----------------------------------------------------------------------------- Leviathan model


def leviathan_accept_length(acceptance_rate: float | np.ndarray, draft_length: int) -> float | np.ndarray:
    """Expected tokens per verification step, (1 - a^(g+1)) / (1 - a); equals g + 1 at a = 1."""
    a = np.asarray(acceptance_rate, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        tau = np.where(a < 1.0, (1.0 - a ** (draft_length + 1)) / (1.0 - np.where(a < 1.0, a, 0.0)), draft_length + 1.0)
    return float(tau) if tau.ndim == 0 else tau


def acceptance_rate_for_accept_length(accept_length: float, draft_length: int) -> float:
    """Invert the Leviathan tau(a) for a chain of g steps; tau must lie in [1, g + 1]."""
    if not 1.0 <= accept_length <= draft_length + 1.0:
        raise ValueError(f"accept length {accept_length} is outside [1, {draft_length + 1}] for draft length {draft_length}")
    if accept_length == draft_length + 1.0:
        return 1.0
    return float(brentq(lambda a: leviathan_accept_length(a, draft_length) - accept_length, 0.0, 1.0 - 1e-15))


@dataclass(frozen=True)
class BreakEven:
    """Break-even analysis from baseline and speculative throughput at a measured accept length."""

    baseline_tokens_per_s: float
    speculative_tokens_per_s: float
    accept_length: float
    speedup: float  # speculative / baseline throughput
    target_step_s: float  # 1 / baseline tok/s
    cycle_s: float  # one draft-and-verify cycle: accept_length / speculative tok/s
    overhead_s: float  # cycle_s - target_step_s: what speculation costs beyond a plain step
    overhead_target_steps: float  # overhead in units of a plain target step
    break_even_accept_length: float  # cycle_s / target_step_s
    draft_length: int | None = None
    cost_ratio: float | None = None  # c = T_draft / T_target, assuming T_verify = T_target
    break_even_acceptance_rate: float | None = None  # Leviathan a at which speedup = 1
    assumptions: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict:
        return asdict(self)


THROUGHPUT_ASSUMPTIONS = (
    "one draft-and-verify cycle costs the same whatever number of tokens it accepts",
    "baseline and speculative runs share hardware, batch size, prompts and output lengths",
    "a plain target step takes 1 / baseline tok/s",
)


def break_even_from_throughput(
    baseline_tokens_per_s: float,
    speculative_tokens_per_s: float,
    accept_length: float,
    draft_length: int | None = None,
) -> BreakEven:
    """Break-even accept length from baseline tok/s and speculative tok/s at a measured tau.

    With `draft_length` (g), also the implied cost ratio c (assuming verification costs one target
    step) and the Leviathan acceptance rate at which the speedup reaches 1.
    """
    if not baseline_tokens_per_s > 0 or not speculative_tokens_per_s > 0:
        raise ValueError("throughputs must be positive measured tokens per second")
    if not accept_length >= 1.0:
        raise ValueError(f"accept length counts the bonus token, so it is at least 1; got {accept_length}")
    target_step_s = 1.0 / baseline_tokens_per_s
    cycle_s = accept_length / speculative_tokens_per_s
    break_even = cycle_s / target_step_s
    assumptions = THROUGHPUT_ASSUMPTIONS
    cost_ratio = break_even_rate = None
    if draft_length is not None:
        if draft_length < 1:
            raise ValueError(f"draft_length must be >= 1, got {draft_length}")
        assumptions = assumptions + ("verification of the drafted tokens costs one plain target step (memory-bound)",)
        cost_ratio = (break_even - 1.0) / draft_length
        # Leviathan speedup = 1  <=>  tau(a) = g c + 1 = break_even; reachable only below g + 1.
        if break_even < draft_length + 1.0:
            break_even_rate = acceptance_rate_for_accept_length(max(break_even, 1.0), draft_length)
    return BreakEven(
        baseline_tokens_per_s=baseline_tokens_per_s,
        speculative_tokens_per_s=speculative_tokens_per_s,
        accept_length=accept_length,
        speedup=speculative_tokens_per_s / baseline_tokens_per_s,
        target_step_s=target_step_s,
        cycle_s=cycle_s,
        overhead_s=cycle_s - target_step_s,
        overhead_target_steps=break_even - 1.0,
        break_even_accept_length=break_even,
        draft_length=draft_length,
        cost_ratio=cost_ratio,
        break_even_acceptance_rate=break_even_rate,
        assumptions=assumptions,
    )
