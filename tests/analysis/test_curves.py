"""The curve families of tau against data size (analysis/curves.py): the row fits, prediction, crossing and
leave-one-size-out error that the scaling answer and the forecast both read."""

from __future__ import annotations

import numpy as np
import pytest

from eaglekit.analysis.curves import (
    FamilyFits,
    fit_accelerating_rows,
    fit_log_linear_rows,
    fit_saturating_rows,
    first_crossing,
    leave_one_size_out_error,
    union_interval,
)
from eaglekit.analysis.scaling import ceiling_identification, fit_scaling, local_slope

SIZES = np.array([60, 120, 240, 480, 960.0])


def saturating(sizes: np.ndarray) -> np.ndarray:
    return 1.8 - 0.45 * (sizes / 60.0) ** -0.3


def _rows(truth: np.ndarray, seed: int = 0, resamples: int = 200) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return truth[None, :] + rng.normal(0, 0.01, (resamples, 1)) + rng.normal(0, 0.01, (resamples, len(truth)))


def test_the_saturating_profile_fit_recovers_an_exact_curve():
    params = fit_saturating_rows(SIZES, saturating(SIZES)[None, :], ceiling=4.0)[0]
    assert params == pytest.approx([1.8, 0.45, 0.3], rel=0.02)  # tau_inf, gap at N_min = 60, exponent


def test_the_accelerating_family_bends_only_upward():
    x = np.log2(SIZES) - np.log2(SIZES).mean()
    convex, concave = 1.3 + 0.05 * x + 0.01 * x**2, 1.3 + 0.05 * x - 0.01 * x**2
    assert fit_accelerating_rows(SIZES, convex[None, :])[0] == pytest.approx([1.3, 0.05, 0.01])
    assert fit_accelerating_rows(SIZES, concave[None, :])[0, 2] == 0.0  # a bending curve gets the line


def test_the_scaling_fit_and_the_forecast_read_one_saturating_fit():
    """One path: the ceiling test's fit and the forecast's saturating family are the same numbers, row for
    row, and the curve they draw is the same (the scaling fit once had its own scipy fit beside the
    forecast's)."""
    truth = saturating(SIZES)
    rows = _rows(truth)
    scaling = fit_scaling(SIZES, truth, replicate_accept_lengths=rows, max_accept_length=4.0)
    families = FamilyFits.fit(SIZES, rows, ceiling=4.0)
    np.testing.assert_array_equal(scaling.replicates, families.saturating)
    point = FamilyFits.fit(SIZES, truth[None, :], ceiling=4.0)
    grid = np.geomspace(60, 960, 9)
    np.testing.assert_allclose(scaling.predict(grid), point.raw(grid)["saturating"][0])
    assert ceiling_identification(SIZES, truth, rows, max_accept_length=4.0).fit.params == pytest.approx(
        point.saturating[0]
    )


def test_the_local_slope_is_the_log_linear_family():
    truth = 1.2 + 0.06 * np.log2(SIZES / 60)
    rows = _rows(truth, seed=1)
    slope = local_slope(SIZES, truth, rows)
    np.testing.assert_allclose(slope.replicate_slopes, fit_log_linear_rows(SIZES, rows)[:, 1])
    assert fit_log_linear_rows(SIZES, truth[None, :])[0] == pytest.approx([1.2 - 0.06 * np.log2(60), 0.06])


def test_prediction_is_held_between_the_last_measured_tau_and_the_ceiling():
    falling = np.array([1.5, 1.45, 1.4, 1.35, 1.3])  # a fit that would predict below the largest draft
    steep = 1.0 + 0.4 * np.log2(
        SIZES / 60
    )  # 2.6 at 960, a line that would pass the chain's ceiling of 3 by 7,680
    for taus in (falling, steep):
        ahead = FamilyFits.fit(SIZES, taus[None, :], ceiling=3.0).at([7680.0])
        for curve in ahead.values():
            assert taus[-1] - 1e-12 <= curve[0, 0] <= 3.0 + 1e-12
    assert FamilyFits.fit(SIZES, steep[None, :], ceiling=3.0).at([7680.0])["log-linear"][0, 0] == 3.0


def test_union_interval_and_first_crossing():
    curves = {"low": np.array([[1.0, 2.0], [1.2, 2.2]]), "high": np.array([[1.5, 2.5], [1.7, 2.7]])}
    low, high = union_interval(curves, 0.0, 0.0)
    assert low.tolist() == [1.0, 2.0] and high.tolist() == [1.7, 2.7]
    grid = np.array([100.0, 200.0, 400.0])
    rows = np.array([[1.0, 1.5, 2.0], [1.0, 1.1, 1.2], [2.5, 2.6, 2.7]])
    assert first_crossing(grid, rows, 1.5).tolist() == [200.0, np.inf, 100.0]


def test_leave_one_size_out_error_predicts_each_size_from_the_others():
    taus = saturating(SIZES)
    manual = []
    for left_out in range(len(SIZES)):
        keep = np.arange(len(SIZES)) != left_out
        intercept, slope = fit_log_linear_rows(SIZES[keep], taus[keep][None, :])[0]
        manual.append(intercept + slope * np.log2(SIZES[left_out]) - taus[left_out])
    assert leave_one_size_out_error(SIZES, taus, "log-linear") == pytest.approx(
        float(np.sqrt(np.mean(np.square(manual))))
    )
    assert (
        leave_one_size_out_error(SIZES, taus, "saturating", ceiling=4.0) < 1e-3
    )  # the true shape predicts what it left out
    assert (
        leave_one_size_out_error(SIZES[:4], taus[:4], "saturating") is None
    )  # 3 left to fit 3 parameters: nothing tested
