"""The papermill runner on fixture notebooks: run folders, failure with the failing cell, --resume, secrets."""

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
    return subprocess.run([sys.executable, "-m", "eaglekit.cli", *args], capture_output=True, text=True, timeout=600)


def test_failing_stage_stops_the_run_and_resume_continues(tmp_path):
    params = scenario(tmp_path)
    first = eaglekit_cli("run", str(params), "--notebooks", str(FIXTURE_NOTEBOOKS), "--stages", "hello,gate", "--run-id", "r1")
    assert first.returncode == 1
    assert "stage 02_gate failed in cell" in first.stderr
    assert "raise RuntimeError('second stage refused" in first.stderr  # the failing cell's source
    assert "RuntimeError: second stage refused: allow_second_stage missing" in first.stderr
    assert "--run-id r1 --resume" in first.stderr
    run_dir = tmp_path / "outputs" / "r1"
    assert (run_dir / "hello.txt").read_text() == "fixture"
    assert json.loads((run_dir / "state.json").read_text()) == {"completed": ["01_hello"], "failed": "02_gate"}
    for name in ("params.yaml", "environment.json", "run.log", "01_hello.ipynb", "02_gate.ipynb"):
        assert (run_dir / name).is_file(), name
    environment = json.loads((run_dir / "environment.json").read_text())
    assert environment["packages"]["torch"] == "2.13.0+cpu" or environment["packages"]["torch"].startswith("2.13.0")
    assert "git_commit" in environment and "device" in environment

    (run_dir / "hello.txt").write_text("must stay")  # resume must not rerun finished stages
    (run_dir / "allow_second_stage").touch()
    second = eaglekit_cli("run", str(params), "--notebooks", str(FIXTURE_NOTEBOOKS), "--stages", "hello,gate", "--run-id", "r1", "--resume")
    assert second.returncode == 0, second.stderr
    assert "without encryption" not in second.stderr  # the kernel's sockets use CurveZMQ, so ipykernel stays quiet
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


def test_unknown_stage_is_named(tmp_path):
    with pytest.raises(RunError, match="unknown stage 'trainnig'"):
        run_pipeline(scenario(tmp_path), stages=["trainnig"], notebooks_dir=FIXTURE_NOTEBOOKS)


def test_endpoint_key_never_lands_in_the_run_folder(tmp_path, embedded_server, monkeypatch):
    secret = "sk-eaglekit-test-7f3a9c1e55"
    monkeypatch.setenv("EAGLEKIT_TEST_API_KEY", secret)
    params = scenario(
        tmp_path,
        f"endpoints:\n  - url: {embedded_server.base_url}\n    model: {embedded_server.model_name}\n    api_key_env: EAGLEKIT_TEST_API_KEY\n",
    )
    run_dir = run_pipeline(params, stages=["hello", "ask"], run_id="secret", notebooks_dir=FIXTURE_NOTEBOOKS)
    assert json.loads((run_dir / "answer.json").read_text())["url"] == embedded_server.base_url
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert secret not in path.read_text(errors="replace"), f"API key leaked into {path}"
    assert "EAGLEKIT_TEST_API_KEY" in (run_dir / "params.yaml").read_text()


def test_runner_starts_and_stops_the_embedded_server(tmp_path):
    run_dir = run_pipeline(scenario(tmp_path), stages=["ask"], run_id="served", notebooks_dir=FIXTURE_NOTEBOOKS)
    answer = json.loads((run_dir / "answer.json").read_text())
    assert answer["finish_reason"] in {"length", "stop"}
    assert "Uvicorn running" in (run_dir / "server.log").read_text() or (run_dir / "server.log").stat().st_size > 0
    import httpx

    with pytest.raises(httpx.HTTPError):  # stopped with the run
        httpx.get(answer["url"].removesuffix("/v1") + "/health", timeout=2)


def test_sigterm_stops_the_run_marks_the_stage_and_leaves_no_server(tmp_path):
    import signal
    import time

    params = scenario(tmp_path)
    runner = subprocess.Popen([sys.executable, "-m", "eaglekit.cli", "run", str(params), "--notebooks", str(FIXTURE_NOTEBOOKS),
                               "--stages", "wait", "--run-id", "stopped"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run_dir = tmp_path / "outputs" / "stopped"
    deadline = time.monotonic() + 300
    while not (run_dir / "waiting").exists():
        assert runner.poll() is None and time.monotonic() < deadline, runner.stderr.read() if runner.poll() is not None else "timed out"
        time.sleep(0.5)
    server_log = (run_dir / "server.log").read_text()
    port = server_log.split("Uvicorn running on http://127.0.0.1:")[1].split(" ")[0]
    runner.send_signal(signal.SIGTERM)
    _, stderr = runner.communicate(timeout=120)
    assert runner.returncode == 130, stderr
    assert "--resume" in stderr
    assert json.loads((run_dir / "state.json").read_text())["failed"] == "04_wait"
    import httpx

    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
