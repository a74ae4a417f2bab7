"""The draft model: layer math as SGLang/vLLM compute it, TTT unroll == server-style KV-cache decoding,
RoPE positions at the logit level, draft vocab, target-based init."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from eaglekit.draft.model import (
    DraftConfig,
    DraftKVCache,
    load_target_head_weights,
    shift_left,
)
from eaglekit.draft.vocab import (
    count_generated_tokens,
    coverage_curve,
    default_draft_vocab_size,
    select_draft_vocab,
)

# shared test helpers, tests/support.py
from support import tiny_target, samples_from_target, tiny_draft, randomize_norms, serve_chain


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def target() -> LlamaForCausalLM:
    return tiny_target()


@pytest.fixture(scope="module")
def samples(target) -> list[dict]:
    return samples_from_target(target, 4)


def test_layer_matches_sglang_formula(target, samples):
    """Recompute the layer by hand the way SGLang's LlamaDecoderLayer + fused add-norm do."""
    model = tiny_draft(target, samples).eval()
    randomize_norms(model)
    sample = samples[0]
    input_ids = shift_left(sample["input_ids"][None], 1)
    hidden = model.project_features(sample["aux_hidden_states"][None].float())
    layer = model.midlayer
    with torch.no_grad():
        prenorm = model.step(input_ids, hidden, torch.arange(input_ids.shape[1])[None], DraftKVCache())
        # By hand: residual = h; attention on cat(input_layernorm(embed), hidden_norm(h)); add; norm; mlp;
        # add.
        embeds = model.embed_tokens(input_ids)
        attention_input = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], dim=-1)
        assert attention_input.shape[-1] == 2 * model.config.hidden_size
        cos, sin = model.rotary_emb(hidden, torch.arange(input_ids.shape[1])[None])
        residual = hidden + layer.self_attn(attention_input, cos, sin, DraftKVCache())
        expected = residual + layer.mlp(layer.post_attention_layernorm(residual))
        torch.testing.assert_close(prenorm, expected, rtol=0, atol=0)
        # The residual is h, not hidden_norm(h): using the normed state changes the output.
        wrong = layer.hidden_norm(hidden) + layer.self_attn(attention_input, cos, sin, DraftKVCache())
        wrong = wrong + layer.mlp(layer.post_attention_layernorm(wrong))
        assert (wrong - expected).abs().max() > 1e-2


def test_q_k_v_take_two_h_inputs(target, samples):
    model = tiny_draft(target, samples)
    hidden = model.config.hidden_size
    for name in ("q_proj", "k_proj", "v_proj"):
        assert getattr(model.midlayer.self_attn, name).weight.shape[1] == 2 * hidden
    assert model.fc.weight.shape == (hidden, 3 * hidden)
    assert model.lm_head.weight.shape == (200, hidden)


def test_training_unroll_equals_server_decoding(target, samples):
    """The heart of TTT: every TTT step's logits equal a KV-cache chain started at that row."""
    model = tiny_draft(target, samples).eval()
    randomize_norms(model)
    ttt_steps = 5
    sample = samples[1]
    input_ids, aux = sample["input_ids"], sample["aux_hidden_states"].float()
    with torch.no_grad():
        unrolled = model(input_ids[None], aux[None], ttt_steps)
        length = input_ids.shape[0]
        checked = 0
        for last_row in range(0, length - ttt_steps - 1):
            # Chain tokens: the same tokens the unroll fed at steps 1..k-1 (row t, step i: token t+1+i).
            chain_tokens = [int(input_ids[last_row + 1 + step]) for step in range(1, ttt_steps)]
            served = serve_chain(model, input_ids, aux, last_row, chain_tokens)
            for step in range(ttt_steps):
                torch.testing.assert_close(unrolled[step][0, last_row], served[step], rtol=1e-4, atol=1e-4)
                checked += 1
    assert checked >= 5 * ttt_steps


def test_off_by_one_decode_position_changes_logits(target, samples):
    """The older SGLang rule (+ j + 1) must not match training: the test above would catch it."""
    model = tiny_draft(target, samples).eval()
    randomize_norms(model)
    sample = samples[1]
    input_ids, aux = sample["input_ids"], sample["aux_hidden_states"].float()
    with torch.no_grad():
        unrolled = model(input_ids[None], aux[None], 3)
        chain_tokens = [int(input_ids[6 + step]) for step in range(1, 3)]
        served_old_rule = serve_chain(model, input_ids, aux, 5, chain_tokens, position_offset=1)
    torch.testing.assert_close(
        unrolled[0][0, 5], served_old_rule[0], rtol=1e-4, atol=1e-4
    )  # the extend row is unaffected
    assert (unrolled[1][0, 5] - served_old_rule[1]).abs().max() > 1e-3


def test_draft_vocab_mapping_and_coverage():
    counts = torch.tensor([5, 0, 9, 9, 1, 0, 3, 7])
    vocab = select_draft_vocab(counts, 4)
    assert vocab.draft_to_target.tolist() == [0, 2, 3, 7]  # the four most frequent, ascending
    assert vocab.d2t.dtype == torch.int64 and vocab.d2t.tolist() == [0, 1, 1, 4]
    assert (torch.arange(4) + vocab.d2t).tolist() == vocab.draft_to_target.tolist()
    assert vocab.t2d.dtype == torch.bool and vocab.t2d.tolist() == [
        True,
        False,
        True,
        True,
        False,
        False,
        False,
        True,
    ]
    assert vocab.coverage == pytest.approx(30 / 34)
    # Ties break on lower id; unseen tokens fill the rest in id order.
    assert select_draft_vocab(torch.tensor([0, 2, 2, 0, 0]), 3).draft_to_target.tolist() == [0, 1, 2]
    assert coverage_curve(counts, [1, 4, 8]) == {1: pytest.approx(9 / 34), 4: pytest.approx(30 / 34), 8: 1.0}
    assert default_draft_vocab_size(49_152) == 32_000 and default_draft_vocab_size(300) == 300
    with pytest.raises(ValueError, match="draft_vocab_size"):
        select_draft_vocab(counts, 9)


def test_vocab_counts_only_generated_tokens():
    samples = [
        {"id": "a", "input_ids": torch.tensor([1, 2, 3, 3]), "loss_mask": torch.tensor([0, 0, 1, 1])},
        {"id": "b", "input_ids": torch.tensor([4, 1]), "loss_mask": torch.tensor([1, 0])},
    ]
    assert count_generated_tokens(samples, 6).tolist() == [0, 0, 0, 2, 1, 0]
    with pytest.raises(ValueError, match="'a'.*vocab_size"):
        count_generated_tokens(samples, 3)


def test_init_from_target(target, samples):
    model = tiny_draft(target, samples)
    ids = model.draft_to_target_ids()
    assert torch.equal(model.lm_head.weight, target.lm_head.weight[ids])
    assert torch.equal(model.norm.weight, target.model.norm.weight)
    assert torch.equal(model.embed_tokens.weight, target.model.embed_tokens.weight)
    assert not model.embed_tokens.weight.requires_grad
    assert not any(name.startswith("embed_tokens") for name in model.trainable_state_dict())


def test_load_target_head_weights_from_folder(tmp_path, target):
    target.save_pretrained(tmp_path)
    weights = load_target_head_weights(tmp_path)
    assert torch.equal(weights.embed_tokens, target.model.embed_tokens.weight)
    assert torch.equal(weights.lm_head, target.lm_head.weight)  # tied: the embedding table
    assert torch.equal(weights.final_norm, target.model.norm.weight)
    assert DraftConfig.from_target_config(weights.config, 100).capture_layer_indices == (2, 3, 3)


def test_real_model_capture_indices_and_shapes(embedded_model_dir):
    weights = load_target_head_weights(embedded_model_dir)
    config = DraftConfig.from_target_config(
        weights.config, default_draft_vocab_size(weights.config.vocab_size)
    )
    assert config.capture_layer_indices == (2, 15, 27)
    assert (config.hidden_size, config.vocab_size, config.draft_vocab_size) == (576, 49_152, 32_000)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
