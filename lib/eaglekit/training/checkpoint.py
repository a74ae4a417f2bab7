"""Training checkpoints: save, load (weights only), and resume a run where its last checkpoint left it.

A checkpoint carries model, optimizer, the progress (step, data position, the stopping state), the RNG
states, the settings (flat, `TrainSettings.to_dict`) and the draft config; the learning rate is
recomputed from the step, so a resumed run continues the same loss curve. Checkpoints hold tensors and
plain Python values only, so they load with `torch.load(weights_only=True)`: a checkpoint file cannot run code.
"""

from __future__ import annotations

import pickle
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eaglekit.draft.model import Eagle3DraftModel
from eaglekit.io import atomic_write
from eaglekit.training.metrics import truncate_metrics
from eaglekit.training.schedule import anneal_length
from eaglekit.training.settings import TrainSettings
from eaglekit.training.stopping import TrainProgress

LAST_CHECKPOINT = "last.pt"
BEST_CHECKPOINT = "best.pt"


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
                    model: Eagle3DraftModel) -> None:
    """Atomic: a crash mid-save leaves the previous checkpoint intact. progress: `TrainProgress.to_dict()`."""
    record = {
        "model": model_state,
        "optimizer": optimizer_state,
        "progress": dict(progress),
        "rng": _rng_state(),
        "settings": settings.to_dict(),
        "draft_config": model.config.to_dict(),
    }
    with atomic_write(path, "wb") as handle:
        torch.save(record, handle)


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """A training checkpoint, read with weights_only=True: tensors and plain values, never code.

    A file that needs anything else to unpickle (a class, a callable) is refused with the file named.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise ValueError(f"{path}: refused to load: it holds more than tensors and plain values, so loading it could run "
                         f"code ({str(error).splitlines()[0]}). Only load checkpoints this kit wrote; retrain or re-save it.") from None


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
        raise ValueError(f"{path}: cannot resume with different settings {changed} (saved, now); use a new output_dir or the saved settings")


def anneals_a_converged_run(saved: dict, progress: TrainProgress, settings: TrainSettings) -> bool:
    """A run that stopped converged without an anneal (decay_steps 0, or a checkpoint from before it),
    resumed with one: its anneal starts at the step it stopped, which is where the same run with the anneal
    from the start would have started it (the same plateau, so the same length), so the result is that
    run's (tests/training/test_training.py)."""
    saved = {**_ADDED_SETTINGS, **saved}
    return (progress.stopped == "converged" and progress.decay_start is None
            and anneal_length(saved["decay_steps"], saved["decay_fraction"], progress.step) == 0
            and settings.anneal_steps(progress.step) > 0)


def resume_from(path: Path, model: Eagle3DraftModel, optimizer: torch.optim.Optimizer, settings: TrainSettings,
                metrics_path: Path | None) -> TrainProgress:
    """Load `path` (last.pt) into model, optimizer and the RNGs; return its progress.

    Refuses other settings (`check_resumable`), except that a converged run without an anneal may resume
    with one (`anneals_a_converged_run`: it anneals from where it stopped). metrics_path (rank 0; None on
    the others): its lines after the checkpoint's step are dropped, so each step appears once.
    """
    checkpoint = load_checkpoint(path)
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
