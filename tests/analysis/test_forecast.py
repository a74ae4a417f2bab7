"""The go / no-go forecast on synthetic curves of known truth: coverage, wrong "go"s near break-even, the
wording.

Synthetic held-out data: m samples, each scored by every size's draft (paired), per-sample tau =
truth(N) + u_i (the sample's difficulty, shared by every size, sd 0.25) + e_iN (independent, sd 0.15) + d_N
(the draft's own training noise, one per size, sd TRAINING_NOISE_PRIOR's 0.013), sized to the kit's ShareGPT
measurements. truth(N) is what a draft trained on N samples scores in expectation over held-out sets and
seeds: what the interval claims to cover and what a verdict is right or wrong about.

The truths are the shapes data scaling produces: a line in log N, a saturating power law, a knee (the line
until one doubling past the largest measured size, flat after), an S-curve (its inflection one doubling past
the data) and a flat curve. Forecasts at 2 and 3 doublings past 960 (3,840 and 7,680; 4 doublings is past
MAX_DOUBLINGS_BEYOND and refused).

Tolerances: 80 experiments give a binomial standard error of 0.024 around a 95% rate, so a coverage is
accepted from 0.90 (2 standard errors). A wrong "go" is held to 5% by construction (the lower bound's level,
Bonferroni over the looks); the test accepts 0.05 + 2 standard errors at its experiment count. The seeds
are fixed, so every test is deterministic; docs/forecast.md has the rates from 500 experiments.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
import pytest

from support import read_strict_json
from eaglekit.analysis.forecast import (
    MAX_DOUBLINGS_BEYOND,
    TRAINING_NOISE_PRIOR,
    Forecast,
    forecast,
    paired_bootstrap_means,
    training_noise,
)

TRUTHS = {
    "log-linear": lambda n: 1.2 + 0.06 * np.log2(n / 60.0),
    "saturating": lambda n: 1.8 - 0.45 * (n / 60.0) ** -0.3,
    "knee": lambda n: 1.2 + 0.06 * np.minimum(np.log2(n / 60.0), 5.0),
    "s-curve": lambda n: 1.1 + 0.5 / (1.0 + np.exp(-0.8 * (np.log2(n / 60.0) - 5.0))),
    "flat": lambda n: 1.3 + 0.0 * n,
}
THREE = (60.0, 240.0, 960.0)
FIVE = (60.0, 120.0, 240.0, 480.0, 960.0)
AHEAD = (3840.0, 7680.0)  # 2 and 3 doublings beyond 960; the horizon is the last
EXPERIMENTS = 80
RESAMPLES = 200
COVERAGE_LOW = 0.90
TRAINING_SD = TRAINING_NOISE_PRIOR[0]


def wrong_go_limit(experiments: int) -> float:
    return 0.05 + 2.0 * math.sqrt(0.05 * 0.95 / experiments)


def synthetic(
    truth, sizes, seed: int, samples: int = 60, training_sd: float = TRAINING_SD
) -> tuple[np.ndarray, np.ndarray]:
    """(measured tau per size, (R, n) paired bootstrap replicates of the held-out set)."""
    rng = np.random.default_rng(seed)
    sizes = np.asarray(sizes)
    per_sample = (
        truth(sizes)[None, :]
        + rng.normal(0.0, 0.25, (samples, 1))
        + rng.normal(0.0, 0.15, (samples, len(sizes)))
        + rng.normal(0.0, training_sd, (1, len(sizes)))
    )
    return per_sample.mean(axis=0), paired_bootstrap_means(per_sample, RESAMPLES, seed + 10_000)


@functools.lru_cache(maxsize=None)
def experiments(name: str, sizes: tuple[float, ...]) -> dict:
    """Coverage at AHEAD and the wrong-"go" rate with break-even just above the truth at the horizon (by 0 to
    0.02)."""
    truth = TRUTHS[name]
    hits, wrong_go = dict.fromkeys(AHEAD, 0), 0
    for seed in range(EXPERIMENTS):
        taus, replicates = synthetic(truth, sizes, seed)
        break_even = float(truth(np.array(AHEAD[-1]))) + np.random.default_rng(seed + 1).uniform(0.0, 0.02)
        result = forecast(
            sizes,
            taus,
            replicates,
            planned_sizes=[*sizes, *AHEAD[:-1]],
            full_size=AHEAD[-1],
            break_even=break_even,
            max_accept_length=4.0,
            seed=seed,
        )
        wrong_go += result.verdict == "go"
        for item in result.predictions:
            if not item.measured:
                hits[item.data_size] += (
                    item.tau_low <= float(truth(np.array(item.data_size))) <= item.tau_high
                )
    return {
        "coverage": {size: count / EXPERIMENTS for size, count in hits.items()},
        "wrong_go": wrong_go / EXPERIMENTS,
    }


@pytest.mark.parametrize("sizes", [THREE, FIVE], ids=["3 sizes", "5 sizes"])
@pytest.mark.parametrize("name", sorted(TRUTHS))
def test_intervals_cover_every_shape_two_and_three_doublings_out(name, sizes):
    rates = experiments(name, sizes)["coverage"]
    assert all(rate >= COVERAGE_LOW for rate in rates.values()), rates


@pytest.mark.parametrize("sizes", [THREE, FIVE], ids=["3 sizes", "5 sizes"])
@pytest.mark.parametrize("name", sorted(TRUTHS))
def test_a_wrong_go_near_break_even_stays_within_five_percent(name, sizes):
    assert experiments(name, sizes)["wrong_go"] <= wrong_go_limit(EXPERIMENTS)


@pytest.mark.parametrize("name", ["knee", "flat"])
def test_re_forecasting_after_every_staged_size_keeps_the_chance_of_ever_a_wrong_go(name):
    """A staged run forecasts after each of 5 sizes, then stage 6 once more on redrawn drafts: 6 looks.
    Break-even sits just above the truth at the horizon, so any "go" on the way is wrong."""
    truth, sequences = TRUTHS[name], 40
    ever = 0
    for seed in range(sequences):
        break_even = float(truth(np.array(AHEAD[0]))) + np.random.default_rng(seed + 1).uniform(0.0, 0.02)
        looks = [synthetic(truth, FIVE[:count], seed) for count in range(1, len(FIVE) + 1)]
        looks.append(synthetic(truth, FIVE, seed + 50_000))  # stage 6: the same sizes, other drafts
        verdicts = [
            forecast(
                FIVE[: len(taus)],
                taus,
                replicates,
                planned_sizes=FIVE,
                full_size=AHEAD[0],
                break_even=break_even,
                max_accept_length=4.0,
                looks=len(looks),
                seed=seed,
            ).verdict
            for taus, replicates in looks
        ]
        ever += "go" in verdicts
    assert ever / sequences <= wrong_go_limit(sequences)


def test_two_sizes_slope_interval_covers_the_true_slope():
    hits = 0
    for seed in range(EXPERIMENTS):
        taus, replicates = synthetic(TRUTHS["log-linear"], THREE[:2], seed)
        slope = forecast(THREE[:2], taus, replicates, break_even=2.0, seed=seed).slope
        hits += slope["slope_low"] <= 0.06 <= slope["slope_high"]
    assert hits / EXPERIMENTS >= COVERAGE_LOW


def test_training_noise_pools_the_prior_with_the_seeds():
    prior_sd, prior_df = TRAINING_NOISE_PRIOR
    assert training_noise({60.0: 1.2}, None).sd == prior_sd
    noise = training_noise({60.0: 1.20, 240.0: 1.30}, {60.0: [1.26], 240.0: [1.36, 1.24]})
    squares = prior_sd**2 * prior_df + 0.5 * 0.06**2 + np.var([1.30, 1.36, 1.24]) * 3
    assert noise.degrees_of_freedom == prior_df + 3 and noise.sd == pytest.approx(
        math.sqrt(squares / (prior_df + 3))
    )
    assert noise.seeds_by_size == {60.0: 1, 240.0: 2}
    with pytest.raises(ValueError, match="not measured"):
        training_noise({60.0: 1.2}, {120.0: [1.3]})


def test_measured_seed_to_seed_noise_widens_the_interval():
    taus, replicates = synthetic(TRUTHS["log-linear"], THREE, 4)
    quiet = forecast(
        THREE, taus, replicates, planned_sizes=THREE, full_size=3840.0, break_even=2.0, max_accept_length=4.0
    )
    noisy = forecast(
        THREE,
        taus,
        replicates,
        planned_sizes=THREE,
        full_size=3840.0,
        break_even=2.0,
        max_accept_length=4.0,
        seed_accept_lengths={60.0: [taus[0] + 0.08, taus[0] - 0.08], 240.0: [taus[1] + 0.1]},
    )
    width = lambda result: result.predictions[-1].tau_high - result.predictions[-1].tau_low  # noqa: E731
    assert width(noisy) > width(quiet) + 0.05
    assert noisy.training_noise["seeds_by_size"] == {60.0: 2, 240.0: 1}


# ----------------------------------------------------------------------------- what it claims, in words


def _forecast(truth, sizes, break_even, seed=3, full_size=7680.0, **kwargs) -> Forecast:
    taus, replicates = synthetic(truth, sizes, seed)
    return forecast(
        sizes,
        taus,
        replicates,
        planned_sizes=sizes,
        full_size=full_size,
        break_even=break_even,
        max_accept_length=4.0,
        **kwargs,
    )


def test_flat_curve_far_below_break_even_is_a_no_go():
    result = _forecast(TRUTHS["flat"], FIVE, break_even=2.0)
    assert result.verdict == "no-go", result.line
    assert result.line.startswith("no-go: at 7,680 samples (3.0 doublings beyond 960)")
    assert "below break-even 2.000 even at the highest family's upper bound" in result.line
    assert "from 5 sizes (60, 120, 240, 480, 960 samples)" in result.line


def test_a_no_go_resting_on_capped_sizes_is_not_yet_known():
    result = _forecast(TRUTHS["flat"], FIVE, break_even=2.0, lower_bound_sizes=[960.0])
    assert result.verdict == "not yet known"
    assert result.line.startswith("not yet known (capped sizes are lower bounds): at 7,680 samples")
    assert "stopped by the step cap while still improving" in result.line


def test_a_rising_curve_is_not_a_go_until_a_measured_draft_clears_break_even():
    rising = lambda n: 1.2 + 0.08 * np.log2(n / 60.0)  # 1.52 at 960, 1.76 at 7,680
    result = _forecast(rising, FIVE, break_even=1.6)
    assert result.verdict == "not yet known", result.line
    assert (
        "an interval that contains break-even 1.600" in result.line
        and "no size can rule out that the curve stops" in result.line
    )
    assert 960 < result.crossing_size < 7680 and not isinstance(
        result.crossing_high, float
    )  # "beyond 7,680": the plateau never crosses
    measured = _forecast(rising, FIVE, break_even=1.4)
    assert measured.verdict == "go" and measured.line.startswith(
        "go: the draft trained on 960 samples measures tau"
    )
    assert measured.line.endswith("is not expected to score lower.")


def test_shrinking_gains_are_said_only_when_their_change_is_resolved():
    assert (
        "(no change resolved: change -" in _forecast(TRUTHS["saturating"], THREE, break_even=2.2, seed=5).line
    )
    steep = lambda n: (
        2.5 - 1.5 * (n / 60.0) ** -0.5
    )  # +0.375 per doubling from 60 to 240, +0.19 from 240 to 960
    assert "(shrinking: change -0.1" in _forecast(steep, THREE, break_even=3.9).line


def test_the_horizon_past_three_doublings_is_refused_in_words():
    result = _forecast(TRUTHS["saturating"], THREE, break_even=1.78, full_size=15360.0)
    assert result.verdict == "not yet known"
    assert (
        "the horizon (15,360 samples) is 4.0 doublings beyond the largest measured size (960), "
        "past the 3 a forecast" in result.line
    )
    assert result.predictions == [
        item for item in result.predictions if item.measured
    ]  # no number past the reach
    assert result.crossing_high == f"beyond {960 * 2**MAX_DOUBLINGS_BEYOND:,.0f}"


def test_crossing_sizes_past_the_reach_are_words_in_answer_json(tmp_path):
    result = _forecast(TRUTHS["flat"], THREE, break_even=3.5)
    assert result.crossing_size == result.crossing_high == "beyond 7,680"
    result.save(tmp_path / "forecast.json")
    record = read_strict_json(
        tmp_path / "forecast.json"
    )  # the flat slope never reaches break-even: inf, written as "inf"
    assert record["crossing_size"] == "beyond 7,680" and record == result.to_dict()


def test_two_sizes_give_a_slope_and_no_doublings_past_the_reach():
    # The staged demo's line after 20 samples said "49.8 more doublings away (interval 24.7 to 674.6)".
    sizes, taus = (10.0, 20.0), np.array([1.140, 1.163])
    rng = np.random.default_rng(0)
    per_sample = taus[None, :] + rng.normal(0, 0.05, (30, 1)) + rng.normal(0, 0.03, (30, 2))
    per_sample += taus - per_sample.mean(axis=0)
    result = forecast(
        sizes,
        taus,
        paired_bootstrap_means(per_sample, 1000, 1),
        planned_sizes=(10, 20, 40, 80),
        break_even=2.296,
        max_accept_length=4.0,
    )
    assert result.verdict == "not yet known" and result.predictions == [] and result.crossing_size is None
    assert result.line.startswith(
        "not yet known: from 2 sizes (10, 20 samples) only a slope: +0.023 tau per doubling"
    )
    assert "is not reached within 2.0 doublings (80 samples, the largest planned size)" in result.line
    assert "more doublings away" not in result.line and "A third size is needed" in result.line


def test_two_sizes_within_reach_give_the_doublings():
    result = _forecast(TRUTHS["log-linear"], THREE[:2], break_even=1.40, full_size=15360.0)
    assert (
        "more doublings away" in result.line
        and "3.0 doublings reach 1,920 samples, the furthest a slope is read" in result.line
    )
    assert "the full data (15,360 samples) is 6.0 doublings away" in result.line


def test_one_size_gives_the_point_only():
    result = _forecast(TRUTHS["log-linear"], THREE[:1], break_even=2.0)
    assert result.verdict == "not yet known" and result.slope is None and result.predictions == []
    assert result.line.startswith("not yet known: one size measured, tau 1.1")


def test_measured_draft_above_break_even_is_a_go_whatever_the_sizes():
    result = _forecast(TRUTHS["flat"], THREE[:1], break_even=1.1)
    assert result.verdict == "go" and result.line.endswith("is not expected to score lower.")
    assert "one-sided 95.0%" in result.line
    assert "one-sided 99.0%, 5 looks" in _forecast(TRUTHS["flat"], THREE[:1], break_even=1.1, looks=5).line


def test_a_measured_full_data_is_a_measurement_not_a_forecast():
    """The horizon is a measured size (params/kimi_k25_big_run.yaml's last size is its full data): this raised
    KeyError."""
    result = _forecast(TRUTHS["flat"], FIVE, break_even=2.0, full_size=960.0)
    assert (
        result.verdict == "no-go"
        and "the draft trained on 960 samples, the full data, measures tau" in result.line
    )
    assert "measured, not forecast" in result.line
    capped = _forecast(TRUTHS["flat"], FIVE, break_even=2.0, full_size=960.0, lower_bound_sizes=[960.0])
    assert capped.line.startswith(
        "not yet known (its tau is a lower bound): the draft trained on 960 samples"
    )
    # A smaller size still rising does not move the full data's own measurement (the real curve's 120 did so).
    smaller = _forecast(TRUTHS["flat"], FIVE, break_even=2.0, full_size=960.0, lower_bound_sizes=[120.0])
    assert smaller.verdict == "no-go" and "measured, not forecast" in smaller.line


def test_no_break_even_is_not_yet_known_and_lower_bounds_are_named():
    result = _forecast(TRUTHS["log-linear"], THREE, break_even=None, lower_bound_sizes=[960.0])
    assert result.verdict == "not yet known" and "no break-even tau" in result.line
    assert any("960 samples were stopped by the step cap" in note for note in result.notes)
    assert any(note.startswith("Training noise: sd 0.0130 tau per draft (prior") for note in result.notes)


def test_forecast_saves_every_field_as_strict_json(tmp_path):
    result = _forecast(TRUTHS["saturating"], THREE, break_even=1.78)
    result.save(tmp_path / "answer.json")
    record = read_strict_json(tmp_path / "answer.json")
    assert record == result.to_dict() and set(record) == {item.name for item in dataclasses.fields(Forecast)}


def test_inputs_are_checked():
    with pytest.raises(ValueError, match="distinct positive"):
        forecast([60, 60], [1.2, 1.3], np.ones((10, 2)))
    with pytest.raises(ValueError, match=r"must be \(R, 2\)"):
        forecast([60, 240], [1.2, 1.3], np.ones((10, 3)))
    with pytest.raises(ValueError, match="looks"):
        forecast([60], [1.2], np.ones((10, 1)), looks=0)
