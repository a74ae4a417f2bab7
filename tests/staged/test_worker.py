"""The staged worker's loop: how it learns that generation ended, and that it starts no size after that."""

import json
import os
import threading
import time
from pathlib import Path

import pytest

from eaglekit.config import load_params
from eaglekit.io import InputError, write_json
from eaglekit.staged.slices import StagedRecord
from eaglekit.staged.worker import BREAK_EVEN_FILE, GenerationSignal, StagedWorker, staged_summary
from eaglekit.training.order import ORDER_FILE, TrainingOrder

ROOT = Path(__file__).resolve().parents[2]


def test_the_pipe_says_running_until_its_write_end_closes_and_a_wait_wakes_at_the_close():
    read_fd, write_fd = os.pipe()
    signal = GenerationSignal(read_fd)
    assert signal.running()
    threading.Timer(0.2, os.close, (write_fd,)).start()
    started = time.monotonic()
    signal.wait(30.0)
    assert time.monotonic() - started < 20.0  # woke at the close, not after the 30 s
    assert not signal.running()
    os.close(read_fd)


def test_a_pipe_with_data_written_is_still_running():
    read_fd, write_fd = os.pipe()
    os.write(write_fd, b"x")  # only EOF means ended
    signal = GenerationSignal(read_fd)
    signal.wait(0.1)
    assert signal.running()
    os.close(write_fd)
    signal.wait(1.0)
    assert not signal.running()
    os.close(read_fd)


def planned_run_folder(tmp_path: Path, seed: int, heldout_size: int) -> Path:
    order = TrainingOrder(
        seed=seed,
        heldout_size=heldout_size,
        heldout=tuple(("d", f"h{i}") for i in range(heldout_size)),
        train=tuple(("d", f"t{i}") for i in range(20)),
    )
    (tmp_path / "prep").mkdir(parents=True)
    (tmp_path / "prep" / ORDER_FILE).write_text(json.dumps(order.to_dict()))
    return tmp_path


def test_no_size_starts_once_generation_has_ended(tmp_path):
    params = load_params(ROOT / "params" / "smoke.yaml")
    run_dir = planned_run_folder(tmp_path, params.run.seed, params.training.heldout_size)
    assert StagedWorker(params, run_dir, GenerationSignal(running=False)).run() == []
    assert not StagedRecord.path(run_dir).exists()  # nothing recorded: stages 4-6 train every size


def test_without_a_planned_order_nothing_is_staged(tmp_path):
    params = load_params(ROOT / "params" / "smoke.yaml")
    assert StagedWorker(params, tmp_path, GenerationSignal(running=True)).run() == []


# ---- a staged slice is the one stage 5 trains: waited for, checked, set aside when it differs -----------


class EndsAtFirstWait:
    """Generation running until the worker first waits for it; then ended."""

    def __init__(self):
        self._running = True

    def running(self) -> bool:
        return self._running

    def wait(self, seconds: float) -> None:
        self._running = False


def staged_folder(tmp_path: Path, params, answered, errors, sessions: int) -> Path:
    """Prep's order, stage 3's logs (answers; errors as (id, session)) and `sessions` finished sessions."""
    run_dir = planned_run_folder(tmp_path, params.run.seed, params.training.heldout_size)
    generation = run_dir / "generation"
    generation.mkdir()
    (generation / "generations.jsonl").write_text(
        "".join(
            json.dumps({"dataset": "d", "id": name, "partition": "short", "content": "x"}) + "\n"
            for name in answered
        )
    )
    (generation / "errors.jsonl").write_text(
        "".join(
            json.dumps({"dataset": "d", "id": name, "session": session, "error": "timeout"}) + "\n"
            for name, session in errors
        )
    )
    (generation / "sessions.jsonl").write_text(
        "".join(json.dumps({"session": number}) + "\n" for number in range(1, sessions + 1))
    )
    return run_dir


def stub_training(monkeypatch) -> list:
    """Every answered sample tokenizes; "training" a size marks it done. Returns the sizes staged, in
    order."""
    import eaglekit.staged.worker as worker

    staged = []
    monkeypatch.setattr(worker, "write_staged_data", lambda run_dir, keys, params, tokenizer: ({}, set(keys)))
    monkeypatch.setattr(worker.StagedWorker, "_tokenizer", None)

    def stage(self, entry, record, planned_prompts):
        entry.status = "done"
        record.save(self.run_dir)
        staged.append((entry.size, list(entry.train)))

    monkeypatch.setattr(worker.StagedWorker, "_stage_size", stage)
    return staged


def test_a_slice_waits_for_the_retry_of_an_error_an_earlier_session_left(tmp_path, monkeypatch):
    params = load_params(ROOT / "params" / "smoke.yaml")
    heldout = [f"h{i}" for i in range(params.training.heldout_size)]
    # t1 failed in session 1; session 2 (this generation) retries it and has not answered it yet.
    run_dir = staged_folder(
        tmp_path, params, [*heldout, *(f"t{i}" for i in range(20) if i != 1)], [("t1", 1)], sessions=1
    )
    staged = stub_training(monkeypatch)
    assert StagedWorker(params, run_dir, EndsAtFirstWait()).run() == []
    assert (
        staged == []
        and StagedRecord.load(run_dir, params.run.seed, params.training.heldout_size).slices == {}
    )


def test_a_recorded_size_whose_samples_are_no_longer_stage_5s_is_reported_and_staged_again(
    tmp_path, monkeypatch, caplog
):
    from eaglekit.staged.slices import SliceEntry, keys_sha256

    params = load_params(ROOT / "params" / "smoke.yaml")
    heldout = [f"h{i}" for i in range(params.training.heldout_size)]
    # An earlier session left t1 failed and size 4 was staged without it; a resume answered t1.
    run_dir = staged_folder(tmp_path, params, [*heldout, *(f"t{i}" for i in range(20))], [], sessions=2)
    old = [("d", "t0"), ("d", "t2"), ("d", "t3"), ("d", "t4")]
    record = StagedRecord(
        params.run.seed, params.training.heldout_size, heldout=[("d", name) for name in heldout]
    )
    record.slices[4] = SliceEntry(size=4, train=old, train_sha256=keys_sha256(old), status="done")
    record.save(run_dir)
    (run_dir / "staged" / "training" / "size-0000004").mkdir(parents=True)
    staged = stub_training(monkeypatch)
    with caplog.at_level("WARNING", logger="eaglekit.staged.worker"):
        assert StagedWorker(params, run_dir, GenerationSignal(running=True)).run() == sorted(
            params.training.data_sizes
        )
    assert staged[0] == (4, [("d", f"t{i}") for i in range(4)])
    record = StagedRecord.load(run_dir, params.run.seed, params.training.heldout_size)
    (aside,) = record.set_aside
    assert aside["size"] == 4 and "stage 5 would train size 4 on other samples" in aside["problem"]
    assert (run_dir / aside["folder"]).exists() and not (
        run_dir / "staged" / "training" / "size-0000004"
    ).exists()
    assert "staged size 4: stage 5 would train size 4 on other samples" in caplog.text


def test_a_torn_staged_record_or_break_even_names_the_file_and_the_fix(tmp_path):
    """Both were a bare JSONDecodeError: the runner's state.json summary and the worker's kept break-even."""
    params = load_params(ROOT / "params" / "smoke.yaml")
    StagedRecord(params.run.seed, params.training.heldout_size).save(tmp_path)
    record = StagedRecord.path(tmp_path)
    assert staged_summary(tmp_path)["sizes_done"] == []
    os.truncate(record, record.stat().st_size - 2)
    with pytest.raises(InputError, match=rf"{record}:\d+: not JSON .*; move staged/ aside"):
        staged_summary(tmp_path)
    kept = tmp_path / "staged" / BREAK_EVEN_FILE
    write_json(kept, {"break_even_accept_length": 1.5, "assumptions": ["timed"]})
    os.truncate(kept, kept.stat().st_size // 2)
    worker = StagedWorker(params, tmp_path, GenerationSignal(running=False))
    with pytest.raises(
        InputError, match=rf"{kept}:\d+: not JSON .*; delete it to measure the break-even again"
    ):
        worker._embedded_break_even(StagedRecord(params.run.seed, params.training.heldout_size), [])
