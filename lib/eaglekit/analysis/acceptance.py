"""Offline acceptance statistics: per-position acceptance, chain accept length, bootstrap intervals.

One definition of accept length (DESIGN.md, "Accept length"), used everywhere in the kit:
tau = tokens emitted per target verification step, bonus token included. For a greedy chain of k
draft steps evaluated offline,

    tau = 1 + sum_{j=1..k} prod_{i<=j} acc_i

where acc_i is the draft's top-1 agreement with the target's argmax at chain step i, given that all
earlier steps agreed. A chain of k steps can never exceed k + 1, so every table here carries the
topology (`topology.Topology.to_dict()`: kind, steps, top_k, draft_tokens) beside every tau.

Trees (SGLang's S/K/T): the accepted path is a chain of its own, so a tree's per-start-row accepted
depths, turned into (P, S) tables by `depth_agreement`, go through the same counts, bootstrap and tables;
per-step rows then read per depth (`tree.offline_tree_depths_grid` produces the depths).

Input per sample: a boolean agreement array of shape (num_positions, k). Row t, column i says
whether the draft, unrolled on its own outputs from position t, proposed at step i + 1 the token the
target's argmax chose there. Rows must be complete (every one of the k steps has a target token);
the producer drops positions too close to the end of the sequence and positions outside the loss
mask. Values in a row after the first disagreement are ignored: the chain stopped there.

Two aggregates are reported side by side, because they answer different questions:
- pooled: every position of every sample weighs the same (sum over tokens / sum over tokens); this
  is what a server measures when it pools requests as sum/sum.
- per-sample mean: each sample's own tau, averaged; long samples do not dominate.

Confidence intervals come from a percentile bootstrap over samples (samples are the independent
unit; positions within a sample are correlated), vectorized as multinomial resampling weights.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from eaglekit.topology import Topology

POOLED_DATASET_NAME = "all"


@dataclass(frozen=True)
class ChainCounts:
    """Sufficient statistics of a set of samples for chain accept length.

    positions: (S,) number of evaluated positions per sample.
    prefix_counts: (S, k) per sample, the number of positions whose steps 1..j all agreed (column j-1).
    """

    positions: np.ndarray
    prefix_counts: np.ndarray

    @property
    def steps(self) -> int:
        return int(self.prefix_counts.shape[1])

    @property
    def num_samples(self) -> int:
        return int(self.positions.shape[0])


def chain_counts(agreements: Sequence[np.ndarray], steps: int | None = None) -> ChainCounts:
    """Reduce per-sample agreement arrays to per-sample chain counts.

    agreements: S arrays, each (num_positions, K) bool; `steps` (k <= K) keeps the first k columns.
    Returns ChainCounts with positions (S,) and prefix_counts (S, k).
    """
    if len(agreements) == 0:
        raise ValueError("no samples: pass at least one (num_positions, k) agreement array")
    widths = {np.asarray(array).shape[1] if np.asarray(array).ndim == 2 else -1 for array in agreements}
    if -1 in widths:
        bad = next(i for i, array in enumerate(agreements) if np.asarray(array).ndim != 2)
        raise ValueError(f"sample {bad}: agreement array must be 2-D (num_positions, k), got shape {np.shape(agreements[bad])}")
    if len(widths) != 1:
        raise ValueError(f"samples disagree on the number of chain steps k: {sorted(widths)}; evaluate all samples with one k")
    available = widths.pop()
    k = available if steps is None else steps
    if not 1 <= k <= available:
        raise ValueError(f"steps={steps} but the agreement arrays hold {available} chain steps; pass 1 <= steps <= {available}")
    positions = np.empty(len(agreements), dtype=np.int64)
    prefix_counts = np.empty((len(agreements), k), dtype=np.int64)
    for index, array in enumerate(agreements):
        array = np.asarray(array)
        if array.dtype != np.bool_:
            raise ValueError(f"sample {index}: agreement array must be bool, got {array.dtype}")
        # (P, k) -> (P, k): a step counts only if every earlier step agreed (the chain stopped otherwise).
        all_agreed_so_far = np.logical_and.accumulate(array[:, :k], axis=1)
        positions[index] = array.shape[0]
        prefix_counts[index] = all_agreed_so_far.sum(axis=0)
    return ChainCounts(positions=positions, prefix_counts=prefix_counts)


def depth_agreement(accepted_depths: np.ndarray, steps: int) -> np.ndarray:
    """(P,) accepted depths (0..S, e.g. of a tree) -> (P, S) bool, column j-1 = "accepted >= j".

    A tree's accepted path is a chain of its own, so this table feeds `chain_counts` and everything after it
    unchanged: tau = 1 + sum_j P(accepted >= j) = 1 + E[accepted], per depth acc_j = P(>= j) / P(>= j-1).
    """
    depths = np.asarray(accepted_depths)
    if depths.ndim != 1 or (depths.size and (depths.min() < 0 or depths.max() > steps)):
        raise ValueError(f"accepted depths must be a 1-D array in [0, {steps}], got shape {depths.shape}"
                         + (f" and range [{depths.min()}, {depths.max()}]" if depths.size else ""))
    return depths[:, None] >= np.arange(1, steps + 1)[None, :]


def concat_counts(parts: Sequence[ChainCounts]) -> ChainCounts:
    """Stack the samples of several ChainCounts (same k) into one."""
    steps = {part.steps for part in parts}
    if len(steps) != 1:
        raise ValueError(f"cannot pool counts with different chain steps {sorted(steps)}")
    return ChainCounts(
        positions=np.concatenate([part.positions for part in parts]),
        prefix_counts=np.concatenate([part.prefix_counts for part in parts], axis=0),
    )


def _conditional_from_prefix(prefix_rates: np.ndarray) -> np.ndarray:
    """acc_j = P(1..j agree) / P(1..j-1 agree); (..., k) -> (..., k). NaN where nothing reached step j."""
    previous = np.concatenate([np.ones_like(prefix_rates[..., :1]), prefix_rates[..., :-1]], axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(previous > 0, prefix_rates / np.where(previous > 0, previous, 1.0), np.nan)


def per_sample_accept_length(counts: ChainCounts) -> np.ndarray:
    """Each sample's own chain tau = 1 + sum_j prefix_rate_j; (S,). Samples with no positions are NaN."""
    with np.errstate(invalid="ignore", divide="ignore"):
        rates = counts.prefix_counts / counts.positions[:, None]
    return np.where(counts.positions > 0, 1.0 + rates.sum(axis=1), np.nan)


def pooled_accept_length(counts: ChainCounts) -> float:
    """Pooled chain tau over all positions of all samples."""
    total_positions = counts.positions.sum()
    if total_positions == 0:
        raise ValueError("no positions to evaluate: every sample is empty")
    return float(1.0 + (counts.prefix_counts.sum(axis=0) / total_positions).sum())


def bootstrap_weights(num_samples: int, num_resamples: int, seed: int) -> np.ndarray:
    """Multinomial resampling weights: row r says how often each sample appears in resample r; (R, S)."""
    rng = np.random.default_rng(seed)
    return rng.multinomial(num_samples, np.full(num_samples, 1.0 / num_samples), size=num_resamples)


def bootstrap_ratio(numerators: np.ndarray, denominators: np.ndarray, num_resamples: int, seed: int) -> np.ndarray:
    """Bootstrap replicates of sum(numerators) / sum(denominators) over units (prompts): (U,) -> (R,), or
    (U, n) -> (R, n) with one set of resampling weights for every column (paired). NaN where a resample's
    denominator sums to 0."""
    weights = bootstrap_weights(len(numerators), num_resamples, seed).astype(np.float64)  # (R, U)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (weights @ numerators) / (weights @ denominators)


@dataclass(frozen=True)
class BootstrapReplicates:
    """Bootstrap replicates over samples.

    pooled_tau: (R,); sample_mean_tau: (R,); conditional_acceptance: (R, k) pooled acc_j per replicate.
    """

    pooled_tau: np.ndarray
    sample_mean_tau: np.ndarray
    conditional_acceptance: np.ndarray


def bootstrap_accept_length(counts: ChainCounts, num_resamples: int = 1000, seed: int = 0) -> BootstrapReplicates:
    """Resample samples with replacement and recompute pooled tau, per-sample-mean tau and acc_j.

    Vectorized: the (R, S) weight matrix times the (S, k) counts gives every replicate at once.
    """
    usable = counts.positions > 0
    if not usable.any():
        raise ValueError("no positions to evaluate: every sample is empty")
    positions = counts.positions[usable].astype(np.float64)
    prefix_counts = counts.prefix_counts[usable].astype(np.float64)
    weights = bootstrap_weights(len(positions), num_resamples, seed).astype(np.float64)  # (R, S)
    # (R, S) @ (S,) -> (R,) and (R, S) @ (S, k) -> (R, k)
    # pooled P(steps 1..j all agree): (R, k)
    prefix_rates = (weights @ prefix_counts) / (weights @ positions)[:, None]
    per_sample_tau = 1.0 + (prefix_counts / positions[:, None]).sum(axis=1)  # (S,)
    return BootstrapReplicates(
        pooled_tau=1.0 + prefix_rates.sum(axis=1),
        sample_mean_tau=weights @ per_sample_tau / len(positions),
        conditional_acceptance=_conditional_from_prefix(prefix_rates),
    )


def percentile_interval(replicates: np.ndarray, confidence: float, method: str = "linear") -> tuple[np.ndarray, np.ndarray]:
    """Two-sided percentile interval along axis 0, ignoring NaN replicates. method: numpy's percentile method
    ("nearest" where a replicate may be inf)."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    tail = (1.0 - confidence) / 2.0 * 100.0
    with warnings.catch_warnings():
        # A chain step no position reached has only NaN replicates: its interval is NaN, said once by the NaN.
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanpercentile(replicates, tail, axis=0, method=method), np.nanpercentile(replicates, 100.0 - tail, axis=0, method=method)


def _dataset_rows(name: str, counts: ChainCounts, num_resamples: int, confidence: float,
                  seed: int) -> tuple[dict, list[dict], BootstrapReplicates]:
    """One dataset's summary row, its per-step rows and its bootstrap replicates; every row names its
    chain."""
    columns = Topology.chain(counts.steps).to_dict()
    replicates = bootstrap_accept_length(counts, num_resamples, seed)
    pooled_low, pooled_high = percentile_interval(replicates.pooled_tau, confidence)
    mean_low, mean_high = percentile_interval(replicates.sample_mean_tau, confidence)
    summary_row = {
        "dataset": name,
        **columns,
        "samples": counts.num_samples,
        "positions": int(counts.positions.sum()),
        "tau_pooled": pooled_accept_length(counts),
        "tau_pooled_low": float(pooled_low),
        "tau_pooled_high": float(pooled_high),
        "tau_sample_mean": float(np.nanmean(per_sample_accept_length(counts))),
        "tau_sample_mean_low": float(mean_low),
        "tau_sample_mean_high": float(mean_high),
        "confidence": confidence,
        "resamples": num_resamples,
    }
    total_positions = counts.positions.sum()
    prefix_rates = counts.prefix_counts.sum(axis=0) / total_positions  # (k,)
    acceptance = _conditional_from_prefix(prefix_rates)
    acceptance_low, acceptance_high = percentile_interval(replicates.conditional_acceptance, confidence)
    reaching = np.concatenate([[total_positions], counts.prefix_counts.sum(axis=0)[:-1]])
    position_rows = [
        {
            "dataset": name,
            **columns,
            "step": step_index + 1,
            "acceptance": float(acceptance[step_index]),
            "acceptance_low": float(acceptance_low[step_index]),
            "acceptance_high": float(acceptance_high[step_index]),
            "prefix_rate": float(prefix_rates[step_index]),
            "positions_reaching": int(reaching[step_index]),
        }
        for step_index in range(counts.steps)
    ]
    return summary_row, position_rows, replicates


def _counts_by_dataset(agreements_by_dataset: Mapping[str, Sequence[np.ndarray]], steps: int | None) -> dict[str, ChainCounts]:
    """Chain counts per dataset plus the pooled "all" row when there is more than one dataset."""
    if not agreements_by_dataset:
        raise ValueError("no datasets given")
    if POOLED_DATASET_NAME in agreements_by_dataset:
        raise ValueError(f"dataset name {POOLED_DATASET_NAME!r} is reserved for the pooled row; rename the dataset")
    counts_by_dataset = {name: chain_counts(arrays, steps) for name, arrays in agreements_by_dataset.items()}
    if len(counts_by_dataset) > 1:
        counts_by_dataset[POOLED_DATASET_NAME] = concat_counts(list(counts_by_dataset.values()))
    return counts_by_dataset


def acceptance_tables(
    agreements_by_dataset: Mapping[str, Sequence[np.ndarray]],
    steps: int | None = None,
    num_resamples: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Per-dataset (and pooled "all") chain acceptance with bootstrap intervals over samples.

    agreements_by_dataset: dataset name -> list of (num_positions, K) bool arrays, one per held-out sample.
    Returns (summary, per_position):
    - summary: one row per dataset: topology, steps, samples, positions, tau_pooled (+ CI),
      tau_sample_mean (+ CI), confidence, bootstrap resamples.
    - per_position: one row per dataset and chain step: acceptance (conditional acc_j, pooled, + CI),
      prefix_rate (P(steps 1..j all agree)), positions_reaching (positions whose steps 1..j-1 agreed).
    Each dataset uses the same seed, so the "all" row resamples its own samples independently.
    """
    datasets = [_dataset_rows(name, counts, num_resamples, confidence, seed)
                for name, counts in _counts_by_dataset(agreements_by_dataset, steps).items()]
    return (pd.DataFrame([summary for summary, _, _ in datasets]),
            pd.DataFrame([row for _, rows, _ in datasets for row in rows]))


@dataclass(frozen=True)
class SweepAcceptance:
    """Offline acceptance of every draft of a data-size sweep on one held-out set.

    summary / per_position: `acceptance_tables` rows with a leading `data_size` column.
    pooled_replicates: dataset -> (R, n_sizes) bootstrap replicates of tau_pooled, columns in `data_sizes`
      order. The same resampling weights serve every size (same held-out samples, same seed), so the
      replicates are paired across sizes: what `scaling.fit_scaling(replicate_accept_lengths=...)` wants.
    """

    data_sizes: list[float]
    summary: pd.DataFrame
    per_position: pd.DataFrame
    pooled_replicates: dict[str, np.ndarray]


def sweep_acceptance(
    agreements_by_size: Mapping[float, Mapping[str, Sequence[np.ndarray]]],
    steps: int | None = None,
    num_resamples: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> SweepAcceptance:
    """`acceptance_tables` for each draft of a sweep, with paired bootstrap replicates across sizes.

    agreements_by_size: training-data size -> {dataset: [(num_positions, K) bool per held-out sample]}.
    Every size must be scored on the same held-out samples in the same order (the paired bootstrap
    depends on it): a dataset whose per-sample position counts differ between sizes is an error.
    """
    if not agreements_by_size:
        raise ValueError("no drafts given: pass {data size: {dataset: agreements}}")
    sizes = sorted(agreements_by_size)
    summary_rows, position_rows = [], []
    replicates: dict[str, list[np.ndarray]] = {}
    reference_positions: dict[str, np.ndarray] = {}
    for size in sizes:
        for name, counts in _counts_by_dataset(agreements_by_size[size], steps).items():
            if not np.array_equal(reference_positions.setdefault(name, counts.positions), counts.positions):
                raise ValueError(
                    f"dataset {name!r}: the draft of size {size} was scored on other held-out samples than the draft of "
                    f"size {sizes[0]} (positions per sample differ); score every draft on the same held-out set"
                )
            summary_row, rows, bootstrap = _dataset_rows(name, counts, num_resamples, confidence, seed)
            summary_rows.append({"data_size": size, **summary_row})
            position_rows.extend({"data_size": size, **row} for row in rows)
            replicates.setdefault(name, []).append(bootstrap.pooled_tau)
    missing = {name: len(columns) for name, columns in replicates.items() if len(columns) != len(sizes)}
    if missing:
        raise ValueError(f"datasets {sorted(missing)} are missing for some sizes; every draft must see every dataset")
    return SweepAcceptance(
        data_sizes=[float(size) for size in sizes],
        summary=pd.DataFrame(summary_rows),
        per_position=pd.DataFrame(position_rows),
        # (R, n_sizes)
        pooled_replicates={name: np.column_stack(columns) for name, columns in replicates.items()},
    )


@dataclass(frozen=True)
class ServerAcceptLength:
    """Server-style accept length (tokens emitted / verification steps) over a set of requests."""

    pooled: float  # sum(tokens) / sum(verification steps)
    per_request_mean: float  # mean over requests of tokens / steps
    requests: int
    tokens: int
    verification_steps: int


def server_accept_length(tokens_emitted: Sequence[int], verification_steps: Sequence[int]) -> ServerAcceptLength:
    """Accept length the way SGLang reports it: completion_tokens / spec_verify_ct per request.

    Used for the kit's own speculative loop and for SGLang's meta_info alike. Pooled is sum/sum;
    the per-request mean sits beside it. A request with zero verification steps has no accept length
    and is an error here (the server did not speculate on it).
    """
    tokens = np.asarray(tokens_emitted, dtype=np.int64)
    steps = np.asarray(verification_steps, dtype=np.int64)
    if tokens.shape != steps.shape or tokens.ndim != 1 or tokens.size == 0:
        raise ValueError(f"need two equal-length, non-empty 1-D lists; got {tokens.shape} tokens and {steps.shape} steps")
    if (steps <= 0).any():
        bad = np.flatnonzero(steps <= 0).tolist()
        raise ValueError(f"requests {bad[:10]} report no verification steps: speculation was not active for them")
    if (tokens < steps).any():
        bad = np.flatnonzero(tokens < steps).tolist()
        raise ValueError(f"requests {bad[:10]} emitted fewer tokens than verification steps; every step emits at least one token")
    return ServerAcceptLength(
        pooled=float(tokens.sum() / steps.sum()),
        per_request_mean=float((tokens / steps).mean()),
        requests=int(tokens.size),
        tokens=int(tokens.sum()),
        verification_steps=int(steps.sum()),
    )
