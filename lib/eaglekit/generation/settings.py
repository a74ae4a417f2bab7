"""How a generation run retries (params `generation`: max_attempts, backoff_base_s, backoff_max_s), and the
answer-deciding settings a resume must keep (settings.json). Partitions are params `generation.partitions` as
they are."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any

from eaglekit.config import GenerationParams
from eaglekit.io import write_json

logger = logging.getLogger(__name__)


def backoff_seconds(retry: GenerationParams, attempt: int, rng: random.Random) -> float:
    """Transient failures retry with full-jitter exponential backoff: uniform(0, min(max, base x 2^(n-1))),
    from params generation's backoff_base_s and backoff_max_s (the one source of these settings and their
    defaults)."""
    return rng.uniform(0.0, min(retry.backoff_max_s, retry.backoff_base_s * 2 ** (attempt - 1)))


SETTINGS_FILE = "settings.json"  # what produced the answers of this folder (`GenerationEngine._settings`)


class GenerationSettingsChanged(ValueError):
    """A resume whose settings would produce other answers than the folder holds: refused, the keys named."""


def check_generation_settings(path: Path, settings: dict[str, Any], has_answers: bool) -> None:
    """Refuse a resume whose answer-deciding settings differ from those the folder's answers were made with.

    A first session writes `path`. A folder with answers but no settings file (written before the kit kept
    one) adopts the current settings with a warning: its earlier records carry none."""
    if not path.is_file():
        if has_answers:
            logger.warning("%s: none kept by the session(s) that wrote the answers here; taking this session's "
                           "settings as theirs (earlier records carry no settings)", path)
        write_json(path, settings)
        return
    kept = json.loads(path.read_text())
    changed = {key: (kept.get(key), value) for key, value in settings.items() if kept.get(key) != value}
    if changed:
        lines = "; ".join(f"{key}: {old!r} in the folder, {new!r} now" for key, (old, new) in changed.items())
        raise GenerationSettingsChanged(
            f"{path}: this resume would answer with other settings than the answers already here ({lines}); answers of "
            "two settings would be mixed in one training set. Restore those params (or the served model) and resume, "
            "or start a new run id for the new settings.")
