"""run.log: the runner's heartbeat fills every silence of a running stage, and the silence check reads the file."""

import logging
import time

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
    with StageHeartbeat(run_log, logger, "06_analysis", lambda: " in cell [5] (`result = run_analysis_stage(params, out)`)",
                        after_s=0.6, poll_s=0.05):
        time.sleep(2.0)  # a cell that logs nothing: about three heartbeats
    beats = [line for line in run_log.read_text().splitlines() if "still running" in line]
    assert 2 <= len(beats) <= 4, beats
    assert "stage 06_analysis: still running in cell [5] (`result = run_analysis_stage(params, out)`); nothing logged for" in beats[0]

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
        "Traceback (most recent call last):\n"          # no timestamp: part of the line before
        "2026-12-06 10:01:05 INFO [04_capture] capture: 20 samples\n"
        "2026-12-06 10:01:06 INFO stage 04_capture: done\n")
    stretches = silent_stretches(run_log, limit_s=30)
    assert [(gap, after.split(" INFO ")[1]) for _, after, gap in stretches] == [(36.0, "[04_capture] capture: 20 samples")]
    assert silent_stretches(run_log, limit_s=40) == []
