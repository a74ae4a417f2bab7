"""Live serving measurement against recorded SGLang / vLLM answers served over real HTTP on 127.0.0.1."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from fixtures.serving import replay_server as replay
from eaglekit.analysis.live_serving import (
    get_sglang_server_info,
    measure_live_serving,
    measure_sglang,
    measure_vllm,
    root_url,
    run_sglang_requests,
    served_model_id,
    sglang_speculation,
)
from eaglekit.analysis.vllm_counters import parse_vllm_spec_counters


PROMPTS = replay.load("prompts.json")
# /generate takes rendered prompts; the replay server knows prompt "p0" by input ids [ord("p"), ord("0")].
GENERATE_PROMPTS = [{"id": p["id"], "input_ids": [ord(c) for c in p["id"]]} for p in PROMPTS]

# Recorded: completion_tokens (64, 128, 40), spec_verify_ct (30, 45, 21).
TAU_POOLED = (64 + 128 + 40) / (30 + 45 + 21)
TAU_REQUEST_MEAN = (64 / 30 + 128 / 45 + 40 / 21) / 3


def test_root_url_strips_v1():
    assert root_url("http://127.0.0.1:30000/v1/") == "http://127.0.0.1:30000"
    assert root_url("http://h:1") == "http://h:1"


def test_sglang_generate_with_baseline():
    with (
        replay.serve(replay.sglang_app(speculative=True)) as spec_url,
        replay.serve(replay.sglang_app(speculative=False)) as base_url,
    ):
        summary, per_request = measure_sglang(
            spec_url + "/v1", GENERATE_PROMPTS, baseline_url=base_url, max_new_tokens=128
        )
    speculative = summary[summary["role"] == "speculative"].iloc[0]
    baseline = summary[summary["role"] == "baseline"].iloc[0]
    assert speculative["tau_pooled"] == pytest.approx(TAU_POOLED)
    assert speculative["tau_request_mean"] == pytest.approx(TAU_REQUEST_MEAN)
    assert speculative["verification_steps"] == 96
    # Topology recorded beside tau, from server info.
    assert (
        speculative["algorithm"],
        speculative["topology"],
        speculative["steps"],
        speculative["topk"],
        speculative["draft_tokens"],
    ) == ("EAGLE3", "chain", 3, 1, 4)
    assert pd.isna(baseline["tau_pooled"]) and baseline["completion_tokens"] == 232
    assert speculative["tokens_per_s"] == pytest.approx(232 / speculative["wall_s"])
    assert speculative["speedup"] == pytest.approx(speculative["tokens_per_s"] / baseline["tokens_per_s"])
    assert baseline["speedup"] == pytest.approx(1.0)
    spec_rows = per_request[per_request["endpoint"] == spec_url + "/v1"]
    assert spec_rows["tau"].tolist() == pytest.approx([64 / 30, 128 / 45, 40 / 21])
    assert spec_rows["finish_reason"].tolist() == ["length", "length", "stop"]
    assert spec_rows["server_latency_s"].tolist() == pytest.approx([0.78, 1.21, 0.52])


def test_speculative_endpoint_without_spec_verify_ct_fails_loudly():
    # A server that says EAGLE3 but answers without spec_verify_ct.
    info = replay.load("sglang_server_info_eagle3.json")
    with replay.serve(replay.sglang_app(speculative=False, server_info=info)) as url:
        with pytest.raises(RuntimeError, match="no spec_verify_ct"):
            measure_sglang(url, GENERATE_PROMPTS)
    with replay.serve(replay.sglang_app(speculative=False)) as url:
        with pytest.raises(RuntimeError, match="no speculative_algorithm"):
            measure_sglang(url, GENERATE_PROMPTS)


def test_baseline_that_speculates_is_rejected():
    with replay.serve(replay.sglang_app(speculative=True)) as url:
        with pytest.raises(RuntimeError, match="baseline reports spec_verify_ct"):
            measure_sglang(url, GENERATE_PROMPTS, baseline_url=url)


def test_server_info_route_old_and_new():
    with replay.serve(replay.sglang_app(speculative=True, new_server_info_route=True)) as url:
        info = get_sglang_server_info(url)
    setup = sglang_speculation(info)
    assert setup.algorithm == "EAGLE3" and setup.draft_model_path == "/models/draft-eagle3"
    tree = sglang_speculation({**info, "speculative_eagle_topk": 8, "speculative_num_draft_tokens": 64})
    assert tree.topology == "tree"


def test_generate_prompts_must_be_token_ids():
    with pytest.raises(ValueError, match=r"prompt 0 \('p0'\) has no 'input_ids' for /generate"):
        run_sglang_requests("http://127.0.0.1:9", PROMPTS)


def test_vllm_counters_parse_sums_engines_and_skips_created():
    before = parse_vllm_spec_counters(Path(replay.FIXTURES, "vllm_metrics_before.txt").read_text())
    after = parse_vllm_spec_counters(Path(replay.FIXTURES, "vllm_metrics_after.txt").read_text())
    assert (before.drafts, before.draft_tokens, before.accepted_tokens) == (1000, 3000, 1300)
    assert before.accepted_per_position == (600, 420, 280)
    delta = after.minus(before)
    assert (delta.drafts, delta.accepted_tokens, delta.accepted_per_position) == (96, 136, (64, 44, 28))


def test_vllm_measurement_from_metrics_before_and_after():
    with replay.serve(replay.vllm_app()) as url, replay.serve(replay.vllm_app()) as baseline_url:
        summary, per_request = measure_vllm(
            url + "/v1",
            GENERATE_PROMPTS,
            model="meta-llama/Llama-3.1-8B-Instruct",
            baseline_url=baseline_url,
            max_tokens=128,
        )
    speculative = summary[summary["role"] == "speculative"].iloc[0]
    assert speculative["tau_pooled"] == pytest.approx(1 + 136 / 96)
    assert (speculative["topology"], speculative["steps"], speculative["draft_tokens"]) == ("chain", 3, 4)
    assert speculative["acceptance_per_position"] == pytest.approx([64 / 96, 44 / 96, 28 / 96])
    assert speculative["completion_tokens"] == 232
    assert "speedup" in summary.columns and len(per_request) == 6


def test_vllm_without_speculation_says_how_to_enable_it():
    with replay.serve(replay.vllm_app(speculative=False)) as url:
        with pytest.raises(RuntimeError, match="--speculative-config"):
            measure_vllm(url, GENERATE_PROMPTS, model="m")


# ----------------------------------------------------------------------------- notebook 06's live measurement


def test_served_model_id_reads_v1_models_and_names_a_server_without_it():
    with replay.serve(replay.vllm_app()) as url:
        assert served_model_id(url + "/v1/") == "meta-llama/Llama-3.1-8B-Instruct"
    with replay.serve(replay.sglang_app(speculative=True)) as url:  # the replay SGLang has no /v1/models
        with pytest.raises(RuntimeError, match=r"GET http://127\.0\.0\.1:\d+/v1/models answered 404"):
            served_model_id(url)


def test_live_serving_without_endpoints_sends_nothing_and_says_so():
    live = measure_live_serving(GENERATE_PROMPTS, max_new_tokens=128)
    assert not live.measured and live.summary is None and live.records() is None and live.per_request == {}
    assert "analysis.sglang_endpoint / analysis.vllm_endpoint are unset" in live.note()


def test_live_serving_sglang_sends_token_ids_with_its_baseline():
    spec_app, base_app = replay.sglang_app(speculative=True), replay.sglang_app(speculative=False)
    prompts = [
        {**prompt, "dataset": "chitchat"} for prompt in GENERATE_PROMPTS
    ]  # loop prompts carry more than id and ids
    with replay.serve(spec_app) as spec_url, replay.serve(base_app) as base_url:
        live = measure_live_serving(
            prompts, max_new_tokens=96, sglang_endpoint=spec_url, baseline_endpoint=base_url
        )
    assert [body["input_ids"] for body in spec_app.state.requests_seen] == [
        prompt["input_ids"] for prompt in GENERATE_PROMPTS
    ]
    assert (
        base_app.state.requests_seen == spec_app.state.requests_seen
    )  # the baseline gets the very same requests
    assert all(
        body["sampling_params"] == {"max_new_tokens": 96, "temperature": 0.0}
        for body in spec_app.state.requests_seen
    )
    assert live.summary["role"].tolist() == ["speculative", "baseline"] and list(live.per_request) == [
        "sglang"
    ]
    assert live.summary["tau_pooled"].iloc[0] == pytest.approx(TAU_POOLED)
    records = live.records()
    assert (
        records[0]["endpoint"] == spec_url
        and records[0]["verification_steps"] == 96
        and records[1]["endpoint"] == base_url
    )
    assert len(live.per_request["sglang"]) == 6 and "2 endpoint(s)" in live.note()


def test_live_serving_vllm_gets_the_same_token_ids_under_the_served_name():
    app = replay.vllm_app()
    prompts = [{**prompt, "dataset": "chitchat"} for prompt in GENERATE_PROMPTS]
    with replay.serve(app) as url:
        live = measure_live_serving(prompts, max_new_tokens=128, vllm_endpoint=url + "/v1")
    # Token ids on /v1/completions, as SGLang's /generate gets them: no second chat template around the
    # prompt.
    assert [body["prompt"] for body in app.state.requests_seen] == [
        prompt["input_ids"] for prompt in GENERATE_PROMPTS
    ]
    assert {body["model"] for body in app.state.requests_seen} == {"meta-llama/Llama-3.1-8B-Instruct"}
    assert all(body["max_tokens"] == 128 and body["temperature"] == 0.0 for body in app.state.requests_seen)
    row = live.summary.iloc[0]
    assert (row["server"], row["tau_pooled"], row["completion_tokens"]) == (
        "vllm",
        pytest.approx(1 + 136 / 96),
        232,
    )
    assert live.per_request["vllm"]["finish_reason"].tolist() == ["length", "length", "stop"]
    assert list(live.per_request) == ["vllm"] and live.per_request["vllm"]["prompt_id"].tolist() == [
        p["id"] for p in PROMPTS
    ]


def test_vllm_completions_refuses_prompts_without_token_ids():
    with replay.serve(replay.vllm_app()) as url:
        with pytest.raises(ValueError, match="prompt 0 \\('p0'\\) has no 'input_ids' for /v1/completions"):
            measure_vllm(url, PROMPTS, model="m")


def test_request_without_verification_steps_counts_as_zero_steps():
    # SGLang sets spec_* in meta_info only when spec_verify_ct > 0 (tokenizer_manager.py), so a request
    # answered by its prefill alone (1 token) has no spec_verify_ct on a speculating server. It must not abort
    # the run.
    records = replay.load("sglang_generate_speculative.json")
    p2 = records[2]["response"]
    meta = {key: value for key, value in p2["meta_info"].items() if not key.startswith("spec_")}
    meta.update(completion_tokens=1, finish_reason={"type": "length", "length": 1})
    records[2] = {**records[2], "response": {**p2, "output_ids": p2["output_ids"][:1], "meta_info": meta}}
    assert "spec_verify_ct" not in records[2]["response"]["meta_info"]
    with replay.serve(replay.sglang_app(speculative=True, generate_records=records)) as url:
        summary, per_request = measure_sglang(url, GENERATE_PROMPTS, max_new_tokens=128)
    speculative = summary[summary["role"] == "speculative"].iloc[0]
    assert speculative["verification_steps"] == 30 + 45 and speculative["completion_tokens"] == 64 + 128 + 1
    assert speculative["tau_pooled"] == pytest.approx((64 + 128 + 1) / (30 + 45))
    assert speculative["tau_request_mean"] == pytest.approx(
        (64 / 30 + 128 / 45) / 2
    )  # a 0-step request has no tau
    assert per_request["verification_steps"].tolist() == [30, 45, 0]
