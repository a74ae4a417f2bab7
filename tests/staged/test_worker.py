"""The staged worker's loop: how it learns that generation ended, and that it starts no size after that."""

import json
import os
import threading
import time
from pathlib import Path

from eaglekit.config import load_params
from eaglekit.staged.slices import StagedRecord
from eaglekit.staged.worker import GenerationSignal, StagedWorker
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
    order = TrainingOrder(seed=seed, heldout_size=heldout_size, heldout=tuple(("d", f"h{i}") for i in range(heldout_size)),
                          train=tuple(("d", f"t{i}") for i in range(20)))
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
