"""`python -m eaglekit.staged --params P --run-dir D [--generation-fd N --runner-pid PID]`: the staged worker,
as the runner starts it.

The runner passes the run folder's lock (inherited, so this process is a writer under the same lock, never a
second one) and the read end of a pipe it closes when stage 3 ends. When the runner itself dies (kill -9), the
worker stops at once, as a stage kernel does, so the lock it holds does not block the resume: the size it was
on continues from its last checkpoint then. Run by hand on a run folder whose generation has ended, it stages
nothing new: it only finishes a size a stopped worker left in training.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time

PARENT_POLL_S = 1.0
HARD_STOP_AFTER_S = 10.0  # the interrupt's grace period before the worker exits hard


def _stop_when_parent_dies(parent: int, interval_s: float = PARENT_POLL_S) -> None:
    """A thread that interrupts this process (as Ctrl-C would) once `parent`, the runner that started it, is
    gone (this process is then re-parented, so its parent pid changes; checked from the start, so no death is
    missed)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        logging.getLogger("eaglekit.staged").warning("staged worker: the runner (pid %d) is gone; stopping", parent)
        os.kill(os.getpid(), signal.SIGINT)
        # An interrupt that lands in a C call or is swallowed never ends the process, and the run folder's
        # lock would outlive the runner: after a grace period, stop hard. Every write is atomic, so this loses
        # no more than a kill -9 would (the size in progress resumes from its last checkpoint).
        time.sleep(HARD_STOP_AFTER_S)
        logging.getLogger("eaglekit.staged").warning("staged worker: still running %.0f s after the interrupt; exiting", HARD_STOP_AFTER_S)
        os._exit(130)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eaglekit.staged", description=__doc__)
    parser.add_argument("--params", required=True, help="the run folder's params.yaml")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--generation-fd", type=int, help="a pipe that reaches EOF when stage 3 ends (the runner's)")
    parser.add_argument("--runner-pid", type=int, help="the runner's pid: when it dies, the worker stops")
    args = parser.parse_args(argv)

    from eaglekit.config import load_params
    from eaglekit.run_log import attach_stage_logging
    from eaglekit.staged.worker import GenerationSignal, StagedWorker

    attach_stage_logging()  # run.log and the runner's stderr, tagged [staged]
    if args.runner_pid is not None:
        _stop_when_parent_dies(args.runner_pid)
    try:
        params = load_params(args.params)
        StagedWorker(params, args.run_dir, GenerationSignal(args.generation_fd)).run()
    except KeyboardInterrupt:
        logging.getLogger("eaglekit.staged").warning("staged worker stopped; a resume continues the size it was on")
        return 130
    except Exception:
        logging.getLogger("eaglekit.staged").exception("staged worker failed")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
