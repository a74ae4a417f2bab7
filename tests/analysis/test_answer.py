"""Stage 6's answer: the sweep's scaling answer, the scaling_summary.json record, the headline metrics, and
the plain-words answer with the measured numbers and intervals at the configured confidence."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from support import read_strict_json
from eaglekit.analysis.acceptance import percentile_interval, sweep_acceptance
from eaglekit.analysis.answer import (
    analysis_summary_record,
    answer_in_words,
    headline_metrics,
    sweep_scaling,
    write_summary_record,
)
from eaglekit.analysis.break_even import break_even_from_throughput
from eaglekit.analysis.scaling import scaling_answer
from eaglekit.topology import Topology


def agreements(rate: float, seed: int, steps: int = 3) -> dict[str, list[np.ndarray]]:
    """Two datasets of held-out samples; each position agrees with probability `rate` at every step."""
    generator = np.random.default_rng(seed)
    return {name: [generator.random((12, steps)) < rate for _ in range(8)] for name in ("alpha", "beta")}


def test_the_answer_reports_the_measured_numbers_at_the_configured_confidence():
    acceptance = sweep_acceptance(
        {20: agreements(0.2, 0), 80: agreements(0.5, 1)}, 3, num_resamples=200, confidence=0.8
    )
    loop = {"tau_loop_pooled": 1.31, "tau_offline_pooled": 1.29, "speedup": 0.87, "outputs_equal": True}
    seed_case = break_even_from_throughput(90.0, 82.3, 2.1)
    embedded = break_even_from_throughput(5.5, 3.7, 1.2, draft_length=3)
    benchmark = pd.DataFrame(
        [
            {"data_size": 20, "prompts": 4, "tau": 1.05, "tau_low": 1.0, "tau_high": 1.1},
            {"data_size": 80, "prompts": 4, "tau": 1.25, "tau_low": 1.15, "tau_high": 1.35},
        ]
    )
    lines = answer_in_words(
        acceptance,
        "all",
        Topology.chain(3),
        16,
        0.8,
        embedded,
        loop,
        ["the slope statement"],
        seed_case,
        benchmark,
        "test.jsonl",
    )

    overall = acceptance.summary[acceptance.summary["dataset"] == "all"].set_index("data_size")
    assert (
        f"tau went from {overall.loc[20, 'tau_pooled']:.2f} with 20 training samples to "
        f"{overall.loc[80, 'tau_pooled']:.2f}" in lines[0]
    )
    assert "80% interval" in lines[0] and "ceiling tau 4" in lines[0] and "16 held-out samples" in lines[0]
    # The paired gain's interval is at the configured confidence (80% here), not a fixed 95%.
    replicates = acceptance.pooled_replicates["all"]
    low, high = percentile_interval(replicates[:, 1] - replicates[:, 0], 0.8)
    assert (
        lines[1].startswith("More data helped")
        and f"{float(low):+.3f} to {float(high):+.3f} (80% interval)" in lines[1]
    )
    assert (
        f"needs tau above {embedded.break_even_accept_length:.2f}" in lines[2]
        and "0.87x" in lines[2]
        and "(slower)" in lines[2]
    )
    assert lines[3] == "the slope statement"
    assert "4 benchmark prompts" in lines[4] and "from 1.05 (20 samples) to 1.25" in lines[4]
    assert (
        f"must reach tau {seed_case.break_even_accept_length:.2f}" in lines[5]
        and "90 tok/s plain, 82.3 tok/s at tau 2.1" in lines[5]
    )

    same = answer_in_words(
        sweep_acceptance({20: agreements(0.3, 2), 80: agreements(0.3, 2)}, 3, num_resamples=200),
        "all",
        Topology.chain(3),
        16,
        0.95,
        embedded,
        loop,
        [],
        seed_case,
    )
    assert same[1].startswith("More data did not measurably help") and len(same) == 4  # no benchmark line


LOOP = {
    "tau_loop_pooled": 1.31,
    "tau_offline_pooled": 1.29,
    "speedup": 0.87,
    "outputs_equal": True,
    "verification_steps": 40,
}


def three_sizes():
    return sweep_acceptance(
        {20: agreements(0.2, 0), 40: agreements(0.35, 1), 80: agreements(0.5, 2)},
        3,
        num_resamples=60,
        confidence=0.8,
        seed=0,
    )


def test_sweep_scaling_fits_the_pooled_curve_and_marks_lower_bounds_only_there():
    acceptance = three_sizes()
    still_improving = {80: 0.02}  # SweepRecord.still_improving(): {size: recent gain}
    scaling = sweep_scaling(
        acceptance, 1.9, max_accept_length=4.0, confidence=0.8, lower_bound_sizes=still_improving
    )

    assert scaling.pooled_dataset == "all" and scaling.overall["data_size"].tolist() == [20, 40, 80]
    assert set(scaling.overall["dataset"]) == {"all"}
    marked = scaling.points[scaling.points["lower_bound"]]
    assert marked[["data_size", "dataset"]].values.tolist() == [
        [80, "all"]
    ]  # not the per-dataset rows of size 80
    assert len(scaling.points) == len(acceptance.summary)
    # The same answer the scaling module gives on the pooled rows, with break-even as the one target.
    direct = scaling_answer(
        [20, 40, 80],
        scaling.overall["tau_pooled"].to_numpy(),
        acceptance.pooled_replicates["all"],
        max_accept_length=4.0,
        targets=[("break-even", 1.9)],
        confidence=0.8,
        lower_bound_sizes=[80],
    )
    assert scaling.answer.slope.slope == pytest.approx(direct.slope.slope) and scaling.answer.slope.slope > 0
    assert (scaling.answer.slope.slope_low, scaling.answer.slope.slope_high) == pytest.approx(
        (direct.slope.slope_low, direct.slope.slope_high)
    )
    assert [item["label"] for item in scaling.answer.doublings_needed] == ["break-even"]
    assert scaling.statements == [
        *direct.statements,
        "No target accept length is set (analysis.target_accept_length), so only break-even is sized.",
    ]
    slope_table, ceiling_table, doublings_table = scaling.tables()
    assert (
        slope_table.loc["slope_per_doubling", "local slope"] == pytest.approx(direct.slope.slope)
        and "statement" not in slope_table.index
    )
    assert "identified" in ceiling_table.index and "statement" not in doublings_table.columns
    assert scaling.ceiling_identified == direct.ceiling.identified

    with_target = sweep_scaling(
        acceptance, 1.9, max_accept_length=4.0, confidence=0.8, target_accept_length=2.5
    )
    assert [item["label"] for item in with_target.answer.doublings_needed] == ["break-even", "target"]
    assert not any("No target" in statement for statement in with_target.statements)
    assert not with_target.points["lower_bound"].any()


def test_sweep_scaling_with_one_size_or_one_dataset():
    one_size = sweep_scaling(
        sweep_acceptance({40: agreements(0.3, 0)}, 3, num_resamples=50),
        1.9,
        4.0,
        0.95,
        target_accept_length=2.0,
    )
    assert one_size.answer is None and not one_size.ceiling_identified and one_size.tables() == []
    assert one_size.statements == [
        "No slope: the sweep measured 1 data size; add sizes to training.data_sizes."
    ]
    generator = np.random.default_rng(3)
    only = {
        size: {"code": [generator.random((12, 3)) < rate for _ in range(8)]}
        for size, rate in ((20, 0.2), (80, 0.5))
    }
    one_dataset = sweep_scaling(sweep_acceptance(only, 3, num_resamples=50), 1.9, 4.0, 0.95)
    assert one_dataset.pooled_dataset == "code" and one_dataset.overall["data_size"].tolist() == [20, 80]
    assert one_dataset.answer is not None


def test_summary_record_and_headline_carry_the_measured_numbers(tmp_path):
    acceptance = three_sizes()
    scaling = sweep_scaling(
        acceptance, 1.9, max_accept_length=4.0, confidence=0.8, lower_bound_sizes={80: 0.02}
    )
    seed_case = break_even_from_throughput(90.0, 82.3, 2.1)
    embedded = break_even_from_throughput(5.5, 3.7, 1.31, draft_length=3)
    benchmark = pd.DataFrame(
        [
            {
                "data_size": np.int64(20),
                "prompts": np.int64(4),
                "tau": np.float64(1.05),
                "outputs_equal": np.bool_(True),
            }
        ]
    )

    record = analysis_summary_record(
        Topology.chain(3), 48, scaling, embedded, seed_case, LOOP, "bench/prompts.jsonl", benchmark
    )
    assert list(record) == [
        "topology",
        "heldout_samples",
        "points",
        "scaling",
        "statements",
        "benchmark",
        "break_even",
        "seed_break_even",
        "speculative_loop",
    ]
    assert record["topology"] == {"topology": "chain", "steps": 3, "top_k": 1, "draft_tokens": 4}
    assert record["heldout_samples"] == 48 and len(record["points"]) == len(acceptance.summary)
    assert record["scaling"]["local_slope"]["slope_per_doubling"] == pytest.approx(scaling.answer.slope.slope)
    assert record["statements"] == scaling.statements and record["speculative_loop"] == LOOP
    assert (
        record["benchmark"]["file"] == "bench/prompts.jsonl"
        and record["benchmark"]["summary"][0]["tau"] == 1.05
    )
    assert record["break_even"]["break_even_accept_length"] == pytest.approx(
        embedded.break_even_accept_length
    )
    assert record["seed_break_even"]["accept_length"] == 2.1
    assert (
        analysis_summary_record(Topology.chain(3), 48, scaling, embedded, seed_case, LOOP)["benchmark"]
        is None
    )

    record["stage_seconds"] = 12.5
    record["topology_sweep"] = {
        "loop_check": [{"tau_loop": np.float32(1.5), "steps": np.int64(3)}]
    }  # numpy scalars, as loops return
    write_summary_record(tmp_path / "scaling_summary.json", record)
    written = json.loads((tmp_path / "scaling_summary.json").read_text())
    assert written["topology_sweep"] == {
        "loop_check": [{"tau_loop": 1.5, "steps": 3.0}]
    }  # json.dumps alone refuses them
    assert written["benchmark"]["summary"] == [
        {"data_size": 20, "prompts": 4, "tau": 1.05, "outputs_equal": True}
    ]
    assert [
        (point["data_size"], point["dataset"]) for point in written["points"] if point["lower_bound"]
    ] == [(80, "all")]
    assert written["stage_seconds"] == 12.5 and written["statements"] == scaling.statements

    headline = headline_metrics(
        Topology.chain(3),
        scaling,
        LOOP,
        embedded,
        seed_case,
        lower_bound_sizes={80: 0.02},
        stage_seconds=12.5,
    )
    largest = scaling.overall.iloc[-1]
    assert headline["topology"] == "chain" and headline["steps"] == 3 and headline["draft_tokens"] == 4
    assert headline["largest_data_size"] == 80.0 and headline["tau_offline_largest"] == pytest.approx(
        float(largest["tau_pooled"])
    )
    assert (headline["tau_offline_largest_low"], headline["tau_offline_largest_high"]) == pytest.approx(
        (float(largest["tau_pooled_low"]), float(largest["tau_pooled_high"]))
    )
    assert (
        headline["tau_loop"],
        headline["tau_loop_offline_same_prompts"],
        headline["loop_speedup"],
        headline["outputs_equal"],
    ) == (1.31, 1.29, 0.87, True)
    assert (
        headline["break_even_embedded"] == embedded.break_even_accept_length
        and headline["break_even_seed"] == seed_case.break_even_accept_length
    )
    assert (headline["slope_per_doubling"], headline["slope_low"], headline["slope_high"]) == (
        scaling.answer.slope.slope,
        scaling.answer.slope.slope_low,
        scaling.answer.slope.slope_high,
    )
    assert headline["doublings_needed"] == {"break-even": scaling.answer.doublings_needed[0]["doublings"]}
    assert headline["lower_bound_sizes"] == [80] and headline["stage_seconds"] == 12.5
    assert headline["ceiling_identified"] == scaling.ceiling_identified
    json.dumps(headline)  # a metrics line: plain JSON

    none = headline_metrics(
        Topology.chain(3),
        sweep_scaling(sweep_acceptance({40: agreements(0.3, 0)}, 3, num_resamples=50), 1.9, 4.0, 0.95),
        LOOP,
        embedded,
        seed_case,
        lower_bound_sizes=(),
        stage_seconds=1.0,
    )
    assert (
        none["slope_per_doubling"] is None
        and none["doublings_needed"] == {}
        and none["ceiling_identified"] is False
    )
    assert none["largest_data_size"] == 40.0


# ------------------------------------------------------------------ the forecast on every shipped params file

PARAMS_FILES = sorted((Path(__file__).resolve().parents[2] / "params").glob("*.yaml"))


def rising_agreements(sizes, steps: int) -> dict[int, dict[str, list[np.ndarray]]]:
    """Synthetic held-out agreements whose acceptance rises by 0.04 per doubling from 0.3 (chain of
    `steps`)."""
    return {
        size: agreements(min(0.9, 0.3 + 0.04 * np.log2(size / sizes[0])), index, steps)
        for index, size in enumerate(sizes)
    }


@pytest.mark.parametrize("path", PARAMS_FILES, ids=[path.stem for path in PARAMS_FILES])
def test_the_forecast_and_the_answer_file_on_every_shipped_params_file(path, tmp_path):
    """Each params file's data sizes, full data and break-even, with synthetic measured taus, after every size
    in turn: params/kimi_k25_big_run.yaml's last size is its full data, where the forecast raised
    KeyError('log-linear')."""
    from eaglekit.analysis.forecast import VERDICTS
    from eaglekit.analysis.answer import forecast_answer
    from eaglekit.config import load_params

    params = load_params(path)
    settings, sizes = params.analysis, sorted(params.training.data_sizes)
    timings = (
        settings.baseline_tokens_per_s,
        settings.speculative_tokens_per_s,
        settings.measured_accept_length,
    )
    cases = {"embedded loop": 1.9}
    if all(value is not None for value in timings):
        cases = {
            "serving (params.analysis)": break_even_from_throughput(*timings).break_even_accept_length,
            **cases,
        }
    by_size = rising_agreements(sizes, settings.chain_steps)
    for count in range(1, len(sizes) + 1):
        acceptance = sweep_acceptance(
            {size: by_size[size] for size in sizes[:count]}, settings.chain_steps, num_resamples=40
        )
        scaling = sweep_scaling(
            acceptance, 1.9, max_accept_length=settings.chain_steps + 1.0, confidence=settings.confidence
        )
        answer = forecast_answer(
            acceptance,
            scaling,
            sizes,
            cases,
            max_accept_length=settings.chain_steps + 1.0,
            confidence=settings.confidence,
            full_size=settings.full_data_size,
        )
        assert answer.verdict in VERDICTS and answer.line.startswith(answer.verdict), answer.line
        answer.save(tmp_path / "answer.json")
        # Strict JSON (a non-finite number is a string) holding what the answer says.
        record = read_strict_json(tmp_path / "answer.json")
        assert (
            record == answer.to_dict()
            and record["verdict"] == answer.verdict
            and set(record["forecasts"]) == set(cases)
        )


def test_a_draft_labelled_converged_while_its_tau_still_rose_is_a_lower_bound():
    """The rule stops when tau has not improved by min_improvement for `patience` evaluations. Judged on
    smoothed taus, it labelled converged drafts whose best tau rose by more than that over those evaluations
    (the demo had two)."""
    from eaglekit.analysis.answer import lower_bound_sizes

    rows = [
        {"size": 10, "converged": True, "recent_gain": 0.004},  # converged by the rule's own test
        {
            "size": 20,
            "converged": True,
            "recent_gain": 0.021,
        },  # "converged", but rose 0.021 > 0.01: still rising
        {"size": 40, "converged": False, "recent_gain": 0.05},  # the step cap
        {"size": 80, "converged": True, "recent_gain": None},
    ]  # too few evaluations to tell: the label stands
    from types import SimpleNamespace

    no_anneal = SimpleNamespace(
        min_improvement=0.01, decay_steps=0, decay_fraction=0.75
    )  # params/demo.yaml's rule
    assert lower_bound_sizes(rows, no_anneal) == {20.0: 0.021, 40.0: 0.05}
    # Under an anneal the last evaluations are the anneal's own rise: only the cap makes a lower bound.
    assert lower_bound_sizes(
        rows, SimpleNamespace(min_improvement=0.01, decay_steps=None, decay_fraction=0.75)
    ) == {40.0: 0.05}


def test_the_verdict_uses_this_targets_break_even_unless_serving_timings_are_given():
    """The demo's answer.json opened with 2.296, the Kimi-K2.5 serving case of the params defaults, on
    SmolLM2."""
    from types import SimpleNamespace

    from eaglekit.analysis.answer import EMBEDDED_CASE, SERVING_CASE, break_even_cases, serving_case

    embedded = break_even_from_throughput(5.5, 3.7, 1.2, draft_length=3)
    unset = SimpleNamespace(
        baseline_tokens_per_s=None, speculative_tokens_per_s=None, measured_accept_length=None
    )
    assert serving_case(unset) is None
    assert break_even_cases(serving_case(unset), embedded) == {
        EMBEDDED_CASE: embedded.break_even_accept_length
    }
    given = serving_case(
        SimpleNamespace(baseline_tokens_per_s=90.0, speculative_tokens_per_s=82.3, measured_accept_length=2.1)
    )
    cases = break_even_cases(given, embedded)
    assert list(cases) == [SERVING_CASE, EMBEDDED_CASE] and cases[SERVING_CASE] == pytest.approx(
        2.1 * 90 / 82.3
    )
    assert break_even_cases(None, None) == {}


def test_only_a_params_file_that_gives_serving_timings_has_a_serving_case():
    """The schema's defaults were the seed's Kimi-K2.5 timings, so every run without timings still had a
    serving case (the demo's answer.json opened with 2.296 on SmolLM2). Now the defaults are none; the seed's
    file gives its own."""
    from eaglekit.analysis.answer import serving_case
    from eaglekit.config import Params, load_params

    assert serving_case(Params().analysis) is None
    for path in PARAMS_FILES:
        case = serving_case(load_params(path).analysis)
        if path.stem == "kimi_k25_big_run":
            assert case is not None and case.break_even_accept_length == pytest.approx(2.1 * 90 / 82.3)
        else:
            assert case is None, path.name
    demo = load_params(PARAMS_FILES[0].parent / "demo.yaml")
    assert demo.analysis.full_data_size > max(
        demo.training.data_sizes
    )  # the demo's verdict has a horizon to forecast


def test_answer_in_words_without_serving_timings_says_nothing_of_another_deployment():
    acceptance = sweep_acceptance({20: agreements(0.2, 0), 80: agreements(0.5, 1)}, 3, num_resamples=50)
    embedded = break_even_from_throughput(5.5, 3.7, 1.2, draft_length=3)
    lines = answer_in_words(acceptance, "all", Topology.chain(3), 16, 0.95, embedded, LOOP, [], None)
    assert len(lines) == 3 and not any("tok/s plain" in line for line in lines)


def test_extra_seed_drafts_give_their_pooled_tau_per_size():
    from eaglekit.analysis.acceptance import chain_counts, concat_counts, pooled_accept_length
    from eaglekit.analysis.answer import seed_accept_lengths

    first, second = agreements(0.3, 5), agreements(0.35, 6)
    taus = seed_accept_lengths({20: [first, second], 40: []}, 3)
    expected = [
        pooled_accept_length(concat_counts([chain_counts(values, 3) for values in drafts.values()]))
        for drafts in (first, second)
    ]
    assert taus == {20.0: pytest.approx(expected)}
