"""A draft's metrics.jsonl: one "train" line per step, one "heldout" line per evaluation, and what is read
from it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from eaglekit.io import atomic_write, read_jsonl

METRICS_FILE = "metrics.jsonl"


def recent_gain(metrics_path: str | Path, evaluations: int) -> dict[str, Any]:
    """How much the best held-out tau rose over the last `evaluations` evaluations of a run.

    {"recent_gain": best tau overall - best tau before the window (0.0 when the window holds no new best),
     "recent_window_steps": [first, last] step of the window, "recent_evaluations": evaluations in it}.
    A draft still gaining at the end of its training has a tau that is a lower bound on what its data gives.
    """
    heldout = [(record["step"], record["simulated_accept_length"]) for record in iterate_metrics(metrics_path, "heldout")]
    if len(heldout) < 2:
        return {"recent_gain": None, "recent_window_steps": None, "recent_evaluations": 0}
    window = heldout[-min(evaluations, len(heldout) - 1):]
    before = max(tau for _, tau in heldout[: len(heldout) - len(window)])
    best = max(tau for _, tau in heldout)
    return {"recent_gain": best - before, "recent_window_steps": [window[0][0], window[-1][0]], "recent_evaluations": len(window)}


def iterate_metrics(path: str | Path, split: str) -> Iterator[dict]:
    """Records of one split ("train" or "heldout") from a metrics.jsonl, for the notebook's plots."""
    for _, record in read_jsonl(path):
        if record.get("split") == split:
            yield record


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop log lines written after the checkpoint we resume from, so each step appears once."""
    if not path.exists():
        return
    keep = [record for _, record in read_jsonl(path) if record.get("step", 0) <= last_step]
    with atomic_write(path) as handle:
        handle.writelines(json.dumps(record) + "\n" for record in keep)
