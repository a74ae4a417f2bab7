"""Offline capture: every sample's features into bounded-size shards, resumable, data parallel under torchrun.

`capture_to_shards` is the library call; `eaglekit capture` (alias `python -m eaglekit.capture`, the
torchrun entry) calls it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as distributed
from torch import nn

from eaglekit.config import CaptureParams, Params
from eaglekit.capture.forward import FeatureSource, as_feature_source, plan_batches
from eaglekit.capture.inputs import TokenizedSample, capture_length, read_tokenized_samples
from eaglekit.capture.layers import resolve_capture_layer_ids
from eaglekit.capture.plan import check_disk_space
from eaglekit.capture.shards import (
    FEATURE_DTYPES,
    FINAL_HIDDEN_STATE_NOTE,
    ShardWriter,
    completed_sample_keys,
    stored_bytes_per_token,
    write_config_once,
    write_merged_index,
)
from eaglekit.run_log import under_runner

logger = logging.getLogger(__name__)

_DEFAULTS = CaptureParams()  # the params schema is the one source of the capture defaults
DEFAULT_MAX_SHARD_BYTES = _DEFAULTS.max_shard_mb * 2**20


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


def _rank_and_world_size() -> tuple[int, int]:
    if distributed.is_available() and distributed.is_initialized():
        return distributed.get_rank(), distributed.get_world_size()
    return 0, 1


def _ordered_batches(samples: Sequence[TokenizedSample], max_tokens_per_batch: int,
                     slices: Sequence[Sequence[tuple[str, str]]] | None) -> list[list[int]]:
    """Batches over all samples. With `slices` (groups of (dataset, id)), each group's batches come before
    the next group's and never mix two groups, so a slice is whole in shards before the next one starts;
    samples in no group go last."""
    if slices is None:
        return plan_batches([len(sample.input_ids) for sample in samples], max_tokens_per_batch)
    position_of = {sample.key: position for position, sample in enumerate(samples)}
    groups = [[position_of[tuple(key)] for key in group if tuple(key) in position_of] for group in slices]
    unknown = sum(len(group) for group in slices) - sum(len(group) for group in groups)
    if unknown:
        raise ValueError(f"capture slices name {unknown} samples that are not in the data: plan the slices from the same files")
    chosen = {position for group in groups for position in group}
    groups.append([position for position in range(len(samples)) if position not in chosen])
    batches = []
    for group in groups:
        planned = plan_batches([len(samples[position].input_ids) for position in group], max_tokens_per_batch)
        batches += [[group[index] for index in batch] for batch in planned]
    return batches


def _barrier() -> None:
    if distributed.is_available() and distributed.is_initialized():
        distributed.barrier()


def capture_to_shards(
    model: nn.Module | FeatureSource,
    data_files: Mapping[str, str | os.PathLike],
    output_dir: str | os.PathLike,
    *,
    model_name: str,
    capture_layer_ids: Sequence[int] | None = None,
    max_seq_len: int = _DEFAULTS.max_seq_len,
    max_tokens_per_batch: int = _DEFAULTS.max_tokens_per_batch,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    progress: bool = True,
    log_interval_s: float = _DEFAULTS.log_interval_s,
    feature_dtype: str = _DEFAULTS.feature_dtype,
    slices: Sequence[Sequence[tuple[str, str]]] | None = None,
) -> CaptureReport:
    """Capture every sample of `data_files` ({dataset: tokenized_data.jsonl}) into shards in `output_dir`.

    `progress` shows a tqdm bar; every `log_interval_s` a progress line (samples and tokens done,
    tok/s, ETA) goes to the `eaglekit.capture.run` logger, and a final one at the end.

    Resumable: samples already indexed are skipped (their batch is recomputed whole so the features
    are bit-identical to an uninterrupted run). Under torchrun (process group initialized) batch i
    goes to rank i % world_size, each rank writes its own shards, and rank 0 writes `index.json`.
    Refuses to start when the planned bytes exceed free disk.

    `model` is a transformers target (hooked) or an engine (`FeatureSource`: vLLM, SGLang). An engine
    that owns tensor parallelism (SGLang under torchrun) computes every batch on all ranks together and
    only its TP rank 0 writes; otherwise torchrun ranks split the batches (data parallel).
    `feature_dtype` "fp8" stores float8_e4m3fn features with a per-token scale (`shards.encode_features`).
    `slices` (groups of (dataset, id), optional: `capture.slices`, `plan.nested_capture_slices`) captures
    group after group, batches never mixing two, so a data size can train once its slice is in shards.
    Defaults are the params schema's (`config.CaptureParams`).
    """
    started = time.perf_counter()
    output_dir = Path(output_dir)
    source = as_feature_source(model)
    tensor_parallel_rank = getattr(source, "tensor_parallel_rank", None)
    if tensor_parallel_rank is None:
        rank, world_size = _rank_and_world_size()  # data parallel: each torchrun rank its own batches
    else:
        rank, world_size = 0, 1  # one TP group computes every batch together
    writes = tensor_parallel_rank in (None, 0)
    layer_ids = resolve_capture_layer_ids(capture_layer_ids, source.num_hidden_layers)
    if max_seq_len > max_tokens_per_batch:
        raise ValueError(
            f"max_seq_len {max_seq_len} exceeds max_tokens_per_batch {max_tokens_per_batch}: "
            "the longest sample must fit one batch; raise the budget or lower max_seq_len"
        )
    samples, stats = read_tokenized_samples(data_files, source.vocab_size, max_seq_len)
    shape = {"model": model_name, "capture_layer_ids": layer_ids, "hidden_size": source.hidden_size,
             "num_hidden_layers": source.num_hidden_layers}
    config = {**shape, "datasets": {name: str(Path(path).resolve()) for name, path in data_files.items()}, "max_seq_len": max_seq_len,
              "max_tokens_per_batch": max_tokens_per_batch, "max_shard_bytes": max_shard_bytes, "dtype": FEATURE_DTYPES[feature_dtype],
              "model_dtype": source.dtype_name}
    # Rank 0 records the settings first; the others then check theirs against it.
    if rank == 0 and writes:
        write_config_once(output_dir, config)
    _barrier()
    if rank != 0 and writes:
        write_config_once(output_dir, config)
    done = completed_sample_keys(output_dir)
    remaining_tokens = sum(len(sample.input_ids) for sample in samples if sample.key not in done)
    planned_bytes = remaining_tokens * stored_bytes_per_token(source.hidden_size, feature_dtype)
    free_bytes = check_disk_space(output_dir, planned_bytes)
    # Every rank has read the finished set before any rank writes a new shard.
    _barrier()

    report = CaptureReport(
        output_dir=str(output_dir), capture_layer_ids=layer_ids, hidden_size=source.hidden_size, samples=len(samples),
        tokens=sum(dataset_stats.tokens for dataset_stats in stats.values()),
        truncated_samples=sum(dataset_stats.truncated_samples for dataset_stats in stats.values()),
        truncated_tokens=sum(dataset_stats.truncated_tokens for dataset_stats in stats.values()),
        resumed_samples=sum(sample.key in done for sample in samples), planned_bytes=planned_bytes, free_bytes_before=free_bytes,
        rank=rank, world_size=world_size, datasets={name: asdict(dataset_stats) for name, dataset_stats in stats.items()},
    )
    writer = ShardWriter(output_dir, rank, max_shard_bytes, feature_dtype=feature_dtype) if writes else None
    _capture_batches(source, samples, _ordered_batches(samples, max_tokens_per_batch, slices), done, layer_ids, writer, report,
                     progress, log_interval_s)
    _barrier()
    if rank == 0 and writes:
        header = {**shape, "dtype": FEATURE_DTYPES[feature_dtype], "final_hidden_states": FINAL_HIDDEN_STATE_NOTE,
                  "aux_hidden_states": "residual stream entering each capture layer (output_hidden_states[i]), concatenated in "
                                       "capture_layer_ids order",
                  "max_seq_len": max_seq_len, "truncated_samples": report.truncated_samples, "truncated_tokens": report.truncated_tokens,
                  "datasets": report.datasets}
        report.index_path = str(write_merged_index(output_dir, header, [sample.key for sample in samples]))
    _barrier()
    report.seconds = time.perf_counter() - started
    return report


def capture_samples(params: Params, source: nn.Module | FeatureSource, files: dict[str, Path], out_dir: Path,
                    capture_layer_ids: list[int], *, progress: bool = True, slices: list | None = None) -> CaptureReport:
    """`files` captured into shards in `out_dir` under the params' capture settings (capture_length, batch
    tokens, shard size, feature dtype, log interval): the one call stage 4, its ablation input, the staged
    run and SGLang's torchrun entry (`sglang_capture.main`) make. Resumes past the samples `out_dir` holds.
    No tqdm bar under the runner (its progress lines go to run.log)."""
    return capture_to_shards(source, files, out_dir, model_name=params.target.model, capture_layer_ids=capture_layer_ids,
                             max_seq_len=capture_length(params), max_tokens_per_batch=params.capture.max_tokens_per_batch,
                             max_shard_bytes=params.capture.max_shard_mb * 2**20, progress=progress and not under_runner(),
                             log_interval_s=params.capture.log_interval_s, feature_dtype=params.capture.feature_dtype, slices=slices)


def _capture_batches(source: FeatureSource, samples: list[TokenizedSample], batches: list[list[int]], done: set, layer_ids: list[int],
                     writer: ShardWriter | None, report: CaptureReport, progress: bool, log_interval_s: float) -> None:
    """This rank's share of `batches` (batch i goes to rank i % world size) through `source`, new
    samples into `writer`."""
    rank, world_size = report.rank, report.world_size
    my_batches = [batch for number, batch in enumerate(batches) if number % world_size == rank]
    mine = [samples[position] for batch in my_batches for position in batch]  # this rank's share, done or not
    my_batches = [batch for batch in my_batches if any(samples[position].key not in done for position in batch)]
    mine_done = [sample for sample in mine if sample.key in done]
    tracker = _CaptureProgress(len(mine), sum(len(sample.input_ids) for sample in mine), len(mine_done),
                               sum(len(sample.input_ids) for sample in mine_done), log_interval_s, rank, world_size)
    try:
        batch_iterator: Any = my_batches
        if progress and rank == 0:
            from tqdm.auto import tqdm

            batch_iterator = tqdm(my_batches, desc=f"capture (rank 0 of {world_size})", unit="batch")
        batch_samples = ([samples[position] for position in batch] for batch in batch_iterator)
        for captured_batch in source.capture_batches(batch_samples, layer_ids):
            new = [captured for captured in captured_batch if (captured.dataset, captured.id) not in done]
            for captured in new:
                if writer is not None:
                    writer.add(captured)
                report.captured_samples += 1
                report.captured_tokens += captured.length
            tracker.add(len(new), sum(captured.length for captured in new))
    except BaseException:
        # Only a clean finish flushes the partial last shard: a resume then rewrites it exactly as an
        # uninterrupted run would have, so shard boundaries never depend on where a run stopped.
        if writer is not None:
            writer.abandon()
        raise
    if writer is not None:
        writer.close()
        report.shards_written = writer.shards_written
        report.bytes_written = writer.bytes_written
    tracker.finish()
