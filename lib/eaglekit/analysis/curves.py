"""The curve families of tau against training-data size N, fitted on every row of bootstrap replicates at
once.

One path serves the scaling answer (`scaling`: the local slope, the ceiling test), the go / no-go forecast
(`forecast`: the union interval, the crossing size) and the answer in words (`answer`): each reads these fits.

The families (`FAMILIES`), each `fit_rows(sizes, rows, ceiling) -> (R, p)` and read back by `FamilyFits.at`:
- "log-linear": tau = intercept + slope log2 N (least squares);
- "saturating": tau = tau_inf - gap (N / N_min)^-c with 1 <= tau_inf <= ceiling, gap >= 0, 0 < c <=
  MAX_EXPONENT, by profile least squares over EXPONENT_GRID (closed form per exponent, the best exponent per
  row): no refit can fail, and R rows cost one matrix product;
- "accelerating": a quadratic in log2 N with curvature >= 0 (the lower half of an S-curve);
- "plateau": no gain past the largest measured size (a knee just past the data).

rows are (R, n) taus at the n measured sizes, ascending; a point fit is the (1, n) row of the measured taus.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

# The curve families the forecast's interval spans, and what each stands for.
FAMILIES = {
    "log-linear": "the same gain per doubling",
    "saturating": "tau_inf - b N^-c: gains per doubling shrink",
    "accelerating": "a quadratic in log N bending upward: the lower half of an S-curve",
    "plateau": "no gain past the largest measured size: a knee just past the data",
}
# the families a point forecast averages and a model is chosen from
MEASURED_SHAPE = ("log-linear", "saturating")
PARAMETERS = {"log-linear": 2, "saturating": 3, "accelerating": 3, "plateau": 1}

MAX_EXPONENT = 5.0
# Exponents of the saturating model's profile fit: log-spaced over the bounds (0, MAX_EXPONENT].
EXPONENT_GRID = np.geomspace(1e-3, MAX_EXPONENT, 240)


def sorted_points(data_sizes: Sequence[float], accept_lengths: Sequence[float],
                  replicate_accept_lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The measured curve every fit reads, checked and ascending in size: (n,) sizes, (n,) taus and their
    (R, n) bootstrap replicate rows. Sizes must be positive; the caller says how many distinct ones it
    needs."""
    sizes = np.asarray(data_sizes, dtype=np.float64)
    taus = np.asarray(accept_lengths, dtype=np.float64)
    rows = np.asarray(replicate_accept_lengths, dtype=np.float64)
    if sizes.ndim != 1 or sizes.shape != taus.shape:
        raise ValueError(f"data_sizes and accept_lengths must be equal-length lists, got {sizes.shape} and {taus.shape}")
    if (sizes <= 0).any():
        raise ValueError(f"data sizes must be positive numbers of training samples, got {sizes.tolist()}")
    if rows.ndim != 2 or rows.shape[1] != len(sizes):
        raise ValueError(f"replicate_accept_lengths must be (R, {len(sizes)}), got {rows.shape}")
    order = np.argsort(sizes)
    return sizes[order], taus[order], rows[:, order]


def saturating_curve(params: np.ndarray, relative_sizes: np.ndarray | Sequence[float]) -> np.ndarray:
    """tau = tau_inf - gap (N / N_min)^-c: (R, 3) (tau_inf, gap, c) rows at (k,) sizes N / N_min -> (R, k)."""
    relative = np.asarray(relative_sizes, dtype=np.float64)
    return params[:, :1] - params[:, 1:2] * relative[None, :] ** (-params[:, 2:3])


def slope_per_doubling(log2_sizes: np.ndarray, accept_lengths: np.ndarray) -> np.ndarray:
    """Least-squares slope of tau on log2 N; accept_lengths (..., n) -> (...,)."""
    centered = log2_sizes - log2_sizes.mean()
    return (accept_lengths - accept_lengths.mean(axis=-1, keepdims=True)) @ centered / float(centered @ centered)


def fit_log_linear_rows(sizes: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Least squares tau = intercept + slope log2 N on every row: (R, n) -> (R, 2) (intercept, slope)."""
    log2_sizes = np.log2(sizes)
    slope = slope_per_doubling(log2_sizes, rows)
    return np.column_stack([rows.mean(axis=1) - slope * log2_sizes.mean(), slope])


def fit_saturating_rows(sizes: np.ndarray, rows: np.ndarray, ceiling: float) -> np.ndarray:
    """tau = tau_inf - gap (N / N_min)^-c on every row by profile least squares over EXPONENT_GRID:
    (R, n) -> (R, 3) (tau_inf, gap, c), with 1 <= tau_inf <= ceiling and gap >= 0. No refit can fail."""
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


def fit_accelerating_rows(sizes: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """tau = a + b x + q x^2, x = log2 N - mean, q >= 0, on every row: (R, n) -> (R, 3) (a, b, q). A row whose
    least squares curvature is negative (a bending curve, which the saturating family covers) gets the line (q
    = 0)."""
    centered = np.log2(sizes) - np.log2(sizes).mean()
    design = np.column_stack([np.ones_like(centered), centered, centered**2])  # (n, 3)
    quadratic = rows @ np.linalg.pinv(design).T  # (R, 3)
    line = np.column_stack([rows.mean(axis=1), slope_per_doubling(centered, rows), np.zeros(len(rows))])
    return np.where(quadratic[:, 2:3] > 0, quadratic, line)


@dataclass(frozen=True)
class FamilyFits:
    """Every family fitted on every row of (R, n) replicates; `at` evaluates them at any size."""

    sizes: np.ndarray  # (n,) measured, ascending
    plateau: np.ndarray  # (R, 1) each row's tau at the largest measured size
    log_linear: np.ndarray  # (R, 2)
    saturating: np.ndarray  # (R, 3)
    accelerating: np.ndarray  # (R, 3)
    ceiling: float

    @classmethod
    def fit(cls, sizes: np.ndarray, rows: np.ndarray, ceiling: float) -> "FamilyFits":
        return cls(sizes, rows[:, -1:], fit_log_linear_rows(sizes, rows), fit_saturating_rows(sizes, rows, ceiling),
                   fit_accelerating_rows(sizes, rows), ceiling)

    def raw(self, data_sizes: Sequence[float]) -> dict[str, np.ndarray]:
        """name -> (R, len(data_sizes)) tau as each family's formula gives it, unclipped (inside the measured
        range)."""
        at = np.asarray(data_sizes, dtype=np.float64)
        x = np.log2(at)[None, :] - np.log2(self.sizes).mean()
        line, saturating, accelerating = self.log_linear, self.saturating, self.accelerating
        return {
            "log-linear": line[:, :1] + line[:, 1:2] * np.log2(at)[None, :],
            "saturating": saturating_curve(saturating, at / self.sizes.min()),
            "accelerating": accelerating[:, :1] + accelerating[:, 1:2] * x + accelerating[:, 2:3] * x**2,
            "plateau": np.repeat(self.plateau, len(at), axis=1),
        }

    def at(self, data_sizes: Sequence[float]) -> dict[str, np.ndarray]:
        """name -> (R, len(data_sizes)) tau beyond the largest measured size. Each prediction is held between
        the row's tau at the largest measured size (more data does not lower tau, and the plateau family is
        that level) and the chain's ceiling k + 1."""
        return {name: np.clip(curve, self.plateau, self.ceiling) for name, curve in self.raw(data_sizes).items()}


def union_interval(curves: Mapping[str, np.ndarray], low_tail: float, high_tail: float,
                   method: str = "linear") -> tuple[np.ndarray, np.ndarray]:
    """The union of the families' percentile intervals: the lowest family's low_tail quantile to the highest
    family's 1 - high_tail quantile, per column. Each curve (R, k) -> two (k,) arrays ((R,) -> two scalars).
    method: numpy's quantile method ("nearest" where a value may be inf)."""
    low = np.min([np.quantile(curve, low_tail, axis=0, method=method) for curve in curves.values()], axis=0)
    high = np.max([np.quantile(curve, 1.0 - high_tail, axis=0, method=method) for curve in curves.values()], axis=0)
    return low, high


def first_crossing(grid: np.ndarray, curves: np.ndarray, target: float) -> np.ndarray:
    """(R,) the first grid size at which each row's curve (R, G) reaches `target`; inf where it does not
    within the grid."""
    reached = curves >= target
    return np.where(reached.any(axis=1), grid[np.argmax(reached, axis=1)], np.inf)


def leave_one_size_out_error(data_sizes: Sequence[float], accept_lengths: Sequence[float], model: str,
                             ceiling: float = math.inf) -> float | None:
    """Root-mean-square error of predicting each size's tau from the `model` family fitted to the other sizes.

    None when leaving one out leaves no more points than the model has parameters (an exact fit
    predicts nothing about the point it did not see).
    """
    sizes = np.asarray(data_sizes, dtype=np.float64)
    taus = np.asarray(accept_lengths, dtype=np.float64)
    if len(sizes) - 1 <= PARAMETERS[model]:
        return None
    # Each size predicted by the family fitted to the others.
    errors = [float(FamilyFits.fit(np.delete(sizes, left_out), np.delete(taus, left_out)[None, :], ceiling)
                    .raw(sizes[left_out : left_out + 1])[model][0, 0]) - taus[left_out]
              for left_out in range(len(sizes))]
    return float(np.sqrt(np.mean(np.square(errors))))


def leave_one_size_out_errors(sizes: Sequence[float], accept_lengths: Sequence[float],
                              ceiling: float = math.inf) -> dict[str, float | None]:
    """`leave_one_size_out_error` of every MEASURED_SHAPE family: the errors the ceiling test chooses a model by
    and the forecast weighs its point by (`scaling.CeilingIdentification.loo_error`, handed to the forecast)."""
    return {model: leave_one_size_out_error(sizes, accept_lengths, model, ceiling) for model in MEASURED_SHAPE}
