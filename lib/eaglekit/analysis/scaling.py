"""The scaling answer: accept length (DESIGN.md's tau) against training-data size, its local slope and whether
a ceiling is identified. The curves are `curves`'s, the one fitting path the forecast reads too.

In the order a careful reader should trust it:
1. The local slope (`local_slope`): tau gained per doubling of training data over the measured range
   (the log-linear family: least squares of tau on log2 N), with a paired-bootstrap interval. It needs no
   model of what happens beyond the data. "Data needed" is given from it only as "k more doublings at the
   measured slope".
2. A model of the curve, chosen by leave-one-size-out prediction error (`curves.leave_one_size_out_error`),
   not by taste: the log-linear line (2 parameters, no ceiling) or the saturating tau_inf - gap (N / N_min)^-c
   (3). The ceiling tau_inf is reported only when it is identified (`ceiling_identification`): more sizes than
   parameters, bootstrap refits that do not pile up at a bound, and the saturating model predicting held-out
   sizes better than the line. Otherwise the summary says, in plain words, that the measured range cannot pin
   it.

The saturating fit's uncertainty (`fit_scaling`) is a "per-sample" bootstrap: the caller passes, per data
size, bootstrap replicates of tau obtained by resampling held-out samples
(`acceptance.bootstrap_accept_length` with the same seed for every size, so the resamples are paired when
every draft is scored on the same held-out set); each replicate row is refitted. (A residual bootstrap of the
(N, tau) points alone is crude with a handful of sizes.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from eaglekit.analysis.acceptance import percentile_interval
from eaglekit.analysis.curves import (EXPONENT_GRID, PARAMETERS, fit_saturating_rows, leave_one_size_out_errors,
                                     saturating_curve, slope_per_doubling, sorted_points)

# No count of doublings is stated further than this past the largest measured size: there the curves the sizes
# cannot tell apart diverge (docs/forecast.md backtests knees and S-curves). The forecast's reach too.
MAX_DOUBLINGS_BEYOND = 3.0


def sizes_text(sizes: Sequence[float]) -> str:
    """Data sizes as the statements name them: "60, 240, 960"."""
    return ", ".join(f"{size:g}" for size in sizes)


# ----------------------------------------------------------------------------- the saturating fit

@dataclass(frozen=True)
class ScalingFit:
    """tau(N) = tau_inf - gap (N / N_min)^-c with the refits of its bootstrap replicates
    (`curves.fit_saturating_rows`)."""

    params: np.ndarray  # (3,) tau_inf, gap, exponent, on N / N_min
    replicates: np.ndarray  # (R, 3) the same, refitted on every replicate row
    data_sizes: np.ndarray  # (n,) ascending; N_min = data_sizes[0]
    accept_lengths: np.ndarray  # (n,)
    ceiling: float  # bound on tau_inf: steps + 1 for a chain of `steps`
    confidence: float
    bootstrap_method: str = "per-sample"  # held-out samples resampled, paired across sizes

    @property
    def tau_inf(self) -> float:
        return float(self.params[0])

    @property
    def exponent(self) -> float:
        return float(self.params[2])

    @property
    def scale(self) -> float:
        """b of tau_inf - b N^-c in samples: gap (N / N_min)^-c = (gap N_min^c) N^-c."""
        return float(self.params[1] * self.data_sizes[0] ** self.params[2])

    @property
    def residuals(self) -> np.ndarray:
        return self.accept_lengths - self.predict(self.data_sizes)

    def predict(self, data_sizes: float | np.ndarray) -> np.ndarray:
        return saturating_curve(self.params[None, :], np.atleast_1d(data_sizes) / self.data_sizes[0])[0]

    def predict_band(self, data_sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Percentile band of the replicate curves at `data_sizes`; (len,) low and high."""
        return percentile_interval(saturating_curve(self.replicates, np.asarray(data_sizes) / self.data_sizes[0]), self.confidence)

    def ceiling_interval(self) -> tuple[float, float]:
        low, high = percentile_interval(self.replicates[:, 0], self.confidence)
        return float(low), float(high)

    def to_dict(self) -> dict:
        low, high = self.ceiling_interval()
        return {
            "model": "tau(N) = tau_inf - scale * N^(-exponent)", "tau_inf": self.tau_inf, "tau_inf_low": low, "tau_inf_high": high,
            "scale": self.scale, "exponent": self.exponent, "ceiling_bound": self.ceiling, "data_sizes": self.data_sizes.tolist(),
            "accept_lengths": self.accept_lengths.tolist(), "residuals": self.residuals.tolist(),
            "bootstrap_method": self.bootstrap_method, "bootstrap_replicates": int(len(self.replicates)), "confidence": self.confidence,
        }


def fit_scaling(
    data_sizes: Sequence[float],
    accept_lengths: Sequence[float],
    replicate_accept_lengths: np.ndarray,
    max_accept_length: float = math.inf,
    confidence: float = 0.95,
) -> ScalingFit:
    """The saturating curve with bootstrap uncertainty.

    data_sizes, accept_lengths: (n,) one point per trained draft (n >= 3 distinct sizes).
    replicate_accept_lengths: (R, n) bootstrap replicates of each point from resampling held-out samples.
    max_accept_length: the topology's ceiling (steps + 1 for a chain), bounds tau_inf.
    """
    sizes, taus, rows = sorted_points(data_sizes, accept_lengths, replicate_accept_lengths)
    if len(np.unique(sizes)) < 3:
        raise ValueError(f"the fit has 3 parameters and needs at least 3 distinct data sizes; got {sorted(set(sizes.tolist()))}")
    point = fit_saturating_rows(sizes, taus[None, :], max_accept_length)  # (1, 3)
    return ScalingFit(params=point[0], replicates=fit_saturating_rows(sizes, rows, max_accept_length), data_sizes=sizes,
                      accept_lengths=taus, ceiling=float(max_accept_length), confidence=confidence)


# ----------------------------------------------------------------------------- local slope

@dataclass(frozen=True)
class LocalSlope:
    """Held-out tau gained per doubling of training data over the measured sizes, with a paired bootstrap.

    slope: least squares of tau on log2 N over all sizes; last_segment: the same between the two largest
    sizes (where the curve is now). Intervals are percentiles over bootstrap replicates of the held-out set,
    paired across sizes (every draft scored on the same resampled samples).
    """

    slope: float
    slope_low: float
    slope_high: float
    positive_fraction: float  # share of replicates with a positive slope
    last_segment: float
    last_segment_low: float
    last_segment_high: float
    data_sizes: np.ndarray  # (n,) ascending
    accept_lengths: np.ndarray  # (n,)
    replicate_slopes: np.ndarray  # (R,)
    lower_bound_sizes: tuple[float, ...]  # sizes whose draft was still improving: tau is a lower bound
    confidence: float

    @property
    def doublings_measured(self) -> float:
        return float(math.log2(self.data_sizes[-1] / self.data_sizes[0]))

    def doublings_to(self, target_accept_length: float) -> tuple[float, float, float]:
        """More doublings beyond the largest size to reach the target at the measured slope:
        (point, low, high); inf where the slope is not positive. 0 when already reached."""
        gap = target_accept_length - float(self.accept_lengths[-1])
        if gap <= 0:
            return 0.0, 0.0, 0.0

        def doublings(slope: np.ndarray) -> np.ndarray:
            with np.errstate(divide="ignore"):
                return np.where(slope > 0, gap / np.where(slope > 0, slope, 1.0), np.inf)

        low, high = percentile_interval(doublings(self.replicate_slopes), self.confidence, method="nearest")
        return float(doublings(np.array(self.slope))), float(low), float(high)

    def statement(self) -> str:
        percent = f"{self.confidence:.0%}"
        text = (
            f"Over the measured range ({self.data_sizes[0]:g} to {self.data_sizes[-1]:g} training samples, "
            f"{self.doublings_measured:.1f} doublings), held-out tau rose {self.slope:+.3f} per doubling of data "
            f"({percent} paired-bootstrap interval {self.slope_low:+.3f} to {self.slope_high:+.3f}; positive in "
            f"{self.positive_fraction:.0%} of resamples); between the two largest sizes {self.last_segment:+.3f} per doubling "
            f"({self.last_segment_low:+.3f} to {self.last_segment_high:+.3f})."
        )
        if self.lower_bound_sizes:
            text += (f" The drafts at {sizes_text(self.lower_bound_sizes)} samples were still improving when training stopped, so "
                     "their tau is a lower bound and the slope may be off (raise training.max_steps to let them converge).")
        return text

    def doublings_statement(self, target_accept_length: float, label: str = "target") -> str:
        point, low, high = self.doublings_to(target_accept_length)
        largest = float(self.accept_lengths[-1])
        if point == 0.0:
            return f"The largest draft already reaches the {label} accept length {target_accept_length:.3g} (tau {largest:.3g})."
        if not math.isfinite(point):
            return (f"Reaching the {label} accept length {target_accept_length:.3g} from {largest:.3g}: the measured slope is not "
                    "positive, so more data of this kind is not shown to get there.")
        if point > MAX_DOUBLINGS_BEYOND:
            return (f"Reaching the {label} accept length {target_accept_length:.3g} from {largest:.3g} would take more than "
                    f"{MAX_DOUBLINGS_BEYOND:g} doublings of data at the measured slope (over {2.0 ** MAX_DOUBLINGS_BEYOND:g}x the largest "
                    "size): past what the measured sizes speak for, so no count is given.")
        upper = (f"more than {MAX_DOUBLINGS_BEYOND:g}" if high > MAX_DOUBLINGS_BEYOND else f"{high:.1f}")
        return (
            f"Reaching the {label} accept length {target_accept_length:.3g} from {largest:.3g} would take {point:.1f} more doublings of "
            f"data at the measured slope ({self.confidence:.0%} interval {low:.1f} to {upper}), i.e. about {2.0 ** point:.3g}x the largest "
            f"size, if the slope held. Returns per doubling usually shrink as data grows, so read this as a lower bound on the data "
            "needed, not a forecast."
        )

    def to_dict(self) -> dict:
        return {
            "slope_per_doubling": self.slope, "slope_low": self.slope_low, "slope_high": self.slope_high,
            "positive_fraction": self.positive_fraction, "last_segment_per_doubling": self.last_segment,
            "last_segment_low": self.last_segment_low, "last_segment_high": self.last_segment_high,
            "doublings_measured": self.doublings_measured, "data_sizes": self.data_sizes.tolist(),
            "accept_lengths": self.accept_lengths.tolist(), "lower_bound_sizes": list(self.lower_bound_sizes),
            "bootstrap_replicates": int(len(self.replicate_slopes)), "confidence": self.confidence,
            "statement": self.statement(),
        }


def local_slope(
    data_sizes: Sequence[float],
    accept_lengths: Sequence[float],
    replicate_accept_lengths: np.ndarray,
    confidence: float = 0.95,
    lower_bound_sizes: Sequence[float] = (),
) -> LocalSlope:
    """tau gained per doubling of data, over the measured sizes, with a paired-bootstrap interval.

    data_sizes, accept_lengths: (n,) n >= 2 distinct sizes. replicate_accept_lengths: (R, n) bootstrap
    replicates of each point, paired across sizes (acceptance.sweep_acceptance's pooled_replicates).
    lower_bound_sizes: sizes whose draft had not converged (their tau is a lower bound), named in the
    statement.
    """
    sizes, taus, replicates = sorted_points(data_sizes, accept_lengths, replicate_accept_lengths)
    if len(np.unique(sizes)) != len(sizes) or len(sizes) < 2:
        raise ValueError(f"a slope needs at least 2 distinct positive data sizes, got {sizes.tolist()}")
    log2_sizes = np.log2(sizes)
    slopes = slope_per_doubling(log2_sizes, replicates)
    segment_doublings = log2_sizes[-1] - log2_sizes[-2]
    segments = (replicates[:, -1] - replicates[:, -2]) / segment_doublings
    low, high = percentile_interval(slopes, confidence)
    segment_low, segment_high = percentile_interval(segments, confidence)
    return LocalSlope(
        slope=float(slope_per_doubling(log2_sizes, taus)),
        slope_low=float(low), slope_high=float(high), positive_fraction=float((slopes > 0).mean()),
        last_segment=float((taus[-1] - taus[-2]) / segment_doublings),
        last_segment_low=float(segment_low), last_segment_high=float(segment_high),
        data_sizes=sizes, accept_lengths=taus, replicate_slopes=slopes,
        lower_bound_sizes=tuple(float(size) for size in sorted(lower_bound_sizes)), confidence=confidence,
    )


# ---------------------------------------------------------------------------- model choice and identification

# A bootstrap refit "piles up" at a bound when it lands within this relative distance of it; the ceiling
# counts as identified only when at most PILE_UP_LIMIT of the refits do.
BOUND_TOLERANCE = 1e-3
PILE_UP_LIMIT = 0.05


@dataclass(frozen=True)
class CeilingIdentification:
    """Whether the measured range pins the ceiling tau_inf, and why not when it does not."""

    identified: bool
    reasons: tuple[str, ...]  # empty when identified
    fit: ScalingFit | None  # the saturating fit, when one could be made
    loo_error: dict[str, float | None]  # model -> leave-one-size-out RMSE (None: not evaluable)
    chosen_model: str  # the model with the lowest held-out error ("log-linear" when none is evaluable)
    at_bound_fraction: float | None  # share of bootstrap refits with tau_inf or the exponent at a bound

    def statement(self) -> str:
        errors = ", ".join(f"{name} {value:.4f}" if value is not None else f"{name} not evaluable"
                           for name, value in self.loo_error.items())
        if self.identified and self.fit is not None:
            low, high = self.fit.ceiling_interval()
            return (f"The ceiling is identified: tau_inf = {self.fit.tau_inf:.3g} ({self.fit.confidence:.0%} interval {low:.3g} to "
                    f"{high:.3g}), from the saturating model, which predicts left-out sizes best (leave-one-size-out RMSE: {errors}).")
        if any(value is not None for value in self.loo_error.values()):
            choice = f"the model chosen by leave-one-size-out error is {self.chosen_model} ({errors})"
        else:
            choice = ("too few sizes to choose a model by leave-one-size-out error, so the answer rests on the "
                      "log-linear slope alone")
        return ("The ceiling is not identified: " + "; ".join(self.reasons) + ". No ceiling and no data-size forecast from one "
                f"is reported; {choice}.")

    def to_dict(self) -> dict:
        return {
            "identified": self.identified, "reasons": list(self.reasons), "chosen_model": self.chosen_model,
            "loo_rmse": self.loo_error, "at_bound_fraction": self.at_bound_fraction,
            "saturating_fit": None if self.fit is None else self.fit.to_dict(), "statement": self.statement(),
        }


def ceiling_identification(
    data_sizes: Sequence[float],
    accept_lengths: Sequence[float],
    replicate_accept_lengths: np.ndarray,
    max_accept_length: float = math.inf,
    confidence: float = 0.95,
) -> CeilingIdentification:
    """Fit the saturating model where possible and decide whether its ceiling is identified.

    Not identified when any of these holds (each named in `reasons`): no more sizes than the model's
    3 parameters (the fit passes through the points, so nothing tests it); more than PILE_UP_LIMIT of
    the bootstrap refits put tau_inf at the ceiling bound or the exponent at one of its bounds; the
    saturating model does not predict left-out sizes better than the log-linear line (the curvature
    that would pin a ceiling is not measurable).
    """
    sizes, taus, replicate_accept_lengths = sorted_points(data_sizes, accept_lengths, replicate_accept_lengths)
    loo = leave_one_size_out_errors(sizes, taus, max_accept_length)
    evaluable = {model: error for model, error in loo.items() if error is not None}
    chosen = min(evaluable, key=evaluable.get) if evaluable else "log-linear"
    reasons: list[str] = []
    n = len(np.unique(sizes))
    if n <= PARAMETERS["saturating"]:
        reasons.append(f"{n} data sizes for a 3-parameter curve: it passes through every point, so no point tests it "
                       "(measure at least 5 sizes: 4 to fit, 1 to predict)")
    elif loo["saturating"] is None:
        reasons.append(f"with {n} data sizes the 3-parameter curve cannot be tested on a left-out size "
                       "(measure at least 5 sizes: 4 to fit, 1 to predict)")
    fit, at_bound = None, None
    if n >= 3:
        fit = fit_scaling(sizes, taus, replicate_accept_lengths, max_accept_length=max_accept_length, confidence=confidence)
        tau_inf, exponent = fit.replicates[:, 0], fit.replicates[:, 2]
        tolerance = BOUND_TOLERANCE * max(1.0, abs(max_accept_length) if math.isfinite(max_accept_length) else 1.0)
        at_ceiling = (tau_inf >= max_accept_length - tolerance) if math.isfinite(max_accept_length) else np.zeros(len(tau_inf), bool)
        at_exponent_bound = (exponent >= EXPONENT_GRID[-1] * (1 - BOUND_TOLERANCE)) | (exponent <= EXPONENT_GRID[0] * (1 + BOUND_TOLERANCE))
        at_bound = float((at_ceiling | at_exponent_bound).mean())
        if at_ceiling.mean() > PILE_UP_LIMIT:
            reasons.append(f"{at_ceiling.mean():.0%} of bootstrap refits put tau_inf at the bound {max_accept_length:g} (the chain's "
                           "ceiling), so the data do not bound it from above")
        if at_exponent_bound.mean() > PILE_UP_LIMIT:
            reasons.append(f"{at_exponent_bound.mean():.0%} of bootstrap refits put the exponent at a bound")
    if loo["saturating"] is not None and loo["log-linear"] is not None and loo["saturating"] >= loo["log-linear"]:
        reasons.append(f"the saturating model predicts left-out sizes no better than a straight line in log N "
                       f"(RMSE {loo['saturating']:.4f} vs {loo['log-linear']:.4f}): the curvature that would pin a ceiling is not measured")
    return CeilingIdentification(
        identified=not reasons and fit is not None, reasons=tuple(reasons), fit=fit, loo_error=loo, chosen_model=chosen,
        at_bound_fraction=at_bound,
    )


@dataclass(frozen=True)
class ScalingAnswer:
    """The scaling answer: the local slope, whether a ceiling is identified, doublings to each target."""

    slope: LocalSlope
    ceiling: CeilingIdentification
    doublings_needed: list[dict]  # label, target_accept_length, doublings (point, low, high), statement

    @property
    def statements(self) -> list[str]:
        """Plain sentences in reading order, built from the numbers."""
        return [self.slope.statement(), self.ceiling.statement(), *(item["statement"] for item in self.doublings_needed)]

    def to_dict(self) -> dict:
        return {"local_slope": self.slope.to_dict(), "ceiling": self.ceiling.to_dict(), "doublings_needed": self.doublings_needed,
                "statements": self.statements}


def scaling_answer(
    data_sizes: Sequence[float],
    accept_lengths: Sequence[float],
    replicate_accept_lengths: np.ndarray,
    max_accept_length: float,
    targets: Sequence[tuple[str, float]] = (),
    confidence: float = 0.95,
    lower_bound_sizes: Sequence[float] = (),
) -> ScalingAnswer:
    """Slope, ceiling identification and doublings per target (label, tau), e.g. ("break-even", 2.07)."""
    slope = local_slope(data_sizes, accept_lengths, replicate_accept_lengths, confidence, lower_bound_sizes)
    ceiling = ceiling_identification(data_sizes, accept_lengths, replicate_accept_lengths, max_accept_length, confidence)
    doublings = [{"label": label, "target_accept_length": target,
                  **dict(zip(("doublings", "doublings_low", "doublings_high"), slope.doublings_to(target))),
                  "statement": slope.doublings_statement(target, label)} for label, target in targets]
    return ScalingAnswer(slope=slope, ceiling=ceiling, doublings_needed=doublings)
