"""The go / no-go forecast: from the data sizes measured so far, tau at each planned size and at the full data,
the size at which tau crosses break-even, and one plain line (go / no-go / not yet known).

It never claims more than the sizes support:
- 1 size: the measured point and its interval, nothing else (a "go" only if that point already clears
  break-even by its whole interval: a measurement, not a forecast).
- 2 sizes: the local slope per doubling and its paired-bootstrap interval (`scaling.local_slope`), and
  "at the measured slope, k more doublings" to break-even; no curve, no predicted tau, no crossing size.
- 3 or more sizes: both curves of `scaling` (the log-linear line, 2 parameters, and the saturating power law
  tau_inf - b N^-c, 3 parameters) refitted on every paired bootstrap replicate of the held-out set, and the
  forecast is their **model-averaged bootstrap**: the pooled replicate predictions of both models, each model
  weighted by w_m. So the interval carries both the held-out sampling noise (the replicates) and the choice
  of curve (the mixture), which is the uncertainty that dominates any extrapolation.

The model weights: with fewer than 5 sizes the saturating model cannot be tested on a left-out size (3 points
fit it exactly; `scaling.leave_one_size_out_error` returns None), so nothing measured ranks the two curves and
each gets 1/2. From 5 sizes on, weights are inverse leave-one-size-out mean squared error (Bates and Granger's
forecast combination), the rule `scaling` already uses to choose a model, made soft so a curve that predicts
left-out sizes nearly as well still widens the interval. Equal weights are deliberate: a line keeps rising
and a saturating curve flattens, and with 3-4 sizes the data cannot tell them apart far beyond the largest
size, so the interval must span both.

The saturating model is fitted here by profile least squares over a fixed grid of exponents (for each c the
model is linear in tau_inf and b), vectorized over all replicates, under `scaling`'s bounds (1 <= tau_inf <=
the chain's ceiling, b >= 0, 0 < c <= 5): no refit can fail, so none is dropped.

The verdict, against the break-even tau from measured timings (`break_even`), at the horizon (the full data,
else the largest planned size): "go" when the lower end of the forecast interval there clears break-even (or
a measured draft already does), "no-go" when even the upper end stays below it, else "not yet known".
What the intervals do not include: draft-to-draft training noise (a second draft at the same size trained
with another seed scores differently), which held-out resampling cannot see; docs/forecast.md measures how
much that matters in the backtest.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from eaglekit.analysis.scaling import MAX_EXPONENT, LocalSlope, leave_one_size_out_error, local_slope
from eaglekit.io import write_json

# Exponents of the saturating model's profile fit: log-spaced over scaling's bounds (0, MAX_EXPONENT].
EXPONENT_GRID = np.geomspace(1e-3, MAX_EXPONENT, 240)
# Sizes from which the saturating model can be scored on a left-out size (4 to fit, 1 to predict).
SIZES_TO_RANK_MODELS = 5

VERDICTS = ("go", "no-go", "not yet known")


# ----------------------------------------------------------------------------- the bootstrap the forecast reads

def paired_bootstrap_means(per_sample: np.ndarray, num_resamples: int = 1000, seed: int = 0) -> np.ndarray:
    """(m, n) per-held-out-sample values (m samples, each scored by every size's draft) -> (R, n) replicate
    means, the same resampled samples for every size (paired). The kit's stage 6 gets its replicates from
    `acceptance.sweep_acceptance` (pooled over positions); this is for per-sample tau, as in the tests."""
    values = np.asarray(per_sample, dtype=np.float64)
    if values.ndim != 2 or len(values) < 2:
        raise ValueError(f"per_sample must be (samples, sizes) with at least 2 samples, got {values.shape}")
    rows = np.random.default_rng(seed).integers(0, len(values), size=(num_resamples, len(values)))
    return values[rows].mean(axis=1)  # (R, m, n) -> (R, n)


# ----------------------------------------------------------------------------- the two curves, on every replicate

def fit_log_linear_rows(sizes: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Least squares tau = intercept + slope log2 N on every row: (R, n) -> (R, 2) (intercept, slope)."""
    log2_sizes = np.log2(sizes)
    centered = log2_sizes - log2_sizes.mean()
    slope = (rows - rows.mean(axis=1, keepdims=True)) @ centered / float(centered @ centered)
    return np.column_stack([rows.mean(axis=1) - slope * log2_sizes.mean(), slope])


def fit_saturating_rows(sizes: np.ndarray, rows: np.ndarray, ceiling: float) -> np.ndarray:
    """tau = tau_inf - gap (N / N_min)^-c on every row by profile least squares over EXPONENT_GRID:
    (R, n) -> (R, 3) (tau_inf, gap, c), with 1 <= tau_inf <= ceiling and gap >= 0."""
    relative = sizes / sizes.min()
    basis = relative[None, :] ** (-EXPONENT_GRID[:, None])  # (C, n): x = (N / N_min)^-c per exponent
    basis_mean = basis.mean(axis=1)  # (C,)
    basis_centered = basis - basis_mean[:, None]
    rows_mean = rows.mean(axis=1)  # (R,)
    # Unconstrained tau = a - g x: g = -cov(x, y) / var(x), a = mean(y) + g mean(x).  (R, C)
    gap = -(rows - rows_mean[:, None]) @ basis_centered.T / (basis_centered ** 2).sum(axis=1)[None, :]
    gap = np.maximum(gap, 0.0)  # a falling curve is fitted flat (gap 0)
    tau_inf = rows_mean[:, None] + gap * basis_mean[None, :]
    # Where the ceiling (or 1) binds, refit the gap with tau_inf fixed there: g = sum((a - y) x) / sum(x^2).
    bound = np.clip(tau_inf, 1.0, ceiling)
    refit = np.maximum((bound * basis.sum(axis=1)[None, :] - rows @ basis.T) / (basis ** 2).sum(axis=1)[None, :], 0.0)
    clipped = bound != tau_inf
    gap = np.where(clipped, refit, gap)
    tau_inf = bound
    # (R, C, n) residuals of every row under every exponent; the best exponent per row.
    fitted = tau_inf[:, :, None] - gap[:, :, None] * basis[None, :, :]
    errors = ((rows[:, None, :] - fitted) ** 2).sum(axis=2)
    best = errors.argmin(axis=1)
    pick = np.arange(len(rows))
    return np.column_stack([tau_inf[pick, best], gap[pick, best], EXPONENT_GRID[best]])


def predict_rows(model: str, params: np.ndarray, reference_size: float, sizes: np.ndarray) -> np.ndarray:
    """(R, p) parameters -> (R, len(sizes)) tau."""
    sizes = np.asarray(sizes, dtype=np.float64)
    if model == "log-linear":
        return params[:, :1] + params[:, 1:2] * np.log2(sizes)[None, :]
    return params[:, :1] - params[:, 1:2] * (sizes[None, :] / reference_size) ** (-params[:, 2:3])


def crossing_rows(model: str, params: np.ndarray, reference_size: float, target: float) -> np.ndarray:
    """(R,) the data size at which each curve reaches `target` tau; inf where it never does."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if model == "log-linear":
            intercept, slope = params[:, 0], params[:, 1]
            return np.where(slope > 0, 2.0 ** ((target - intercept) / np.where(slope > 0, slope, 1.0)), np.inf)
        tau_inf, gap, exponent = params[:, 0], params[:, 1], params[:, 2]
        reaches = (tau_inf > target) & (gap > 0)
        ratio = np.where(reaches, gap / np.where(reaches, tau_inf - target, 1.0), 1.0)
        size = reference_size * ratio ** (1.0 / exponent)
        return np.where(reaches, size, np.where(tau_inf >= target, reference_size, np.inf))


def weighted_quantiles(values: np.ndarray, weights: np.ndarray, quantiles: Sequence[float]) -> list[float]:
    """Quantiles of a weighted sample, "nearest" style (no interpolation, so inf stays inf)."""
    order = np.argsort(values, kind="stable")
    cumulative = np.cumsum(weights[order]) / weights.sum()
    return [float(values[order][min(int(np.searchsorted(cumulative, q, side="left")), len(values) - 1)]) for q in quantiles]


# ----------------------------------------------------------------------------- the forecast

@dataclass(frozen=True)
class SizeForecast:
    """tau forecast at one data size: the model-averaged point and percentile interval."""

    data_size: float
    tau: float
    tau_low: float
    tau_high: float
    by_model: dict[str, float]  # each curve's point prediction
    measured: bool  # True when this size was measured (then tau is the measurement)


@dataclass(frozen=True)
class Forecast:
    """What the measured sizes say about the planned ones; see the module docstring for what each part needs."""

    data_sizes: list[float]  # measured, ascending
    accept_lengths: list[float]  # (n,) measured tau per size
    accept_length_intervals: list[tuple[float, float]]  # (n,) percentile intervals of the measured tau
    planned_sizes: list[float]
    full_size: float | None
    break_even: float | None
    confidence: float
    slope: dict[str, Any] | None  # scaling.LocalSlope.to_dict(), from 2 sizes
    model_weights: dict[str, float]  # {} below 3 sizes
    weight_rule: str
    loo_rmse: dict[str, float | None]
    predictions: list[SizeForecast]  # planned sizes and the full data beyond the measured ones; [] below 3 sizes
    crossing_size: float | None  # model-averaged median size at which tau reaches break-even; inf: not reached
    crossing_low: float | None
    crossing_high: float | None
    crossing_within_horizon: float | None  # share of the mixture that reaches break-even by the horizon
    horizon: float | None  # the full data, else the largest planned size
    doublings_to_horizon: float | None  # from the largest measured size
    doublings_at_slope: tuple[float, float, float] | None  # (point, low, high) more doublings to break-even, 2+ sizes
    lower_bound_sizes: list[float]
    verdict: str  # one of VERDICTS
    line: str  # the plain sentence that starts with the verdict
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, strict JSON: a size never reached (inf) is written as the string "inf"."""
        return _strict_json(json.loads(json.dumps(asdict(self), default=float)))

    def save(self, path: str | os.PathLike) -> None:
        write_json(path, self.to_dict())

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> "Forecast":
        record = dict(record)
        for name in ("crossing_size", "crossing_low", "crossing_high"):
            record[name] = None if record[name] is None else float(record[name])
        record["predictions"] = [SizeForecast(**item) for item in record["predictions"]]
        record["accept_length_intervals"] = [tuple(item) for item in record["accept_length_intervals"]]
        if record["doublings_at_slope"] is not None:
            record["doublings_at_slope"] = tuple(float(value) for value in record["doublings_at_slope"])
        return cls(**record)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Forecast":
        with open(path, encoding="utf-8") as handle:
            return cls.from_dict(json.load(handle))


def _strict_json(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "inf", "-inf", "nan"; float() reads them back
    if isinstance(value, dict):
        return {key: _strict_json(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_strict_json(item) for item in value]
    return value


def _size(value: float) -> str:
    return "never" if not math.isfinite(value) else f"{value:,.0f}"


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
) -> Forecast:
    """The forecast from the sizes measured so far.

    data_sizes, accept_lengths: (n,) n >= 1 distinct sizes and their measured held-out tau.
    replicate_accept_lengths: (R, n) bootstrap replicates of each tau over the held-out samples, paired
      across sizes (acceptance.sweep_acceptance's pooled_replicates, or `paired_bootstrap_means`).
    planned_sizes: training.data_sizes; full_size: every sample the run will have (None: unknown).
    break_even: tau at which speculation pays off (break_even.break_even_from_throughput); None: no verdict
      beyond "not yet known" (nothing to compare with).
    max_accept_length: the chain's ceiling (steps + 1) bounding the saturating curve.
    """
    sizes = np.asarray(data_sizes, dtype=np.float64)
    taus = np.asarray(accept_lengths, dtype=np.float64)
    replicates = np.asarray(replicate_accept_lengths, dtype=np.float64)
    if sizes.ndim != 1 or sizes.shape != taus.shape or len(sizes) == 0:
        raise ValueError(f"data_sizes and accept_lengths must be equal-length, non-empty lists; got {sizes.shape} and {taus.shape}")
    if len(np.unique(sizes)) != len(sizes) or (sizes <= 0).any():
        raise ValueError(f"data sizes must be distinct positive sample counts, got {sizes.tolist()}")
    if replicates.ndim != 2 or replicates.shape[1] != len(sizes):
        raise ValueError(f"replicate_accept_lengths must be (R, {len(sizes)}), got {replicates.shape}")
    order = np.argsort(sizes)
    sizes, taus, replicates = sizes[order], taus[order], replicates[:, order]
    tail = (1.0 - confidence) / 2.0
    intervals = [tuple(float(bound) for bound in np.quantile(replicates[:, column], [tail, 1.0 - tail])) for column in range(len(sizes))]
    largest = float(sizes[-1])
    planned = sorted({float(size) for size in planned_sizes})
    horizon = full_size if full_size is not None else (max(planned) if planned and max(planned) > largest else None)
    doublings_to_horizon = None if horizon is None else max(0.0, math.log2(horizon / largest))
    lower_bounds = sorted(float(size) for size in lower_bound_sizes)
    rests_on = f"from {len(sizes)} size{'s' if len(sizes) > 1 else ''} ({', '.join(f'{size:g}' for size in sizes)} samples)"
    notes: list[str] = []
    if lower_bounds:
        notes.append(f"The drafts at {', '.join(f'{size:g}' for size in lower_bounds)} samples were stopped by the step cap while still "
                     "improving: their tau is a lower bound, so the forecast may be low.")

    # A measured draft that already clears break-even by its whole interval is a "go" whatever the forecast.
    measured_go = break_even is not None and any(low >= break_even for low, _ in intervals)
    measured_line = ""
    if measured_go:
        index = next(i for i, (low, _) in enumerate(intervals) if low >= break_even)
        measured_line = (f"go: the draft trained on {sizes[index]:g} samples already reaches tau {taus[index]:.3f} "
                         f"({confidence:.0%} interval {intervals[index][0]:.3f}-{intervals[index][1]:.3f}), above break-even "
                         f"{break_even:.3f}: measured, not forecast.")

    empty = dict(slope=None, model_weights={}, weight_rule="", loo_rmse={}, predictions=[], crossing_size=None, crossing_low=None,
                 crossing_high=None, crossing_within_horizon=None, doublings_at_slope=None)
    common = dict(data_sizes=sizes.tolist(), accept_lengths=taus.tolist(), accept_length_intervals=intervals, planned_sizes=planned,
                  full_size=full_size, break_even=break_even, confidence=confidence, horizon=horizon,
                  doublings_to_horizon=doublings_to_horizon, lower_bound_sizes=lower_bounds, notes=notes)

    if len(sizes) == 1:
        line = measured_line or (f"not yet known: one size measured, tau {taus[0]:.3f} ({confidence:.0%} interval {intervals[0][0]:.3f}-"
                                 f"{intervals[0][1]:.3f}) at {sizes[0]:g} samples; a slope needs a second size, a curve a third.")
        return Forecast(**common, **empty, verdict="go" if measured_go else "not yet known", line=line)

    slope: LocalSlope = local_slope(sizes, taus, replicates, confidence, lower_bounds)
    doublings = slope.doublings_to(break_even) if break_even is not None else None

    if len(sizes) == 2:
        text = (f"{rests_on} only a slope: {slope.slope:+.3f} tau per doubling ({confidence:.0%} interval {slope.slope_low:+.3f} to "
                f"{slope.slope_high:+.3f})")
        if doublings is not None and not measured_go:
            point, low, high = doublings
            if math.isfinite(point):
                text += (f"; at the measured slope break-even {break_even:.3f} is {point:.1f} more doublings away (interval {low:.1f} to "
                         f"{'never' if not math.isfinite(high) else f'{high:.1f}'})")
            else:
                text += f"; at the measured slope (not positive) break-even {break_even:.3f} is not reached"
            if doublings_to_horizon is not None:
                where = "the full data" if full_size is not None else "the largest planned size"
                text += f"; {where} ({horizon:,.0f} samples) is {doublings_to_horizon:.1f} doublings away"
        text += ". A third size is needed before a curve, a predicted tau or a crossing size."
        line = measured_line or f"not yet known: {text}"
        return Forecast(**{**common, "notes": notes + ([text] if measured_go else [])}, **{**empty, "slope": slope.to_dict(),
                        "doublings_at_slope": doublings}, verdict="go" if measured_go else "not yet known", line=line)

    # 3 or more sizes: the model-averaged bootstrap over both curves.
    fits = {"log-linear": fit_log_linear_rows(sizes, replicates),
            "saturating": fit_saturating_rows(sizes, replicates, max_accept_length)}
    points = {"log-linear": fit_log_linear_rows(sizes, taus[None, :]),
              "saturating": fit_saturating_rows(sizes, taus[None, :], max_accept_length)}
    loo = {model: leave_one_size_out_error(sizes, taus, model, max_accept_length) for model in fits}
    if len(sizes) >= SIZES_TO_RANK_MODELS and all(value is not None for value in loo.values()):
        inverse = {model: 1.0 / max(float(value) ** 2, 1e-12) for model, value in loo.items()}
        weights = {model: value / sum(inverse.values()) for model, value in inverse.items()}
        rule = "inverse leave-one-size-out mean squared error"
    else:
        weights = {model: 0.5 for model in fits}
        rule = (f"equal: with {len(sizes)} sizes the 3-parameter curve cannot be scored on a left-out size "
                f"(needs {SIZES_TO_RANK_MODELS}), so nothing measured ranks the two curves")
    reference = float(sizes.min())
    # Each replicate of model m carries w_m / R, so the pooled sample is the mixture of the two bootstraps.
    mixture_weights = np.concatenate([np.full(len(fits[model]), weights[model] / len(fits[model])) for model in fits])

    wanted = sorted({size for size in planned if size > largest} | ({float(horizon)} if horizon is not None and horizon > largest else set()))
    predictions = [SizeForecast(float(size), float(tau), *interval, by_model={}, measured=True)
                   for size, tau, interval in zip(sizes, taus, intervals) if size in planned]
    if wanted:
        pooled = np.concatenate([predict_rows(model, fits[model], reference, np.array(wanted)) for model in fits])  # (2R, k)
        point_by_model = {model: predict_rows(model, points[model], reference, np.array(wanted))[0] for model in fits}
        for column, size in enumerate(wanted):
            low, high = weighted_quantiles(pooled[:, column], mixture_weights, [tail, 1.0 - tail])
            point = sum(weights[model] * float(point_by_model[model][column]) for model in fits)
            predictions.append(SizeForecast(size, point, low, high, {model: float(point_by_model[model][column]) for model in fits}, False))

    crossing = crossing_low = crossing_high = within = None
    verdict, line = "not yet known", ""
    at_horizon = next((item for item in predictions if horizon is not None and item.data_size == float(horizon)), None)
    # The curve's shape, lower half against upper half of the sizes (3 sizes: the two segments), paired.
    middle = len(sizes) // 2
    log2_sizes = np.log2(sizes)

    def halves(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # (..., n) -> per-doubling gains (...,), (...,)
        return ((values[..., middle] - values[..., 0]) / (log2_sizes[middle] - log2_sizes[0]),
                (values[..., -1] - values[..., middle]) / (log2_sizes[-1] - log2_sizes[middle]))

    lower_gain, upper_gain = halves(taus)
    change_low, change_high = np.quantile(np.subtract(*halves(replicates)[::-1]), [tail, 1.0 - tail])
    resolved = "resolved" if change_high < 0 or change_low > 0 else "not resolved"
    shape = (f"per doubling {lower_gain:+.3f} from {sizes[0]:g} to {sizes[middle]:g} and {upper_gain:+.3f} from {sizes[middle]:g} to "
             f"{largest:g} ({'shrinking' if upper_gain < lower_gain else 'not shrinking'}; change {upper_gain - lower_gain:+.3f}, "
             f"interval {change_low:+.3f} to {change_high:+.3f}, {resolved})")
    if break_even is not None:
        crossings = np.concatenate([crossing_rows(model, fits[model], reference, break_even) for model in fits])
        crossing, crossing_low, crossing_high = weighted_quantiles(crossings, mixture_weights, [0.5, tail, 1.0 - tail])
        if horizon is not None:
            within = float(mixture_weights[crossings <= horizon].sum() / mixture_weights.sum())
    if measured_go:
        verdict, line = "go", measured_line
    elif break_even is None:
        line = f"not yet known: no break-even tau to compare with (measure the serving timings); {rests_on}, {shape}."
    elif at_horizon is None:
        line = (f"not yet known: no size beyond the largest measured ({largest:g}) is planned or known, so there is nothing to forecast "
                f"against break-even {break_even:.3f}; {rests_on}.")
    else:
        where = (f"at {at_horizon.data_size:,.0f} samples ({doublings_to_horizon:.1f} doublings beyond {largest:g}) tau is forecast "
                 f"{at_horizon.tau:.3f} ({confidence:.0%} interval {at_horizon.tau_low:.3f}-{at_horizon.tau_high:.3f}; line "
                 f"{at_horizon.by_model['log-linear']:.3f}, saturating {at_horizon.by_model['saturating']:.3f})")
        if at_horizon.tau_low >= break_even:
            cross = ("" if crossing is None or not math.isfinite(crossing) else
                     f"; it crosses break-even at about {_size(crossing)} samples (interval {_size(crossing_low)} to {_size(crossing_high)})")
            verdict, line = "go", f"go: {where}, above break-even {break_even:.3f} by its whole interval{cross}; {rests_on}."
        elif at_horizon.tau_high < break_even:
            verdict, line = "no-go", (f"no-go: {where}, below break-even {break_even:.3f} even at its upper end: not within "
                                      f"{doublings_to_horizon:.1f} doublings; {rests_on}, {shape}.")
        else:
            line = (f"not yet known: {where}, an interval that contains break-even {break_even:.3f} (reached by the horizon in "
                    f"{within:.0%} of the mixture); {rests_on}, {shape}. The next planned size narrows it.")
        if doublings_to_horizon > slope.doublings_measured:
            notes.append(f"The horizon is {doublings_to_horizon:.1f} doublings beyond the largest size, more than the "
                         f"{slope.doublings_measured:.1f} measured: the interval there is mostly the choice of curve.")
    return Forecast(**common, slope=slope.to_dict(), model_weights=weights, weight_rule=rule, loo_rmse=loo, predictions=predictions,
                    crossing_size=crossing, crossing_low=crossing_low, crossing_high=crossing_high, crossing_within_horizon=within,
                    doublings_at_slope=doublings, verdict=verdict, line=line)


# ----------------------------------------------------------------------------- analysis/answer.json

ANSWER_FILE = "answer.json"


@dataclass(frozen=True)
class AnswerFile:
    """analysis/answer.json: the current forecast with the sizes it rests on, one per break-even case.

    `primary` names the case the plain line is for: the serving measurement of params.analysis (the user's
    timings), with the embedded loop's own break-even beside it. Stage 6 rewrites it after every size it scores
    (a staged run rewrites it after each size), atomically, so a reader never sees half a file.
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

    @classmethod
    def load(cls, path: str | os.PathLike) -> "AnswerFile":
        with open(path, encoding="utf-8") as handle:
            record = json.load(handle)
        forecasts = {name: Forecast.from_dict(item) for name, item in record["forecasts"].items()}
        return cls(primary=record["primary"], forecasts=forecasts, sizes=record["sizes"], planned_sizes=record["planned_sizes"],
                   updated=record["updated"])
