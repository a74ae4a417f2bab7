"""Break-even arithmetic (Leviathan et al. 2023): speedup and break-even tau from timings and throughput."""

from __future__ import annotations

import pytest

from eaglekit.analysis.break_even import (
    acceptance_rate_for_accept_length,
    break_even_from_throughput,
    leviathan_accept_length,
)


def test_leviathan_formula_by_hand_and_limits():
    assert leviathan_accept_length(0.5, 3) == pytest.approx(0.9375 / 0.5)  # (1 - 0.5^4) / (1 - 0.5)
    assert leviathan_accept_length(1.0, 4) == 5.0  # every draft accepted: g + 1 tokens
    assert leviathan_accept_length(0.0, 4) == 1.0  # only the bonus token
    for tau in (1.0, 1.7, 2.9, 4.0):
        assert leviathan_accept_length(acceptance_rate_for_accept_length(tau, 3), 3) == pytest.approx(tau)
    with pytest.raises(ValueError, match="outside"):
        acceptance_rate_for_accept_length(4.5, 3)


def test_seed_case_90_tok_s_baseline_82_3_at_tau_2_1():
    result = break_even_from_throughput(90.0, 82.3, 2.1)
    assert result.speedup == pytest.approx(82.3 / 90)
    assert result.target_step_s == pytest.approx(1 / 90)  # 11.1 ms
    assert result.cycle_s == pytest.approx(2.1 / 82.3)  # 25.5 ms per draft-and-verify cycle
    assert result.break_even_accept_length == pytest.approx(2.1 * 90 / 82.3)  # 2.2965
    assert round(result.break_even_accept_length, 2) == 2.30
    assert result.overhead_s * 1000 == pytest.approx(14.405, abs=1e-3)
    assert result.overhead_target_steps == pytest.approx(1.2965, abs=1e-4)
    assert len(result.assumptions) == 3

    # With a chain of 3 steps: c = (2.2965 - 1) / 3, and the Leviathan speedup at the break-even
    # acceptance rate, (1 - a^(g+1)) / ((1 - a)(g c + 1)), is exactly 1.
    chain = break_even_from_throughput(90.0, 82.3, 2.1, draft_length=3)
    assert chain.cost_ratio == pytest.approx((chain.break_even_accept_length - 1) / 3)
    speedup = leviathan_accept_length(chain.break_even_acceptance_rate, 3) / (3 * chain.cost_ratio + 1.0)
    assert speedup == pytest.approx(1.0)
    assert "memory-bound" in chain.assumptions[-1]
