"""run.log: the runner's heartbeat fills every silence of a running stage, and the silence check reads the
file."""

import logging
import time

import pytest

from eaglekit.run_log import RunLogHandler, StageHeartbeat
from support import silent_stretches  # the oracle the e2e run holds run.log to


def _logger(path, name):
    logger = logging.getLogger(f"eaglekit.test.{name}")
    logger.handlers.clear()
    logger.propagate = False
    logger.setLevel(logging.INFO)
    handler = RunLogHandler(path, open("/dev/null", "w"))
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%Y-%m-%d %H:%M:%S"))
    logger.addHandler(handler)
    return logger


def test_a_quiet_stage_gets_a_line_saying_where_it_is_and_a_talking_one_none(tmp_path):
    run_log = tmp_path / "run.log"
    logger = _logger(run_log, "heartbeat")
    logger.info("stage 06_analysis: running")
    with StageHeartbeat(
        run_log,
        logger,
        "06_analysis",
        lambda: " in cell [5] (`result = run_analysis_stage(params, out)`)",
        after_s=0.6,
        poll_s=0.05,
    ):
        time.sleep(2.0)  # a cell that logs nothing: about three heartbeats
    beats = [line for line in run_log.read_text().splitlines() if "still running" in line]
    assert 2 <= len(beats) <= 4, beats
    assert (
        "stage 06_analysis: still running in cell [5] (`result = run_analysis_stage(params, out)`); "
        "nothing logged for" in beats[0]
    )

    talking = tmp_path / "talking.log"
    logger = _logger(talking, "talking")
    with StageHeartbeat(talking, logger, "05_training", lambda: "", after_s=0.6, poll_s=0.05):
        for step in range(10):  # a stage that logs every 0.2 s needs no heartbeat
            logger.info("step %d", step)
            time.sleep(0.2)
    assert "still running" not in talking.read_text()


def test_silent_stretches_are_the_gaps_between_timestamped_lines(tmp_path):
    run_log = tmp_path / "run.log"
    run_log.write_text(
        "2026-12-06 10:00:00 INFO stage 04_capture: running\n"
        "2026-12-06 10:00:29 INFO [04_capture] capture: 10 samples\n"
        "Traceback (most recent call last):\n"  # no timestamp: part of the line before
        "2026-12-06 10:01:05 INFO [04_capture] capture: 20 samples\n"
        "2026-12-06 10:01:06 INFO stage 04_capture: done\n"
    )
    stretches = silent_stretches(run_log, limit_s=30)
    assert [(gap, after.split(" INFO ")[1]) for _, after, gap in stretches] == [
        (36.0, "[04_capture] capture: 20 samples")
    ]
    assert silent_stretches(run_log, limit_s=40) == []


# ---- a flush that races the kernel's shutdown -----------------------------------------------------

# The interleaving CI met once under load (a stage kernel shut down while its control thread flushed): the
# flushing thread finds ipykernel's IO thread alive, loses the CPU, and wakes it through a pipe that stop()
# has closed since. Here the flushing thread is held at that point until stop() returns, so the race happens
# every time.
RACE = r"""
import json, sys, threading
import zmq
from ipykernel.iostream import IOPubThread
from eaglekit.run_log import quiet_iopub_shutdown_race

if sys.argv[1] == "kit":
    quiet_iopub_shutdown_race()
context = zmq.Context()
pub = IOPubThread(context.socket(zmq.PUB))
pub.start()
found_alive, stopped, ran = threading.Event(), threading.Event(), threading.Event()
hold = threading.Event()
really_alive = pub.thread.is_alive

def is_alive():
    alive = really_alive()
    if hold.is_set() and threading.current_thread().name == "flusher":
        found_alive.set()
        # preempted here until the main thread has stopped the IO thread and closed its pipes
        stopped.wait(10)
    return alive

pub.thread.is_alive = is_alive
errors = []

def flusher():
    # this thread's wake-up pipe exists before the shutdown, as the control thread's does
    pub.schedule(lambda: None)
    hold.set()
    try:
        pub.schedule(ran.set)
    except Exception as error:
        errors.append(repr(error))

thread = threading.Thread(target=flusher, name="flusher")
thread.start()
found_alive.wait(10)
pub.stop()
stopped.set()
thread.join(10)
print(json.dumps({"errors": errors, "ran": ran.is_set()}))
"""


def test_a_flush_racing_the_kernel_shutdown_runs_without_a_traceback():
    import json
    import subprocess
    import sys

    def race(mode):
        done = subprocess.run([sys.executable, "-c", RACE, mode], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    kit = race("kit")
    assert kit == {"errors": [], "ran": True}, (
        kit
    )  # and the flush's callback ran: nothing waits out flush_timeout
    plain = race("plain")  # ipykernel alone, held the same way
    if not plain["errors"]:
        pytest.skip("this ipykernel no longer races here: run_log.quiet_iopub_shutdown_race can go")
    assert len(plain["errors"]) == 1 and "Socket operation on non-socket" in plain["errors"][0], plain
