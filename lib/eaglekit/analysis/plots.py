"""Figures of a data-size sweep: stage 5's draft vocab and training curves (notebook 05), stage 6's per-position
acceptance and ablation bars (notebook 06). Each function takes the records the stage wrote and returns a
matplotlib figure; the notebook saves it. Also stage 6's scaling curve (`plot_accept_length_vs_data_size`, over
`scaling`'s slope and fit); the topology sweep's figure is `topology_sweep.plot_topology_sweep`.
"""

from __future__ import annotations

import os

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from eaglekit.analysis.scaling import LocalSlope, ScalingFit
from eaglekit.training.record import DraftVocabRecord, SweepRecord
from eaglekit.training import iterate_metrics


def plot_vocab_coverage(vocab: DraftVocabRecord) -> Figure:
    """Share of generated tokens covered against draft vocab size (log), the chosen size marked."""
    figure, axis = plt.subplots(figsize=(7, 3.5))
    sizes, shares = zip(*vocab.coverage_curve) if vocab.coverage_curve else ((), ())
    axis.plot(sizes, shares, marker=".")
    axis.axvline(vocab.size, color="tab:red", linestyle="--", label=f"chosen {vocab.size:,}: {vocab.coverage:.1%}")
    axis.set_xscale("log")
    axis.set_xlabel("draft vocab size")
    axis.set_ylabel("share of generated tokens covered")
    axis.set_title(f"draft vocab coverage ({vocab.counted_tokens:,} generated tokens in the largest subset)")
    axis.legend()
    figure.tight_layout()
    return figure


def plot_training_curves(sweep: SweepRecord, run_dir: str | os.PathLike) -> Figure:
    """Per data size (columns): soft cross-entropy (top) and top-1 accuracy (bottom) per TTT position over steps."""
    figure, axes = plt.subplots(2, len(sweep.runs), figsize=(3.2 * len(sweep.runs), 5.5), sharey="row", squeeze=False)
    for column, entry in enumerate(sweep.runs):
        records = pd.DataFrame(list(iterate_metrics(sweep.path(run_dir, entry.metrics_path), "train")))
        for row, name in enumerate(("loss_by_position", "accuracy_by_position")):
            values = pd.DataFrame(records[name].tolist(), index=records["step"])  # (evaluations, TTT positions)
            for position in values.columns:
                axes[row, column].plot(values.index, values[position], label=f"position {position}")
            axes[row, column].set_xlabel("step")
        axes[0, column].set_title(f"{entry.size} samples")
    axes[0, 0].set_ylabel("soft cross-entropy")
    axes[1, 0].set_ylabel("top-1 accuracy")
    axes[1, 0].legend(fontsize=7)
    figure.tight_layout()
    return figure


def plot_heldout_curves(sweep: SweepRecord, run_dir: str | os.PathLike) -> Figure:
    """Held-out simulated tau against samples seen, one line per size; a ring on each best checkpoint; a size
    stopped by the step cap is labelled "still improving"."""
    figure, axis = plt.subplots(figsize=(7, 3.8))
    for entry in sweep.runs:
        records = pd.DataFrame(list(iterate_metrics(sweep.path(run_dir, entry.metrics_path), "heldout")))
        line = axis.plot(records["samples_seen"], records["simulated_accept_length"], marker=".",
                         label=f"{entry.size} samples" + ("" if entry.converged else " (still improving)"))[0]
        best = records.loc[records["step"] == entry.best_step].iloc[0]
        axis.plot(best["samples_seen"], best["simulated_accept_length"], marker="o", markersize=9, fillstyle="none", color=line.get_color())
    axis.set_xlabel("training samples seen")
    axis.set_ylabel("simulated accept length (held-out)")
    heldout = sweep.runs[0].heldout_size if sweep.runs else 0
    axis.set_title(f"{sweep.topology.label}, {heldout} held-out samples")
    axis.legend()
    figure.tight_layout()
    return figure


def plot_per_position_acceptance(per_position: pd.DataFrame, title: str) -> Figure:
    """Conditional acceptance acc_j per chain step j with its interval, one line per dataset ("all" in bold).

    per_position: `acceptance.sweep_acceptance(...).per_position` rows of one draft."""
    figure, axis = plt.subplots(figsize=(7, 3.8))
    for name, group in per_position.groupby("dataset"):
        style = {"color": "black", "linewidth": 2.2} if name == "all" else {"linewidth": 1.2}
        line = axis.plot(group["step"], group["acceptance"], marker="o", label=name, **style)[0]
        axis.fill_between(group["step"], group["acceptance_low"], group["acceptance_high"], color=line.get_color(), alpha=0.12)
    axis.set_xticks(sorted(per_position["step"].unique()))
    axis.set_xlabel("chain step j")
    axis.set_ylabel("acc_j (given steps 1..j-1 agreed)")
    axis.set_ylim(0, 1)
    axis.set_title(title)
    axis.legend(fontsize=8)
    figure.tight_layout()
    return figure


def plot_ablation(table: pd.DataFrame, pooled_dataset: str = "all") -> Figure:
    """Pooled held-out tau per ablation variant with its interval (`checkpoints.score_ablation`'s table)."""
    if not (table["dataset"] == pooled_dataset).any():  # one dataset: acceptance_tables adds no pooled row
        pooled_dataset = table["dataset"].iloc[0]
    pooled = table[table["dataset"] == pooled_dataset]
    figure, axis = plt.subplots(figsize=(6, 3.5))
    axis.bar(pooled["variant"], pooled["tau_pooled"],
             yerr=[pooled["tau_pooled"] - pooled["tau_pooled_low"], pooled["tau_pooled_high"] - pooled["tau_pooled"]], capsize=6)
    topology = pooled.iloc[0]
    axis.set_ylabel(f"held-out tau ({topology['topology']}, {topology['steps']} steps)")
    axis.set_ylim(1, None)
    axis.set_title(f"Ablation: same size ({int(topology['data_size'])} samples), same held-out set")
    figure.tight_layout()
    return figure


def plot_accept_length_vs_data_size(
    points: pd.DataFrame,
    fit: ScalingFit | None = None,
    break_even_accept_length: float | None = None,
    target_accept_length: float | None = None,
    overall_dataset: str = "all",
    size_column: str = "data_size",
    dataset_column: str = "dataset",
    value_column: str = "tau_pooled",
    low_column: str = "tau_pooled_low",
    high_column: str = "tau_pooled_high",
    extend_to: float | None = None,
    lower_bound_column: str = "lower_bound",
    slope: LocalSlope | None = None,
    benchmark: pd.DataFrame | None = None,
    benchmark_label: str = "benchmark prompts (real loop)",
) -> Figure:
    """Accept length against training-data size: per dataset and overall, log x, confidence bands.

    points: one row per (dataset, data size) with the value and its interval columns; a "topology"
      and "steps" column, when present, label the y axis (topology recorded beside every tau). A True
      in `lower_bound_column` (the draft was still improving when training stopped) draws that overall
      point as an open marker with an upward arrow: its tau is a lower bound.
    fit: drawn over the measured range (extended to `extend_to` when given) with its bootstrap band;
      pass it only when its ceiling is identified (`ceiling_identification`).
    slope: the local slope, drawn as the least-squares line over the measured range.
    benchmark: rows of `size_column`, "tau", "tau_low", "tau_high" from the real loop on benchmark
      prompts, drawn beside the held-out curve.
    Returns the matplotlib Figure.
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    missing = [c for c in (size_column, dataset_column, value_column, low_column, high_column) if c not in points.columns]
    if missing:
        raise ValueError(f"points is missing columns {missing}; it has {list(points.columns)}")
    figure, axes = plt.subplots(figsize=(10.5, 4.8))
    for name, group in points.groupby(dataset_column, sort=True):
        group = group.sort_values(size_column)
        overall = name == overall_dataset
        style = {"color": "black", "linewidth": 2.2, "zorder": 3} if overall else {"linewidth": 1.2, "alpha": 0.85}
        line = axes.plot(group[size_column], group[value_column], marker="o", label=str(name), **style)[0]
        axes.fill_between(group[size_column], group[low_column], group[high_column], color=line.get_color(), alpha=0.15 if overall else 0.1)
        if overall and lower_bound_column in group.columns:
            still_improving = group[lower_bound_column].fillna(False).astype(bool)
            converged = group[~still_improving]
            if len(converged):  # said in the legend too, so a reader knows no point is a lower bound
                axes.plot(converged[size_column], converged[value_column], linestyle="none", marker="o", markersize=9, color="black",
                          zorder=4, label=f"converged, stopped by patience ({len(converged)} of {len(group)} sizes)")
        if overall and lower_bound_column in group.columns and group[lower_bound_column].fillna(False).astype(bool).any():
            bounded = group[group[lower_bound_column].fillna(False).astype(bool)]
            axes.plot(bounded[size_column], bounded[value_column], linestyle="none", marker="o", markersize=11, markerfacecolor="white",
                      markeredgecolor="black", zorder=4, label="still improving: tau is a lower bound")
            for size, value in zip(bounded[size_column], bounded[value_column]):
                axes.annotate("", xy=(size, value + 0.06), xytext=(size, value + 0.01), zorder=4,
                              arrowprops={"arrowstyle": "->", "color": "black", "linewidth": 1.4})
    if benchmark is not None and len(benchmark):
        bench = benchmark.sort_values(size_column)
        line = axes.plot(bench[size_column], bench["tau"], marker="s", linestyle="-.", color="tab:cyan", linewidth=1.8, label=benchmark_label)[0]
        axes.fill_between(bench[size_column], bench["tau_low"], bench["tau_high"], color=line.get_color(), alpha=0.12)
    if slope is not None:
        grid = np.geomspace(float(slope.data_sizes[0]), float(slope.data_sizes[-1]), 50)
        intercept = float(slope.accept_lengths.mean() - slope.slope * np.log2(slope.data_sizes).mean())
        axes.plot(grid, intercept + slope.slope * np.log2(grid), linestyle=":", color="tab:gray", linewidth=1.5,
                  label=f"slope {slope.slope:+.3f}/doubling ({slope.confidence:.0%}: {slope.slope_low:+.3f} to {slope.slope_high:+.3f})")
    if fit is not None:
        right = max(float(points[size_column].max()), extend_to or 0.0)
        grid = np.geomspace(float(points[size_column].min()) / 1.5, right * 1.5, 200)
        axes.plot(grid, fit.predict(grid), linestyle="--", color="tab:purple", label=f"fit (ceiling identified): tau_inf={fit.tau_inf:.2f}, c={fit.exponent:.2f}")
        band_low, band_high = fit.predict_band(grid)
        axes.fill_between(grid, band_low, band_high, color="tab:purple", alpha=0.12, label=f"fit {fit.confidence:.0%} band ({fit.bootstrap_method} bootstrap)")
    if break_even_accept_length is not None:
        axes.axhline(break_even_accept_length, color="tab:red", linewidth=1.5, label=f"break-even tau = {break_even_accept_length:.2f}")
    if target_accept_length is not None:
        axes.axhline(target_accept_length, color="tab:green", linestyle=":", linewidth=1.5, label=f"target tau = {target_accept_length:.2f}")
    axes.set_xscale("log")
    axes.set_xlabel("training samples (log scale)")
    topology = ""
    if {"topology", "steps"} <= set(points.columns):
        pairs = points[["topology", "steps"]].drop_duplicates()
        topology = " (" + "; ".join(f"{row.topology}, {row.steps} steps" for row in pairs.itertuples()) + ")"
    axes.set_ylabel(f"accept length tau{topology}")
    axes.set_title("Accept length against training-data size")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)  # beside the plot, never over a curve
    figure.tight_layout()
    return figure
