"""The go / no-go forecast: from the data sizes measured so far, tau at each planned size and at the full
data, the size at which tau crosses break-even, and one plain line (go / no-go / not yet known).

It never claims more than the sizes support:
- 1 size: the measured point and its interval.
- 2 sizes: the local slope per doubling (`scaling.local_slope`) and "at the measured slope, k more doublings"
  to break-even, only as far as the reach below; no curve, no predicted tau, no crossing size.
- 3 or more sizes: tau at the planned sizes and the horizon (the full data, else the largest planned size),
  each at most MAX_DOUBLINGS_BEYOND doublings past the largest measured size. Beyond that the sizes say
  nothing that a number could carry, and the line says so in words.

**Four curve families**, each refitted on every bootstrap replicate (`FAMILIES`). Three to five sizes cannot
tell a line from a curve that bends, accelerates or stops just past the data, and accept length measured
against data size does all of these (docs/forecast.md backtests knees and S-curves). So no family is preferred
for the
interval: it is the **union** of the four families' percentile intervals, and it covers a truth of any of
these shapes at least at its stated level. The point forecast ("the measured shape") is the log-linear and
saturating fits averaged: equal weights below 5 sizes (3 points fit the 3-parameter curve exactly, so nothing
ranks them), inverse leave-one-size-out mean squared error from 5 (Bates and Granger).

**Two sources of noise** are in every replicate: the held-out set (paired bootstrap replicates, the same
resampled samples scoring every size) and draft-to-draft training noise (another seed at the same size scores
differently, which resampling the held-out set cannot see). Training noise is measured when extra seeds were
trained (`seed_accept_lengths`) and otherwise taken from a prior measured on the kit (TRAINING_NOISE_PRIOR);
both are pooled as a scaled inverse chi-square, so a variance from few seeds widens the interval as a t would.

**The verdict** at the horizon, at one-sided level (1 - confidence) / looks, `looks` being the verdicts the
run issues (a staged run re-forecasts after every size; Bonferroni keeps the chance that any of them is a
wrong "go" within 1 - confidence):
- "go" when the largest measured draft's lower bound clears break-even. More data does not lower tau, so the
  full data's draft clears it too; no forecast can give a "go" earlier, because the "plateau" family (a knee
  just past the data) is always possible and stays where the data end.
- "no-go" when even the highest family's upper bound at the horizon stays below break-even, and no size it
  rests on was stopped by the step cap (a capped draft's tau is a lower bound, so its forecast is too): then
  "not yet known (capped sizes are lower bounds)".
- a horizon already measured (the full data was trained) is read as that measurement, "go" or "no-go" by its
  bounds ("no-go" unless that draft itself is a lower bound: a smaller size's does not move it).
- else "not yet known", with what the measured shape says and what would decide it.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from eaglekit.analysis.curves import (FAMILIES, MEASURED_SHAPE, FamilyFits, first_crossing, leave_one_size_out_errors, sorted_points,
                                     union_interval)
from eaglekit.analysis.scaling import MAX_DOUBLINGS_BEYOND, LocalSlope, local_slope, sizes_text
from eaglekit.io import write_json

# Draft-to-draft training noise (sd of tau between drafts of one size, same held-out set) and its degrees of
# freedom, used when no second seed was trained: docs/forecast.md, "Training noise".
TRAINING_NOISE_PRIOR = (0.013, 4)
# Sizes from which the saturating model can be scored on a left-out size (4 to fit, 1 to predict).
SIZES_TO_RANK_MODELS = 5
# Points per doubling of the grid on which crossing sizes are read.
CROSSING_GRID_PER_DOUBLING = 50

VERDICTS = ("go", "no-go", "not yet known")


# --------------------------------------------------------------------------- the bootstrap the forecast reads

def paired_bootstrap_means(per_sample: np.ndarray, num_resamples: int = 1000, seed: int = 0) -> np.ndarray:
    """(m, n) per-held-out-sample values (m samples, each scored by every size's draft) -> (R, n) replicate
    means, the same resampled samples for every size (paired). The kit's stage 6 gets its replicates from
    `acceptance.sweep_acceptance` (pooled over positions); this is for per-sample tau
    (bench/forecast_backtest.py, the tests)."""
    values = np.asarray(per_sample, dtype=np.float64)
    if values.ndim != 2 or len(values) < 2:
        raise ValueError(f"per_sample must be (samples, sizes) with at least 2 samples, got {values.shape}")
    rows = np.random.default_rng(seed).integers(0, len(values), size=(num_resamples, len(values)))
    return values[rows].mean(axis=1)  # (R, m, n) -> (R, n)


@dataclass(frozen=True)
class TrainingNoise:
    """Draft-to-draft training noise: the sd of tau between drafts trained on the same samples with other
    seeds."""

    sd: float
    degrees_of_freedom: int
    seeds_by_size: dict[float, int]  # extra drafts measured per size ({} when only the prior is used)
    source: str


def training_noise(accept_lengths: Mapping[float, float], seed_accept_lengths: Mapping[float, Sequence[float]] | None) -> TrainingNoise:
    """The prior pooled with the seed-to-seed variance of every size that has extra seeds (the measured tau
    and its seeds' taus at that size). Pooled over sizes: two or three seeds per size estimate a variance too
    poorly alone."""
    prior_sd, prior_df = TRAINING_NOISE_PRIOR
    squares, degrees = prior_sd**2 * prior_df, prior_df
    seeds: dict[float, int] = {}
    for size, extra in (seed_accept_lengths or {}).items():
        if float(size) not in accept_lengths:
            raise ValueError(f"seed_accept_lengths names size {size:g}, which was not measured ({sorted(accept_lengths)})")
        values = np.array([accept_lengths[float(size)], *extra], dtype=np.float64)
        if len(values) > 1:
            squares += float(((values - values.mean()) ** 2).sum())
            degrees += len(values) - 1
            seeds[float(size)] = len(values) - 1
    source = (f"prior sd {prior_sd} ({prior_df} degrees of freedom)" if not seeds else
              f"prior sd {prior_sd} ({prior_df} df) pooled with {sum(seeds.values())} extra seeds at sizes "
              + sizes_text(sorted(seeds)))
    return TrainingNoise(sd=math.sqrt(squares / degrees), degrees_of_freedom=degrees, seeds_by_size=seeds, source=source)


def with_training_noise(replicates: np.ndarray, noise: TrainingNoise, seed: int) -> np.ndarray:
    """(R, n) held-out replicates plus each size's own training noise: every size is a separate draft, so the
    noise is independent across sizes. Each replicate draws its sd from the variance's posterior (scaled
    inverse chi-square), so an sd known from few degrees of freedom gives heavier tails."""
    rng = np.random.default_rng(seed)
    sd = noise.sd * np.sqrt(noise.degrees_of_freedom / rng.chisquare(noise.degrees_of_freedom, size=(len(replicates), 1)))
    return replicates + sd * rng.standard_normal(replicates.shape)


# ----------------------------------------------------------------------------- the forecast

@dataclass(frozen=True)
class SizeForecast:
    """tau forecast at one data size: the measured-shape point and the union interval over the families."""

    data_size: float
    tau: float
    tau_low: float
    tau_high: float
    by_model: dict[str, float]  # each family's point prediction
    # True when this size was measured (then tau is the measurement, its interval the held-out one)
    measured: bool


Crossing = float | str  # a size, or "beyond N" when past the reach of the forecast


@dataclass(frozen=True, kw_only=True)
class Forecast:
    """What the measured sizes say about the planned ones; see the module docstring for what each part
    needs. A part the measured sizes cannot carry keeps its empty default."""

    data_sizes: list[float]  # measured, ascending
    accept_lengths: list[float]  # (n,) measured tau per size
    # (n,) held-out percentile intervals of the measured tau
    accept_length_intervals: list[tuple[float, float]]
    planned_sizes: list[float]
    full_size: float | None
    break_even: float | None
    confidence: float
    slope: dict[str, Any] | None = None  # scaling.LocalSlope.to_dict(), from 2 sizes, training noise included
    # the point forecast's weights over MEASURED_SHAPE; {} below 3 sizes
    model_weights: dict[str, float] = field(default_factory=dict)
    weight_rule: str = ""
    loo_rmse: dict[str, float | None] = field(default_factory=dict)
    # planned sizes and the horizon within reach; [] below 3 sizes
    predictions: list[SizeForecast] = field(default_factory=list)
    # where the measured shape reaches break-even; "beyond N" past the reach
    crossing_size: Crossing | None = None
    crossing_low: Crossing | None = None  # the union over the families
    crossing_high: Crossing | None = None
    # share of the measured shape's replicates that reach break-even by the horizon
    crossing_within_horizon: float | None = None
    horizon: float | None  # the full data, else the largest planned size
    doublings_to_horizon: float | None  # from the largest measured size
    # the largest size a tau is forecast at: the horizon or MAX_DOUBLINGS_BEYOND past the data, the smaller
    reach: float
    # (point, low, high) more doublings to break-even, 2+ sizes
    doublings_at_slope: tuple[float, float, float] | None = None
    lower_bound_sizes: list[float]
    training_noise: dict[str, Any]  # TrainingNoise as a dict
    looks: int  # verdicts the run issues; each is made at one-sided level (1 - confidence) / looks
    # the one-sided (low, high) bounds the verdict read, at the horizon
    verdict_bounds: tuple[float, float] | None = None
    verdict: str  # one of VERDICTS
    line: str  # the plain sentence that starts with the verdict
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, strict JSON: a non-finite number is written as a string ("inf")."""
        return _strict_json(json.loads(json.dumps(asdict(self), default=float)))

    def save(self, path: str | os.PathLike) -> None:
        write_json(path, self.to_dict())


def _strict_json(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "inf", "-inf", "nan"; float() reads them back
    if isinstance(value, dict):
        return {key: _strict_json(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_strict_json(item) for item in value]
    return value


def _crossing(value: float, reach: float) -> Crossing:
    return value if value <= reach else f"beyond {reach:,.0f}"


def _point_weights(sizes: np.ndarray, loo: Mapping[str, float | None]) -> tuple[dict[str, float], str]:
    """The point forecast's weights over MEASURED_SHAPE from the leave-one-size-out errors, and the rule that
    gave them."""
    if len(sizes) >= SIZES_TO_RANK_MODELS and all(loo[model] is not None for model in MEASURED_SHAPE):
        inverse = {model: 1.0 / max(float(loo[model]) ** 2, 1e-12) for model in MEASURED_SHAPE}
        weights = {model: value / sum(inverse.values()) for model, value in inverse.items()}
        return weights, "inverse leave-one-size-out mean squared error"
    return ({model: 0.5 for model in MEASURED_SHAPE},
            f"equal: with {len(sizes)} sizes the 3-parameter curve cannot be scored on a left-out size (needs {SIZES_TO_RANK_MODELS})")


def _gain_shape(sizes: np.ndarray, taus: np.ndarray, rows: np.ndarray, tail: float) -> str:
    """Gains per doubling over the lower and the upper half of the sizes, and whether their change is
    resolved: the words "shrinking" or "growing" only when the change's paired interval excludes 0."""
    middle = len(sizes) // 2
    log2_sizes = np.log2(sizes)

    # (..., n) -> per-doubling gains (...,), (...,)
    def halves(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return ((values[..., middle] - values[..., 0]) / (log2_sizes[middle] - log2_sizes[0]),
                (values[..., -1] - values[..., middle]) / (log2_sizes[-1] - log2_sizes[middle]))

    lower_gain, upper_gain = halves(taus)
    change_low, change_high = np.quantile(np.subtract(*halves(rows)[::-1]), [tail, 1.0 - tail])
    word = "shrinking" if change_high < 0 else "growing" if change_low > 0 else "no change resolved"
    return (f"per doubling {lower_gain:+.3f} from {sizes[0]:g} to {sizes[middle]:g} and {upper_gain:+.3f} from {sizes[middle]:g} to "
            f"{sizes[-1]:g} ({word}: change {upper_gain - lower_gain:+.3f}, interval {change_low:+.3f} to {change_high:+.3f})")


def forecast(
    data_sizes: Sequence[float],
    accept_lengths: Sequence[float],
    replicate_accept_lengths: np.ndarray,
    planned_sizes: Sequence[float] = (),
    full_size: float | None = None,
    break_even: float | None = None,
    max_accept_length: float = math.inf,
    confidence: float = 0.95,
    lower_bound_sizes: Sequence[float] = (),
    seed_accept_lengths: Mapping[float, Sequence[float]] | None = None,
    looks: int = 1,
    seed: int = 0,
    loo_error: Mapping[str, float | None] | None = None,
) -> Forecast:
    """The forecast from the sizes measured so far.

    data_sizes, accept_lengths: (n,) n >= 1 distinct sizes and their measured held-out tau.
    replicate_accept_lengths: (R, n) bootstrap replicates of each tau over the held-out samples, paired
      across sizes (acceptance.sweep_acceptance's pooled_replicates, or `paired_bootstrap_means`).
    planned_sizes: training.data_sizes; full_size: every sample the run will have (None: unknown).
    break_even: tau at which speculation pays off (break_even.break_even_from_throughput); None: no verdict
      beyond "not yet known" (nothing to compare with).
    max_accept_length: the chain's ceiling (steps + 1) bounding every family.
    lower_bound_sizes: sizes whose draft the step cap stopped while still improving (tau a lower bound).
    seed_accept_lengths: per size, the taus of extra drafts trained on the same samples with other seeds and
      scored on the same held-out set: they measure the training noise (else TRAINING_NOISE_PRIOR).
    looks: how many verdicts the run issues (a staged run: one per staged size and the final one).
    seed: the training-noise draws (deterministic for a given seed).
    loo_error: the leave-one-size-out errors of these points under this ceiling, when the caller has them
      (`scaling.CeilingIdentification.loo_error`, what `answer.forecast_answer` hands over); None: computed here.
    """
    sizes, taus, replicates = sorted_points(data_sizes, accept_lengths, replicate_accept_lengths)
    if len(sizes) == 0 or len(np.unique(sizes)) != len(sizes):
        raise ValueError(f"data sizes must be distinct positive sample counts, at least one; got {sizes.tolist()}")
    if looks < 1:
        raise ValueError(f"looks counts the verdicts a run issues, at least 1; got {looks}")
    noise = training_noise(dict(zip(sizes.tolist(), taus.tolist())), seed_accept_lengths)
    rows = with_training_noise(replicates, noise, seed)  # (R, n): held-out and training noise
    loo = dict(loo_error) if loo_error is not None else leave_one_size_out_errors(sizes, taus, max_accept_length)
    return _Forecaster(sizes, taus, replicates, rows, noise, planned_sizes, full_size, break_even, max_accept_length, confidence,
                       sorted(float(size) for size in lower_bound_sizes), looks, loo).run()


class _Forecaster:
    """One forecast's inputs and the steps that build it, in the order the module docstring gives them."""

    def __init__(self, sizes, taus, replicates, rows, noise: TrainingNoise, planned_sizes, full_size, break_even, ceiling, confidence,
                 lower_bounds: list[float], looks: int, loo: dict[str, float | None]):
        self.sizes, self.taus, self.rows, self.noise, self.loo = sizes, taus, rows, noise, loo
        self.break_even, self.ceiling, self.confidence, self.lower_bounds, self.looks = break_even, ceiling, confidence, lower_bounds, looks
        self.full_size = full_size
        self.tail = (1.0 - confidence) / 2.0
        # one-sided, per look (Bonferroni over the run's looks)
        self.verdict_tail = (1.0 - confidence) / looks
        self.largest = float(sizes[-1])
        self.planned = sorted({float(size) for size in planned_sizes})
        self.horizon = full_size if full_size is not None else (
            max(self.planned) if self.planned and max(self.planned) > self.largest else None)
        self.doublings_to_horizon = None if self.horizon is None else max(0.0, math.log2(self.horizon / self.largest))
        limit = self.largest * 2.0**MAX_DOUBLINGS_BEYOND
        self.reach = limit if self.horizon is None else min(limit, max(float(self.horizon), self.largest))
        self.intervals = [tuple(pair) for pair in np.quantile(replicates, [self.tail, 1.0 - self.tail], axis=0).T.tolist()]
        self.rests_on = f"from {len(sizes)} size{'s' if len(sizes) > 1 else ''} ({sizes_text(sizes)} samples)"
        self.percent = f"{confidence:.0%}"
        self.notes: list[str] = [f"Training noise: sd {noise.sd:.4f} tau per draft ({noise.source}), in every interval."]
        if lower_bounds:
            self.notes.append(f"The drafts at {sizes_text(lower_bounds)} samples were stopped by the step cap while still improving: "
                              "their tau is a lower bound, so the forecast may be low and no no-go rests on it.")

    # ---- the measured largest draft: the only ground for a "go" ------------------------------------------
    def measured_bounds(self) -> tuple[float, float]:
        """One-sided (low, high) bounds of the largest size's tau at the verdict's level, training noise
        included."""
        column = self.rows[:, -1]
        return float(np.quantile(column, self.verdict_tail)), float(np.quantile(column, 1.0 - self.verdict_tail))

    def level_text(self) -> str:
        looks = f", {self.looks} looks" if self.looks > 1 else ""
        return f"one-sided {1.0 - self.verdict_tail:.1%}{looks}, held-out and training noise"

    def measured_go(self) -> str | None:
        if self.break_even is None:
            return None
        low, _ = self.measured_bounds()
        if low < self.break_even:
            return None
        return (f"go: the draft trained on {self.largest:g} samples measures tau {self.taus[-1]:.3f}, above break-even "
                f"{self.break_even:.3f} even at its lower bound {low:.3f} ({self.level_text()}): measured, not forecast; "
                "a draft on more data of this kind is not expected to score lower.")

    def measured_at_horizon(self) -> tuple[str, str]:
        """The verdict when the horizon is already measured (the full data was trained): a measurement, not a
        forecast."""
        low, high = self.measured_bounds()
        # The full data's own draft is the measurement: a smaller size's lower bound does not move it; its own
        # does.
        if high < self.break_even and self.largest not in self.lower_bounds:
            return "no-go", (f"no-go: the draft trained on {self.largest:g} samples, the full data, measures tau "
                             f"{self.taus[-1]:.3f}, below break-even {self.break_even:.3f} even at its upper bound {high:.3f} "
                             f"({self.level_text()}): measured, not forecast; {self.rests_on}.")
        capped = " (its tau is a lower bound)" if high < self.break_even else ""
        return "not yet known", (f"not yet known{capped}: the draft trained on {self.largest:g} samples, the full data, measures tau "
                                 f"{self.taus[-1]:.3f} (bounds {low:.3f} to {high:.3f}, {self.level_text()}) against break-even "
                                 f"{self.break_even:.3f}; {self.rests_on}.")

    # ---- the build ----------------------------------------------------------------------------------------
    def run(self) -> Forecast:
        if len(self.sizes) == 1:
            return self.one_size()
        slope = local_slope(self.sizes, self.taus, self.rows, self.confidence, self.lower_bounds)
        if len(self.sizes) == 2:
            return self.two_sizes(slope)
        return self.curves(slope)

    def result(self, verdict: str, line: str, **parts: Any) -> Forecast:
        return Forecast(data_sizes=self.sizes.tolist(), accept_lengths=self.taus.tolist(), accept_length_intervals=self.intervals,
                        planned_sizes=self.planned, full_size=self.full_size, break_even=self.break_even, confidence=self.confidence,
                        horizon=self.horizon, doublings_to_horizon=self.doublings_to_horizon, reach=self.reach,
                        lower_bound_sizes=self.lower_bounds, training_noise=asdict(self.noise), looks=self.looks, notes=self.notes,
                        verdict=verdict, line=line, **parts)

    def early_verdict(self, text: str) -> tuple[str, str]:
        """One or two sizes: a measured go, a measured full data, or not yet known with `text`."""
        if (go := self.measured_go()) is not None:
            return "go", go
        if self.break_even is not None and self.horizon is not None and self.horizon <= self.largest:
            return self.measured_at_horizon()
        return "not yet known", f"not yet known: {text}"

    def one_size(self) -> Forecast:
        low, high = self.intervals[0]
        verdict, line = self.early_verdict(f"one size measured, tau {self.taus[0]:.3f} ({self.percent} interval {low:.3f}-{high:.3f}) at "
                                           f"{self.sizes[0]:g} samples; a slope needs a second size, a curve a third.")
        return self.result(verdict, line)

    def two_sizes(self, slope: LocalSlope) -> Forecast:
        text = (f"{self.rests_on} only a slope: {slope.slope:+.3f} tau per doubling ({self.percent} interval {slope.slope_low:+.3f} to "
                f"{slope.slope_high:+.3f}, training noise included)")
        doublings = slope.doublings_to(self.break_even) if self.break_even is not None else None
        if doublings is not None:
            text += "; " + self.doublings_text(*doublings)
        # (within reach, the slope's words named it)
        if self.horizon is not None and self.horizon > self.reach:
            where = "the full data" if self.full_size is not None else "the largest planned size"
            text += f"; {where} ({self.horizon:,.0f} samples) is {self.doublings_to_horizon:.1f} doublings away"
        verdict, line = self.early_verdict(text + ". A third size is needed before a curve, a predicted tau or a crossing size.")
        if verdict != "not yet known":
            self.notes.append(text)
        return self.result(verdict, line, slope=slope.to_dict(), doublings_at_slope=doublings)

    def doublings_text(self, point: float, low: float, high: float) -> str:
        """"At the measured slope, k more doublings" only as far as the reach: past it, words, not a
        number."""
        reach_doublings = math.log2(self.reach / self.largest)
        where = (f"{self.reach:,.0f} samples, " + ("the full data" if self.full_size is not None and self.reach == self.full_size else
                                                   "the largest planned size" if self.reach == self.horizon else
                                                   "the furthest a slope is read"))
        if not math.isfinite(point):
            return f"at the measured slope (not positive) break-even {self.break_even:.3f} is not reached"
        if point > reach_doublings:
            return f"at the measured slope break-even {self.break_even:.3f} is not reached within {reach_doublings:.1f} doublings ({where})"
        upper = f"{high:.1f}" if high <= reach_doublings else f"more than {reach_doublings:.1f}"
        return (f"at the measured slope break-even {self.break_even:.3f} is {point:.1f} more doublings away ({self.percent} interval "
                f"{low:.1f} to {upper}; {reach_doublings:.1f} doublings reach {where})")

    def curves(self, slope: LocalSlope) -> Forecast:
        sizes, taus = self.sizes, self.taus
        self.fits = FamilyFits.fit(sizes, self.rows, self.ceiling)
        self.point_fits = FamilyFits.fit(sizes, taus[None, :], self.ceiling)
        weights, rule = _point_weights(sizes, self.loo)
        shape = _gain_shape(sizes, taus, self.rows, self.tail)
        wanted = sorted({size for size in self.planned if size > self.largest}
                        | ({float(self.horizon)} if self.horizon is not None and self.horizon > self.largest else set()))
        within = [size for size in wanted if size <= self.reach * (1 + 1e-9)]
        beyond = [size for size in wanted if size not in within]
        predictions = [SizeForecast(float(size), float(tau), *interval, by_model={}, measured=True)
                       for size, tau, interval in zip(sizes, taus, self.intervals) if size in self.planned]
        if within:
            curves, points = self.fits.at(within), self.point_fits.at(within)
            low, high = union_interval(curves, self.tail, self.tail)
            for column, size in enumerate(within):
                point = sum(weights[model] * float(points[model][0, column]) for model in MEASURED_SHAPE)
                predictions.append(SizeForecast(size, point, float(low[column]), float(high[column]),
                                                {model: float(points[model][0, column]) for model in FAMILIES}, False))
        if beyond:
            self.notes.append(f"Not forecast: {sizes_text(beyond)} samples, more than {MAX_DOUBLINGS_BEYOND:g} doublings beyond the "
                              f"largest measured size ({self.largest:g}).")
        parts = dict(slope=slope.to_dict(), model_weights=weights, weight_rule=rule, loo_rmse=self.loo, predictions=predictions,
                     doublings_at_slope=slope.doublings_to(self.break_even) if self.break_even is not None else None)
        if self.break_even is None:
            return self.result("not yet known", f"not yet known: no break-even tau to compare with (measure the serving timings); "
                               f"{self.rests_on}, {shape}.", **parts)
        parts.update(self.crossing(weights))
        verdict, line, bounds = self.verdict_from_curves(predictions, shape, parts)
        return self.result(verdict, line, verdict_bounds=bounds, **parts)

    def crossing(self, weights: Mapping[str, float]) -> dict[str, Any]:
        """Where tau reaches break-even, read on a grid up to the reach: the measured shape's point and the
        union of the families' intervals; past the reach, "beyond N"."""
        if self.reach <= self.largest:
            return {}
        count = max(2, int(math.log2(self.reach / self.largest) * CROSSING_GRID_PER_DOUBLING))
        grid = np.geomspace(self.largest, self.reach, count)
        curves, points = self.fits.at(grid), self.point_fits.at(grid)
        point_curve = sum(weights[model] * points[model] for model in MEASURED_SHAPE)
        crossings = {name: first_crossing(grid, curve, self.break_even) for name, curve in curves.items()}
        # "nearest": a quantile between a size and inf is one of them, never NaN.
        low, high = (float(bound) for bound in union_interval(crossings, self.tail, self.tail, method="nearest"))
        pooled = np.concatenate([crossings[model] for model in MEASURED_SHAPE])
        mixture = np.concatenate([np.full(len(crossings[model]), weights[model]) for model in MEASURED_SHAPE])
        within = None if self.horizon is None else float(mixture[pooled <= self.horizon].sum() / mixture.sum())
        point = float(first_crossing(grid, point_curve, self.break_even)[0])
        return dict(crossing_size=_crossing(point, self.reach), crossing_low=_crossing(low, self.reach),
                    crossing_high=_crossing(high, self.reach), crossing_within_horizon=within)

    def verdict_from_curves(self, predictions: list[SizeForecast], shape: str,
                            parts: Mapping[str, Any]) -> tuple[str, str, tuple[float, float] | None]:
        be = self.break_even
        if (go := self.measured_go()) is not None:
            return "go", go, self.measured_bounds()
        if self.horizon is None:
            return "not yet known", (f"not yet known: no size beyond the largest measured ({self.largest:g}) is planned or known, so "
                                     f"there is nothing to forecast against break-even {be:.3f} (set analysis.full_data_size); "
                                     f"{self.rests_on}."), None
        if self.horizon <= self.largest:
            return (*self.measured_at_horizon(), self.measured_bounds())
        if self.horizon > self.reach * (1 + 1e-9):
            return "not yet known", (f"not yet known: the horizon ({self.horizon:,.0f} samples) is {self.doublings_to_horizon:.1f} "
                                     f"doublings beyond the largest measured size ({self.largest:g}), past the "
                                     f"{MAX_DOUBLINGS_BEYOND:g} a forecast extrapolates: measure a size within "
                                     f"{MAX_DOUBLINGS_BEYOND:g} doublings of it; {self.rests_on}, {shape}."), None
        at = next(item for item in predictions if item.data_size == float(self.horizon))
        curves = self.fits.at([float(self.horizon)])
        low, high = (float(bound[0]) for bound in union_interval(curves, self.verdict_tail, self.verdict_tail))
        where = (f"at {at.data_size:,.0f} samples ({self.doublings_to_horizon:.1f} doublings beyond {self.largest:g}) tau is "
                 f"forecast {at.tau:.3f} under the measured shape ({self.percent} interval {at.tau_low:.3f}-{at.tau_high:.3f} "
                 "over the curve families: "
                 + ", ".join(f"{name} {at.by_model[name]:.3f}" for name in FAMILIES) + ")")
        if high < be:
            if self.lower_bounds:
                return "not yet known", (f"not yet known (capped sizes are lower bounds): {where}, below break-even {be:.3f} even at the "
                                         f"highest family's upper bound {high:.3f} ({self.level_text()}), but the drafts at "
                                         f"{sizes_text(self.lower_bounds)} samples were stopped by the step cap while still improving, so "
                                         "their tau and this forecast are lower bounds (raise training.max_steps); "
                                         f"{self.rests_on}, {shape}."), (low, high)
            return "no-go", (f"no-go: {where}, below break-even {be:.3f} even at the highest family's upper bound {high:.3f} "
                             f"({self.level_text()}): not within {self.doublings_to_horizon:.1f} doublings; "
                             f"{self.rests_on}, {shape}."), (low, high)
        crossing = parts.get("crossing_size")
        cross = ("" if crossing is None else
                 f"; the measured shape crosses break-even at {crossing:,.0f} samples" if not isinstance(crossing, str) else
                 f"; the measured shape crosses break-even {crossing} samples")
        return "not yet known", (f"not yet known: {where}, an interval that contains break-even {be:.3f}{cross}. A 'go' needs a measured "
                                 f"draft above break-even: no size can rule out that the curve stops rising past it; {self.rests_on}, "
                                 f"{shape}."), (low, high)


# ----------------------------------------------------------------------------- analysis/answer.json

ANSWER_FILE = "answer.json"


@dataclass(frozen=True)
class AnswerFile:
    """analysis/answer.json: the current forecast with the sizes it rests on, one per break-even case.

    `primary` names the case the plain line is for: the user's serving timings when given (params.analysis),
    else the run's own target (the embedded loop), with any other case beside it. Stage 6 rewrites it after
    every size it scores (a staged run rewrites it after each size), atomically, so a reader never sees half a
    file.
    """

    primary: str
    forecasts: dict[str, Forecast]
    sizes: list[float]  # the measured sizes every forecast rests on
    planned_sizes: list[float]
    updated: str  # UTC ISO time of the write

    @property
    def line(self) -> str:
        return self.forecasts[self.primary].line

    @property
    def verdict(self) -> str:
        return self.forecasts[self.primary].verdict

    def to_dict(self) -> dict[str, Any]:
        return {"primary": self.primary, "verdict": self.verdict, "line": self.line, "sizes": self.sizes,
                "planned_sizes": self.planned_sizes, "updated": self.updated,
                "forecasts": {name: item.to_dict() for name, item in self.forecasts.items()}}

    def save(self, path: str | os.PathLike) -> None:
        write_json(path, self.to_dict())
