"""Training checkpoints: save, load (weights only), and resume a run where its last checkpoint left it.

A checkpoint carries model, optimizer, the progress (step, data position, the stopping state), the RNG
states, the settings (flat, `TrainSettings.to_dict`) and the draft config; the learning rate is
recomputed from the step, so a resumed run continues the same loss curve. Checkpoints hold tensors and
plain Python values only, so they load with `torch.load(weights_only=True)`: a checkpoint file cannot run
code.

Torn checkpoints. Writes are atomic, yet a file can still be cut short afterwards (a full disk under a
copy, a sync that stopped, a filesystem that lied about fsync). A file that does not read back whole
raises `TornCheckpointError` naming it, never torch's bare `PytorchStreamReader` error. Each new last.pt
rotates the one before it to last.prev.pt, so a resume whose last.pt is torn continues from the previous
good one (`find_resume_point`), and with none left trains that size again from step 0, saying so. A run's
best.pt is verified when it resumes: unreadable, it is restored from the resumed checkpoint when that is
the best step's, else the size trains again (same seed, same data order: the same curve). sweep.json
records each best.pt's size and sha256 (`verify_checkpoint`), so a later reader finds a damaged one
before it loads it (a zeroed block mid-file still loads: torch checks no checksums).
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import random
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eaglekit.draft.model import Eagle3DraftModel
from eaglekit.io import atomic_write, remove_stale_temp_files
from eaglekit.training.metrics import truncate_metrics
from eaglekit.training.schedule import anneal_length
from eaglekit.training.settings import TrainSettings
from eaglekit.training.stopping import TrainProgress

logger = logging.getLogger(__name__)

LAST_CHECKPOINT = "last.pt"
PREVIOUS_CHECKPOINT = "last.prev.pt"  # the last.pt before the newest one: what a resume falls back to
BEST_CHECKPOINT = "best.pt"
TORN_SUFFIX = ".torn"  # an unreadable checkpoint set aside under its own name plus this, for inspection


def _rng_state() -> dict[str, Any]:
    """RNG states as tensors and plain values only (numpy's key array becomes a tensor), so the
    checkpoint loads with weights_only=True."""
    algorithm, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),  # (version, tuple of ints, None or float)
        "numpy": {"algorithm": str(algorithm), "keys": torch.from_numpy(keys.astype(np.int64)), "position": int(position),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    numpy_state = state["numpy"]
    np.random.set_state((numpy_state["algorithm"], numpy_state["keys"].numpy().astype(np.uint32), numpy_state["position"],
                         numpy_state["has_gauss"], numpy_state["cached_gaussian"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(path: Path, model_state: dict, optimizer_state: dict, progress: Mapping[str, Any], settings: TrainSettings,
                    model: Eagle3DraftModel, previous: Path | None = None) -> None:
    """Atomic: a crash mid-save leaves the previous checkpoint intact. progress: `TrainProgress.to_dict()`.
    previous: the file at `path` moves there first (last.pt -> last.prev.pt), so one good checkpoint
    survives the new one being torn later."""
    record = {
        "model": model_state,
        "optimizer": optimizer_state,
        "progress": dict(progress),
        "rng": _rng_state(),
        "settings": settings.to_dict(),
        "draft_config": model.config.to_dict(),
    }
    with atomic_write(path, "wb", previous=previous) as handle:
        torch.save(record, handle)


class TornCheckpointError(ValueError):
    """A checkpoint file that does not read back whole (truncated, emptied, altered): names the file."""

    def __init__(self, path: str | os.PathLike, reason: str, advice: str = "retrain it, or restore the file from a copy"):
        self.path = Path(path)
        super().__init__(f"{path}: torn checkpoint: {reason}; {advice}")


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """A training checkpoint, read with weights_only=True: tensors and plain values, never code.

    A file that needs anything else to unpickle (a class, a callable) is refused with the file named;
    one that cannot be read at all (cut short, empty) raises TornCheckpointError naming it.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except pickle.UnpicklingError as error:
        if "weights only" not in str(error).lower():  # a pickle stream cut short, not a refused object
            raise TornCheckpointError(path, f"its data does not unpickle ({str(error).splitlines()[0]})") from None
        raise ValueError(f"{path}: refused to load: it holds more than tensors and plain values, so loading it could run "
                         f"code ({str(error).splitlines()[0]}). Only load checkpoints this kit wrote; retrain or re-save it.") from None
    except (RuntimeError, EOFError, KeyError, IndexError, ValueError, OSError) as error:
        # torch reads a zip whose directory sits at the end: a cut file fails there (RuntimeError), an empty
        # one with EOFError.
        reason = str(error).splitlines()[0].split(". ")[0] if str(error) else type(error).__name__
        raise TornCheckpointError(path, f"{os.path.getsize(path)} bytes that torch cannot read ({reason})") from None


@dataclass(frozen=True)
class CheckpointDigest:
    """What sweep.json records of a checkpoint it points to: its size and sha256."""

    bytes: int
    sha256: str


def file_digest(path: str | os.PathLike) -> CheckpointDigest:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(1 << 20):
            digest.update(block)
    return CheckpointDigest(os.path.getsize(path), digest.hexdigest())


def verify_checkpoint(path: str | os.PathLike, step: int | None = None) -> CheckpointDigest:
    """Load `path` whole (TornCheckpointError naming it when it does not read back) and, with `step`, check it
    is that step's checkpoint; returns its digest for sweep.json."""
    if not Path(path).exists():
        raise TornCheckpointError(path, "missing")
    saved_step = load_checkpoint(path).get("progress", {}).get("step")
    if step is not None and saved_step != step:
        raise TornCheckpointError(path, f"holds step {saved_step}, not the best step {step} its run recorded")
    return file_digest(path)


def check_digest(path: str | os.PathLike, expected: CheckpointDigest, advice: str) -> None:
    """Raise TornCheckpointError naming `path` unless it is the file whose size and sha256 were recorded."""
    if not Path(path).exists():
        raise TornCheckpointError(path, "missing", advice)
    size = os.path.getsize(path)
    if size != expected.bytes:  # a cut file shows in its size, without reading it
        raise TornCheckpointError(path, f"{size} bytes, sweep.json recorded {expected.bytes}", advice)
    actual = file_digest(path)
    if actual.sha256 != expected.sha256:
        raise TornCheckpointError(path, f"sha256 {actual.sha256[:12]}..., sweep.json recorded {expected.sha256[:12]}...", advice)


def load_draft_weights(model: Eagle3DraftModel, checkpoint: dict[str, Any]) -> None:
    """Load a checkpoint's trainable weights (everything but the target embeddings) into `model`."""
    missing, unexpected = model.load_state_dict(checkpoint["model"], strict=False)
    missing = [name for name in missing if not name.startswith("embed_tokens.")]
    if missing or unexpected:
        raise ValueError(f"checkpoint does not fit this draft: missing {missing}, unexpected {unexpected}")


# Settings that may change between an interrupted run and its resumption (prefetching and activation
# checkpointing change how, not what, a step computes).
_RESUMABLE_DIFFERENCES = {"stop_at_step", "device", "log_interval_s", "prefetch_steps", "activation_checkpointing"}


# Settings added after checkpoints were already being written, with the value that reproduces how those
# checkpoints trained: a checkpoint without the key resumes only under that value.
_ADDED_SETTINGS = {"feature_noise": 0.0, "distill": "soft", "smoothing_evaluations": 1, "decay_steps": 0, "decay_fraction": 0.0}

def _anneal_rule(settings: dict) -> dict:
    """Settings as they train: decay_fraction does nothing while decay_steps is set."""
    return {**settings, "decay_fraction": None} if settings["decay_steps"] is not None else settings


def check_resumable(saved: dict, settings: TrainSettings, path: Path, also_allowed: frozenset[str] = frozenset()) -> None:
    """Refuse to resume a checkpoint saved with `saved` settings under different ones, naming each."""
    current = _anneal_rule(settings.to_dict())
    saved = _anneal_rule({**_ADDED_SETTINGS, **saved})
    allowed = _RESUMABLE_DIFFERENCES | also_allowed
    changed = {key: (saved.get(key), value) for key, value in current.items() if key not in allowed and saved.get(key) != value}
    if changed:
        raise ValueError(f"{path}: cannot resume with different settings {changed} (saved, now); "
                         "use a new output_dir or the saved settings")


def anneals_a_converged_run(saved: dict, progress: TrainProgress, settings: TrainSettings) -> bool:
    """A run that stopped converged without an anneal (decay_steps 0, or a checkpoint from before it),
    resumed with one: its anneal starts at the step it stopped, which is where the same run with the anneal
    from the start would have started it (the same plateau, so the same length), so the result is that
    run's (tests/training/test_training.py)."""
    saved = {**_ADDED_SETTINGS, **saved}
    return (progress.stopped == "converged" and progress.decay_start is None
            and anneal_length(saved["decay_steps"], saved["decay_fraction"], progress.step) == 0
            and settings.anneal_steps(progress.step) > 0)


@dataclass
class ResumePoint:
    """Where a run in a size folder continues: the checkpoint it resumes from (None: step 0), the files
    to set aside first (unreadable ones are kept as `<name>.torn`, superseded ones removed), whether
    best.pt is to be restored from the resumed checkpoint, and what to tell the user."""

    path: Path | None = None
    checkpoint: dict[str, Any] | None = None
    torn: list[Path] = field(default_factory=list)
    superseded: list[Path] = field(default_factory=list)
    restore_best: bool = False
    warnings: list[str] = field(default_factory=list)


def _readable(path: Path, point: ResumePoint) -> dict[str, Any] | None:
    """The checkpoint at `path`, or None (absent, or torn: noted in `point`)."""
    if not path.exists():
        return None
    try:
        return load_checkpoint(path)
    except TornCheckpointError as error:
        point.torn.append(path)
        point.warnings.append(str(error).split("; ")[0])
        return None


def find_resume_point(output_dir: Path) -> ResumePoint:
    """Decide how the run in `output_dir` resumes; reads only, so every rank decides the same.

    last.pt, else last.prev.pt (the one before it), else step 0. The run's best.pt must read back too:
    the sweep lists it. Unreadable, and the resumed checkpoint is the best step's (best.pt and last.pt
    are saved from one state), it is restored from that; otherwise the best weights are lost and the
    size trains again from step 0 (the same seed and data order: the same curve, the same best).
    """
    point = ResumePoint()
    for path in (output_dir / LAST_CHECKPOINT, output_dir / PREVIOUS_CHECKPOINT):
        checkpoint = _readable(path, point)
        if checkpoint is not None:
            point.path, point.checkpoint = path, checkpoint
            break
    if point.checkpoint is None:
        if point.torn:
            point.warnings.append(f"{output_dir}: no readable checkpoint left: this size trains again from step 0")
        return point
    progress = point.checkpoint["progress"]
    if point.torn:
        point.warnings.append(f"{output_dir}: resuming from {point.path.name} (step {progress['step']}), "
                              "the checkpoint before the torn one")
    best_path = output_dir / BEST_CHECKPOINT
    if _readable(best_path, point) is not None:
        return point
    if progress["best_step"] == progress["step"]:
        point.restore_best = True
        point.warnings.append(f"{best_path}: unreadable or missing; restored from {point.path.name}, "
                              f"saved at the same best step {progress['step']}")
        return point
    point.warnings.append(f"{best_path}: the best weights (step {progress['best_step']}) are lost: this size trains again from step 0 "
                          "(same seed and data order, so the same curve and the same best)")
    point.superseded = [path for path in (output_dir / LAST_CHECKPOINT, output_dir / PREVIOUS_CHECKPOINT)
                        if path.exists() and path not in point.torn]
    point.path = point.checkpoint = None
    return point


def prepare_resume(point: ResumePoint, output_dir: Path, metrics_path: Path) -> None:
    """Rank 0, after every rank found `point`: say what happened, set torn files aside, restore best.pt,
    drop the killed writes' temp files; starting from step 0, drop the folder's old metrics lines."""
    for warning in point.warnings:
        logger.warning("%s", warning)
    for path in point.torn:
        os.replace(path, path.with_name(path.name + TORN_SUFFIX))
    for path in point.superseded:
        path.unlink(missing_ok=True)
    if point.restore_best:
        with open(point.path, "rb") as source, atomic_write(output_dir / BEST_CHECKPOINT, "wb") as handle:
            shutil.copyfileobj(source, handle)
    remove_stale_temp_files(output_dir)  # a kill mid-save leaves `.last.pt.<pid>@<host>.<random>.tmp`
    if point.path is None:
        # a run from step 0 logs its own lines, not beside a discarded run's
        truncate_metrics(metrics_path, -1)


def resume_from(path: Path, model: Eagle3DraftModel, optimizer: torch.optim.Optimizer, settings: TrainSettings,
                metrics_path: Path | None, checkpoint: dict[str, Any] | None = None) -> TrainProgress:
    """Load `path` (last.pt; `checkpoint`: its contents, already read) into model, optimizer and the RNGs;
    return its progress.

    Refuses other settings (`check_resumable`), except that a converged run without an anneal may resume
    with one (`anneals_a_converged_run`: it anneals from where it stopped). metrics_path (rank 0; None on
    the others): its lines after the checkpoint's step are dropped, so each step appears once.
    """
    checkpoint = checkpoint if checkpoint is not None else load_checkpoint(path)
    progress = TrainProgress.from_dict(checkpoint["progress"])
    annealing = anneals_a_converged_run(checkpoint["settings"], progress, settings)
    check_resumable(checkpoint["settings"], settings, path, frozenset({"decay_steps", "decay_fraction"}) if annealing else frozenset())
    if annealing:
        progress.decay_start, progress.stopped = progress.step, None
    if settings.parallel == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(model, checkpoint["model"], options=options)
        set_optimizer_state_dict(model, optimizer, checkpoint["optimizer"], options=options)
    else:
        load_draft_weights(model, checkpoint)
        optimizer.load_state_dict(checkpoint["optimizer"])
    _set_rng_state(checkpoint["rng"])
    if metrics_path is not None:
        truncate_metrics(metrics_path, progress.step)
    return progress
