"""Batches: samples side by side (right-padded), the rows each TTT step trains on, and the draft's input
noise.

Samples are dicts {"id", "dataset", "input_ids" (T,) int64, "loss_mask" (T,), "aux_hidden_states"
(T, 3H) bf16, "final_hidden_states" (T, H) bf16}, where final_hidden_states is the output of the
target's final norm (transformers' `output_hidden_states[-1]`), so target logits = final @ lm_head^T.
Packed batches (fixed token budgets, a document mask instead of padding) are eaglekit.training.packing's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch


@dataclass
class Batch:
    """Samples side by side (right-padded, `collate`) or packed into fixed token budgets
    (eaglekit.training.packing).

    input_ids/loss_mask (B, T); aux (B, T, 3H); final (B, T, H); lengths (B,) real tokens per row;
    position_ids (B, T) each sample's own positions from 0; document_ids (B, T) which sample a token
    belongs to (attention, token shifts and targets never cross a document boundary).
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    aux_hidden_states: torch.Tensor
    final_hidden_states: torch.Tensor
    lengths: torch.Tensor
    position_ids: torch.Tensor
    document_ids: torch.Tensor

    def to(self, device: torch.device) -> "Batch":
        return Batch(*(to_device(tensor, device) for tensor in dataclasses.astuple(self)))


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Host -> device without waiting for the GPU: a copy from pageable memory synchronizes the stream
    first, one from pinned memory does not, so CUDA copies go through pinned memory."""
    if torch.device(device).type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device, non_blocking=True)


def sample_length(sample: dict, max_length: int) -> int:
    """Tokens of a sample after the cut at max_length."""
    return min(int(sample["input_ids"].shape[0]), max_length)


def place_samples(samples: Sequence[dict], lengths: Sequence[int], places: Sequence[tuple[int, int]], rows: int,
                  length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, loss_mask, aux, final), (rows, length) and zero but where sample i, cut at lengths[i], lies
    from places[i] = (row, start): what `collate` (one sample a row) and a pack (end to end in one row)
    share."""
    first = samples[0]
    aux_width, hidden = first["aux_hidden_states"].shape[-1], first["final_hidden_states"].shape[-1]
    input_ids = torch.zeros(rows, length, dtype=torch.int64)
    loss_mask = torch.zeros(rows, length, dtype=torch.bool)
    aux = torch.zeros(rows, length, aux_width, dtype=first["aux_hidden_states"].dtype)
    final = torch.zeros(rows, length, hidden, dtype=first["final_hidden_states"].dtype)
    for sample, sample_length, (row, start) in zip(samples, lengths, places):
        if sample["aux_hidden_states"].shape[-1] != aux_width:
            raise ValueError(f"sample {sample['id']!r}: aux_hidden_states width {sample['aux_hidden_states'].shape[-1]} != {aux_width}")
        stop = start + sample_length
        input_ids[row, start:stop] = torch.as_tensor(sample["input_ids"][:sample_length])
        loss_mask[row, start:stop] = torch.as_tensor(sample["loss_mask"][:sample_length]).bool()
        aux[row, start:stop] = sample["aux_hidden_states"][:sample_length]
        final[row, start:stop] = sample["final_hidden_states"][:sample_length]
    return input_ids, loss_mask, aux, final


def collate(samples: Sequence[dict], max_length: int) -> Batch:
    """Pad samples on the right to the longest (cut at max_length). Padding rows are masked everywhere."""
    lengths = [sample_length(sample, max_length) for sample in samples]
    length = max(lengths)
    input_ids, loss_mask, aux, final = place_samples(samples, lengths, [(row, 0) for row in range(len(samples))], len(samples), length)
    positions = torch.arange(length).expand(len(samples), length)
    # One document per row: a padded row is the unpacked layout (padding is masked by loss_mask).
    return Batch(input_ids, loss_mask, aux, final, torch.tensor(lengths), positions, torch.zeros_like(input_ids))


def eligible_rows(batch: Batch, ttt_steps: int) -> torch.Tensor:
    """Which rows TTT step i trains on: the predicted token t+2+i exists in the same sample (document)
    and the target generated it.

    -> (ttt_steps, B, T) bool. Cheap (no target logits), so global counts are known before the forward.
    """
    length = batch.input_ids.shape[1]
    rows = []
    for step in range(ttt_steps):
        shift = 2 + step
        eligible = torch.zeros_like(batch.loss_mask)
        if shift < length:
            same_document = batch.document_ids[:, shift:] == batch.document_ids[:, : length - shift]
            eligible[:, : length - shift] = batch.loss_mask[:, shift:] & same_document
        rows.append(eligible)
    return torch.stack(rows)


def add_feature_noise(features: torch.Tensor, relative_std: float) -> torch.Tensor:
    """features (B, T, F) + uniform noise whose std is `relative_std` x each token's feature RMS.

    EAGLE trains on target features with uniform noise added, so the draft tolerates the feature error
    it meets at inference; a std relative to the RMS makes one setting mean the same for any target
    (hidden-state scales differ by orders of magnitude between models and layers). Uniform on
    [-sqrt(3) s, sqrt(3) s] has std s. Draws from torch's global RNG (seeded and checkpointed by
    `train_draft`, so a resumed run draws the same noise). Returns a new tensor of the input dtype.
    """
    if relative_std == 0:
        return features
    values = features.float()
    rms = values.pow(2).mean(-1, keepdim=True).sqrt()  # (B, T, 1)
    noise = (torch.rand(values.shape, device=values.device) * 2 - 1) * (math.sqrt(3) * relative_std)
    return (values + noise * rms).to(features.dtype)


def device_autocast(device: torch.device) -> AbstractContextManager:
    """bf16 autocast on GPU only: CPU autocast would change numerics the CPU tests pin down."""
    return torch.autocast(device_type="cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
