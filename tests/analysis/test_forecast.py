"""The go / no-go forecast on synthetic curves of known truth: interval coverage and the wording.

Synthetic held-out data: m samples, each scored by every size's draft (paired), per-sample tau =
truth(N) + u_i (the sample's difficulty, shared by every size) + e_iN (independent), the noise sized to the
kit's ShareGPT measurements (interval half-widths 0.05-0.08 on 80 samples). The truth at a size is truth(N),
what the interval claims to cover.

Coverage tolerance: 200 simulated experiments give a binomial standard error of sqrt(0.95 x 0.05 / 200) =
0.015 around a true 95% rate; a percentile bootstrap of a 60-sample mean covers at about 94% (its known
O(1/m) shortfall). A rate is accepted in [0.95 - 0.06, 0.995]: 3 standard errors plus that shortfall below,
and not so wide that every experiment is covered above (an interval that always covers says nothing).
The seeds are fixed, so the test is deterministic; the measured rates are in docs/forecast.md.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from eaglekit.analysis.forecast import (Forecast, fit_saturating_rows, forecast, paired_bootstrap_means, weighted_quantiles)

TRUTHS = {
    "log-linear": lambda n: 1.2 + 0.06 * np.log2(n / 60.0),
    "saturating": lambda n: 1.8 - 0.45 * (n / 60.0) ** -0.3,
    "flat": lambda n: 1.3 + 0.0 * n,
}
THREE = [60.0, 240.0, 960.0]
FIVE = [60.0, 120.0, 240.0, 480.0, 960.0]
EXPERIMENTS = 200
RESAMPLES = 200
COVERAGE_LOW, COVERAGE_HIGH = 0.95 - 0.06, 0.995


def synthetic(truth, sizes, seed: int, samples: int = 60) -> tuple[np.ndarray, np.ndarray]:
    """(measured tau per size, (R, n) paired bootstrap replicates)."""
    rng = np.random.default_rng(seed)
    per_sample = (truth(np.asarray(sizes))[None, :] + rng.normal(0.0, 0.25, (samples, 1))
                  + rng.normal(0.0, 0.15, (samples, len(sizes))))
    return per_sample.mean(axis=0), paired_bootstrap_means(per_sample, RESAMPLES, seed + 10_000)


def coverage(truth, sizes, forecast_sizes) -> dict[float, float]:
    hits = dict.fromkeys(forecast_sizes, 0)
    for seed in range(EXPERIMENTS):
        taus, replicates = synthetic(truth, sizes, seed)
        result = forecast(sizes, taus, replicates, planned_sizes=[*sizes, *forecast_sizes[:-1]], full_size=forecast_sizes[-1],
                          break_even=2.0, max_accept_length=4.0)
        for item in result.predictions:
            if not item.measured:
                hits[item.data_size] += item.tau_low <= float(truth(np.array(item.data_size))) <= item.tau_high
    return {size: count / EXPERIMENTS for size, count in hits.items()}


@pytest.mark.parametrize("name", sorted(TRUTHS))
def test_three_sizes_intervals_cover_the_truth_at_the_stated_rate(name):
    rates = coverage(TRUTHS[name], THREE, [3840.0, 15360.0])  # 2 and 4 doublings beyond the largest
    assert all(COVERAGE_LOW <= rate <= COVERAGE_HIGH for rate in rates.values()), rates


def test_five_sizes_saturating_interval_covers_the_truth_at_the_stated_rate():
    rates = coverage(TRUTHS["saturating"], FIVE, [3840.0, 15360.0])
    assert all(COVERAGE_LOW <= rate <= COVERAGE_HIGH for rate in rates.values()), rates


def test_two_sizes_slope_interval_covers_the_true_slope():
    truth = TRUTHS["log-linear"]
    hits = 0
    for seed in range(EXPERIMENTS):
        taus, replicates = synthetic(truth, THREE[:2], seed)
        slope = forecast(THREE[:2], taus, replicates, break_even=2.0).slope
        hits += slope["slope_low"] <= 0.06 <= slope["slope_high"]
    assert COVERAGE_LOW <= hits / EXPERIMENTS <= COVERAGE_HIGH


def test_saturating_profile_fit_recovers_an_exact_curve():
    sizes = np.array(FIVE)
    params = fit_saturating_rows(sizes, TRUTHS["saturating"](sizes)[None, :], ceiling=4.0)[0]
    # tau_inf, gap at N_min = 60, exponent
    assert params == pytest.approx([1.8, 0.45, 0.3], rel=0.02)


def test_weighted_quantiles_keep_inf():
    values = np.array([1.0, 2.0, np.inf, np.inf])
    assert weighted_quantiles(values, np.ones(4), [0.25, 0.9]) == [1.0, math.inf]


# ----------------------------------------------------------------------------- wording

def _forecast(truth, sizes, break_even, seed=3, **kwargs) -> Forecast:
    taus, replicates = synthetic(truth, sizes, seed)
    return forecast(sizes, taus, replicates, planned_sizes=sizes, full_size=15360.0, break_even=break_even, max_accept_length=4.0,
                    **kwargs)


def test_flat_curve_is_a_no_go():
    result = _forecast(TRUTHS["flat"], FIVE, break_even=2.0)
    assert result.verdict == "no-go"
    assert result.line.startswith("no-go: at 15,360 samples")
    assert "below break-even 2.000 even at its upper end: not within 4.0 doublings" in result.line
    assert "from 5 sizes (60, 120, 240, 480, 960 samples)" in result.line


def test_rising_curve_is_a_go_with_its_crossing_size():
    rising = lambda n: 1.2 + 0.08 * np.log2(n / 60.0)  # 1.52 at 960, 1.84 at 15,360
    result = _forecast(rising, FIVE, break_even=1.6)
    assert result.verdict == "go", result.line
    assert result.line.startswith("go: at 15,360 samples")
    assert "above break-even 1.600 by its whole interval; it crosses break-even at about" in result.line
    assert 960 < result.crossing_size < result.crossing_high < 15360


def test_saturating_curve_below_break_even_is_a_no_go_and_says_the_gain_shrinks():
    result = _forecast(TRUTHS["saturating"], FIVE, break_even=2.2)
    assert result.verdict == "no-go", result.line
    assert "(shrinking; change -" in result.line
    assert result.model_weights["saturating"] != 0.5  # 5 sizes: weighted by leave-one-size-out error
    assert "inverse leave-one-size-out" in result.weight_rule


def test_interval_containing_break_even_is_not_yet_known():
    result = _forecast(TRUTHS["saturating"], THREE, break_even=1.78)
    assert result.verdict == "not yet known", result.line
    assert "an interval that contains break-even 1.780" in result.line
    assert result.model_weights == {"log-linear": 0.5, "saturating": 0.5}


def test_two_sizes_give_a_slope_only():
    result = _forecast(TRUTHS["log-linear"], THREE[:2], break_even=2.0)
    assert result.verdict == "not yet known"
    assert result.predictions == [] and result.crossing_size is None
    assert result.line.startswith("not yet known: from 2 sizes (60, 240 samples) only a slope: ")
    assert "at the measured slope break-even 2.000 is" in result.line and "the full data (15,360 samples) is 6.0 doublings away" in result.line
    assert "A third size is needed" in result.line


def test_two_sizes_without_a_full_size_name_the_largest_planned_size_as_the_horizon():
    taus, replicates = synthetic(TRUTHS["log-linear"], THREE[:2], 3)
    result = forecast(THREE[:2], taus, replicates, planned_sizes=THREE, full_size=None, break_even=2.0, max_accept_length=4.0)
    assert "the largest planned size (960 samples) is 2.0 doublings away" in result.line, result.line
    assert "full data" not in result.line


def test_one_size_gives_the_point_only():
    result = _forecast(TRUTHS["log-linear"], THREE[:1], break_even=2.0)
    assert result.verdict == "not yet known" and result.slope is None and result.predictions == []
    assert result.line.startswith("not yet known: one size measured, tau 1.1")


def test_measured_draft_above_break_even_is_a_go_whatever_the_sizes():
    result = _forecast(TRUTHS["flat"], THREE[:1], break_even=1.1)
    assert result.verdict == "go"
    assert result.line.endswith("measured, not forecast.")


def test_no_break_even_is_not_yet_known_and_lower_bounds_are_named():
    result = _forecast(TRUTHS["log-linear"], THREE, break_even=None, lower_bound_sizes=[960.0])
    assert result.verdict == "not yet known" and "no break-even tau" in result.line
    assert any("960 samples were stopped by the step cap" in note for note in result.notes)


def test_forecast_saves_and_loads(tmp_path):
    result = _forecast(TRUTHS["saturating"], THREE, break_even=1.78)
    result.save(tmp_path / "answer.json")
    assert Forecast.load(tmp_path / "answer.json") == result


def test_inputs_are_checked():
    with pytest.raises(ValueError, match="distinct positive"):
        forecast([60, 60], [1.2, 1.3], np.ones((10, 2)))
    with pytest.raises(ValueError, match=r"must be \(R, 2\)"):
        forecast([60, 240], [1.2, 1.3], np.ones((10, 3)))


# ----------------------------------------------------------------------------- stage 6's analysis/answer.json

def _agreements(rate: float, seed: int) -> dict[str, list[np.ndarray]]:
    generator = np.random.default_rng(seed)
    return {name: [generator.random((12, 3)) < rate for _ in range(8)] for name in ("alpha", "beta")}


def test_stage_six_answer_file_holds_the_forecast_and_its_sizes(tmp_path):
    from eaglekit.analysis.acceptance import sweep_acceptance
    from eaglekit.analysis.answer import forecast_answer, sweep_scaling
    from eaglekit.analysis.forecast import AnswerFile

    acceptance = sweep_acceptance({20: _agreements(0.2, 0), 40: _agreements(0.35, 1), 80: _agreements(0.5, 2)}, 3, num_resamples=200)
    scaling = sweep_scaling(acceptance, 2.3, max_accept_length=4.0, confidence=0.95)
    answer = forecast_answer(acceptance, scaling, [20, 40, 80, 160], {"serving (params.analysis)": 2.3, "embedded loop": 1.1},
                             max_accept_length=4.0, confidence=0.95, lower_bound_sizes={80.0})
    assert answer.sizes == [20.0, 40.0, 80.0] and answer.planned_sizes == [20.0, 40.0, 80.0, 160.0]
    serving = answer.forecasts["serving (params.analysis)"]
    assert answer.line == serving.line and serving.horizon == 160.0  # no full size known: the largest planned size
    assert [item.data_size for item in serving.predictions if not item.measured] == [160.0]
    overall = scaling.overall.set_index("data_size")
    assert serving.accept_lengths == pytest.approx(overall["tau_pooled"].tolist())
    assert answer.forecasts["embedded loop"].verdict == "go"  # every draft clears 1.1
    assert any("80 samples were stopped by the step cap" in note for note in serving.notes)
    answer.save(tmp_path / "answer.json")
    assert json.loads((tmp_path / "answer.json").read_text())["verdict"] == answer.verdict  # strict JSON, no Infinity
    assert AnswerFile.load(tmp_path / "answer.json") == answer
