"""run.log: the runner's lines and every stage kernel's `eaglekit` log lines in one file of the run folder,
also on the runner's terminal and in the running cell's output.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from eaglekit.disk_full import describe_os_error


def under_runner() -> bool:
    """True in a stage kernel the runner started: progress goes to run.log as lines, never as a bar (a bar in
    an executed notebook stays frozen at its first frame)."""
    return bool(os.environ.get(STAGE_ENV))


def run_logger(run_dir: Path) -> logging.Logger:
    logger = logging.getLogger(f"eaglekit.run.{run_dir.name}")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    if not logger.handlers:
        formatter = logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%Y-%m-%d %H:%M:%S")
        for handler in (RunLogHandler(run_dir / "run.log", sys.stderr), logging.StreamHandler()):
            handler.setFormatter(formatter)
            logger.addHandler(handler)
    return logger


class RunLogHandler(logging.Handler):
    """Appends each line to run.log in one write on an O_APPEND descriptor (the runner and its stage kernel
    share the file). When the disk is full a line is lost from run.log only: the failure is said once on
    `report` (the terminal), not as a traceback per line, and after a write torn by either process the next
    line that fits starts on a line of its own."""

    def __init__(self, path: Path, report):
        super().__init__()
        self.path = Path(path)
        self.report = report
        self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)  # read: the last byte
        self._failing = False

    def emit(self, record: logging.LogRecord) -> None:
        try:
            data = (self.format(record) + "\n").encode("utf-8", "replace")
        except Exception:
            self.handleError(record)
            return
        try:
            if self._last_byte() not in (b"", b"\n"):  # a torn line, ours or the other process's
                data = b"\n" + data
            if os.write(self._fd, data) < len(data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
        except OSError as error:
            if not self._failing:
                self._failing = True
                with contextlib.suppress(Exception):
                    self.report.write(f"eaglekit: {self.path}: cannot append: {describe_os_error(error)}; "
                                      f"its lines reach only this output until there is room\n")
                    self.report.flush()
            return
        self._failing = False

    def _last_byte(self) -> bytes:
        size = os.fstat(self._fd).st_size
        return os.pread(self._fd, 1, size - 1) if size else b""

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)
        super().close()


RUN_LOG_ENV = "EAGLEKIT_RUN_LOG"  # the run folder's run.log, set by the runner for each stage kernel
STAGE_ENV = "EAGLEKIT_STAGE"  # the stage label, e.g. 03_generation


def attach_stage_logging() -> None:
    """Run inside a stage kernel at start-up: the `eaglekit` logger's lines reach `run.log`, the
    runner's output and the executed notebook.

    The kernel inherits the runner's stderr, so writing to the kernel's original stderr puts progress
    lines in `nohup eaglekit run ... > kimi.out` (where `tail -f` shows them); a second handler appends
    them to `run.log` (O_APPEND, beside the runner's own lines); a third writes to `sys.stderr`, which
    ipykernel routes into the running cell's output. Library code only logs; how often is its own
    setting (`log_interval_s`).
    """
    run_log = os.environ.get(RUN_LOG_ENV)
    if not run_log:
        return
    stage = os.environ.get(STAGE_ENV, "stage")
    # ipykernel may redirect fd 2 into the notebook; it keeps the original stderr as this copy.
    original = getattr(sys.stderr, "_original_stdstream_copy", None)
    terminal = open(os.dup(original), "w", buffering=1, encoding="utf-8", errors="replace") if original is not None else sys.__stderr__
    kit_logger = logging.getLogger("eaglekit")
    formatter = logging.Formatter(f"%(asctime)s %(levelname)s [{stage}] %(name)s: %(message)s", "%Y-%m-%d %H:%M:%S")
    # ipykernel routes sys.stderr into the running cell; a plain process (the staged worker) has no cell
    # output, and its sys.stderr is the terminal handler's stream already.
    in_kernel = type(sys.stderr).__module__.startswith("ipykernel")
    handlers = (RunLogHandler(Path(run_log), terminal), logging.StreamHandler(terminal), *([_NotebookHandler()] if in_kernel else []))
    for handler in handlers:
        handler.setFormatter(formatter)
        kit_logger.addHandler(handler)
    if kit_logger.level == logging.NOTSET:
        kit_logger.setLevel(logging.INFO)


class _NotebookHandler(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is at the time (ipykernel's stream into the running cell)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def quiet_iopub_shutdown_race() -> None:
    """Run inside a stage kernel at start-up: a flush that races the kernel's shutdown prints no traceback.

    ipykernel's IOPubThread.schedule asks whether the IO thread is alive, then wakes it through a pipe. When
    the kernel shuts down between the two (the control thread flushes after the shutdown reply while the main
    thread joins the IO thread and closes its pipes), the wake-up raises ENOTSOCK and tornado prints the
    traceback on the runner's terminal, under the stage's located message. ipykernel 7.4 catches this race in
    `_really_send` (ipython/ipykernel#1518) but not here. The thread is gone, so the callback runs at once, as
    schedule does for a dead thread; any other error is raised as before.
    """
    try:
        import zmq
        from ipykernel.iostream import IOPubThread
    except ImportError:
        return
    schedule = IOPubThread.schedule
    if getattr(schedule, "eaglekit_quiet", False):
        return

    def quiet_schedule(self, f):
        try:
            schedule(self, f)
        except zmq.ZMQError as error:
            if error.errno != zmq.ENOTSOCK or not getattr(self, "_stopped", False):
                raise
            f()

    quiet_schedule.eaglekit_quiet = True
    IOPubThread.schedule = quiet_schedule


KERNEL_HOOK = ("import eaglekit.run_log as _eaglekit_run_log; _eaglekit_run_log.attach_stage_logging(); "
               "_eaglekit_run_log.quiet_iopub_shutdown_race(); del _eaglekit_run_log")


# ---- no silent stretch -----------------------------------------------------------------------

# run.log never goes longer without a line: a user tailing it tells a long step from a hang
SILENCE_LIMIT_S = 30.0
# the runner's "still running" line comes this long after the last line, within the limit
HEARTBEAT_AFTER_S = 25.0


class StageHeartbeat:
    """While a stage runs, a thread watches run.log: after `after_s` without a new byte (from the runner, the
    stage's kernel or the staged worker), one line says the stage still runs, where (`where()`: the running
    cell and for how long) and how long nothing was logged. Stages log their own progress; this covers the
    steps that cannot (a model load, one long forward) so that no stretch of run.log is silent past
    SILENCE_LIMIT_S."""

    def __init__(self, run_log: Path, logger: logging.Logger, label: str, where: Callable[[], str],
                 after_s: float = HEARTBEAT_AFTER_S, poll_s: float = 1.0):
        self.run_log, self.logger, self.label, self.where = Path(run_log), logger, label, where
        self.after_s, self.poll_s = after_s, poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"heartbeat-{label}", daemon=True)

    def __enter__(self) -> "StageHeartbeat":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _size(self) -> int:
        try:
            return self.run_log.stat().st_size
        except OSError:
            return -1

    def _watch(self) -> None:
        size, changed = self._size(), time.monotonic()
        while not self._stop.wait(self.poll_s):
            now, current = time.monotonic(), self._size()
            if current != size:
                size, changed = current, now
            elif now - changed >= self.after_s:
                with contextlib.suppress(Exception):  # a heartbeat never fails the stage it reports on
                    self.logger.info("stage %s: still running%s; nothing logged for %.0f s", self.label, self.where(), now - changed)
                size, changed = self._size(), time.monotonic()
