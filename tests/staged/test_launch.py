"""The worker process as the runner starts it: told by a pipe that generation ended, stopped when the runner
dies."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eaglekit.run_folder import RunFolderLock, RunLockedError
from eaglekit.runner import RUN_LOG_ENV, STAGE_ENV
from eaglekit.staged.launch import STAGE_LABEL, StagedProcess
from eaglekit.training.order import ORDER_FILE, TrainingOrder

ROOT = Path(__file__).resolve().parents[2]


def waiting_run_folder(tmp_path: Path) -> Path:
    """A run folder whose planned held-out set has no answer yet: the worker waits for its first slice."""
    from eaglekit.config import load_params

    params = load_params(ROOT / "params" / "smoke.yaml")
    order = TrainingOrder(
        seed=params.run.seed,
        heldout_size=params.training.heldout_size,
        heldout=tuple(("d", f"h{i}") for i in range(params.training.heldout_size)),
        train=tuple(("d", f"t{i}") for i in range(20)),
    )
    (tmp_path / "prep").mkdir()
    (tmp_path / "prep" / ORDER_FILE).write_text(json.dumps(order.to_dict()))
    (tmp_path / "params.yaml").write_text((ROOT / "params" / "smoke.yaml").read_text())
    return tmp_path


def wait_for(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def test_closing_the_pipe_ends_a_worker_that_waits_for_a_slice(tmp_path):
    run_dir = waiting_run_folder(tmp_path)
    lock = RunFolderLock(run_dir).acquire()
    env = {RUN_LOG_ENV: str(run_dir / "run.log"), STAGE_ENV: STAGE_LABEL}
    worker = StagedProcess.start(run_dir / "params.yaml", run_dir, lock.fd, env)
    try:
        assert worker.wait(3.0) is None  # waiting: the held-out set is not answered
        worker.generation_ended()
        assert worker.wait(60.0) == 0
    finally:
        worker.stop(1.0)
        lock.release()
    assert "generation has ended" in (run_dir / "run.log").read_text()


# A runner that starts the worker, then hands a copy of the pipe's write end to a process that outlives it:
# the pipe stays open after the runner dies, as it is in effect while the worker trains a size (it reads the
# pipe only between sizes), so only the worker's watch on the runner's pid can stop it.
RUNNER = """
import subprocess, sys, time
from pathlib import Path
from eaglekit.run_folder import RunFolderLock
from eaglekit.staged.launch import StagedProcess
run_dir = Path(sys.argv[1])
lock = RunFolderLock(run_dir).acquire()
environment = {"EAGLEKIT_RUN_LOG": str(run_dir / "run.log")}
worker = StagedProcess.start(run_dir / "params.yaml", run_dir, lock.fd, environment)
holder = subprocess.Popen(["sleep", "120"], pass_fds=(worker._write_fd,), start_new_session=True)
print(worker.pid, holder.pid, flush=True)
time.sleep(600)
"""


def test_a_runner_killed_with_minus_9_takes_its_worker_and_the_lock_with_it(tmp_path):
    run_dir = waiting_run_folder(tmp_path)
    runner = subprocess.Popen([sys.executable, "-c", RUNNER, str(run_dir)], stdout=subprocess.PIPE, text=True)
    worker_pid, holder_pid = map(int, runner.stdout.readline().split())
    try:
        time.sleep(
            3.0
        )  # the worker is up (or still importing: its watch holds the runner's pid from the start)
        with pytest.raises(RunLockedError):
            RunFolderLock(run_dir).acquire(wait_for_orphans_s=0.0)  # held by the runner and its worker
        runner.send_signal(signal.SIGKILL)
        runner.wait()
        lock = RunFolderLock(run_dir).acquire(wait_for_orphans_s=30.0)  # the worker let it go
        lock.release()
        assert wait_for(lambda: not _alive(worker_pid), 30.0)
        assert f"the runner (pid {runner.pid}) is gone" in (run_dir / "run.log").read_text()
    finally:
        for pid in (worker_pid, holder_pid):
            if _alive(pid):
                os.killpg(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (dead, not yet reaped by init) counts as gone
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_without_a_gpu_the_embedded_server_gets_the_cores_the_worker_leaves(monkeypatch):
    import torch

    from eaglekit.config import params_from_sections
    from eaglekit.staged.launch import staged_serving_params
    from eaglekit.staged.worker import cpu_threads_split

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(os, "cpu_count", lambda: 5)
    assert cpu_threads_split() == (2, 3)
    assert staged_serving_params(params_from_sections({})).server.threads == 3
    assert (
        staged_serving_params(params_from_sections({"server": {"threads": 4}})).server.threads == 4
    )  # the user's choice
    served = params_from_sections({"endpoints": [{"url": "http://10.0.0.5:30000/v1"}]})
    assert staged_serving_params(served) is served  # a remote engine's threads are not ours to set
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert (
        cpu_threads_split() is None and staged_serving_params(params_from_sections({})).server.threads is None
    )
