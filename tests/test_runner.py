"""The papermill runner on fixture notebooks: run folders, failure with the failing cell, --resume,
secrets."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from eaglekit.runner import RunError, run_pipeline

FIXTURE_NOTEBOOKS = Path(__file__).parent / "fixtures" / "notebooks"

pytestmark = pytest.mark.slow


def scenario(tmp_path: Path, extra: str = "") -> Path:
    path = tmp_path / "scenario.yaml"
    path.write_text(f"run:\n  name: fixture\n  outputs_dir: {tmp_path / 'outputs'}\n{extra}")
    return path


def eaglekit_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "eaglekit.cli", *args], capture_output=True, text=True, timeout=600
    )


def test_failing_stage_stops_the_run_and_resume_continues(tmp_path):
    params = scenario(tmp_path)
    first = eaglekit_cli(
        "run", str(params), "--notebooks", str(FIXTURE_NOTEBOOKS), "--stages", "hello,gate", "--run-id", "r1"
    )
    assert first.returncode == 1
    assert "stage 02_gate failed in cell" in first.stderr
    assert "raise RuntimeError('second stage refused" in first.stderr  # the failing cell's source
    assert "RuntimeError: second stage refused: allow_second_stage missing" in first.stderr
    assert "--run-id r1 --resume" in first.stderr
    run_dir = tmp_path / "outputs" / "r1"
    assert (run_dir / "hello.txt").read_text() == "fixture"
    state = json.loads((run_dir / "state.json").read_text())
    assert state["completed"] == ["01_hello"] and state["failed"] == "02_gate" and state["running"] is None
    assert (
        state["stages"]["02_gate"]["status"] == "failed"
        and "second stage refused" in state["stages"]["02_gate"]["error"]
    )
    for name in ("params.yaml", "environment.json", "run.log", "01_hello.ipynb", "02_gate.ipynb"):
        assert (run_dir / name).is_file(), name
    environment = json.loads((run_dir / "environment.json").read_text())
    assert environment["packages"]["torch"] == "2.13.0+cpu" or environment["packages"]["torch"].startswith(
        "2.13.0"
    )
    assert "git_commit" in environment and "device" in environment
    assert (
        environment["load"]["cpu_count"] >= 1 and environment["load"]["loadavg_5m"] >= 0
    )  # every timing depends on it
    assert state["stages"]["01_hello"]["load"]["loadavg_1m"] >= 0
    assert "stage 01_hello: done in" in first.stderr and " cores)" in first.stderr

    (run_dir / "hello.txt").write_text("must stay")  # resume must not rerun finished stages
    (run_dir / "allow_second_stage").touch()
    second = eaglekit_cli(
        "run",
        str(params),
        "--notebooks",
        str(FIXTURE_NOTEBOOKS),
        "--stages",
        "hello,gate",
        "--run-id",
        "r1",
        "--resume",
    )
    assert second.returncode == 0, second.stderr
    assert (
        "without encryption" not in second.stderr
    )  # the kernel's sockets use CurveZMQ, so ipykernel stays quiet
    assert (run_dir / "second.txt").read_text() == "ok"
    assert (run_dir / "hello.txt").read_text() == "must stay"
    assert json.loads((run_dir / "state.json").read_text())["completed"] == ["01_hello", "02_gate"]


def test_a_run_folder_is_never_overwritten(tmp_path):
    params = scenario(tmp_path)
    run_pipeline(params, stages=["hello"], run_id="once", notebooks_dir=FIXTURE_NOTEBOOKS)
    with pytest.raises(RunError, match="never overwritten"):
        run_pipeline(params, stages=["hello"], run_id="once", notebooks_dir=FIXTURE_NOTEBOOKS)


def test_bad_params_fail_before_any_folder_is_made(tmp_path):
    params = scenario(tmp_path, "target:\n  modle: x\n")
    result = eaglekit_cli("run", str(params), "--notebooks", str(FIXTURE_NOTEBOOKS))
    assert result.returncode == 1 and "unknown key 'target.modle'" in result.stderr
    assert not (tmp_path / "outputs").exists()


def test_a_torn_state_json_stops_a_resume_naming_the_file_not_with_a_traceback(tmp_path):
    params = scenario(tmp_path)
    run_pipeline(params, stages=["hello"], run_id="torn", notebooks_dir=FIXTURE_NOTEBOOKS)
    state = tmp_path / "outputs" / "torn" / "state.json"
    text = state.read_text()
    state.write_text(text[: len(text) // 2])
    resume = ["--run-id", "torn", "--resume", "--notebooks", str(FIXTURE_NOTEBOOKS)]
    result = eaglekit_cli("run", str(params), *resume)
    assert result.returncode == 1, result.stderr
    assert f"{state}:" in result.stderr and "not JSON" in result.stderr
    assert "Traceback" not in result.stderr
    assert f"{state}:" in (state.parent / "run.log").read_text()  # run.log says it too, as for any run error
    assert state.read_text() == text[: len(text) // 2]  # nothing written over what the user has to mend


def test_unknown_stage_is_named(tmp_path):
    with pytest.raises(RunError, match="unknown stage 'trainnig'"):
        run_pipeline(scenario(tmp_path), stages=["trainnig"], notebooks_dir=FIXTURE_NOTEBOOKS)


def test_endpoint_key_never_lands_in_the_run_folder(tmp_path, embedded_server, monkeypatch):
    secret = "sk-eaglekit-test-7f3a9c1e55"
    monkeypatch.setenv("EAGLEKIT_TEST_API_KEY", secret)
    params = scenario(
        tmp_path,
        f"endpoints:\n  - url: {embedded_server.base_url}\n    model: {embedded_server.model_name}\n"
        "    api_key_env: EAGLEKIT_TEST_API_KEY\n",
    )
    run_dir = run_pipeline(params, stages=["hello", "ask"], run_id="secret", notebooks_dir=FIXTURE_NOTEBOOKS)
    assert json.loads((run_dir / "answer.json").read_text())["url"] == embedded_server.base_url
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert secret not in path.read_text(errors="replace"), f"API key leaked into {path}"
    assert "EAGLEKIT_TEST_API_KEY" in (run_dir / "params.yaml").read_text()


def test_runner_starts_and_stops_the_embedded_server(tmp_path):
    run_dir = run_pipeline(
        scenario(tmp_path), stages=["ask", "after"], run_id="served", notebooks_dir=FIXTURE_NOTEBOOKS
    )
    # stopped once no later stage needs it: stages 4-6 get the server's memory and cores
    assert (run_dir / "server_during_later_stage").read_text() == "down"
    assert "endpoints stopped: no later stage needs them" in (run_dir / "run.log").read_text()
    answer = json.loads((run_dir / "answer.json").read_text())
    assert answer["finish_reason"] in {"length", "stop"}
    assert (
        "Uvicorn running" in (run_dir / "server.log").read_text()
        or (run_dir / "server.log").stat().st_size > 0
    )
    import httpx

    with pytest.raises(httpx.HTTPError):  # stopped with the run
        httpx.get(answer["url"].removesuffix("/v1") + "/health", timeout=2)


def test_sigterm_stops_the_run_marks_the_stage_and_leaves_no_server(tmp_path):
    import signal
    import time

    params = scenario(tmp_path)
    runner = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "eaglekit.cli",
            "run",
            str(params),
            "--notebooks",
            str(FIXTURE_NOTEBOOKS),
            "--stages",
            "wait",
            "--run-id",
            "stopped",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    run_dir = tmp_path / "outputs" / "stopped"
    deadline = time.monotonic() + 300
    while not (run_dir / "waiting").exists():
        assert runner.poll() is None and time.monotonic() < deadline, (
            runner.stderr.read() if runner.poll() is not None else "timed out"
        )
        time.sleep(0.5)
    server_log = (run_dir / "server.log").read_text()
    port = server_log.split("Uvicorn running on http://127.0.0.1:")[1].split(" ")[0]
    runner.send_signal(signal.SIGTERM)
    _, stderr = runner.communicate(timeout=120)
    assert runner.returncode == 143, stderr
    assert "--resume" in stderr and "Traceback" not in stderr
    assert json.loads((run_dir / "state.json").read_text())["failed"] == "04_wait"
    import httpx

    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)


# ---- faults: signals, a dead kernel, two writers, stages with errors, progress in the log ----------


def start_runner(params: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "eaglekit.cli",
            "run",
            str(params),
            "--notebooks",
            str(FIXTURE_NOTEBOOKS),
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for(path: Path, runner: subprocess.Popen, timeout_s: float = 120) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if runner.poll() is not None:
            raise AssertionError(
                f"runner exited {runner.returncode} before {path.name}: {runner.stderr.read()}"
            )
        assert time.monotonic() < deadline, f"no {path.name} after {timeout_s} s"
        time.sleep(0.1)


@pytest.mark.parametrize("signum, status", [(15, 143), (2, 130)], ids=["SIGTERM", "SIGINT"])
def test_a_stop_gives_in_flight_work_the_grace_period_and_exits_quietly(tmp_path, signum, status):
    import time

    # The fixture finishes its in-flight work in 0.6 x the grace: 3 s, beyond the 2.5 s after which
    # the old runner had already killed the kernel (it never interrupted it at all).
    params = scenario(tmp_path, "generation:\n  shutdown_grace_s: 5.0\n")
    runner = start_runner(params, "--stages", "busy", "--run-id", "stop")
    run_dir = tmp_path / "outputs" / "stop"
    wait_for(run_dir / "busy", runner)
    time.sleep(0.5)  # into the long cell
    stopped = time.monotonic()
    runner.send_signal(signum)
    _, stderr = runner.communicate(timeout=60)
    assert runner.returncode == status, stderr
    assert time.monotonic() - stopped < 5.0 + 10.0  # within the grace and the kill margin
    assert (
        run_dir / "finished_in_flight"
    ).read_text() == "5.0"  # the kernel got the stop and the params' grace
    assert not (run_dir / "busy_done").exists()  # and stopped: later cells never ran
    assert "Traceback" not in stderr and "zmq" not in stderr.lower(), stderr
    assert "--run-id stop --resume" in stderr.splitlines()[-1]
    state = json.loads((run_dir / "state.json").read_text())
    assert state["failed"] == "05_busy" and state["stages"]["05_busy"]["status"] == "interrupted"
    assert state["running"] is None and "05_busy" not in state["completed"]


def test_a_dead_kernel_is_a_failed_stage_with_the_resume_command(tmp_path):
    import os
    import signal

    import nbformat

    params = scenario(tmp_path)
    runner = start_runner(params, "--stages", "busy", "--run-id", "oom")
    run_dir = tmp_path / "outputs" / "oom"
    wait_for(run_dir / "busy", runner)
    os.kill(int((run_dir / "busy").read_text()), signal.SIGKILL)  # what the out-of-memory killer does
    _, stderr = runner.communicate(timeout=60)
    assert runner.returncode == 1, stderr
    assert "stage 05_busy failed: the kernel died in cell [" in stderr and "SIGKILL" in stderr
    assert "continue with: eaglekit run" in stderr and "--run-id oom --resume" in stderr
    assert "Traceback" not in stderr, stderr
    state = json.loads((run_dir / "state.json").read_text())
    assert state["failed"] == "05_busy" and "kernel died" in state["stages"]["05_busy"]["error"]
    notebook = nbformat.read(run_dir / "05_busy.ipynb", as_version=4)
    statuses = [cell.metadata.papermill["status"] for cell in notebook.cells]
    waiting = next(index for index, cell in enumerate(notebook.cells) if "time.sleep(300)" in cell.source)
    assert statuses[waiting] == "failed" and statuses[waiting + 1 :] == ["pending"] * (
        len(statuses) - waiting - 1
    )
    assert notebook.cells[waiting].outputs[-1]["ename"] == "DeadKernelError"
    assert notebook.metadata.papermill["exception"] is True


def test_one_writer_per_run_folder_and_a_dead_runners_lock_is_taken_over(tmp_path):
    import os
    import signal
    import time

    from eaglekit.run_folder import RunFolderLock, RunLockedError

    params = scenario(tmp_path)
    first = start_runner(params, "--stages", "busy", "--run-id", "shared")
    run_dir = tmp_path / "outputs" / "shared"
    wait_for(run_dir / "busy", first)
    kernel_pid = int((run_dir / "busy").read_text())
    started = time.monotonic()
    second = eaglekit_cli(
        "run",
        str(params),
        "--notebooks",
        str(FIXTURE_NOTEBOOKS),
        "--stages",
        "hello",
        "--run-id",
        "shared",
        "--resume",
    )
    assert second.returncode == 1 and time.monotonic() - started < 15
    assert f"in use by another eaglekit process (pid {first.pid} on" in second.stderr, second.stderr
    assert not (run_dir / "hello.txt").exists()  # the second runner wrote nothing

    # kill -9 of the runner while its kernel is held still: the kernel shares the lock, so the folder
    # stays locked until it is gone too (it exits by itself once it runs and sees its parent gone).
    os.kill(kernel_pid, signal.SIGSTOP)
    try:
        first.kill()
        first.wait()  # not communicate(): the stopped kernel still holds the runner's output pipes
        with pytest.raises(
            RunLockedError, match="still locked although its runner .* is gone: a stage kernel"
        ):
            RunFolderLock(run_dir).acquire(wait_for_orphans_s=0.5)
    finally:
        os.kill(kernel_pid, signal.SIGCONT)
    first.communicate(timeout=30)  # the kernel sees its parent gone and exits, closing the pipes
    third = eaglekit_cli(
        "run",
        str(params),
        "--notebooks",
        str(FIXTURE_NOTEBOOKS),
        "--stages",
        "hello",
        "--run-id",
        "shared",
        "--resume",
    )
    assert third.returncode == 0, third.stderr
    assert (run_dir / "hello.txt").read_text() == "fixture"
    assert "05_busy was running when its runner stopped" in third.stderr
    with pytest.raises(ProcessLookupError):
        os.kill(kernel_pid, 0)  # the orphaned kernel was gone before the third runner wrote
    assert json.loads((run_dir / "run.lock").read_text())["pid"] != first.pid


def test_a_stage_with_errors_is_reported_and_resume_reruns_only_it(tmp_path):
    params = scenario(tmp_path)
    run_dir = tmp_path / "outputs" / "errs"
    run_dir.mkdir(parents=True)
    (run_dir / "failing").write_text("p1 p2")  # the stage will record two errors
    first = eaglekit_cli(
        "run",
        str(params),
        "--notebooks",
        str(FIXTURE_NOTEBOOKS),
        "--stages",
        "hello,outcome",
        "--run-id",
        "errs",
        "--resume",
    )
    assert first.returncode == 3, first.stderr
    last_line = first.stderr.strip().splitlines()[-1]
    assert "06_outcome done with 2 errors" in last_line and "--run-id errs --resume" in last_line
    state = json.loads((run_dir / "state.json").read_text())
    assert state["completed"] == ["01_hello"]
    assert (
        state["stages"]["06_outcome"]["status"] == "done with 2 errors"
        and state["stages"]["06_outcome"]["errors"] == 2
    )

    (run_dir / "failing").unlink()  # the retried items succeed
    (run_dir / "hello.txt").write_text("must stay")
    second = eaglekit_cli(
        "run",
        str(params),
        "--notebooks",
        str(FIXTURE_NOTEBOOKS),
        "--run-id",
        "errs",
        "--resume",
        "--stages",
        "hello,outcome",
    )
    assert second.returncode == 0, second.stderr
    assert "done already 01_hello; to run 06_outcome" in second.stderr
    assert (run_dir / "outcome_attempts").read_text() == "2" and (
        run_dir / "hello.txt"
    ).read_text() == "must stay"
    state = json.loads((run_dir / "state.json").read_text())
    assert (
        state["completed"] == ["01_hello", "06_outcome"] and state["stages"]["06_outcome"]["status"] == "done"
    )


def test_library_progress_lines_reach_the_runner_output_and_run_log(tmp_path):
    import nbformat

    params = scenario(tmp_path)
    run_dir = tmp_path / "outputs" / "lines"
    run_dir.mkdir(parents=True)  # a run whose first stage is done; the resume asks for another one only
    (run_dir / "state.json").write_text(json.dumps({"completed": ["01_hello"], "failed": None}))
    result = eaglekit_cli(
        "run",
        str(params),
        "--notebooks",
        str(FIXTURE_NOTEBOOKS),
        "--stages",
        "progress",
        "--run-id",
        "lines",
        "--resume",
    )
    assert result.returncode == 0, result.stderr
    # The third-party-server finding: this said "done already none".
    assert (
        "done already 01_hello; to run 07_progress" in result.stderr
        and "done already none" not in result.stderr
    )
    run_log = (run_dir / "run.log").read_text()
    for done in (1, 2, 3):
        line = f"[07_progress] eaglekit.fixture: progress {done}/3 items | 1.5 req/s"
        assert line in result.stderr, (
            result.stderr
        )  # what `nohup eaglekit run ... > run.out` and `tail -f` show
        assert line in run_log
    assert run_log.index("progress 3/3") < run_log.index("stage 07_progress: done")
    assert (
        "eaglekit.fixture: shutdown race guarded: True" in run_log
    )  # the runner's kernel hook ran in the stage kernel
    notebook = nbformat.read(run_dir / "07_progress.ipynb", as_version=4)
    shown = "".join(output.get("text", "") for cell in notebook.cells for output in cell.get("outputs", []))
    assert shown.count("progress 3/3 items") == 1  # the executed notebook still shows them, once
    assert result.stderr.count("progress 3/3 items") == 1 and run_log.count("progress 3/3 items") == 1


def test_a_stage_that_ignores_the_stop_is_killed_after_the_grace_and_the_margin(tmp_path, monkeypatch):
    import os
    import signal
    import threading
    import time

    import nbformat

    from eaglekit import runner as runner_module
    from eaglekit.runner import RunInterrupted

    monkeypatch.setattr(runner_module, "KILL_MARGIN_S", 1.0)
    params = scenario(tmp_path, "generation:\n  shutdown_grace_s: 2.0\n")
    run_dir = tmp_path / "outputs" / "hung"
    run_dir.mkdir(parents=True)
    (run_dir / "hang").touch()  # the fixture's in-flight work never finishes
    sent = {}

    def stop_when_busy() -> None:
        while not (run_dir / "busy").exists():
            time.sleep(0.05)
        time.sleep(0.5)
        sent["at"] = time.monotonic()
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop_when_busy, daemon=True).start()
    with pytest.raises(RunInterrupted) as caught:
        run_pipeline(params, stages=["busy"], run_id="hung", resume=True, notebooks_dir=FIXTURE_NOTEBOOKS)
    waited = time.monotonic() - sent["at"]
    assert caught.value.exit_status == 143
    assert 3.0 <= waited < 3.0 + 5.0  # killed after grace + margin (3 s), not before, and not much after
    kernel_pid = int((run_dir / "busy").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(kernel_pid, 0)
    assert not (run_dir / "finished_in_flight").exists()
    state = json.loads((run_dir / "state.json").read_text())
    assert state["failed"] == "05_busy" and state["stages"]["05_busy"]["status"] == "interrupted"
    notebook = nbformat.read(run_dir / "05_busy.ipynb", as_version=4)
    waiting = next(cell for cell in notebook.cells if "time.sleep(300)" in cell.source)
    assert waiting.metadata.papermill["status"] == "failed" and waiting.outputs[-1]["ename"] == "KernelKilled"


# ---- a full disk -------------------------------------------------------------------------------

SMALL_DISK_BYTES = (
    4 << 20
)  # the run folder's whole filesystem: params, logs, the space reserve and one stage's output


@pytest.fixture
def small_disk(tmp_path):
    """A real 4 MiB filesystem (tmpfs) for the run folder: the disk fills as a real one does, for every
    writer."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={SMALL_DISK_BYTES}", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"needs to mount a small tmpfs (root or CAP_SYS_ADMIN): {mounted.stderr.strip()}")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], check=False)


def _runner_on_small_disk(params: Path, fill: str, *args: str) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(
        [
            sys.executable,
            "-m",
            "eaglekit.cli",
            "run",
            str(params),
            "--notebooks",
            str(FIXTURE_NOTEBOOKS),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "EAGLEKIT_TEST_FILL": fill},
    )


@pytest.mark.parametrize("fill", ["raise", "quiet"], ids=["the-stage-write-fails", "the-notebook-save-fails"])
def test_a_full_disk_fails_the_stage_naming_the_path_and_the_resume_and_tears_nothing(small_disk, fill):
    import nbformat

    disk = small_disk
    params = disk.parent / "scenario.yaml"
    params.write_text(f"run:\n  name: fixture\n  outputs_dir: {disk}\n")
    run_dir = disk / "full"
    first = _runner_on_small_disk(params, fill, "--stages", "fill", "--run-id", "full")
    assert first.returncode == 1, first.stderr
    assert "Traceback" not in first.stderr, first.stderr
    last = first.stderr.strip().splitlines()[-1]
    assert "stage 08_fill failed" in last and "No space left on device" in last, last
    assert "free space, then continue with: eaglekit run" in last and "--run-id full --resume" in last, last
    assert str(run_dir) in last, last  # the message places the failure in the run folder

    state = json.loads((run_dir / "state.json").read_text())
    stage = state["stages"]["08_fill"]
    assert (
        state["failed"] == "08_fill" and state["running"] is None and "08_fill" not in state["completed"]
    ), state
    assert stage["status"] == "failed" and "No space left on device" in stage["error"]
    assert stage["path"] and stage["path"].startswith(str(run_dir)), stage
    if fill == "raise":  # the stage's own write failed first: that is the error, with its cell
        assert stage["error"].startswith("cell [") and "OSError" in stage["error"], stage
    assert "largest in the run folder: shard-00000.bin" in last, last
    notebook = nbformat.read(run_dir / "08_fill.ipynb", as_version=4)  # whole: it parses
    assert notebook.metadata.papermill["exception"] is True
    assert [path.name for path in run_dir.rglob("*.tmp")] == [], "a torn temp file is left behind"
    assert not (run_dir / "filled_done").exists()

    (run_dir / "shard-00000.bin").unlink()  # the user frees space
    (run_dir / "no_fill").touch()
    second = _runner_on_small_disk(params, fill, "--stages", "fill", "--run-id", "full", "--resume")
    assert second.returncode == 0, second.stderr
    assert (run_dir / "filled_done").read_text() == "ok"
    state = json.loads((run_dir / "state.json").read_text())
    assert (
        state["completed"] == ["08_fill"]
        and state["failed"] is None
        and "error" not in state["stages"]["08_fill"]
    ), state
    assert not (run_dir / "space_reserve").exists()


def test_a_disk_without_room_for_the_runners_own_records_refuses_to_start(tmp_path):
    disk = tmp_path / "tiny"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(disk)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"needs to mount a small tmpfs (root or CAP_SYS_ADMIN): {mounted.stderr.strip()}")
    try:
        params = tmp_path / "scenario.yaml"
        params.write_text(f"run:\n  name: fixture\n  outputs_dir: {disk}\n")
        with pytest.raises(RunError) as refused:
            run_pipeline(params, stages=["hello"], run_id="cramped", notebooks_dir=FIXTURE_NOTEBOOKS)
        message = str(refused.value)
        assert "no room to start" in message and "No space left on device (ENOSPC)" in message, message
        assert (
            str(disk / "cramped" / "space_reserve") in message and "--run-id cramped --resume" in message
        ), message
        assert not (disk / "cramped" / "space_reserve").exists()  # what was written of it is given back
        assert not (disk / "cramped" / "01_hello.ipynb").exists()  # no stage ran
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_one_notebook_alone_through_papermill_gets_only_the_params_it_declares(tmp_path):
    import yaml

    repo = Path(__file__).parent.parent
    notebook = repo / "notebooks" / "03_generation.ipynb"
    listed = eaglekit_cli(
        "params", str(repo / "params" / "demo.yaml"), str(notebook), "-o", str(tmp_path / "p.yaml")
    )
    assert listed.returncode == 0, listed.stderr
    sections = yaml.safe_load((tmp_path / "p.yaml").read_text())
    assert "generation" in sections and "capture" not in sections and "analysis" not in sections, sorted(
        sections
    )

    def prepare(params_file: Path) -> str:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "papermill",
                "--prepare-only",
                str(notebook),
                str(tmp_path / "out.ipynb"),
                "-f",
                str(params_file),
                "-p",
                "run_dir",
                str(tmp_path / "run"),
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        return done.stderr

    assert "Passed unknown parameter" in prepare(
        repo / "params" / "demo.yaml"
    )  # every section the notebook lacks
    assert "Passed unknown parameter" not in prepare(tmp_path / "p.yaml")
