"""Packing: variable-length samples into fixed token budgets, with a document mask instead of padding.

A padded batch of samples of lengths 300 and 2,000 computes 4,000 rows for 2,300 tokens. A pack
lays samples end to end in one row of `pack_tokens` and records, per token, which sample
(`document_ids`) and which position inside it (`position_ids`) it is. The draft then keeps every
sample to itself (eaglekit.draft.model: attention is causal within a document, TTT token shifts stop at
the document's end, RoPE positions restart at 0), so each sample's logits, loss and gradient are
those of the sample alone, and the only waste is the tail of each pack.

Packs have a fixed length on purpose: every micro-batch has the same shape, so compiled kernels and
block masks are reused and memory use is known in advance (eaglekit.training.memory).

Assignment is first-fit decreasing over the samples of one optimizer step (deterministic: ties
break on position), so a step's loss is the same whatever the packing: the TTT loss is normalized by
the step's global counted rows, not per micro-batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from eaglekit.training.batch import Batch, place_samples, sample_length


def assign_packs(lengths: Sequence[int], pack_tokens: int) -> list[list[int]]:
    """First-fit decreasing: indices of `lengths` grouped so each group sums to <= pack_tokens.

    Longest first, each into the first pack with room, ties in index order; within a pack the
    samples keep their index order. Raises when one sample alone exceeds the budget.
    """
    too_long = [(index, length) for index, length in enumerate(lengths) if length > pack_tokens]
    if too_long:
        raise ValueError(f"samples longer than pack_tokens={pack_tokens}: {too_long[:3]} (index, tokens); "
                         f"set training.max_length <= training.pack_tokens so samples are cut to fit")
    packs: list[list[int]] = []
    room: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda position: (-lengths[position], position)):
        for pack, free in enumerate(room):
            if lengths[index] <= free:
                packs[pack].append(index)
                room[pack] -= lengths[index]
                break
        else:
            packs.append([index])
            room.append(pack_tokens - lengths[index])
    return [sorted(pack) for pack in packs]


def pack_samples(samples: Sequence[dict], pack_tokens: int, max_length: int) -> Batch:
    """Lay `samples` end to end in one row of exactly `pack_tokens` tokens -> Batch of shape (1, pack_tokens).

    Each sample is cut at max_length. The tail after the last sample is padding: loss_mask 0, a
    document of its own (so it attends only to itself), token 0, zero features.
    """
    if not samples:
        raise ValueError("pack_samples needs at least one sample (use empty_pack for a placeholder)")
    lengths = [sample_length(sample, max_length) for sample in samples]
    if sum(lengths) > pack_tokens:
        raise ValueError(f"{sum(lengths)} tokens do not fit a pack of {pack_tokens}; pack with assign_packs first")
    starts = [sum(lengths[:document]) for document in range(len(samples))]
    input_ids, loss_mask, aux, final = place_samples(samples, lengths, [(0, start) for start in starts], 1, pack_tokens)
    position_ids = torch.zeros(1, pack_tokens, dtype=torch.int64)
    document_ids = torch.full((1, pack_tokens), len(samples), dtype=torch.int64)  # the tail's own document
    for document, (start, length) in enumerate(zip(starts, lengths)):
        position_ids[0, start : start + length] = torch.arange(length)
        document_ids[0, start : start + length] = document
    start = sum(lengths)
    position_ids[0, start:] = torch.arange(pack_tokens - start)
    return Batch(input_ids, loss_mask, aux, final, torch.tensor([start]), position_ids, document_ids)


def empty_pack(like: Batch) -> Batch:
    """An all-padding pack shaped like `like`: no row counts. FSDP ranks with fewer packs than the
    others run these so every rank enters the same number of forwards (each is a collective)."""
    return Batch(
        torch.zeros_like(like.input_ids), torch.zeros_like(like.loss_mask), torch.zeros_like(like.aux_hidden_states),
        torch.zeros_like(like.final_hidden_states), torch.zeros_like(like.lengths),
        torch.arange(like.input_ids.shape[1]).expand_as(like.input_ids).clone(), torch.zeros_like(like.document_ids),
    )


def packed_micro_batches(samples: Sequence[dict], pack_tokens: int, max_length: int, fixed_length: bool = True) -> list[Batch]:
    """One optimizer step's samples (this rank's share) as packs of pack_tokens: one Batch (1, pack_tokens)
    each.

    fixed_length=False cuts each pack after its last sample, rounded up to a multiple of 64: the
    tail's rows are not computed. That pays in eager mode (CPU); compiled GPU kernels want one shape.
    """
    lengths = [sample_length(sample, max_length) for sample in samples]
    packs = []
    for pack in assign_packs(lengths, pack_tokens):
        used = sum(lengths[index] for index in pack)
        row_tokens = pack_tokens if fixed_length else min(pack_tokens, -(-used // 64) * 64)
        packs.append(pack_samples([samples[index] for index in pack], row_tokens, max_length))
    return packs


def padding_share(batches: Sequence[Batch]) -> float:
    """Share of rows in `batches` that hold no sample token: what padding or pack tails cost."""
    rows = sum(batch.input_ids.numel() for batch in batches)
    return 1.0 - sum(int(batch.lengths.sum()) for batch in batches) / max(rows, 1)
