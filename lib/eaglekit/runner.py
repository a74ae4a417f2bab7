"""The pipeline runner: stage notebooks executed in order with papermill into a run folder.

`outputs/<run_id>/` receives `params.yaml` (resolved), `environment.json`, `run.log`,
`state.json` (which stages finished), and each executed notebook `NN_<stage>.ipynb`.
While a run lasts it also holds `space_reserve`: space kept so that, when the disk fills during a
stage, the runner can still say so in state.json, run.log and the executed notebook.
Stages are the notebooks `NN_<name>.ipynb` found in the notebooks folder; a notebook whose
metadata says `"eaglekit": {"needs_endpoint": true}` gets the endpoints (the embedded server,
started once for the run, when params name none).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import nbformat

from eaglekit.config import Params, dump_params, load_params, repo_path
from eaglekit.disk_full import (
    SPACE_RESERVE_BYTES, DiskFull, SpaceReserve, describe_os_error, free_space, is_disk_full, largest_files, naming)
from eaglekit.executed_notebook import failed_cell, mark_unfinished, notebook_saves, running_cell, settle_executed_notebook
from eaglekit.io import InputError, atomic_write, write_json
from eaglekit.paths import NOTEBOOKS_DIR
from eaglekit.run_folder import (
    RunFolderLock,
    RunLockedError,
    clear_stage_outcome,
    describe_load,
    machine_load,
    new_run_id,
    read_stage_outcome,
    read_state,
    write_environment,
)
from eaglekit.run_log import KERNEL_HOOK, RUN_LOG_ENV, STAGE_ENV, StageHeartbeat, run_logger

STAGE_FILE = re.compile(r"^(\d\d)_([a-z0-9_]+)\.ipynb$")


class RunError(RuntimeError):
    pass


@dataclass(frozen=True)
class Stage:
    number: str  # "01"
    name: str  # "survey"
    notebook: Path
    needs_endpoint: bool

    @property
    def label(self) -> str:
        return f"{self.number}_{self.name}"


def discover_stages(notebooks_dir: Path = NOTEBOOKS_DIR) -> list[Stage]:
    stages = []
    for path in sorted(Path(notebooks_dir).glob("*.ipynb")):
        match = STAGE_FILE.match(path.name)
        if not match:
            continue
        metadata = nbformat.read(path, as_version=4).metadata.get("eaglekit", {})
        stages.append(Stage(match[1], match[2], path, bool(metadata.get("needs_endpoint", False))))
    return stages


def select_stages(stages: list[Stage], wanted: list[str] | None) -> list[Stage]:
    """`wanted` holds stage names or numbers ("prep", "02", "02_prep"); None means all."""
    if not wanted:
        return stages
    chosen = []
    for item in wanted:
        match = [stage for stage in stages if item in (stage.name, stage.number, stage.label)]
        if not match:
            known = ", ".join(stage.label for stage in stages)
            raise RunError(f"unknown stage {item!r}; stages here: {known}")
        chosen.extend(stage for stage in match if stage not in chosen)
    return sorted(chosen, key=lambda stage: stage.number)


# ---- runner side -------------------------------------------------------------------------------

# After a stop, the kernel gets the in-flight grace plus this long (flush, reply) before it is killed.
KILL_MARGIN_S = 10.0


class RunInterrupted(RunError):
    """The run was stopped by a signal; the exit status is 128 + the signal number (130, 143)."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum
        self.exit_status = 128 + signum


class _StageControl:
    """Owns the signals while a run lasts and the stage kernel while a stage runs.

    SIGINT/SIGTERM during a stage do not raise inside papermill (which would tear down ZeroMQ
    mid-poll and kill the kernel at once): they interrupt the kernel (SIGINT to its process group,
    so library code sees KeyboardInterrupt and gives in-flight work `grace_s`), and the kernel is
    killed only if it has not finished `grace_s + KILL_MARGIN_S` later. A second signal interrupts
    again (the generation engine then abandons what is in flight) and shortens the wait to the margin.
    Outside a stage a signal raises RunInterrupted at once.
    """

    def __init__(self, grace_s: float, logger: logging.Logger):
        self.grace_s = grace_s
        self.logger = logger
        self.signum: int | None = None
        self.process: subprocess.Popen | None = None
        self.in_stage = False
        self.killed_after_grace = False
        self.helpers: list = []  # processes beside the kernel that a stop reaches too (the staged worker)
        self._timer: threading.Timer | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, self._on_signal)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
        self._cancel_timer()

    def kernel_started(self, process: subprocess.Popen) -> None:
        self.process = process
        if self.signum is not None:  # stopped while the kernel was starting
            self._interrupt_kernel(KILL_MARGIN_S)

    def stage_ended(self) -> None:
        self._cancel_timer()
        self.process = None
        self.in_stage = False

    def _on_signal(self, signum: int, frame) -> None:
        first = self.signum is None
        self.signum = self.signum or signum
        name = signal.Signals(signum).name
        if not self.in_stage:
            raise RunInterrupted(f"stopped by {name}", self.signum)
        if self.process is None:  # the kernel is starting: it is interrupted once it is up
            return
        if first:
            self.logger.warning("%s: interrupting the stage; in-flight work gets up to %.0f s "
                                "(generation.shutdown_grace_s), the kernel is stopped after %.0f s",
                                name, self.grace_s, self.grace_s + KILL_MARGIN_S)
            self._interrupt_kernel(self.grace_s + KILL_MARGIN_S)
        else:
            self.logger.warning("%s again: abandoning in-flight work; the kernel is stopped within %.0f s",
                                name, KILL_MARGIN_S)
            self._interrupt_kernel(KILL_MARGIN_S)

    def _interrupt_kernel(self, kill_after_s: float) -> None:
        self._signal_kernel(signal.SIGINT)
        self._cancel_timer()
        self._timer = threading.Timer(kill_after_s, self._kill_kernel)
        self._timer.daemon = True
        self._timer.start()

    def _kill_kernel(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.killed_after_grace = True
            self.logger.warning("the stage kernel did not stop within the grace period: killing it")
            self._signal_kernel(signal.SIGKILL)

    def _signal_kernel(self, signum: int) -> None:
        for helper in self.helpers:
            helper.signal(signum)
        process = self.process
        if process is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            # The kernel leads its own process group (jupyter_client starts it in a new session).
            os.killpg(process.pid, signum)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def _stage_kernel_manager(control: _StageControl, lock_fd: int, run_log: Path, stage: Stage) -> type:
    """A kernel manager class for one stage: the kernel inherits the run-folder lock, learns where
    run.log is, installs the logging hook at start-up, and is handed to `control` once launched."""
    from jupyter_client.manager import AsyncKernelManager

    class StageKernelManager(AsyncKernelManager):
        async def start_kernel(self, **kw) -> None:
            # start_kernel's keywords reach the kernel's Popen (pass_fds, env) and its command line
            # (extra_arguments).
            kw["pass_fds"] = (*kw.get("pass_fds", ()), lock_fd)
            # No progress bars in a headless stage (transformers' and the hub's read this at import): a bar
            # rendered into the executed notebook stays frozen at its first frame; run.log has the progress
            # lines.
            kw["env"] = {**(kw.get("env") or os.environ), RUN_LOG_ENV: str(run_log), STAGE_ENV: stage.label,
                         "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
            kw["extra_arguments"] = [*kw.get("extra_arguments", []), f"--IPKernelApp.exec_lines={KERNEL_HOOK}"]
            await super().start_kernel(**kw)
            control.kernel_started(self.provisioner.process)

        async def _async_interrupt_kernel(self) -> None:
            # jupyter_client interrupts before every shutdown; an idle kernel caught mid-message then logs
            # "KeyboardInterrupt caught in kernel" into the runner's output. Stops are _StageControl's job.
            # The one private hook left: shutdown_kernel calls _async_interrupt_kernel itself (jupyter_client
            # 8.10), so overriding the public interrupt_kernel alone would not skip it.
            if not self.shutting_down:
                await super()._async_interrupt_kernel()

        interrupt_kernel = _async_interrupt_kernel

    return StageKernelManager


def _save_params(run_dir: Path, params: Params) -> None:
    """params.yaml is the resolved params; on a resume with changed params the old file is kept beside it."""
    text = dump_params(params)
    path = run_dir / "params.yaml"
    if path.exists() and path.read_text(encoding="utf-8") != text:
        stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        shutil.copy2(path, run_dir / f"params.before-{stamp}.yaml")
    with naming(path), atomic_write(path) as handle:
        handle.write(text)


def _now() -> str:
    return dt.datetime.now().astimezone().isoformat(timespec="seconds")


def _logged_error(logger: logging.Logger, message: str) -> RunError:
    """The RunError to raise with `message`, which run.log (and the terminal) get first."""
    logger.error(message)
    return RunError(message)


def run_pipeline(
    params_path: str | Path,
    stages: list[str] | None = None,
    run_id: str | None = None,
    resume: bool = False,
    notebooks_dir: Path = NOTEBOOKS_DIR,
    staged: bool | None = None,
) -> Path:
    """Run the selected stages; returns the run folder.

    staged (None: params' run.staged): while stage 3 runs, a worker trains each finished data size and
    rewrites the forecast (`eaglekit.staged`); stages 4-6 then run over all the data as always.

    Raises RunError naming the failed cell (or the dead kernel), RunInterrupted after SIGINT/SIGTERM,
    RunLockedError when another live process writes into the run folder. A stage that finishes but
    records errors (`eaglekit.run_folder.record_stage_outcome`) does not stop the run; it is reported
    "done with N errors" and `--resume` runs it again.
    """
    params = load_params(params_path)  # fail before creating anything
    all_stages = discover_stages(notebooks_dir)
    if not all_stages:
        raise RunError(f"no stage notebooks (NN_name.ipynb) in {notebooks_dir}")
    chosen = select_stages(all_stages, stages)
    outputs = repo_path(params.run.outputs_dir)
    if resume:
        if not run_id:
            raise RunError("--resume needs --run-id: the run folder to continue")
        run_dir = outputs / run_id
        if not run_dir.is_dir():
            raise RunError(f"--resume: no run folder {run_dir}")
    else:
        run_id = run_id or new_run_id(params.run.name)
        run_dir = outputs / run_id
        outputs.mkdir(parents=True, exist_ok=True)
        try:
            run_dir.mkdir()
        except FileExistsError:
            raise RunError(f"run folder {run_dir} exists and runs are never overwritten: pick another --run-id or pass --resume") from None
    staged = params.run.staged if staged is None else staged
    resume_command = f"eaglekit run {params_path} --run-id {run_id} --resume{' --staged' if staged else ''}"
    try:
        lock = RunFolderLock(run_dir).acquire()
    except RunLockedError as error:
        raise RunError(str(error)) from None
    except OSError as error:
        if not is_disk_full(error):
            raise
        raise RunError(f"run {run_id}: cannot take the run folder's lock: {describe_os_error(error)} writing {error.filename}; "
                       f"{free_space(run_dir)}; free space, then continue with: {resume_command}") from None
    try:
        return _run_locked(params, run_id, run_dir, chosen, resume, resume_command, lock, staged)
    finally:
        lock.release()


def _run_locked(params: Params, run_id: str, run_dir: Path, chosen: list[Stage], resume: bool, resume_command: str,
                lock: RunFolderLock, staged: bool) -> Path:
    logger = run_logger(run_dir)
    try:
        state = read_state(run_dir)
    except InputError as error:  # a state.json edited by hand: the runner writes it whole
        raise _logged_error(logger, f"run {run_id}: {error}") from None
    reserve = SpaceReserve(run_dir)
    try:
        (run_dir / "figures").mkdir(exist_ok=True)
        reserve.make()
        _save_params(run_dir, params)
        with naming(run_dir / "environment.json"):
            write_environment(run_dir)
    except OSError as error:
        reserve.release()
        if not is_disk_full(error):
            raise
        raise _logged_error(logger, f"run {run_id}: no room to start: {describe_os_error(error)} writing {error.filename}; "
                            f"{free_space(run_dir)} (the runner keeps {SPACE_RESERVE_BYTES >> 10} KiB for its own records); "
                            f"free space, then continue with: {resume_command}") from None
    try:
        return _run_stages(params, run_id, run_dir, chosen, resume, resume_command, lock, staged, logger, state, reserve)
    finally:
        reserve.release()


def _run_stages(params: Params, run_id: str, run_dir: Path, chosen: list[Stage], resume: bool, resume_command: str,
                lock: RunFolderLock, staged: bool, logger: logging.Logger, state: dict, reserve: SpaceReserve) -> Path:
    from traitlets.config import Config

    from eaglekit.generation.server import serving_endpoints
    from eaglekit.staged.launch import staged_serving_params

    if resume:
        done = list(state["completed"])
        if state["running"]:
            logger.warning("stage %s was running when its runner stopped without a word (killed or crashed)", state["running"])
        chosen = [stage for stage in chosen if stage.label not in done]
        logger.info("resuming run %s: done already %s; to run %s", run_id, ", ".join(done) or "none",
                    ", ".join(stage.label for stage in chosen) or "nothing")
    logger.info("run %s: stages %s -> %s", run_id, [stage.label for stage in chosen], run_dir)

    # The kernel's ZMQ sockets on 127.0.0.1 use CurveZMQ when the kernelspec supports it
    # (ipykernel does), instead of plain text and a warning from every stage.
    kernel_config = Config({"KernelManager": {"transport_encryption": "auto"}})
    control = _StageControl(params.generation.shutdown_grace_s, logger)
    control.install()
    try:
        with contextlib.ExitStack() as serving:
            endpoints = None
            for index, stage in enumerate(chosen):
                if stage.needs_endpoint and endpoints is None:
                    logger.info("starting endpoints (embedded server unless params name endpoints)")
                    served = staged_serving_params(params) if staged else params
                    endpoints = serving.enter_context(serving_endpoints(served, log_path=run_dir / "server.log"))
                    logger.info("endpoints: %s", [endpoint.url for endpoint in endpoints])
                elif endpoints is not None and not any(later.needs_endpoint for later in chosen[index:]):
                    # the embedded server's memory and cores go to the stages after generation
                    serving.close()
                    endpoints = None
                    logger.info("endpoints stopped: no later stage needs them")
                try:
                    with _staged_worker(staged and stage.name == "generation", run_dir, state, control, logger, lock):
                        _run_stage(stage, params, run_dir, endpoints, state, control, logger, lock, resume_command,
                                   kernel_config)
                except (OSError, DiskFull) as error:
                    if isinstance(error, OSError) and not is_disk_full(error):
                        raise
                    full = error if isinstance(error, DiskFull) else DiskFull.from_os_error(error, run_dir, run_dir / stage.notebook.name)
                    raise _stage_failed_on_full_disk(stage, full, run_dir, state, reserve, logger, resume_command) from None
    except RunInterrupted as error:
        label = state["running"]
        unrecorded = ""
        if label:
            try:
                _record(run_dir, state, label, "interrupted")
            except OSError as write_error:
                if not is_disk_full(write_error):
                    raise
                unrecorded = f" (state.json not updated: {describe_os_error(write_error)})"
        logger.error("interrupted (%s)%s%s; continue with: %s", error, f" in stage {label}" if label else "", unrecorded, resume_command)
        raise RunInterrupted(f"{error}; continue with: {resume_command}", error.signum) from None
    finally:
        control.restore()
    with_errors = stages_with_errors(run_dir)
    if with_errors:
        summary = ", ".join(f"{label} done with {count} errors" for label, count in with_errors.items())
        logger.warning("run %s finished with errors: %s; retry them with: %s", run_id, summary, resume_command)
    else:
        logger.info("run %s complete: %s", run_id, run_dir)
    return run_dir


@contextlib.contextmanager
def _staged_worker(wanted: bool, run_dir: Path, state: dict, control: _StageControl, logger: logging.Logger, lock: RunFolderLock):
    """Around stage 3 of a staged run: the worker starts with it; when stage 3 returns it finishes the size it
    is on (the runner waits), and when stage 3 fails or is stopped it is stopped too. Its outcome goes in
    state.json."""
    if not wanted:
        yield
        return
    from eaglekit.staged.launch import STAGE_LABEL, StagedProcess
    from eaglekit.staged.worker import staged_summary

    worker = StagedProcess.start(run_dir / "params.yaml", run_dir, lock.fd, {RUN_LOG_ENV: str(run_dir / "run.log"), STAGE_ENV: STAGE_LABEL})
    control.helpers.append(worker)
    logger.info("staged run: worker %d trains each data size as its slice is answered, and rewrites analysis/answer.json", worker.pid)
    code = None
    try:
        yield
        worker.generation_ended()
        if worker.wait(0) is None:
            logger.info("staged run: generation ended; waiting for the worker to finish the size it is on")
        code = worker.wait()
    except BaseException:
        code = worker.stop(control.grace_s + KILL_MARGIN_S)
        raise
    finally:
        control.helpers.remove(worker)
        summary = {**staged_summary(run_dir), "exit_status": code}
        state[STAGE_LABEL] = summary
        try:
            with naming(run_dir / "state.json"):
                write_json(run_dir / "state.json", state)
        except OSError as error:  # a full disk: the stage's own failure, if any, says so; do not hide it
            if not is_disk_full(error):
                raise
            logger.warning("staged run: its summary is not in state.json: %s writing %s", describe_os_error(error), error.filename)
    if code != 0:
        logger.warning("staged run: the worker exited with status %s (its error is in run.log); stages 4-6 give the answer", code)
    else:
        logger.info("staged run: sizes %s staged, %d forecasts (staged/forecasts.jsonl)", summary["sizes_done"], summary["forecasts"])


def stages_with_errors(run_dir: Path) -> dict[str, int]:
    """Stages whose last attempt finished with errors, from state.json: {label: errors}."""
    state = read_state(Path(run_dir))
    return {label: entry.get("errors", 0) for label, entry in state["stages"].items()
            if entry.get("status", "").startswith("done with")}


def _record(run_dir: Path, state: dict, label: str, status: str, **fields) -> None:
    """state.json: `completed` (stages done without errors, skipped by --resume), `failed` (the stage whose
    last attempt failed or was interrupted), `running` (a stage whose runner vanished without a word keeps
    it), and per stage its last status."""
    previous = state["stages"].get(label, {})
    if status == "running":  # a new attempt: the last one's error is history (run.log keeps it)
        previous = {key: value for key, value in previous.items() if key not in ("error", "path")}
    state["stages"][label] = {**previous, "status": status, "updated": _now(), **fields}
    state["running"] = label if status == "running" else None
    if status != "running":
        state["failed"] = label if status in ("failed", "interrupted") else None
    if status == "done" and label not in state["completed"]:
        state["completed"] = [*state["completed"], label]
    elif status != "done" and status != "running":
        state["completed"] = [item for item in state["completed"] if item != label]
    # atomic: a write refused by a full disk leaves the previous state.json whole
    with naming(run_dir / "state.json"):
        write_json(run_dir / "state.json", state)


def _stage_failed_on_full_disk(stage: Stage, full: DiskFull, run_dir: Path, state: dict, reserve: SpaceReserve,
                               logger: logging.Logger, resume_command: str) -> RunError:
    """The stage ran out of room. The space reserve is given up so that state.json (the stage failed, with the
    error and the path), the executed notebook (its last complete save, marked failed) and run.log can still
    say so; each of those that still cannot be written is named in the one-line message, which ends with the
    resume command."""
    free = free_space(Path(full.path) if full.path else run_dir)  # before the reserve is given back
    reserve.release()
    output = run_dir / stage.notebook.name
    first = "" if full.cell is not None else failed_cell(output)
    if first:  # the stage's own write failed first; papermill's save of that failure then failed too
        error_text = f"{first.replace(' failed with ', ': ', 1)} (then saving {full.path} failed too: {full.reason})"
        located = error_text
    elif full.path:
        error_text = f"{full.reason} writing {full.path}"
        located = f"{error_text} ({full.what})"
    else:  # a failed write() names no file
        error_text = located = f"{full.reason} writing {full.what} (the error names no file; the stage writes in {run_dir})"
    where = f" in cell [{full.cell}]" if full.cell is not None else ""
    parts = [f"stage {stage.label} failed{where}: {located}; {free}; largest in the run folder: {largest_files(run_dir)}"]
    try:
        _record(run_dir, state, stage.label, "failed", error=error_text, path=full.path)
        parts.append("state.json: stage marked failed")
    except OSError as error:
        kept = read_state(run_dir)
        parts.append(f"state.json not updated ({describe_os_error(error)}): the previous one is kept whole "
                     f"(running: {kept['running']}, failed: {kept['failed']})")
    unsaved = "the executed notebook could not be saved after this cell: " if full.path == str(output) else ""
    parts.append(settle_executed_notebook(output, unsaved + error_text))
    parts.append(f"free space, then continue with: {resume_command}")
    return _logged_error(logger, "; ".join(parts))


def notebook_parameters(params: Params, notebook: Path, **extra) -> dict:
    """The resolved params sections (and `extra` values) that `notebook`'s parameters cell declares: papermill
    warns "Passed unknown parameter" for each other one, and the notebook would never read it."""
    import papermill

    declared = set(papermill.inspect_notebook(str(notebook)))
    return {key: value for key, value in {**params.sections(), **extra}.items() if key in declared}


def _run_stage(stage: Stage, params: Params, run_dir: Path, endpoints: list | None, state: dict, control: _StageControl,
               logger: logging.Logger, lock: RunFolderLock, resume_command: str, kernel_config) -> None:
    import papermill
    from nbclient.exceptions import DeadKernelError

    extra = {"endpoints": [endpoint.model_dump(mode="json") for endpoint in endpoints]} if stage.needs_endpoint else {}
    parameters = notebook_parameters(params, stage.notebook, run_dir=str(run_dir), **extra)
    output = run_dir / stage.notebook.name
    notebook_saves(output)  # every save atomic: a full disk leaves the last complete one
    clear_stage_outcome(run_dir, stage.name)
    _record(run_dir, state, stage.label, "running", started=_now())
    logger.info("stage %s: running %s", stage.label, stage.notebook)
    started = time.monotonic()
    control.in_stage = True
    try:
        with StageHeartbeat(run_dir / "run.log", logger, stage.label, lambda: running_cell(output)):
            papermill.execute_notebook(
                str(stage.notebook), str(output), parameters=parameters, kernel_name="python3",
                cwd=str(stage.notebook.parent), progress_bar=False, log_output=False, config=kernel_config,
                kernel_manager_class=_stage_kernel_manager(control, lock.fd, run_dir / "run.log", stage),
            )
    except papermill.PapermillExecutionError as error:
        control.stage_ended()
        if control.signum is not None:
            raise RunInterrupted(f"stopped by {signal.Signals(control.signum).name}", control.signum) from None
        full = DiskFull.from_cell_error(error.ename, error.evalue, error.exec_count)
        if full is not None:
            raise full from None
        _record(run_dir, state, stage.label, "failed", error=f"{error.ename}: {error.evalue}")
        cell_source = "\n".join("    " + line for line in (error.source or "").splitlines()[:15])
        raise _logged_error(logger, f"stage {stage.label} failed in cell [{error.exec_count}]:\n{cell_source}\n"
                                    f"{error.ename}: {error.evalue}\n"
                                    f"executed notebook: {output}\n"
                                    f"after fixing, continue with: {resume_command}") from None
    except DeadKernelError:
        process = control.process
        control.stage_ended()
        returncode = process.poll() if process is not None else None
        if control.signum is not None:
            mark_unfinished(output, "KernelKilled", "stopped by the runner after the shutdown grace period")
            raise RunInterrupted(f"stopped by {signal.Signals(control.signum).name}", control.signum) from None
        how = _describe_exit(returncode)
        exec_count = mark_unfinished(output, "DeadKernelError", f"the kernel died ({how})")
        _record(run_dir, state, stage.label, "failed", error=f"kernel died ({how})")
        raise _logged_error(logger, f"stage {stage.label} failed: the kernel died in cell [{exec_count}] ({how})\n"
                                    f"executed notebook: {output}\n"
                                    f"continue with: {resume_command}") from None
    finally:
        control.stage_ended()
    if control.signum is not None:  # the signal came as the last cell ended: stop before the next stage
        raise RunInterrupted(f"stopped by {signal.Signals(control.signum).name}", control.signum)
    seconds = round(time.monotonic() - started, 1)
    load = machine_load()  # the stage's time depends on what ran beside it
    outcome = read_stage_outcome(run_dir, stage.name) or {}
    errors = int(outcome.get("errors", 0))
    if errors:
        status = f"done with {errors} errors"
        _record(run_dir, state, stage.label, status, errors=errors, detail=outcome.get("detail", ""), seconds=seconds, load=load)
        logger.warning("stage %s: %s in %.1fs (%s)%s; continue with: %s", stage.label, status, seconds, describe_load(load),
                       f" ({outcome['detail']})" if outcome.get("detail") else "", resume_command)
    else:
        _record(run_dir, state, stage.label, "done", errors=0, seconds=seconds, load=load)
        logger.info("stage %s: done in %.1fs (%s)", stage.label, seconds, describe_load(load))


def _describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "exit status unknown"
    if returncode < 0:
        name = signal.Signals(-returncode).name
        if -returncode == signal.SIGKILL:
            return f"killed by {name}: the out-of-memory killer or a kill -9"
        return f"killed by {name}"
    return f"exit status {returncode}"
