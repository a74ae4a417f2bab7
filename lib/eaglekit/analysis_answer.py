"""Stage 6's answer in plain words (notebook 06's last cell), every number taken from what was measured.

Nothing here measures or fits: it reads the sweep's offline acceptance (`acceptance.SweepAcceptance`), the
real loop's summary (`checkpoint_evaluation.evaluate_speculative_loop`), the scaling statements
(`scaling.scaling_answer`), the benchmark curve and the break-even cases, and says them in order.
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

from eaglekit.acceptance import SweepAcceptance, percentile_interval
from eaglekit.scaling import BreakEven
from eaglekit.topology import Topology


def answer_in_words(
    acceptance: SweepAcceptance,
    pooled_dataset: str,
    topology: Topology,
    heldout_samples: int,
    confidence: float,
    embedded_case: BreakEven,
    loop_summary: dict,
    scaling_statements: Sequence[str],
    seed_case: BreakEven,
    benchmark_summary: pd.DataFrame | None = None,
    benchmark_name: str = "",
) -> list[str]:
    """The answer as paragraphs: held-out tau from the smallest to the largest draft with its interval, the
    paired-bootstrap gain between them, the real loop against break-even, the scaling statements, the
    benchmark curve (when measured) and the seed's serving case. Intervals are at `confidence`."""
    overall = acceptance.summary[acceptance.summary["dataset"] == pooled_dataset].sort_values("data_size")
    first, last = overall.iloc[0], overall.iloc[-1]
    lines = [f"On {heldout_samples} held-out samples, a greedy {topology.label} (ceiling tau {topology.ceiling:g}): tau went from "
             f"{first['tau_pooled']:.2f} with {first['data_size']:g} training samples to {last['tau_pooled']:.2f} "
             f"({confidence:.0%} interval {last['tau_pooled_low']:.2f}-{last['tau_pooled_high']:.2f}) with {last['data_size']:g}."]
    # The same resampled held-out sets score every draft, so the difference of two columns is a paired interval.
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
                     f"({confidence:.0%} interval {last_bench['tau_low']:.2f}-{last_bench['tau_high']:.2f}) with {last_bench['data_size']:g}.")
    lines.append(f"For the seed's serving case ({seed_case.baseline_tokens_per_s:g} tok/s plain, {seed_case.speculative_tokens_per_s:g} tok/s "
                 f"at tau {seed_case.accept_length:g}) the draft must reach tau {seed_case.break_even_accept_length:.2f} to break even; "
                 "this run's curve is for the embedded target and its draft, not that deployment.")
    return lines
