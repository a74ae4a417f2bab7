"""The ETA of `eaglekit.generation.logs` on synthetic timelines: a two-partition run simulated request by
request (answer lengths lognormal, a prefill then a fixed decode speed, each partition at its concurrency, the
long one starting in the room the short one frees), read at 10-s ticks the way the engine reads itself. No
server: the estimator is pure. The cases are the ones the old estimator (a partition's finished requests over
its elapsed time, an unstarted partition priced at the last one's request rate) got wrong in a real run."""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import pytest

from eaglekit.generation.logs import ETA_WINDOW_S, PartitionWork, progress_line, run_etas, work_left


@dataclass(frozen=True)
class Partition:
    name: str
    prompts: int
    concurrency: int
    max_tokens: int
    mean_tokens: float


# Close to the run the ETA was reported wrong on: a short partition at concurrency 256, then a long one at 32
# whose answers run 16 times longer; about 45 minutes in all.
RUN = (Partition("short", 6000, 256, 4096, 900), Partition("long", 300, 32, 16384, 4000))


def simulate(
    partitions=RUN, overlap: bool = True, speed: float = 25.0, prefill_s: float = 2.0, seed: int = 0
):
    """(partition, sent, ended, tokens) of every request, sent as the engine sends them
    (`capacity.SharedPool`)."""
    rng = np.random.default_rng(seed)
    requests, heap, room, now = [], [], Fraction(0), 0.0
    for partition in partitions:
        if not overlap:  # the engine before the overlap: drain, then the next partition
            now = max([now, *(end for end, _, _ in heap)])
            heap, room = [], Fraction(0)
        share = Fraction(1, partition.concurrency)
        lengths = rng.lognormal(np.log(partition.mean_tokens) - 0.5, 1.0, partition.prompts)
        for tokens in np.clip(lengths, 1, partition.max_tokens).astype(int).tolist():
            while room + share > 1:
                now, _, freed = heapq.heappop(heap)
                room -= freed
            room += share
            end = now + prefill_s + tokens / speed
            heapq.heappush(heap, (end, len(requests), share))
            requests.append((partition.name, now, end, tokens))
    return requests


def works_at(requests, t: float, partitions=RUN) -> list[PartitionWork]:
    """What the engine knows at time t (`GenerationEngine._work`)."""
    works = []
    for partition in partitions:
        mine = [request for request in requests if request[0] == partition.name]
        done = sorted((request for request in mine if request[2] <= t), key=lambda request: request[2])
        running = [request for request in mine if request[1] <= t < request[2]]
        recent = [request for request in done if request[2] > t - ETA_WINDOW_S] or done[-64:]
        if len(recent) < 64:
            recent = done[-64:]
        works.append(
            PartitionWork(
                partition.name,
                partition.prompts - len(done) - len(running),
                [t - request[1] for request in running],
                [request[3] for request in done],
                [(request[3], request[2] - request[1]) for request in recent],
                partition.concurrency,
                partition.max_tokens,
            )
        )
    return works


def test_no_figure_before_there_is_evidence_for_one():
    requests = simulate()
    for t in (5.0, 20.0):  # the old estimator said 15m42s at 20 s for a 46-minute run
        etas, total = run_etas(works_at(requests, t), t)
        assert total.kind == "not yet known" and total.seconds is None
        assert total.words() == f"not yet known ({t:.0f} s of 30 s measured)"
        assert all(eta.words() == "not yet known" for eta in etas.values())


@pytest.mark.parametrize("overlap", [True, False])
def test_a_partition_without_answers_is_bounded_by_max_tokens_never_priced_at_another_ones_rate(overlap):
    # The old estimator gave the long partition (no answer yet) the short one's request rate: 0m42s, the whole
    # run 13m39s at minute 1 of 45. Until a long answer is in, the long partition is at most max_tokens an
    # answer, and the run's total is not yet known (its bound said in words).
    requests = simulate(overlap=overlap)
    end = max(request[2] for request in requests)
    first_long = min(request[2] for request in requests if request[0] == "long")
    long_alone = end - max(request[2] for request in requests if request[0] == "short")
    ticks = np.arange(60.0, first_long, 60.0)
    assert len(ticks) >= 10
    for t in ticks:
        etas, total = run_etas(works_at(requests, t), t, overlap=overlap)
        assert etas["short"].kind in ("estimate", "range")
        assert (
            etas["long"].kind == "at most" and "0 answers of it yet: up to max_tokens" in etas["long"].words()
        )
        assert etas["long"].seconds >= long_alone
        assert total.kind == "not yet known" and total.words().startswith(
            "not yet known (long has no answers yet: at most"
        )


def test_the_predicted_end_does_not_climb_while_long_answers_are_awaited():
    # The long partition's first 10 answers came in its first minute (the short ones among them); the other 54
    # run for minutes. The old estimator (remaining x elapsed / finished) rose by 54 s every 10 s through that
    # wait; the running answers' age is evidence they are long, never that the run got slower.
    short = PartitionWork("short", 0, [], [400] * 500, [(400, 18.0)] * 64, 256, 4096)
    lengths = [300, 450, 600, 700, 800, 900, 1000, 1200, 1300, 1500]
    answers = [(tokens, 2.0 + tokens / 25.0) for tokens in lengths]
    predicted = []
    for t in np.arange(60.0, 200.0, 10.0):  # seconds since the long partition started; 16 running, 38 to send
        long = PartitionWork("long", 38, [t] * 16, lengths, answers, 16, 16384)
        etas, total = run_etas([short, long], 900.0 + t)
        assert total.kind in ("range", "estimate")
        predicted.append(t + total.seconds)
    rises = np.diff(predicted)
    assert rises.max() <= 0.01 * predicted[0], rises


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_remaining_time_lies_within_the_eta_once_one_is_given(overlap, seed):
    requests = simulate(overlap=overlap, seed=seed)
    end = max(request[2] for request in requests)
    inside, given = 0, 0
    for t in np.arange(30.0, end, 10.0):
        _, total = run_etas(works_at(requests, t), t, overlap=overlap)
        if total.seconds is None:
            continue
        given += 1
        low = total.low_s if total.low_s is not None else 0.0
        inside += 0.9 * low - 60.0 <= end - t <= 1.1 * total.seconds + 60.0
    assert given >= 0.6 * (end - 30.0) / 10.0  # a figure for most of the run
    # The old estimator's figure held the remaining time at 2-5% of the ticks of these runs.
    assert inside >= 0.85 * given, (
        f"the remaining time was outside the ETA at {given - inside} of {given} ticks"
    )


def test_work_left_counts_new_answers_and_the_rest_of_running_ones():
    # 10 answers of 100 tokens: 2 new ones are 200 tokens; 2 running at 50 have 50 each to go, on 2 slots.
    low, high = work_left([100] * 10, [50.0, 50.0], max_tokens=1000, to_send=2, slots=2)
    assert low.total == pytest.approx(300.0) and high.total == pytest.approx(300.0)
    assert low.makespan == pytest.approx(150.0) and high.makespan == pytest.approx(150.0)
    # Nothing known: the new answers are up to max_tokens each (upper), nothing (lower).
    low, high = work_left([], [], max_tokens=1000, to_send=3, slots=2)
    assert (low.total, high.total, high.makespan) == (0.0, 3000.0, 2000.0)


def test_the_progress_line_says_the_eta_in_words():
    requests = simulate()
    etas, total = run_etas(works_at(requests, 600.0), 600.0)
    snapshot = {
        "elapsed_s": 600.0,
        "done": {"chat": 10},
        "total": {"chat": 20},
        "errors": 0,
        "truncated": 0,
        "requests_per_s": 1.0,
        "completion_tokens_per_s": 100.0,
        "mean_completion_tokens": 100.0,
        "in_flight": 3,
        "eta_s": {name: eta.seconds for name, eta in etas.items()},
        "eta": {name: eta.words() for name, eta in etas.items()},
        "eta_total_s": total.seconds,
        "eta_total": total.words(),
        "rate_window_s": 60.0,
    }
    line = progress_line(snapshot)
    assert f"ETA short {etas['short'].words()}, long at most " in line
    assert line.endswith(f"total {total.words()}")
