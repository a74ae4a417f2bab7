"""Generation engine over real HTTP on 127.0.0.1: the fault endpoint, then the real embedded server.

Run as a script (`python tests/test_generation.py CONFIG.json`) it is the client process the
kill -9 / SIGTERM tests start and kill.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fault_endpoint import FaultEndpoint, FaultOptions  # noqa: E402

from eaglekit.generation.client import Endpoint, EndpointPool, EndpointSpec, parse_chat_response  # noqa: E402
from eaglekit.generation.errors import (  # noqa: E402
    EndpointAuthError,
    EndpointModelChangedError,
    TransientError,
    parse_retry_after,
)
from eaglekit.config import GenerationParams, PartitionParams  # noqa: E402
from eaglekit.generation import (  # noqa: E402
    GenerationLog,
    PromptSource,
    finished_keys,
    generate,
    generation_table,
    has_repetition_loop,
    quality_flags,
    read_generations,
    summarize_generations,
)
from eaglekit.io import read_jsonl  # noqa: E402
from eaglekit.generation.engine import GenerationSettingsChanged  # noqa: E402
from support import write_prompts  # noqa: E402  (shared test helpers, tests/support.py)

FAST = dict(
    retry=GenerationParams(max_attempts=4, backoff_base_s=0.01, backoff_max_s=0.05),
    log_interval_s=0.2,
    flush_interval_s=0.05,
    health_interval_s=0.05,
    progress_bar=False,
    probe_wait_s=10.0,
)


def ids_once(output_dir: Path) -> Counter:
    return Counter(record["id"] for _, record in read_jsonl(output_dir / "generations.jsonl"))


def within(seconds: float, function, *args, **kwargs):
    """Run function in a thread; fail (instead of hanging the suite) when it has not returned in time."""
    outcome: dict = {}

    def work() -> None:
        try:
            outcome["value"] = function(*args, **kwargs)
        except BaseException as error:  # handed to the test
            outcome["error"] = error

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{function.__name__} still running after {seconds} s: the run hangs"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


# -------------------------------------------------------------------------------------------------
# Failures, retries, dialects (fault endpoint in this process)


def test_transient_failures_retry_and_rejections_are_recorded(tmp_path):
    texts = [
        "plain",
        "a #fault:500x2",
        "b #fault:429x1",
        "c #fault:408x1",
        "d #fault:resetx1",
        "e #fault:slowx1",
        "f #fault:400",
        "g #fault:503",
        "h #fault:length",
    ]
    prompts = write_prompts(tmp_path / "prompts.jsonl", texts)
    with FaultEndpoint(FaultOptions(slow_seconds=3.0)) as endpoint:
        summary = generate(
            [PromptSource("ds", "short", prompts)],
            [EndpointSpec(endpoint.base_url)],
            tmp_path / "out",
            [PartitionParams(name="short", concurrency=4, max_tokens=32)],
            request_timeout_s=0.5,
            **FAST,
        )
    records = read_generations(tmp_path / "out")
    attempts = {key[1]: record["attempts"] for key, record in records.items()}
    assert attempts == {"p0": 1, "p1": 3, "p2": 2, "p3": 2, "p4": 2, "p5": 2, "p8": 1}
    truncated = records[("ds", "p8")]
    assert (
        truncated["truncated"]
        and truncated["finish_reason"] == "length"
        and "truncated" in truncated["flags"]
    )
    errors = {record["id"]: record for _, record in read_jsonl(tmp_path / "out" / "errors.jsonl")}
    assert errors["p6"]["status"] == 400 and errors["p6"]["attempts"] == 1
    assert "maximum context length" in errors["p6"]["message"]  # the server's own words
    assert errors["p7"]["status"] == 503 and errors["p7"]["attempts"] == 4  # transient, up to the limit
    counts = summary.datasets["ds"]
    assert (counts.total, counts.done, counts.errors, counts.truncated) == (9, 7, 2, 1)
    metrics = [record for _, record in read_jsonl(tmp_path / "out" / "metrics.jsonl")]
    assert metrics[-1]["final"] and metrics[-1]["done"] == {"ds": 7} and metrics[-1]["errors"] == 2
    assert {
        "requests_per_s",
        "completion_tokens_per_s",
        "mean_completion_tokens",
        "in_flight",
        "eta_s",
    } <= set(metrics[-1])


def test_endpoint_tells_a_timeout_from_a_reset_and_sends_the_sdk_headers():
    # The aiohttp transport reports every dropped connection as httpx2.ConnectTimeout; the kinds in
    # the errors file must still say what happened. Auth and user agent are the SDK client's own.
    async def attempts(base_url: str) -> list[str]:
        endpoint = Endpoint(
            EndpointSpec(base_url, api_key="sk-test"), max_connections=2, request_timeout_s=0.5
        )
        try:
            await endpoint.probe()
            kinds = []
            for text in ["x #fault:slowx1", "y #fault:resetx1"]:
                with pytest.raises(TransientError) as caught:
                    await endpoint.chat([{"role": "user", "content": text}], 8, None, None, None)
                kinds.append(caught.value.kind)
                answer = await endpoint.chat([{"role": "user", "content": text}], 8, None, None, None)
                assert answer.content == f"Answer: {text}"  # the second attempt is served
            return kinds
        finally:
            await endpoint.aclose()

    with FaultEndpoint(FaultOptions(slow_seconds=3.0)) as server:
        assert asyncio.run(attempts(server.base_url)) == ["timeout", "connection"]
        headers = server.server.last_headers
    assert headers["authorization"] == "Bearer sk-test"
    assert (
        headers["user-agent"].startswith("AsyncOpenAI/Python")
        and headers["content-type"] == "application/json"
    )


def test_errored_prompts_retried_on_rerun_only_when_asked(tmp_path):
    prompts = write_prompts(tmp_path / "prompts.jsonl", ["ok", "bad #fault:400x1"])
    source, partitions = (
        [PromptSource("ds", "short", prompts)],
        [PartitionParams(name="short", concurrency=2, max_tokens=16)],
    )
    with FaultEndpoint() as endpoint:
        endpoints = [EndpointSpec(endpoint.base_url)]
        first = generate(source, endpoints, tmp_path / "out", partitions, **FAST)
        assert first.datasets["ds"].errors == 1
        skipped = generate(source, endpoints, tmp_path / "out", partitions, retry_errors=False, **FAST)
        assert skipped.requests_this_session == 0 and skipped.datasets["ds"].errors == 1
        retried = generate(source, endpoints, tmp_path / "out", partitions, retry_errors=True, **FAST)
    assert (
        retried.requests_this_session == 1
        and retried.datasets["ds"].done == 2
        and retried.datasets["ds"].errors == 0
    )
    assert ids_once(tmp_path / "out") == {"p0": 1, "p1": 1}


def test_server_rejecting_unknown_fields_gets_plain_requests(tmp_path):
    prompts = write_prompts(tmp_path / "prompts.jsonl", ["one", "two", "three"])
    # Honours return_token_ids in principle, but 422s any unknown field first, like `transformers serve`.
    with FaultEndpoint(FaultOptions(strict_fields=True, token_ids="vllm")) as endpoint:
        summary = generate(
            [PromptSource("ds", "short", prompts)],
            [EndpointSpec(endpoint.base_url)],
            tmp_path / "out",
            [PartitionParams(name="short", concurrency=2, max_tokens=16)],
            **FAST,
        )
        statuses = endpoint.server.statuses
    assert summary.endpoints[0]["rejects_unknown_fields"] and not summary.endpoints[0]["accepts_token_ids"]
    assert summary.datasets["ds"].done == 3 and statuses["422"] == 1  # only the probe saw a 422
    assert all(record["token_ids"] is None for record in read_generations(tmp_path / "out").values())


@pytest.mark.parametrize(
    "dialect, reasoning_field",
    [("vllm", "reasoning"), ("vllm", "reasoning_content"), ("sglang", "reasoning_content"), (None, None)],
)
def test_token_ids_and_reasoning_fields_as_servers_send_them(tmp_path, dialect, reasoning_field):
    prompts = write_prompts(tmp_path / "prompts.jsonl", ["hello", "think only #fault:think"])
    with FaultEndpoint(FaultOptions(token_ids=dialect, reasoning_field=reasoning_field)) as endpoint:
        summary = generate(
            [PromptSource("ds", "short", prompts)],
            [EndpointSpec(endpoint.base_url)],
            tmp_path / "out",
            [PartitionParams(name="short", concurrency=2, max_tokens=16)],
            **FAST,
        )
    assert summary.endpoints[0]["accepts_token_ids"] == (dialect is not None)
    assert summary.endpoints[0]["reasoning_field"] == reasoning_field
    record = read_generations(tmp_path / "out")[("ds", "p0")]
    assert record["content"] == "Answer: hello"
    if reasoning_field:
        assert record["reasoning"] == "Let me think."
        assert summary.datasets["ds"].flags["reasoning_without_answer"] == 1
    else:
        assert record["reasoning"] is None
    if dialect:
        completion_text = (record["reasoning"] or "") + record["content"]
        assert record["token_ids"] == [ord(character) for character in completion_text] + [0]
        assert record["prompt_token_ids"] == [ord(character) for character in "Be brief.hello"]


def test_quality_flags():
    assert has_repetition_loop("intro " + "abc " * 100)
    assert has_repetition_loop("x" * 500)
    rng = random.Random(0)
    assert not has_repetition_loop(
        " ".join(rng.choice(["the", "a", "cat", "sat", "on", "mat", "and"]) for _ in range(2000))
    )
    assert not has_repetition_loop("short " * 10)  # 60 chars: below the minimum span
    assert quality_flags("", None, "stop") == ["empty"]
    assert quality_flags("", "thinking...", "stop") == ["reasoning_without_answer"]
    assert quality_flags("ok " * 100, None, "length") == ["truncated", "repetition_loop"]
    assert quality_flags("A fine answer.", "Because.", "stop") == []


def test_bad_prompt_file_names_file_line_and_field(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        json.dumps({"id": "a", "messages": [{"role": "user", "content": "q"}]})
        + "\n"
        + json.dumps(
            {
                "id": "b",
                "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "answered"}],
            }
        )
        + "\n"
    )
    with pytest.raises(ValueError, match=r"prompts.jsonl:2: field 'messages\[1\].role'"):
        generate(
            [PromptSource("ds", "short", path)],
            [EndpointSpec("http://127.0.0.1:9/v1")],
            tmp_path / "out",
            [PartitionParams(name="short", concurrency=1, max_tokens=8)],
            **FAST,
        )


# -------------------------------------------------------------------------------------------------
# Malformed answers, authentication, Retry-After, status classes

MALFORMED_200S = ["nullchoice", "strchoice", "nomessage", "nochoices", "usagelist", "notjson", "badids"]


def test_parse_chat_response_rejects_every_malformed_completion():
    good = {
        "choices": [{"message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1},
    }
    assert parse_chat_response(good).content == "hi"
    broken = [
        None,
        "text",
        [],
        {},
        {"choices": None},
        {"choices": []},
        {"choices": [None]},
        {"choices": ["x"]},
        {"choices": [{"finish_reason": "stop"}]},
        {"choices": [{"message": "hi"}]},
        {**good, "usage": [1, 2]},
        {**good, "usage": {"prompt_tokens": "3"}},
        {**good, "usage": {"completion_tokens": True}},
        {"choices": [{"message": {"content": 5}}]},
        {"choices": [{"message": {"content": "a"}, "token_ids": ["1"]}]},
        {"choices": [{"message": {"content": "a"}, "finish_reason": 3}]},
        {"choices": [{"message": {"content": None, "tool_calls": [{"function": {}}]}}]},
        {**good, "sglext": "x"},
    ]
    for data in broken:
        with pytest.raises(TransientError) as caught:
            parse_chat_response(data)
        assert caught.value.kind == "bad_response", data


def test_malformed_200s_are_retried_then_recorded_and_never_hang_the_run(tmp_path):
    # Concurrency 1: one leaked slot and the run waits for ever (today's parser raised past the release).
    texts = [f"once {kind} #fault:{kind}x1" for kind in MALFORMED_200S]
    texts += ["always #fault:nullchoice", "no message ever #fault:nomessage", "fine at the end"]
    prompts = write_prompts(tmp_path / "prompts.jsonl", texts)
    with FaultEndpoint(FaultOptions(token_ids="vllm")) as endpoint:
        summary = within(
            60,
            generate,
            [PromptSource("ds", "short", prompts)],
            [EndpointSpec(endpoint.base_url)],
            tmp_path / "out",
            [PartitionParams(name="short", concurrency=1, max_tokens=16)],
            **FAST,
        )
    records = read_generations(tmp_path / "out")
    for index, kind in enumerate(MALFORMED_200S):
        record = records[("ds", f"p{index}")]
        assert record["attempts"] == 2 and record["content"].startswith("Answer: once"), kind
    errors = {record["id"]: record for _, record in read_jsonl(tmp_path / "out" / "errors.jsonl")}
    first_permanent = len(MALFORMED_200S)
    assert set(errors) == {f"p{first_permanent}", f"p{first_permanent + 1}"}
    assert all(error["kind"] == "bad_response" and error["attempts"] == 4 for error in errors.values())
    assert all(record["content"] for record in records.values())  # no choice without message stored as ""
    assert ("ds", f"p{first_permanent + 2}") in records
    assert (summary.datasets["ds"].done, summary.datasets["ds"].errors) == (len(MALFORMED_200S) + 1, 2)


def test_a_client_bug_costs_one_prompt_never_the_slot(tmp_path, monkeypatch):
    import eaglekit.generation.client as endpoints_module

    real_parse = endpoints_module.parse_chat_response

    def buggy(data):
        if "boom" in json.dumps(data):
            raise ZeroDivisionError("a bug in the client")
        return real_parse(data)

    monkeypatch.setattr(endpoints_module, "parse_chat_response", buggy)
    prompts = write_prompts(tmp_path / "prompts.jsonl", ["a", "boom", "b", "boom again", "c"])
    with FaultEndpoint() as endpoint:
        summary = within(
            30,
            generate,
            [PromptSource("ds", "short", prompts)],
            [EndpointSpec(endpoint.base_url)],
            tmp_path / "out",
            [PartitionParams(name="short", concurrency=1, max_tokens=16)],
            **FAST,
        )
    errors = {record["id"]: record for _, record in read_jsonl(tmp_path / "out" / "errors.jsonl")}
    assert set(errors) == {"p1", "p3"} and errors["p1"]["kind"] == "client_error"
    assert "ZeroDivisionError" in errors["p1"]["message"]
    assert (summary.datasets["ds"].done, summary.datasets["ds"].errors) == (3, 2)


def test_status_classes_only_request_faults_are_terminal_for_a_prompt(tmp_path):
    texts = ["a #fault:413", "b #fault:422", "c #fault:404x2", "d #fault:500x1", "e #fault:400"]
    prompts = write_prompts(tmp_path / "prompts.jsonl", texts)
    with FaultEndpoint() as endpoint:
        generate(
            [PromptSource("ds", "short", prompts)],
            [EndpointSpec(endpoint.base_url)],
            tmp_path / "out",
            [PartitionParams(name="short", concurrency=2, max_tokens=16)],
            **FAST,
        )
    errors = {
        record["id"]: (record["status"], record["attempts"])
        for _, record in read_jsonl(tmp_path / "out" / "errors.jsonl")
    }
    assert errors == {"p0": (413, 1), "p1": (422, 1), "p4": (400, 1)}
    attempts = {key[1]: record["attempts"] for key, record in read_generations(tmp_path / "out").items()}
    assert attempts == {"p2": 3, "p3": 2}


def test_key_rotated_mid_run_stops_at_once_naming_endpoint_and_fix(tmp_path, monkeypatch):
    total = 80
    prompts = write_prompts(tmp_path / "prompts.jsonl", [f"q{i} #sleep:0.02" for i in range(total)])
    source, partitions = (
        [PromptSource("ds", "short", prompts)],
        [PartitionParams(name="short", concurrency=4, max_tokens=16)],
    )
    output = tmp_path / "out"
    with FaultEndpoint(FaultOptions(api_key="key-1")) as endpoint:
        spec = EndpointSpec(
            endpoint.base_url, api_key="key-1", name="sglang-test", api_key_env="TEST_SGLANG_KEY"
        )

        def rotate() -> None:
            while len(finished_keys(output / "generations.jsonl")) < 10:
                time.sleep(0.005)
            endpoint.server.options.api_key = "key-2"

        rotator = threading.Thread(target=rotate, daemon=True)
        rotator.start()
        started = time.monotonic()
        with pytest.raises(EndpointAuthError) as caught:
            within(60, generate, source, [spec], output, partitions, **FAST)
        stopped_in = time.monotonic() - started
        rotator.join(5)
        message = str(caught.value)
        assert (
            "sglang-test" in message
            and "TEST_SGLANG_KEY" in message
            and "401" in message
            and "--resume" in message
        )
        assert stopped_in < 10
        done_before = len(finished_keys(output / "generations.jsonl"))
        assert 10 <= done_before < total
        assert not (output / "errors.jsonl").exists() or not (output / "errors.jsonl").read_text().strip()
        requests_after_rotation = endpoint.server.statuses["401"]
        assert requests_after_rotation <= 4 + 1  # the slots in flight, not every remaining prompt
        # The operator fixes the key and resumes: every prompt answered exactly once.
        summary = generate(
            source,
            [EndpointSpec(endpoint.base_url, api_key="key-2", name="sglang-test")],
            output,
            partitions,
            **FAST,
        )
    assert summary.datasets["ds"].done == total and summary.datasets["ds"].errors == 0
    assert set(ids_once(output).values()) == {1}


def test_served_model_changed_mid_run_stops_naming_the_endpoint_and_both_models(tmp_path):
    """The server is restarted with another model mid-run: the first answer naming it stops the run; every
    kept answer came from the probed model, and a resume against the probed model again finishes exactly
    once."""
    total = 80
    prompts = write_prompts(tmp_path / "prompts.jsonl", [f"q{i} #sleep:0.02" for i in range(total)])
    source, partitions = (
        [PromptSource("ds", "short", prompts)],
        [PartitionParams(name="short", concurrency=4, max_tokens=16)],
    )
    output = tmp_path / "out"
    with FaultEndpoint(FaultOptions(served_model="model-a")) as endpoint:

        def swap() -> None:
            while len(finished_keys(output / "generations.jsonl")) < 10:
                time.sleep(0.005)
            endpoint.server.options.served_model = "model-b"

        swapper = threading.Thread(target=swap, daemon=True)
        swapper.start()
        with pytest.raises(EndpointModelChangedError) as caught:
            within(
                60,
                generate,
                source,
                [EndpointSpec(endpoint.base_url, name="sglang-test")],
                output,
                partitions,
                **FAST,
            )
        swapper.join(5)
        message = str(caught.value)
        assert (
            "sglang-test" in message
            and "'model-a'" in message
            and "'model-b'" in message
            and "--resume" in message
        )
        done_before = len(finished_keys(output / "generations.jsonl"))
        assert 10 <= done_before < total
        assert not (output / "errors.jsonl").exists() or not (output / "errors.jsonl").read_text().strip()
        endpoint.server.options.served_model = "model-a"
        summary = generate(
            source, [EndpointSpec(endpoint.base_url, name="sglang-test")], output, partitions, **FAST
        )
    assert summary.datasets["ds"].done == total and set(ids_once(output).values()) == {1}


def test_a_dripping_body_times_out_by_the_whole_request_deadline(tmp_path):
    """One byte of the answer every 0.2 s: no read waits long, so a timeout between reads never fires. The
    request's deadline bounds it whole: each attempt ends after request_timeout_s, the prompt is recorded, the
    rest answered."""
    prompts = write_prompts(tmp_path / "prompts.jsonl", ["a", "b #fault:drip", "c"])
    with FaultEndpoint(FaultOptions(drip_seconds=0.2)) as endpoint:
        started = time.monotonic()
        summary = within(
            30,
            generate,
            [PromptSource("ds", "short", prompts)],
            [EndpointSpec(endpoint.base_url)],
            tmp_path / "out",
            [PartitionParams(name="short", concurrency=3, max_tokens=16)],
            request_timeout_s=1.0,
            **{**FAST, "retry": GenerationParams(max_attempts=2, backoff_base_s=0.01, backoff_max_s=0.05)},
        )
        elapsed = time.monotonic() - started
    assert summary.datasets["ds"].done == 2 and summary.datasets["ds"].errors == 1
    errors = {record["id"]: record for _, record in read_jsonl(tmp_path / "out" / "errors.jsonl")}
    assert (
        errors["p1"]["kind"] == "timeout"
        and errors["p1"]["attempts"] == 2
        and "1 s" in errors["p1"]["message"]
    )
    assert elapsed < 15


def test_a_huge_body_is_cut_at_the_cap_and_recorded_naming_the_endpoint(tmp_path):
    """A 256 MB answer to a 16-token request: reading stops at the cap (about 1 MB here), the prompt is
    recorded as too large with the endpoint named, never retried, and the other prompts are answered."""
    prompts = write_prompts(tmp_path / "prompts.jsonl", ["a", "b #fault:huge", "c", "d"])
    with FaultEndpoint(FaultOptions()) as endpoint:
        summary = within(
            60,
            generate,
            [PromptSource("ds", "short", prompts)],
            [EndpointSpec(endpoint.base_url, name="big")],
            tmp_path / "out",
            [PartitionParams(name="short", concurrency=2, max_tokens=16)],
            **FAST,
        )
        sent = endpoint.server.huge_bytes_sent
    assert summary.datasets["ds"].done == 3 and summary.datasets["ds"].errors == 1
    errors = {record["id"]: record for _, record in read_jsonl(tmp_path / "out" / "errors.jsonl")}
    assert (
        errors["p1"]["kind"] == "too_large"
        and errors["p1"]["attempts"] == 1
        and errors["p1"]["endpoint"] == "big"
    )
    assert "endpoint big" in errors["p1"]["message"]
    assert sent < 32 << 20, f"{sent:,} bytes left the server: the client kept reading past its cap"
    assert (tmp_path / "out" / "generations.jsonl").stat().st_size < 1 << 20


def test_a_resume_with_other_settings_is_refused_naming_the_keys(tmp_path):
    """Half the prompts answered, then resumed with another max_tokens, temperature and served model: refused
    before any request, each differing key named with both values; the same settings resume and finish exactly
    once."""
    prompts = write_prompts(tmp_path / "prompts.jsonl", [f"q{i}" for i in range(12)])
    source, output = [PromptSource("ds", "short", prompts)], tmp_path / "out"
    first = [PartitionParams(name="short", concurrency=2, max_tokens=16)]
    with FaultEndpoint(FaultOptions(served_model="model-a")) as endpoint:
        spec = [EndpointSpec(endpoint.base_url)]
        generate(source, spec, output, first, temperature=0.0, **FAST)
        kept = [record for _, record in read_jsonl(output / "generations.jsonl")]
        assert {(record["model"], record["max_tokens"], record["temperature"]) for record in kept} == {
            ("model-a", 16, 0.0)
        }
        lines = (output / "generations.jsonl").read_text().splitlines(keepends=True)
        (output / "generations.jsonl").write_text("".join(lines[:6]))  # six answered, six to do
        endpoint.server.options.served_model = "model-b"
        requests_before = endpoint.server.requests
        with pytest.raises(GenerationSettingsChanged) as caught:
            generate(
                source,
                spec,
                output,
                [PartitionParams(name="short", concurrency=2, max_tokens=32)],
                temperature=0.7,
                **FAST,
            )
        message = str(caught.value)
        for words in (
            "max_tokens",
            "{'short': 16}",
            "{'short': 32}",
            "temperature",
            "0.7",
            "model",
            "model-a",
            "model-b",
            "settings.json",
        ):
            assert words in message, words
        assert endpoint.server.requests - requests_before <= 1  # the probe only: no answer asked for
        assert len((output / "generations.jsonl").read_text().splitlines()) == 6
        endpoint.server.options.served_model = "model-a"
        summary = generate(
            source,
            spec,
            output,
            [PartitionParams(name="short", concurrency=4, max_tokens=16)],
            temperature=0.0,
            **FAST,
        )
    assert summary.datasets["ds"].done == 12 and set(ids_once(output).values()) == {1}


def test_keyed_endpoint_starts_without_model_and_sends_the_key_to_health_and_models(tmp_path):
    prompts = write_prompts(tmp_path / "prompts.jsonl", ["one", "two"])
    with FaultEndpoint(FaultOptions(api_key="secret")) as endpoint:
        summary = generate(
            [PromptSource("ds", "short", prompts)],
            [EndpointSpec(endpoint.base_url, api_key="secret")],
            tmp_path / "out",
            [PartitionParams(name="short", concurrency=2, max_tokens=16)],
            **FAST,
        )
        assert summary.datasets["ds"].done == 2

        async def health() -> bool:
            probe = Endpoint(EndpointSpec(endpoint.base_url, api_key="secret"), 1, 5.0)
            try:
                return await probe.check_health()
            finally:
                await probe.aclose()

        assert asyncio.run(health())
        assert endpoint.server.control_headers and all(
            auth == "Bearer secret" for _, auth in endpoint.server.control_headers
        )
        # A wrong key is said to be a wrong key, at once, not "no endpoint answered ... fix base_url".
        started = time.monotonic()
        with pytest.raises(EndpointAuthError, match="refuses the API key"):
            generate(
                [PromptSource("ds", "short", prompts)],
                [EndpointSpec(endpoint.base_url, api_key="wrong", name="keyed")],
                tmp_path / "out2",
                [PartitionParams(name="short", concurrency=2, max_tokens=16)],
                **FAST,
            )
        assert time.monotonic() - started < 5


def test_retry_after_is_honoured_without_spending_attempts(tmp_path):
    texts = ["busy #fault:429x3 #retryafter:0.3", "overloaded #fault:503x2 #retryafter:0.3", "plain"]
    prompts = write_prompts(tmp_path / "prompts.jsonl", texts)
    retry = GenerationParams(max_attempts=2, backoff_base_s=0.01, backoff_max_s=0.02)
    started = time.monotonic()
    with FaultEndpoint() as endpoint:
        summary = generate(
            [PromptSource("ds", "short", prompts)],
            [EndpointSpec(endpoint.base_url)],
            tmp_path / "out",
            [PartitionParams(name="short", concurrency=1, max_tokens=16)],
            **{**FAST, "retry": retry},
        )
    elapsed = time.monotonic() - started
    assert summary.datasets["ds"].done == 3 and summary.datasets["ds"].errors == 0
    records = read_generations(tmp_path / "out")
    assert records[("ds", "p0")]["attempts"] == 1 and records[("ds", "p1")]["attempts"] == 1
    assert elapsed >= 5 * 0.3  # the server asked to wait five times


def test_a_paused_endpoint_gets_no_requests_while_another_serves():
    async def scenario() -> list[str]:
        endpoints = [
            Endpoint(EndpointSpec(f"http://127.0.0.1:9/v{i}", name=f"e{i}"), 2, 1.0) for i in range(2)
        ]
        for endpoint in endpoints:
            endpoint.capabilities = object()  # probed
        pool = EndpointPool(endpoints)
        endpoints[0].pause(0.2)
        picked = [(await pool.acquire(4)).name for _ in range(3)]
        endpoints[1].pause(0.2)
        started = time.monotonic()
        picked.append((await pool.acquire(4)).name)  # both paused: waits for the first pause to end
        assert time.monotonic() - started >= 0.05
        await pool.aclose()
        return picked

    assert asyncio.run(scenario()) == ["e1", "e1", "e1", "e0"]
    assert parse_retry_after("2.5") == 2.5 and parse_retry_after("soon") is None
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # a date in the past: no wait


def test_a_failing_write_stops_the_run_with_its_error(tmp_path, monkeypatch):
    from eaglekit.generation import GenerationEngine

    original, calls = GenerationEngine._record_answer, []

    def disk_full(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            raise OSError(28, "No space left on device")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(GenerationEngine, "_record_answer", disk_full)
    prompts = write_prompts(tmp_path / "prompts.jsonl", [f"q{i} #sleep:0.01" for i in range(40)])
    with FaultEndpoint() as endpoint, pytest.raises(OSError, match="No space left"):
        within(
            30,
            generate,
            [PromptSource("ds", "short", prompts)],
            [EndpointSpec(endpoint.base_url)],
            tmp_path / "out",
            [PartitionParams(name="short", concurrency=2, max_tokens=16)],
            **FAST,
        )
    assert len(finished_keys(tmp_path / "out" / "generations.jsonl")) < 40


# -------------------------------------------------------------------------------------------------
# Resume: errors once per session with their history, cumulative counters, progress lines


def test_errored_prompts_retried_once_per_session_recorded_once_with_history(tmp_path):
    texts = [f"bad {i} #fault:400" for i in range(5)] + ["ok 1", "ok 2", "cut #fault:length"]
    prompts = write_prompts(tmp_path / "prompts.jsonl", texts)
    source, partitions = (
        [PromptSource("ds", "short", prompts)],
        [PartitionParams(name="short", concurrency=3, max_tokens=16)],
    )
    with FaultEndpoint() as endpoint:
        for session in (1, 2, 3):
            summary = generate(
                source, [EndpointSpec(endpoint.base_url, name="fault")], tmp_path / "out", partitions, **FAST
            )
            errors = [record for _, record in read_jsonl(tmp_path / "out" / "errors.jsonl")]
            assert len(errors) == 5 and summary.datasets["ds"].errors == 5
            assert all(
                len(error["history"]) == session - 1 and error["session"] == session for error in errors
            )
            assert all(
                past["status"] == 400 and past["endpoint"] == "fault"
                for error in errors
                for past in error["history"]
            )
            assert summary.datasets["ds"].done == 3 and summary.datasets["ds"].truncated == 1
        attempts = endpoint.server.attempts
    assert all(attempts[text] == 3 for text in texts[:5])  # once per session
    assert all(attempts[text] == 1 for text in texts[5:])  # nothing finished is requested again


def mixed_texts(total: int, sleep: float) -> list[str]:
    """Answers of every kind the counters track: truncated, flagged, reasoning only, failed, plain."""
    kinds = ["#fault:length", "#fault:loop", "#fault:empty", "#fault:think", "#fault:400", "", "", "", ""]
    return [f"q{i} {kinds[i % len(kinds)]} #sleep:{sleep}" for i in range(total)]


def counters(record: dict) -> dict:
    return {
        name: record[name]
        for name in ("done", "total", "errors", "truncated", "flags", "mean_completion_tokens")
    }


def test_counters_after_two_kill9s_equal_an_uninterrupted_run_and_a_recount(tmp_path):
    total = 117
    prompts = write_prompts(tmp_path / "prompts.jsonl", mixed_texts(total, 0.05))
    source, partitions = (
        [PromptSource("ds", "short", prompts)],
        [PartitionParams(name="short", concurrency=4, max_tokens=16)],
    )
    with FaultEndpoint(FaultOptions(reasoning_field="reasoning_content")) as endpoint:
        generate(source, [EndpointSpec(endpoint.base_url)], tmp_path / "reference", partitions, **FAST)
        output = tmp_path / "out"
        config = {
            "prompts": str(prompts),
            "base_url": endpoint.base_url,
            "output_dir": str(output),
            "concurrency": 4,
        }
        for kill_after in (15, 50):  # two real kill -9s of a generation process
            client = subprocess.Popen(
                client_command(config, tmp_path / "config.json"), stderr=subprocess.DEVNULL
            )
            deadline = time.monotonic() + 60
            while (
                len(finished_keys(output / "generations.jsonl")) < kill_after and time.monotonic() < deadline
            ):
                time.sleep(0.005)
            client.kill()
            assert client.wait(timeout=20) == -signal.SIGKILL
        assert len(finished_keys(output / "generations.jsonl")) < total - 13, (
            "the client finished before the kill"
        )
        resumed = generate(source, [EndpointSpec(endpoint.base_url)], output, partitions, **FAST)
    expected = counters([record for _, record in read_jsonl(tmp_path / "reference" / "metrics.jsonl")][-1])
    final = [record for _, record in read_jsonl(output / "metrics.jsonl")][-1]
    assert final["final"] and final["session"] == 3
    assert counters(final) == expected
    assert expected["truncated"] == 13 and expected["errors"] == 13
    assert expected["flags"]["repetition_loop"] == 13 and expected["flags"]["reasoning_without_answer"] == 26
    recount = summarize_generations(output, source)
    for summary in (resumed, recount):
        counts = summary.datasets["ds"]
        assert (counts.done, counts.errors, counts.truncated) == (expected["done"]["ds"], 13, 13)
        assert counts.flags == expected["flags"]
        assert round(counts.mean_completion_tokens, 2) == expected["mean_completion_tokens"]
    assert set(ids_once(output).values()) == {1}


def test_progress_lines_in_the_log_with_endpoint_names_and_whole_session_final_rate(tmp_path, caplog):
    prompts = write_prompts(tmp_path / "prompts.jsonl", [f"q{i} #sleep:0.05" for i in range(60)])
    caplog.set_level(logging.INFO, logger="eaglekit")
    with FaultEndpoint() as first, FaultEndpoint() as second:
        specs = [EndpointSpec(first.base_url, name="node-a"), EndpointSpec(second.base_url, name="node-b")]
        generate(
            [PromptSource("ds", "short", prompts)],
            specs,
            tmp_path / "out",
            [PartitionParams(name="short", concurrency=2, max_tokens=16)],
            **{**FAST, "log_interval_s": 0.25},
        )
    lines = [record.getMessage() for record in caplog.records if record.name == "eaglekit.generation.engine"]
    progress = [line for line in lines if line.startswith("progress ")]
    final = [line for line in lines if line.startswith("final ")]
    assert progress and len(final) == 1
    for line in progress + final:
        assert "ds " in line and "/60" in line and "errors 0" in line and "req/s" in line and "tok/s" in line
        assert (
            "mean " in line
            and "in flight" in line
            and "node-a" in line
            and "node-b" in line
            and "ETA" in line
        )
    assert "ds 60/60" in final[0]
    assert {record["endpoint"] for record in read_generations(tmp_path / "out").values()} == {
        "node-a",
        "node-b",
    }
    records = list(read_generations(tmp_path / "out").values())
    first_start = min(record["finished_at"] - record["latency_s"] for record in records)
    span = max(record["finished_at"] for record in records) - first_start
    measured = len(records) / span
    last = [record for _, record in read_jsonl(tmp_path / "out" / "metrics.jsonl")][-1]
    assert abs(last["requests_per_s"] - measured) / measured < 0.25, (last["requests_per_s"], measured)


@pytest.mark.parametrize("grace, sleep, recorded", [(6.0, 1.0, 2), (0.3, 20.0, 0)])
def test_sigterm_gives_in_flight_requests_exactly_the_grace_then_exits_143(tmp_path, grace, sleep, recorded):
    prompts = write_prompts(tmp_path / "prompts.jsonl", [f"q{i} #sleep:{sleep}" for i in range(6)])
    output = tmp_path / "out"
    with FaultEndpoint() as endpoint:
        config = {
            "prompts": str(prompts),
            "base_url": endpoint.base_url,
            "output_dir": str(output),
            "concurrency": 2,
            "grace": grace,
        }
        client = subprocess.Popen(
            client_command(config, tmp_path / "config.json"), stderr=subprocess.PIPE, text=True
        )
        deadline = time.monotonic() + 30
        while endpoint.server.requests < 3 and time.monotonic() < deadline:  # the probe, then two in flight
            time.sleep(0.005)
        client.send_signal(signal.SIGTERM)
        started = time.monotonic()
        returncode = client.wait(timeout=30)
        stopped_in = time.monotonic() - started
        stderr = client.stderr.read()
    assert returncode == 143, stderr[-2000:]
    assert "Traceback" not in stderr, stderr
    assert len(finished_keys(output / "generations.jsonl")) == recorded
    if recorded:
        assert stopped_in < grace  # finished within the grace: no need to wait it out
    else:
        # Abandoned at the grace, not at the request's end (20 s after it started): the 10 s margin is the
        # client's own exit, which takes over 3 s on a loaded 2-core machine.
        assert grace <= stopped_in < grace + 10.0, stopped_in


# -------------------------------------------------------------------------------------------------
# Tools, tool calls and reasoning as the server sees and returns them


def test_tools_and_tool_calls_sent_in_openai_shape_and_answers_kept(tmp_path):
    tools = [
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
        {"name": "bare_function", "parameters": {"type": "object"}},
    ]
    conversation = {
        "id": "t0",
        "source": "test",
        "meta": {"tools": tools},
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
            },
            {"role": "tool", "content": '{"temp": 21}'},
            {"role": "user", "content": "And Rome? #fault:toolcall"},
        ],
    }
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps(conversation) + "\n")
    with FaultEndpoint(FaultOptions(token_ids="sglang", reasoning_field="reasoning_content")) as endpoint:
        summary = generate(
            [PromptSource("ds", "short", path)],
            [EndpointSpec(endpoint.base_url)],
            tmp_path / "out",
            [PartitionParams(name="short", concurrency=1, max_tokens=16)],
            **FAST,
        )
        request = endpoint.server.last_request
    assert request["tools"] == [tools[0], {"type": "function", "function": tools[1]}]
    assistant, tool = request["messages"][1], request["messages"][2]
    assert assistant["tool_calls"] == [
        {
            "id": "call00100",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        }
    ]
    assert tool == {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call00100"}
    record = read_generations(tmp_path / "out")[("ds", "t0")]
    assert record["tool_calls"][0]["function"]["name"] == "get_weather" and record["content"] == ""
    assert record["reasoning"] == "Let me think." and record["reasoning_field"] == "reasoning_content"
    assert record["token_ids"] and record["prompt_token_ids"]
    assert summary.datasets["ds"].flags["empty"] == 0 and "reasoning_without_answer" not in record["flags"]


def test_chat_template_kwargs_sent_in_every_request_only_when_set(tmp_path):
    """prep.chat_template_kwargs reach the server as the top-level `chat_template_kwargs` SGLang, vLLM and
    transformers serve read (strict: the endpoint 422s fields transformers serve does not know)."""
    prompts = write_prompts(tmp_path / "prompts.jsonl", ["q0", "q1", "q2 #fault:500x1"])
    for name, kwargs in (("with", {"enable_thinking": False}), ("without", None), ("empty", {})):
        with FaultEndpoint(FaultOptions(strict_fields=True)) as endpoint:
            summary = generate(
                [PromptSource("ds", "short", prompts)],
                [EndpointSpec(endpoint.base_url)],
                tmp_path / name,
                [PartitionParams(name="short", concurrency=2, max_tokens=16)],
                chat_template_kwargs=kwargs,
                **FAST,
            )
            requests = [
                request
                for request in endpoint.server.chat_requests
                if request["messages"][-1]["content"] != "Say OK."
            ]
        assert summary.datasets["ds"].done == 3 and len(requests) >= 4  # a retried request carries them too
        assert [request.get("chat_template_kwargs") for request in requests] == [kwargs or None] * len(
            requests
        ), name
    with FaultEndpoint() as endpoint:  # extra_body's own template kwargs are kept beside them
        generate(
            [PromptSource("ds", "short", prompts)],
            [EndpointSpec(endpoint.base_url)],
            tmp_path / "merged",
            [PartitionParams(name="short", concurrency=1, max_tokens=16)],
            extra_body={"chat_template_kwargs": {"thinking": True}},
            chat_template_kwargs={"enable_thinking": False},
            **FAST,
        )
        assert endpoint.server.last_request["chat_template_kwargs"] == {
            "thinking": True,
            "enable_thinking": False,
        }


@pytest.mark.parametrize(
    "conversation, field",
    [
        (
            {"meta": {"tools": [{"parameters": {}}]}, "messages": [{"role": "user", "content": "q"}]},
            r"meta.tools\[0\]",
        ),
        ({"meta": {"tools": "not json"}, "messages": [{"role": "user", "content": "q"}]}, "meta.tools"),
        (
            {
                "messages": [
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": None, "tool_calls": [{"function": {}}]},
                    {"role": "tool", "content": "r"},
                ]
            },
            r"messages\[1\].tool_calls\[0\].function.name",
        ),
    ],
)
def test_bad_tools_name_file_line_and_field(tmp_path, conversation, field):
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        json.dumps({"id": "ok", "messages": [{"role": "user", "content": "q"}]})
        + "\n"
        + json.dumps({"id": "bad", **conversation})
        + "\n"
    )
    with pytest.raises(ValueError, match=rf"prompts.jsonl:2: field '{field}'"):
        generate(
            [PromptSource("ds", "short", path)],
            [EndpointSpec("http://127.0.0.1:9/v1")],
            tmp_path / "out",
            [PartitionParams(name="short", concurrency=1, max_tokens=8)],
            **FAST,
        )


# -------------------------------------------------------------------------------------------------
# Reading the log with bounded memory


def test_streaming_readers_agree_with_the_full_read(tmp_path):
    prompts = write_prompts(tmp_path / "prompts.jsonl", mixed_texts(18, 0.0))
    name = 'odd ", "content": name'  # a quote and the content key inside a value: still one head
    with FaultEndpoint(FaultOptions(token_ids="vllm")) as endpoint:
        generate(
            [PromptSource("ds", "short", prompts)],
            [EndpointSpec(endpoint.base_url, name=name)],
            tmp_path / "out",
            [PartitionParams(name="short", concurrency=3, max_tokens=16)],
            **FAST,
        )
    full = read_generations(tmp_path / "out")
    with open(tmp_path / "out" / "generations.jsonl", "a") as handle:
        handle.write('{"dataset": "ds", "id": "torn", "content": "cut off')  # a writer killed mid-line
    table = generation_table(tmp_path / "out")
    rows = [dict(zip(table, values)) for values in zip(*table.values())]
    assert {(row["dataset"], row["id"]) for row in rows} == set(full)
    for row in rows:
        record = full[(row["dataset"], row["id"])]
        assert "content" not in row and "token_ids" not in row and row["endpoint"] == name
        assert row == {
            key: tuple(value) if isinstance(value, list) else value
            for key, value in record.items()
            if key not in ("content", "reasoning", "tool_calls", "prompt_token_ids", "token_ids")
        }
    with GenerationLog(tmp_path / "out") as log:
        assert len(log) == len(full) and all(log.get(key) == record for key, record in full.items())
        assert log.get(("ds", "missing")) is None and [record["id"] for record in log] == [
            r["id"] for r in full.values()
        ]


# -------------------------------------------------------------------------------------------------
# Routing and health


def test_least_in_flight_routing_and_dead_endpoint_skipped(tmp_path):
    prompts = write_prompts(tmp_path / "prompts.jsonl", [f"q{i} #sleep:0.02" for i in range(40)])
    with FaultEndpoint() as first, FaultEndpoint() as second:
        # Port 9 (discard) has no listener here: the probe fails, the endpoint starts unhealthy.
        endpoints = [
            EndpointSpec(first.base_url),
            EndpointSpec(second.base_url),
            EndpointSpec("http://127.0.0.1:9/v1"),
        ]
        summary = generate(
            [PromptSource("ds", "short", prompts)],
            endpoints,
            tmp_path / "out",
            [PartitionParams(name="short", concurrency=4, max_tokens=16)],
            **FAST,
        )
        served = (first.server.requests, second.server.requests)
    assert summary.datasets["ds"].done == 40
    assert all(count >= 15 for count in served), served  # 41 requests (incl. probes) spread over both
    used = Counter(record["endpoint"] for record in read_generations(tmp_path / "out").values())
    assert set(used) == {first.base_url, second.base_url}


def test_an_endpoints_own_concurrency_caps_its_in_flight_requests(tmp_path):
    """params `endpoints[].concurrency` bounds that endpoint alone; the other takes the rest of the
    partition's."""
    prompts = write_prompts(tmp_path / "prompts.jsonl", [f"q{i} #sleep:0.05" for i in range(24)])
    with FaultEndpoint() as capped, FaultEndpoint() as free:
        endpoints = [EndpointSpec(capped.base_url, concurrency=1), EndpointSpec(free.base_url)]
        summary = generate(
            [PromptSource("ds", "short", prompts)],
            endpoints,
            tmp_path / "out",
            [PartitionParams(name="short", concurrency=6, max_tokens=16)],
            **FAST,
        )
        peaks = (capped.server.peak_in_flight, free.server.peak_in_flight)
    assert summary.datasets["ds"].done == 24
    assert peaks[0] == 1 and peaks[1] > 1, peaks


def start_fault_process(port: int, *args: str) -> subprocess.Popen:
    process = subprocess.Popen(
        [
            sys.executable,
            str(Path(__file__).resolve().parents[1] / "fault_endpoint.py"),
            "--port",
            str(port),
            *args,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout.readline().startswith("READY"), "fault endpoint did not start"
    return process


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_endpoint_dies_and_comes_back_mid_run(tmp_path):
    port = free_port()
    prompts = write_prompts(tmp_path / "prompts.jsonl", [f"q{i} #sleep:0.01" for i in range(120)])
    server = {"process": start_fault_process(port)}

    def outage() -> None:
        while len(finished_keys(tmp_path / "out" / "generations.jsonl")) < 20:
            time.sleep(0.01)
        server["process"].kill()
        server["process"].wait()
        time.sleep(0.6)
        server["process"] = start_fault_process(port)

    killer = threading.Thread(target=outage)
    killer.start()
    try:
        summary = generate(
            [PromptSource("ds", "short", prompts)],
            [EndpointSpec(f"http://127.0.0.1:{port}/v1")],
            tmp_path / "out",
            [PartitionParams(name="short", concurrency=8, max_tokens=16)],
            **FAST,
        )
    finally:
        killer.join(10)
        server["process"].kill()
    assert summary.datasets["ds"].done == 120 and summary.datasets["ds"].errors == 0
    assert set(ids_once(tmp_path / "out").values()) == {1}
    assert max(record["attempts"] for record in read_generations(tmp_path / "out").values()) > 1


# -------------------------------------------------------------------------------------------------
# Killing the client


def client_command(config: dict, path: Path) -> list[str]:
    path.write_text(json.dumps(config))
    return [sys.executable, __file__, str(path)]


def run_client(config_path: str) -> None:
    config = json.loads(Path(config_path).read_text())
    generate(
        [PromptSource("ds", "short", Path(config["prompts"]))],
        [EndpointSpec(config["base_url"])],
        Path(config["output_dir"]),
        [PartitionParams(name="short", concurrency=config["concurrency"], max_tokens=16)],
        shutdown_grace_s=config.get("grace", 30.0),
        **FAST,
    )


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_client_killed_mid_run_resumes_exactly_once(tmp_path, how):
    total = 150
    prompts = write_prompts(tmp_path / "prompts.jsonl", [f"q{i} #sleep:0.02" for i in range(total)])
    output = tmp_path / "out"
    with FaultEndpoint() as endpoint:
        config = {
            "prompts": str(prompts),
            "base_url": endpoint.base_url,
            "output_dir": str(output),
            "concurrency": 4,
            "grace": 5.0,
        }
        client = subprocess.Popen(
            client_command(config, tmp_path / "config.json"), stderr=subprocess.PIPE, text=True
        )
        deadline = time.monotonic() + 30
        while len(finished_keys(output / "generations.jsonl")) < 20 and time.monotonic() < deadline:
            time.sleep(0.01)
        client.send_signal(signal.SIGKILL if how == "SIGKILL" else signal.SIGTERM)
        started = time.monotonic()
        returncode = client.wait(timeout=20)
        stopped_in = time.monotonic() - started
        stderr = client.stderr.read()
        before = len(finished_keys(output / "generations.jsonl"))
        assert 20 <= before < total, "the client finished before it was killed; slow the prompts down"
        if how == "SIGKILL":
            assert returncode == -signal.SIGKILL
            with open(output / "generations.jsonl", "a") as handle:
                handle.write('{"dataset": "ds", "id": "torn')  # a write cut off by the kill
        else:
            assert returncode == 143, stderr[-2000:]
            assert stopped_in < 5.0 and "stopping: no new requests" in stderr, stderr
            metrics = [record for _, record in read_jsonl(output / "metrics.jsonl")]
            assert metrics[-1]["final"] and metrics[-1]["in_flight"] == 0
        summary = generate(
            [PromptSource("ds", "short", prompts)],
            [EndpointSpec(endpoint.base_url)],
            output,
            [PartitionParams(name="short", concurrency=4, max_tokens=16)],
            **FAST,
        )
    assert summary.datasets["ds"].done == total
    counts = ids_once(output)
    assert len(counts) == total and set(counts.values()) == {1}
    assert (
        summary.requests_this_session <= total - before + 4
    )  # only the missing ones (+ those in flight) again


# -------------------------------------------------------------------------------------------------
# The real embedded server


@pytest.mark.slow
def test_embedded_server_end_to_end_and_tokenized_data(tmp_path, embedded_server, embedded_model_dir):
    prompts = write_prompts(tmp_path / "prompts.jsonl", ["What is 2+2?", "Name a colour.", "Say hi."])
    source = [PromptSource("tiny", "short", prompts)]
    summary = generate(
        source,
        [EndpointSpec(embedded_server.base_url, model=embedded_server.model_name)],
        tmp_path / "out",
        [PartitionParams(name="short", concurrency=3, max_tokens=8)],
        temperature=0.0,
        chat_template_kwargs={"enable_thinking": False},
        **FAST,
    )  # transformers serve takes them (its own field)
    assert summary.datasets["tiny"].done == 3 and summary.datasets["tiny"].errors == 0
    assert summary.endpoints[0]["rejects_unknown_fields"]  # transformers serve 422s return_token_ids
    records = read_generations(tmp_path / "out")
    assert all(
        record["completion_tokens"] and record["finish_reason"] in ("stop", "length")
        for record in records.values()
    )
    # build_tokenized_data over these answers (and the server's usage): tests/test_tokenized.py


@pytest.mark.slow
def test_embedded_server_stopped_and_restarted_mid_run(tmp_path, embedded_model_dir):
    from eaglekit.generation.server import EmbeddedServer

    prompts = write_prompts(
        tmp_path / "prompts.jsonl", [f"Give one word for the number {i}." for i in range(6)]
    )
    server = EmbeddedServer(embedded_model_dir, log_path=tmp_path / "server.log").start()
    restarted, run_over = threading.Event(), threading.Event()

    def restart() -> None:
        while len(finished_keys(tmp_path / "out" / "generations.jsonl")) < 1 and not run_over.is_set():
            time.sleep(0.05)
        server.stop()
        server.start()  # same port
        restarted.set()
        # The server's PR_SET_PDEATHSIG fires when the *thread* that started it exits: stay alive
        # until the run is over, and stop the server from here.
        run_over.wait()
        server.stop()

    restarter = threading.Thread(target=restart, daemon=True)
    restarter.start()
    try:
        summary = generate(
            [PromptSource("tiny", "short", prompts)],
            [EndpointSpec(server.base_url, model=server.model_name)],
            tmp_path / "out",
            [PartitionParams(name="short", concurrency=2, max_tokens=4)],
            temperature=0.0,
            **{**FAST, "retry": GenerationParams(max_attempts=6, backoff_base_s=0.2, backoff_max_s=1.0)},
        )
    finally:
        run_over.set()
        restarter.join(120)
    assert restarted.is_set()
    assert summary.datasets["tiny"].done == 6 and summary.datasets["tiny"].errors == 0
    assert set(ids_once(tmp_path / "out").values()) == {1}


# -------------------------------------------------------------------------------------------------
# Settings from params: every field comes from config.py, none is copied by hand


def test_settings_build_themselves_from_params(monkeypatch):
    from eaglekit.config import params_from_sections
    from eaglekit.generation.settings import backoff_seconds

    monkeypatch.setenv("EAGLEKIT_TEST_KEY", "sk-test")
    params = params_from_sections(
        {
            "generation": {
                "partitions": [{"name": "long", "concurrency": 3, "max_tokens": 77}],
                "max_attempts": 5,
                "backoff_base_s": 0.25,
                "backoff_max_s": 9.0,
            },
            "endpoints": [
                {"url": "http://10.0.0.5:30000/v1/", "model": "m", "api_key_env": "EAGLEKIT_TEST_KEY"},
                {"url": "http://10.0.0.6:30000/v1", "name": "b", "concurrency": 2},
            ],
        }
    )
    assert params.generation.partitions == [PartitionParams(name="long", concurrency=3, max_tokens=77)]
    # The backoff reads params generation's own fields: attempt n waits uniform(0, min(max, base x 2^(n-1))).
    rng = random.Random(0)
    fourth = [backoff_seconds(params.generation, 4, rng) for _ in range(200)]
    assert min(fourth) >= 0 and 1.8 < max(fourth) <= 0.25 * 2**3
    assert (
        8.0 < max(backoff_seconds(params.generation, 9, rng) for _ in range(200)) <= 9.0
    )  # capped at backoff_max_s
    first, second = (EndpointSpec.from_params(e) for e in params.endpoints)
    assert first == EndpointSpec(
        base_url="http://10.0.0.5:30000/v1",
        model="m",
        api_key="sk-test",
        name="http://10.0.0.5:30000/v1",
        api_key_env="EAGLEKIT_TEST_KEY",
    )
    assert second == EndpointSpec(
        base_url="http://10.0.0.6:30000/v1", model=None, api_key="EMPTY", name="b", concurrency=2
    )
    monkeypatch.delenv("EAGLEKIT_TEST_KEY")
    with pytest.raises(ValueError, match="EAGLEKIT_TEST_KEY is not set"):
        EndpointSpec.from_params(params.endpoints[0])


if __name__ == "__main__":
    run_client(sys.argv[1])


@pytest.mark.parametrize("dialect", ["sglang", "vllm"])
def test_abort_and_error_finishes_are_retried_not_recorded_as_answers(tmp_path, dialect):
    # SGLang and vLLM end a request they gave up on with finish_reason "abort" (vLLM also "error"): no answer,
    # so the prompt is retried and, past the attempt limit, recorded as an error. "length" is an answer.
    prompts = write_prompts(
        tmp_path / "prompts.jsonl",
        [
            "aborted once #fault:abortx1",
            "always aborted #fault:abort",
            "always errored #fault:error",
            "cut #fault:length",
        ],
    )
    with FaultEndpoint(FaultOptions(token_ids=dialect)) as endpoint:
        summary = generate(
            [PromptSource("ds", "short", prompts)],
            [EndpointSpec(endpoint.base_url)],
            tmp_path / "out",
            [PartitionParams(name="short", concurrency=2, max_tokens=16)],
            **FAST,
        )
    records = read_generations(tmp_path / "out")
    assert sorted(record["id"] for record in records.values()) == ["p0", "p3"]
    assert records[("ds", "p0")]["attempts"] == 2 and records[("ds", "p0")]["finish_reason"] == "stop"
    assert records[("ds", "p3")]["truncated"] and records[("ds", "p3")]["attempts"] == 1
    errors = {record["id"]: record for _, record in read_jsonl(tmp_path / "out" / "errors.jsonl")}
    assert {name: errors[name]["kind"] for name in ("p1", "p2")} == {
        "p1": "finish_abort",
        "p2": "finish_error",
    }
    assert errors["p1"]["attempts"] == FAST["retry"].max_attempts and summary.errors == 2


def _served_prompt(tokenizer, request: dict) -> str:
    """The prompt as SGLang/vLLM render a chat request: the template over the request's own messages and
    tools."""
    return tokenizer.apply_chat_template(
        request["messages"],
        tools=request.get("tools"),
        add_generation_prompt=True,
        tokenize=False,
        **request.get("chat_template_kwargs", {}),
    )


@pytest.mark.parametrize("template", ["qwen3", "smollm2"])
def test_past_reasoning_is_sent_so_the_server_renders_the_prompt_prep_rendered(
    tmp_path, embedded_model_dir, template
):
    """A tool-result prompt after a turn with reasoning: Qwen3 renders that turn's reasoning (it follows the
    last user query), ChatML has no reasoning field and prep folds it into the content. The request must
    carry it so, or the server answers a different prompt than the one the sample is trained under."""
    from eaglekit.chat.prompts import render_conversation
    from eaglekit.generation.prompts import history_reasoning_for
    from support import TOOLS, fixture_tokenizer

    tokenizer = fixture_tokenizer(embedded_model_dir, template)
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "List the files."},
        {
            "role": "assistant",
            "content": "",
            "reasoning": "I should run ls.",
            "tool_calls": [
                {"id": "call0", "type": "function", "function": {"name": "bash", "arguments": {"cmd": "ls"}}}
            ],
        },
        {"role": "tool", "tool_call_id": "call0", "content": "a.txt b.txt"},
    ]
    if (
        template == "smollm2"
    ):  # no tool syntax in ChatML: a plain earlier turn with reasoning, then a question
        conversation[2:] = [
            {"role": "assistant", "content": "Two files.", "reasoning": "Count them."},
            {"role": "user", "content": "Which is first?"},
        ]
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        json.dumps(
            {
                "id": "c0",
                "source": "t",
                "messages": conversation,
                "meta": {"tools": TOOLS if template == "qwen3" else None},
            }
        )
        + "\n"
    )
    extra = {} if template == "qwen3" else {"history_reasoning": history_reasoning_for(tokenizer)}
    with FaultEndpoint(FaultOptions(token_ids="vllm")) as endpoint:
        generate(
            [PromptSource("ds", "short", path)],
            [EndpointSpec(endpoint.base_url)],
            tmp_path / "out",
            [PartitionParams(name="short", concurrency=1, max_tokens=16)],
            **FAST,
            **extra,
        )
        request = endpoint.server.last_request
    prepared = render_conversation(
        tokenizer, conversation, add_generation_prompt=True, tools=TOOLS if template == "qwen3" else None
    )
    assert "I should run ls." in prepared or "Count them." in prepared
    assert _served_prompt(tokenizer, request) == prepared


def _occupancy(
    spans: list[tuple[str, float, float]], concurrency: dict[str, int]
) -> tuple[float, dict[str, int]]:
    """The most room the server's answers took at once (sum over partitions of in flight / concurrency), and
    the most in flight of each partition; a span's partition is its prompt's first letter."""
    events = sorted(
        [(start, 1, prompt[0]) for prompt, start, _ in spans]
        + [(end, -1, prompt[0]) for prompt, _, end in spans]
    )
    running = {name: 0 for name in concurrency}
    room, peaks = 0.0, dict(running)
    for (
        _,
        change,
        name,
    ) in events:  # at equal times an end (-1) comes before a start: an answer frees its room first
        running[name] += change
        peaks[name] = max(peaks[name], running[name])
        room = max(room, sum(running[key] / concurrency[key] for key in concurrency))
    return room, peaks


def test_the_long_partition_starts_in_the_room_the_short_one_frees_as_it_drains(tmp_path):
    # Answers of realistic length and decode time: 32 short ones of 20-200 tokens (one of 400, a long drain),
    # then 6 long ones of 600. The long partition must start before the last short answer is in, and the
    # server must never hold more than the room: short in flight / 8 + long in flight / 2 <= 1.
    rng = random.Random(0)
    short = [f"s{index} #tokens:{rng.randint(20, 200) if index != 28 else 400}" for index in range(32)]
    long = [f"l{index} #tokens:600" for index in range(6)]
    sources = [
        PromptSource("chat", "short", write_prompts(tmp_path / "short.jsonl", short)),
        PromptSource("code", "long", write_prompts(tmp_path / "long.jsonl", long)),
    ]
    partitions = [
        PartitionParams(name="short", concurrency=8, max_tokens=512),
        PartitionParams(name="long", concurrency=2, max_tokens=1024),
    ]
    with FaultEndpoint(FaultOptions(token_seconds=0.002)) as endpoint:
        summary = within(
            60,
            generate,
            sources,
            [EndpointSpec(endpoint.base_url)],
            tmp_path / "out",
            partitions,
            **{**FAST, "log_interval_s": 0.1},
        )
        spans = list(endpoint.server.spans)
    assert summary.datasets["chat"].done == 32 and summary.datasets["code"].done == 6
    assert ids_once(tmp_path / "out") == Counter({f"p{index}": 1 for index in range(32)}) + Counter(
        {f"p{index}": 1 for index in range(6)}
    )
    last_short_end = max(end for prompt, _, end in spans if prompt.startswith("s"))
    first_long_start = min(start for prompt, start, _ in spans if prompt.startswith("l"))
    assert first_long_start < last_short_end - 0.2, "the long partition waited for the short one to drain"
    room, peaks = _occupancy(spans, {"s": 8, "l": 2})
    assert room <= 1.0 and peaks == {"s": 8, "l": 2}, (room, peaks)
    # Every progress record says its ETA in words; none gives the long partition a plain figure before it has
    # answers of its own (the old ETA priced it at the short partition's request rate).
    metrics = [record for _, record in read_jsonl(tmp_path / "out" / "metrics.jsonl")]
    assert all(set(record["eta"]) == {"short", "long"} and record["eta_total"] for record in metrics)
    before_long = [record for record in metrics if record["done"]["code"] == 0 and not record["final"]]
    assert before_long and all(
        record["eta"]["long"].startswith(("not yet known", "at most")) for record in before_long
    )
