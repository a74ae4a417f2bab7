"""The blocking entry point of stage 3: `generate` runs the engine on its own event loop in a worker thread,
so it works the same in a terminal and inside Jupyter; Ctrl-C and SIGTERM stop it cleanly, then re-raise."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from eaglekit.config import PartitionParams
from eaglekit.generation.client import EndpointSpec
from eaglekit.generation.engine import GenerationEngine
from eaglekit.generation.logs import GenerationSummary
from eaglekit.generation.prompts import PromptSource


class _Terminated(BaseException):
    """Raised in the main thread by our SIGTERM handler, handled like Ctrl-C."""


def generate(sources: Sequence[PromptSource], endpoints: Sequence[EndpointSpec], output_dir: str | Path,
             partitions: Sequence[PartitionParams], **options: Any) -> GenerationSummary:
    """Generate an answer for every prompt not already answered in output_dir; blocks until done.

    The arguments are `GenerationEngine`'s (its docstring says each). The engine runs on its own event loop
    in a worker thread, so this works the same in a terminal and inside Jupyter (whose own loop is already
    running); Ctrl-C and SIGTERM stop it as `shutdown_grace_s` says.
    """
    kit_logger = logging.getLogger("eaglekit")
    if not kit_logger.hasHandlers():
        # The periodic progress line must be visible even when nobody configured logging.
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        kit_logger.addHandler(handler)
    if kit_logger.level == logging.NOTSET and kit_logger.getEffectiveLevel() > logging.INFO:
        kit_logger.setLevel(logging.INFO)  # only when nobody chose a level for the kit
    engine = GenerationEngine(sources, endpoints, output_dir, partitions, **options)
    return run_engine(engine)


def run_engine(engine: GenerationEngine) -> GenerationSummary:
    """Run an engine to completion in a worker thread; Ctrl-C / SIGTERM stop it cleanly, then re-raise."""
    outcome: dict[str, Any] = {}
    finished = threading.Event()

    try:  # uvloop where installed (Linux, macOS): ~15% off the client's CPU per request (bench/generation.py)
        from uvloop import run as run_loop
    except ImportError:
        run_loop = asyncio.run

    def work() -> None:
        try:
            outcome["summary"] = run_loop(engine.run())
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
