"""Stage 6's plain-words answer says the measured numbers, its intervals at the configured confidence."""

from __future__ import annotations

import numpy as np
import pandas as pd

from eaglekit.acceptance import percentile_interval, sweep_acceptance
from eaglekit.analysis_answer import answer_in_words
from eaglekit.scaling import break_even_from_throughput
from eaglekit.topology import Topology


def agreements(rate: float, seed: int) -> dict[str, list[np.ndarray]]:
    """Two datasets of held-out samples; each position agrees with probability `rate` at every step."""
    generator = np.random.default_rng(seed)
    return {name: [generator.random((12, 3)) < rate for _ in range(8)] for name in ("alpha", "beta")}


def test_the_answer_reports_the_measured_numbers_at_the_configured_confidence():
    acceptance = sweep_acceptance({20: agreements(0.2, 0), 80: agreements(0.5, 1)}, 3, num_resamples=200, confidence=0.8)
    loop = {"tau_loop_pooled": 1.31, "tau_offline_pooled": 1.29, "speedup": 0.87, "outputs_equal": True}
    seed_case = break_even_from_throughput(90.0, 82.3, 2.1)
    embedded = break_even_from_throughput(5.5, 3.7, 1.2, draft_length=3)
    benchmark = pd.DataFrame([{"data_size": 20, "prompts": 4, "tau": 1.05, "tau_low": 1.0, "tau_high": 1.1},
                              {"data_size": 80, "prompts": 4, "tau": 1.25, "tau_low": 1.15, "tau_high": 1.35}])
    lines = answer_in_words(acceptance, "all", Topology.chain(3), 16, 0.8, embedded, loop, ["the slope statement"], seed_case,
                            benchmark, "test.jsonl")

    overall = acceptance.summary[acceptance.summary["dataset"] == "all"].set_index("data_size")
    assert f"tau went from {overall.loc[20, 'tau_pooled']:.2f} with 20 training samples to {overall.loc[80, 'tau_pooled']:.2f}" in lines[0]
    assert "80% interval" in lines[0] and "ceiling tau 4" in lines[0] and "16 held-out samples" in lines[0]
    # The paired gain's interval is at the configured confidence (80% here), not a fixed 95%.
    replicates = acceptance.pooled_replicates["all"]
    low, high = percentile_interval(replicates[:, 1] - replicates[:, 0], 0.8)
    assert lines[1].startswith("More data helped") and f"{float(low):+.3f} to {float(high):+.3f} (80% interval)" in lines[1]
    assert f"needs tau above {embedded.break_even_accept_length:.2f}" in lines[2] and "0.87x" in lines[2] and "(slower)" in lines[2]
    assert lines[3] == "the slope statement"
    assert "4 benchmark prompts" in lines[4] and "from 1.05 (20 samples) to 1.25" in lines[4]
    assert f"must reach tau {seed_case.break_even_accept_length:.2f}" in lines[5] and "90 tok/s plain, 82.3 tok/s at tau 2.1" in lines[5]

    same = answer_in_words(sweep_acceptance({20: agreements(0.3, 2), 80: agreements(0.3, 2)}, 3, num_resamples=200), "all",
                           Topology.chain(3), 16, 0.95, embedded, loop, [], seed_case)
    assert same[1].startswith("More data did not measurably help") and len(same) == 4  # no benchmark line
