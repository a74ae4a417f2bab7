"""Capacity planner figures against hand-computed values for real model configs."""

import json

import pytest

from eaglekit import capacity
from eaglekit.io import InputError

LLAMA_31_8B = {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
               "num_key_value_heads": 8, "head_dim": 128}
# Kimi-K2.5 wraps its DeepSeek-V3-style decoder in text_config (multimodal wrapper).
KIMI_K25 = {"architectures": ["KimiK25ForConditionalGeneration"], "text_config": {
    "num_hidden_layers": 61, "hidden_size": 7168, "num_attention_heads": 64, "num_key_value_heads": 64,
    "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128}}
SMOLLM2_135M = {"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3}


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
        tmp_path, gpu_memory_bytes=80 * 10**9, memory_fraction=0.9, weight_bytes=16 * 10**9,
        partitions=[{"name": "short", "prompts": 1000, "prompt_tokens": 2048, "max_tokens": 10_240, "concurrency": 150},
                    {"name": "long", "prompts": 100, "prompt_tokens": 16_384, "max_tokens": 16_384, "concurrency": 32}],
        measured_requests_per_second={"short": 2.0, "long": 0.5}, expected_total_tokens=1_000_000)
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
        KIMI_K25, gpu_memory_bytes=141 * 10**9, memory_fraction=0.85, weight_bytes=8 * 80 * 10**9,
        tensor_parallel=8, partitions=[{"name": "short", "prompts": 10, "prompt_tokens": 1000, "max_tokens": 10_240}])
    pool = int(141e9 * 0.85 - 80e9)
    assert plan.kv_pool_tokens == pool // 70_272
    assert plan.partitions[0].recommended_concurrency == plan.partitions[0].sequences_that_fit
    assert plan.eta_seconds is None


def test_eta_and_failures():
    assert capacity.eta_seconds(100, tokens_per_second=1000.0, mean_completion_tokens=500.0) == 50.0
    with pytest.raises(ValueError, match="do not fit"):
        capacity.kv_pool_bytes_per_rank(24 * 10**9, 0.9, 40 * 10**9)
    with pytest.raises(ValueError, match="unknown KV-cache dtype"):
        capacity.kv_cache_bytes_per_token(LLAMA_31_8B, "int3")
    with pytest.raises(InputError, match="num_hidden_layers"):
        capacity.kv_cache_bytes_per_token({"hidden_size": 8, "num_attention_heads": 2})
    with pytest.raises(InputError, match="max_tokens"):
        capacity.plan_capacity(LLAMA_31_8B, gpu_memory_bytes=80 * 10**9, memory_fraction=0.9, weight_bytes=0,
                               partitions=[{"name": "x", "prompts": 1, "prompt_tokens": 5}])
