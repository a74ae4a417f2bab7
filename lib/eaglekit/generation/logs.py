"""Readers of stage 3's files with bounded memory: generations.jsonl, errors.jsonl, and the progress records.

Every record's small fields come before its text, so readers that need no text (resume, counters, the
notebook's tables) parse only the head of each line: memory and time do not grow with the answers.
Counters are recounted from the files, so they cover every session of a resumed run.
"""

from __future__ import annotations

import heapq
import json
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from eaglekit.generation.prompts import PromptItem, PromptSource, load_prompts
from eaglekit.generation.quality import QUALITY_FLAGS
from eaglekit.io import ClosesOnExit, InputError, format_duration, read_jsonl, write_jsonl

logger = logging.getLogger(__name__)

GENERATIONS_FILE = "generations.jsonl"
ERRORS_FILE = "errors.jsonl"
METRICS_FILE = "metrics.jsonl"
SESSIONS_FILE = "sessions.jsonl"


# Every record's small fields come before "content" (see `engine.GenerationEngine._record_answer`). In a JSON
# line, a quote inside a string value is escaped, so the first `, "content": ` is the key itself: the head
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


class GenerationLog(ClosesOnExit):
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
    duplicate_prompt_ids: int = 0
    requests_this_session: int = 0
    elapsed_s: float = 0.0
    interrupted: bool = False
    endpoints: list[dict[str, Any]] = field(default_factory=list)
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
    """Per-dataset counts of the answers on file for these prompts; (counts, answered keys, duplicates), the
    duplicates warned about."""
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
    if duplicates:
        logger.warning("%s: %d prompts recorded more than once (counted once)", output_dir / GENERATIONS_FILE,
                       duplicates)
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
    return GenerationSummary(output_dir=output_dir, datasets=datasets, duplicate_records=duplicates)


def progress_line(snapshot: dict[str, Any]) -> str:
    """The progress line of one metrics record, as the log shows it.

    progress 1h02m | B1 1200/9000, B2 300/5000 | errors 3 truncated 41 | 2.10 req/s 480 tok/s
    mean 231 tok | in flight 150 (sglang-kimi 150) | ETA short 3h10m, long at most 9h40m (0 answers of it yet:
    up to max_tokens), total at most 12h50m
    The final line's rates are over the whole session (`rate_window_s`), the others' over the interval; the
    ETA's words are `Eta.words` (records from before them carry only seconds).
    """
    datasets = ", ".join(f"{name} {snapshot['done'][name]}/{snapshot['total'][name]}" for name in snapshot["done"])
    words = snapshot.get("eta") or {name: format_duration(eta) for name, eta in snapshot["eta_s"].items()}
    etas = ", ".join(f"{name} {eta}" for name, eta in words.items())
    total = snapshot.get("eta_total") or format_duration(snapshot["eta_total_s"])
    mean = snapshot["mean_completion_tokens"]
    per_endpoint = ", ".join(f"{name} {count}" for name, count in snapshot.get("endpoints_in_flight", {}).items())
    label = f"final (session {snapshot.get('session', '?')}, rates over {format_duration(snapshot['rate_window_s'])})" \
        if snapshot.get("final") else "progress"
    return (f"{label} {format_duration(snapshot['elapsed_s'])} | {datasets} | errors {snapshot['errors']} "
            f"truncated {snapshot['truncated']} | {snapshot['requests_per_s']:.2f} req/s "
            f"{snapshot['completion_tokens_per_s']:.0f} tok/s mean {'-' if mean is None else f'{mean:.0f}'} tok | "
            f"in flight {snapshot['in_flight']} ({per_endpoint}) | ETA {etas}, total {total}")


# ---------------------------------------------------------------------------------------------
# The ETA, from tokens and the work in flight
#
# A request's time is its answer's length over the speed one sequence decodes at (tokens per second of
# latency, queue and prefill included). With a partition's `slots` full, its throughput is slots x that speed,
# and its work left is the prompts not yet sent x the expected answer length, plus what each request in flight
# has still to generate. Answer lengths are estimated from the answers finished so far with the ones still
# running counted as at least as long as they already are (Kaplan-Meier): early on only short answers have
# finished, and a plain mean of them is the bias that made a long partition's ETA look minutes long. Where the
# running answers may still end anywhere up to max_tokens, the figure is an upper bound ("at most"); before
# enough evidence there is no figure ("not yet known"), never a rate borrowed from another partition's request
# count.

ETA_MIN_ANSWERS = 8       # answers finished (this session) before any speed is trusted
ETA_MIN_SECONDS = 30.0    # seconds of sending before any speed is trusted (the first answers are quick ones)
ETA_WINDOW_S = 300.0      # the decode speed is measured over the answers finished in the last 5 minutes
ETA_TAIL_AT_RISK = 8      # lengths are known up to where this many answers (finished or running) still reach
ETA_RESOLVED = 0.1        # an estimate once its lower and upper bounds differ by less than this share


@dataclass(frozen=True)
class PartitionWork:
    """One partition's state at one moment, what its ETA reads (the engine fills it; tests make it up)."""

    name: str
    to_send: int                        # prompts of this session neither in flight nor finished
    in_flight_ages_s: Sequence[float]   # how long each request in flight has been running
    lengths: Sequence[int]              # completion tokens of each answer it finished this session
    recent: Sequence[tuple[int, float]]  # (completion tokens, latency s) of answers it finished in the window
    slots: int                          # requests in flight when it has the endpoints to itself
    max_tokens: int


@dataclass(frozen=True)
class Eta:
    """How long is left, as `kind` says: "done"; "estimate" (~seconds: its bounds agree within ETA_RESOLVED);
    "range" (low_s to seconds: answers still running may be long); "at most" (seconds: too few answers of the
    partition yet, so they are taken up to max_tokens); "not yet known" (`why` names the missing evidence).

    work_s / work_low_s: the partition's tokens at its full throughput (what a total sums); seconds / low_s
    include the drain's tail, until its last answer is in."""

    kind: str
    seconds: float | None = None
    low_s: float | None = None
    why: str = ""
    work_s: float = 0.0
    work_low_s: float = 0.0

    def words(self) -> str:
        if self.kind == "done":
            return "done"
        if self.seconds is None:
            return f"not yet known ({self.why})" if self.why else "not yet known"
        figure = {"estimate": "~", "at most": "at most "}.get(self.kind, "")
        if self.kind == "range":
            figure = f"{format_duration(self.low_s)} to "
        return f"{figure}{format_duration(self.seconds)}" + (f" ({self.why})" if self.why else "")


def _combined(kind: str, low: float, high: float, **fields) -> Eta:
    """An Eta from its bounds: an estimate (their middle) once they agree within ETA_RESOLVED."""
    if kind == "range" and high - low <= ETA_RESOLVED * high:
        return Eta("estimate", (low + high) / 2, low, **fields)
    return Eta(kind, high, low, **fields)


def decode_speed(recent: Sequence[tuple[int, float]]) -> float | None:
    """Tokens per second one sequence gets: generated tokens over the seconds their requests took."""
    seconds = sum(latency for _, latency in recent)
    tokens = sum(tokens for tokens, _ in recent)
    return tokens / seconds if seconds > 0 and tokens > 0 else None


def _survival(lengths: np.ndarray, running: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Kaplan-Meier steps of P(length > x): where each step starts (0 first) and its value; running answers
    are censored at what they made."""
    observations = np.sort(np.concatenate([lengths, running]))
    times, deaths = np.unique(lengths, return_counts=True)
    at_risk = len(observations) - np.searchsorted(observations, times, side="left")
    values = np.cumprod(1.0 - deaths / at_risk)
    return np.concatenate([[0.0], times]), np.concatenate([[1.0], values])


@dataclass(frozen=True)
class WorkLeft:
    """One bound (lower or upper) of a partition's work left, in tokens."""

    total: float          # every token still to generate: new answers and the rest of the running ones
    makespan: float       # the tokens one slot runs until the last answer is in (the drain's tail included)


def _schedule(rests: np.ndarray, jobs: np.ndarray, bulk: float, slots: int) -> float:
    """Greedy list scheduling, in tokens: the running rests hold their slots, `bulk` tokens spread evenly over
    all of them, then each job takes the first free slot; when the last one is done."""
    free = np.zeros(max(slots, len(rests)))
    free[:len(rests)] = np.sort(rests)[::-1]
    free = (free + bulk / len(free)).tolist()
    heapq.heapify(free)
    for job in jobs.tolist():
        heapq.heappush(free, heapq.heappop(free) + job)
    return max(free)


def work_left(lengths: Sequence[int], generated: Sequence[float], max_tokens: int, to_send: int, slots: int
              ) -> tuple[WorkLeft, WorkLeft]:
    """The tokens left, as (lower, upper) bounds: `to_send` new answers and the rest of each running one
    (`generated`: what each has made so far), and when the last ends with `slots` kept full as long as there
    is work.

    The running answers' lengths are censored at what they made. The lengths are known up to where fewer than
    ETA_TAIL_AT_RISK answers still reach (a curve from one or two answers past it says nothing); past it the
    lower bound ends every unfinished answer there, the upper bound lets it run on to max_tokens. The drain's
    tail comes from scheduling the last prompts (4 per slot, lengths at the distribution's quantiles, 3 orders
    averaged): long answers sent last are what keeps a partition running after its throughput says it is
    done."""
    end = float(max_tokens)
    finished = np.minimum(np.asarray(lengths, dtype=float), end)
    running = np.minimum(np.asarray(generated, dtype=float), end - 1.0)
    starts, values = _survival(finished, running)
    observations = np.sort(np.concatenate([finished, running]))
    last = float(observations[-ETA_TAIL_AT_RISK]) if len(observations) >= ETA_TAIL_AT_RISK else 0.0
    known = starts <= last
    known[0] = True
    starts, values = starts[known], values[known]
    stops = np.append(starts[1:], last)
    # The area of steps i.. up to `last`, and the step each running answer is on.
    after = np.append(np.cumsum((values * (stops - starts))[::-1])[::-1], 0.0)
    step = np.searchsorted(starts, running, side="right") - 1
    inside = running < last
    partial = np.where(inside, values[step] * (stops[step] - running) + after[step + 1], 0.0)
    last_jobs = min(to_send, 4 * max(1, slots))
    quantiles = (np.arange(last_jobs) + 0.5) / max(1, last_jobs)
    orders = [np.random.default_rng(seed).permutation(last_jobs) for seed in range(3)]
    bounds = []
    for tail in (0.0, float(values[-1])):  # lower bound, upper bound
        mean = float(after[0] + tail * (end - last))
        alive = np.where(inside, values[step], tail)
        rests = np.divide(partial + tail * (end - np.maximum(running, last)), alive,
                          out=np.zeros_like(running), where=alive > 0)
        # The lengths' distribution: each step's drop is the mass at its start; what is left at `last` sits at
        # `last` (lower) or max_tokens (upper). Its quantiles stand for the last prompts' answers; each
        # running answer's rest is drawn from it beyond what it made (the drain ends with the longest of them,
        # and the longest of several draws is longer than the longest of their means).
        points = np.append(starts[1:], last if tail == 0.0 else end)
        cumulative = np.cumsum(np.append(-np.diff(values), values[-1]))
        jobs = points[np.minimum(np.searchsorted(cumulative / cumulative[-1], quantiles), len(points) - 1)]
        below = np.where(running >= points[0], cumulative[np.maximum(np.searchsorted(points, running, "right") - 1, 0)], 0.0)
        bulk = (to_send - last_jobs) * mean
        spans = []
        for seed, order in enumerate(orders):
            draw = below + np.random.default_rng(seed).random(len(running)) * (cumulative[-1] - below)
            drawn = points[np.minimum(np.searchsorted(cumulative, draw), len(points) - 1)]
            spans.append(_schedule(np.maximum(drawn - running, 0.0), jobs[order], bulk, slots))
        makespan = float(np.mean(spans))
        bounds.append(WorkLeft(to_send * mean + float(rests.sum()), makespan))
    return bounds[0], bounds[1]


def partition_eta(work: PartitionWork, pooled_speed: float | None, evidence: str) -> Eta:
    """The time a partition's work takes at its own concurrency; see the section comment.

    pooled_speed: the decode speed over every partition's recent answers, used (for an upper bound only) while
    this partition has too few answers of its own. evidence: why no speed is trusted yet ("" when one is)."""
    if work.to_send == 0 and not work.in_flight_ages_s:
        return Eta("done", 0.0, 0.0)
    own = decode_speed(work.recent) if len(work.recent) >= ETA_MIN_ANSWERS else None
    speed = own or pooled_speed
    if evidence or speed is None:  # the run-wide reason is said once, on the total
        return Eta("not yet known", why="" if evidence else "no answer measured yet")
    generated = [speed * age for age in work.in_flight_ages_s]
    low, high = work_left(work.lengths, generated, work.max_tokens, work.to_send, work.slots)
    throughput = max(1, work.slots) * speed
    if own is None:
        answered = len(work.lengths)
        return Eta("at most", high.makespan / speed, None,
                   f"{answered} answer{'s' if answered != 1 else ''} of it yet: up to max_tokens",
                   high.total / throughput, high.total / throughput)
    return _combined("range", low.makespan / speed, high.makespan / speed, work_s=high.total / throughput,
                     work_low_s=low.total / throughput)


def run_etas(partitions: Sequence[PartitionWork], elapsed_s: float, min_seconds: float = ETA_MIN_SECONDS,
             overlap: bool = True) -> tuple[dict[str, Eta], Eta]:
    """Each partition's ETA and the whole run's, partitions in the order they are sent.

    With overlap (the engine's default) the next partition fills the room the last one's drain frees, so the
    total is the earlier partitions' work at full throughput plus the last one's time with its tail; without,
    each partition's drain adds up. Nothing is trusted before ETA_MIN_ANSWERS answers and `min_seconds` of
    sending."""
    answered = sum(len(work.lengths) for work in partitions)
    evidence = ""
    if elapsed_s < min_seconds:
        evidence = f"{elapsed_s:.0f} s of {min_seconds:.0f} s measured"
    elif answered < ETA_MIN_ANSWERS:
        evidence = f"{answered} of {ETA_MIN_ANSWERS} answers"
    pooled = decode_speed([answer for work in partitions for answer in work.recent])
    etas = {work.name: partition_eta(work, pooled, evidence) for work in partitions}
    open_etas = [eta for eta in etas.values() if eta.kind != "done"]
    if not open_etas:
        return etas, Eta("done", 0.0, 0.0)
    unknown = [name for name, eta in etas.items() if eta.kind == "not yet known"]
    if unknown:
        return etas, Eta("not yet known", why=evidence or f"{unknown[0]}: {etas[unknown[0]].why}")
    bounds = []
    for high in (False, True):
        ends = [eta.seconds if high else (eta.low_s or 0.0) for eta in open_etas]
        works = [eta.work_s if high else eta.work_low_s for eta in open_etas]
        bounds.append(max(sum(works[:-1]) + ends[-1], *ends) if overlap else sum(ends))
    waiting = [name for name, eta in etas.items() if eta.kind == "at most"]
    if waiting:  # a bound from max_tokens is no ETA: said, with the bound, but not as a figure
        return etas, Eta("not yet known", why=f"{waiting[0]} has no answers yet: at most {format_duration(bounds[1])}")
    return etas, _combined("range", bounds[0], bounds[1])
