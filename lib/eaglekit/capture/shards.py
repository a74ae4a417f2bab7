"""Hidden-state shards: bounded-size bf16 safetensors files, a per-rank index log, one merged index, a reader.

Layout of an output folder:

    capture_config.json          what produced the shards (model, layers, limits); resume refuses a mismatch
    shard-r00-00000.safetensors  samples concatenated along the token axis:
                                   aux_hidden_states   bf16  (sum T, 3H)
                                   final_hidden_states bf16  (sum T, H)   after the target's final norm
                                   input_ids           int64 (sum T,)
                                   loss_mask           uint8 (sum T,)
                                 with capture.feature_dtype fp8: the features as float8_e4m3fn and
                                   aux_hidden_states_scale float32 (sum T, 3),
                                   final_hidden_states_scale (sum T, 1)
    index-rank00.jsonl           append-only: one line per sample once its shard is on disk
    index.json                   merged index written at the end of a run (the reader needs it)

A shard is written to a temp file and renamed, then its samples are appended to the rank's index log.
A sample counts as done only when its index line exists, so a run killed at any point resumes by
sample id: at worst it rewrites one shard that was renamed but not yet indexed.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save

from eaglekit.capture.inputs import TokenizedSample
from eaglekit.generation.capacity import hidden_state_bytes_per_token
from eaglekit.io import AppendLog, atomic_write, read_json, remove_stale_temp_files, write_json

logger = logging.getLogger(__name__)

INDEX_FILE = "index.json"
CONFIG_FILE = "capture_config.json"
INDEX_FORMAT_VERSION = 1
FINAL_HIDDEN_STATE_NOTE = "output of the target's final norm: exactly what its lm_head consumes"
# input_ids are stored as int64 (8 bytes) and loss_mask as uint8 (1 byte) beside the bf16 features.
TOKEN_ID_AND_MASK_BYTES = 8 + 1

_RANK_INDEX_PATTERN = re.compile(r"^index-rank(\d+)\.jsonl$")


def shard_name(rank: int, shard_number: int) -> str:
    return f"shard-r{rank:02d}-{shard_number:05d}.safetensors"


def rank_index_name(rank: int) -> str:
    return f"index-rank{rank:02d}.jsonl"


# capture.feature_dtype -> the dtype named in capture_config.json and index.json.
FEATURE_DTYPES = {"bf16": "bfloat16", "fp8": "float8_e4m3fn"}
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# fp8 shards keep one float32 scale per token and feature block: 3 for the aux layers, 1 for the final state.
FP8_SCALE_BYTES = 4 * (3 + 1)


def stored_bytes_per_token(hidden_size: int, feature_dtype: str = "bf16") -> int:
    """Bytes one token takes in a shard: 3H + H features (bf16: the planner's 4H x 2; fp8: 4H x 1 plus
    four float32 scales), an int64 id and a uint8 mask."""
    if feature_dtype == "fp8":
        return hidden_state_bytes_per_token(hidden_size, dtype_bytes=1) + FP8_SCALE_BYTES + TOKEN_ID_AND_MASK_BYTES
    if feature_dtype != "bf16":
        raise ValueError(f"feature_dtype must be bf16 or fp8, got {feature_dtype!r}")
    return hidden_state_bytes_per_token(hidden_size, dtype_bytes=2) + TOKEN_ID_AND_MASK_BYTES


def encode_fp8(features: torch.Tensor, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, blocks x H) features -> float8_e4m3fn (T, blocks x H) and float32 scales (T, blocks).

    Each token's block (one capture layer, or the final state) is scaled so its largest |value| maps to
    448 (e4m3's largest finite value); decode multiplies back. Relative error per entry <=
    2^-4 (3 mantissa bits).
    """
    tokens, width = features.shape
    blocked = features.float().reshape(tokens, blocks, width // blocks)  # (T, blocks, H)
    scale = blocked.abs().amax(dim=-1).clamp_min(1e-12) / FP8_MAX  # (T, blocks)
    encoded = (blocked / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return encoded.reshape(tokens, width), scale


def decode_fp8(encoded: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn (T, blocks x H) and scales (T, blocks) -> bf16 (T, blocks x H)."""
    tokens, width = encoded.shape
    blocks = scale.shape[-1]
    blocked = encoded.float().reshape(tokens, blocks, width // blocks) * scale.unsqueeze(-1)
    return blocked.reshape(tokens, width).to(torch.bfloat16)


@dataclass
class CapturedSample:
    """One sample's features on CPU, ready for a shard.

    aux_hidden_states: bf16 (T, 3H); final_hidden_states: bf16 (T, H); input_ids: int64 (T,);
    loss_mask: (T,) 0/1.
    """

    id: str
    dataset: str
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    aux_hidden_states: torch.Tensor
    final_hidden_states: torch.Tensor
    original_length: int

    @classmethod
    def of(cls, sample: TokenizedSample, aux_hidden_states: torch.Tensor, final_hidden_states: torch.Tensor) -> CapturedSample:
        """A tokenized sample with its two feature tensors, as every capture path hands them to
        the shard writer."""
        return cls(sample.id, sample.dataset, torch.tensor(sample.input_ids, dtype=torch.long),
                   torch.tensor(sample.loss_mask, dtype=torch.uint8), aux_hidden_states, final_hidden_states,
                   sample.original_length)

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[0])

    def nbytes(self) -> int:
        return (self.aux_hidden_states.nbytes + self.final_hidden_states.nbytes
                + self.length * TOKEN_ID_AND_MASK_BYTES)


def read_rank_indexes(output_dir: Path) -> dict[int, list[dict]]:
    """All per-rank index logs in `output_dir`, keyed by rank, torn last lines ignored."""
    records_by_rank: dict[int, list[dict]] = {}
    for path in sorted(Path(output_dir).glob("index-rank*.jsonl")):
        match = _RANK_INDEX_PATTERN.match(path.name)
        if match is None:
            continue
        # The last element is either empty (clean end) or a torn line from a kill: skip it.
        lines = path.read_bytes().split(b"\n")[:-1]
        records_by_rank[int(match.group(1))] = [json.loads(raw) for raw in lines if raw.strip()]
    return records_by_rank


class CorruptShardError(RuntimeError):
    """A shard file that cannot be read as written (truncated, overwritten): names the file."""


SHARD_TENSORS = ("aux_hidden_states", "final_hidden_states", "input_ids", "loss_mask")


def open_shard(path: str | os.PathLike) -> Any:
    """`safe_open` a shard; a file safetensors cannot read raises CorruptShardError naming it."""
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as error:
        raise CorruptShardError(f"shard {path}: cannot be read ({error}); rerun the capture to resume: it "
                                "verifies every shard and captures the samples of an unreadable one again") from None


def verify_shard(path: Path, records: list[dict]) -> str | None:
    """Why the shard at `path` cannot serve `records` (its index lines), or None when it can.

    Checks what a kill or a full disk can break without touching the tensors' bytes: the file
    exists, safetensors reads its header and finds the data it declares (a truncated file fails
    here), the four tensors are there with one row per token, covering every indexed sample.
    """
    if not path.exists():
        return "missing"
    try:
        handle = open_shard(path)
        keys = set(handle.keys())
        if not keys >= set(SHARD_TENSORS):
            return f"tensors {sorted(set(SHARD_TENSORS) - keys)} missing"
        rows = {name: handle.get_slice(name).get_shape()[0] for name in SHARD_TENSORS}
    except CorruptShardError as error:
        return str(error).split(": ", 1)[1]
    if len(set(rows.values())) != 1:
        return f"tensors disagree on the token count: {rows}"
    needed = max((record["offset"] + record["length"] for record in records), default=0)
    if needed > rows["input_ids"]:
        return f"holds {rows['input_ids']} tokens, its index lines need {needed}"
    return None


def _valid_records(output_dir: Path) -> tuple[list[dict], dict[str, str]]:
    """Every index record whose shard verifies, in log order, and {shard: why} for the others."""
    records = [record for rank_records in read_rank_indexes(output_dir).values() for record in rank_records]
    by_shard: dict[str, list[dict]] = {}
    for record in records:
        by_shard.setdefault(record["shard"], []).append(record)
    bad = {name: why for name, shard_records in by_shard.items()
           if (why := verify_shard(output_dir / name, shard_records)) is not None}
    return [record for record in records if record["shard"] not in bad], bad


def completed_sample_keys(output_dir: Path) -> set[tuple[str, str]]:
    """(dataset, id) of every sample already in a readable shard, from all ranks' index logs.

    Each shard a resume would build on is verified (`verify_shard`): the samples of a truncated or
    missing shard are not done, so the capture computes them again into a new shard.
    """
    output_dir = Path(output_dir)
    records, bad = _valid_records(output_dir)
    for name, why in sorted(bad.items()):
        if why != "missing":
            logger.warning("%s: shard %s is unusable (%s); its samples will be captured again", output_dir, name, why)
    return {(record["dataset"], record["id"]) for record in records}


class ShardWriter:
    """Buffers captured samples and writes them as bounded-size shards for one rank.

    Shards close when the next sample would push them past `max_shard_bytes` (a single sample larger
    than that gets a shard of its own). Boundaries depend only on the order of samples, so a resumed
    run that replays the same order rewrites the same shards.
    """

    def __init__(self, output_dir: str | os.PathLike, rank: int, max_shard_bytes: int, feature_dtype: str = "bf16"):
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        stored_bytes_per_token(1, feature_dtype)  # refuses an unknown dtype before anything is written
        self.feature_dtype = feature_dtype
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.max_shard_bytes = max_shard_bytes
        # Temp shards of this rank were left by a killed run; only this rank writes them, so
        # all are safe to drop.
        remove_stale_temp_files(self.output_dir, f"shard-r{rank:02d}-*", every_writer=True)
        existing = read_rank_indexes(self.output_dir).get(rank, [])
        self.next_shard_number = 1 + max((record["shard_number"] for record in existing), default=-1)
        self._buffer: list[CapturedSample] = []
        self._buffer_bytes = 0
        self._index_log = AppendLog(self.output_dir / rank_index_name(rank), sync_every=1_000_000)
        self.shards_written = 0
        self.samples_written = 0
        self.bytes_written = 0

    def add(self, sample: CapturedSample) -> None:
        sample_bytes = sample.nbytes() // (2 if self.feature_dtype == "fp8" else 1)
        if self._buffer and self._buffer_bytes + sample_bytes > self.max_shard_bytes:
            self.flush()
        self._buffer.append(sample)
        self._buffer_bytes += sample_bytes

    def flush(self) -> None:
        """Write the buffered samples as one shard (temp file, rename), then index them."""
        if not self._buffer:
            return
        name = shard_name(self.rank, self.next_shard_number)
        # torch.cat makes new contiguous tensors, as safetensors' save needs them
        tensors = {key: torch.cat([getattr(sample, key) for sample in self._buffer]) for key in SHARD_TENSORS}
        tensors["input_ids"] = tensors["input_ids"].to(torch.int64)
        tensors["loss_mask"] = tensors["loss_mask"].to(torch.uint8)
        if self.feature_dtype == "fp8":
            tensors["aux_hidden_states"], tensors["aux_hidden_states_scale"] = encode_fp8(tensors["aux_hidden_states"], 3)
            tensors["final_hidden_states"], tensors["final_hidden_states_scale"] = encode_fp8(tensors["final_hidden_states"], 1)
        path = self.output_dir / name
        # Serialized in memory (one shard, bounded by max_shard_bytes) so the write goes through
        # atomic_write: a kill leaves a stray temp file, never a half shard under the final name.
        # One metadata key only: safetensors orders metadata keys by hash, which would make bytes
        # differ between runs.
        payload = save(tensors, metadata={"format": "pt"})
        with atomic_write(path, "wb") as handle:
            handle.write(payload)
        offset = 0
        for sample in self._buffer:
            self._index_log.append({
                "id": sample.id,
                "dataset": sample.dataset,
                "shard": name,
                "shard_number": self.next_shard_number,
                "rank": self.rank,
                "offset": offset,
                "length": sample.length,
                "original_length": sample.original_length,
                "loss_tokens": int(sample.loss_mask.sum()),
            })
            offset += sample.length
        self._index_log.flush()
        self.shards_written += 1
        self.samples_written += len(self._buffer)
        self.bytes_written += path.stat().st_size
        self.next_shard_number += 1
        self._buffer, self._buffer_bytes = [], 0

    def close(self) -> None:
        """Write the last, partial shard and close the index log."""
        self.flush()
        self._index_log.close()

    def abandon(self) -> None:
        """Drop buffered samples (they were never indexed, so a resume recomputes them) and close the log."""
        self._buffer, self._buffer_bytes = [], 0
        self._index_log.close()


def write_merged_index(output_dir: str | os.PathLike, header: dict[str, Any], sample_order: list[tuple[str, str]]) -> Path:
    """Merge every rank's index log into `index.json`, samples in `sample_order` ((dataset, id) pairs).

    Raises when a sample of `sample_order` has no shard: the run is incomplete and must be resumed.
    """
    output_dir = Path(output_dir)
    # a sample captured again after its shard broke: the readable copy
    records, _ = _valid_records(output_dir)
    by_key = {(record["dataset"], record["id"]): record for record in records}
    missing = [key for key in sample_order if key not in by_key]
    if missing:
        raise RuntimeError(
            f"{len(missing)} samples have no shard in {output_dir} (first: dataset {missing[0][0]!r}, id {missing[0][1]!r}); "
            "the capture did not finish: run it again with the same arguments to resume"
        )
    samples = [{name: value for name, value in by_key[key].items() if name != "shard_number"} for key in sample_order]
    shards = sorted({record["shard"] for record in samples})
    index = {
        "format_version": INDEX_FORMAT_VERSION,
        **header,
        "num_samples": len(samples),
        "num_tokens": sum(record["length"] for record in samples),
        "shards": shards,
        "samples": samples,
    }
    path = output_dir / INDEX_FILE
    write_json(path, index)
    return path


def load_index(output_dir: str | os.PathLike) -> dict[str, Any]:
    return read_json(Path(output_dir) / INDEX_FILE, f"run the capture into {output_dir} again to rewrite it",
                     missing=f"the capture into {output_dir} has not finished (run it again to resume), "
                             "or this is not a capture output folder")


class ShardDataset(torch.utils.data.Dataset):
    """Samples from a finished capture, as the dicts stage 5 trains on (`capture.CapturedSamples`).

    Each item: {"id": str, "dataset": str, "input_ids": int64 (T,), "loss_mask": int64 (T,),
    "aux_hidden_states": bf16 (T, 3H), "final_hidden_states": bf16 (T, H)}.
    Tensors are read lazily by slice, so a dataset far larger than memory is fine.
    """

    def __init__(self, output_dir: str | os.PathLike, datasets: list[str] | None = None):
        self.output_dir = Path(output_dir)
        self.index = load_index(self.output_dir)
        samples = self.index["samples"]
        if datasets is not None:
            unknown = sorted(set(datasets) - {record["dataset"] for record in samples})
            if unknown:
                raise ValueError(f"datasets {unknown} are not in {self.output_dir / INDEX_FILE}")
            samples = [record for record in samples if record["dataset"] in set(datasets)]
        self.samples: list[dict] = samples
        self.hidden_size: int = self.index["hidden_size"]
        self.capture_layer_ids: list[int] = self.index["capture_layer_ids"]
        self._open_name: str | None = None
        self._open_handle: Any = None

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def keys(self) -> list[tuple[str, str]]:
        """(dataset, id) of each position: what splits and subsets are keyed on."""
        return [(record["dataset"], str(record["id"])) for record in self.samples]

    def tokens(self, position: int) -> dict[str, Any]:
        """The sample without its features: {"id", "dataset", "input_ids" (T,), "loss_mask" (T,)}."""
        return self._read(position, with_features=False)

    def _shard(self, name: str) -> Any:
        # Samples are stored shard by shard, so keeping the last shard open serves sequential reads.
        if name != self._open_name:
            self._open_handle = open_shard(self.output_dir / name)
            self._open_name = name
        return self._open_handle

    def __getitem__(self, position: int) -> dict[str, Any]:
        return self._read(position, with_features=True)

    def _read(self, position: int, with_features: bool) -> dict[str, Any]:
        record = self.samples[position]
        shard = self._shard(record["shard"])
        start, stop = record["offset"], record["offset"] + record["length"]
        try:
            sample = {
                "id": record["id"],
                "dataset": record["dataset"],
                "input_ids": shard.get_slice("input_ids")[start:stop].to(torch.long),
                "loss_mask": shard.get_slice("loss_mask")[start:stop].to(torch.long),
            }
            if with_features:
                for name in ("aux_hidden_states", "final_hidden_states"):
                    features = shard.get_slice(name)[start:stop]
                    if features.dtype == torch.float8_e4m3fn:
                        # an fp8 capture: decoded to bf16 here, so readers see one format
                        features = decode_fp8(features, shard.get_slice(f"{name}_scale")[start:stop])
                    sample[name] = features
            return sample
        except SafetensorError as error:
            raise CorruptShardError(f"shard {self.output_dir / record['shard']}: sample {record['dataset']}/{record['id']} "
                                    f"cannot be read ({error})") from None

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for position in range(len(self)):
            yield self[position]


def write_config_once(output_dir: Path, config: dict[str, Any]) -> None:
    """Record what produces this folder; refuse to mix runs with different settings in one folder."""
    output_dir = Path(output_dir)
    path = output_dir / CONFIG_FILE
    if not path.exists():
        write_json(path, config)
        return
    existing = read_json(path, "delete it to capture into this folder with this run's settings")
    differences = {key: (existing.get(key), config.get(key)) for key in set(existing) | set(config) if existing.get(key) != config.get(key)}
    if differences:
        details = ", ".join(f"{key}: folder has {old!r}, this run {new!r}" for key, (old, new) in sorted(differences.items()))
        raise ValueError(
            f"{output_dir} holds a capture made with other settings ({details}); "
            "use a new output folder, or the same settings to resume"
        )
