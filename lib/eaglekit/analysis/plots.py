"""Figures of a data-size sweep: stage 5's draft vocab and training curves (notebook 05), stage 6's per-position
acceptance and ablation bars (notebook 06). Each function takes the records the stage wrote and returns a
matplotlib figure; the notebook saves it. The scaling curve is `scaling.plot_accept_length_vs_data_size` and
the topology sweep `topology_sweep.plot_topology_sweep`.
"""

from __future__ import annotations

import os

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.figure import Figure

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
    """Pooled held-out tau per ablation variant with its interval (`checkpoint_evaluation.score_ablation`'s table)."""
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
