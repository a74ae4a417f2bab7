"""The saturating scaling fit with bootstrap, the local slope and ceiling identification, and the scaling
curve's figure."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from eaglekit.analysis.acceptance import acceptance_tables, bootstrap_accept_length, chain_counts
from eaglekit.analysis.break_even import break_even_from_throughput
from eaglekit.analysis.plots import plot_accept_length_vs_data_size
from eaglekit.analysis.curves import leave_one_size_out_error
from eaglekit.analysis.scaling import fit_scaling


def saturating_accept_length(data_size, tau_inf: float, scale: float, exponent: float) -> np.ndarray:
    """A known truth: tau(N) = tau_inf - scale * N^(-exponent)."""
    return tau_inf - scale * np.asarray(data_size, dtype=np.float64) ** (-exponent)


def _synthetic_sizes_and_counts(rng: np.random.Generator):
    """Drafts trained on growing data: per-step acceptance a(N) rises and saturates; k = 4."""
    sizes = np.array([1_000, 3_000, 10_000, 30_000, 100_000, 300_000])
    rates = 0.75 - 0.55 * (sizes / 1_000) ** -0.5  # 0.20 .. 0.72
    counts = []
    for rate in rates:
        samples = [rng.random((int(rng.integers(30, 80)), 4)) < rate for _ in range(60)]
        counts.append(chain_counts(samples))
    return sizes, counts


def test_fit_recovers_a_saturating_curve_from_per_sample_bootstrap():
    rng = np.random.default_rng(0)
    true = (2.6, 40.0, 0.6)
    sizes = np.array([500, 2_000, 8_000, 32_000, 128_000])
    taus = saturating_accept_length(sizes, *true) + rng.normal(0, 0.01, size=len(sizes))
    replicates = saturating_accept_length(sizes, *true)[None, :] + rng.normal(0, 0.03, size=(300, len(sizes)))
    fit = fit_scaling(sizes, taus, replicate_accept_lengths=replicates, max_accept_length=4.0)
    assert fit.bootstrap_method == "per-sample"
    assert fit.tau_inf == pytest.approx(2.6, abs=0.1)
    assert fit.exponent == pytest.approx(0.6, abs=0.2)
    low, high = fit.ceiling_interval()
    assert low < fit.tau_inf < high
    assert fit.predict(sizes) == pytest.approx(
        saturating_accept_length(sizes, fit.tau_inf, fit.scale, fit.exponent)
    )
    band_low, band_high = fit.predict_band(np.array([1e6]))
    assert band_low[0] < fit.predict(1e6)[0] < band_high[0]


def test_end_to_end_from_agreement_arrays_with_paired_resamples(tmp_path):
    rng = np.random.default_rng(1)
    sizes, counts = _synthetic_sizes_and_counts(rng)
    from eaglekit.analysis.acceptance import pooled_accept_length

    taus = np.array([pooled_accept_length(c) for c in counts])
    assert np.all(np.diff(taus) > 0)
    # Same seed for every size: the same held-out sample indices are drawn in each replicate.
    replicates = np.column_stack([bootstrap_accept_length(c, 200, seed=42).pooled_tau for c in counts])
    fit = fit_scaling(sizes, taus, replicate_accept_lengths=replicates, max_accept_length=5.0)
    assert 1.0 <= fit.tau_inf <= 5.0
    assert np.abs(fit.residuals).max() < 0.1

    break_even = break_even_from_throughput(90.0, 82.3, 2.1, draft_length=4)
    record = fit.to_dict()
    assert record["bootstrap_method"] == "per-sample" and record["bootstrap_replicates"] == 200
    assert record["tau_inf_low"] <= record["tau_inf"] <= record["tau_inf_high"]

    points = pd.DataFrame(
        {
            "data_size": sizes,
            "dataset": "all",
            "topology": "chain",
            "steps": 4,
            "tau_pooled": taus,
            "tau_pooled_low": np.percentile(replicates, 2.5, axis=0),
            "tau_pooled_high": np.percentile(replicates, 97.5, axis=0),
        }
    )
    figure = plot_accept_length_vs_data_size(
        points, fit, break_even_accept_length=break_even.break_even_accept_length, target_accept_length=3.0
    )
    axes = figure.axes[0]
    assert axes.get_xscale() == "log"
    assert "chain, 4 steps" in axes.get_ylabel()
    labels = [line.get_label() for line in axes.get_lines()]
    assert any(label.startswith("break-even tau = 2.30") for label in labels)
    assert any(label.startswith("fit (ceiling identified):") for label in labels)
    figure.savefig(tmp_path / "scaling.png")
    assert (tmp_path / "scaling.png").stat().st_size > 10_000


def test_plot_draws_each_dataset_from_acceptance_tables():
    rng = np.random.default_rng(2)
    frames = []
    for size, rate in ((1_000, 0.3), (10_000, 0.5), (100_000, 0.6)):
        by_dataset = {
            name: [rng.random((30, 3)) < rate + shift for _ in range(20)]
            for name, shift in (("chat", 0.05), ("code", -0.05))
        }
        summary, _ = acceptance_tables(by_dataset, num_resamples=100, seed=0)
        frames.append(summary.assign(data_size=size))
    figure = plot_accept_length_vs_data_size(pd.concat(frames), break_even_accept_length=2.3)
    labels = {line.get_label() for line in figure.axes[0].get_lines()}
    assert {"chat", "code", "all"} <= labels


def test_input_checks():
    sizes = [1_000, 3_000, 10_000, 30_000, 100_000]
    taus = saturating_accept_length(np.array(sizes), 2.2, 8.0, 0.5) + np.array(
        [0.01, -0.02, 0.015, -0.01, 0.005]
    )
    with pytest.raises(ValueError, match="at least 3 distinct"):
        fit_scaling([1_000, 1_000, 2_000], [1.2, 1.3, 1.4], np.ones((10, 3)))
    with pytest.raises(ValueError, match=r"\(R, 5\)"):
        fit_scaling(sizes, taus, replicate_accept_lengths=np.ones((10, 4)))


def test_tau_inf_respects_the_topology_ceiling():
    sizes = np.array([1e3, 1e4, 1e5, 1e6])
    taus = np.array([2.0, 2.6, 2.9, 2.99])  # a chain of 2 steps can never exceed 3
    replicates = taus + np.random.default_rng(0).normal(0.0, 0.05, (50, 4))  # some rows above the ceiling
    assert (replicates > 3.0).any()
    fit = fit_scaling(sizes, taus, replicates, max_accept_length=3.0)
    assert fit.tau_inf <= 3.0 + 1e-9
    assert (fit.replicates[:, 0] <= 3.0 + 1e-9).all()
    assert math.isfinite(fit.scale)


# ----------------------------------------------------------------------------- slope and identification
from eaglekit.analysis.scaling import ceiling_identification, local_slope, scaling_answer  # noqa: E402


def _paired_replicates(
    truth: np.ndarray, rng: np.random.Generator, resamples: int = 300, shared: float = 0.01, own: float = 0.01
) -> np.ndarray:
    """(R, n) replicates around the true curve: a shift common to all sizes (the same resampled held-out
    samples score every draft) plus noise of each size's own."""
    return (
        truth[None, :] + rng.normal(0, shared, (resamples, 1)) + rng.normal(0, own, (resamples, len(truth)))
    )


def test_local_slope_recovers_a_known_slope_per_doubling_and_counts_doublings():
    rng = np.random.default_rng(5)
    sizes = np.array([20, 40, 80, 160, 320.0])
    truth = 1.1 + 0.06 * np.log2(sizes / 20)
    slope = local_slope(sizes, truth, _paired_replicates(truth, rng), lower_bound_sizes=[320.0])
    assert slope.slope == pytest.approx(0.06) and slope.last_segment == pytest.approx(0.06)
    assert slope.slope_low < 0.06 < slope.slope_high and slope.positive_fraction == 1.0
    assert slope.doublings_measured == pytest.approx(4.0)
    point, low, high = slope.doublings_to(1.1 + 0.06 * 4 + 0.3)  # 0.3 above the largest: 5 doublings
    assert point == pytest.approx(5.0) and low < 5.0 < high
    text = slope.doublings_statement(1.34 + 0.12, "break-even")  # 2 doublings at +0.06
    assert (
        "2.0 more doublings" in text and "4x the largest" in text and "lower bound on the data needed" in text
    )
    assert "320 samples were still improving" in slope.statement()
    assert slope.doublings_to(1.0) == (0.0, 0.0, 0.0)
    for far in (
        slope.doublings_statement(1.64, "break-even"),
        slope.doublings_statement(1.34 + 0.06 * 25, "break-even"),
    ):  # 5, 25
        assert (
            "more than 3 doublings" in far
            and "no count is given" in far
            and "5.0" not in far
            and "25" not in far
        )
    flat = local_slope(sizes, np.full(5, 1.2), _paired_replicates(np.full(5, 1.2), rng))
    assert flat.slope == pytest.approx(0.0, abs=1e-12) and flat.doublings_to(2.0)[0] == math.inf
    assert "not shown to get there" in flat.doublings_statement(2.0)
    with pytest.raises(ValueError, match=r"\(R, 5\)"):
        local_slope(sizes, truth, np.ones((10, 3)))


def test_a_saturating_curve_that_reaches_its_plateau_is_identified_and_recovered():
    rng = np.random.default_rng(0)
    sizes = np.array([100, 200, 400, 800, 1600, 3200, 6400, 12800.0])
    true = (2.6, 1.2 * 100**0.6, 0.6)
    truth = saturating_accept_length(sizes, *true)
    observed = truth + rng.normal(0, 0.005, len(sizes))
    result = ceiling_identification(sizes, observed, _paired_replicates(truth, rng), max_accept_length=4.0)
    assert result.identified, result.reasons
    assert (
        result.chosen_model == "saturating"
        and result.loo_error["saturating"] < result.loo_error["log-linear"]
    )
    assert result.fit.tau_inf == pytest.approx(2.6, abs=0.05) and result.fit.exponent == pytest.approx(
        0.6, abs=0.15
    )
    low, high = result.fit.ceiling_interval()
    assert low < 2.6 < high and high < 4.0
    assert "The ceiling is identified: tau_inf = 2.6" in result.statement()


def test_three_sizes_and_a_three_parameter_curve_are_not_identified():
    """The issue's 60 / 240 / 960 case: the curve passes exactly through the points."""
    rng = np.random.default_rng(1)
    sizes = np.array([60, 240, 960.0])
    truth = np.array([1.34, 1.46, 1.54])
    answer = scaling_answer(
        sizes, truth, _paired_replicates(truth, rng), 4.0, targets=[("break-even", 2.07)]
    ).to_dict()
    assert not answer["ceiling"]["identified"]
    assert "3 data sizes for a 3-parameter curve" in answer["ceiling"]["statement"]
    assert "No ceiling and no data-size forecast" in answer["ceiling"]["statement"]
    assert answer["ceiling"]["loo_rmse"] == {"log-linear": None, "saturating": None}
    assert "too few sizes to choose a model" in answer["ceiling"]["statement"]
    assert (
        "not evaluable" not in answer["ceiling"]["statement"]
    )  # no model is "chosen" when none could be tested
    # Data needed only as doublings at the measured slope: (2.07 - 1.54) / 0.05 = 10.6.
    needed = answer["doublings_needed"][0]
    assert needed["doublings"] == pytest.approx((2.07 - 1.54) / 0.05, rel=1e-6)
    assert (
        "more than 3 doublings of data at the measured slope" in needed["statement"]
    )  # 10.6: past what 3 sizes speak for
    assert "samples to" not in " ".join(answer["statements"])  # no point estimate of a data size anywhere


def test_a_curve_far_from_its_ceiling_is_not_identified():
    """True tau_inf 3.9 with exponent 0.05: over 20-640 samples the curve is a straight line in log N,
    and the bootstrap refits run to the chain's bound."""
    rng = np.random.default_rng(2)
    sizes = np.array([20, 40, 80, 160, 320, 640.0])
    truth = saturating_accept_length(sizes, 3.9, 3.0, 0.05)
    result = ceiling_identification(
        sizes, truth + rng.normal(0, 0.005, len(sizes)), _paired_replicates(truth, rng), max_accept_length=4.0
    )
    assert not result.identified
    assert any("at the bound 4" in reason for reason in result.reasons)
    assert "not identified" in result.statement()


def test_four_sizes_cannot_test_the_curve_on_a_left_out_size():
    sizes = np.array([1e3, 1e4, 1e5, 1e6])
    truth = saturating_accept_length(sizes, 2.5, 30.0, 0.5)
    result = ceiling_identification(
        sizes, truth, _paired_replicates(truth, np.random.default_rng(3)), max_accept_length=4.0
    )
    assert not result.identified and any(
        "cannot be tested on a left-out size" in reason for reason in result.reasons
    )
    assert leave_one_size_out_error(sizes, truth, "saturating") is None
    assert leave_one_size_out_error(sizes, truth, "log-linear") > 0
    assert "the model chosen by leave-one-size-out error is log-linear (log-linear 0." in result.statement()


def test_plot_marks_lower_bounds_and_draws_slope_and_benchmark(tmp_path):
    rng = np.random.default_rng(4)
    sizes = np.array([20, 40, 80.0])
    truth = np.array([1.05, 1.12, 1.16])
    points = pd.DataFrame(
        {
            "data_size": sizes,
            "dataset": "all",
            "tau_pooled": truth,
            "tau_pooled_low": truth - 0.03,
            "tau_pooled_high": truth + 0.03,
            "lower_bound": [False, False, True],
        }
    )
    slope = local_slope(sizes, truth, _paired_replicates(truth, rng))
    benchmark = pd.DataFrame(
        {"data_size": sizes, "tau": truth + 0.1, "tau_low": truth + 0.05, "tau_high": truth + 0.15}
    )
    figure = plot_accept_length_vs_data_size(points, slope=slope, benchmark=benchmark)
    axes = figure.axes[0]
    lines = {line.get_label(): line for line in axes.get_lines()}
    bounded = lines["still improving: tau is a lower bound"]
    assert list(bounded.get_xdata()) == [80.0] and bounded.get_markerfacecolor() == "white"
    converged = lines["converged, stopped by patience (2 of 3 sizes)"]  # filled, and said in the legend
    assert list(converged.get_xdata()) == [20.0, 40.0] and converged.get_markerfacecolor() != "white"
    legend = axes.get_legend()
    assert (
        legend.get_bbox_to_anchor().x0 > axes.get_window_extent().x1 - 1
    )  # beside the plot, not over the curves
    assert any(label.startswith("slope +0.055/doubling") for label in lines)
    assert list(lines["benchmark prompts (real loop)"].get_ydata()) == pytest.approx(truth + 0.1)
    assert len(axes.texts) == 1  # one upward arrow, on the bounded point
    figure.savefig(tmp_path / "bounds.png")
