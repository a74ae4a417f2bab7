"""Run-folder records: a stage's own verdict (record_stage_outcome) survives a kill and is read back whole."""

import json
import os
import subprocess
import sys

import pytest

from eaglekit.runs import clear_stage_outcome, read_stage_outcome, record_stage_outcome


def test_stage_outcome_round_trip_and_clear(tmp_path):
    assert read_stage_outcome(tmp_path, "generation") is None
    record_stage_outcome(tmp_path, "generation", errors=3, detail="3 prompts failed: 2 bad_response, 1 http_400")
    outcome = read_stage_outcome(tmp_path, "generation")
    assert outcome["errors"] == 3 and outcome["detail"].startswith("3 prompts") and outcome["stage"] == "generation"
    record_stage_outcome(tmp_path, "generation", errors=0)  # a later attempt replaces the verdict
    assert read_stage_outcome(tmp_path, "generation")["errors"] == 0
    clear_stage_outcome(tmp_path, "generation")
    assert read_stage_outcome(tmp_path, "generation") is None
    with pytest.raises(ValueError):
        record_stage_outcome(tmp_path, "generation", errors=-1)


def test_stage_outcome_is_never_half_written(tmp_path):
    # A writer killed mid-write leaves the previous verdict whole (temp file + rename), never a torn JSON.
    record_stage_outcome(tmp_path, "capture", errors=1)
    code = (
        "import os, sys\n"
        "from eaglekit import io\n"
        "real = os.replace\n"
        "os.replace = lambda *a: os.kill(os.getpid(), 9)\n"
        "from eaglekit.runs import record_stage_outcome\n"
        f"record_stage_outcome({str(tmp_path)!r}, 'capture', errors=7, detail='x' * 100000)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert result.returncode == -9
    assert read_stage_outcome(tmp_path, "capture")["errors"] == 1
    leftovers = [name for name in os.listdir(tmp_path / "stage_outcomes") if name != "capture.json"]
    assert all(name.endswith(".tmp") for name in leftovers)
    json.loads((tmp_path / "stage_outcomes" / "capture.json").read_text())
