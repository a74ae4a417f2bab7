"""Stage 4's input: `tokenized_data.jsonl` lines read, validated against the target's
vocabulary and truncated."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eaglekit.io import InputError, read_jsonl

if TYPE_CHECKING:
    from eaglekit.config import Params


def capture_length(params: Params) -> int:
    """Tokens captured per sample: capture.max_seq_len, but never past training.max_length
    (training reads no more)."""
    return min(params.capture.max_seq_len, params.training.max_length)


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
                raise InputError(path, line, "id", f"sample {sample_id!r} already appears at line "
                                 f"{first_line_of_id[sample_id]}; ids must be unique")
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
