"""The storage plan of stage 4: the bytes offline shards would take against the free disk,
and the mode chosen.

`plan_capture_storage` decides offline (shards) or online (features recomputed in stage 5); stage 4
writes the plan to `capture/plan.json` and `read_capture_plan` reads it back for the later stages.
"""

from __future__ import annotations

import itertools
import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from eaglekit.capture.inputs import read_tokenized_samples
from eaglekit.capture.shards import stored_bytes_per_token
from eaglekit.io import InputError, read_json

PLAN_FILE = "plan.json"


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
    feature_dtype: str = "bf16"  # bf16 | fp8 (capture.feature_dtype)
    # capture.slices: the nested slices in capture order, each {"size", "samples", "tokens", "bytes",
    # "cumulative_bytes", "keys"}: the first holds the held-out set and the smallest size's samples.
    slices: list[dict] | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def plan_capture_storage(
    data_files: Mapping[str, str | os.PathLike], hidden_size: int, vocab_size: int, max_seq_len: int,
    output_dir: str | os.PathLike, mode: str = "auto", feature_dtype: str = "bf16", slices: list[dict] | None = None,
) -> StoragePlan:
    """Count the tokens to capture (validated, truncated) and decide offline vs online.

    auto: offline when the planned shard bytes fit the free disk of `output_dir`, else online.
    offline: refuses (InsufficientDiskError) when they do not fit. online: always online.
    """
    if mode not in ("auto", "offline", "online"):
        raise ValueError(f"capture mode must be auto, offline or online, got {mode!r}")
    samples, stats = read_tokenized_samples(data_files, vocab_size, max_seq_len)
    tokens = sum(dataset_stats.tokens for dataset_stats in stats.values())
    bytes_per_token = stored_bytes_per_token(hidden_size, feature_dtype)
    planned_bytes = tokens * bytes_per_token
    # offline refuses what does not fit; auto and online only read the free space
    free_bytes = check_disk_space(Path(output_dir), planned_bytes if mode == "offline" else 0)
    chosen = "online" if mode == "online" or (mode == "auto" and planned_bytes > free_bytes) else "offline"
    if slices is not None:
        cumulative = itertools.accumulate(part["tokens"] * bytes_per_token for part in slices)
        for part, total in zip(slices, cumulative):
            part.update(bytes=part["tokens"] * bytes_per_token, cumulative_bytes=total)
    return StoragePlan(tokens, len(samples), bytes_per_token, planned_bytes, free_bytes, mode, chosen, feature_dtype, slices)


def nested_capture_slices(data_files: Mapping[str, str | os.PathLike], vocab_size: int, max_seq_len: int, data_sizes: Sequence[int],
                          heldout_size: int, seed: int, order=None) -> list[dict]:
    """The capture's nested slices, in the order stage 5 trains: {"size", "samples", "tokens", "keys"} each.

    Slice 0 holds the held-out set and the first `data_sizes[0]` training samples; slice i the samples
    size i adds; a last slice (size None) the samples no size trains on. The split is stage 5's
    (`split_heldout` over the samples in capture-index order, conversations kept whole, seed `run.seed`),
    so once slice i is in shards, size i can train. `order` (`training.order.TrainingOrder`, prep's plan):
    split by it, as stage 5 then does.
    """
    from eaglekit.training.split import read_conversation_keys, split_heldout

    samples, _ = read_tokenized_samples(data_files, vocab_size, max_seq_len)
    keys = [sample.key for sample in samples]
    if order is not None:
        heldout, train_order = order.split(keys)
    else:
        heldout, train_order = split_heldout([sample.dataset for sample in samples], heldout_size, seed,
                                             read_conversation_keys(data_files, keys))
    bounds = [size for size in data_sizes if size <= len(train_order)]
    parts = [(data_sizes[0], heldout + train_order[:data_sizes[0]])]
    parts += [(size, train_order[previous:size]) for previous, size in zip(bounds, bounds[1:])]
    if bounds and bounds[-1] < len(train_order):
        parts.append((None, train_order[bounds[-1]:]))
    return [{"size": size, "samples": len(positions), "tokens": sum(len(samples[position].input_ids) for position in positions),
             "keys": [list(samples[position].key) for position in positions]} for size, positions in parts]


def format_bytes(count: float) -> str:
    """A byte count in the largest decimal unit it fills (B, KB, MB, GB, TB, as disks are sold), 3 significant
    digits: "812 B", "3.21 MB", "41.7 TB". A demo's megabytes never read as "0.000 TB"."""
    if count < 0 or count != count:
        raise ValueError(f"a byte count must be a number >= 0, got {count!r}")
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if count >= scale * 0.9995:  # 999.6 KB rounds to "1.00 MB", not "1e+03 KB"
            scaled = count / scale
            return f"{scaled:,.2f} {unit}" if scaled < 10 else f"{scaled:,.1f} {unit}" if scaled < 100 else f"{scaled:,.0f} {unit}"
    return f"{count:,.0f} B"


def format_slice_plan(plan: StoragePlan) -> str:
    """The per-slice bytes as lines: what the disk must hold before each size can train."""
    if not plan.slices:
        return (f"one capture: {plan.tokens:,} tokens x {plan.bytes_per_token:,} B = "
                f"{format_bytes(plan.planned_bytes)} ({plan.feature_dtype})")
    lines = []
    for part in plan.slices:
        label = f"size {part['size']:>7,}" if part["size"] is not None else "untrained   "
        lines.append(f"{label}: {part['samples']:>7,} samples {part['tokens']:>14,} tokens {format_bytes(part['bytes']):>9} "
                     f"(cumulative {format_bytes(part['cumulative_bytes'])}, {plan.feature_dtype})")
    return "\n".join(lines)


class InsufficientDiskError(RuntimeError):
    pass


def check_disk_space(output_dir: Path, planned_bytes: int) -> int:
    """Refuse to start when the planned shard bytes exceed the free space; returns the free bytes."""
    output_dir.mkdir(parents=True, exist_ok=True)
    free_bytes = shutil.disk_usage(output_dir).free
    if planned_bytes > free_bytes:
        raise InsufficientDiskError(
            f"capture needs {planned_bytes:,} bytes ({planned_bytes / 1e9:.2f} GB) in {output_dir} but only "
            f"{free_bytes:,} bytes ({free_bytes / 1e9:.2f} GB) are free: free space, pick another folder, "
            "lower max_seq_len, or set capture.mode: online (features recomputed while training)"
        )
    return free_bytes



def read_capture_plan(capture_dir: str | os.PathLike) -> StoragePlan:
    """The storage plan stage 4 wrote (`capture/plan.json`): which mode the capture ran in."""
    path = Path(capture_dir) / PLAN_FILE
    record = read_json(path, "rerun stage 4", missing="run stage 4 (capture) first")
    if record.get("mode") not in ("offline", "online"):
        raise InputError(path, None, "mode", f"expected 'offline' or 'online', got {record.get('mode')!r}; rerun stage 4")
    known = {item.name for item in fields(StoragePlan)}
    return StoragePlan(**{name: record.get(name) for name in known})


def planned_slice_bytes(data_sizes: Sequence[int], heldout_size: int, total_samples: int, tokens_per_sample: float,
                        hidden_size: int, feature_dtype: str = "bf16") -> list[dict]:
    """Bytes per nested slice before any data exists (a mean length instead of measured
    tokens), for planning a run.

    Slice 0: held-out + the smallest size; then each size's new samples; then what no size trains on.
    """
    bytes_per_token = stored_bytes_per_token(hidden_size, feature_dtype)
    bounds = [heldout_size + size for size in data_sizes if heldout_size + size <= total_samples]
    counts = [bounds[0]] + [after - before for before, after in zip(bounds, bounds[1:])]
    sizes: list[int | None] = list(data_sizes[:len(bounds)])
    if bounds[-1] < total_samples:
        counts.append(total_samples - bounds[-1])
        sizes.append(None)
    tokens = [int(samples * tokens_per_sample) for samples in counts]
    cumulative = itertools.accumulate(count * bytes_per_token for count in tokens)
    return [{"size": size, "samples": samples, "tokens": count, "bytes": count * bytes_per_token, "cumulative_bytes": total}
            for size, samples, count, total in zip(sizes, counts, tokens, cumulative)]
