"""Offline acceptance statistics against hand-computed values and a brute-force bootstrap."""

from __future__ import annotations

import numpy as np
import pytest

from eaglekit.analysis.acceptance import (
    acceptance_tables,
    bootstrap_accept_length,
    bootstrap_ratio,
    chain_counts,
    pooled_accept_length,
    per_sample_accept_length,
    server_accept_length,
)


def _rows(*rows: str) -> np.ndarray:
    """'110' -> [True, True, False]; one string per position."""
    return np.array([[character == "1" for character in row] for row in rows], dtype=bool)


def test_chain_tau_by_hand_ignores_steps_after_first_rejection():
    # Sample A: 4 positions, k = 3. Prefix agreement per position: 3, 1, 0, 2 steps.
    # The '1' after a '0' in row 2 must not count: the chain stopped at step 2.
    sample_a = _rows("111", "101", "011", "110")
    # Sample B: 2 positions: 0 and 3 steps.
    sample_b = _rows("000", "111")
    counts = chain_counts([sample_a, sample_b])
    assert counts.positions.tolist() == [4, 2]
    assert counts.prefix_counts.tolist() == [[3, 2, 1], [1, 1, 1]]

    # pooled: prefix rates 4/6, 3/6, 2/6 -> tau = 1 + 9/6 = 2.5
    assert pooled_accept_length(counts) == pytest.approx(2.5)
    # per sample: A = 1 + 6/4 = 2.5, B = 1 + 3/2 = 2.5
    assert per_sample_accept_length(counts).tolist() == pytest.approx([2.5, 2.5])

    # The definition, literally: tau = 1 + sum_k prod_{i<=k} acc_i with acc_i conditional.
    acc = [4 / 6, (3 / 6) / (4 / 6), (2 / 6) / (3 / 6)]
    assert pooled_accept_length(counts) == pytest.approx(
        1 + acc[0] + acc[0] * acc[1] + acc[0] * acc[1] * acc[2]
    )


def test_pooled_and_sample_mean_differ_when_lengths_differ():
    long_good = _rows(*["11"] * 8)  # tau 3 over 8 positions
    short_bad = _rows("00", "00")  # tau 1 over 2 positions
    counts = chain_counts([long_good, short_bad])
    assert pooled_accept_length(counts) == pytest.approx(1 + 2 * 8 / 10)
    assert np.nanmean(per_sample_accept_length(counts)) == pytest.approx(2.0)


def test_steps_selects_leading_columns_and_bounds_tau():
    sample = _rows("1111", "1110")
    assert pooled_accept_length(chain_counts([sample], steps=2)) == pytest.approx(3.0)  # k + 1 at most
    assert pooled_accept_length(chain_counts([sample])) == pytest.approx(1 + 1 + 1 + 1 + 0.5)
    with pytest.raises(ValueError, match="steps=5"):
        chain_counts([sample], steps=5)


def test_bad_inputs_fail_with_the_sample_named():
    with pytest.raises(ValueError, match="sample 1: agreement array must be bool"):
        chain_counts([_rows("1"), np.ones((2, 1), dtype=np.int64)])
    with pytest.raises(ValueError, match="disagree on the number of chain steps"):
        chain_counts([_rows("11"), _rows("1")])
    with pytest.raises(ValueError, match="2-D"):
        chain_counts([np.ones(3, dtype=bool)])


def test_vectorized_bootstrap_matches_a_loop_over_resamples():
    rng = np.random.default_rng(7)
    samples = [rng.random((int(rng.integers(3, 30)), 4)) < 0.7 for _ in range(25)]
    counts = chain_counts(samples)
    replicates = bootstrap_accept_length(counts, num_resamples=50, seed=11)

    # Rebuild the same resamples from the same multinomial weights, one at a time.
    weights = np.random.default_rng(11).multinomial(25, np.full(25, 1 / 25), size=50)
    for resample, row in enumerate(weights):
        chosen = [samples[index] for index in np.repeat(np.arange(25), row)]
        resampled = chain_counts(chosen)
        assert replicates.pooled_tau[resample] == pytest.approx(pooled_accept_length(resampled))
        assert replicates.sample_mean_tau[resample] == pytest.approx(
            np.mean(per_sample_accept_length(resampled))
        )


def test_bootstrap_ratio_resamples_units_with_one_set_of_weights_for_every_column():
    """sum / sum over resampled prompts: what the benchmark (one column per draft) and `eaglekit evaluate`
    (one topology at a time) bootstrap; a column alone gets the same replicates as beside the others."""
    rng = np.random.default_rng(3)
    steps = rng.integers(1, 9, (20, 3)).astype(np.float64)  # (prompts, drafts)
    tokens = steps + rng.integers(0, 20, (20, 3))
    replicates = bootstrap_ratio(tokens, steps, num_resamples=40, seed=5)  # (R, drafts)
    weights = np.random.default_rng(5).multinomial(20, np.full(20, 1 / 20), size=40)
    for resample, row in enumerate(weights):
        chosen = np.repeat(np.arange(20), row)
        assert replicates[resample] == pytest.approx(tokens[chosen].sum(axis=0) / steps[chosen].sum(axis=0))
    for column in range(3):
        assert bootstrap_ratio(tokens[:, column], steps[:, column], 40, 5) == pytest.approx(
            replicates[:, column]
        )


def test_tables_have_topology_intervals_and_a_pooled_row():
    rng = np.random.default_rng(3)
    by_dataset = {
        "easy": [rng.random((40, 3)) < 0.9 for _ in range(30)],
        "hard": [rng.random((40, 3)) < 0.3 for _ in range(30)],
    }
    summary, per_position = acceptance_tables(by_dataset, num_resamples=300, seed=5)
    summary = summary.set_index("dataset")
    assert list(summary.index) == ["easy", "hard", "all"]
    assert (summary["topology"] == "chain").all() and (summary["steps"] == 3).all()
    assert (
        summary.loc["easy", "tau_pooled"]
        > summary.loc["all", "tau_pooled"]
        > summary.loc["hard", "tau_pooled"]
    )
    for prefix in ("tau_pooled", "tau_sample_mean"):
        assert (summary[f"{prefix}_low"] <= summary[prefix]).all()
        assert (summary[prefix] <= summary[f"{prefix}_high"]).all()
        assert (summary[f"{prefix}_high"] <= 4.0).all()
    # Independent Bernoulli(0.9) per step: every conditional acceptance is near 0.9.
    easy = per_position[per_position["dataset"] == "easy"]
    assert easy["acceptance"].to_numpy() == pytest.approx([0.9] * 3, abs=0.05)
    assert (easy["acceptance_low"] < easy["acceptance"]).all() and (
        easy["acceptance"] < easy["acceptance_high"]
    ).all()
    assert easy["positions_reaching"].iloc[0] == 1200

    # Same seed, same answer; another seed, other intervals.
    again, _ = acceptance_tables(by_dataset, num_resamples=300, seed=5)
    other, _ = acceptance_tables(by_dataset, num_resamples=300, seed=6)
    assert again["tau_pooled_low"].tolist() == summary["tau_pooled_low"].tolist()
    assert other["tau_pooled_low"].tolist() != summary["tau_pooled_low"].tolist()


def test_server_accept_length_pools_sum_over_sum():
    result = server_accept_length([100, 10], [40, 10])
    assert result.pooled == pytest.approx(110 / 50)
    assert result.per_request_mean == pytest.approx((2.5 + 1.0) / 2)
    with pytest.raises(ValueError, match="no verification steps"):
        server_accept_length([10], [0])
    with pytest.raises(ValueError, match="fewer tokens than verification steps"):
        server_accept_length([3], [5])


def test_sweep_pairs_bootstrap_across_sizes_and_matches_single_tables():
    from eaglekit.analysis.acceptance import sweep_acceptance

    small = {"chat": [_rows("10", "00", "11"), _rows("00")], "code": [_rows("11", "10")]}
    large = {"chat": [_rows("11", "10", "11"), _rows("10")], "code": [_rows("11", "11")]}
    sweep = sweep_acceptance({64: large, 16: small}, steps=2, num_resamples=200, seed=3)
    assert sweep.data_sizes == [16.0, 64.0]
    # Each size's rows are exactly what acceptance_tables gives for that draft alone.
    for size, agreements in ((16, small), (64, large)):
        alone, per_position = acceptance_tables(agreements, steps=2, num_resamples=200, seed=3)
        rows = (
            sweep.summary[sweep.summary["data_size"] == size].drop(columns="data_size").reset_index(drop=True)
        )
        assert rows.equals(alone)
        assert len(sweep.per_position[sweep.per_position["data_size"] == size]) == len(per_position)
    replicates = sweep.pooled_replicates["all"]
    assert replicates.shape == (200, 2)
    # Paired: the same resampled samples for both sizes; every sample improved or stayed, so no replicate
    # drops.
    assert (replicates[:, 1] >= replicates[:, 0]).all()
    assert set(sweep.summary["topology"]) == {"chain"} and set(sweep.summary["steps"]) == {2}


def test_sweep_rejects_drafts_scored_on_other_heldout_samples():
    from eaglekit.analysis.acceptance import sweep_acceptance

    with pytest.raises(ValueError, match="other held-out samples"):
        sweep_acceptance(
            {1: {"chat": [_rows("10", "00")]}, 2: {"chat": [_rows("10")]}}, steps=2, num_resamples=10
        )


def test_tree_depths_read_as_chain_counts_per_depth():
    from eaglekit.analysis.acceptance import depth_agreement
    from eaglekit.topology import Topology

    tree = Topology.parse("tree:3,2,6")
    # Two samples' accepted depths per start row (0..S).
    samples = [np.array([3, 0, 1, 2]), np.array([2, 2])]
    arrays = [depth_agreement(depths, tree.steps) for depths in samples]
    assert arrays[0].tolist() == [
        [True, True, True],
        [False, False, False],
        [True, False, False],
        [True, True, False],
    ]
    # The tree sweep (topology_sweep.sweep_table) pools them as chain counts: 1 + mean accepted depth over the
    # 6 rows.
    assert pooled_accept_length(chain_counts(arrays, tree.steps)) == pytest.approx(1 + 10 / 6)
    # Per depth: P(>= 1) = 5/6, P(>= 2 | >= 1) = 4/5, P(>= 3 | >= 2) = 1/4.
    _, per_depth = acceptance_tables({"d": arrays}, num_resamples=200)
    assert per_depth["acceptance"].tolist() == pytest.approx([5 / 6, 4 / 5, 1 / 4])
    with pytest.raises(ValueError, match=r"in \[0, 3\]"):
        depth_agreement(np.array([4]), 3)
