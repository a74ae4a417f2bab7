"""The runner's side of a staged run: the worker process beside stage 3's kernel, and how it is told and
stopped.

The worker (`python -m eaglekit.staged`) inherits the run folder's lock descriptor, so the folder keeps one
writer (the runner and its children) even if the runner dies; it leads its own process group, so the runner
alone decides when a Ctrl-C reaches it. Generation's end is the closing of a pipe: the runner closes its end
when stage 3 returns. A runner killed with -9 closes it too, and the worker, which watches the runner's pid,
stops at once, so its inherited lock does not keep a resume out.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

STAGE_LABEL = "staged"


def staged_serving_params(params):
    """Params for the embedded server of a staged run: on a machine without a GPU, unless `server.threads` is
    set, it gets the CPU threads the worker leaves (`worker.cpu_threads_split`)."""
    from eaglekit.staged.worker import cpu_threads_split

    split = cpu_threads_split()
    if split is None or params.server.threads is not None or params.endpoints:
        return params
    return params.model_copy(update={"server": params.server.model_copy(update={"threads": split[1]})})


class StagedProcess:
    def __init__(self, process: subprocess.Popen, write_fd: int):
        self.process = process
        self._write_fd: int | None = write_fd

    @classmethod
    def start(cls, params_path: Path, run_dir: Path, lock_fd: int, environment: dict[str, str]) -> StagedProcess:
        read_fd, write_fd = os.pipe()
        os.set_inheritable(read_fd, True)
        command = [sys.executable, "-m", "eaglekit.staged", "--params", str(params_path), "--run-dir", str(run_dir),
                   "--generation-fd", str(read_fd), "--runner-pid", str(os.getpid())]
        try:
            process = subprocess.Popen(command, pass_fds=(lock_fd, read_fd), env={**os.environ, **environment, "PYTHONUNBUFFERED": "1"},
                                       stdin=subprocess.DEVNULL, start_new_session=True)
        except BaseException:
            os.close(write_fd)
            raise
        finally:
            os.close(read_fd)
        return cls(process, write_fd)

    @property
    def pid(self) -> int:
        return self.process.pid

    def generation_ended(self) -> None:
        """Close the pipe: the worker finishes the size it is on and starts no other."""
        if self._write_fd is not None:
            os.close(self._write_fd)
            self._write_fd = None

    def signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signum)

    def wait(self, timeout_s: float | None = None) -> int | None:
        """The exit status, or None when it is still running after `timeout_s`."""
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, grace_s: float) -> int:
        """SIGINT (the worker's training stops at its next step), then SIGKILL after `grace_s`: a resume
        continues it."""
        self.generation_ended()
        if self.process.poll() is None:
            self.signal(signal.SIGINT)
            if self.wait(grace_s) is None:
                self.signal(signal.SIGKILL)
        return self.process.wait()
