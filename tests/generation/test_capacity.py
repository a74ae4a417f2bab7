"""Capacity planner figures against hand-computed values for real model configs."""

import json
import os

import numpy as np
import pytest

from eaglekit.generation import capacity
from eaglekit.io import InputError

LLAMA_31_8B = {
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
}
# Kimi-K2.5 wraps its DeepSeek-V3-style decoder in text_config (multimodal wrapper).
KIMI_K25 = {
    "architectures": ["KimiK25ForConditionalGeneration"],
    "text_config": {
        "num_hidden_layers": 61,
        "hidden_size": 7168,
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
    },
}
SMOLLM2_135M = {
    "num_hidden_layers": 30,
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
}


def test_llama_kv_bytes_per_token():
    assert capacity.kv_cache_bytes_per_token(LLAMA_31_8B, "bf16") == 131_072
    assert capacity.kv_cache_bytes_per_token(LLAMA_31_8B, "fp16") == 131_072
    assert capacity.kv_cache_bytes_per_token(LLAMA_31_8B, "fp8") == 65_536
    # 8 KV heads over TP 2: 4 heads per rank.
    assert capacity.kv_cache_bytes_per_token(LLAMA_31_8B, "bf16", tensor_parallel=2) == 65_536
    # TP 16 > 8 KV heads: heads are replicated, one per rank.
    assert capacity.kv_cache_bytes_per_token(LLAMA_31_8B, "bf16", tensor_parallel=16) == 2 * 32 * 128 * 2
    assert capacity.attention_kind(LLAMA_31_8B) == "GQA"


def test_kimi_mla_kv_bytes_per_token_and_the_naive_estimate():
    assert capacity.attention_kind(KIMI_K25) == "MLA"
    assert capacity.kv_cache_bytes_per_token(KIMI_K25, "bf16") == 61 * 576 * 2 == 70_272
    assert capacity.kv_cache_bytes_per_token(KIMI_K25, "fp8") == 35_136
    # The latent is replicated on every TP rank.
    assert capacity.kv_cache_bytes_per_token(KIMI_K25, "bf16", tensor_parallel=8) == 70_272
    naive = capacity.naive_kv_estimates(KIMI_K25)
    assert naive["mha_formula_hidden_size"] == 2 * 61 * 7168 * 2 == 1_748_992  # the "1.75 MB/token"
    assert round(naive["mha_formula_hidden_size"] / 1e6, 2) == 1.75
    assert naive["mla_expanded_per_head"] == 61 * 64 * (128 + 64 + 128) * 2 == 2_498_560


def test_mha_and_smollm2():
    mha = dict(LLAMA_31_8B, num_key_value_heads=32)
    assert capacity.attention_kind(mha) == "MHA"
    assert capacity.kv_cache_bytes_per_token(mha) == 2 * 32 * 32 * 128 * 2
    assert capacity.kv_cache_bytes_per_token(SMOLLM2_135M) == 2 * 30 * 3 * 64 * 2 == 23_040


def test_hidden_state_storage():
    assert capacity.hidden_state_bytes_per_token(7168) == 57_344
    assert capacity.hidden_state_bytes_per_token(4096) == 32_768
    assert capacity.hidden_state_bytes_per_token(4096, dtype_bytes=4) == 65_536


def test_plan_llama_on_one_h100(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_31_8B))
    plan = capacity.plan_capacity(
        tmp_path,
        gpu_memory_bytes=80 * 10**9,
        memory_fraction=0.9,
        weight_bytes=16 * 10**9,
        partitions=[
            {
                "name": "short",
                "prompts": 1000,
                "prompt_tokens": 2048,
                "max_tokens": 10_240,
                "concurrency": 150,
            },
            {
                "name": "long",
                "prompts": 100,
                "prompt_tokens": 16_384,
                "max_tokens": 16_384,
                "concurrency": 32,
            },
        ],
        measured_requests_per_second={"short": 2.0, "long": 0.5},
        expected_total_tokens=1_000_000,
    )
    pool = 72 * 10**9 - 16 * 10**9
    assert plan.kv_pool_bytes_per_rank == pool
    assert plan.kv_pool_tokens == pool // 131_072 == 427_246
    short, long = plan.partitions
    assert short.sequences_that_fit == 427_246 // 12_288 == 34
    assert short.recommended_concurrency == 34  # capped: 150 requested would preempt
    assert long.sequences_that_fit == 427_246 // 32_768 == 13
    assert short.eta_seconds == 500.0 and long.eta_seconds == 200.0 and plan.eta_seconds == 700.0
    assert plan.hidden_state_storage_bytes == 32_768 * 1_000_000
    assert [row["partition"] for row in plan.table()] == ["short", "long"]


def test_plan_kimi_on_eight_gpus_gains_no_kv_room_from_tp():
    plan = capacity.plan_capacity(
        KIMI_K25,
        gpu_memory_bytes=141 * 10**9,
        memory_fraction=0.85,
        weight_bytes=8 * 80 * 10**9,
        tensor_parallel=8,
        partitions=[{"name": "short", "prompts": 10, "prompt_tokens": 1000, "max_tokens": 10_240}],
    )
    pool = int(141e9 * 0.85 - 80e9)
    assert plan.kv_pool_tokens == pool // 70_272
    assert plan.partitions[0].recommended_concurrency == plan.partitions[0].sequences_that_fit
    assert plan.eta_seconds is None


def test_capacity_failures():
    with pytest.raises(ValueError, match="do not fit"):
        capacity.kv_pool_bytes_per_rank(24 * 10**9, 0.9, 40 * 10**9)
    with pytest.raises(ValueError, match="unknown KV-cache dtype"):
        capacity.kv_cache_bytes_per_token(LLAMA_31_8B, "int3")
    with pytest.raises(InputError, match="num_hidden_layers"):
        capacity.kv_cache_bytes_per_token({"hidden_size": 8, "num_attention_heads": 2})
    with pytest.raises(InputError, match="max_tokens"):
        capacity.plan_capacity(
            LLAMA_31_8B,
            gpu_memory_bytes=80 * 10**9,
            memory_fraction=0.9,
            weight_bytes=0,
            partitions=[{"name": "x", "prompts": 1, "prompt_tokens": 5}],
        )
    with pytest.raises(ValueError, match="'short': throughput must be positive, got -2.0"):
        capacity.plan_capacity(
            LLAMA_31_8B,
            gpu_memory_bytes=80 * 10**9,
            memory_fraction=0.9,
            weight_bytes=16 * 10**9,
            partitions=[{"name": "short", "prompts": 10, "prompt_tokens": 64, "max_tokens": 64}],
            measured_requests_per_second={"short": -2.0},
        )


# -------------------------------------------------------------------------------------------------
# Concurrency from length distributions

KIMI_H200_TP8 = dict(
    gpu_memory_bytes=141 * 10**9, memory_fraction=0.85, weight_bytes=594 * 10**9, tensor_parallel=8
)


def scenario_lengths(seed: int = 0, n: int = 5000):
    """Prompts with p95 ~ 2,000 tokens and answers averaging ~300 (the reference run's first minutes:
    217-298)."""
    rng = np.random.default_rng(seed)
    prompts = np.minimum(rng.lognormal(np.log(500), 0.9, n).astype(int) + 20, 4096)
    completions = np.minimum(rng.lognormal(np.log(220), 0.8, n).astype(int) + 1, 10_240)
    return prompts, completions


def test_reference_scenario_worst_case_53_and_length_plan_keeps_the_requested_150():
    prompts, completions = scenario_lengths()
    short = {
        "name": "short",
        "prompts": 80_000,
        "prompt_tokens": 2000,
        "max_tokens": 10_240,
        "concurrency": 150,
    }
    old = capacity.plan_capacity(KIMI_K25, **KIMI_H200_TP8, partitions=[short])
    assert old.kv_bytes_per_token == old.kv_bytes_per_token_per_rank == 70_272
    pool_tokens = int(141e9 * 0.85 - 594e9 / 8) // 70_272
    assert old.kv_pool_tokens == pool_tokens and pool_tokens // (2000 + 10_240) == 53
    plan = old.partitions[0]
    assert (plan.sequences_that_fit, plan.recommended_concurrency) == (53, 53)  # what the old plan said
    assert "worst case" in plan.reason and plan.retraction_concurrency is None
    measured = capacity.plan_capacity(
        KIMI_K25,
        **KIMI_H200_TP8,
        partitions=[
            {
                **short,
                "prompt_lengths": prompts,
                "completion_lengths": completions,
                "completion_source": "pilot",
            }
        ],
        measured_requests_per_second={"short": 1.24},
    )
    plan = measured.partitions[0]
    assert plan.sequences_that_fit == 53  # the no-preemption worst case, still reported
    assert plan.recommended_concurrency == 150 and plan.retraction_concurrency > 400
    assert 0.15 < plan.expected_kv_occupancy < 0.35  # 150 running sequences use about a quarter of the pool
    assert "set the requested 150" in plan.reason and "53" in plan.reason
    assert plan.eta_seconds == pytest.approx(80_000 / 1.24)
    # Answers that all run to max_tokens: then 150 does not fit and the plan says so.
    long_answers = capacity.plan_capacity(
        KIMI_K25,
        **KIMI_H200_TP8,
        partitions=[{**short, "prompt_lengths": prompts, "completion_lengths": np.full(100, 20_000)}],
    ).partitions[0]
    assert long_answers.mean_completion_tokens == 10_240  # clipped to max_tokens
    assert 53 < long_answers.recommended_concurrency < 150 and "not the requested 150" in long_answers.reason


@pytest.mark.parametrize("paired", [True, False])
def test_retraction_concurrency_matches_a_simulated_continuous_batch(paired):
    # Simulate what the plan assumes: C slots, each holding a sequence chosen in proportion to its
    # running time (its completion length) at a uniform step of its answer; count how often the
    # C slots together outgrow the pool. At the planned C that is about the accepted risk.
    rng = np.random.default_rng(1)
    prompts, completions = scenario_lengths(seed=2, n=4000)
    if not paired:
        completions = completions[:1500]
    pool = 200_000
    plan = capacity.length_plan(pool, prompts, completions, retraction_risk=0.05)
    weights = completions / completions.sum()

    def overflow_rate(concurrency: int, trials: int = 3000) -> float:
        picks = rng.choice(len(completions), size=(trials, concurrency), p=weights)
        chosen = completions[picks]
        held_prompts = prompts[picks] if paired else rng.choice(prompts, size=(trials, concurrency))
        steps = np.floor(rng.random((trials, concurrency)) * chosen) + 1
        return float(((held_prompts + steps).sum(axis=1) > pool).mean())

    assert 0.02 < overflow_rate(plan.retraction_concurrency) < 0.09
    assert overflow_rate(int(plan.retraction_concurrency * 1.15)) > 0.4  # beyond it, retractions are likely
    assert plan.expected_tokens_per_sequence * plan.retraction_concurrency < pool


def test_length_plan_inputs():
    with pytest.raises(ValueError, match="at least one"):
        capacity.length_plan(1000, [], [10])
    with pytest.raises(ValueError, match="retraction_risk"):
        capacity.length_plan(1000, [10], [10], retraction_risk=0.7)
    # One sequence kind, prompt 100, answer 99 tokens: a slot holds 100 + 50 on average.
    assert capacity.length_plan(10_000, [100], [99]).expected_tokens_per_sequence == 150.0
    assert capacity.length_plan(10_000, [100], [99], page_size=16).expected_tokens_per_sequence == 157.5


def test_plan_generation_measures_lengths_from_a_pilot_else_the_datasets_answers(tmp_path):
    from eaglekit.config import params_from_sections
    from eaglekit.generation.plan import plan_generation

    prep = tmp_path / "prep" / "ds"
    prep.mkdir(parents=True)
    with (
        open(prep / "prompts.short.jsonl", "w") as prompts,
        open(prep / "original_tokenized_data.jsonl", "w") as answers,
    ):
        for index in range(40):
            meta = {"prompt_tokens": 20 + index, "partition": "short"}
            prompts.write(
                json.dumps({"id": f"p{index}", "messages": [{"role": "user", "content": "q"}], "meta": meta})
                + "\n"
            )
            answers.write(
                json.dumps(
                    {"id": f"p{index}", "input_ids": [1] * 30, "loss_mask": [0] * 20 + [1] * 10, "meta": meta}
                )
                + "\n"
            )
    pilot = tmp_path / "pilot"
    pilot.mkdir()
    with open(pilot / "generations.jsonl", "w") as handle:
        for index in range(10):  # ten answers of 50 tokens, one finished every second from t = 1000
            handle.write(
                json.dumps(
                    {
                        "dataset": "ds",
                        "id": f"p{index}",
                        "partition": "short",
                        "endpoint": "e",
                        "latency_s": 1.0,
                        "prompt_tokens": 25,
                        "completion_tokens": 50,
                        "finished_at": 1001.0 + index,
                        "truncated": index == 0,
                        "content": "x",
                    }
                )
                + "\n"
            )
    sections = {
        "target": {"model": "embedded:smollm2-135m-instruct", "config": SMOLLM2_135M},
        "server": {"kv_cache_tokens": 4096},
        "generation": {"partitions": [{"name": "short", "concurrency": 8, "max_tokens": 64}]},
    }
    files = [("ds", "short", prep / "prompts.short.jsonl")]
    from_answers = plan_generation(params_from_sections(sections), files).partitions[0]
    assert (
        from_answers.completion_source.startswith("datasets' own answers")
        and from_answers.mean_completion_tokens == 10
    )
    assert from_answers.eta_seconds is None
    sections["generation"]["plan"] = {"pilot_dir": str(pilot)}
    plan = plan_generation(params_from_sections(sections), files)
    short = plan.partitions[0]
    assert plan.kv_pool_tokens == 4096  # the embedded server's bounded pool
    assert short.completion_source.startswith("pilot") and short.mean_completion_tokens == 50
    assert "10% cut at the pilot's max_tokens: lengths are a lower bound" in short.completion_source
    assert short.expected_tokens_per_sequence == 25 + 51 / 2
    assert short.eta_seconds == pytest.approx(40 / (10 / 10.0))  # 10 answers in 10 s
    assert short.sequences_that_fit == 4096 // (58 + 64)
    # Under the runner the embedded server arrives as an endpoint named "embedded": still its own pool.
    sections["endpoints"] = [{"url": "http://127.0.0.1:8000/v1", "name": "embedded"}]
    assert plan_generation(params_from_sections(sections), files).kv_pool_tokens == 4096
    sections["endpoints"] = [{"url": "http://gpu-node:30000/v1", "name": "sglang"}]
    sections["generation"]["plan"].update(gpu_memory_gb=80.0, memory_fraction=0.9, weight_gb=2.0)
    assert (
        plan_generation(params_from_sections(sections), files).kv_pool_tokens
        == int(80e9 * 0.9 - 2e9) // 23_040
    )


def test_a_torn_or_missing_config_json_names_the_file(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA_31_8B, indent=2))
    assert capacity.attention_kind(tmp_path) == "GQA"
    os.truncate(config, config.stat().st_size // 2)  # a download or write cut off
    with pytest.raises(InputError, match=rf"{config}:\d+: not JSON .*download the model again"):
        capacity.attention_kind(tmp_path)
    with pytest.raises(
        FileNotFoundError, match=rf"{tmp_path / 'elsewhere' / 'config.json'} not found: pass the model"
    ):
        capacity.attention_kind(tmp_path / "elsewhere" / "config.json")
