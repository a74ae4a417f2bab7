"""Stage 3: regenerate class-B prompts through the target's endpoints, resumable over days.

The engine keeps each partition's concurrency full: a new request starts the moment one finishes
(never waves that wait for their slowest member), partitions run in the order given (default short,
then long), and requests go to the least busy healthy endpoint (`eaglekit.generation.client`).

Files in output_dir, all append-only JSONL (torn last line repaired on open):
- generations.jsonl: one record per finished prompt (truncated ones included, flagged). Its small
  fields come first and `content` after them, so readers that need no text (resume, counters, the
  notebook's tables) parse only the head of each line: memory and time do not grow with the answers.
- errors.jsonl: prompts whose last attempt failed for good (a 400/413/422, or transient failures past
  the attempt limit), with the server's message and the history of earlier failed sessions. A
  retried prompt that fails again is appended with its whole history; the file is compacted to one
  line per still-failing prompt at the start and end of every session.
- metrics.jsonl: one line per log interval (cumulative counts, rates, in flight, ETA), `final` last.
- sessions.jsonl: one line per session (start time, what it had to do).
- endpoints.json: what each endpoint's probe found.

Resume is by stable (dataset, id), never by line count: outputs arrive out of order. A record is
written once, when its answer is complete; a kill at any moment loses at most the answers not yet
written (they are requested again), so the final file holds every prompt exactly once. Errored
prompts are retried once per session (`retry_errors`); nothing finished is requested again.

What stops a run: Ctrl-C or SIGTERM (in-flight requests get `shutdown_grace_s`, then are abandoned
and requested again on resume; SIGTERM exits 143), and an endpoint refusing the API key (401/403:
`EndpointAuthError`, raised at once; no prompt is marked failed by it).

`eaglekit.generation.tokenized.build_tokenized_data` turns generations into `tokenized_data.jsonl` per dataset
(DESIGN contract).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from eaglekit.config import GenerationParams, PartitionParams
from eaglekit.generation.client import (
    ChatAnswer,
    Endpoint,
    EndpointAuthError,
    EndpointPool,
    EndpointSpec,
    RequestRejected,
    TransientError,
)
from eaglekit.io import (
    format_duration,
    AppendLog,
    InputError,
    read_jsonl,
    repair_torn_tail,
    write_json,
    write_jsonl,
)

logger = logging.getLogger(__name__)

GENERATIONS_FILE = "generations.jsonl"
ERRORS_FILE = "errors.jsonl"
METRICS_FILE = "metrics.jsonl"
SESSIONS_FILE = "sessions.jsonl"
QUALITY_FLAGS = ("empty", "truncated", "repetition_loop", "reasoning_without_answer")
TRUNCATED_POLICIES = ("keep", "drop")
PROMPT_ROLES = ("user", "tool")
# A server answering 429/503 with Retry-After is honoured without spending the prompt's attempts,
# up to this many waits per prompt and session (then the waits count like any transient failure).
MAX_RETRY_AFTER_WAITS = 100


# ---------------------------------------------------------------------------------------------
# Inputs

@dataclass(frozen=True)
class PromptSource:
    """One stage-2 `prompts.jsonl`: conversations whose last message is the prompt to answer."""

    dataset: str
    partition: str
    path: Path


@dataclass(frozen=True)
class PartitionSettings:
    """How one partition runs: requests in flight per endpoint, and the completion budget."""

    name: str
    concurrency: int
    max_tokens: int

    @classmethod
    def from_params(cls, partition: PartitionParams) -> PartitionSettings:
        """One partition of params `generation.partitions`."""
        return cls(partition.name, partition.concurrency, partition.max_tokens)


@dataclass(frozen=True)
class RetryPolicy:
    """Transient failures retry with full-jitter exponential backoff: uniform(0, min(max, base x 2^(n-1))).

    No defaults here: they live in `config.GenerationParams` (`DEFAULT_RETRY` is built from them)."""

    max_attempts: int
    backoff_base_s: float
    backoff_max_s: float

    @classmethod
    def from_params(cls, generation: GenerationParams) -> RetryPolicy:
        """The retry settings of params `generation` (max_attempts, backoff_base_s, backoff_max_s)."""
        return cls(generation.max_attempts, generation.backoff_base_s, generation.backoff_max_s)

    def backoff_seconds(self, attempt: int, rng: random.Random) -> float:
        return rng.uniform(0.0, min(self.backoff_max_s, self.backoff_base_s * 2 ** (attempt - 1)))


DEFAULT_RETRY = RetryPolicy.from_params(GenerationParams())


@dataclass(frozen=True)
class PromptItem:
    dataset: str
    partition: str
    id: str
    messages: list[dict[str, Any]]          # what the server gets, in OpenAI shape
    tools: list[dict[str, Any]] | None = None  # the record's `meta.tools`, OpenAI function format


def _tool_call_request(call: Any, path: Path, line: int, where: str, fallback_id: str) -> dict[str, Any]:
    """One assistant tool call in the shape OpenAI-compatible servers accept (arguments as a JSON string)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InputError(path, line, f"{where}.function.name", "a tool call needs function.name (OpenAI shape)")
    arguments = function.get("arguments", {})
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": call.get("id") or fallback_id, "type": call.get("type") or "function",
            "function": {"name": function["name"], "arguments": arguments}}


def _request_messages(messages: list[Any], path: Path, line: int) -> list[dict[str, Any]]:
    """Validate a conversation and keep what the server needs: role, content, tool calls and their ids."""
    request: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict) or message.get("role") not in ("system", "user", "assistant", "tool"):
            raise InputError(path, line, where, "needs role system|user|assistant|tool and string content")
        tool_calls = message.get("tool_calls")
        content = message.get("content")
        if not isinstance(content, str) and not (content is None and tool_calls):
            raise InputError(path, line, where, "needs role system|user|assistant|tool and string content")
        out: dict[str, Any] = {"role": message["role"], "content": content}
        if tool_calls:
            if message["role"] != "assistant" or not isinstance(tool_calls, list):
                raise InputError(path, line, f"{where}.tool_calls", "only an assistant message carries a list of tool calls")
            # Fallback ids are 9 alphanumerics, the shape Mistral's template insists on (as prep writes them).
            out["tool_calls"] = [_tool_call_request(call, path, line, f"{where}.tool_calls[{number}]",
                                                    f"call{index:03d}{number:02d}")
                                 for number, call in enumerate(tool_calls)]
        if message["role"] == "tool":
            for key in ("tool_call_id", "name"):
                if isinstance(message.get(key), str):
                    out[key] = message[key]
        request.append(out)
    # A tool result without an id answers the call of the same position in the assistant turn before it.
    pending: list[str] = []
    for out in request:
        if out["role"] == "assistant":
            pending = [call["id"] for call in out.get("tool_calls", [])]
        elif out["role"] == "tool" and "tool_call_id" not in out and pending:
            out["tool_call_id"] = pending.pop(0)
    return request


def _request_tools(tools: Any, path: Path, line: int) -> list[dict[str, Any]] | None:
    """meta.tools as OpenAI `tools`: [{"type": "function", "function": {...}}]; bare functions are wrapped."""
    if tools is None or tools == []:
        return None
    if isinstance(tools, str):  # some datasets keep the definitions as a JSON string
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError:
            raise InputError(path, line, "meta.tools", "a string that is not JSON tool definitions") from None
    if not isinstance(tools, list):
        raise InputError(path, line, "meta.tools", "expected a list of tool definitions")
    request = []
    for index, tool in enumerate(tools):
        if isinstance(tool, dict) and isinstance(tool.get("function"), dict) and isinstance(tool["function"].get("name"), str):
            request.append({"type": tool.get("type") or "function", "function": tool["function"]})
        elif isinstance(tool, dict) and isinstance(tool.get("name"), str):
            request.append({"type": "function", "function": tool})
        else:
            raise InputError(path, line, f"meta.tools[{index}]", "needs function.name (OpenAI function format)")
    return request


def load_prompts(sources: Sequence[PromptSource]) -> tuple[list[PromptItem], int]:
    """Read every prompts file; returns (items in file order, duplicate ids skipped).

    Fails with the file, line and field on a malformed conversation.
    """
    items: list[PromptItem] = []
    seen: set[tuple[str, str]] = set()
    duplicates = 0
    for source in sources:
        path = Path(source.path)
        if not path.exists():
            raise FileNotFoundError(f"{path}: prompts file for dataset {source.dataset!r} not found; run stage 2 first")
        for line_number, conversation in read_jsonl(path):
            if not isinstance(conversation, dict):
                raise InputError(path, line_number, None, "expected a JSON object (a conversation)")
            conversation_id = conversation.get("id")
            if not isinstance(conversation_id, str) or not conversation_id:
                raise InputError(path, line_number, "id", "missing or not a non-empty string")
            messages = conversation.get("messages")
            if not isinstance(messages, list) or not messages:
                raise InputError(path, line_number, "messages", "missing or empty")
            request = _request_messages(messages, path, line_number)
            if request[-1]["role"] not in PROMPT_ROLES:
                raise InputError(path, line_number, f"messages[{len(messages) - 1}].role",
                                 f"last message is {request[-1]['role']!r}; a prompt to answer ends with a user "
                                 "(or tool) message (class-A conversations go straight to tokenization)")
            meta = conversation.get("meta")
            tools = _request_tools(meta.get("tools") if isinstance(meta, dict) else None, path, line_number)
            key = (source.dataset, conversation_id)
            if key in seen:
                duplicates += 1
                continue
            seen.add(key)
            items.append(PromptItem(source.dataset, source.partition, conversation_id, request, tools))
    return items, duplicates


# ---------------------------------------------------------------------------------------------
# Quality flags

def has_repetition_loop(text: str, min_span_chars: int = 200, max_period_chars: int = 200, min_repeats: int = 3) -> bool:
    """True when the text ends in a loop: a block of 1..max_period_chars characters repeated back to back.

    The last `span` characters have period p exactly when text[-span:] == text[-span-p:-p]; we need the
    periodic tail to cover at least max(min_span_chars, min_repeats x p) characters. Each check is a
    C-speed slice comparison, so a 16K-token answer costs well under a millisecond per period.
    """
    for period in range(1, max_period_chars + 1):
        span = max(min_span_chars, min_repeats * period)
        if len(text) < span + period:
            break
        if text[-span:] == text[-span - period:-period]:
            return True
    return False


def quality_flags(content: str, reasoning: str | None, finish_reason: str | None,
                  tool_calls: list | None = None) -> list[str]:
    """Flags for one answer, in QUALITY_FLAGS order. Filtering on them is a prep-for-training param.

    An answer that is only tool calls is not empty.
    """
    flags = []
    if not content.strip() and not (reasoning or "").strip() and not tool_calls:
        flags.append("empty")
    if finish_reason == "length":
        flags.append("truncated")
    if has_repetition_loop(content) or has_repetition_loop(reasoning or ""):
        flags.append("repetition_loop")
    if (reasoning or "").strip() and not content.strip() and not tool_calls:
        flags.append("reasoning_without_answer")
    return flags


# ---------------------------------------------------------------------------------------------
# Reading the generation log with bounded memory

# Every record's small fields come before "content" (see `_record_answer`). In a JSON line, a
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
            record = {**record, "history": [*previous.get("history", []), _failure(previous)]}
        latest[key] = record
    return latest


def _failure(record: dict[str, Any]) -> dict[str, Any]:
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


def _count_answers(output_dir: Path, items: Sequence[PromptItem]) -> tuple[dict[str, DatasetCounts], set, int]:
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
    datasets, answered, duplicates = _count_answers(output_dir, items)
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


# ---------------------------------------------------------------------------------------------
# The engine

@dataclass
class _PartitionProgress:
    total: int = 0            # to do this session
    finished: int = 0         # done or errored this session
    started_at: float | None = None
    ended_at: float | None = None

    def rate(self, now: float) -> float | None:
        if self.started_at is None or self.finished == 0:
            return None
        return self.finished / max(1e-9, (self.ended_at or now) - self.started_at)


class _Slot:
    """The endpoint slot one prompt's task holds. Released exactly once per acquire, on every path:
    by the attempt's `finally`, or by the task's done-callback if the task ends (even cancelled before
    it first ran) still holding it."""

    __slots__ = ("endpoint", "pool")

    def __init__(self, pool: EndpointPool, endpoint: Endpoint | None = None):
        self.pool, self.endpoint = pool, endpoint

    def release(self, transient_failure: bool = False) -> None:
        endpoint, self.endpoint = self.endpoint, None
        if endpoint is not None:
            self.pool.release(endpoint, transient_failure=transient_failure)


class GenerationEngine:
    """Runs prompts through endpoints; see `generate` for the blocking entry point and arguments."""

    def __init__(self, sources: Sequence[PromptSource], endpoints: Sequence[EndpointSpec], output_dir: str | Path,
                 partitions: Sequence[PartitionSettings], *, temperature: float | None = None,
                 top_p: float | None = None, extra_body: dict[str, Any] | None = None,
                 chat_template_kwargs: dict[str, Any] | None = None,
                 retry: RetryPolicy = DEFAULT_RETRY, request_timeout_s: float = 3600.0, retry_errors: bool = True,
                 log_interval_s: float = 60.0, flush_interval_s: float = 2.0, shutdown_grace_s: float = 30.0,
                 progress_bar: bool = True, health_interval_s: float = 5.0, unhealthy_after: int = 3,
                 probe_wait_s: float = 60.0, seed: int = 0):
        self.sources = list(sources)
        self.endpoint_specs = list(endpoints)
        self.output_dir = Path(output_dir)
        self.partitions = list(partitions)
        names = [partition.name for partition in self.partitions]
        if len(set(names)) != len(names):
            raise ValueError(f"partition names repeat: {names}")
        for source in self.sources:
            if source.partition not in names:
                raise ValueError(f"{source.path}: partition {source.partition!r} has no settings; known: {names}")
        for partition in self.partitions:
            if partition.concurrency < 1 or partition.max_tokens < 1:
                raise ValueError(f"partition {partition.name!r}: concurrency and max_tokens must be >= 1")
        labels = [spec.label for spec in self.endpoint_specs]
        if len(set(labels)) != len(labels):
            raise ValueError(f"endpoint names repeat: {labels}; give each endpoint its own name")
        if shutdown_grace_s < 0:
            raise ValueError(f"shutdown_grace_s must be >= 0, got {shutdown_grace_s}")
        self.temperature, self.top_p, self.extra_body = temperature, top_p, dict(extra_body or {})
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.retry = retry
        self.request_timeout_s = request_timeout_s
        self.retry_errors = retry_errors
        self.log_interval_s, self.flush_interval_s = log_interval_s, flush_interval_s
        self.shutdown_grace_s = shutdown_grace_s
        self.progress_bar = progress_bar
        self.health_interval_s, self.unhealthy_after, self.probe_wait_s = health_interval_s, unhealthy_after, probe_wait_s
        self.rng = random.Random(seed)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._abandon: asyncio.Event | None = None
        self._stopped_at: float | None = None
        self._fatal: BaseException | None = None
        self._stop_requested = threading.Event()  # set from any thread, before or during the run

    # -- control from other threads -----------------------------------------------------------

    def request_stop(self, abandon: bool = False) -> None:
        """Stop dispatching; in-flight requests get shutdown_grace_s (abandon=True: none). Thread-safe."""
        self._stop_requested.set()
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._set_stop, abandon)

    def _set_stop(self, abandon: bool) -> None:
        if self._stop is not None and not self._stop.is_set():
            self._stopped_at = time.monotonic()
            if self._fatal is None:
                logger.warning("stopping: no new requests; waiting up to %.0f s for %d in flight (rerun to resume)",
                               self.shutdown_grace_s, self.pool.in_flight)
            self._stop.set()
            self.pool.notify()
        if abandon and self._abandon is not None:
            self._abandon.set()

    def _fail_run(self, error: BaseException) -> None:
        """Stop at once for a run-wide fault (the key refused): nothing more is sent, in-flight abandoned."""
        if self._fatal is None:
            self._fatal = error
            logger.error("%s", error)
        self._set_stop(abandon=True)

    # -- run ----------------------------------------------------------------------------------

    async def run(self) -> GenerationSummary:
        self._loop = asyncio.get_running_loop()
        self._stop, self._abandon = asyncio.Event(), asyncio.Event()
        if self._stop_requested.is_set():
            self._stop.set()
            self._stopped_at = time.monotonic()
        session_started = time.monotonic()
        self.output_dir.mkdir(parents=True, exist_ok=True)
        items, duplicates = load_prompts(self.sources)
        if duplicates:
            logger.warning("%d duplicate prompt ids skipped (first occurrence kept)", duplicates)
        self.generations = AppendLog(self.output_dir / GENERATIONS_FILE)
        self.metrics = AppendLog(self.output_dir / METRICS_FILE, sync_every=1)
        errors_repaired = repair_torn_tail(self.output_dir / ERRORS_FILE)
        for path, repaired in ((self.generations.path, self.generations.repaired_bytes),
                               (self.output_dir / ERRORS_FILE, errors_repaired)):
            if repaired:
                logger.warning("%s: cut a torn last line (%d bytes) left by a crash", path, repaired)
        # Counters start from the files (every earlier session), so they stay cumulative and equal
        # to a recount at every moment: done, truncated, flags and completion lengths.
        self.datasets, answered, duplicate_records = _count_answers(self.output_dir, items)
        if duplicate_records:
            logger.warning("%s: %d prompts recorded more than once (counted once)", self.generations.path,
                           duplicate_records)
        self.previous_errors = compact_errors(self.output_dir, answered)
        self.errors = AppendLog(self.output_dir / ERRORS_FILE)
        self.errored_keys = set(self.previous_errors)
        sessions_path = self.output_dir / SESSIONS_FILE
        self.session = 1 + count_lines(sessions_path)
        todo_by_partition: dict[str, list[PromptItem]] = {partition.name: [] for partition in self.partitions}
        errored_here = 0
        for item in items:
            key = (item.dataset, item.id)
            if key in answered:
                continue
            if key in self.errored_keys:
                errored_here += 1
                self.datasets[item.dataset].errors += 1  # still failed until answered (or failed again)
                if not self.retry_errors:
                    continue
            todo_by_partition[item.partition].append(item)
        todo = sum(len(partition_items) for partition_items in todo_by_partition.values())
        with AppendLog(sessions_path, sync_every=1) as sessions:
            sessions.append({"session": self.session, "started_at": time.time(), "pid": os.getpid(),
                             "prompts": len(items), "done_before": len(answered), "errored_before": errored_here,
                             "to_request": todo})
        logger.info("session %d: %d prompts, %d already done, %d errored before (%s), %d to request",
                    self.session, len(items), len(answered), errored_here,
                    "retrying them" if self.retry_errors else "skipped", todo)
        self.progress = {name: _PartitionProgress(total=len(todo_by_partition[name])) for name in todo_by_partition}
        self.requests_this_session = 0
        self.completion_tokens_this_session = 0
        self.finished_this_session = 0
        self.session_started = session_started
        self.dispatch_started: float | None = None
        self._window = (time.monotonic(), 0, 0)  # (time, finished, completion tokens) at the last tick
        self.current_partition: str | None = None
        max_concurrency = max(partition.concurrency for partition in self.partitions)
        self.pool = EndpointPool(
            [Endpoint(spec, max_connections=max_concurrency, request_timeout_s=self.request_timeout_s)
             for spec in self.endpoint_specs],
            unhealthy_after=self.unhealthy_after, health_interval_s=self.health_interval_s)
        self.bar = tqdm(total=todo, desc="generation", unit="req", disable=not self.progress_bar, dynamic_ncols=True)
        background: list[asyncio.Task] = []
        try:
            if todo and not self._stop.is_set():
                await self.pool.probe_all(self.probe_wait_s)
                write_json(self.output_dir / "endpoints.json",
                           [{"name": endpoint.name, "base_url": endpoint.base_url,
                             "capabilities": asdict(endpoint.capabilities) if endpoint.capabilities else None}
                            for endpoint in self.pool.endpoints])
                health = asyncio.create_task(self.pool.health_loop())
                health.add_done_callback(self._background_ended)
                background = [health, asyncio.create_task(self._tick_loop())]
                self.dispatch_started = time.monotonic()
                for partition in self.partitions:
                    if self._stop.is_set():
                        break
                    await self._run_partition(partition, todo_by_partition[partition.name])
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            self._tick(final=True)
            self.bar.close()
            for log in (self.generations, self.errors, self.metrics):
                log.close()
            await self.pool.aclose()
        summary = summarize_generations(self.output_dir, self.sources, items=items)
        compact_errors(self.output_dir, {key for key in finished_keys(self.output_dir / GENERATIONS_FILE)})
        summary.duplicate_prompt_ids = duplicates
        summary.requests_this_session = self.requests_this_session
        summary.elapsed_s = time.monotonic() - session_started
        summary.interrupted = self._stop.is_set()
        summary.session = self.session
        summary.endpoints = [{"name": endpoint.name, "base_url": endpoint.base_url,
                              **(asdict(endpoint.capabilities) if endpoint.capabilities else {})}
                             for endpoint in self.pool.endpoints]
        write_json(self.output_dir / "summary.json", {**asdict(summary), "output_dir": str(self.output_dir),
                                                      "errors": summary.errors})
        if self._fatal is not None:
            raise self._fatal
        return summary

    def _background_ended(self, task: asyncio.Task) -> None:
        """A task of the run ended with an exception: stop the run and raise it from `run`."""
        if not task.cancelled() and task.exception() is not None:
            self._fail_run(task.exception())

    async def _run_partition(self, partition: PartitionSettings, items: list[PromptItem]) -> None:
        progress = self.progress[partition.name]
        self.current_partition = partition.name
        progress.started_at = time.monotonic()
        tasks: set[asyncio.Task] = set()
        for item in items:
            endpoint = await self.pool.acquire(partition.concurrency, self._stop)
            if endpoint is None:
                break
            slot = _Slot(self.pool, endpoint)
            task = asyncio.create_task(self._process(item, partition, slot))
            # The backstop: a task that ends holding its slot (cancelled before it first ran, or a
            # bug) gives it back, so no path can leave a slot taken and the run waiting for ever.
            task.add_done_callback(lambda _task, slot=slot: slot.release())
            # A task that fails (a full disk while recording) stops the run: nothing is lost silently.
            task.add_done_callback(self._background_ended)
            tasks.add(task)
            task.add_done_callback(tasks.discard)  # finished tasks are not kept: 80,000 of them add up
        await self._drain(tasks)
        progress.ended_at = time.monotonic()

    async def _drain(self, tasks: set[asyncio.Task]) -> None:
        """Wait for in-flight requests; once stopping, give them what is left of shutdown_grace_s
        (counted from the stop), then cancel them. Abandoned requests wrote nothing, so a rerun
        requests them again: still exactly once."""
        pending = set(tasks)
        if not pending:
            return
        all_done = asyncio.gather(*pending, return_exceptions=True)
        stop_waiter = asyncio.create_task(self._stop.wait())
        await asyncio.wait({all_done, stop_waiter}, return_when=asyncio.FIRST_COMPLETED)
        stop_waiter.cancel()
        if not all_done.done():
            grace = 0.0 if self._abandon.is_set() else \
                max(0.0, self.shutdown_grace_s - (time.monotonic() - (self._stopped_at or time.monotonic())))
            abandon_waiter = asyncio.create_task(self._abandon.wait())
            await asyncio.wait({all_done, abandon_waiter}, timeout=grace, return_when=asyncio.FIRST_COMPLETED)
            abandon_waiter.cancel()
            if not all_done.done():
                logger.warning("abandoning %d requests still in flight (requested again on resume)",
                               sum(not task.done() for task in pending))
                for task in pending:
                    task.cancel()
        results = await all_done
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
                raise result

    async def _process(self, item: PromptItem, partition: PartitionSettings, slot: _Slot) -> None:
        """One prompt to a final record: retry transient failures, record rejections and answers.

        Every attempt runs on a slot it releases in `finally`; a stop while waiting for a slot or
        backing off abandons the prompt unrecorded (requested again on resume).
        """
        attempts, waits = 0, 0
        failures: list[str] = []
        while True:
            if slot.endpoint is None:
                slot.endpoint = await self.pool.acquire(partition.concurrency, self._stop)
                if slot.endpoint is None:
                    return
            endpoint = slot.endpoint
            attempts += 1
            self.requests_this_session += 1
            started = time.monotonic()
            outcome: BaseException | ChatAnswer
            transient = False
            try:
                outcome = await endpoint.chat(item.messages, partition.max_tokens, self.temperature, self.top_p,
                                              self.extra_body, tools=item.tools,
                                              chat_template_kwargs=self.chat_template_kwargs)
            except TransientError as error:
                outcome = error
                if error.retry_after_s is not None:
                    endpoint.pause(error.retry_after_s)  # the server is alive and asks us to wait
                else:
                    transient = True
            except (RequestRejected, EndpointAuthError) as error:
                outcome = error
            except Exception as error:  # a client bug must cost one prompt, never the slot or the run
                logger.exception("%s/%s: unexpected error on %s", item.dataset, item.id, endpoint.name)
                outcome = error
            finally:
                slot.release(transient_failure=transient)
            latency = time.monotonic() - started
            if isinstance(outcome, ChatAnswer):
                self._record_answer(item, endpoint.name, attempts, latency, outcome)
                return
            if isinstance(outcome, EndpointAuthError):
                self._fail_run(outcome)  # not the prompt's fault: no record, requested again on resume
                return
            if isinstance(outcome, RequestRejected):
                self._record_error(item, endpoint.name, attempts, "rejected", outcome.status, outcome.message, failures)
                return
            if not isinstance(outcome, TransientError):
                self._record_error(item, endpoint.name, attempts, "client_error", None,
                                   f"{type(outcome).__name__}: {outcome}", failures)
                return
            failures.append(f"{endpoint.name}: {outcome.kind}")
            if outcome.retry_after_s is not None and waits < MAX_RETRY_AFTER_WAITS:
                # Honour the server's Retry-After: the endpoint is paused, `acquire` waits for it (or
                # routes to another endpoint), and the wait does not spend one of the prompt's attempts.
                waits += 1
                attempts -= 1
                logger.info("%s/%s: %s asks to retry after %.1f s (%s)", item.dataset, item.id, endpoint.name,
                            outcome.retry_after_s, outcome.kind)
                continue
            if attempts >= self.retry.max_attempts:
                self._record_error(item, endpoint.name, attempts, outcome.kind, outcome.status, outcome.message,
                                   failures)
                return
            # Back off, then take whichever endpoint is free and healthy (maybe another one).
            delay = self.retry.backoff_seconds(attempts, self.rng)
            logger.info("%s/%s attempt %d on %s: %s; retrying in %.1f s", item.dataset, item.id, attempts,
                        endpoint.name, str(outcome)[:200], delay)
            if await self._sleep_unless_stopped(delay):
                return

    async def _sleep_unless_stopped(self, seconds: float) -> bool:
        """Sleep; True when the run is stopping (the caller abandons its prompt)."""
        try:
            await asyncio.wait_for(self._stop.wait(), timeout=seconds)
            return True
        except asyncio.TimeoutError:
            return False

    # -- records --------------------------------------------------------------------------------

    def _record_answer(self, item: PromptItem, endpoint_name: str, attempts: int, latency: float,
                       answer: ChatAnswer) -> None:
        flags = quality_flags(answer.content, answer.reasoning, answer.finish_reason, answer.tool_calls)
        completion_tokens = answer.completion_tokens
        if completion_tokens is None and answer.token_ids is not None:
            completion_tokens = len(answer.token_ids)
        # Small fields first, "content" and the bulky fields after it: readers that need no text
        # (`iter_record_heads`) parse only the head of the line.
        record = {
            "dataset": item.dataset, "id": item.id, "partition": item.partition, "endpoint": endpoint_name,
            "session": self.session, "attempts": attempts, "latency_s": round(latency, 4),
            "prompt_tokens": answer.prompt_tokens, "completion_tokens": completion_tokens,
            "finish_reason": answer.finish_reason, "truncated": answer.finish_reason == "length", "flags": flags,
            "reasoning_field": answer.reasoning_field, "finished_at": time.time(),
            "content": answer.content, "reasoning": answer.reasoning, "tool_calls": answer.tool_calls,
            "prompt_token_ids": answer.prompt_token_ids, "token_ids": answer.token_ids}
        self.generations.append(record)
        key = (item.dataset, item.id)
        counts = self.datasets[item.dataset]
        counts.add_answer(record)
        if key in self.errored_keys:  # an earlier failure is superseded by this answer
            self.errored_keys.discard(key)
            counts.errors -= 1
        self.completion_tokens_this_session += completion_tokens or 0
        self._finished(item)

    def _record_error(self, item: PromptItem, endpoint_name: str, attempts: int, kind: str, status: int | None,
                      message: str, failures: list[str]) -> None:
        key = (item.dataset, item.id)
        previous = self.previous_errors.get(key)
        history = [*previous.get("history", []), _failure(previous)] if previous else []
        self.errors.append({"dataset": item.dataset, "id": item.id, "partition": item.partition,
                            "endpoint": endpoint_name, "session": self.session, "attempts": attempts, "kind": kind,
                            "status": status, "message": message, "at": time.time(),
                            "attempt_errors": failures[-20:], "history": history})
        if key not in self.errored_keys:
            self.errored_keys.add(key)
            self.datasets[item.dataset].errors += 1
        logger.info("%s/%s failed for good after %d attempts on %s: %s %s", item.dataset, item.id, attempts,
                    endpoint_name, kind, message[:200])
        self._finished(item)

    def _finished(self, item: PromptItem) -> None:
        self.progress[item.partition].finished += 1
        self.finished_this_session += 1
        self.bar.update(1)

    # -- progress -------------------------------------------------------------------------------

    async def _tick_loop(self) -> None:
        last_log = time.monotonic()
        while True:
            await asyncio.sleep(min(self.flush_interval_s, self.log_interval_s))
            self.generations.flush()
            self.errors.flush()
            if time.monotonic() - last_log >= self.log_interval_s:
                last_log = time.monotonic()
                self._tick()

    def _snapshot(self, final: bool) -> dict[str, Any]:
        """Cumulative counts (every session) and rates: over the last interval, or the whole session
        when final (the final line must not report the rate of its last half second)."""
        now = time.monotonic()
        finished, tokens = self.finished_this_session, self.completion_tokens_this_session
        window_time, window_finished, window_tokens = self._window
        self._window = (now, finished, tokens)
        if final:
            window_time = self.dispatch_started or now
            window_finished, window_tokens = 0, 0
        span = max(1e-9, now - window_time)
        etas: dict[str, float | None] = {}
        last_rate = None
        for partition in self.partitions:
            progress = self.progress[partition.name]
            rate = progress.rate(now) or last_rate  # not started yet: the last measured rate, a rough guess
            last_rate = progress.rate(now) or last_rate
            remaining = progress.total - progress.finished
            etas[partition.name] = 0.0 if remaining == 0 else (remaining / rate if rate else None)
        total_eta = None if any(eta is None for eta in etas.values()) else sum(etas.values())
        completion_tokens = sum(counts.completion_tokens for counts in self.datasets.values())
        measured = sum(counts.measured_answers for counts in self.datasets.values())
        flags = {flag: sum(counts.flags.get(flag, 0) for counts in self.datasets.values()) for flag in QUALITY_FLAGS}
        return {
            "time": time.time(), "session": self.session, "elapsed_s": round(now - self.session_started, 3),
            "partition": self.current_partition,
            "done": {name: counts.done for name, counts in self.datasets.items()},
            "total": {name: counts.total for name, counts in self.datasets.items()},
            "errors": sum(counts.errors for counts in self.datasets.values()),
            "truncated": sum(counts.truncated for counts in self.datasets.values()),
            "flags": flags,
            "rate_window_s": round(span, 3),
            "requests_per_s": round((finished - window_finished) / span, 4),
            "completion_tokens_per_s": round((tokens - window_tokens) / span, 2),
            "mean_completion_tokens": round(completion_tokens / measured, 2) if measured else None,
            "finished_this_session": finished, "requests_this_session": self.requests_this_session,
            "in_flight": self.pool.in_flight,
            "endpoints_in_flight": {endpoint.name: endpoint.in_flight for endpoint in self.pool.endpoints},
            "healthy_endpoints": sum(endpoint.healthy for endpoint in self.pool.endpoints),
            "eta_s": etas, "eta_total_s": total_eta}

    def _tick(self, final: bool = False) -> None:
        snapshot = self._snapshot(final)
        snapshot["final"] = final
        self.metrics.append(snapshot)
        self.bar.set_postfix(in_flight=snapshot["in_flight"], errors=snapshot["errors"],
                             truncated=snapshot["truncated"], refresh=False)
        logger.info("%s", progress_line(snapshot))


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


# ---------------------------------------------------------------------------------------------
# Blocking entry point

class _Terminated(BaseException):
    """Raised in the main thread by our SIGTERM handler, handled like Ctrl-C."""


def generate(sources: Sequence[PromptSource], endpoints: Sequence[EndpointSpec], output_dir: str | Path,
             partitions: Sequence[PartitionSettings], *, temperature: float | None = None, top_p: float | None = None,
             extra_body: dict[str, Any] | None = None, chat_template_kwargs: dict[str, Any] | None = None,
             retry: RetryPolicy = DEFAULT_RETRY, request_timeout_s: float = 3600.0, retry_errors: bool = True,
             log_interval_s: float = 60.0, flush_interval_s: float = 2.0, shutdown_grace_s: float = 30.0, progress_bar: bool = True,
             health_interval_s: float = 5.0, unhealthy_after: int = 3, probe_wait_s: float = 60.0,
             seed: int = 0) -> GenerationSummary:
    """Generate an answer for every prompt not already answered in output_dir; blocks until done.

    sources: (dataset, partition, prompts.jsonl) triples. partitions: run in this order, each with
    its concurrency (per endpoint) and max_tokens. temperature/top_p: None leaves the server default.
    extra_body: extra request fields (e.g. {"seed": 0}).
    chat_template_kwargs: `prep.chat_template_kwargs` (e.g. {"enable_thinking": False} for Qwen3), sent
    in every request as the top-level `chat_template_kwargs` (SGLang, vLLM, `transformers serve`), so
    the target renders the prompt as prep and `build_tokenized_data` do; omitted when empty.
    request_timeout_s: read timeout per request (a 16K-token answer at 10 tok/s takes ~27 min).
    retry_errors: on rerun, request again prompts that failed for good before.
    shutdown_grace_s: after Ctrl-C/SIGTERM, how long in-flight requests may finish (a second Ctrl-C
    abandons them). Then outputs are flushed and KeyboardInterrupt (or SystemExit 143) is raised.
    An endpoint that refuses the key (401/403) raises EndpointAuthError at once, with no prompt
    marked failed; a failure to write the outputs stops the run with its error.

    The engine runs on its own event loop in a worker thread, so this works the same in a terminal
    and inside Jupyter (whose own loop is already running).
    """
    kit_logger = logging.getLogger("eaglekit")
    if not kit_logger.hasHandlers():
        # The periodic progress line must be visible even when nobody configured logging.
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        kit_logger.addHandler(handler)
    if kit_logger.level == logging.NOTSET and kit_logger.getEffectiveLevel() > logging.INFO:
        kit_logger.setLevel(logging.INFO)  # only when nobody chose a level for the kit
    engine = GenerationEngine(
        sources, endpoints, output_dir, partitions, temperature=temperature, top_p=top_p, extra_body=extra_body,
        chat_template_kwargs=chat_template_kwargs, retry=retry, request_timeout_s=request_timeout_s, retry_errors=retry_errors,
        log_interval_s=log_interval_s, flush_interval_s=flush_interval_s, shutdown_grace_s=shutdown_grace_s, progress_bar=progress_bar,
        health_interval_s=health_interval_s, unhealthy_after=unhealthy_after, probe_wait_s=probe_wait_s, seed=seed)
    return run_engine(engine)


def run_event_loop(coroutine):
    """Run on uvloop where it is installed (Linux, macOS), else asyncio's own loop.

    uvloop takes ~15% off the client's CPU per request (bench/generation.py, instant endpoint).
    """
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)
    return uvloop.run(coroutine)


def run_engine(engine: GenerationEngine) -> GenerationSummary:
    """Run an engine to completion in a worker thread; Ctrl-C / SIGTERM stop it cleanly, then re-raise."""
    outcome: dict[str, Any] = {}
    finished = threading.Event()

    def work() -> None:
        try:
            outcome["summary"] = run_event_loop(engine.run())
        except BaseException as error:  # handed to the calling thread
            outcome["error"] = error
        finally:
            finished.set()

    in_main_thread = threading.current_thread() is threading.main_thread()
    previous_handler = None
    if in_main_thread:
        def on_sigterm(signum, frame):
            raise _Terminated()
        previous_handler = signal.signal(signal.SIGTERM, on_sigterm)
    thread = threading.Thread(target=work, name="eaglekit-generation", daemon=True)
    interruption: BaseException | None = None
    try:
        thread.start()
        # Wait on an Event, not Thread.join: on Python < 3.13 an exception raised by a signal handler
        # inside join() can leave the thread reported as finished while it still runs.
        try:
            while not finished.wait(0.2):
                pass
        except (KeyboardInterrupt, _Terminated) as error:
            interruption = error
            engine.request_stop()
            while True:
                try:
                    if finished.wait(0.2):
                        break
                except (KeyboardInterrupt, _Terminated):
                    engine.request_stop(abandon=True)
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous_handler)
    if "error" in outcome:
        raise outcome["error"]
    if isinstance(interruption, _Terminated):
        raise SystemExit(143)
    if interruption is not None:
        raise KeyboardInterrupt("generation stopped; outputs are flushed, rerun to resume") from None
    return outcome["summary"]
