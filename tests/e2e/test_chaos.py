"""The chaos run of issue 13: stage 03 through the real runner, kernel and engine while everything is killed.

kill -9 of the runner, of the stage kernel and of the endpoint, three times each, plus a second
`--resume` started while the first runs; then one last resume. At the end every prompt is answered
exactly once and every counter equals an uninterrupted run's (the engine in-process on the same
prompts against the same fault endpoint).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eaglekit.config import GenerationParams, PartitionParams
from eaglekit.generation import PromptSource, generate, summarize_generations
from eaglekit.io import read_jsonl

pytestmark = pytest.mark.slow  # part of the CI suite (make test runs slow tests)

FAULT_ENDPOINT = Path(__file__).resolve().parents[1] / "fault_endpoint.py"
TOTAL = 120
# Answers of every kind the counters track: truncated, repetition loop, empty, always-400 (an error
# that --resume retries and that stays an error), plain. Each takes 0.3 s, so kills land mid-run.
KINDS = ["#fault:length", "#fault:loop", "#fault:empty", "#fault:400", "", "", "", ""]
SETTINGS = {
    "concurrency": 4,
    "max_tokens": 16,
    "max_attempts": 6,
    "backoff_base_s": 0.1,
    "backoff_max_s": 0.5,
}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_endpoint(port: int) -> subprocess.Popen:
    endpoint = subprocess.Popen(
        [sys.executable, str(FAULT_ENDPOINT), "--port", str(port)], stdout=subprocess.PIPE, text=True
    )
    assert endpoint.stdout.readline().startswith("READY"), "fault endpoint did not start"
    return endpoint


def write_prepared_run(run_dir: Path) -> Path:
    """What stage 02 leaves for stage 03: one class-B dataset's prompts.short.jsonl."""
    path = run_dir / "prep" / "chaos" / "prompts.short.jsonl"
    path.parent.mkdir(parents=True)
    with open(path, "w", encoding="utf-8") as handle:
        for index in range(TOTAL):
            text = f"q{index} {KINDS[index % len(KINDS)]} #sleep:0.3"
            handle.write(
                json.dumps(
                    {
                        "id": f"p{index}",
                        "source": "chaos",
                        "messages": [{"role": "user", "content": text}],
                        "meta": {"prompt_tokens": 12, "partition": "short"},
                    }
                )
                + "\n"
            )
    return path


def records_on_file(run_dir: Path) -> int:
    path = run_dir / "generation" / "generations.jsonl"
    return path.read_bytes().count(b"\n") if path.exists() else 0


def wait_for_records(run_dir: Path, at_least: int, runner: subprocess.Popen, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while records_on_file(run_dir) < at_least:
        if runner.poll() is not None:
            raise AssertionError(f"runner exited {runner.returncode} early:\n{runner.stderr.read()[-3000:]}")
        assert time.monotonic() < deadline, f"fewer than {at_least} records after {timeout_s} s"
        time.sleep(0.02)


def wait_for_lock_holder(run_dir: Path, runner: subprocess.Popen, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if json.loads((run_dir / "run.lock").read_text())["pid"] == runner.pid:
                return
        except (OSError, ValueError, KeyError):
            pass
        assert runner.poll() is None and time.monotonic() < deadline, (
            "the runner never took the run folder's lock"
        )
        time.sleep(0.02)


def stage_kernel_of(runner_pid: int) -> int:
    """The ipykernel process the runner started (a child in its own session)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == runner_pid and b"ipykernel" in cmdline:
            return int(entry)
    raise AssertionError(f"no stage kernel under runner {runner_pid}")


def wait_gone(pid: int, timeout_s: float = 15) -> None:
    deadline = time.monotonic() + timeout_s
    while (
        Path(f"/proc/{pid}").exists()
        and Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    ):
        assert time.monotonic() < deadline, (
            f"orphaned kernel {pid} still running {timeout_s} s after its runner died"
        )
        time.sleep(0.05)


def counters(metrics_line: dict) -> dict:
    return {
        name: metrics_line[name]
        for name in ("done", "total", "errors", "truncated", "flags", "mean_completion_tokens")
    }


def test_chaos_run_answers_every_prompt_once_with_the_counters_of_an_uninterrupted_run(
    tmp_path, embedded_model_dir
):
    port = free_port()
    params = tmp_path / "chaos.yaml"
    params.write_text(
        f"run:\n  name: chaos\n  outputs_dir: {tmp_path / 'outputs'}\n"
        f"endpoints:\n  - {{url: 'http://127.0.0.1:{port}/v1', name: fault, model: fault-model}}\n"
        f"generation:\n  partitions:\n    - {{name: short, concurrency: {SETTINGS['concurrency']}, "
        f"max_tokens: {SETTINGS['max_tokens']}}}\n"
        f"  max_attempts: {SETTINGS['max_attempts']}\n  backoff_base_s: {SETTINGS['backoff_base_s']}\n"
        f"  backoff_max_s: {SETTINGS['backoff_max_s']}\n  log_interval_s: 1.0\n  shutdown_grace_s: 2.0\n"
        # the fault endpoint's usage counts characters, not the target's tokens
        "  max_usage_disagreement: 1.0\n"
    )
    run_dir = tmp_path / "outputs" / "chaos"
    prompts = write_prepared_run(run_dir)
    resume = [
        sys.executable,
        "-m",
        "eaglekit.cli",
        "run",
        str(params),
        "--stages",
        "generation",
        "--run-id",
        "chaos",
        "--resume",
    ]

    endpoint = start_endpoint(port)
    try:
        # Six sessions, each ended by a kill -9 (runner, kernel, alternately); the endpoint is killed
        # and restarted in three of them; a second resume is tried during one.
        # After two of the endpoint kills the session goes on with the restarted endpoint (it waits
        # for its health check); after the other the kernel is killed at once.
        sessions = [
            ("runner", "recover", False),
            ("kernel", "restart", False),
            ("runner", "recover", True),
            ("kernel", None, False),
            ("runner", None, False),
            ("kernel", None, False),
        ]
        started = time.monotonic()
        for victim, kill_endpoint, second_resume in sessions:
            print(
                f"{time.monotonic() - started:6.1f} s: {records_on_file(run_dir)} records; "
                f"next session ends with a kill of the {victim} (endpoint: {kill_endpoint or 'left alone'})"
            )
            before = records_on_file(run_dir)
            runner = subprocess.Popen(resume, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            if second_resume:  # started once the first holds the run folder, while its kernel starts
                wait_for_lock_holder(run_dir, runner)
                second = subprocess.Popen(resume, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            wait_for_records(run_dir, before + 4, runner)
            if kill_endpoint:
                endpoint.kill()
                endpoint.wait()
                endpoint = start_endpoint(port)  # a server restart mid-run: in-flight requests are lost
                if kill_endpoint == "recover":
                    wait_for_records(run_dir, records_on_file(run_dir) + 3, runner)
            if second_resume:
                _, second_stderr = second.communicate(timeout=60)
                assert second.returncode == 1, second_stderr
                assert f"in use by another eaglekit process (pid {runner.pid} on" in second_stderr
            if victim == "runner":
                kernel = stage_kernel_of(runner.pid)
                runner.kill()
                assert runner.wait(timeout=30) == -signal.SIGKILL
                runner.stderr.close()
                wait_gone(kernel)  # the orphaned kernel notices its runner's death and exits by itself
            else:
                os.kill(stage_kernel_of(runner.pid), signal.SIGKILL)
                _, stderr = runner.communicate(timeout=60)
                assert runner.returncode == 1, stderr
                assert (
                    "stage 03_generation failed: the kernel died" in stderr
                    and "--run-id chaos --resume" in stderr
                )
            runner.stdout.close()
            assert records_on_file(run_dir) < TOTAL - 10, "the run finished before the kills: make it longer"

        print(f"{time.monotonic() - started:6.1f} s: {records_on_file(run_dir)} records; the last session")
        final = subprocess.run(resume, capture_output=True, text=True, timeout=300)
        print(f"{time.monotonic() - started:6.1f} s: done")
    finally:
        endpoint.kill()
        endpoint.wait()
        endpoint.stdout.close()
    assert final.returncode in (0, 3), final.stderr[-4000:]
    state = json.loads((run_dir / "state.json").read_text())
    assert state["failed"] is None and state["running"] is None

    # The uninterrupted reference: the same prompts, settings and fault behaviour, one session.
    source = [PromptSource("chaos", "short", prompts)]
    partitions = [
        PartitionParams(name="short", concurrency=SETTINGS["concurrency"], max_tokens=SETTINGS["max_tokens"])
    ]
    retry = GenerationParams(
        max_attempts=SETTINGS["max_attempts"],
        backoff_base_s=SETTINGS["backoff_base_s"],
        backoff_max_s=SETTINGS["backoff_max_s"],
    )
    reference_port = free_port()
    reference_endpoint = start_endpoint(reference_port)
    try:
        from eaglekit.generation.client import EndpointSpec

        reference = generate(
            source,
            [EndpointSpec(f"http://127.0.0.1:{reference_port}/v1", model="fault-model", name="fault")],
            tmp_path / "reference",
            partitions,
            temperature=0.0,
            retry=retry,
            log_interval_s=60.0,
            progress_bar=False,
        )
    finally:
        reference_endpoint.kill()
        reference_endpoint.wait()
        reference_endpoint.stdout.close()

    generation_dir = run_dir / "generation"
    expected = counters([record for _, record in read_jsonl(tmp_path / "reference" / "metrics.jsonl")][-1])
    last = [record for _, record in read_jsonl(generation_dir / "metrics.jsonl")][-1]
    assert last["final"] and last["session"] >= 7  # six killed sessions (at least) and the last one
    assert counters(last) == expected
    assert expected["errors"] == {"chaos": TOTAL // len(KINDS)} or expected["errors"] == TOTAL // len(KINDS)
    recount = summarize_generations(generation_dir, source).datasets["chaos"]
    expected_counts = reference.datasets["chaos"]
    assert (recount.done, recount.errors, recount.truncated, recount.flags) == (
        expected_counts.done,
        expected_counts.errors,
        expected_counts.truncated,
        expected_counts.flags,
    )
    assert recount.done + recount.errors == TOTAL

    # Exactly once: every answered prompt has one record; every still-failing prompt one error line.
    answered = [record["id"] for _, record in read_jsonl(generation_dir / "generations.jsonl")]
    assert len(answered) == len(set(answered)) == expected_counts.done
    failing = [record["id"] for _, record in read_jsonl(generation_dir / "errors.jsonl")]
    assert len(failing) == len(set(failing)) == expected_counts.errors and not set(failing) & set(answered)
    if final.returncode == 3:  # the stage recorded its errors (the always-400 prompts): reported, resumable
        assert state["stages"]["03_generation"]["status"] == f"done with {expected_counts.errors} errors"
