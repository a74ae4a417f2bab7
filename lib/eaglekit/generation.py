"""Stage 3: regenerate class-B prompts through the target's endpoints, resumable over days.

The engine keeps each partition's concurrency full: a new request starts the moment one finishes
(never waves that wait for their slowest member), partitions run in the order given (default short,
then long), and requests go to the least busy healthy endpoint (`eaglekit.endpoints`).

Files in output_dir, all append-only JSONL (torn last line repaired on open):
- generations.jsonl: one record per finished prompt (truncated ones included, flagged).
- errors.jsonl: prompts that failed for good (a 400, or transient failures past the attempt limit),
  with the server's message. Rerunning retries them when retry_errors is set.
- metrics.jsonl: one line per log interval (rates, in flight, ETA) for the notebook's timeline.
- endpoints.json: what each endpoint's probe found.

Resume is by stable (dataset, id), never by line count: outputs arrive out of order. A record is
written once, when its answer is complete; a kill at any moment loses at most the answers not yet
written (they are requested again), so the final file holds every prompt exactly once.

`eaglekit.tokenized.build_tokenized_data` turns generations into `tokenized_data.jsonl` per dataset
(DESIGN contract).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import re
import signal
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from eaglekit.endpoints import Endpoint, EndpointPool, EndpointSpec, RequestRejected, TransientError
from eaglekit.io import AppendLog, InputError, read_jsonl, write_json

logger = logging.getLogger(__name__)

GENERATIONS_FILE = "generations.jsonl"
ERRORS_FILE = "errors.jsonl"
METRICS_FILE = "metrics.jsonl"
QUALITY_FLAGS = ("empty", "truncated", "repetition_loop", "reasoning_without_answer")
TRUNCATED_POLICIES = ("keep", "drop")
PROMPT_ROLES = ("user", "tool")


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


@dataclass(frozen=True)
class RetryPolicy:
    """Transient failures retry with full-jitter exponential backoff: uniform(0, min(max, base x 2^(n-1)))."""

    max_attempts: int = 8
    backoff_base_s: float = 1.0
    backoff_max_s: float = 60.0

    def backoff_seconds(self, attempt: int, rng: random.Random) -> float:
        return rng.uniform(0.0, min(self.backoff_max_s, self.backoff_base_s * 2 ** (attempt - 1)))


@dataclass(frozen=True)
class PromptItem:
    dataset: str
    partition: str
    id: str
    messages: list[dict[str, str]]   # what the server gets: role and content only


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
            for index, message in enumerate(messages):
                if not isinstance(message, dict) or not isinstance(message.get("content"), str) \
                        or message.get("role") not in ("system", "user", "assistant", "tool"):
                    raise InputError(path, line_number, f"messages[{index}]",
                                     "needs role system|user|assistant|tool and string content")
            if messages[-1]["role"] not in PROMPT_ROLES:
                raise InputError(path, line_number, f"messages[{len(messages) - 1}].role",
                                 f"last message is {messages[-1]['role']!r}; a prompt to answer ends with a user "
                                 "(or tool) message (class-A conversations go straight to tokenization)")
            key = (source.dataset, conversation_id)
            if key in seen:
                duplicates += 1
                continue
            seen.add(key)
            items.append(PromptItem(source.dataset, source.partition, conversation_id,
                                    [{"role": message["role"], "content": message["content"]} for message in messages]))
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


def quality_flags(content: str, reasoning: str | None, finish_reason: str | None) -> list[str]:
    """Flags for one answer, in QUALITY_FLAGS order. Filtering on them is a prep-for-training param."""
    flags = []
    if not content.strip() and not (reasoning or "").strip():
        flags.append("empty")
    if finish_reason == "length":
        flags.append("truncated")
    if has_repetition_loop(content) or has_repetition_loop(reasoning or ""):
        flags.append("repetition_loop")
    if (reasoning or "").strip() and not content.strip():
        flags.append("reasoning_without_answer")
    return flags


# ---------------------------------------------------------------------------------------------
# Resume

# Records start with dataset and id (insertion order), so resume reads them without parsing the
# (long) answer and token ids: a 10 GB generations file resumes in seconds.
_RECORD_KEY = re.compile(rb'^\{"dataset": ("(?:[^"\\]|\\.)*"), "id": ("(?:[^"\\]|\\.)*")')


def finished_keys(path: Path) -> set[tuple[str, str]]:
    """(dataset, id) of every record in an append-only JSONL file (generations or errors)."""
    keys: set[tuple[str, str]] = set()
    if not path.exists():
        return keys
    with open(path, "rb") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            match = _RECORD_KEY.match(line)
            if match:
                keys.add((json.loads(match.group(1)), json.loads(match.group(2))))
                continue
            try:
                record = json.loads(line)
                keys.add((record["dataset"], record["id"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                raise InputError(path, line_number, None, "not a generation record; is this the right output folder?") from None
    return keys


# ---------------------------------------------------------------------------------------------
# The engine

@dataclass
class DatasetCounts:
    total: int = 0
    done: int = 0
    errors: int = 0
    truncated: int = 0
    flags: dict[str, int] = field(default_factory=lambda: {flag: 0 for flag in QUALITY_FLAGS})


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

    def table(self) -> list[dict[str, Any]]:
        """One row per dataset, for a pandas DataFrame."""
        return [{"dataset": name, "total": counts.total, "done": counts.done, "errors": counts.errors,
                 "truncated": counts.truncated, **{f"flag_{flag}": n for flag, n in counts.flags.items()}}
                for name, counts in self.datasets.items()]


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


class GenerationEngine:
    """Runs prompts through endpoints; see `generate` for the blocking entry point and arguments."""

    def __init__(self, sources: Sequence[PromptSource], endpoints: Sequence[EndpointSpec], output_dir: str | Path,
                 partitions: Sequence[PartitionSettings], *, temperature: float | None = None,
                 top_p: float | None = None, extra_body: dict[str, Any] | None = None,
                 retry: RetryPolicy = RetryPolicy(), request_timeout_s: float = 3600.0, retry_errors: bool = True,
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
        self.temperature, self.top_p, self.extra_body = temperature, top_p, dict(extra_body or {})
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
            logger.warning("stopping: no new requests; waiting up to %.0f s for %d in flight (rerun to resume)",
                           self.shutdown_grace_s, self.pool.in_flight)
            self._stop.set()
            self.pool.notify()
        if abandon and self._abandon is not None:
            self._abandon.set()

    # -- run ----------------------------------------------------------------------------------

    async def run(self) -> GenerationSummary:
        self._loop = asyncio.get_running_loop()
        self._stop, self._abandon = asyncio.Event(), asyncio.Event()
        if self._stop_requested.is_set():
            self._stop.set()
        session_started = time.monotonic()
        self.output_dir.mkdir(parents=True, exist_ok=True)
        items, duplicates = load_prompts(self.sources)
        if duplicates:
            logger.warning("%d duplicate prompt ids skipped (first occurrence kept)", duplicates)
        self.generations = AppendLog(self.output_dir / GENERATIONS_FILE)
        self.errors = AppendLog(self.output_dir / ERRORS_FILE)
        self.metrics = AppendLog(self.output_dir / METRICS_FILE, sync_every=1)
        for log in (self.generations, self.errors):
            if log.repaired_bytes:
                logger.warning("%s: cut a torn last line (%d bytes) left by a crash", log.path, log.repaired_bytes)
        done = finished_keys(self.generations.path)
        errored = finished_keys(self.errors.path) - done
        skip = done if self.retry_errors else done | errored
        self.datasets: dict[str, DatasetCounts] = defaultdict(DatasetCounts)
        todo_by_partition: dict[str, list[PromptItem]] = {partition.name: [] for partition in self.partitions}
        for item in items:
            counts = self.datasets[item.dataset]
            counts.total += 1
            key = (item.dataset, item.id)
            if key in done:
                counts.done += 1
            elif key not in skip:
                todo_by_partition[item.partition].append(item)
            else:
                counts.errors += 1
        todo = sum(len(partition_items) for partition_items in todo_by_partition.values())
        logger.info("%d prompts, %d already done, %d errored before (%s), %d to request",
                    len(items), len(done), len(errored), "retrying them" if self.retry_errors else "skipped", todo)
        self.progress = {name: _PartitionProgress(total=len(todo_by_partition[name])) for name in todo_by_partition}
        self.requests_this_session = 0
        self.completion_tokens_total = 0
        self.answers_this_session = 0
        self.session_started = session_started
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
            if todo:
                await self.pool.probe_all(self.probe_wait_s)
                write_json(self.output_dir / "endpoints.json",
                           [{"base_url": endpoint.name, "capabilities": asdict(endpoint.capabilities) if endpoint.capabilities else None}
                            for endpoint in self.pool.endpoints])
                background = [asyncio.create_task(self.pool.health_loop()), asyncio.create_task(self._tick_loop())]
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
        interrupted = self._stop.is_set()
        summary = summarize_generations(self.output_dir, self.sources, items=items)
        summary.duplicate_prompt_ids = duplicates
        summary.requests_this_session = self.requests_this_session
        summary.elapsed_s = time.monotonic() - session_started
        summary.interrupted = interrupted
        summary.endpoints = [{"base_url": endpoint.name, **(asdict(endpoint.capabilities) if endpoint.capabilities else {})}
                             for endpoint in self.pool.endpoints]
        write_json(self.output_dir / "summary.json", {**asdict(summary), "output_dir": str(self.output_dir)})
        return summary

    async def _run_partition(self, partition: PartitionSettings, items: list[PromptItem]) -> None:
        progress = self.progress[partition.name]
        self.current_partition = partition.name
        progress.started_at = time.monotonic()
        tasks: set[asyncio.Task] = set()
        for item in items:
            endpoint = await self.pool.acquire(partition.concurrency, self._stop)
            if endpoint is None:
                break
            task = asyncio.create_task(self._process(item, partition, endpoint))
            tasks.add(task)
        await self._drain(tasks)
        progress.ended_at = time.monotonic()

    async def _drain(self, tasks: set[asyncio.Task]) -> None:
        """Wait for in-flight requests; once stopping, give them shutdown_grace_s, then cancel them."""
        if not tasks:
            return
        all_done = asyncio.gather(*tasks, return_exceptions=True)
        stop_waiter = asyncio.create_task(self._stop.wait())
        await asyncio.wait({all_done, stop_waiter}, return_when=asyncio.FIRST_COMPLETED)
        stop_waiter.cancel()
        if not all_done.done():
            abandon_waiter = asyncio.create_task(self._abandon.wait())
            await asyncio.wait({all_done, abandon_waiter}, timeout=self.shutdown_grace_s,
                               return_when=asyncio.FIRST_COMPLETED)
            abandon_waiter.cancel()
            if not all_done.done():
                # Abandoned requests wrote nothing, so a rerun requests them again: still exactly once.
                logger.warning("abandoning %d requests still in flight", sum(not task.done() for task in tasks))
                for task in tasks:
                    task.cancel()
        results = await all_done
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
                raise result

    async def _process(self, item: PromptItem, partition: PartitionSettings, endpoint: Endpoint | None) -> None:
        """One prompt to a final record: retry transient failures, record rejections and answers."""
        attempts = 0
        try:
            while True:
                attempts += 1
                self.requests_this_session += 1
                started = time.monotonic()
                try:
                    answer = await endpoint.chat(item.messages, partition.max_tokens, self.temperature, self.top_p,
                                                 self.extra_body)
                except TransientError as error:
                    self.pool.release(endpoint, transient_failure=True)
                    failed_on, endpoint = endpoint.name, None
                    if attempts >= self.retry.max_attempts:
                        self._record_error(item, failed_on, attempts, error.kind, error.status, error.message)
                        return
                    # Back off, then take whichever endpoint is free and healthy (maybe another one).
                    delay = self.retry.backoff_seconds(attempts, self.rng)
                    logger.info("%s/%s attempt %d on %s: %s; retrying in %.1f s", item.dataset, item.id, attempts,
                                failed_on, str(error)[:200], delay)
                    if await self._sleep_unless_stopped(delay):
                        return
                    endpoint = await self.pool.acquire(partition.concurrency, self._stop)
                    if endpoint is None:
                        return
                    continue
                except RequestRejected as error:
                    self.pool.release(endpoint, transient_failure=False)
                    failed_on, endpoint = endpoint.name, None
                    self._record_error(item, failed_on, attempts, "rejected", error.status, error.message)
                    return
                latency = time.monotonic() - started
                self.pool.release(endpoint, transient_failure=False)
                answered_by, endpoint = endpoint.name, None
                self._record_answer(item, answered_by, attempts, latency, answer)
                return
        except asyncio.CancelledError:
            if endpoint is not None:
                self.pool.release(endpoint, transient_failure=False)
            raise

    async def _sleep_unless_stopped(self, seconds: float) -> bool:
        """Sleep; True when the run is stopping (the caller abandons its prompt)."""
        try:
            await asyncio.wait_for(self._stop.wait(), timeout=seconds)
            return True
        except asyncio.TimeoutError:
            return False

    # -- records --------------------------------------------------------------------------------

    def _record_answer(self, item: PromptItem, endpoint_name: str, attempts: int, latency: float, answer) -> None:
        flags = quality_flags(answer.content, answer.reasoning, answer.finish_reason)
        completion_tokens = answer.completion_tokens
        if completion_tokens is None and answer.token_ids is not None:
            completion_tokens = len(answer.token_ids)
        # dataset and id first: `finished_keys` reads them without parsing the rest.
        self.generations.append({
            "dataset": item.dataset, "id": item.id, "partition": item.partition, "endpoint": endpoint_name,
            "attempts": attempts, "latency_s": round(latency, 4), "prompt_tokens": answer.prompt_tokens,
            "completion_tokens": completion_tokens, "finish_reason": answer.finish_reason,
            "truncated": answer.finish_reason == "length", "flags": flags, "finished_at": time.time(),
            "content": answer.content, "reasoning": answer.reasoning,
            "prompt_token_ids": answer.prompt_token_ids, "token_ids": answer.token_ids})
        counts = self.datasets[item.dataset]
        counts.done += 1
        counts.truncated += answer.finish_reason == "length"
        for flag in flags:
            counts.flags[flag] += 1
        self.answers_this_session += 1
        self.completion_tokens_total += completion_tokens or 0
        self._finished(item)

    def _record_error(self, item: PromptItem, endpoint_name: str, attempts: int, kind: str, status: int | None,
                      message: str) -> None:
        self.errors.append({"dataset": item.dataset, "id": item.id, "partition": item.partition,
                            "endpoint": endpoint_name, "attempts": attempts, "kind": kind, "status": status,
                            "message": message, "at": time.time()})
        self.datasets[item.dataset].errors += 1
        logger.info("%s/%s failed for good after %d attempts: %s %s", item.dataset, item.id, attempts, kind,
                    message[:200])
        self._finished(item)

    def _finished(self, item: PromptItem) -> None:
        self.progress[item.partition].finished += 1
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

    def _snapshot(self) -> dict[str, Any]:
        now = time.monotonic()
        finished = sum(progress.finished for progress in self.progress.values())
        window_time, window_finished, window_tokens = self._window
        span = max(1e-9, now - window_time)
        self._window = (now, finished, self.completion_tokens_total)
        etas: dict[str, float | None] = {}
        last_rate = None
        for partition in self.partitions:
            progress = self.progress[partition.name]
            rate = progress.rate(now) or last_rate  # not started yet: the last measured rate, a rough guess
            last_rate = progress.rate(now) or last_rate
            remaining = progress.total - progress.finished
            etas[partition.name] = 0.0 if remaining == 0 else (remaining / rate if rate else None)
        total_eta = None if any(eta is None for eta in etas.values()) else sum(etas.values())
        return {
            "time": time.time(), "elapsed_s": round(now - self.session_started, 3), "partition": self.current_partition,
            "done": {name: counts.done for name, counts in self.datasets.items()},
            "total": {name: counts.total for name, counts in self.datasets.items()},
            "errors": sum(counts.errors for counts in self.datasets.values()),
            "truncated": sum(counts.truncated for counts in self.datasets.values()),
            "requests_per_s": round((finished - window_finished) / span, 4),
            "completion_tokens_per_s": round((self.completion_tokens_total - window_tokens) / span, 2),
            "mean_completion_tokens": round(self.completion_tokens_total / self.answers_this_session, 2)
            if self.answers_this_session else None,
            "in_flight": self.pool.in_flight,
            "healthy_endpoints": sum(endpoint.healthy for endpoint in self.pool.endpoints),
            "eta_s": etas, "eta_total_s": total_eta}

    def _tick(self, final: bool = False) -> None:
        snapshot = self._snapshot()
        snapshot["final"] = final
        self.metrics.append(snapshot)
        self.bar.set_postfix(in_flight=snapshot["in_flight"], errors=snapshot["errors"],
                             truncated=snapshot["truncated"], refresh=False)
        datasets = ", ".join(f"{name} {snapshot['done'][name]}/{snapshot['total'][name]}" for name in snapshot["done"])
        etas = " ".join(f"{name} {_duration(eta)}" for name, eta in snapshot["eta_s"].items())
        mean = snapshot["mean_completion_tokens"]
        logger.info("%s %s | %s | errors %d truncated %d | %.2f req/s %.0f tok/s mean %s tok | in flight %d | "
                    "ETA %s total %s", "final" if final else "progress", _duration(snapshot["elapsed_s"]), datasets,
                    snapshot["errors"], snapshot["truncated"], snapshot["requests_per_s"],
                    snapshot["completion_tokens_per_s"], "-" if mean is None else f"{mean:.0f}",
                    snapshot["in_flight"], etas, _duration(snapshot["eta_total_s"]))


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


# ---------------------------------------------------------------------------------------------
# Blocking entry point

class _Terminated(BaseException):
    """Raised in the main thread by our SIGTERM handler, handled like Ctrl-C."""


def generate(sources: Sequence[PromptSource], endpoints: Sequence[EndpointSpec], output_dir: str | Path,
             partitions: Sequence[PartitionSettings], *, temperature: float | None = None, top_p: float | None = None,
             extra_body: dict[str, Any] | None = None, retry: RetryPolicy = RetryPolicy(),
             request_timeout_s: float = 3600.0, retry_errors: bool = True, log_interval_s: float = 60.0,
             flush_interval_s: float = 2.0, shutdown_grace_s: float = 30.0, progress_bar: bool = True,
             health_interval_s: float = 5.0, unhealthy_after: int = 3, probe_wait_s: float = 60.0,
             seed: int = 0) -> GenerationSummary:
    """Generate an answer for every prompt not already answered in output_dir; blocks until done.

    sources: (dataset, partition, prompts.jsonl) triples. partitions: run in this order, each with
    its concurrency (per endpoint) and max_tokens. temperature/top_p: None leaves the server default.
    extra_body: extra request fields (e.g. {"chat_template_kwargs": {"thinking": True}}).
    request_timeout_s: read timeout per request (a 16K-token answer at 10 tok/s takes ~27 min).
    retry_errors: on rerun, request again prompts that failed for good before.
    shutdown_grace_s: after Ctrl-C/SIGTERM, how long in-flight requests may finish (a second Ctrl-C
    abandons them). Then outputs are flushed and KeyboardInterrupt (or SystemExit 143) is raised.

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
        retry=retry, request_timeout_s=request_timeout_s, retry_errors=retry_errors, log_interval_s=log_interval_s,
        flush_interval_s=flush_interval_s, shutdown_grace_s=shutdown_grace_s, progress_bar=progress_bar,
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


# ---------------------------------------------------------------------------------------------
# Reading results back

def read_generations(output_dir: str | Path) -> dict[tuple[str, str], dict[str, Any]]:
    """Every generation record by (dataset, id). Raises if a key appears twice (exactly-once broken)."""
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


def summarize_generations(output_dir: str | Path, sources: Sequence[PromptSource],
                          items: Sequence[PromptItem] | None = None) -> GenerationSummary:
    """Per-dataset totals, answers, current errors, truncations and quality flags, from the files."""
    output_dir = Path(output_dir)
    if items is None:
        items, _ = load_prompts(sources)
    records = read_generations(output_dir)
    errored = finished_keys(output_dir / ERRORS_FILE)
    datasets: dict[str, DatasetCounts] = {}
    for item in items:
        counts = datasets.setdefault(item.dataset, DatasetCounts())
        counts.total += 1
        key = (item.dataset, item.id)
        record = records.get(key)
        if record is not None:
            counts.done += 1
            counts.truncated += bool(record.get("truncated"))
            for flag in record.get("flags", []):
                counts.flags[flag] = counts.flags.get(flag, 0) + 1
        elif key in errored:
            counts.errors += 1
    return GenerationSummary(output_dir=output_dir, datasets=datasets, duplicate_prompt_ids=0,
                             requests_this_session=0, elapsed_s=0.0, interrupted=False, endpoints=[])
