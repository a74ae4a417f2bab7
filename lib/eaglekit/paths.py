"""Where the kit keeps things: the repository root, notebooks, and the cache for converted models and data."""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_ROOT = PACKAGE_DIR.parent.parent
NOTEBOOKS_DIR = REPO_ROOT / "notebooks"


def cache_dir() -> Path:
    """`$EAGLEKIT_CACHE`, else `~/.cache/eaglekit`: converted models (`models/`) and fetched data
    (`data/`)."""
    root = Path(os.environ.get("EAGLEKIT_CACHE") or Path.home() / ".cache" / "eaglekit")
    root.mkdir(parents=True, exist_ok=True)
    return root


def installed_package_dir(module: str, needed_by: str, pip_name: str | None = None,
                          error: type[Exception] = FileNotFoundError) -> Path:
    """The folder of an installed package, found without importing it (data-only packages). Absent: `error`
    saying what needs it and the pip command that installs it."""
    import importlib.util

    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        pip_name = pip_name or module
        raise error(f"{needed_by} needs the PyPI package {pip_name!r}: `pip install --no-deps {pip_name}` "
                    "(or run `make install`)")
    return Path(next(iter(spec.submodule_search_locations)))
