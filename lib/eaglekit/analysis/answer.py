"""Stage 6's answer: the sweep's scaling answer, the `scaling_summary.json` record, the headline metrics
event and the answer in plain words (notebook 06), every number taken from what was measured; and what the
go / no-go forecast is made against (`break_even_cases`) and on (`lower_bound_sizes`, `forecast_answer`).

Nothing here measures: it reads the sweep's offline acceptance (`acceptance.SweepAcceptance`), the real
loop's summary (`checkpoints.evaluate_speculative_loop`), the scaling answer
(`scaling.scaling_answer`, fitted here on the pooled curve), the benchmark curve and the break-even cases.
"""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd

from eaglekit.analysis.acceptance import SweepAcceptance, chain_counts, concat_counts, percentile_interval, pooled_accept_length
from eaglekit.io import write_json
from eaglekit.analysis.break_even import BreakEven, break_even_from_throughput
from eaglekit.analysis.forecast import AnswerFile, forecast
from eaglekit.analysis.scaling import ScalingAnswer, scaling_answer
from eaglekit.topology import Topology


SERVING_CASE = "serving (params.analysis)"
EMBEDDED_CASE = "embedded loop"


def serving_case(analysis: Any) -> BreakEven | None:
    """Break-even from the user's serving timings (analysis.baseline_tokens_per_s, speculative_tokens_per_s,
    measured_accept_length), None when any is unset: then no deployment was measured for this target."""
    timings = (analysis.baseline_tokens_per_s, analysis.speculative_tokens_per_s, analysis.measured_accept_length)
    return None if any(value is None for value in timings) else break_even_from_throughput(*timings)


def break_even_cases(serving: BreakEven | None, embedded: BreakEven | None) -> dict[str, float]:
    """Label -> break-even tau, the primary case first: the user's serving timings when given, else the run's
    own target (the embedded loop's timings). A verdict is never made against another deployment's
    break-even."""
    cases = {SERVING_CASE: serving, EMBEDDED_CASE: embedded}
    return {label: case.break_even_accept_length for label, case in cases.items() if case is not None}


def lower_bound_sizes(rows: Iterable[Mapping[str, Any]], training: Any) -> dict[float, float | None]:
    """{data size: recent gain} of the drafts whose tau is a lower bound: stopped by the step cap, or labelled
    converged while the rule's own test says otherwise. The rule stops when held-out tau has not improved by
    training.min_improvement for `patience` evaluations; a draft whose best tau rose by more than that over
    those last evaluations (`recent_gain`, judged on single taus where the rule judged their smoothed mean)
    was still rising. Under an anneal (training.decay_steps / decay_fraction) the last evaluations are the
    anneal's own rise, so only the cap counts.

    rows: sweep rows or `DraftEntry.to_dict()`s with size, converged, recent_gain; training: the params
    section."""
    from eaglekit.training.schedule import anneal_length

    annealed = anneal_length(training.decay_steps, training.decay_fraction, 1) > 0
    return {float(row["size"]): row.get("recent_gain") for row in rows
            if not row.get("converged", True)
            or (not annealed and row.get("recent_gain") is not None and row["recent_gain"] > training.min_improvement)}


def seed_accept_lengths(agreements_by_size: Mapping[int, Sequence[Mapping[str, Sequence]]], steps: int) -> dict[float, list[float]]:
    """{size: pooled held-out tau of each extra-seed draft}: the forecast's measured training noise.

    agreements_by_size: per size, one {dataset: [(P, k) agreement]} per extra seed, scored on the same
    held-out samples as the sweep's drafts (`checkpoints.offline_agreements_by_size` per seed)."""
    return {float(size): [pooled_accept_length(concat_counts([chain_counts(values, steps) for values in by_dataset.values()]))
                          for by_dataset in drafts]
            for size, drafts in agreements_by_size.items() if drafts}


@dataclass(frozen=True)
class SweepScaling:
    """The scaling answer on the sweep's pooled held-out curve, with the points it was read from."""

    pooled_dataset: str  # "all" when the sweep pooled its datasets, else its one dataset
    overall: pd.DataFrame  # acceptance.summary's rows for pooled_dataset, ascending data size
    # acceptance.summary plus `lower_bound`: pooled rows of drafts stopped while still improving
    points: pd.DataFrame
    answer: ScalingAnswer | None  # None with fewer than two data sizes
    statements: list[str]  # the answer's sentences, or why there is none, plus a note when no target is set

    @property
    def ceiling_identified(self) -> bool:
        return self.answer is not None and self.answer.ceiling.identified

    def tables(self) -> list[pd.DataFrame]:
        """What notebook 06 displays: the local slope, the ceiling test, doublings per target (when any)."""
        if self.answer is None:
            return []
        tables = [pd.Series({key: value for key, value in self.answer.slope.to_dict().items()
                             if key not in ("statement", "data_sizes", "accept_lengths")}).to_frame("local slope"),
                  pd.Series({key: value for key, value in self.answer.ceiling.to_dict().items()
                             if key not in ("statement", "saturating_fit")}).to_frame("ceiling")]
        if self.answer.doublings_needed:
            tables.append(pd.DataFrame(self.answer.doublings_needed).drop(columns=["statement"]).round(2))
        return tables


def sweep_scaling(
    acceptance: SweepAcceptance,
    break_even_accept_length: float,
    max_accept_length: float,
    confidence: float,
    target_accept_length: float | None = None,
    lower_bound_sizes: Collection[float] = (),
) -> SweepScaling:
    """`scaling.scaling_answer` on the pooled curve ("all", else the only dataset), sized for break-even and,
    when set, the target accept length. `lower_bound_sizes`: sizes whose drafts the step cap stopped while
    still improving (`SweepRecord.still_improving()`), marked as lower bounds in the slope and the points."""
    pooled = "all" if "all" in acceptance.pooled_replicates else str(acceptance.summary["dataset"].iloc[0])
    overall = acceptance.summary[acceptance.summary["dataset"] == pooled].sort_values("data_size")
    lower_bounds = sorted(lower_bound_sizes)
    points = acceptance.summary.assign(lower_bound=acceptance.summary["data_size"].astype(float).isin(lower_bounds)
                                       & (acceptance.summary["dataset"] == pooled))
    targets = [("break-even", break_even_accept_length)] + ([("target", target_accept_length)] if target_accept_length is not None else [])
    answer = None
    if overall["data_size"].nunique() >= 2:
        answer = scaling_answer(overall["data_size"].to_numpy(), overall["tau_pooled"].to_numpy(), acceptance.pooled_replicates[pooled],
                                max_accept_length=max_accept_length, targets=targets, confidence=confidence, lower_bound_sizes=lower_bounds)
        statements = answer.statements
    else:
        statements = [f"No slope: the sweep measured {overall['data_size'].nunique()} data size; add sizes to training.data_sizes."]
    if target_accept_length is None:
        statements.append("No target accept length is set (analysis.target_accept_length), so only break-even is sized.")
    return SweepScaling(pooled_dataset=pooled, overall=overall, points=points, answer=answer, statements=statements)


def analysis_summary_record(
    topology: Topology,
    heldout_samples: int,
    scaling: SweepScaling,
    embedded_case: BreakEven,
    seed_case: BreakEven | None,
    loop_summary: Mapping[str, Any],
    benchmark_file: str | None = None,
    benchmark_summary: pd.DataFrame | None = None,
) -> dict[str, Any]:
    """`analysis/scaling_summary.json` as far as the scaling answer: later cells add "topology_sweep",
    "ablation", "serving" and "stage_seconds" (write it with `write_summary_record`)."""
    return {
        "topology": topology.to_dict(),
        "heldout_samples": heldout_samples,
        "points": scaling.points.to_dict(orient="records"),
        "scaling": None if scaling.answer is None else scaling.answer.to_dict(),
        "statements": scaling.statements,
        "benchmark": None if benchmark_summary is None else {"file": benchmark_file,
                                                             "summary": benchmark_summary.to_dict(orient="records")},
        "break_even": embedded_case.to_dict(),
        # None: no serving timings given
        "seed_break_even": None if seed_case is None else seed_case.to_dict(),
        "speculative_loop": dict(loop_summary),
    }


def write_summary_record(path: str | os.PathLike, record: Mapping[str, Any]) -> None:
    """Write the record as JSON; numpy scalars (pandas rows hold them) become plain numbers."""
    write_json(path, json.loads(json.dumps(record, default=float)))


def headline_metrics(
    topology: Topology,
    scaling: SweepScaling,
    loop_summary: Mapping[str, Any],
    embedded_case: BreakEven,
    seed_case: BreakEven | None,
    lower_bound_sizes: Collection[float],
    stage_seconds: float,
) -> dict[str, Any]:
    """The `headline` metrics event: the largest draft's held-out tau with its interval, the real loop, both
    break-evens, the slope per doubling, whether a ceiling is identified and doublings needed per target."""
    largest = scaling.overall.iloc[-1]
    answer = scaling.answer
    return {
        **topology.to_dict(),
        "largest_data_size": float(largest["data_size"]),
        "tau_offline_largest": float(largest["tau_pooled"]),
        "tau_offline_largest_low": float(largest["tau_pooled_low"]),
        "tau_offline_largest_high": float(largest["tau_pooled_high"]),
        "tau_loop": loop_summary["tau_loop_pooled"],
        "tau_loop_offline_same_prompts": loop_summary["tau_offline_pooled"],
        "loop_speedup": loop_summary["speedup"],
        "outputs_equal": loop_summary["outputs_equal"],
        "break_even_embedded": embedded_case.break_even_accept_length,
        "break_even_seed": None if seed_case is None else seed_case.break_even_accept_length,
        "slope_per_doubling": None if answer is None else answer.slope.slope,
        "slope_low": None if answer is None else answer.slope.slope_low,
        "slope_high": None if answer is None else answer.slope.slope_high,
        "ceiling_identified": scaling.ceiling_identified,
        "lower_bound_sizes": sorted(lower_bound_sizes),
        "doublings_needed": {} if answer is None else {item["label"]: item["doublings"] for item in answer.doublings_needed},
        "stage_seconds": stage_seconds,
    }


def answer_in_words(
    acceptance: SweepAcceptance,
    pooled_dataset: str,
    topology: Topology,
    heldout_samples: int,
    confidence: float,
    embedded_case: BreakEven,
    loop_summary: dict,
    scaling_statements: Sequence[str],
    seed_case: BreakEven | None,
    benchmark_summary: pd.DataFrame | None = None,
    benchmark_name: str = "",
) -> list[str]:
    """The answer as paragraphs: held-out tau from the smallest to the largest draft with its interval, the
    paired-bootstrap gain between them, the real loop against break-even, the scaling statements, the
    benchmark curve (when measured) and the serving timings of params.analysis (when given). Intervals are at
    `confidence`."""
    overall = acceptance.summary[acceptance.summary["dataset"] == pooled_dataset].sort_values("data_size")
    first, last = overall.iloc[0], overall.iloc[-1]
    lines = [f"On {heldout_samples} held-out samples, a greedy {topology.label} (ceiling tau {topology.ceiling:g}): tau went from "
             f"{first['tau_pooled']:.2f} with {first['data_size']:g} training samples to {last['tau_pooled']:.2f} "
             f"({confidence:.0%} interval {last['tau_pooled_low']:.2f}-{last['tau_pooled_high']:.2f}) with {last['data_size']:g}."]
    # The same resampled held-out sets score every draft, so the difference of two columns is a paired
    # interval.
    replicates = acceptance.pooled_replicates[pooled_dataset]  # (R, sizes), columns ascending in data size
    gain_low, gain_high = (float(bound) for bound in percentile_interval(replicates[:, -1] - replicates[:, 0], confidence))
    lines.append(f"More data {'helped' if gain_low > 0 else 'did not measurably help'} here: the paired bootstrap puts the gain from "
                 f"the smallest to the largest draft at {gain_low:+.3f} to {gain_high:+.3f} ({confidence:.0%} interval).")
    speedup = loop_summary["speedup"]
    lines.append(f"On this machine the embedded loop needs tau above {embedded_case.break_even_accept_length:.2f} to beat plain decoding; "
                 f"the largest draft reached {loop_summary['tau_loop_pooled']:.2f} in the real loop (offline estimate on the same prompts "
                 f"{loop_summary['tau_offline_pooled']:.2f}), so speculation ran at {speedup:.2f}x plain greedy decoding "
                 f"({'faster' if speedup > 1 else 'slower'}), outputs identical: {loop_summary['outputs_equal']}.")
    lines.extend(scaling_statements)
    if benchmark_summary is not None and len(benchmark_summary):
        first_bench, last_bench = benchmark_summary.iloc[0], benchmark_summary.iloc[-1]
        lines.append(f"On {int(last_bench['prompts'])} benchmark prompts from outside the training data ({benchmark_name}), the real "
                     f"loop's tau went from {first_bench['tau']:.2f} ({first_bench['data_size']:g} samples) to {last_bench['tau']:.2f} "
                     f"({confidence:.0%} interval {last_bench['tau_low']:.2f}-{last_bench['tau_high']:.2f}) with "
                     f"{last_bench['data_size']:g}.")
    if seed_case is None:
        return lines
    lines.append(f"For the serving timings of params.analysis ({seed_case.baseline_tokens_per_s:g} tok/s plain, "
                 f"{seed_case.speculative_tokens_per_s:g} tok/s at tau {seed_case.accept_length:g}) the draft must reach tau "
                 f"{seed_case.break_even_accept_length:.2f} to break even.")
    return lines


def forecast_answer(
    acceptance: SweepAcceptance,
    scaling: SweepScaling,
    planned_sizes: Sequence[float],
    break_evens: Mapping[str, float],
    max_accept_length: float,
    confidence: float,
    full_size: float | None = None,
    lower_bound_sizes: Collection[float] = (),
    seed_accept_lengths: Mapping[float, Sequence[float]] | None = None,
    looks: int = 1,
    seed: int = 0,
) -> AnswerFile:
    """analysis/answer.json's content: `forecast.forecast` on the pooled held-out curve the scaling answer
    reads, once per break-even case (label -> tau; the first is the primary line, `break_even_cases`), over
    `planned_sizes` (training.data_sizes) and the full data when known. `seed_accept_lengths`: pooled tau of
    extra-seed drafts per size (the training noise); `looks`: the verdicts the run issues
    (`forecast.forecast`). The leave-one-size-out errors are the scaling answer's, handed over, not refitted:
    so `max_accept_length` must be the one `sweep_scaling` was given."""
    if not break_evens:
        raise ValueError("no break-even case: give serving timings (params.analysis) or measure the embedded loop")
    ceiling = None if scaling.answer is None else scaling.answer.ceiling  # its leave-one-size-out errors are reused
    if ceiling is not None and ceiling.fit is not None and ceiling.fit.ceiling != max_accept_length:
        raise ValueError(f"the scaling answer was fitted under the ceiling {ceiling.fit.ceiling:g}, the forecast is asked for "
                         f"{max_accept_length:g}: give sweep_scaling and forecast_answer one max_accept_length")
    overall = scaling.overall
    # (R, sizes): sweep_acceptance's columns ascend in data size, as overall's rows do
    replicates = acceptance.pooled_replicates[scaling.pooled_dataset]
    forecasts = {label: forecast(overall["data_size"].to_numpy(float), overall["tau_pooled"].to_numpy(float), replicates,
                                 planned_sizes=planned_sizes, full_size=full_size, break_even=break_even,
                                 max_accept_length=max_accept_length, confidence=confidence, lower_bound_sizes=sorted(lower_bound_sizes),
                                 seed_accept_lengths=seed_accept_lengths, looks=looks, seed=seed,
                                 loo_error=None if ceiling is None else ceiling.loo_error)
                 for label, break_even in break_evens.items()}
    return AnswerFile(primary=next(iter(break_evens)), forecasts=forecasts, sizes=[float(size) for size in overall["data_size"]],
                      planned_sizes=sorted(float(size) for size in planned_sizes),
                      updated=datetime.now(timezone.utc).isoformat(timespec="seconds"))
