"""The blocking entry point of stage 3: `generate` runs the engine on its own event loop in a worker thread,
so it works the same in a terminal and inside Jupyter; Ctrl-C and SIGTERM stop it cleanly, then re-raise."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from eaglekit.config import GenerationParams, PartitionParams
from eaglekit.generation.client import EndpointSpec
from eaglekit.generation.engine import GenerationEngine
from eaglekit.generation.logs import GenerationSummary
from eaglekit.generation.prompts import PromptSource


class _Terminated(BaseException):
    """Raised in the main thread by our SIGTERM handler, handled like Ctrl-C."""


def generate(sources: Sequence[PromptSource], endpoints: Sequence[EndpointSpec], output_dir: str | Path,
             partitions: Sequence[PartitionParams], *, temperature: float | None = None, top_p: float | None = None,
             extra_body: dict[str, Any] | None = None, chat_template_kwargs: dict[str, Any] | None = None,
             history_reasoning: str = "field", retry: GenerationParams = GenerationParams(), request_timeout_s: float = 3600.0, retry_errors: bool = True,
             log_interval_s: float = 60.0, flush_interval_s: float = 2.0, shutdown_grace_s: float = 30.0, progress_bar: bool = True,
             health_interval_s: float = 5.0, unhealthy_after: int = 3, probe_wait_s: float = 60.0,
             seed: int = 0, priority: Sequence[tuple[str, str]] | None = None,
             first_answers_check: Callable[[str, list[dict]], Any] | None = None,
             overlap_partitions: bool = True) -> GenerationSummary:
    """Generate an answer for every prompt not already answered in output_dir; blocks until done.

    sources: (dataset, partition, prompts.jsonl) triples. partitions: sent in this order, each with
    its concurrency (per endpoint) and max_tokens; once one has sent its last prompt the next starts in the room
    its drain frees (a request of a partition of concurrency C takes 1/C of an endpoint: `capacity.SharedPool`).
    overlap_partitions=False drains each partition before the next starts. temperature/top_p: None leaves the server default.
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
    first_answers_check: called with (dataset, records) on each dataset's first 32 answers of the session; what it
    raises stops the run (the stage's usage check: a systematic mismatch is said after minutes, not days).

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
        chat_template_kwargs=chat_template_kwargs, history_reasoning=history_reasoning, retry=retry, request_timeout_s=request_timeout_s, retry_errors=retry_errors,
        log_interval_s=log_interval_s, flush_interval_s=flush_interval_s, shutdown_grace_s=shutdown_grace_s, progress_bar=progress_bar,
        health_interval_s=health_interval_s, unhealthy_after=unhealthy_after, probe_wait_s=probe_wait_s, seed=seed,
        priority=priority, first_answers_check=first_answers_check, overlap_partitions=overlap_partitions)
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
