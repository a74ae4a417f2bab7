"""The embedded server: real `transformers serve` on 127.0.0.1 talked to with the openai client."""

import asyncio
import json
import os
import shutil
import signal

import httpx
import openai
import pytest

from eaglekit.generation.server import EmbeddedServer, ServerError

pytestmark = pytest.mark.slow


def test_server_settings_build_themselves_from_params(monkeypatch, tmp_path):
    """serving_endpoints starts the embedded server with params `server` as they are (the schema is the one
    source of its settings and defaults; start is stubbed: no process here)."""
    from eaglekit.config import ServerParams, params_from_sections
    from eaglekit.generation.server import serving_endpoints

    (tmp_path / "config.json").write_text("{}")  # resolve_model takes a local folder with a config
    params = params_from_sections(
        {
            "server": {
                "continuous_batching": False,
                "dtype": "bfloat16",
                "kv_cache_tokens": 1024,
                "threads": 1,
                "startup_timeout_s": 12.0,
            },
            "target": {"model": str(tmp_path)},
        }
    )
    started = []
    monkeypatch.setattr(EmbeddedServer, "start", lambda self: started.append(self) or self)
    monkeypatch.setattr(EmbeddedServer, "stop", lambda self: None)
    with serving_endpoints(params) as endpoints:
        assert [endpoint.name for endpoint in endpoints] == ["embedded"]
    (server,) = started
    assert server.settings is params.server and server.startup_timeout_s == 12.0
    command = server.command()
    assert "--no-continuous-batching" in command and command[command.index("--dtype") + 1] == "bfloat16"
    assert server.environment()["OMP_NUM_THREADS"] == "1"
    # With continuous batching the KV cache is bounded: ceil(kv_cache_tokens / page) blocks.
    batching = EmbeddedServer(tmp_path, settings=ServerParams(kv_cache_tokens=1000)).command()
    assert batching[batching.index("--cb-num-blocks") + 1] == "4" and "--continuous-batching" in batching


def test_health_and_models(embedded_server):
    assert embedded_server.base_url.startswith("http://127.0.0.1:")
    assert httpx.get(f"{embedded_server.root_url}/health").status_code == 200
    models = openai.OpenAI(base_url=embedded_server.base_url, api_key="unused").models.list()
    assert embedded_server.model_name in [model.id for model in models.data]


def test_chat_completion_truncated_at_max_tokens(embedded_server):
    client = openai.OpenAI(base_url=embedded_server.base_url, api_key="unused")
    answer = client.chat.completions.create(
        model=embedded_server.model_name,
        max_tokens=5,
        messages=[{"role": "user", "content": "Write a long essay about the history of Rome."}],
    )
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage.completion_tokens == 5 and answer.choices[0].message.content


def test_unknown_request_fields_are_rejected_with_422(embedded_server):
    # Why the generation engine probes endpoints: this server cannot return token ids.
    response = httpx.post(
        f"{embedded_server.base_url}/chat/completions",
        timeout=60,
        json={
            "model": embedded_server.model_name,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            "return_token_ids": True,
        },
    )
    assert response.status_code == 422


def test_concurrent_requests_all_complete(embedded_server):
    client = openai.AsyncOpenAI(base_url=embedded_server.base_url, api_key="unused")

    async def ask(number: int):
        return await client.chat.completions.create(
            model=embedded_server.model_name,
            max_tokens=6,
            messages=[{"role": "user", "content": f"Count to {number}."}],
        )

    async def main():
        return await asyncio.gather(*(ask(number) for number in range(8)))

    answers = asyncio.run(main())
    assert len(answers) == 8 and all(answer.usage.completion_tokens > 0 for answer in answers)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as handle:  # a zombie is dead too
        return handle.read().split()[2] != "Z"


def test_start_and_stop_leave_no_process(embedded_model_dir, tmp_path):
    server = EmbeddedServer(embedded_model_dir, log_path=tmp_path / "server.log").start()
    pid = server._process.pid
    assert server.is_running()
    server.stop()
    assert not _alive(pid)
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{server.root_url}/health", timeout=2)


def test_server_dies_with_a_killed_parent(embedded_model_dir, tmp_path):
    import subprocess
    import sys
    import time

    code = (
        "import sys, time; from eaglekit.generation.server import EmbeddedServer;"
        "s = EmbeddedServer(sys.argv[1]).start(); print(s._process.pid, flush=True); time.sleep(600)"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", code, str(embedded_model_dir)], stdout=subprocess.PIPE, text=True
    )
    server_pid = int(parent.stdout.readline())
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 30
    while _alive(server_pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _alive(server_pid), "server outlived its parent"


def test_failure_to_start_carries_the_log_tail(embedded_model_dir, tmp_path):
    broken = tmp_path / "broken-model"
    shutil.copytree(embedded_model_dir, broken)
    config = json.loads((broken / "config.json").read_text())
    config["model_type"] = "no-such-architecture"
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ServerError) as caught:
        EmbeddedServer(broken, log_path=tmp_path / "server.log", startup_timeout_s=120).start()
    message = str(caught.value)
    assert "log" in message and "no-such-architecture" in message


def test_not_a_model_folder_is_refused_before_starting(tmp_path):
    with pytest.raises(ServerError, match="no config.json"):
        EmbeddedServer(tmp_path).start()


def test_server_started_from_a_finished_thread_keeps_running(embedded_model_dir, tmp_path):
    """PR_SET_PDEATHSIG is per thread: a server started from a worker thread must outlive that thread."""
    import threading
    import time

    holder = {}
    worker = threading.Thread(
        target=lambda: holder.setdefault(
            "server", EmbeddedServer(embedded_model_dir, log_path=tmp_path / "s.log").start()
        )
    )
    worker.start()
    worker.join()
    server = holder["server"]
    try:
        time.sleep(2)
        assert server.is_running()
        assert httpx.get(f"{server.root_url}/health", timeout=10).status_code == 200
    finally:
        server.stop()
