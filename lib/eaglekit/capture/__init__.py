"""Stage 4: run the target over tokenized data and capture the EAGLE-3 features.

Per token the draft needs the residual stream entering three target layers (concatenated to 3H)
and the target's final hidden state (H). We take them with forward pre-hooks on the three decoder
layers and the base model's `last_hidden_state`, so no other layer's output is kept and the
full-vocabulary lm_head is never run (stage 5 applies the target's lm_head itself).

Layer ids are indices into transformers' `output_hidden_states` tuple (0 = embeddings, i = output
of layer i-1 = input of layer i), the convention SGLang's `[2, N//2, N-3]` uses. The final hidden
state is the output of the target's final norm: exactly what its lm_head consumes.

Samples are batched by a token budget over length-sorted buckets with right padding; causal
attention plus the attention mask keep each real token's features independent of the padding.

Entry points: `plan_capture_storage` (bytes vs free disk: offline or online), `capture_to_shards`
(offline, resumable, data parallel under torchrun), `OnlineCaptureDataset`/`OnlineCaptureSamples`
(the same features on the fly, streamed or by index), `open_captured_samples` (a finished capture in
either mode behind one interface, `CapturedSamples`), and `python -m eaglekit.capture` (CLI).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as distributed
from torch import nn

from eaglekit.io import InputError, read_jsonl, write_jsonl
from eaglekit.capture.shards import (
    FINAL_HIDDEN_STATE_NOTE,
    CapturedSample,
    ShardWriter,
    completed_sample_keys,
    stored_bytes_per_token,
    write_config_once,
    write_merged_index,
)

logger = logging.getLogger(__name__)

DEFAULT_MAX_SHARD_BYTES = 256 * 1024 * 1024


# ---------------------------------------------------------------------------------------------
# Layers


def default_capture_layer_ids(num_hidden_layers: int) -> list[int]:
    """SGLang's EAGLE-3 layers for an N-layer target: [2, N//2, N-3] (SmolLM2-135M, N=30: [2, 15, 27])."""
    return [2, num_hidden_layers // 2, num_hidden_layers - 3]


def validate_capture_layer_ids(layer_ids: Sequence[int], num_hidden_layers: int) -> list[int]:
    """Check layer ids against the target: three distinct `output_hidden_states` indices in [0, N-1].

    Index N is not allowed: in transformers it is the output after the final norm, not a residual
    stream entering a layer, and it is stored anyway as the final hidden state.
    """
    layer_ids = [int(layer_id) for layer_id in layer_ids]
    if len(layer_ids) != 3:
        raise ValueError(f"EAGLE-3 captures exactly 3 layers, got {layer_ids}; the default is {default_capture_layer_ids(num_hidden_layers)}")
    if len(set(layer_ids)) != 3:
        raise ValueError(f"capture layer ids must be distinct, got {layer_ids}")
    out_of_range = [layer_id for layer_id in layer_ids if not 0 <= layer_id < num_hidden_layers]
    if out_of_range:
        raise ValueError(
            f"capture layer ids {out_of_range} are outside [0, {num_hidden_layers - 1}] for a {num_hidden_layers}-layer target "
            f"(ids index output_hidden_states: i = the residual entering layer i); the default is {default_capture_layer_ids(num_hidden_layers)}"
        )
    return layer_ids


def base_model_of(model: nn.Module) -> nn.Module:
    """The decoder stack under a *ForCausalLM (or the model itself): has `layers` and returns `last_hidden_state`."""
    base = getattr(model, getattr(model, "base_model_prefix", "model"), model)
    if not hasattr(base, "layers"):
        raise TypeError(
            f"{type(model).__name__} has no decoder `layers` list under `.{getattr(model, 'base_model_prefix', 'model')}`; "
            "capture supports Llama-style decoders (Llama, Qwen, Mistral, DeepSeek, SmolLM)"
        )
    return base


class LayerInputCapture:
    """Forward pre-hooks that keep the hidden states entering chosen decoder layers.

    Use as a context manager around one forward; `captured[layer_id]` is (B, T, H) on that layer's device.
    """

    def __init__(self, base_model: nn.Module, layer_ids: Sequence[int]):
        self.base_model = base_model
        self.layer_ids = list(layer_ids)
        self.captured: dict[int, torch.Tensor] = {}
        self._handles: list[Any] = []

    def _hook_for(self, layer_id: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            self.captured[layer_id] = args[0] if args else kwargs["hidden_states"]
        return hook

    def __enter__(self) -> "LayerInputCapture":
        self.captured = {}
        for layer_id in self.layer_ids:
            layer = self.base_model.layers[layer_id]
            self._handles.append(layer.register_forward_pre_hook(self._hook_for(layer_id), with_kwargs=True))
        return self

    def __exit__(self, *exc_info: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


# ---------------------------------------------------------------------------------------------
# Input


@dataclass
class TokenizedSample:
    """One line of a `tokenized_data.jsonl`, validated and truncated to the maximum sequence length."""

    id: str
    dataset: str
    input_ids: list[int]
    loss_mask: list[int]
    path: str
    line: int
    original_length: int

    @property
    def key(self) -> tuple[str, str]:
        return (self.dataset, self.id)


@dataclass
class DatasetStats:
    samples: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    truncated_samples: int = 0
    truncated_tokens: int = 0
    samples_without_loss_tokens: int = 0


def _validate_record(record: Any, path: Path, line: int, vocab_size: int) -> tuple[str, list[int], list[int]]:
    if not isinstance(record, dict):
        raise InputError(path, line, None, f"expected a JSON object, got {type(record).__name__}")
    sample_id = record.get("id")
    if not isinstance(sample_id, str) or not sample_id:
        raise InputError(path, line, "id", f"missing or not a non-empty string: {sample_id!r}")
    input_ids = record.get("input_ids")
    loss_mask = record.get("loss_mask")
    if not isinstance(input_ids, list):
        raise InputError(path, line, "input_ids", f"sample {sample_id!r}: expected a list of token ids, got {type(input_ids).__name__}")
    if not input_ids:
        raise InputError(path, line, "input_ids", f"sample {sample_id!r}: empty sample (no tokens); drop it in stage 2")
    if not isinstance(loss_mask, list):
        raise InputError(path, line, "loss_mask", f"sample {sample_id!r}: expected a list of 0/1, got {type(loss_mask).__name__}")
    if len(loss_mask) != len(input_ids):
        raise InputError(path, line, "loss_mask", f"sample {sample_id!r}: length {len(loss_mask)} != input_ids length {len(input_ids)}")
    for position, token_id in enumerate(input_ids):
        if type(token_id) is not int or not 0 <= token_id < vocab_size:
            raise InputError(
                path, line, "input_ids",
                f"sample {sample_id!r}: token {token_id!r} at position {position} is not an id in [0, {vocab_size}) "
                "of the target's vocabulary; was it tokenized with another tokenizer?",
            )
    for position, value in enumerate(loss_mask):
        if type(value) is not int or value not in (0, 1):
            raise InputError(path, line, "loss_mask", f"sample {sample_id!r}: value {value!r} at position {position} is not 0 or 1")
    return sample_id, input_ids, loss_mask


def read_tokenized_samples(
    data_files: Mapping[str, str | os.PathLike],
    vocab_size: int,
    max_seq_len: int,
) -> tuple[list[TokenizedSample], dict[str, DatasetStats]]:
    """Read and validate `tokenized_data.jsonl` files ({dataset name: path}); truncate to `max_seq_len`.

    Returns the samples in file order and per-dataset counts (truncated samples and dropped tokens
    included). Bad lines raise `InputError` naming the file, line, field and sample id.
    """
    if max_seq_len <= 0:
        raise ValueError(f"max_seq_len must be positive, got {max_seq_len}")
    samples: list[TokenizedSample] = []
    stats: dict[str, DatasetStats] = {}
    for dataset, path in data_files.items():
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"tokenized data for dataset {dataset!r} not found: {path} (run stages 2-3 first)")
        dataset_stats = stats.setdefault(dataset, DatasetStats())
        first_line_of_id: dict[str, int] = {}
        for line, record in read_jsonl(path):
            sample_id, input_ids, loss_mask = _validate_record(record, path, line, vocab_size)
            if sample_id in first_line_of_id:
                raise InputError(path, line, "id", f"sample {sample_id!r} already appears at line {first_line_of_id[sample_id]}; ids must be unique")
            first_line_of_id[sample_id] = line
            original_length = len(input_ids)
            if original_length > max_seq_len:
                dataset_stats.truncated_samples += 1
                dataset_stats.truncated_tokens += original_length - max_seq_len
                input_ids, loss_mask = input_ids[:max_seq_len], loss_mask[:max_seq_len]
            dataset_stats.samples += 1
            dataset_stats.tokens += len(input_ids)
            loss_tokens = sum(loss_mask)
            dataset_stats.loss_tokens += loss_tokens
            dataset_stats.samples_without_loss_tokens += loss_tokens == 0
            samples.append(TokenizedSample(sample_id, dataset, input_ids, loss_mask, str(path), line, original_length))
    return samples, stats


# ---------------------------------------------------------------------------------------------
# Batching and the forward


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
) -> nn.Module:
    """Load the target for capture: eval mode, no gradients.

    `device_map="auto"` spreads a large target over several GPUs (single process); otherwise the
    whole model goes to `device`. Use bf16 on GPU; float32 or bf16 on CPU.
    """
    from transformers import AutoModelForCausalLM

    if device_map is not None:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, device_map=device_map)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device)
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
    return [
        CapturedSample(
            id=sample.id,
            dataset=sample.dataset,
            input_ids=torch.tensor(sample.input_ids, dtype=torch.long),
            loss_mask=torch.tensor(sample.loss_mask, dtype=torch.uint8),
            aux_hidden_states=aux,
            final_hidden_states=final,
            original_length=sample.original_length,
        )
        for sample, aux, final in zip(launched.samples, aux_parts, final_parts, strict=True)
    ]


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


# ---------------------------------------------------------------------------------------------
# Planning: bytes on disk, and offline vs online


@dataclass
class StoragePlan:
    """What offline capture would store, against the free disk, and the mode chosen from it."""

    tokens: int  # tokens to capture, after truncation to max_seq_len
    samples: int
    bytes_per_token: int  # 4H x 2 (bf16 features) + id and mask bytes
    planned_bytes: int
    free_bytes: int
    requested_mode: str  # auto | offline | online
    mode: str  # offline | online

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def plan_capture_storage(
    data_files: Mapping[str, str | os.PathLike], hidden_size: int, vocab_size: int, max_seq_len: int, output_dir: str | os.PathLike, mode: str = "auto"
) -> StoragePlan:
    """Count the tokens to capture (validated, truncated) and decide offline vs online.

    auto: offline when the planned shard bytes fit the free disk of `output_dir`, else online.
    offline: refuses (InsufficientDiskError) when they do not fit. online: always online.
    """
    if mode not in ("auto", "offline", "online"):
        raise ValueError(f"capture mode must be auto, offline or online, got {mode!r}")
    samples, stats = read_tokenized_samples(data_files, vocab_size, max_seq_len)
    tokens = sum(dataset_stats.tokens for dataset_stats in stats.values())
    bytes_per_token = stored_bytes_per_token(hidden_size)
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    free_bytes = shutil.disk_usage(output_dir).free
    planned_bytes = tokens * bytes_per_token
    if mode == "offline":
        check_disk_space(output_dir, planned_bytes)
    chosen = "online" if mode == "online" or (mode == "auto" and planned_bytes > free_bytes) else "offline"
    return StoragePlan(tokens, len(samples), bytes_per_token, planned_bytes, free_bytes, mode, chosen)


# ---------------------------------------------------------------------------------------------
# Offline: shards


@dataclass
class CaptureReport:
    """What a capture run did. Sample and token counts cover all ranks; `captured_*`/`shards_*` this rank."""

    output_dir: str
    capture_layer_ids: list[int]
    hidden_size: int
    samples: int
    tokens: int
    truncated_samples: int
    truncated_tokens: int
    resumed_samples: int
    planned_bytes: int
    free_bytes_before: int
    captured_samples: int = 0
    captured_tokens: int = 0
    shards_written: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    rank: int = 0
    world_size: int = 1
    index_path: str | None = None
    datasets: dict[str, dict[str, int]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class InsufficientDiskError(RuntimeError):
    pass


class _CaptureProgress:
    """Progress lines through the `eaglekit` logger every `interval_s` (they reach run.log and the
    runner's output), and a final line with whole-run rates: samples and tokens done of this rank's
    share, tokens/s since this session started, ETA."""

    def __init__(self, total_samples: int, total_tokens: int, done_samples: int, done_tokens: int,
                 interval_s: float, rank: int, world_size: int):
        self.total_samples, self.total_tokens = total_samples, total_tokens
        self.samples, self.tokens = done_samples, done_tokens
        self.resumed_tokens = done_tokens
        self.interval_s = interval_s
        self.where = f"rank {rank} of {world_size}" if world_size > 1 else "capture"
        self.started = self.last_logged = time.monotonic()

    def add(self, samples: int, tokens: int) -> None:
        self.samples += samples
        self.tokens += tokens
        now = time.monotonic()
        if now - self.last_logged >= self.interval_s:
            self.last_logged = now
            logger.info("progress %s", self.line(now))

    def line(self, now: float) -> str:
        elapsed = max(now - self.started, 1e-9)
        rate = (self.tokens - self.resumed_tokens) / elapsed  # this session's tokens over its whole span
        left = self.total_tokens - self.tokens
        eta = f"{left / rate:.0f} s" if rate > 0 else "unknown"
        return (f"{self.where} {elapsed:.0f} s | samples {self.samples}/{self.total_samples} | "
                f"tokens {self.tokens:,}/{self.total_tokens:,} | {rate:,.0f} tok/s | ETA {eta}")

    def finish(self) -> None:
        logger.info("final %s", self.line(time.monotonic()))


def check_disk_space(output_dir: Path, planned_bytes: int) -> int:
    """Refuse to start when the planned shard bytes exceed the free space; returns the free bytes."""
    output_dir.mkdir(parents=True, exist_ok=True)
    free_bytes = shutil.disk_usage(output_dir).free
    if planned_bytes > free_bytes:
        raise InsufficientDiskError(
            f"capture needs {planned_bytes:,} bytes ({planned_bytes / 1e9:.2f} GB) in {output_dir} but only "
            f"{free_bytes:,} bytes ({free_bytes / 1e9:.2f} GB) are free: free space, pick another folder, "
            "lower max_seq_len, or use online capture (OnlineCaptureDataset)"
        )
    return free_bytes


def _rank_and_world_size() -> tuple[int, int]:
    if distributed.is_available() and distributed.is_initialized():
        return distributed.get_rank(), distributed.get_world_size()
    return 0, 1


def _barrier() -> None:
    if distributed.is_available() and distributed.is_initialized():
        distributed.barrier()


def capture_to_shards(
    model: nn.Module,
    data_files: Mapping[str, str | os.PathLike],
    output_dir: str | os.PathLike,
    *,
    model_name: str,
    capture_layer_ids: Sequence[int] | None = None,
    max_seq_len: int = 4096,
    max_tokens_per_batch: int = 16384,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    progress: bool = True,
    log_interval_s: float = 60.0,
) -> CaptureReport:
    """Capture every sample of `data_files` ({dataset: tokenized_data.jsonl}) into shards in `output_dir`.

    `progress` shows a tqdm bar; every `log_interval_s` a progress line (samples and tokens done,
    tok/s, ETA) goes to the `eaglekit.capture` logger, and a final one at the end.

    Resumable: samples already indexed are skipped (their batch is recomputed whole so the features
    are bit-identical to an uninterrupted run). Under torchrun (process group initialized) batch i
    goes to rank i % world_size, each rank writes its own shards, and rank 0 writes `index.json`.
    Refuses to start when the planned bytes exceed free disk.
    """
    started = time.perf_counter()
    output_dir = Path(output_dir)
    rank, world_size = _rank_and_world_size()
    num_hidden_layers = model.config.num_hidden_layers
    hidden_size = model.config.hidden_size
    layer_ids = validate_capture_layer_ids(
        capture_layer_ids if capture_layer_ids is not None else default_capture_layer_ids(num_hidden_layers), num_hidden_layers
    )
    if max_seq_len > max_tokens_per_batch:
        raise ValueError(
            f"max_seq_len {max_seq_len} exceeds max_tokens_per_batch {max_tokens_per_batch}: "
            "the longest sample must fit one batch; raise the budget or lower max_seq_len"
        )
    samples, stats = read_tokenized_samples(data_files, model.config.vocab_size, max_seq_len)
    config = {
        "model": model_name,
        "capture_layer_ids": layer_ids,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_hidden_layers,
        "datasets": {name: str(Path(path).resolve()) for name, path in data_files.items()},
        "max_seq_len": max_seq_len,
        "max_tokens_per_batch": max_tokens_per_batch,
        "max_shard_bytes": max_shard_bytes,
        "dtype": "bfloat16",
        "model_dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
    }
    # Rank 0 records the settings first; the others then check theirs against it.
    if rank == 0:
        write_config_once(output_dir, config)
    _barrier()
    if rank != 0:
        write_config_once(output_dir, config)
    done = completed_sample_keys(output_dir)
    remaining_tokens = sum(len(sample.input_ids) for sample in samples if sample.key not in done)
    planned_bytes = remaining_tokens * stored_bytes_per_token(hidden_size)
    free_bytes = check_disk_space(output_dir, planned_bytes)
    # Every rank has read the finished set before any rank writes a new shard.
    _barrier()

    report = CaptureReport(
        output_dir=str(output_dir),
        capture_layer_ids=layer_ids,
        hidden_size=hidden_size,
        samples=len(samples),
        tokens=sum(dataset_stats.tokens for dataset_stats in stats.values()),
        truncated_samples=sum(dataset_stats.truncated_samples for dataset_stats in stats.values()),
        truncated_tokens=sum(dataset_stats.truncated_tokens for dataset_stats in stats.values()),
        resumed_samples=sum(sample.key in done for sample in samples),
        planned_bytes=planned_bytes,
        free_bytes_before=free_bytes,
        rank=rank,
        world_size=world_size,
        datasets={name: asdict(dataset_stats) for name, dataset_stats in stats.items()},
    )

    batches = plan_batches([len(sample.input_ids) for sample in samples], max_tokens_per_batch)
    my_batches = [batch for number, batch in enumerate(batches) if number % world_size == rank]
    mine = [samples[position] for batch in my_batches for position in batch]  # this rank's share, done or not
    my_batches = [batch for batch in my_batches if any(samples[position].key not in done for position in batch)]
    writer = ShardWriter(output_dir, rank, max_shard_bytes)
    mine_done = [sample for sample in mine if sample.key in done]
    tracker = _CaptureProgress(len(mine), sum(len(sample.input_ids) for sample in mine), len(mine_done),
                               sum(len(sample.input_ids) for sample in mine_done), log_interval_s, rank, world_size)
    try:
        batch_iterator: Any = my_batches
        if progress and rank == 0:
            from tqdm.auto import tqdm

            batch_iterator = tqdm(my_batches, desc=f"capture (rank 0 of {world_size})", unit="batch")
        batch_samples = ([samples[position] for position in batch] for batch in batch_iterator)
        for captured_batch in capture_batches(model, batch_samples, layer_ids):
            new = [captured for captured in captured_batch if (captured.dataset, captured.id) not in done]
            for captured in new:
                writer.add(captured)
                report.captured_samples += 1
                report.captured_tokens += captured.length
            tracker.add(len(new), sum(captured.length for captured in new))
    except BaseException:
        # Only a clean finish flushes the partial last shard: a resume then rewrites it exactly as an
        # uninterrupted run would have, so shard boundaries never depend on where a run stopped.
        writer.abandon()
        raise
    writer.close()
    tracker.finish()
    report.shards_written = writer.shards_written
    report.bytes_written = writer.bytes_written
    _barrier()
    if rank == 0:
        header = {
            "model": model_name,
            "capture_layer_ids": layer_ids,
            "hidden_size": hidden_size,
            "num_hidden_layers": num_hidden_layers,
            "dtype": "bfloat16",
            "final_hidden_states": FINAL_HIDDEN_STATE_NOTE,
            "aux_hidden_states": "residual stream entering each capture layer (output_hidden_states[i]), concatenated in capture_layer_ids order",
            "max_seq_len": max_seq_len,
            "truncated_samples": report.truncated_samples,
            "truncated_tokens": report.truncated_tokens,
            "datasets": report.datasets,
        }
        report.index_path = str(write_merged_index(output_dir, header, [sample.key for sample in samples]))
    _barrier()
    report.seconds = time.perf_counter() - started
    return report


# ---------------------------------------------------------------------------------------------
# Online


class OnlineCaptureDataset(torch.utils.data.IterableDataset):
    """The shard features computed on the fly: yields the same dicts as `shards.ShardDataset`.

    For when offline storage does not fit. Iterates batch by batch (token budget, length-sorted);
    `shuffle_seed` shuffles the batch order per epoch (`set_epoch`), and `rank`/`world_size` give
    each data-parallel trainer its share of batches. Use with `num_workers=0`: the model runs here.
    """

    def __init__(
        self,
        model: nn.Module,
        data_files: Mapping[str, str | os.PathLike],
        *,
        capture_layer_ids: Sequence[int] | None = None,
        max_seq_len: int = 4096,
        max_tokens_per_batch: int = 16384,
        shuffle_seed: int | None = None,
        rank: int = 0,
        world_size: int = 1,
    ):
        super().__init__()
        num_hidden_layers = model.config.num_hidden_layers
        self.model = model
        self.capture_layer_ids = validate_capture_layer_ids(
            capture_layer_ids if capture_layer_ids is not None else default_capture_layer_ids(num_hidden_layers), num_hidden_layers
        )
        self.samples, self.stats = read_tokenized_samples(data_files, model.config.vocab_size, max_seq_len)
        self.batches = plan_batches([len(sample.input_ids) for sample in self.samples], max_tokens_per_batch)
        self.shuffle_seed = shuffle_seed
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return sum(len(batch) for number, batch in enumerate(self.batches) if number % self.world_size == self.rank)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        order = list(range(len(self.batches)))
        if self.shuffle_seed is not None:
            random.Random(self.shuffle_seed + self.epoch).shuffle(order)
        my_batches = ([self.samples[position] for position in self.batches[number]] for number in order[self.rank :: self.world_size])
        for captured_batch in capture_batches(self.model, my_batches, self.capture_layer_ids):
            for captured in captured_batch:
                yield as_training_sample(captured)


class OnlineCaptureSamples(Sequence):
    """Random access to online features, one sample per target forward: what `train_draft` indexes.

    `OnlineCaptureDataset` streams batches; training draws samples by index (nested subsets, epoch
    permutations), so online mode there recomputes each requested sample's features on access.
    """

    def __init__(
        self, model: nn.Module, data_files: Mapping[str, str | os.PathLike], *, capture_layer_ids: Sequence[int] | None = None, max_seq_len: int = 4096
    ):
        num_hidden_layers = model.config.num_hidden_layers
        self.model = model
        self.capture_layer_ids = validate_capture_layer_ids(
            capture_layer_ids if capture_layer_ids is not None else default_capture_layer_ids(num_hidden_layers), num_hidden_layers
        )
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
        """{"id", "dataset", "input_ids" (T,), "loss_mask" (T,), "aux_hidden_states" bf16 (T, 3H), "final_hidden_states" bf16 (T, H)}."""

    @property
    def keys(self) -> list[tuple[str, str]]:
        """(dataset, id) of each position."""

    def tokens(self, position: int) -> dict[str, Any]:
        """The sample without its features (cheap in both modes): {"id", "dataset", "input_ids", "loss_mask"}."""


PLAN_FILE = "plan.json"


def read_capture_plan(capture_dir: str | os.PathLike) -> StoragePlan:
    """The storage plan stage 4 wrote (`capture/plan.json`): which mode the capture ran in."""
    path = Path(capture_dir) / PLAN_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: run stage 4 (capture) first")
    record = json.loads(path.read_text(encoding="utf-8"))
    if record.get("mode") not in ("offline", "online"):
        raise InputError(path, None, "mode", f"expected 'offline' or 'online', got {record.get('mode')!r}; rerun stage 4")
    known = {item.name for item in fields(StoragePlan)}
    return StoragePlan(**{name: record.get(name) for name in known})


def open_captured_samples(
    capture_dir: str | os.PathLike,
    data_files: Mapping[str, str | os.PathLike],
    model: nn.Module | Callable[[], nn.Module],
    *,
    capture_layer_ids: Sequence[int] | None = None,
    max_seq_len: int = 4096,
) -> CapturedSamples:
    """The samples of a finished stage 4, in the mode it planned (`capture/plan.json`).

    offline: the shards in `capture_dir`. online: `data_files` (dataset -> tokenized_data.jsonl) with the
    features recomputed per access by the target, with `capture_layer_ids` (None: EAGLE-3's defaults) and
    `max_seq_len` as stage 4 used them. `model`: the loaded target, or a loader called only in online mode
    (so an offline run never loads the target for this).
    """
    from eaglekit.capture.shards import ShardDataset

    if read_capture_plan(capture_dir).mode == "offline":
        return ShardDataset(capture_dir)
    target = model if isinstance(model, nn.Module) else model()
    return OnlineCaptureSamples(target, data_files, capture_layer_ids=capture_layer_ids, max_seq_len=max_seq_len)


# ---------------------------------------------------------------------------------------------
# Checks and summaries for the notebook


def check_captured_samples(
    captured: Sequence[dict], data_files: Mapping[str, str | os.PathLike], hidden_size: int, num_aux_layers: int = 3
) -> list[dict[str, Any]]:
    """Compare captured samples with their source lines: ids and loss mask equal (up to truncation),
    feature shapes (T, 3H)/(T, H), bf16, finite. Returns one row per sample; raises on any mismatch."""
    wanted = {(str(sample["dataset"]), str(sample["id"])) for sample in captured}
    source: dict[tuple[str, str], tuple[list[int], list[int]]] = {}
    for dataset, path in data_files.items():
        for _, record in read_jsonl(Path(path)):
            if isinstance(record, dict) and (dataset, record.get("id")) in wanted:
                source[(dataset, record["id"])] = (record["input_ids"], record["loss_mask"])
    rows = []
    for sample in captured:
        key = (str(sample["dataset"]), str(sample["id"]))
        if key not in source:
            raise ValueError(f"captured sample {key} is not in the tokenized files {dict(data_files)}")
        input_ids, loss_mask = source[key]
        length = int(sample["input_ids"].shape[0])
        aux, final = sample["aux_hidden_states"], sample["final_hidden_states"]
        problems = []
        if sample["input_ids"].tolist() != input_ids[:length]:
            problems.append("input_ids differ from the tokenized file")
        if sample["loss_mask"].tolist() != loss_mask[:length]:
            problems.append("loss_mask differs from the tokenized file")
        if tuple(aux.shape) != (length, num_aux_layers * hidden_size) or tuple(final.shape) != (length, hidden_size):
            problems.append(f"shapes {tuple(aux.shape)}, {tuple(final.shape)} != ({length}, {num_aux_layers * hidden_size}), ({length}, {hidden_size})")
        if aux.dtype != torch.bfloat16 or final.dtype != torch.bfloat16:
            problems.append(f"dtypes {aux.dtype}, {final.dtype} are not bfloat16")
        if not (torch.isfinite(aux.float()).all() and torch.isfinite(final.float()).all()):
            problems.append("non-finite features")
        if problems:
            raise ValueError(f"captured sample {key}: " + "; ".join(problems))
        rows.append({
            "dataset": key[0], "id": key[1], "tokens": length, "source_tokens": len(input_ids), "loss_tokens": int(sample["loss_mask"].sum()),
            "aux_shape": tuple(aux.shape), "final_shape": tuple(final.shape), "dtype": str(aux.dtype).removeprefix("torch."),
        })
    return rows


def feature_norms(captured: Iterable[dict], capture_layer_ids: Sequence[int]) -> dict[str, torch.Tensor]:
    """Per-token L2 norms of each captured layer's feature and of the final state, over `captured`.

    aux (T, 3H) splits into one (T, H) block per capture layer, in capture_layer_ids order.
    Returns {"layer <i>": (sum T,) float32, ..., "final": (sum T,)}.
    """
    norms: dict[str, list[torch.Tensor]] = {f"layer {layer_id}": [] for layer_id in capture_layer_ids}
    norms["final"] = []
    for sample in captured:
        blocks = sample["aux_hidden_states"].float().chunk(len(capture_layer_ids), dim=-1)  # 3 x (T, H)
        for layer_id, block in zip(capture_layer_ids, blocks):
            norms[f"layer {layer_id}"].append(block.norm(dim=-1))
        norms["final"].append(sample["final_hidden_states"].float().norm(dim=-1))
    return {name: torch.cat(parts) if parts else torch.zeros(0) for name, parts in norms.items()}


def write_sample_subset(
    data_files: Mapping[str, str | os.PathLike], keep: set[tuple[str, str]], output_dir: str | os.PathLike
) -> dict[str, Path]:
    """Copy the lines of `data_files` whose (dataset, id) is in `keep` to output_dir/<dataset>/tokenized_data.jsonl.

    For capturing a small chosen subset (the ablation's original answers). Returns the new data files.
    """
    output_dir = Path(output_dir)
    written: dict[str, Path] = {}
    for dataset, path in data_files.items():
        lines = [record for _, record in read_jsonl(Path(path)) if isinstance(record, dict) and (dataset, record.get("id")) in keep]
        if not lines:
            continue
        target = output_dir / dataset / "tokenized_data.jsonl"
        target.parent.mkdir(parents=True, exist_ok=True)
        write_jsonl(target, lines)
        written[dataset] = target
    return written


# ---------------------------------------------------------------------------------------------
# Command line (torchrun entry)


def _parse_data_argument(value: str) -> tuple[str, str]:
    name, separator, path = value.partition("=")
    if not separator or not name or not path:
        raise argparse.ArgumentTypeError(f"--data expects NAME=PATH/tokenized_data.jsonl, got {value!r}")
    return name, path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m eaglekit.capture",
        description="Capture EAGLE-3 hidden states into shards. Data parallel: torchrun --nproc_per_node K -m eaglekit.capture ...",
    )
    parser.add_argument("--model", required=True, help="target model folder (transformers format)")
    parser.add_argument("--model-name", default=None, help="name recorded in the index (default: the model path)")
    parser.add_argument("--data", action="append", type=_parse_data_argument, required=True, help="NAME=PATH, repeatable")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--layers", default=None, help="comma-separated output_hidden_states indices (default [2, N//2, N-3])")
    parser.add_argument("--max-seq-len", type=int, default=4096)
    parser.add_argument("--max-tokens-per-batch", type=int, default=16384)
    parser.add_argument("--max-shard-mb", type=float, default=DEFAULT_MAX_SHARD_BYTES / 2**20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="default: bfloat16 on GPU, float32 on CPU")
    parser.add_argument("--device-map", default=None, help="'auto' to spread one process's model over all GPUs (not with torchrun)")
    parser.add_argument("--no-progress", action="store_true")
    arguments = parser.parse_args(argv)

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    device = arguments.device
    if world_size > 1:
        if arguments.device_map is not None:
            parser.error("--device-map spreads one model over GPUs in one process; with torchrun each rank holds a whole copy")
        backend = "nccl" if device.startswith("cuda") else "gloo"
        distributed.init_process_group(backend=backend)
        if device.startswith("cuda"):
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
            torch.cuda.set_device(device)
    dtype_name = arguments.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    try:
        model = load_target(arguments.model, device=device, dtype=getattr(torch, dtype_name), device_map=arguments.device_map)
        report = capture_to_shards(
            model,
            dict(arguments.data),
            arguments.output_dir,
            model_name=arguments.model_name or str(arguments.model),
            capture_layer_ids=[int(part) for part in arguments.layers.split(",")] if arguments.layers else None,
            max_seq_len=arguments.max_seq_len,
            max_tokens_per_batch=arguments.max_tokens_per_batch,
            max_shard_bytes=int(arguments.max_shard_mb * 2**20),
            progress=not arguments.no_progress,
        )
    finally:
        if distributed.is_initialized():
            distributed.destroy_process_group()
    print(
        f"rank {report.rank}/{report.world_size}: captured {report.captured_samples} samples "
        f"({report.captured_tokens} tokens) into {report.shards_written} shards, {report.bytes_written:,} bytes; "
        f"resumed past {report.resumed_samples}; truncated {report.truncated_samples} samples "
        f"({report.truncated_tokens} tokens dropped); {report.seconds:.1f}s"
        + (f"; index {report.index_path}" if report.index_path else "")
    )
    return 0
