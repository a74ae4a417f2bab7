"""Online capture: the shard features computed on the fly, for when offline storage does not fit, and the one
interface (`CapturedSamples`) stages 5 and 6 read a finished capture through, whichever mode it ran in.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from eaglekit.capture.forward import as_training_sample, capture_batch
from eaglekit.capture.inputs import read_tokenized_samples
from eaglekit.capture.layers import resolve_capture_layer_ids
from eaglekit.capture.plan import read_capture_plan
from eaglekit.capture.shards import ShardDataset
from eaglekit.config import CaptureParams

DEFAULTS = CaptureParams()  # the params schema is the one source of defaults


class OnlineCaptureSamples(Sequence):
    """Random access to online features, one sample per target forward: what `train_draft` indexes.

    Training draws samples by index (nested subsets, epoch permutations), so online mode recomputes each
    requested sample's features on access.
    """

    def __init__(
        self, model: nn.Module, data_files: Mapping[str, str | os.PathLike], *, capture_layer_ids: Sequence[int] | None = None,
        max_seq_len: int = DEFAULTS.max_seq_len,
    ):
        num_hidden_layers = model.config.num_hidden_layers
        self.model = model
        self.capture_layer_ids = resolve_capture_layer_ids(capture_layer_ids, num_hidden_layers)
        self.samples, self.stats = read_tokenized_samples(data_files, model.config.vocab_size, max_seq_len)

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def keys(self) -> list[tuple[str, str]]:
        return [sample.key for sample in self.samples]

    def tokens(self, position: int) -> dict[str, Any]:
        """The sample without running the target: {"id", "dataset", "input_ids" (T,), "loss_mask" (T,)}."""
        sample = self.samples[position]
        return {"id": sample.id, "dataset": sample.dataset, "input_ids": torch.tensor(sample.input_ids, dtype=torch.long),
                "loss_mask": torch.tensor(sample.loss_mask, dtype=torch.long)}

    def __getitem__(self, position: int) -> dict[str, Any]:  # type: ignore[override]
        (captured,) = capture_batch(self.model, [self.samples[position]], self.capture_layer_ids)
        return as_training_sample(captured)


@runtime_checkable
class CapturedSamples(Protocol):
    """What stage 5 trains on and stage 6 scores, whether stage 4 stored shards or computes features online.

    `shards.ShardDataset` (offline) and `OnlineCaptureSamples` (online) both are one; `open_captured_samples`
    picks the one stage 4 planned, so callers never branch on the capture mode.
    """

    capture_layer_ids: list[int]

    def __len__(self) -> int: ...

    def __getitem__(self, position: int) -> dict[str, Any]:
        """{"id", "dataset", "input_ids" (T,), "loss_mask" (T,), "aux_hidden_states" bf16 (T, 3H),
        "final_hidden_states" bf16 (T, H)}."""

    @property
    def keys(self) -> list[tuple[str, str]]:
        """(dataset, id) of each position."""

    def tokens(self, position: int) -> dict[str, Any]:
        """The sample without its features (cheap in both modes): {"id", "dataset",
        "input_ids", "loss_mask"}."""



def open_captured_samples(
    capture_dir: str | os.PathLike,
    data_files: Mapping[str, str | os.PathLike],
    model: nn.Module | Callable[[], nn.Module],
    *,
    capture_layer_ids: Sequence[int] | None = None,
    max_seq_len: int = DEFAULTS.max_seq_len,
) -> CapturedSamples:
    """The samples of a finished stage 4, in the mode it planned (`capture/plan.json`).

    offline: the shards in `capture_dir`. online: `data_files` (dataset -> tokenized_data.jsonl) with the
    features recomputed per access by the target, with `capture_layer_ids` (None: EAGLE-3's defaults) and
    `max_seq_len` as stage 4 used them. `model`: the loaded target, or a loader called only in online mode
    (so an offline run never loads the target for this).
    """
    if read_capture_plan(capture_dir).mode == "offline":
        return ShardDataset(capture_dir)
    target = model if isinstance(model, nn.Module) else model()
    return OnlineCaptureSamples(target, data_files, capture_layer_ids=capture_layer_ids, max_seq_len=max_seq_len)
