"""A full disk in a run folder: which errors mean it, the space the runner keeps for its own records, and the
error a stage that ran out of room ends with (`DiskFull`), located by path and cell.

A run folder holds `space_reserve` while the run lasts (SPACE_RESERVE_BYTES): when a stage fills the disk the
runner deletes it, so that state.json (the stage failed, with the error and the path), run.log and the
executed notebook (marked failed) still fit, and the message ends with the resume command.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from pathlib import Path

# Errors that mean "no room to write": the disk is full, a quota is spent, or a file-size limit (RLIMIT_FSIZE)
# is hit.
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
SPACE_RESERVE_BYTES = 1 << 20  # state.json, a few run.log lines and a marked executed notebook fit in it
SPACE_RESERVE = "space_reserve"


def is_disk_full(error: BaseException) -> bool:
    return isinstance(error, OSError) and error.errno in DISK_FULL_ERRNOS


@contextlib.contextmanager
def naming(path: Path):
    """Re-raise an OSError with `path` as its filename: a failed flush names no file, an atomic write its temp
    file."""
    try:
        yield
    except OSError as error:
        if error.filename == str(path) or error.errno is None:
            raise
        raise OSError(error.errno, error.strerror, str(path)) from error


def describe_os_error(error: OSError) -> str:
    """`No space left on device (ENOSPC)`: the reason and its errno name, without the path (the message places
    it)."""
    name = errno.errorcode.get(error.errno, str(error.errno))
    return f"{error.strerror or os.strerror(error.errno)} ({name})"


def free_space(path: Path) -> str:
    """`0 B free on /mnt/data`: free space on the filesystem holding `path` (its nearest existing folder)."""
    folder = Path(path)
    while not folder.is_dir() and folder != folder.parent:
        folder = folder.parent
    mount = folder.resolve()
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    try:
        stats = os.statvfs(folder)
    except OSError:
        return f"free space on {mount} unknown"
    return f"{_size_text(stats.f_bavail * stats.f_frsize)} free on {mount}"


def _size_text(size: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if size >= 1 << shift:
            return f"{size / (1 << shift):.1f} {unit}"
    return f"{size} B"


def largest_files(folder: Path, count: int = 3) -> str:
    """`shard-00041.safetensors 2.9 MiB, run.log 12 B`: what fills the folder, for the user deciding what to
    free."""
    sizes = []
    for root, _, names in os.walk(folder):
        for name in names:
            with contextlib.suppress(OSError):
                sizes.append((os.path.getsize(os.path.join(root, name)), os.path.relpath(os.path.join(root, name), folder)))
    return ", ".join(f"{name} {_size_text(size)}" for size, name in sorted(sizes, reverse=True)[:count]) or "nothing"


class SpaceReserve:
    """`space_reserve` in the run folder: SPACE_RESERVE_BYTES written before the stages run and deleted when a
    stage hits a full disk, so the runner's own records of that failure still have room. Random bytes: a
    compressing filesystem would store zeros in nothing."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / SPACE_RESERVE

    def make(self) -> None:
        """Raises a disk-full OSError naming the reserve when there is no room for it: the run cannot
        start."""
        if self.path.is_file() and self.path.stat().st_size >= SPACE_RESERVE_BYTES:
            return
        try:
            with naming(self.path), open(self.path, "wb") as handle:
                handle.write(os.urandom(SPACE_RESERVE_BYTES))
                handle.flush()
                os.fsync(handle.fileno())
        except OSError:
            self.release()
            raise

    def release(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


class DiskFull(Exception):
    """A stage ran out of room: the path that could not be written (None when the error names none), what it
    is, the OSError's reason (`No space left on device (ENOSPC)`), and the cell when the stage's own code hit
    it."""

    def __init__(self, path: str | None, what: str, reason: str, cell: int | None = None):
        super().__init__(f"{reason} writing {path}")
        self.path, self.what, self.reason, self.cell = path, what, reason, cell

    @classmethod
    def from_os_error(cls, error: OSError, run_dir: Path, output: Path) -> "DiskFull":
        """The runner's own write failed (papermill saving the executed notebook, state.json, ...)."""
        names = {str(output): "the executed notebook", str(run_dir / "state.json"): "state.json"}
        path = str(error.filename) if error.filename else None
        return cls(path, names.get(path, "a file of the runner"), describe_os_error(error))

    @classmethod
    def from_cell_error(cls, ename: str, evalue: str, exec_count: int | None) -> "DiskFull | None":
        """The stage's own code raised it: papermill has only the exception's name and text (`[Errno 28] ...:
        'path'`; a failed write() names no path). None when it is not a disk-full error."""
        match = re.match(r"\[Errno (\d+)\] (.*?)(?:: '(.*)')?$", evalue or "")
        if not match or int(match[1]) not in DISK_FULL_ERRNOS:
            return None
        reason = f"{match[2]} ({errno.errorcode.get(int(match[1]), match[1])})"
        return cls(match[3], "the stage's own output", reason, cell=exec_count)
