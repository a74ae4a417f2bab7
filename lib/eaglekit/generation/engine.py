"""The async generation engine: every prompt through the endpoints, each partition's concurrency kept full.

A new request starts the moment one finishes (never waves that wait for their slowest member), partitions are
sent in the order given (default short, then long), and requests go to the least busy healthy endpoint
(`eaglekit.generation.client`). Once a partition has sent its last prompt, the next one starts in the room its
drain frees (`client.EndpointPool`), so the endpoints stay full through the change. Answers and errors are
appended to the files `eaglekit.generation.logs` reads; a progress record and line every `log_interval_s`,
with an ETA from tokens and the work in flight (`logs.run_etas`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import random
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from eaglekit.config import GenerationParams, PartitionParams
from eaglekit.generation.client import ChatAnswer, Endpoint, EndpointPool, EndpointSpec
from eaglekit.generation.errors import EndpointFatalError, RequestRejected, TransientError
from eaglekit.generation.logs import (
    ERRORS_FILE, ETA_MIN_SECONDS, ETA_WINDOW_S, GENERATIONS_FILE, METRICS_FILE, SESSIONS_FILE, GenerationSummary,
    PartitionWork, compact_errors, count_answers, count_lines, failure_record, finished_keys, progress_line, run_etas,
    summarize_generations)
from eaglekit.generation.prompts import PromptItem, PromptSource, load_prompts
from eaglekit.generation.quality import QUALITY_FLAGS, quality_flags
from eaglekit.generation.settings import (  # noqa: F401  (GenerationSettingsChanged: importable here)
    SETTINGS_FILE, GenerationSettingsChanged, backoff_seconds, check_generation_settings)
from eaglekit.generation.tokenized import EARLY_CHECK_ANSWERS
from eaglekit.io import AppendLog, repair_torn_tail, write_json

logger = logging.getLogger(__name__)

# A server answering 429/503 with Retry-After is honoured without spending the prompt's attempts,
# up to this many waits per prompt and session (then the waits count like any transient failure).
MAX_RETRY_AFTER_WAITS = 100


ETA_RECENT_ANSWERS = 64  # the decode speed reads at least this many latest answers, however old


@dataclass
class _PartitionProgress:
    """What the ETA of one partition reads (`logs.PartitionWork`), kept as the session goes."""

    total: int = 0            # to do this session
    finished: int = 0         # done or errored this session
    running: dict[int, float] = field(default_factory=dict)   # attempt -> when it was sent (monotonic)
    lengths: list[int] = field(default_factory=list)          # completion tokens of this session's answers
    recent: deque = field(default_factory=deque)              # (finished at, completion tokens, latency s)

    def add_answer(self, tokens: int | None, latency: float, now: float) -> None:
        if tokens is None:
            return
        self.lengths.append(tokens)
        self.recent.append((now, tokens, latency))
        while len(self.recent) > ETA_RECENT_ANSWERS and self.recent[0][0] < now - ETA_WINDOW_S:
            self.recent.popleft()


class _Slot:
    """The endpoint slot one prompt's task holds. Released exactly once per acquire, on every path:
    by the attempt's `finally`, or by the task's done-callback if the task ends (even cancelled before
    it first ran) still holding it."""

    __slots__ = ("endpoint", "limit", "pool")

    def __init__(self, pool: EndpointPool, limit: int, endpoint: Endpoint | None = None):
        self.pool, self.limit, self.endpoint = pool, limit, endpoint

    def release(self, transient_failure: bool = False) -> None:
        endpoint, self.endpoint = self.endpoint, None
        if endpoint is not None:
            self.pool.release(endpoint, transient_failure, self.limit)


class GenerationEngine:
    """Runs prompts through endpoints; `generate` is the blocking entry point.

    sources: (dataset, partition, prompts.jsonl) triples. partitions: sent in this order, each with its
    concurrency (per endpoint) and max_tokens; once one has sent its last prompt the next starts in the room
    its drain frees (a request of a partition of concurrency C takes 1/C of an endpoint:
    `client.EndpointPool`).
    overlap_partitions=False drains each partition before the next starts. temperature/top_p: None leaves the
    server default.
    extra_body: extra request fields (e.g. {"seed": 0}).
    chat_template_kwargs: `prep.chat_template_kwargs` (e.g. {"enable_thinking": False} for Qwen3), sent
    in every request as the top-level `chat_template_kwargs` (SGLang, vLLM, `transformers serve`), so
    the target renders the prompt as prep and `build_tokenized_data` do; omitted when empty.
    history_reasoning: how past assistant turns carry their reasoning, as prep renders them: "field"
    (`reasoning_content` on the message) or "fold" (`<think>...</think>` before the content); the stage
    takes it from the target's template (`prompts.history_reasoning_for`).
    request_timeout_s: read timeout per request (a 16K-token answer at 10 tok/s takes ~27 min).
    retry: params `generation` (its max_attempts, backoff_base_s and backoff_max_s are the ones read here).
    retry_errors: on rerun, request again prompts that failed for good before.
    shutdown_grace_s: after Ctrl-C/SIGTERM, how long in-flight requests may finish (a second Ctrl-C
    abandons them). Then outputs are flushed and KeyboardInterrupt (or SystemExit 143) is raised.
    An endpoint that refuses the key (401/403) raises EndpointAuthError at once, with no prompt
    marked failed; a failure to write the outputs stops the run with its error.
    priority: (dataset, id) keys in the order to request them within each partition (the stage passes prep's
    planned training order, `training.order`: the samples the first data sizes need are answered first).
    first_answers_check: called with (dataset, records) on each dataset's first EARLY_CHECK_ANSWERS answers of
    the session; what it raises stops the run (the stage's usage check: a systematic mismatch is said after
    minutes, not days).
    eta_min_seconds: seconds of sending before the progress line trusts a speed for its ETA.
    """

    def __init__(self, sources: Sequence[PromptSource], endpoints: Sequence[EndpointSpec], output_dir: str | Path,
                 partitions: Sequence[PartitionParams], *, temperature: float | None = None,
                 top_p: float | None = None, extra_body: dict[str, Any] | None = None,
                 chat_template_kwargs: dict[str, Any] | None = None, history_reasoning: str = "field",
                 retry: GenerationParams = GenerationParams(), request_timeout_s: float = 3600.0, retry_errors: bool = True,
                 log_interval_s: float = 60.0, flush_interval_s: float = 2.0, shutdown_grace_s: float = 30.0,
                 progress_bar: bool = True, health_interval_s: float = 5.0, probe_wait_s: float = 60.0, seed: int = 0,
                 priority: Sequence[tuple[str, str]] | None = None,
                 first_answers_check: Callable[[str, list[dict]], Any] | None = None,
                 overlap_partitions: bool = True, eta_min_seconds: float = ETA_MIN_SECONDS):
        self.sources = list(sources)
        # (dataset, id) in the order to request them (prep's planned training order); the rest after, in file
        # order.
        self.priority = {tuple(key): rank for rank, key in enumerate(priority or ())}
        self.endpoint_specs = list(endpoints)
        self.output_dir = Path(output_dir)
        self.partitions = list(partitions)
        names = [partition.name for partition in self.partitions]
        if len(set(names)) != len(names):
            raise ValueError(f"partition names repeat: {names}")
        for source in self.sources:
            if source.partition not in names:
                raise ValueError(f"{source.path}: partition {source.partition!r} has no settings; known: {names}")
        labels = [spec.label for spec in self.endpoint_specs]
        if len(set(labels)) != len(labels):
            raise ValueError(f"endpoint names repeat: {labels}; give each endpoint its own name")
        if shutdown_grace_s < 0:
            raise ValueError(f"shutdown_grace_s must be >= 0, got {shutdown_grace_s}")
        self.temperature, self.top_p, self.extra_body = temperature, top_p, dict(extra_body or {})
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.history_reasoning = history_reasoning
        self.retry = retry
        self.request_timeout_s = request_timeout_s
        self.retry_errors = retry_errors
        self.log_interval_s, self.flush_interval_s = log_interval_s, flush_interval_s
        self.shutdown_grace_s = shutdown_grace_s
        self.progress_bar = progress_bar
        # False: each partition drains before the next is sent (the engine before the overlap;
        # bench/generation.py)
        self.overlap_partitions = overlap_partitions
        # No ETA before this much sending (a bench's compressed run lowers it).
        self.eta_min_seconds = eta_min_seconds
        self.health_interval_s, self.probe_wait_s = health_interval_s, probe_wait_s
        self.rng = random.Random(seed)
        self._max_tokens = {partition.name: partition.max_tokens for partition in self.partitions}
        # A systematic fault in the answers (the server's template is not the kit's) shows in a dataset's
        # first answers of a session: `first_answers_check(dataset, records)` runs on them and an exception
        # stops the run.
        self.first_answers_check = first_answers_check
        self._first_records: dict[str, list[dict]] = defaultdict(list)
        self._first_checked: set[str] = set()
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
        self.session_started = time.monotonic()
        self.output_dir.mkdir(parents=True, exist_ok=True)
        items, duplicates = load_prompts(self.sources, self.history_reasoning)
        if duplicates:
            logger.warning("%d duplicate prompt ids skipped (first occurrence kept)", duplicates)
        if self.priority:  # each partition's prompts go out held-out set first, then in training order
            items.sort(key=lambda item: self.priority.get((item.dataset, item.id), len(self.priority)))
        answered = self._open_logs(items)
        todo_by_partition = self._start_session(items, answered)
        todo = sum(len(partition_items) for partition_items in todo_by_partition.values())
        self.progress = {name: _PartitionProgress(total=len(todo_by_partition[name])) for name in todo_by_partition}
        self.requests_this_session = 0
        self.dispatch_started: float | None = None
        self._window = (time.monotonic(), 0, 0)  # (time, finished, completion tokens) at the last tick
        self._attempt_ids = itertools.count()
        self.current_partition: str | None = None
        max_concurrency = max(partition.concurrency for partition in self.partitions)
        self.pool = EndpointPool(
            [Endpoint(spec, max_connections=max_concurrency, request_timeout_s=self.request_timeout_s)
             for spec in self.endpoint_specs],
            health_interval_s=self.health_interval_s)
        self.bar = tqdm(total=todo, desc="generation", unit="req", disable=not self.progress_bar, dynamic_ncols=True)
        background: list[asyncio.Task] = []
        try:
            if todo and not self._stop.is_set():
                await self._dispatch(todo_by_partition, bool(answered), background)
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            self._tick(final=True)
            self.bar.close()
            for log in (self.generations, self.errors, self.metrics):
                log.close()
            await self.pool.aclose()
        summary = self._summary(items, duplicates)
        if self._fatal is not None:
            raise self._fatal
        return summary

    def _open_logs(self, items: list[PromptItem]) -> set:
        """Open the append-only logs (cutting a torn last line a crash left) and count what earlier sessions
        answered: counters start from the files, so they stay cumulative and equal to a recount at every
        moment. Returns the keys answered already."""
        self.generations = AppendLog(self.output_dir / GENERATIONS_FILE)
        self.metrics = AppendLog(self.output_dir / METRICS_FILE, sync_every=1)
        errors_repaired = repair_torn_tail(self.output_dir / ERRORS_FILE)
        for path, repaired in ((self.generations.path, self.generations.repaired_bytes),
                               (self.output_dir / ERRORS_FILE, errors_repaired)):
            if repaired:
                logger.warning("%s: cut a torn last line (%d bytes) left by a crash", path, repaired)
        self.datasets, answered, _duplicates = count_answers(self.output_dir, items)
        self.previous_errors = compact_errors(self.output_dir, answered)
        self.errors = AppendLog(self.output_dir / ERRORS_FILE)
        self.errored_keys = set(self.previous_errors)
        return answered

    def _start_session(self, items: list[PromptItem], answered: set) -> dict[str, list[PromptItem]]:
        """This session's prompts by partition (errored ones only with retry_errors), recorded in
        sessions.jsonl."""
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
        return todo_by_partition

    async def _dispatch(self, todo_by_partition: dict[str, list[PromptItem]], resumed: bool,
                        background: list[asyncio.Task]) -> None:
        """Probe, check the settings against the run's, then send every partition (the long one in the room
        the short one's drain frees) and drain. The health and tick tasks go into `background`, for the caller
        to end."""
        await self.pool.probe_all(self.probe_wait_s)
        check_generation_settings(self.output_dir / SETTINGS_FILE, self._settings(), resumed)
        write_json(self.output_dir / "endpoints.json",
                   [{"name": endpoint.name, "base_url": endpoint.base_url,
                     "capabilities": asdict(endpoint.capabilities) if endpoint.capabilities else None}
                    for endpoint in self.pool.endpoints])
        health = asyncio.create_task(self.pool.health_loop())
        health.add_done_callback(self._background_ended)
        background += [health, asyncio.create_task(self._tick_loop())]
        self.dispatch_started = time.monotonic()
        tasks: set[asyncio.Task] = set()
        for partition in self.partitions:
            if self._stop.is_set():
                break
            await self._send_partition(partition, todo_by_partition[partition.name], tasks)
            if not self.overlap_partitions:
                await self._drain(tasks)
        await self._drain(tasks)

    def _summary(self, items: list[PromptItem], duplicates: int) -> GenerationSummary:
        """The recount of the files after this session, written to summary.json."""
        summary = summarize_generations(self.output_dir, self.sources, items=items)
        compact_errors(self.output_dir, finished_keys(self.output_dir / GENERATIONS_FILE))
        summary = replace(summary, duplicate_prompt_ids=duplicates, requests_this_session=self.requests_this_session,
                          elapsed_s=time.monotonic() - self.session_started, interrupted=self._stop.is_set(),
                          session=self.session,
                          endpoints=[{"name": endpoint.name, "base_url": endpoint.base_url,
                                      **(asdict(endpoint.capabilities) if endpoint.capabilities else {})}
                                     for endpoint in self.pool.endpoints])
        write_json(self.output_dir / "summary.json", {**asdict(summary), "output_dir": str(self.output_dir),
                                                      "errors": summary.errors})
        return summary

    def _settings(self) -> dict[str, Any]:
        """What decides an answer (never concurrency or routing): the served model, each partition's
        max_tokens, the sampling and the extra request fields. Kept in settings.json; a resume must match
        it."""
        models = sorted({endpoint.capabilities.served_model or endpoint.capabilities.model
                         for endpoint in self.pool.endpoints if endpoint.capabilities is not None})
        return {"model": models, "max_tokens": {partition.name: partition.max_tokens for partition in self.partitions},
                "temperature": self.temperature, "top_p": self.top_p, "extra_body": self.extra_body,
                "chat_template_kwargs": self.chat_template_kwargs}

    def _background_ended(self, task: asyncio.Task) -> None:
        """A task of the run ended with an exception: stop the run and raise it from `run`."""
        if not task.cancelled() and task.exception() is not None:
            self._fail_run(task.exception())

    async def _send_partition(self, partition: PartitionParams, items: list[PromptItem],
                              tasks: set[asyncio.Task]) -> None:
        """Send every prompt of a partition as room frees (`client.EndpointPool`); returns once the last is
        sent, its requests (and the earlier partitions' still in flight) in `tasks`."""
        if items and tasks:
            logger.info("partition %s starts while %d requests of %s are in flight, in the room they free",
                        partition.name, sum(not task.done() for task in tasks), self.current_partition)
        self.current_partition = partition.name
        for item in items:
            endpoint = await self.pool.acquire(partition.concurrency, self._stop)
            if endpoint is None:
                break
            slot = _Slot(self.pool, partition.concurrency, endpoint)
            task = asyncio.create_task(self._process(item, partition, slot))
            # The backstop: a task that ends holding its slot (cancelled before it first ran, or a
            # bug) gives it back, so no path can leave a slot taken and the run waiting for ever.
            task.add_done_callback(lambda _task, slot=slot: slot.release())
            # A task that fails (a full disk while recording) stops the run: nothing is lost silently.
            task.add_done_callback(self._background_ended)
            tasks.add(task)
            task.add_done_callback(tasks.discard)  # finished tasks are not kept: 80,000 of them add up

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

    async def _process(self, item: PromptItem, partition: PartitionParams, slot: _Slot) -> None:
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
            attempt = next(self._attempt_ids)
            running = self.progress[partition.name].running
            running[attempt] = started
            outcome: BaseException | ChatAnswer
            transient = False
            try:
                outcome = await endpoint.chat(item.messages, partition.max_tokens, self.temperature, self.top_p,
                                              self.extra_body, tools=item.tools,
                                              chat_template_kwargs=self.chat_template_kwargs)
            except TransientError as error:
                outcome, transient = error, error.retry_after_s is None
                if not transient:
                    endpoint.pause(error.retry_after_s)  # the server is alive and asks us to wait
            except (RequestRejected, EndpointFatalError) as error:
                outcome = error
            except Exception as error:  # a client bug must cost one prompt, never the slot or the run
                logger.exception("%s/%s: unexpected error on %s", item.dataset, item.id, endpoint.name)
                outcome = error
            finally:
                slot.release(transient_failure=transient)
                running.pop(attempt, None)
            latency = time.monotonic() - started
            if isinstance(outcome, ChatAnswer):
                self._record_answer(item, endpoint, attempts, latency, outcome)
                return
            if isinstance(outcome, EndpointFatalError):
                self._fail_run(outcome)  # not the prompt's fault: no record, requested again on resume
                return
            if isinstance(outcome, RequestRejected):
                self._record_error(item, endpoint.name, attempts, outcome.kind, outcome.status, outcome.message, failures)
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
            delay = backoff_seconds(self.retry, attempts, self.rng)
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

    def _record_answer(self, item: PromptItem, endpoint: Endpoint, attempts: int, latency: float,
                       answer: ChatAnswer) -> None:
        flags = quality_flags(answer.content, answer.reasoning, answer.finish_reason, answer.tool_calls)
        completion_tokens = answer.completion_tokens
        if completion_tokens is None and answer.token_ids is not None:
            completion_tokens = len(answer.token_ids)
        # Small fields first, "content" and the bulky fields after it: readers that need no text
        # (`iter_record_heads`) parse only the head of the line.
        record = {
            "dataset": item.dataset, "id": item.id, "partition": item.partition, "endpoint": endpoint.name,
            "session": self.session, "attempts": attempts, "latency_s": round(latency, 4),
            "prompt_tokens": answer.prompt_tokens, "completion_tokens": completion_tokens,
            "finish_reason": answer.finish_reason, "truncated": answer.finish_reason == "length", "flags": flags,
            "model": endpoint.capabilities.served_model or endpoint.capabilities.model,
            "max_tokens": self._max_tokens[item.partition], "temperature": self.temperature,
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
        self.progress[item.partition].add_answer(completion_tokens, latency, time.monotonic())
        self._finished(item)
        self._check_first_answers(item.dataset, record)

    def _check_first_answers(self, dataset: str, record: dict[str, Any]) -> None:
        if self.first_answers_check is None or dataset in self._first_checked:
            return
        first = self._first_records[dataset]
        first.append(record)
        if len(first) < EARLY_CHECK_ANSWERS:
            return
        self._first_checked.add(dataset)
        del self._first_records[dataset]
        try:
            self.first_answers_check(dataset, first)
        except Exception as error:  # the answers are kept; the run stops with the check's words
            self._fail_run(error)

    def _record_error(self, item: PromptItem, endpoint_name: str, attempts: int, kind: str, status: int | None,
                      message: str, failures: list[str]) -> None:
        key = (item.dataset, item.id)
        previous = self.previous_errors.get(key)
        history = [*previous.get("history", []), failure_record(previous)] if previous else []
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
        # This session's finished prompts and answer tokens, from what each partition's ETA reads.
        finished = sum(progress.finished for progress in self.progress.values())
        tokens = sum(sum(progress.lengths) for progress in self.progress.values())
        window_time, window_finished, window_tokens = self._window
        self._window = (now, finished, tokens)
        if final:
            window_time = self.dispatch_started or now
            window_finished, window_tokens = 0, 0
        span = max(1e-9, now - window_time)
        etas, total_eta = run_etas([self._work(partition, now) for partition in self.partitions],
                                   now - (self.dispatch_started or now), self.eta_min_seconds,
                                   overlap=self.overlap_partitions)
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
            "in_flight_by_partition": {name: len(progress.running) for name, progress in self.progress.items()},
            "endpoints_in_flight": {endpoint.name: endpoint.in_flight for endpoint in self.pool.endpoints},
            "healthy_endpoints": sum(endpoint.healthy for endpoint in self.pool.endpoints),
            "eta_s": {name: eta.seconds for name, eta in etas.items()}, "eta_total_s": total_eta.seconds,
            "eta": {name: eta.words() for name, eta in etas.items()}, "eta_total": total_eta.words()}

    def _work(self, partition: PartitionParams, now: float) -> PartitionWork:
        """A partition's state for its ETA; its slots are its concurrency on each healthy endpoint (capped
        there)."""
        progress = self.progress[partition.name]
        endpoints = [endpoint for endpoint in self.pool.endpoints if endpoint.healthy] or self.pool.endpoints
        slots = sum(min(partition.concurrency, endpoint.spec.concurrency or partition.concurrency)
                    for endpoint in endpoints)
        return PartitionWork(
            partition.name, to_send=progress.total - progress.finished - len(progress.running),
            in_flight_ages_s=[now - sent for sent in progress.running.values()], lengths=progress.lengths,
            recent=[(tokens, latency) for _, tokens, latency in progress.recent], slots=slots,
            max_tokens=partition.max_tokens)

    def _tick(self, final: bool = False) -> None:
        snapshot = self._snapshot(final)
        snapshot["final"] = final
        self.metrics.append(snapshot)
        self.bar.set_postfix(in_flight=snapshot["in_flight"], errors=snapshot["errors"],
                             truncated=snapshot["truncated"], refresh=False)
        logger.info("%s", progress_line(snapshot))
