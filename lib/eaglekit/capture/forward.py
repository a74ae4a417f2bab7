"""The target's forward over batches of tokenized samples, keeping only the EAGLE-3 features.

Per token the draft needs the residual stream entering three target layers (concatenated to 3H)
and the target's final hidden state (H). We take them with forward pre-hooks on the three decoder
layers and the base model's `last_hidden_state`, so no other layer's output is kept and the
full-vocabulary lm_head is never run (stage 5 applies the target's lm_head itself). The final hidden
state is the output of the target's final norm: exactly what its lm_head consumes.

Samples are batched by a token budget over length-sorted buckets with right padding; causal
attention plus the attention mask keep each real token's features independent of the padding.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from eaglekit.capture.inputs import TokenizedSample
from eaglekit.capture.layers import LayerInputCapture, base_model_of
from eaglekit.capture.shards import CapturedSample


def plan_batches(lengths: Sequence[int], max_tokens_per_batch: int) -> list[list[int]]:
    """Group sample positions into batches of at most `max_tokens_per_batch` padded tokens.

    Samples are sorted longest first (ties by position) so each batch holds similar lengths and
    padding stays small; a sample longer than the budget gets a batch of its own. Deterministic:
    the same lengths give the same batches, which resume and data parallelism rely on.
    """
    if max_tokens_per_batch <= 0:
        raise ValueError(f"max_tokens_per_batch must be positive, got {max_tokens_per_batch}")
    order = sorted(range(len(lengths)), key=lambda position: (-lengths[position], position))
    batches: list[list[int]] = []
    current: list[int] = []
    for position in order:
        # Sorted longest first, so the batch's padded length is its first sample's length.
        padded_length = lengths[current[0]] if current else lengths[position]
        if current and (len(current) + 1) * padded_length > max_tokens_per_batch:
            batches.append(current)
            current = []
        current.append(position)
    if current:
        batches.append(current)
    return batches


def load_target(
    model_path: str | os.PathLike,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    device_map: str | dict | None = None,
    trust_remote_code: bool = False,
) -> nn.Module:
    """Load the target's text decoder for capture, through its layout: eval mode, no gradients.

    A multimodal wrapper (Kimi-K2.5) loads only its `language_model.*` tensors into the text model
    (`TargetLayout.load_text_model`), so `config` is the decoder's text config and the layers sit at
    `model.layers`. `device_map="auto"` spreads a large target over several GPUs (single process);
    otherwise the whole model goes to `device`. Use bf16 on GPU; float32 or bf16 on CPU. A target that
    does not fit one process is captured through a serving engine instead (`capture.engine`).
    """
    from eaglekit.target import target_layout

    layout = target_layout(model_path, trust_remote_code=trust_remote_code)
    model = layout.load_text_model(dtype=dtype, device_map=device_map)
    if device_map is None:
        model = model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model


@dataclass
class _LaunchedBatch:
    """A batch whose forward is queued and whose packed features are (maybe still) copying to the host."""

    samples: Sequence[TokenizedSample]
    lengths: list[int]
    aux_hidden_states: torch.Tensor  # (N, 3H) bf16, N = real tokens of the batch
    final_hidden_states: torch.Tensor  # (N, H) bf16
    copied: torch.cuda.Event | None


def _launch_batch(
    base_model: nn.Module, samples: Sequence[TokenizedSample], capture_layer_ids: Sequence[int], copy_streams: dict
) -> _LaunchedBatch:
    lengths = [len(sample.input_ids) for sample in samples]
    batch_size, padded_length = len(samples), max(lengths)
    input_ids = torch.zeros(batch_size, padded_length, dtype=torch.long)
    attention_mask = torch.zeros(batch_size, padded_length, dtype=torch.long)
    for row, sample in enumerate(samples):
        input_ids[row, : lengths[row]] = torch.tensor(sample.input_ids, dtype=torch.long)
        attention_mask[row, : lengths[row]] = 1
    # Flat positions of the real tokens in (B * T): padding is dropped on the device, before any copy.
    token_index = torch.cat([row * padded_length + torch.arange(length) for row, length in enumerate(lengths)])
    input_device = base_model.get_input_embeddings().weight.device
    # Right padding keeps every real token at positions 0..length-1, as when run alone.
    position_ids = torch.arange(padded_length, device=input_device).unsqueeze(0).expand(batch_size, -1)
    with torch.inference_mode(), LayerInputCapture(base_model, capture_layer_ids) as capture:
        outputs = base_model(
            input_ids=input_ids.to(input_device),
            # Decided on the host from the lengths: no mask when nothing is padded, and no device sync.
            attention_mask=attention_mask.to(input_device) if min(lengths) < padded_length else None,
            position_ids=position_ids,
            use_cache=False,
        )
        final_hidden_states = outputs.last_hidden_state  # (B, T, H)
        feature_device = final_hidden_states.device
        token_index = token_index.to(feature_device)

        def packed(hidden_states: torch.Tensor) -> torch.Tensor:  # (B, T, H) -> (N, H) bf16 on feature_device
            flat = hidden_states.to(feature_device).reshape(batch_size * padded_length, -1)
            return flat.index_select(0, token_index).to(torch.bfloat16)

        # With device_map over several GPUs the layers live on different devices: gather on the last one.
        aux_hidden_states = torch.cat([packed(capture.captured[layer_id]) for layer_id in capture_layer_ids], dim=-1)  # (N, 3H)
        final_packed = packed(final_hidden_states)  # (N, H)
        if feature_device.type != "cuda":
            return _LaunchedBatch(samples, lengths, aux_hidden_states, final_packed, None)
        # Copy to pinned host memory on a side stream, so the next batch's forward runs during the copy.
        copy_stream = copy_streams.setdefault(feature_device, torch.cuda.Stream(device=feature_device))
        copy_stream.wait_stream(torch.cuda.current_stream(feature_device))
        host_aux = torch.empty(aux_hidden_states.shape, dtype=torch.bfloat16, pin_memory=True)
        host_final = torch.empty(final_packed.shape, dtype=torch.bfloat16, pin_memory=True)
        with torch.cuda.stream(copy_stream):
            host_aux.copy_(aux_hidden_states, non_blocking=True)
            host_final.copy_(final_packed, non_blocking=True)
            # The device tensors must outlive the copy although this function drops them.
            aux_hidden_states.record_stream(copy_stream)
            final_packed.record_stream(copy_stream)
            copied = torch.cuda.Event()
            copied.record(copy_stream)
        return _LaunchedBatch(samples, lengths, host_aux, host_final, copied)


def _finish_batch(launched: _LaunchedBatch) -> list[CapturedSample]:
    if launched.copied is not None:
        launched.copied.synchronize()
    # Views into the batch's packed tensors: no per-sample copy (the shard writer concatenates anyway).
    aux_parts = launched.aux_hidden_states.split(launched.lengths)
    final_parts = launched.final_hidden_states.split(launched.lengths)
    return [CapturedSample.of(sample, aux, final)
            for sample, aux, final in zip(launched.samples, aux_parts, final_parts, strict=True)]


def capture_batches(
    model: nn.Module, batches: Iterable[Sequence[TokenizedSample]], capture_layer_ids: Sequence[int]
) -> Iterator[list[CapturedSample]]:
    """Capture batch after batch, yielding each batch's samples with features on CPU.

    Per batch: (B, T) ids, right-padded -> aux (T_i, 3H) from the three layer inputs and final (T_i, H)
    after the final norm, per sample, bf16. On GPU the next batch is queued before the previous one's
    features are taken off the device, so the copy to the host overlaps the forward.
    """
    base_model = base_model_of(model)
    copy_streams: dict = {}
    pending: _LaunchedBatch | None = None
    for samples in batches:
        launched = _launch_batch(base_model, samples, capture_layer_ids, copy_streams)
        if pending is not None:
            yield _finish_batch(pending)
        pending = launched
    if pending is not None:
        yield _finish_batch(pending)


def capture_batch(model: nn.Module, samples: Sequence[TokenizedSample], capture_layer_ids: Sequence[int]) -> list[CapturedSample]:
    """Capture one batch: each sample's aux (T, 3H) and final (T, H) features, bf16 on CPU."""
    (captured,) = capture_batches(model, [samples], capture_layer_ids)
    return captured


def as_training_sample(sample: CapturedSample) -> dict[str, Any]:
    """The dict stage 5 consumes, identical from shards and from online capture."""
    return {
        "id": sample.id,
        "dataset": sample.dataset,
        "input_ids": sample.input_ids.to(torch.long),  # (T,)
        "loss_mask": sample.loss_mask.to(torch.long),  # (T,)
        "aux_hidden_states": sample.aux_hidden_states,  # bf16 (T, 3H)
        "final_hidden_states": sample.final_hidden_states,  # bf16 (T, H)
    }


class FeatureSource(Protocol):
    """Whatever computes the features capture stores: the hooked transformers model here, or a serving
    engine (`capture.vllm_capture.VllmCapture`, `capture.sglang_capture`). Sizes are the text decoder's."""

    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    dtype_name: str  # the dtype the target computes in, recorded in capture_config.json

    def capture_batches(self, batches: Iterable[Sequence[TokenizedSample]],
                        capture_layer_ids: Sequence[int]) -> Iterator[list[CapturedSample]]: ...


@dataclass
class HookedTarget:
    """The transformers target as a FeatureSource: forward pre-hooks on the capture layers
    (`capture_batches`)."""

    model: nn.Module

    hidden_size = property(lambda self: int(self.model.config.hidden_size))
    num_hidden_layers = property(lambda self: int(self.model.config.num_hidden_layers))
    vocab_size = property(lambda self: int(self.model.config.vocab_size))
    dtype_name = property(lambda self: str(next(self.model.parameters()).dtype).removeprefix("torch."))

    def capture_batches(self, batches: Iterable[Sequence[TokenizedSample]],
                        capture_layer_ids: Sequence[int]) -> Iterator[list[CapturedSample]]:
        return capture_batches(self.model, batches, capture_layer_ids)


def as_feature_source(target: nn.Module | FeatureSource) -> FeatureSource:
    """A loaded transformers model becomes a HookedTarget; an engine is used as it is."""
    return HookedTarget(target) if isinstance(target, nn.Module) else target
