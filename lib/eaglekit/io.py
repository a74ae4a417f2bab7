"""File I/O the whole kit shares: atomic writes, JSON and JSONL read with file:line errors, append-only logs.

Every output is either written atomically (temp file in the same folder, fsync, rename) or is an
append-only JSONL log whose torn last line is repaired on open. Nothing half-written is ever read
as complete.

A writer killed mid-write (kill -9, OOM, a lost node) leaves its temp file behind, up to a whole
checkpoint or model in size. Temp files are named `.<target>.<pid>@<host>.<random>.tmp`, so the next
atomic write of the same target removes those whose writer is dead (`remove_stale_temp_files`), and
a resume sweeps the folders it owns the same way: one mechanism for every atomic writer in the kit.
"""

from __future__ import annotations

import contextlib
import fnmatch
import glob
import json
import os
import re
import socket
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any


class InputError(ValueError):
    """Bad input, located: the file, the 1-based line (or record) and the field at fault."""

    def __init__(self, path: str | os.PathLike, line: int | None, field: str | None, reason: str):
        self.path = str(path)
        self.line = line
        self.field = field
        self.reason = reason
        where = self.path if line is None else f"{self.path}:{line}"
        what = f" field {field!r}:" if field else ""
        super().__init__(f"{where}:{what} {reason}")

    def as_record(self) -> dict[str, Any]:
        return {"file": self.path, "line": self.line, "field": self.field, "reason": self.reason}


TEMP_SUFFIX = ".tmp"
# `<pid>@<host>` of the writer, then mkstemp's random part (letters, digits, "_": never a dot).
_WRITER_TAIL = re.compile(r"^(?P<target>.+)\.(?P<pid>\d+)@(?P<host>[A-Za-z0-9-]+)$")


def _host() -> str:
    """This machine's name as a temp-file name can carry it (no dots: they separate the name's parts)."""
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "host"


def _temp_prefix(target_name: str) -> str:
    return f".{target_name}.{os.getpid()}@{_host()}."


def _temp_file_writer(name: str) -> tuple[str, int | None, str | None] | None:
    """(target name, writer pid, writer host) of an `atomic_write` temp file name, None for other names.

    A temp file from before writers named themselves (`.<target>.<random>.tmp`) has pid and host None."""
    if not (name.startswith(".") and name.endswith(TEMP_SUFFIX)):
        return None
    body = name[1:-len(TEMP_SUFFIX)]
    if "." not in body:
        return None
    rest = body.rsplit(".", 1)[0]  # drop mkstemp's random part
    match = _WRITER_TAIL.match(rest)
    if match is None:
        return rest, None, None
    return match["target"], int(match["pid"]), match["host"]


def remove_stale_temp_files(folder: str | os.PathLike, target: str = "*", every_writer: bool = False) -> list[Path]:
    """Delete the temp files `atomic_write` left in `folder` for targets matching the glob `target`.

    A temp file is stale when its writer is dead: a pid on this machine that no longer runs, or a
    file from before writers named themselves. A live writer's file, and one written on another
    machine (a shared filesystem: its pid means nothing here), are kept, unless `every_writer`, for a
    folder whose files only the caller writes (a capture rank's own shards). Returns what it removed.
    """
    folder, host, removed = Path(folder), _host(), []
    if not folder.is_dir():
        return removed
    for entry in os.scandir(folder):
        parsed = _temp_file_writer(entry.name)
        if parsed is None or not entry.is_file(follow_symlinks=False) or not fnmatch.fnmatchcase(parsed[0], target):
            continue
        _, pid, writer_host = parsed
        dead = pid is None or (writer_host == host and not pid_alive(pid))
        if every_writer or dead:
            with contextlib.suppress(FileNotFoundError):  # another cleaner got there first
                os.unlink(entry.path)
                removed.append(Path(entry.path))
    return removed


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w", encoding: str | None = "utf-8",
                 previous: str | os.PathLike | None = None) -> Iterator[IO]:
    """Open a temp file beside `path`; on success fsync and rename it over `path`, else delete it.

    Stale temp files of `path` (their writer is dead) are removed first, so a target rewritten after a
    kill never keeps the killed write's temp file. `previous`: the file at `path` is first renamed
    there (a rotation: `path` is the new file, `previous` the one before it). A crash between the two
    renames leaves `previous` whole and `path` absent, so a reader tries `path`, then `previous`.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if "b" in mode:
        encoding = None
    remove_stale_temp_files(path.parent, glob.escape(path.name))
    fd, tmp_name = tempfile.mkstemp(prefix=_temp_prefix(path.name), suffix=TEMP_SUFFIX, dir=path.parent)
    try:
        with os.fdopen(fd, mode, encoding=encoding) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        if previous is not None and path.exists():
            os.replace(path, previous)
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise


def write_json(path: str | os.PathLike, obj: Any) -> None:
    with atomic_write(path) as handle:
        json.dump(obj, handle, indent=2, ensure_ascii=False, default=str)
        handle.write("\n")


def write_jsonl(path: str | os.PathLike, records: Iterable[dict]) -> int:
    """Atomically write records as JSONL; returns the number written."""
    count = 0
    with atomic_write(path) as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
            count += 1
    return count


def read_json(path: str | os.PathLike, what: str, missing: str | None = None) -> Any:
    """The JSON document in `path`. One that is not JSON (torn by a crash, edited by hand) or not UTF-8 raises
    InputError naming the file, the line and column where json gives them, then `what` (what to do about it).
    `missing`: a missing file raises FileNotFoundError "<path> not found: <missing>" (None: open's own)."""
    path = Path(path)
    if missing is not None and not path.exists():
        raise FileNotFoundError(f"{path} not found: {missing}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as error:
        raise InputError(path, None, None, f"not UTF-8 ({error.reason} at byte {error.start}); {what}") from None
    except json.JSONDecodeError as error:
        raise InputError(path, error.lineno, None, f"not JSON ({error.msg}: column {error.colno}); {what}") from None


def parse_json_text(value: Any) -> Any:
    """A string that holds JSON, parsed; anything else (a non-JSON string included) as it is. Datasets store
    tool calls' arguments and tool definitions either way. Text json.loads refuses past its limits (an
    integer over 4300 digits: ValueError; deep nesting: RecursionError) is a non-JSON string too."""
    if isinstance(value, str):
        with contextlib.suppress(ValueError, RecursionError):
            return json.loads(value)
    return value


def read_jsonl(path: str | os.PathLike) -> Iterator[tuple[int, Any]]:
    """Yield (line_number, object) for each non-blank line; raise InputError naming file and line.

    Bytes are decoded per line, so one non-UTF-8 line is reported at its own line number.
    """
    path = Path(path)
    with open(path, "rb") as handle:
        for line_number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise InputError(path, line_number, None, f"not UTF-8 ({error.reason} at byte {error.start})") from None
            try:
                yield line_number, json.loads(text)
            except json.JSONDecodeError as error:
                raise InputError(path, line_number, None, f"malformed JSON: {error.msg} (column {error.colno})") from None


def repair_torn_tail(path: str | os.PathLike) -> int:
    """Cut a last line that has no newline (a write torn by a crash); returns bytes removed."""
    path = Path(path)
    if not path.exists():
        return 0
    with open(path, "rb+") as handle:
        size = handle.seek(0, os.SEEK_END)
        if size == 0:
            return 0
        handle.seek(size - 1)
        if handle.read(1) == b"\n":
            return 0
        # Walk back to the last newline in blocks (none: the whole file is one torn line).
        keep, position = 0, size
        while position > 0:
            step = min(65536, position)
            handle.seek(position - step)
            newline = handle.read(step).rfind(b"\n")
            if newline >= 0:
                keep = position - step + newline + 1
                break
            position -= step
        handle.truncate(keep)
        handle.flush()
        os.fsync(handle.fileno())
        return size - keep


class ClosesOnExit:
    """`with obj:` gives obj and calls its close() on the way out, whatever ended the block."""

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class AppendLog(ClosesOnExit):
    """Append-only JSONL log that survives kill -9: each line written through, torn tail repaired on open."""

    def __init__(self, path: str | os.PathLike, sync_every: int = 64):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.repaired_bytes = repair_torn_tail(self.path)
        self._handle = open(self.path, "a", encoding="utf-8")
        self._sync_every = sync_every
        self._pending = 0

    def append(self, record: dict) -> None:
        # Each record reaches the kernel at once (a kill -9 of this process then loses nothing);
        # fsync, which also survives a machine crash, is batched every `sync_every` records.
        self._handle.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._handle.flush()
        self._pending += 1
        if self._pending >= self._sync_every:
            self.flush()

    def flush(self) -> None:
        self._handle.flush()
        os.fsync(self._handle.fileno())
        self._pending = 0

    def close(self) -> None:
        if not self._handle.closed:
            self.flush()
            self._handle.close()


def pid_alive(pid: Any) -> bool:
    """Whether a process with this pid lives on this machine (a zombie does not count; not ours to know:
    alive)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (dead, not yet reaped by its parent) answers kill(0) but holds no files.
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def format_duration(seconds: float | None) -> str:
    """`1h05m`, `4m07s`; `?` when unknown. Progress lines of long stages (generation, training) use it."""
    if seconds is None:
        return "?"
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"
