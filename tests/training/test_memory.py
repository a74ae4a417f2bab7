"""Training memory plan: parameter counts by hand for the reference targets, the meta-device dry run
equals what autograd really keeps on the CPU, the T-curve is exact, the largest pack is the edge of
fitting."""

from __future__ import annotations

import pytest
import torch

from eaglekit.draft.model import DraftConfig, Eagle3DraftModel
from eaglekit.draft.head_loss import chunked_ttt_loss
from eaglekit.training.packing import pack_samples
from eaglekit.training import eligible_rows, target_signals
from eaglekit.training.memory import (
    activation_bytes,
    activation_bytes_curve,
    draft_config_for_target,
    parameter_counts,
    plan_training_memory,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LLAMA_31_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=128256,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
)
KIMI_K25 = {
    "model_type": "kimi_k25",
    "text_config": dict(
        hidden_size=7168,
        intermediate_size=18432,
        num_hidden_layers=61,
        num_attention_heads=64,
        num_key_value_heads=64,
        vocab_size=163840,
        max_position_embeddings=262144,
        rms_norm_eps=1e-6,
    ),
}
H200 = 141e9
TINY = DraftConfig(
    hidden_size=32,
    intermediate_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    vocab_size=60,
    draft_vocab_size=40,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
)


def test_parameter_counts_by_hand():
    # Llama-3.1-8B draft: fc 3H^2, q (2H -> 32x128), k and v (2H -> 8x128), o, SwiGLU, 4 norms,
    # lm_head 32,000 x H.
    hidden, inter = 4096, 14336
    llama = (
        hidden * 3 * hidden
        + 2 * hidden * 4096
        + 2 * (2 * hidden * 1024)
        + 4096 * hidden
        + 3 * hidden * inter
        + 4 * hidden
        + 32000 * hidden
    )
    assert parameter_counts(draft_config_for_target(LLAMA_31_8B, 32000)) == (llama, 128256 * 4096)
    hidden, inter = 7168, 18432  # Kimi-K2.5: 64 heads of 112 (hidden / heads), 64 KV heads
    kimi = (
        hidden * 3 * hidden
        + 3 * (2 * hidden * 7168)
        + 7168 * hidden
        + 3 * hidden * inter
        + 4 * hidden
        + 32000 * hidden
    )
    assert parameter_counts(draft_config_for_target(KIMI_K25, 32000)) == (kimi, 163840 * 7168)


def measured_saved_bytes(config: DraftConfig, tokens: int, ttt_steps: int) -> int:
    """What autograd really keeps for one packed micro-batch on the CPU (fp32, eager), weights excluded."""
    torch.manual_seed(0)
    model = Eagle3DraftModel(config)
    model.set_draft_vocab(
        torch.zeros(config.draft_vocab_size, dtype=torch.int64),
        torch.arange(config.vocab_size) < config.draft_vocab_size,
    )
    model.attention_backend = "eager"
    sample = {
        "id": "a",
        "input_ids": torch.randint(0, config.vocab_size, (tokens,)),
        "loss_mask": torch.ones(tokens, dtype=torch.int64),
        "aux_hidden_states": torch.randn(tokens, 3 * config.hidden_size).bfloat16(),
        "final_hidden_states": torch.randn(tokens, config.hidden_size).bfloat16(),
    }
    batch = pack_samples([sample], tokens, tokens)
    eligible = eligible_rows(batch, ttt_steps)
    targets = target_signals(
        batch.final_hidden_states,
        torch.randn(config.vocab_size, config.hidden_size),
        model.draft_to_target_ids(),
        model.t2d,
    )
    targets.in_draft[:] = True  # every row counts, as the plan's worst case
    weights = {tensor.untyped_storage().data_ptr() for tensor in (*model.parameters(), *model.buffers())}
    saved: dict[int, int] = {}

    def keep(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        states = model(
            batch.input_ids,
            batch.aux_hidden_states,
            ttt_steps,
            batch.position_ids,
            batch.document_ids,
            return_normed_states=True,
        )
        loss, _ = chunked_ttt_loss(model, states, targets, eligible, eligible.sum(dim=(1, 2)).float(), 0.8)
    loss.backward()  # the counted tensors really were what backward needed
    return sum(saved.values())


@pytest.mark.parametrize("tokens", [64, 200])
def test_dry_run_equals_what_autograd_keeps_on_the_cpu(tokens):
    assert activation_bytes(TINY, tokens, 3, attention="eager", dtype="fp32") == measured_saved_bytes(
        TINY, tokens, 3
    )


@pytest.mark.parametrize("attention", ["eager", "flex"])
def test_activation_curve_is_exact(attention):
    c0, c1, c2 = activation_bytes_curve(TINY, 4, attention, "bf16")
    assert (c2 > 0) == (attention == "eager")  # only the eager backend keeps (T x T) probabilities
    assert c0 + c1 * 1280 + c2 * 1280**2 == pytest.approx(
        activation_bytes(TINY, 1280, 4, attention, "bf16"), rel=1e-9
    )


def test_reference_plans_and_the_largest_pack_is_the_edge():
    llama = plan_training_memory(LLAMA_31_8B, gpu_memory_bytes=H200, pack_tokens=4096)
    assert (
        llama.fits
        and llama.trainable_parameters * 16 + llama.frozen_parameters * 4 == llama.model_state_bytes
    )
    assert llama.teacher_head_bytes == 128256 * 4096 * 4
    assert 0 < llama.activation_bytes_per_token and llama.teacher_bytes_per_token == 32000 * 4 + 9
    curve = activation_bytes_curve(draft_config_for_target(LLAMA_31_8B, 32000), 7)
    over = llama.largest_pack_tokens + 128
    over_bytes = (
        llama.model_state_bytes
        + llama.teacher_head_bytes
        + llama.transient_bytes
        + curve[0]
        + curve[1] * over
        + curve[2] * over**2
        + over * llama.teacher_bytes_per_token
    )
    assert llama.largest_pack_tokens % 128 == 0 and over_bytes > llama.usable_bytes
    assert plan_training_memory(
        LLAMA_31_8B, gpu_memory_bytes=H200, pack_tokens=llama.largest_pack_tokens
    ).fits
    # A smaller GPU fits a shorter pack; FSDP over 8 ranks holds an eighth of the draft's state.
    assert (
        plan_training_memory(LLAMA_31_8B, gpu_memory_bytes=80e9, pack_tokens=4096).largest_pack_tokens
        < llama.largest_pack_tokens
    )
    fsdp = plan_training_memory(
        LLAMA_31_8B, gpu_memory_bytes=H200, pack_tokens=4096, world_size=8, parallel="fsdp"
    )
    assert (
        fsdp.model_state_bytes == -(-llama.model_state_bytes // 8)
        and fsdp.largest_pack_tokens > llama.largest_pack_tokens
    )
    kimi = plan_training_memory(KIMI_K25, gpu_memory_bytes=H200, pack_tokens=4096, world_size=8)
    assert (
        kimi.fits and kimi.largest_pack_tokens < llama.largest_pack_tokens
    )  # wider draft, more bytes per token
    assert kimi.activation_bytes_per_token > llama.activation_bytes_per_token


def test_params_draft_shape_picks_the_public_kimi_draft_shape():
    """training.draft_shape reaches the draft config: Kimi-K2.5's 7168-wide, 64-head decoder gives head_dim
    112 when derived, 128 with the published draft's shape."""
    from eaglekit.training.memory import draft_config_for_target

    kimi_text = {
        "model_type": "deepseek_v3",
        "hidden_size": 7168,
        "num_hidden_layers": 61,
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "intermediate_size": 18432,
        "vocab_size": 163840,
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
    }
    wrapper = {"architectures": ["KimiK25ForConditionalGeneration"], "text_config": kimi_text}
    assert draft_config_for_target(wrapper, 32000, shape="auto").head_dim == 112
    public = draft_config_for_target(wrapper, 32000, shape="kimi_k25_public")
    assert (
        public.num_attention_heads,
        public.head_dim,
        public.num_key_value_heads,
        public.intermediate_size,
    ) == (64, 128, 64, 12288)
