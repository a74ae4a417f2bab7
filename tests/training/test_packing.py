"""Packing and the chunked head loss: a packed row keeps each sample to itself (logits equal the sample
alone and equal serving-style decoding), packed and padded steps give the same loss and gradients, the
chunked loss equals the plain reference, and training with packs follows the padded run's curve."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from eaglekit.draft.model import TrainingTimeTestKeyValues
from eaglekit.draft.head_loss import chunked_ttt_loss
from eaglekit.training.packing import assign_packs, empty_pack, pack_samples, packed_micro_batches
from eaglekit.training import (
    TrainSettings,
    collate,
    eligible_rows,
    load_checkpoint,
    target_signals,
    train_draft,
    ttt_loss,
)
from support import randomize_norms, samples_from_target, serve_chain, tiny_draft, tiny_target

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TTT_STEPS = 4


@pytest.fixture(scope="module")
def world():
    target = tiny_target()
    samples = samples_from_target(target, 6, seed=5, min_length=9, max_length=30)
    model = tiny_draft(target, samples).eval()
    randomize_norms(model)
    return target, samples, model


def test_assign_packs_first_fit_decreasing():
    assert assign_packs([5, 9, 3, 7, 2], 10) == [[1], [2, 3], [0, 4]]  # longest first: 9 | 7+3 | 5+2
    packs = assign_packs([4, 4, 4, 4, 4, 4, 4], 10)
    assert sorted(index for pack in packs for index in pack) == list(range(7)) and len(packs) == 4
    with pytest.raises(ValueError, match="max_length <= training.pack_tokens"):
        assign_packs([3, 11], 10)


def test_pack_layout(world):
    _, samples, _ = world
    lengths = [len(sample["input_ids"]) for sample in samples[:3]]
    batch = pack_samples(samples[:3], 100, max_length=64)
    assert batch.input_ids.shape == (1, 100) and int(batch.lengths) == sum(lengths)
    start = 0
    for document, (sample, length) in enumerate(zip(samples[:3], lengths)):
        assert torch.equal(batch.input_ids[0, start : start + length], sample["input_ids"])
        assert batch.position_ids[0, start : start + length].tolist() == list(range(length))
        assert (batch.document_ids[0, start : start + length] == document).all()
        start += length
    assert (
        not batch.loss_mask[0, start:].any() and (batch.document_ids[0, start:] == 3).all()
    )  # the tail: its own document
    # Cutting at max_length: a sample counts only its first max_length tokens.
    assert int(pack_samples(samples[:1], 100, max_length=5).lengths) == 5
    with pytest.raises(ValueError, match="do not fit"):
        pack_samples(samples[:3], sum(lengths) - 1, max_length=64)


def test_eligible_rows_stop_at_document_end(world):
    _, samples, _ = world
    batch = pack_samples(samples[:2], 80, max_length=64)
    first = len(samples[0]["input_ids"])
    eligible = eligible_rows(batch, TTT_STEPS)
    for step in range(TTT_STEPS):
        # Row t of step i predicts token t+2+i: the last rows of document 0 would predict document 1's tokens.
        assert not eligible[step, 0, first - 2 - step : first].any()
        alone = eligible_rows(collate(samples[:1], 64), TTT_STEPS)[step, 0]
        assert torch.equal(eligible[step, 0, :first], alone)


def test_packed_unroll_equals_each_sample_alone_and_serving(world):
    """Each packed document's logits equal the sample unrolled alone, and a served KV-cache chain."""
    _, samples, model = world
    batch = pack_samples(samples[:3], 96, max_length=64)
    with torch.no_grad():
        packed = model(
            batch.input_ids,
            batch.aux_hidden_states.float(),
            TTT_STEPS,
            batch.position_ids,
            batch.document_ids,
        )
        start = 0
        for sample in samples[:3]:
            length = len(sample["input_ids"])
            alone = model(sample["input_ids"][None], sample["aux_hidden_states"][None].float(), TTT_STEPS)
            for step in range(TTT_STEPS):
                torch.testing.assert_close(
                    packed[step][0, start : start + length], alone[step][0], rtol=1e-4, atol=1e-4
                )
            input_ids, aux = sample["input_ids"], sample["aux_hidden_states"].float()
            for last_row in (0, length // 2, length - TTT_STEPS - 2):
                chain_tokens = [int(input_ids[last_row + 1 + step]) for step in range(1, TTT_STEPS)]
                served = serve_chain(model, input_ids, aux, last_row, chain_tokens)
                for step in range(TTT_STEPS):
                    torch.testing.assert_close(
                        packed[step][0, start + last_row], served[step], rtol=1e-4, atol=1e-4
                    )
            start += length


def test_without_document_mask_packing_would_leak(world):
    """The check above can fail: the same pack without document ids lets sample 2 see sample 1."""
    _, samples, model = world
    batch = pack_samples(samples[:2], 80, max_length=64)
    first = len(samples[0]["input_ids"])
    with torch.no_grad():
        masked = model(
            batch.input_ids, batch.aux_hidden_states.float(), 2, batch.position_ids, batch.document_ids
        )
        leaked = model(batch.input_ids, batch.aux_hidden_states.float(), 2, batch.position_ids, None)
    assert (masked[0][0, first + 3] - leaked[0][0, first + 3]).abs().max() > 1e-3


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attention_mask_equals_eager(world):
    """The flex backend's block mask (forward, eager flex on CPU) sees exactly what the eager TTT attention
    sees."""
    _, samples, _ = world
    batch = pack_samples(samples[:3], 96, max_length=64)
    generator = torch.Generator().manual_seed(0)
    eager, flex = (
        TrainingTimeTestKeyValues(batch.document_ids, "eager"),
        TrainingTimeTestKeyValues(batch.document_ids, "flex"),
    )
    with torch.no_grad():
        for _ in range(3):
            query = torch.randn(1, 4, 96, 16, generator=generator)
            key, value = (
                torch.randn(1, 2, 96, 16, generator=generator),
                torch.randn(1, 2, 96, 16, generator=generator),
            )
            torch.testing.assert_close(
                flex.attend(query, key, value, 0.25),
                eager.attend(query, key, value, 0.25),
                rtol=1e-4,
                atol=1e-5,
            )


def _loss_and_grads(model, batches, loss_fn, target, lengths: bool = False):
    """Sum of a step's micro-batch losses and the parameter gradients, with global counts as training uses."""
    head = target.lm_head.weight.detach()
    eligible = [eligible_rows(batch, TTT_STEPS) for batch in batches]
    counts = torch.stack([rows.sum(dim=(1, 2)) for rows in eligible]).sum(0).float()
    model.zero_grad(set_to_none=True)
    total, stats = torch.zeros(()), torch.zeros(TTT_STEPS, 4, dtype=torch.float64)
    for batch, rows in zip(batches, eligible):
        targets = target_signals(
            batch.final_hidden_states,
            head,
            model.draft_to_target_ids(),
            model.t2d,
            chunk_rows=7,
            lengths=batch.lengths.tolist() if lengths else None,
        )
        loss, micro_stats = loss_fn(batch, targets, rows, counts)
        loss.backward()
        total, stats = total + loss.detach(), stats + micro_stats
    grads = {
        name: parameter.grad.clone()
        for name, parameter in model.named_parameters()
        if parameter.grad is not None
    }
    return total, stats, grads


def reference_loss(model):
    def loss_fn(batch, targets, rows, counts):
        logits = model(
            batch.input_ids, batch.aux_hidden_states, TTT_STEPS, batch.position_ids, batch.document_ids
        )
        return ttt_loss(logits, targets, rows, counts, 0.8, model.draft_to_target_ids())

    return loss_fn


def chunked_loss(model, chunk_rows):
    def loss_fn(batch, targets, rows, counts):
        states = model(
            batch.input_ids,
            batch.aux_hidden_states,
            TTT_STEPS,
            batch.position_ids,
            batch.document_ids,
            return_normed_states=True,
        )
        return chunked_ttt_loss(model, states, targets, rows, counts, 0.8, chunk_rows=chunk_rows)

    return loss_fn


def _assert_same(first, second, rtol=1e-5, atol=1e-6):
    (loss_a, stats_a, grads_a), (loss_b, stats_b, grads_b) = first, second
    torch.testing.assert_close(loss_a, loss_b, rtol=rtol, atol=atol)
    torch.testing.assert_close(stats_a[:, 1:], stats_b[:, 1:])  # counted, correct, eligible rows: exact
    torch.testing.assert_close(stats_a[:, 0], stats_b[:, 0], rtol=1e-5, atol=1e-4)
    assert grads_a.keys() == grads_b.keys() and "lm_head.weight" in grads_a and "fc.weight" in grads_a
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-4, atol=1e-6, msg=name)


def test_chunked_loss_equals_reference_on_padded_batches(world):
    target, samples, model = world
    model.train()
    batches = [collate(samples[:3], 64), collate(samples[3:], 64)]
    reference = _loss_and_grads(model, batches, reference_loss(model), target)
    assert reference[0] > 0 and reference[1][:, 1].min() > 0
    for chunk_rows in (5, 4096):  # many chunks, and one
        _assert_same(_loss_and_grads(model, batches, chunked_loss(model, chunk_rows), target), reference)


def test_packing_gives_the_same_loss_and_gradients_as_padding(world):
    """One step over six samples: padded micro-batches with the reference loss vs packs with the chunked
    loss."""
    target, samples, model = world
    model.train()
    padded = _loss_and_grads(
        model, [collate(samples[:3], 64), collate(samples[3:], 64)], reference_loss(model), target
    )
    packs = packed_micro_batches(samples, 64, 64)
    assert len(packs) >= 2 and sum(int(pack.lengths.sum()) for pack in packs) == sum(
        len(sample["input_ids"]) for sample in samples
    )
    _assert_same(_loss_and_grads(model, packs, chunked_loss(model, 16), target), padded)
    # Packs cut after their last sample (the CPU layout) and a teacher computed on real tokens only: the same.
    trimmed = packed_micro_batches(samples, 64, 64, fixed_length=False)
    assert all(pack.input_ids.shape[1] % 64 == 0 for pack in trimmed)
    _assert_same(_loss_and_grads(model, trimmed, chunked_loss(model, 16), target, lengths=True), padded)
    # An empty pack (FSDP's placeholder) counts nothing and adds no gradient.
    empty = _loss_and_grads(model, [empty_pack(packs[0])], chunked_loss(model, 16), target)
    assert float(empty[0]) == 0.0 and all(float(grad.abs().sum()) == 0.0 for grad in empty[2].values())


def test_training_with_packs_follows_the_padded_curve(tmp_path):
    target = tiny_target()
    samples = samples_from_target(target, 12, seed=3)
    train, heldout = samples[:9], samples[9:]
    settings = TrainSettings(
        ttt_steps=3,
        learning_rate=3e-3,
        min_learning_rate=3e-4,
        warmup_steps=1,
        schedule="equal_steps",
        max_steps=3,
        micro_batch_size=3,
        grad_accumulation_steps=1,
        eval_interval=3,
        max_length=48,
    )
    padded = train_draft(
        tiny_draft(target, train),
        target.lm_head.weight.detach(),
        train,
        heldout,
        tmp_path / "padded",
        settings,
    )
    packed = train_draft(
        tiny_draft(target, train),
        target.lm_head.weight.detach(),
        train,
        heldout,
        tmp_path / "packed",
        dataclasses.replace(settings, pack_tokens=64),
    )
    read = lambda result: [
        record
        for record in map(eval_json, result.metrics_path.read_text().splitlines())
        if record["split"] == "train"
    ]
    for a, b in zip(read(padded), read(packed), strict=True):
        assert (
            b["loss"] == pytest.approx(a["loss"], rel=1e-5)
            and b["counted_rows_by_position"] == a["counted_rows_by_position"]
        )
    padded_state, packed_state = (
        load_checkpoint(padded.last_checkpoint)["model"],
        load_checkpoint(packed.last_checkpoint)["model"],
    )
    for name in padded_state:
        # Adam turns float-rounding gradient differences into updates of up to ~lr * 1e-3; each step moves
        # weights by ~lr.
        torch.testing.assert_close(packed_state[name], padded_state[name], rtol=1e-4, atol=2e-5, msg=name)


def eval_json(line: str) -> dict:
    import json

    return json.loads(line)


@pytest.mark.gpu
def test_flex_backend_on_cuda_equals_eager_forward_and_backward(world):
    """The compiled flex kernel (CUDA) against the eager TTT attention: logits and gradients, fp32."""
    target, samples, model = world
    model = tiny_draft(target, samples).cuda().train()
    batch = pack_samples(samples[:4], 256, max_length=64).to(torch.device("cuda"))
    results = {}
    for backend in ("eager", "flex"):
        model.attention_backend = backend
        model.zero_grad(set_to_none=True)
        logits = model(
            batch.input_ids,
            batch.aux_hidden_states.float(),
            TTT_STEPS,
            batch.position_ids,
            batch.document_ids,
        )
        sum(step.float().square().mean() for step in logits).backward()
        results[backend] = (
            [step.detach() for step in logits],
            {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None},
        )
    for eager, flex in zip(results["eager"][0], results["flex"][0]):
        torch.testing.assert_close(flex, eager, rtol=2e-3, atol=2e-3)
    for name, grad in results["eager"][1].items():
        torch.testing.assert_close(results["flex"][1][name], grad, rtol=2e-2, atol=1e-4, msg=name)


@pytest.mark.gpu
def test_packed_micro_batch_makes_no_host_sync_on_cuda(world):
    """Forward, chunked loss and backward of a packed micro-batch under CUDA's sync debug mode "error"."""
    target, samples, _ = world
    device = torch.device("cuda")
    model = tiny_draft(target, samples).to(device).train()
    head = target.lm_head.weight.detach().float().to(device)
    batch = pack_samples(samples[:4], 256, max_length=64)
    eligible = eligible_rows(batch, TTT_STEPS)
    counts = eligible.sum(dim=(1, 2)).float().to(device)
    for checked in (False, True):  # the first pass compiles the flex kernel and warms the allocator
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if checked else "default")
        try:
            on_device = batch.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                targets = target_signals(
                    on_device.final_hidden_states, head, model.draft_to_target_ids(), model.t2d
                )
                states = model(
                    on_device.input_ids,
                    on_device.aux_hidden_states,
                    TTT_STEPS,
                    on_device.position_ids,
                    on_device.document_ids,
                    return_normed_states=True,
                )
                loss, _ = chunked_ttt_loss(model, states, targets, eligible, counts, 0.8)
            loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss)
