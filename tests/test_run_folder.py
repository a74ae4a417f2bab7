"""Run-folder records: a stage's own verdict (record_stage_outcome) survives a kill and is read back whole."""

import json
import os
import subprocess
import sys

import pytest

from eaglekit.run_folder import clear_stage_outcome, read_stage_outcome, record_stage_outcome


def test_stage_outcome_round_trip_and_clear(tmp_path):
    assert read_stage_outcome(tmp_path, "generation") is None
    record_stage_outcome(
        tmp_path, "generation", errors=3, detail="3 prompts failed: 2 bad_response, 1 http_400"
    )
    outcome = read_stage_outcome(tmp_path, "generation")
    assert (
        outcome["errors"] == 3
        and outcome["detail"].startswith("3 prompts")
        and outcome["stage"] == "generation"
    )
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
        "import os\n"
        "# killed between the temp file's fsync and its rename\n"
        "os.replace = lambda *args: os.kill(os.getpid(), 9)\n"
        "from eaglekit.run_folder import record_stage_outcome\n"
        f"record_stage_outcome({str(tmp_path)!r}, 'capture', errors=7, detail='x' * 100000)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert result.returncode == -9
    assert read_stage_outcome(tmp_path, "capture")["errors"] == 1
    leftovers = [name for name in os.listdir(tmp_path / "stage_outcomes") if name != "capture.json"]
    assert all(name.endswith(".tmp") for name in leftovers)
    json.loads((tmp_path / "stage_outcomes" / "capture.json").read_text())


HOLD_LOCK = (
    "import sys, time\n"
    "from eaglekit.run_folder import RunFolderLock\n"
    "RunFolderLock(sys.argv[1]).acquire()\n"
    "print('locked', flush=True)\n"
    "time.sleep(300)\n"
)


def test_a_live_holder_fails_the_second_writer_at_once_naming_it(tmp_path):
    import time

    from eaglekit.run_folder import RunFolderLock, RunLockedError

    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        started = time.monotonic()
        with pytest.raises(
            RunLockedError, match=f"in use by another eaglekit process \\(pid {holder.pid} on "
        ):
            RunFolderLock(tmp_path).acquire()
        assert time.monotonic() - started < 1.0  # at once, not after a wait
        holder.kill()  # kill -9: the kernel drops the flock with the process
        holder.wait()
        with RunFolderLock(tmp_path) as lock:
            assert lock.holder()["pid"] == os.getpid()
    finally:
        holder.kill()


def test_a_lock_file_left_by_a_dead_process_is_taken_over(tmp_path):
    from eaglekit.run_folder import RunFolderLock

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    ).stdout.strip()
    (tmp_path / "run.lock").write_text(
        json.dumps({"pid": int(dead), "host": "elsewhere", "started": "yesterday"})
    )
    with RunFolderLock(tmp_path) as lock:
        assert lock.holder()["pid"] == os.getpid()
    with RunFolderLock(tmp_path):  # and released on exit
        pass


# ---- a notebook run by hand: which run folder, and never into a finished stage ----------------


def _params(tmp_path):
    from eaglekit.config import params_from_sections

    return params_from_sections({"run": {"name": "mine", "outputs_dir": str(tmp_path / "outputs")}})


def test_a_notebook_run_by_hand_names_its_run_folder_by_environment_and_leaves_no_empty_one(
    tmp_path, monkeypatch
):
    from eaglekit.run_folder import RUN_DIR_ENV, RunFolderError, run_dir_for

    monkeypatch.delenv("EAGLEKIT_STAGE", raising=False)
    monkeypatch.delenv(RUN_DIR_ENV, raising=False)
    params = _params(tmp_path)
    with pytest.raises(
        RunFolderError,
        match=f"no run folder .*mine-interactive.*{RUN_DIR_ENV}=outputs/<run id> jupyter nbconvert",
    ):
        run_dir_for(params, "", stage="analysis")
    assert not (tmp_path / "outputs").exists()  # nothing left behind: no empty figures/ folder
    assert (
        run_dir_for(params, "", stage="survey") == tmp_path / "outputs" / "mine-interactive"
    )  # the first stage starts one

    named = tmp_path / "outputs" / "20261206-120000-mine"
    named.mkdir()
    monkeypatch.setenv(RUN_DIR_ENV, str(named))
    assert run_dir_for(params, "", stage="analysis") == named
    assert (
        run_dir_for(params, str(tmp_path / "outputs" / "mine-interactive"), stage="analysis") != named
    )  # run_dir wins


def test_a_finished_stage_is_never_run_again_into_its_run_folder_by_hand(tmp_path, monkeypatch):
    from eaglekit.run_folder import RunFolderError, run_dir_for

    monkeypatch.delenv("EAGLEKIT_STAGE", raising=False)
    run_dir = tmp_path / "outputs" / "done"
    (run_dir / "analysis").mkdir(parents=True)
    (run_dir / "analysis" / "answer.json").write_text("{}")
    (run_dir / "state.json").write_text(
        json.dumps({"completed": ["05_training", "06_analysis"], "failed": None})
    )
    with pytest.raises(RunFolderError, match="records stage 06_analysis as finished .* never overwritten"):
        run_dir_for(_params(tmp_path), str(run_dir), stage="analysis")
    assert (run_dir / "analysis" / "answer.json").read_text() == "{}"
    assert (
        run_dir_for(_params(tmp_path), str(run_dir), stage="capture") == run_dir
    )  # an unfinished stage may run
    monkeypatch.setenv("EAGLEKIT_STAGE", "06_analysis")  # the runner's own kernel (a failed stage run again)
    assert run_dir_for(_params(tmp_path), str(run_dir), stage="analysis") == run_dir


def test_state_json_reads_with_defaults_and_a_torn_one_names_the_file_and_line(tmp_path, monkeypatch):
    """The runner (read_state) and a notebook run by hand (run_dir_for, as RunFolderError) read it alike."""
    from eaglekit.io import InputError, write_json
    from eaglekit.run_folder import RunFolderError, read_state, run_dir_for

    monkeypatch.delenv("EAGLEKIT_STAGE", raising=False)
    run_dir = tmp_path / "outputs" / "torn"
    run_dir.mkdir(parents=True)
    assert read_state(run_dir) == {"completed": [], "failed": None, "running": None, "stages": {}}
    state = run_dir / "state.json"
    write_json(state, {"completed": ["01_data"], "failed": None, "stages": {"01_data": {"status": "done"}}})
    assert read_state(run_dir)["completed"] == ["01_data"] and read_state(run_dir)["running"] is None
    os.truncate(state, state.stat().st_size // 2)  # a write cut off mid-file (or an edit gone wrong)
    with pytest.raises(InputError, match=rf"{state}:\d+: not JSON .*; the runner writes it whole"):
        read_state(run_dir)
    with pytest.raises(RunFolderError, match=rf"stage analysis: run folder .*{state}:\d+: not JSON"):
        run_dir_for(_params(tmp_path), str(run_dir), stage="analysis")
    state.write_text('["01_data"]')  # JSON, but not the runner's object
    with pytest.raises(InputError, match=rf"{state}: not a JSON object \(a list\); the runner writes"):
        read_state(run_dir)
