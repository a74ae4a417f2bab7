"""Readers of stage 3's files with bounded memory: generations.jsonl, errors.jsonl, and the progress records.

Every record's small fields come before its text, so readers that need no text (resume, counters, the
notebook's tables) parse only the head of each line: memory and time do not grow with the answers.
Counters are recounted from the files, so they cover every session of a resumed run.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eaglekit.generation.prompts import PromptItem, PromptSource, load_prompts
from eaglekit.generation.quality import QUALITY_FLAGS
from eaglekit.io import InputError, format_duration, read_jsonl, write_jsonl

logger = logging.getLogger(__name__)

GENERATIONS_FILE = "generations.jsonl"
ERRORS_FILE = "errors.jsonl"
METRICS_FILE = "metrics.jsonl"
SESSIONS_FILE = "sessions.jsonl"


# Every record's small fields come before "content" (see `engine.GenerationEngine._record_answer`). In a JSON line, a
# quote inside a string value is escaped, so the first `, "content": ` is the key itself: the head
# `line[:index] + "}"` is valid JSON with everything but the answer text and token ids.
_CONTENT_KEY = b', "content": '
_BULKY_FIELDS = ("content", "reasoning", "tool_calls", "prompt_token_ids", "token_ids")


def _head(line: bytes, path: Path, line_number: int) -> dict[str, Any]:
    index = line.find(_CONTENT_KEY) if line.startswith(b'{"dataset": ') else -1
    try:
        if index > 0:
            return json.loads(line[:index] + b"}")
        record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise InputError(path, line_number, None, "not a JSON record; is this the right output folder?") from None
    if not isinstance(record, dict) or not isinstance(record.get("dataset"), str) or not isinstance(record.get("id"), str):
        raise InputError(path, line_number, "dataset/id", "not a generation record; is this the right output folder?")
    for name in _BULKY_FIELDS:
        record.pop(name, None)
    return record


def iter_record_heads(path: str | os.PathLike) -> Iterator[tuple[int, int, dict[str, Any]]]:
    """(line number, byte offset, record without its text and token ids) for each line of a generations file.

    Memory is one line at a time. A torn last line (no newline: the writer was killed mid-write and
    the next session repairs it) is skipped.
    """
    path = Path(path)
    if not path.exists():
        return
    with open(path, "rb") as handle:
        offset = 0
        for line_number, line in enumerate(handle, start=1):
            start, offset = offset, offset + len(line)
            if not line.endswith(b"\n"):
                break
            if line.strip():
                yield line_number, start, _head(line, path, line_number)


def finished_keys(path: str | os.PathLike) -> set[tuple[str, str]]:
    """(dataset, id) of every record in an append-only JSONL file (generations or errors)."""
    return {(head["dataset"], head["id"]) for _, _, head in iter_record_heads(path)}


def generation_table(output_dir: str | Path) -> dict[str, list[Any]]:
    """Every answer's small fields (everything but text and token ids) as columns, for a DataFrame.

    `pd.DataFrame(generation_table(folder))` gives one row per answer. Reads the file once, one line
    at a time, and keeps columns with repeated strings shared (dataset, partition, endpoint, finish
    reason, flags), so memory stays a small fraction of the file (bench/read_generations.py). A
    duplicated key (two writers) keeps its first record. Fields missing from older records are None.
    """
    columns: dict[str, list[Any]] = {}
    shared: dict[Any, Any] = {}
    seen: set[tuple[str, str]] = set()
    rows = 0
    for _, _, head in iter_record_heads(Path(output_dir) / GENERATIONS_FILE):
        key = (head["dataset"], head["id"])
        if key in seen:
            continue
        seen.add(key)
        for name, value in head.items():
            column = columns.get(name)
            if column is None:
                column = columns[name] = [None] * rows
            if isinstance(value, list):
                value = tuple(value)
            if isinstance(value, (str, tuple)) and name != "id":
                value = shared.setdefault(value, value)
            column.append(value)
        rows += 1
        for column in columns.values():
            if len(column) < rows:
                column.append(None)
    return columns


class GenerationLog:
    """Random access to generations.jsonl by (dataset, id), holding only byte offsets in memory.

    >>> log = GenerationLog(output_dir); record = log.get(("ds", "id-1"))   # the full record, or None
    Built in one streaming pass; `get` seeks and parses one line. Raises InputError when a key is
    recorded twice (exactly-once broken), like `read_generations`.
    """

    def __init__(self, output_dir: str | Path):
        self.path = Path(output_dir) / GENERATIONS_FILE
        self.offsets: dict[tuple[str, str], int] = {}
        for line_number, offset, head in iter_record_heads(self.path):
            key = (head["dataset"], head["id"])
            if key in self.offsets:
                raise InputError(self.path, line_number, "id", f"{key} recorded twice; the file was edited or two "
                                 "runs wrote to the same folder at once")
            self.offsets[key] = offset
        self._handle = None

    def __len__(self) -> int:
        return len(self.offsets)

    def __contains__(self, key: tuple[str, str]) -> bool:
        return key in self.offsets

    def get(self, key: tuple[str, str]) -> dict[str, Any] | None:
        offset = self.offsets.get(key)
        if offset is None:
            return None
        if self._handle is None:
            self._handle = open(self.path, "rb")
        self._handle.seek(offset)
        return json.loads(self._handle.readline())

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Every indexed record in file order, one at a time (a torn last line is not one)."""
        wanted = set(self.offsets.values())
        with open(self.path, "rb") as handle:
            offset = 0
            for line in handle:
                if offset in wanted:
                    yield json.loads(line)
                offset += len(line)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None

    def __enter__(self) -> GenerationLog:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def read_generations(output_dir: str | Path) -> dict[tuple[str, str], dict[str, Any]]:
    """Every generation record by (dataset, id), text included. Raises if a key appears twice.

    Holds the whole log in memory (about 4x its size on disk): for large runs use `GenerationLog`
    (by key, offsets only), `generation_table` (no text) or `summarize_generations`.
    """
    path = Path(output_dir) / GENERATIONS_FILE
    records: dict[tuple[str, str], dict[str, Any]] = {}
    if not path.exists():
        return records
    for line_number, record in read_jsonl(path):
        key = (record["dataset"], record["id"])
        if key in records:
            raise InputError(path, line_number, "id", f"{key} recorded twice; the file was edited or two runs "
                             "wrote to the same folder at once")
        records[key] = record
    return records


def read_errors(output_dir: str | Path, exclude: set[tuple[str, str]] | frozenset = frozenset()
                ) -> dict[tuple[str, str], dict[str, Any]]:
    """The latest error record per (dataset, id), each with its `history` of earlier failures.

    exclude: keys answered since (an error superseded by an answer is no longer an error).
    """
    path = Path(output_dir) / ERRORS_FILE
    latest: dict[tuple[str, str], dict[str, Any]] = {}
    if not path.exists():
        return latest
    for line_number, record in read_jsonl(path):
        if not isinstance(record, dict) or "dataset" not in record or "id" not in record:
            raise InputError(path, line_number, None, "not an error record; is this the right output folder?")
        key = (record["dataset"], record["id"])
        if key in exclude:
            continue
        previous = latest.get(key)
        if previous is not None and not record.get("history"):
            # Written by an older kit version without history: chain the earlier failure in.
            record = {**record, "history": [*previous.get("history", []), failure_record(previous)]}
        latest[key] = record
    return latest


def failure_record(record: dict[str, Any]) -> dict[str, Any]:
    """One failed session, for an error record's history."""
    return {name: record.get(name) for name in ("session", "endpoint", "attempts", "kind", "status", "message", "at")}


def compact_errors(output_dir: str | Path, answered: set[tuple[str, str]]) -> dict[tuple[str, str], dict[str, Any]]:
    """Rewrite errors.jsonl (atomically) to one line per prompt still failing; returns those records."""
    path = Path(output_dir) / ERRORS_FILE
    latest = read_errors(output_dir, exclude=answered)
    if count_lines(path) != len(latest):
        write_jsonl(path, latest.values())
    return latest


def count_lines(path: str | os.PathLike) -> int:
    """Non-blank lines of a file (0 when it does not exist), read in one pass."""
    path = Path(path)
    if not path.exists():
        return 0
    with open(path, "rb") as handle:
        return sum(1 for raw in handle if raw.strip())


# ---------------------------------------------------------------------------------------------
# Counters, recounted from the files

@dataclass
class DatasetCounts:
    total: int = 0
    done: int = 0
    errors: int = 0
    truncated: int = 0
    flags: dict[str, int] = field(default_factory=lambda: {flag: 0 for flag in QUALITY_FLAGS})
    completion_tokens: int = 0       # summed over answers that report a length
    measured_answers: int = 0        # answers that report a length

    @property
    def mean_completion_tokens(self) -> float | None:
        return self.completion_tokens / self.measured_answers if self.measured_answers else None

    def add_answer(self, head: dict[str, Any]) -> None:
        self.done += 1
        self.truncated += bool(head.get("truncated"))
        for flag in head.get("flags") or []:
            self.flags[flag] = self.flags.get(flag, 0) + 1
        if isinstance(head.get("completion_tokens"), int):
            self.completion_tokens += head["completion_tokens"]
            self.measured_answers += 1


@dataclass
class GenerationSummary:
    """What a run (with everything resumed before it) holds, per dataset, read back from the files."""

    output_dir: Path
    datasets: dict[str, DatasetCounts]
    duplicate_prompt_ids: int
    requests_this_session: int
    elapsed_s: float
    interrupted: bool
    endpoints: list[dict[str, Any]]
    session: int = 0
    duplicate_records: int = 0       # keys recorded twice in generations.jsonl (counted once)

    @property
    def errors(self) -> int:
        return sum(counts.errors for counts in self.datasets.values())

    def table(self) -> list[dict[str, Any]]:
        """One row per dataset, for a pandas DataFrame."""
        return [{"dataset": name, "total": counts.total, "done": counts.done, "errors": counts.errors,
                 "truncated": counts.truncated, "mean_completion_tokens": counts.mean_completion_tokens,
                 **{f"flag_{flag}": n for flag, n in counts.flags.items()}}
                for name, counts in self.datasets.items()]


def count_answers(output_dir: Path, items: Sequence[PromptItem]) -> tuple[dict[str, DatasetCounts], set, int]:
    """Per-dataset counts of the answers on file for these prompts; (counts, answered keys, duplicates)."""
    datasets: dict[str, DatasetCounts] = {}
    wanted: dict[tuple[str, str], str] = {}
    for item in items:
        datasets.setdefault(item.dataset, DatasetCounts()).total += 1
        wanted[(item.dataset, item.id)] = item.dataset
    answered: set[tuple[str, str]] = set()
    duplicates = 0
    for _, _, head in iter_record_heads(output_dir / GENERATIONS_FILE):
        key = (head["dataset"], head["id"])
        if key in answered:
            duplicates += 1
            continue
        if key in wanted:
            answered.add(key)
            datasets[wanted[key]].add_answer(head)
    return datasets, answered, duplicates


def summarize_generations(output_dir: str | Path, sources: Sequence[PromptSource],
                          items: Sequence[PromptItem] | None = None) -> GenerationSummary:
    """Per-dataset totals, answers, current errors, truncations, quality flags and mean completion
    length, recounted from the files in one streaming pass (no answer text is held)."""
    output_dir = Path(output_dir)
    if items is None:
        items, _ = load_prompts(sources)
    datasets, answered, duplicates = count_answers(output_dir, items)
    errored = read_errors(output_dir, exclude=answered)
    for item in items:
        if (item.dataset, item.id) in errored:
            datasets[item.dataset].errors += 1
    if duplicates:
        logger.warning("%s: %d prompts recorded more than once (counted once)", output_dir / GENERATIONS_FILE,
                       duplicates)
    return GenerationSummary(output_dir=output_dir, datasets=datasets, duplicate_prompt_ids=0,
                             requests_this_session=0, elapsed_s=0.0, interrupted=False, endpoints=[],
                             duplicate_records=duplicates)


def progress_line(snapshot: dict[str, Any]) -> str:
    """The progress line of one metrics record, as the log shows it.

    progress 1h02m | B1 1200/9000, B2 300/5000 | errors 3 truncated 41 | 2.10 req/s 480 tok/s
    mean 231 tok | in flight 150 (sglang-kimi 150) | ETA short 3h10m long ? total ?
    The final line's rates are over the whole session (`rate_window_s`), the others' over the interval.
    """
    datasets = ", ".join(f"{name} {snapshot['done'][name]}/{snapshot['total'][name]}" for name in snapshot["done"])
    etas = " ".join(f"{name} {format_duration(eta)}" for name, eta in snapshot["eta_s"].items())
    mean = snapshot["mean_completion_tokens"]
    per_endpoint = ", ".join(f"{name} {count}" for name, count in snapshot.get("endpoints_in_flight", {}).items())
    label = f"final (session {snapshot.get('session', '?')}, rates over {format_duration(snapshot['rate_window_s'])})" \
        if snapshot.get("final") else "progress"
    return (f"{label} {format_duration(snapshot['elapsed_s'])} | {datasets} | errors {snapshot['errors']} "
            f"truncated {snapshot['truncated']} | {snapshot['requests_per_s']:.2f} req/s "
            f"{snapshot['completion_tokens_per_s']:.0f} tok/s mean {'-' if mean is None else f'{mean:.0f}'} tok | "
            f"in flight {snapshot['in_flight']} ({per_endpoint}) | ETA {etas} total {format_duration(snapshot['eta_total_s'])}")
