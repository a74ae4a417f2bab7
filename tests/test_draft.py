"""The draft model: layer math as SGLang/vLLM compute it, TTT unroll == server-style KV-cache decoding,
RoPE positions at the logit level, draft vocab, target-based init."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eaglekit.capture import default_capture_layer_ids
from eaglekit.draft import (
    DraftConfig,
    DraftKVCache,
    Eagle3DraftModel,
    TargetHeadWeights,
    build_draft_from_target,
    load_target_head_weights,
    shift_left,
)
from eaglekit.vocab import count_generated_tokens, coverage_curve, default_draft_vocab_size, select_draft_vocab

TINY_TARGET = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=300, max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=True,
)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny_target(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**TINY_TARGET)).eval()


@torch.no_grad()
def samples_from_target(target: LlamaForCausalLM, count: int, seed: int = 0, datasets: tuple[str, ...] = ("alpha", "beta"),
                        min_length: int = 12, max_length: int = 40) -> list[dict]:
    """Training samples exactly as stage 4 yields them, from a real (tiny) target's hidden states.

    Tokens come from greedy continuation of a random prompt, so the "generated" part is the target's
    own argmax (loss_mask 1 there), as regenerated data is.
    """
    generator = torch.Generator().manual_seed(seed)
    capture = tuple(default_capture_layer_ids(target.config.num_hidden_layers))
    samples = []
    for index in range(count):
        prompt_length = int(torch.randint(3, 8, (1,), generator=generator))
        total_length = int(torch.randint(min_length, max_length + 1, (1,), generator=generator))
        prompt = torch.randint(0, target.config.vocab_size, (1, prompt_length), generator=generator)
        input_ids = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=total_length - prompt_length,
                                    min_new_tokens=total_length - prompt_length, do_sample=False, pad_token_id=0)[0]
        outputs = target(input_ids[None], output_hidden_states=True)
        aux = torch.cat([outputs.hidden_states[i][0] for i in capture], dim=-1)
        loss_mask = torch.zeros_like(input_ids)
        loss_mask[prompt_length:] = 1
        samples.append({
            "id": f"sample-{seed}-{index}",
            "dataset": datasets[index % len(datasets)],
            "input_ids": input_ids,
            "loss_mask": loss_mask,
            "aux_hidden_states": aux.to(torch.bfloat16),
            "final_hidden_states": outputs.hidden_states[-1][0].to(torch.bfloat16),
        })
    return samples


def target_head(target: LlamaForCausalLM) -> TargetHeadWeights:
    return TargetHeadWeights(embed_tokens=target.model.embed_tokens.weight.detach().clone(), lm_head=target.lm_head.weight.detach().clone(),
                             final_norm=target.model.norm.weight.detach().clone(), config=target.config)


def tiny_draft(target: LlamaForCausalLM, samples: list[dict], draft_vocab_size: int = 200, seed: int = 0) -> Eagle3DraftModel:
    vocab = select_draft_vocab(count_generated_tokens(samples, target.config.vocab_size), draft_vocab_size)
    return build_draft_from_target(target_head(target), vocab.d2t, vocab.t2d, seed=seed)


@pytest.fixture(scope="module")
def target() -> LlamaForCausalLM:
    return tiny_target()


@pytest.fixture(scope="module")
def samples(target) -> list[dict]:
    return samples_from_target(target, 4)


def randomize_norms(model: Eagle3DraftModel, seed: int = 1) -> None:
    """Norm weights start at one; make them distinct so a swapped norm shows in the outputs."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in (model.midlayer.input_layernorm, model.midlayer.hidden_norm, model.midlayer.post_attention_layernorm, model.norm):
            module.weight.copy_(1.0 + 0.5 * torch.randn(module.weight.shape, generator=generator))


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
        # By hand: residual = h; attention on cat(input_layernorm(embed), hidden_norm(h)); add; norm; mlp; add.
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


def serve_chain(model: Eagle3DraftModel, input_ids: torch.Tensor, aux: torch.Tensor, last_row: int, chain_tokens: list[int],
                position_offset: int = 0) -> list[torch.Tensor]:
    """How a server drafts after accepting up to row `last_row`: extend rows 0..last_row, then decode
    one token per step with a KV cache, feeding back the pre-norm state. Returns logits per step (V_d,)."""
    cache = DraftKVCache()
    rows = last_row + 1
    logits, prenorm = model.extend(shift_left(input_ids[None], 1)[:, :rows], aux[None, :rows], 0, cache)
    out = [logits[0, -1]]
    hidden = prenorm[:, -1:]
    for step, token in enumerate(chain_tokens, start=1):
        logits, hidden = model.decode(torch.tensor([[token]]), hidden, last_row + step + position_offset, cache)
        out.append(logits[0, 0])
    return out


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
    torch.testing.assert_close(unrolled[0][0, 5], served_old_rule[0], rtol=1e-4, atol=1e-4)  # the extend row is unaffected
    assert (unrolled[1][0, 5] - served_old_rule[1]).abs().max() > 1e-3


def test_draft_vocab_mapping_and_coverage():
    counts = torch.tensor([5, 0, 9, 9, 1, 0, 3, 7])
    vocab = select_draft_vocab(counts, 4)
    assert vocab.draft_to_target.tolist() == [0, 2, 3, 7]  # the four most frequent, ascending
    assert vocab.d2t.dtype == torch.int64 and vocab.d2t.tolist() == [0, 1, 1, 4]
    assert (torch.arange(4) + vocab.d2t).tolist() == vocab.draft_to_target.tolist()
    assert vocab.t2d.dtype == torch.bool and vocab.t2d.tolist() == [True, False, True, True, False, False, False, True]
    assert vocab.coverage == pytest.approx(30 / 34)
    # Ties break on lower id; unseen tokens fill the rest in id order.
    assert select_draft_vocab(torch.tensor([0, 2, 2, 0, 0]), 3).draft_to_target.tolist() == [0, 1, 2]
    assert coverage_curve(counts, [1, 4, 8]) == {1: pytest.approx(9 / 34), 4: pytest.approx(30 / 34), 8: 1.0}
    assert default_draft_vocab_size(49_152) == 32_000 and default_draft_vocab_size(300) == 300
    with pytest.raises(ValueError, match="draft_vocab_size"):
        select_draft_vocab(counts, 9)


def test_vocab_counts_only_generated_tokens():
    samples = [{"id": "a", "input_ids": torch.tensor([1, 2, 3, 3]), "loss_mask": torch.tensor([0, 0, 1, 1])},
               {"id": "b", "input_ids": torch.tensor([4, 1]), "loss_mask": torch.tensor([1, 0])}]
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
    config = DraftConfig.from_target_config(weights.config, default_draft_vocab_size(weights.config.vocab_size))
    assert config.capture_layer_indices == (2, 15, 27)
    assert (config.hidden_size, config.vocab_size, config.draft_vocab_size) == (576, 49_152, 32_000)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
