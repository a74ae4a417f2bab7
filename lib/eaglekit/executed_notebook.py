"""The executed notebook a stage leaves in the run folder: saved atomically by papermill (a save refused by a
full disk leaves the last complete one, never a torn file), and marked after a stage that did not end by
itself (the cell that was running failed, the cells after it never ran).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
from pathlib import Path

import nbformat

from eaglekit.disk_full import describe_os_error, naming
from eaglekit.io import atomic_write


class AtomicNotebookSaves:
    """papermill's I/O for one executed notebook: each save replaces the file whole (temp file, rename), so a
    save that fails on a full disk leaves the last complete save, never a torn file. The notebook it could not
    save is kept, for the runner to mark failed and write once there is room."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.unsaved: str | None = None
        self.last: str | None = None  # the newest notebook papermill saved or tried to: what runs now

    def write(self, buf: str, path: str) -> None:
        self.last = buf
        try:
            write_notebook_text(self.path, buf)
        except OSError:
            self.unsaved = buf
            raise
        self.unsaved = None

    def read(self, path: str) -> str:
        return Path(path).read_text(encoding="utf-8")

    def listdir(self, path: str) -> list[str]:
        return [os.path.join(path, name) for name in os.listdir(path)]

    def pretty_path(self, path: str) -> str:
        return path

    def cwd(self, new_path: str | None) -> None:
        return None


def write_notebook_text(path: Path, text: str) -> None:
    with naming(path), atomic_write(path) as handle:
        os.fchmod(handle.fileno(), 0o644)  # as papermill's own open() leaves it, not the temp file's 0600
        handle.write(text)


NOTEBOOK_SAVES: dict[str, AtomicNotebookSaves] = {}


def notebook_saves(output: Path) -> AtomicNotebookSaves:
    """The papermill handler for `output`, registered once per path (papermill matches a path by its prefix,
    newest registration first; no other path starts with a run folder's `NN_stage.ipynb`)."""
    from papermill.iorw import papermill_io

    key = str(output)
    if key not in NOTEBOOK_SAVES:
        NOTEBOOK_SAVES[key] = AtomicNotebookSaves(output)
        papermill_io.register(key, NOTEBOOK_SAVES[key])
    saves = NOTEBOOK_SAVES[key]
    saves.unsaved = None
    return saves


def running_cell(output: Path) -> str:
    """` in cell [5] (`result = run_analysis_stage(params, out)`) for 1m12s`: the cell papermill last marked
    running in `output`'s newest save; '' before the first cell starts."""
    saves = NOTEBOOK_SAVES.get(str(output))
    if saves is None or saves.last is None:
        return ""
    try:
        cells = json.loads(saves.last)["cells"]
    except (ValueError, KeyError, TypeError):
        return ""
    running = [cell for cell in cells if cell.get("metadata", {}).get("papermill", {}).get("status") == "running"]
    if not running:
        return ""
    cell = running[-1]
    source = "".join(cell.get("source", "")).strip().splitlines()
    first = next((line for line in source if line.strip() and not line.lstrip().startswith(("#", "from ", "import "))),
                 source[0] if source else "")
    since = ""
    with contextlib.suppress(KeyError, TypeError, ValueError):
        started = dt.datetime.fromisoformat(cell["metadata"]["papermill"]["start_time"].replace("Z", "+00:00"))
        seconds = int((dt.datetime.now(dt.timezone.utc) - started).total_seconds())
        since = f" for {seconds // 60}m{seconds % 60:02d}s"
    # papermill numbers a cell when it ends: a running one is the next after those that ran
    number = cell.get("execution_count") or 1 + max((other.get("execution_count") or 0 for other in cells), default=0)
    return f" in cell [{number}] (`{first[:80]}`){since}"


def mark_unfinished(output: Path, ename: str, evalue: str, unsaved: str | None = None) -> int | None:
    """After a kernel died or was stopped, papermill has saved every cell as completed: mark the cell
    that was running as failed, with an error output, and the cells after it as never run.
    `unsaved`: the notebook papermill last tried to save, when that save failed (a full disk); it is
    marked and written in place of the last complete save.
    Returns the execution count of that cell (None when no cell had started)."""
    if unsaved is None and not output.exists():
        return None
    notebook = nbformat.reads(unsaved, as_version=4) if unsaved is not None else nbformat.read(output, as_version=4)
    started = [index for index, cell in enumerate(notebook.cells)
               if cell.get("metadata", {}).get("papermill", {}).get("start_time")]
    if not started:
        return None
    failed = [index for index in started if notebook.cells[index].metadata.papermill.get("status") == "failed"]
    if failed:  # the cell's own error is in the notebook already: only the notebook is marked
        cell = notebook.cells[failed[0]]
    else:
        cell = notebook.cells[started[-1]]
        cell.metadata.papermill.update(status="failed", exception=True)
        if cell.cell_type == "code":
            cell.outputs.append(nbformat.v4.new_output("error", ename=ename, evalue=evalue, traceback=[f"{ename}: {evalue}"]))
        for later in notebook.cells[started[-1] + 1:]:
            later.metadata.setdefault("papermill", {}).update(status="pending", start_time=None, end_time=None, duration=None)
    notebook.metadata.setdefault("papermill", {})["exception"] = True
    write_notebook_text(output, nbformat.writes(notebook))
    return cell.get("execution_count")


def failed_cell(output: Path) -> str:
    """`cell [3] failed with OSError: ...` when the notebook papermill last tried to save shows a failed cell,
    else ''."""
    saves = NOTEBOOK_SAVES.get(str(output))
    try:
        unsaved = saves.unsaved if saves is not None else None
        notebook = nbformat.reads(unsaved, as_version=4) if unsaved is not None else nbformat.read(output, as_version=4)
    except (OSError, ValueError):
        return ""
    for cell in notebook.cells:
        if cell.get("metadata", {}).get("papermill", {}).get("status") == "failed":
            errors = [item for item in cell.get("outputs", []) if item.get("output_type") == "error"]
            what = f" with {errors[-1]['ename']}: {errors[-1]['evalue']}" if errors else ""
            return f"cell [{cell.get('execution_count')}] failed{what}"
    return ""


def settle_executed_notebook(output: Path, error_text: str) -> str:
    """After a full disk: write the notebook papermill could not save, marked failed, over its last complete
    save; when that cannot be written either, the last complete save stays (never a torn file: saves are
    atomic). Says which."""
    saves = NOTEBOOK_SAVES.get(str(output))
    unsaved = saves.unsaved if saves is not None else None
    if unsaved is None and not output.exists():
        return "no executed notebook was written"
    try:
        with naming(output):
            cell = mark_unfinished(output, "OSError", error_text, unsaved=unsaved)
    except OSError as error:
        return (f"executed notebook {output}: its last complete save, from before the disk filled, not marked failed "
                f"({describe_os_error(error)})")
    finally:
        if saves is not None:
            saves.unsaved = None
    return f"executed notebook {output}: whole, marked failed{f' at cell [{cell}]' if cell is not None else ''}"
