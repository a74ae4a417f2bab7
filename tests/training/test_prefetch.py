"""The prefetching reader: the same items in the same order as reading in the step, a read's exception
raised in the training thread, no thread left after an early stop; train_draft with and without
prefetch writes the same losses and weights, and a run stopped early leaves no reader running."""

from __future__ import annotations

import dataclasses
import itertools
import json
import threading
import time

import pytest
import torch

from eaglekit.training import IndexedSubset, TrainSettings, load_checkpoint, train_draft
from eaglekit.training.prefetch import Prefetcher, SerializedSamples
from support import samples_from_target, target_head, tiny_draft, tiny_target

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def prefetch_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == "eaglekit-prefetch"]


def test_same_items_in_the_same_order_at_every_depth():
    read = lambda key: {"key": key, "tensor": torch.full((3,), float(key))}
    reference = [read(key) for key in range(0, 40, 4)]
    for depth in (0, 1, 2, 5):
        with Prefetcher(read, iter(range(0, 40, 4)), depth) as items:
            got = list(items)
        assert [item["key"] for item in got] == [item["key"] for item in reference], depth
        assert all(torch.equal(a["tensor"], b["tensor"]) for a, b in zip(got, reference))
    assert not prefetch_threads()


def test_reads_run_ahead_of_the_consumer_in_a_background_thread():
    threads: set[str] = set()

    def read(key: int) -> int:
        threads.add(threading.current_thread().name)
        return key

    with Prefetcher(read, itertools.count(), depth=3) as items:
        assert next(items) == 0
        deadline = time.monotonic() + 5
        while (
            items._queue.qsize() < 3 and time.monotonic() < deadline
        ):  # the queue fills while nothing consumes
            time.sleep(0.01)
        assert items._queue.qsize() == 3
    assert threads == {"eaglekit-prefetch"}
    assert not prefetch_threads()


def test_a_read_error_is_raised_in_the_consumer_at_its_item():
    def read(key: int) -> int:
        if key == 3:
            raise OSError("shard 3 is gone")
        return key

    items = Prefetcher(read, itertools.count(), depth=2)
    assert [next(items) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(OSError, match="shard 3 is gone"):
        next(items)
    assert not items.running and not prefetch_threads()


def test_close_on_an_early_stop_stops_a_reader_blocked_on_a_full_queue():
    items = Prefetcher(lambda key: key, itertools.count(), depth=2)
    assert next(items) == 0
    time.sleep(0.1)  # the reader fills the queue and waits on it
    items.close()
    assert not items.running and not prefetch_threads()
    with pytest.raises(StopIteration):
        next(items)


def test_grad_mode_is_off_in_the_reader():
    with Prefetcher(lambda key: torch.is_grad_enabled(), iter(range(2)), depth=1) as items:
        assert list(items) == [False, False]


def test_serialized_samples_read_under_the_lock():
    lock = threading.Lock()
    held = []

    class Samples(list):
        def tokens(self, position):
            held.append(lock.locked())
            return {"id": position}

        def __getitem__(self, position):
            held.append(lock.locked())
            return super().__getitem__(position)

    view = SerializedSamples(Samples([{"id": 0}, {"id": 1}]), lock)
    assert len(view) == 2 and view[1] == {"id": 1} and view.tokens(0) == {"id": 0}
    assert held == [True, True] and not lock.locked()


@pytest.fixture(scope="module")
def small_run():
    target = tiny_target()
    samples = samples_from_target(target, 10, seed=3)
    return target, samples


def test_train_draft_with_and_without_prefetch_is_the_same_run(small_run, tmp_path):
    target, samples = small_run
    train, heldout = IndexedSubset(samples, range(2, 10)), IndexedSubset(samples, range(2))
    settings = TrainSettings(
        ttt_steps=2,
        micro_batch_size=2,
        grad_accumulation_steps=1,
        max_steps=5,
        eval_interval=2,
        schedule="equal_steps",
        learning_rate=3e-3,
        warmup_steps=1,
        max_length=48,
        log_interval_s=60,
    )
    results = {}
    for depth in (0, 2):
        run_settings = dataclasses.replace(settings, prefetch_steps=depth)
        results[depth] = train_draft(
            tiny_draft(target, samples),
            target_head(target).lm_head,
            train,
            heldout,
            tmp_path / f"d{depth}",
            run_settings,
        )
        assert not prefetch_threads()
    lines = {depth: (tmp_path / f"d{depth}" / "metrics.jsonl").read_text().splitlines() for depth in results}
    strip = lambda line: {key: value for key, value in json.loads(line).items() if key != "seconds"}
    assert [strip(line) for line in lines[0]] == [strip(line) for line in lines[2]]
    one, two = (load_checkpoint(results[depth].last_checkpoint)["model"] for depth in (0, 2))
    assert all(torch.equal(one[name], two[name]) for name in one)


def test_an_early_stop_and_resume_leave_no_reader_running(small_run, tmp_path):
    target, samples = small_run
    train, heldout = IndexedSubset(samples, range(2, 10)), IndexedSubset(samples, range(2))
    settings = TrainSettings(
        ttt_steps=2,
        micro_batch_size=2,
        grad_accumulation_steps=1,
        max_steps=6,
        eval_interval=2,
        schedule="equal_steps",
        learning_rate=3e-3,
        warmup_steps=1,
        max_length=48,
        log_interval_s=60,
        prefetch_steps=3,
    )

    full = train_draft(
        tiny_draft(target, samples), target_head(target).lm_head, train, heldout, tmp_path / "full", settings
    )
    stopped = train_draft(
        tiny_draft(target, samples),
        target_head(target).lm_head,
        train,
        heldout,
        tmp_path / "split",
        dataclasses.replace(settings, stop_at_step=2),
    )
    assert stopped.steps == 2 and not prefetch_threads()
    resumed = train_draft(
        tiny_draft(target, samples), target_head(target).lm_head, train, heldout, tmp_path / "split", settings
    )
    assert resumed.steps == full.steps == 6 and not prefetch_threads()
    one, two = (load_checkpoint(result.last_checkpoint)["model"] for result in (full, resumed))
    assert all(torch.equal(one[name], two[name]) for name in one)
