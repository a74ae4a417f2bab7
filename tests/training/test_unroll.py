"""Activation checkpointing in the TTT unroll: the same states, loss and gradients as the plain unroll
(packed rows with document boundaries, every TTT step counted), a whole train_draft run alike, and the
memory plan's figure with checkpointing below the one without."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from eaglekit.draft.head_loss import chunked_ttt_loss
from eaglekit.training import (
    IndexedSubset,
    TrainSettings,
    eligible_rows,
    load_checkpoint,
    target_signals,
    train_draft,
)
from eaglekit.training.memory import activation_bytes, plan_training_memory
from eaglekit.training.packing import pack_samples
from eaglekit.training.unroll import CheckpointedDraft, checkpointed_unroll
from support import randomize_norms, samples_from_target, target_head, tiny_draft, tiny_target

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def target_and_samples():
    target = tiny_target()
    return target, samples_from_target(target, 8, seed=5)


def loss_and_gradients(module, draft, batch, targets, eligible, ttt_steps):
    draft.zero_grad(set_to_none=True)
    states = module(
        batch.input_ids,
        batch.aux_hidden_states.float(),
        ttt_steps,
        batch.position_ids,
        batch.document_ids,
        return_normed_states=True,
    )
    counts = eligible.sum(dim=(1, 2)).float()
    loss, _ = chunked_ttt_loss(draft, states, targets, eligible, counts, 0.8)
    loss.backward()
    return (
        loss.detach(),
        states,
        {
            name: parameter.grad.clone()
            for name, parameter in draft.named_parameters()
            if parameter.grad is not None
        },
    )


def test_checkpointed_unroll_equals_the_plain_one_in_loss_and_gradients(target_and_samples):
    target, samples = target_and_samples
    draft = tiny_draft(target, samples)
    randomize_norms(draft)
    draft.attention_backend = "eager"
    ttt_steps = 4
    batch = pack_samples(samples[:3], 128, 48)  # three documents in one row
    eligible = eligible_rows(batch, ttt_steps)
    targets = target_signals(
        batch.final_hidden_states, target_head(target).lm_head, draft.draft_to_target_ids(), draft.t2d
    )
    plain_loss, plain_states, plain_grads = loss_and_gradients(
        draft, draft, batch, targets, eligible, ttt_steps
    )
    checkpointed_loss, checkpointed_states, checkpointed_grads = loss_and_gradients(
        CheckpointedDraft(draft), draft, batch, targets, eligible, ttt_steps
    )
    assert (
        plain_grads.keys() == checkpointed_grads.keys()
        and "fc.weight" in plain_grads
        and "midlayer.mlp.up_proj.weight" in plain_grads
    )
    torch.testing.assert_close(checkpointed_loss, plain_loss, rtol=0, atol=1e-6)
    for plain, checkpointed in zip(plain_states, checkpointed_states):
        torch.testing.assert_close(checkpointed, plain, rtol=0, atol=1e-6)
    for name, gradient in plain_grads.items():
        torch.testing.assert_close(checkpointed_grads[name], gradient, rtol=0, atol=1e-6, msg=name)


def test_the_unroll_states_equal_the_drafts_own(target_and_samples):
    target, samples = target_and_samples
    draft = tiny_draft(target, samples)
    sample = samples[0]
    with torch.no_grad():
        plain = draft.unroll(sample["input_ids"][None], sample["aux_hidden_states"][None].float(), 3)
        checkpointed = checkpointed_unroll(
            draft, sample["input_ids"][None], sample["aux_hidden_states"][None].float(), 3
        )
    for one, two in zip(plain, checkpointed):
        torch.testing.assert_close(two, one, rtol=0, atol=0)


def test_train_draft_with_activation_checkpointing_is_the_same_run(target_and_samples, tmp_path):
    target, samples = target_and_samples
    train, heldout = IndexedSubset(samples, range(2, 8)), IndexedSubset(samples, range(2))
    settings = TrainSettings(
        ttt_steps=3,
        micro_batch_size=2,
        grad_accumulation_steps=1,
        max_steps=4,
        eval_interval=2,
        schedule="equal_steps",
        learning_rate=3e-3,
        warmup_steps=1,
        max_length=48,
        log_interval_s=60,
        pack_tokens=96,
    )
    results = {}
    for checkpointing in (False, True):
        results[checkpointing] = train_draft(
            tiny_draft(target, samples),
            target_head(target).lm_head,
            train,
            heldout,
            tmp_path / str(checkpointing),
            dataclasses.replace(settings, activation_checkpointing=checkpointing),
        )
    losses = {
        key: [
            record["loss"]
            for record in map(json.loads, (tmp_path / str(key) / "metrics.jsonl").read_text().splitlines())
            if record["split"] == "train"
        ]
        for key in results
    }
    assert losses[True] == pytest.approx(losses[False], rel=1e-5, abs=1e-6)
    one, two = (load_checkpoint(results[key].last_checkpoint)["model"] for key in (False, True))
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-4, atol=1e-6, msg=name)


def test_memory_with_checkpointing_holds_one_steps_activations():
    from eaglekit.draft.model import DraftConfig

    config = DraftConfig(
        hidden_size=64,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=300,
        draft_vocab_size=200,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
    )
    for attention in ("flex", "eager"):
        plain = activation_bytes(config, 512, 7, attention)
        checkpointed = activation_bytes(config, 512, 7, attention, checkpointing=True)
        assert checkpointed < plain / 2, (attention, plain, checkpointed)
    plan = plan_training_memory(config, gpu_memory_bytes=10e9, pack_tokens=512, activation_checkpointing=True)
    assert plan.activation_checkpointing and plan.activation_bytes_per_token * 512 == pytest.approx(
        activation_bytes(config, 512, 7, "flex", checkpointing=True), rel=1e-6
    )
