"""The figures of notebooks 04-06 rendered from real stage tables (`acceptance.sweep_acceptance` over
agreement arrays, `answer.sweep_scaling` over it), checked on their matplotlib artists: one colour per dataset
across figures, log ticks in plain numbers, the benchmark line lighter than the held-out curve, n on
per-position points, values on the ablation bars."""

import warnings

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest
from matplotlib.colors import to_hex

from eaglekit.analysis import plots
from eaglekit.analysis.acceptance import acceptance_tables, sweep_acceptance
from eaglekit.analysis.answer import sweep_scaling
from eaglekit.training.record import DraftVocabRecord

SIZES = (30, 60, 120, 240, 480, 960, 1920)  # doublings, as training.data_sizes plans them
# Ten datasets, as the seed scenario (params/kimi_k25_big_run.yaml) has: more than a colour cycle's worth of
# distinct colours once the reference lines take theirs.
DATASETS = (
    "sharegpt",
    "ultrachat",
    "code",
    "math",
    "tool_use",
    "multilingual",
    "long_context",
    "safety",
    "creative",
    "reasoning",
)


@pytest.fixture(scope="module")
def acceptance():
    by_size = {}
    for index, size in enumerate(SIZES):
        rate = 0.35 + 0.04 * index
        by_size[size] = {
            name: [
                np.random.default_rng(100 * shift + sample).random((12, 3)) < rate + 0.01 * shift
                for sample in range(6)
            ]
            for shift, name in enumerate(DATASETS)
        }
    return sweep_acceptance(by_size, steps=3, num_resamples=50, seed=0)


@pytest.fixture(scope="module")
def scaling(acceptance):
    return sweep_scaling(
        acceptance,
        break_even_accept_length=1.9,
        max_accept_length=4.0,
        confidence=0.95,
        target_accept_length=2.4,
    )


def _benchmark(points: pd.DataFrame) -> pd.DataFrame:
    overall = points[points["dataset"] == "all"].sort_values("data_size")
    return pd.DataFrame(
        {
            "data_size": overall["data_size"],
            "prompts": 4,
            "tau": overall["tau_pooled"] + 0.05,
            "tau_low": overall["tau_pooled"] - 0.3,
            "tau_high": overall["tau_pooled"] + 0.4,
        }
    )


def _line_colors(axes) -> dict[str, str]:
    return {line.get_label(): to_hex(line.get_color()) for line in axes.get_lines()}


def _tick_labels(figure, axis) -> list[str]:
    figure.canvas.draw()  # tick labels are set at draw time
    return [label.get_text() for label in axis.get_ticklabels() if label.get_text()]


def _reads_as_a_number(text: str) -> bool:
    """30, 120, 0.5, 1.92k, 2.5M: digits with an optional k/M/B suffix, no TeX, no exponent."""
    number = text.replace(",", "").removesuffix("k").removesuffix("M").removesuffix("B")
    try:
        float(number)
    except ValueError:
        return False
    return "e" not in number.lower()


def test_a_dataset_has_one_colour_in_every_figure_and_none_shares_a_reference_lines(
    acceptance, scaling, tmp_path
):
    colors = plots.dataset_colors(
        list(reversed(DATASETS)) + ["all"]
    )  # the order the names come in changes nothing
    assert colors == plots.dataset_colors(DATASETS)
    largest = acceptance.per_position[acceptance.per_position["data_size"] == max(SIZES)]
    per_position = plots.plot_per_position_acceptance(largest, "per position", colors=colors)
    curve = plots.plot_accept_length_vs_data_size(
        scaling.points,
        break_even_accept_length=1.9,
        target_accept_length=2.4,
        benchmark=_benchmark(scaling.points),
        colors=colors,
    )
    tokens = pd.DataFrame(
        {"tokens": [900, 1_400, 300], "loss_tokens": [500, 700, 120]}, index=["math", "sharegpt", "code"]
    )
    captured = plots.plot_tokens_per_dataset(tokens, colors=colors)

    in_per_position, in_curve = _line_colors(per_position.axes[0]), _line_colors(curve.axes[0])
    for name in DATASETS + ("all",):
        assert in_per_position[name] == in_curve[name] == colors[name], name
    bars = {
        label.get_text(): to_hex(patch.get_facecolor())
        for label, patch in zip(captured.axes[0].get_yticklabels(), captured.axes[0].patches)
    }
    assert bars == {name: colors[name] for name in tokens.index}  # notebook 04's bars in 06's colours
    assert in_curve["all"] == to_hex("black")
    dataset_colours = [in_curve[name] for name in DATASETS]
    assert len(set(dataset_colours)) == len(DATASETS)  # ten datasets, ten colours
    references = {
        label: color
        for label, color in in_curve.items()
        if label.startswith(("break-even", "target", "benchmark"))
    }
    assert len(references) == 3 and not set(references.values()) & set(dataset_colours), references
    # The default (no map passed) is the same function of the same names.
    default = plots.plot_accept_length_vs_data_size(scaling.points)
    assert {name: color for name, color in _line_colors(default.axes[0]).items() if name in colors} == colors
    curve.savefig(tmp_path / "curve.png", dpi=80)
    for figure in (per_position, curve, captured, default):
        plt.close(figure)


def test_log_axes_read_as_plain_numbers_at_the_measured_sizes(scaling):
    curve = plots.plot_accept_length_vs_data_size(scaling.points, break_even_accept_length=1.9)
    axes = curve.axes[0]
    labels = _tick_labels(curve, axes.xaxis)
    assert labels == ["30", "60", "120", "240", "480", "960", "1.92k"]
    assert list(axes.xaxis.get_majorticklocs()) == pytest.approx(SIZES)
    assert not [tick for tick in axes.xaxis.get_minorticklabels() if tick.get_text()]

    vocab = DraftVocabRecord(
        size=4_000,
        coverage=0.93,
        counted_tokens=52_000,
        coverage_curve=[
            [size, min(1.0, 0.3 + 0.1 * np.log2(size / 64))]
            for size in (64, 256, 1_024, 4_000, 16_384, 49_152)
        ],
    )
    coverage = plots.plot_vocab_coverage(vocab)
    coverage_labels = _tick_labels(coverage, coverage.axes[0].xaxis)
    norms = plots.plot_feature_norms(
        {"layer 2": np.linspace(3.0, 40.0, 50), "final": np.linspace(50.0, 900.0, 50)}
    )
    norm_labels = _tick_labels(norms, norms.axes[0].yaxis)
    for texts in (labels, coverage_labels, norm_labels):
        assert texts and all(_reads_as_a_number(text) for text in texts), texts
    assert {"100", "1k", "10k"} <= set(coverage_labels)
    assert [plots.plain_number(value) for value in (0.5, 30, 999.6, 1_000, 16_384, 2_500_000, 3e9)] == [
        "0.5",
        "30",
        "1k",
        "1k",
        "16.4k",
        "2.5M",
        "3B",
    ]
    for figure in (curve, coverage, norms):
        plt.close(figure)


def test_the_few_prompt_benchmark_line_is_lighter_than_the_heldout_curve(scaling):
    figure = plots.plot_accept_length_vs_data_size(scaling.points, benchmark=_benchmark(scaling.points))
    lines = {line.get_label(): line for line in figure.axes[0].get_lines()}
    heldout, benchmark = lines["all"], lines["benchmark prompts (real loop) (4 prompts)"]
    assert benchmark.get_linewidth() < heldout.get_linewidth()
    assert (benchmark.get_alpha() if benchmark.get_alpha() is not None else 1.0) < (
        heldout.get_alpha() if heldout.get_alpha() is not None else 1.0
    )
    plt.close(figure)


def test_per_position_points_say_how_many_positions_they_rest_on(acceptance):
    largest = acceptance.per_position[acceptance.per_position["data_size"] == max(SIZES)]
    figure = plots.plot_per_position_acceptance(largest, "per position")
    labels = sorted(
        (round(float(text.xy[0]), 6), round(float(text.xy[1]), 6), text.get_text())
        for text in figure.axes[0].texts
    )
    expected = sorted(
        (round(float(row.step), 6), round(float(row.acceptance), 6), f"n={row.positions_reaching:,}")
        for row in largest.itertuples()
    )
    assert labels == expected  # every point, its own count (fewer positions reach later steps)
    assert largest[largest["dataset"] == "all"]["positions_reaching"].is_monotonic_decreasing
    plt.close(figure)

    # A dataset whose draft never agrees at step 1 has no step-2 point (NaN, 0 positions): no label for it
    # either.
    never = sweep_acceptance(
        {60: {"chat": [np.ones((10, 2), bool)] * 3, "code": [np.zeros((10, 2), bool)] * 3}},
        steps=2,
        num_resamples=20,
    ).per_position
    assert never["acceptance"].isna().sum() == 1
    figure = plots.plot_per_position_acceptance(never, "a dataset never reaching step 2")
    assert sorted(text.get_text() for text in figure.axes[0].texts) == ["n=30"] * 4 + ["n=60"]  # no "n=0"
    assert all(
        0 < text.get_position()[1] < 1 for text in figure.axes[0].texts
    )  # inside the axes, the 0 acceptance's too
    plt.close(figure)


def test_ablation_bars_print_their_values():
    rng = np.random.default_rng(3)
    tables = []
    for variant, rate in (("original answers", 0.35), ("regenerated answers", 0.55)):
        summary, _ = acceptance_tables(
            {name: [rng.random((20, 3)) < rate for _ in range(8)] for name in ("chat", "code")},
            num_resamples=50,
            seed=0,
        )
        tables.append(summary.assign(variant=variant, data_size=60))
    table = pd.concat(tables, ignore_index=True)
    figure = plots.plot_ablation(table)
    axes = figure.axes[0]
    pooled = table[table["dataset"] == "all"]
    texts = [text.get_text() for text in axes.texts]
    assert texts == [
        f"{row.tau_pooled:.3f}\n[{row.tau_pooled_low:.3f}, {row.tau_pooled_high:.3f}]"
        for row in pooled.itertuples()
    ]
    assert axes.get_ylim()[1] > pooled["tau_pooled_high"].max()  # the printed values sit inside the axes
    plt.close(figure)

    # Drafts that never agree (an untrained smoke draft): every tau is exactly 1 with no interval. The axis
    # still opens above 1, without matplotlib's singular-limits warning.
    never, _ = acceptance_tables({"chat": [np.zeros((20, 3), bool)] * 4}, num_resamples=20, seed=0)
    flat = pd.concat(
        [
            never.assign(variant=variant, data_size=60)
            for variant in ("original answers", "regenerated answers")
        ]
    )
    assert set(flat["tau_pooled_high"]) == {1.0}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        figure = plots.plot_ablation(flat)
    low, high = figure.axes[0].get_ylim()
    assert low == 1.0 and high > 1.0
    plt.close(figure)
