"""A real process killed with SIGKILL in the middle of an atomic write: what a kill -9 during an export or a
checkpoint save leaves on disk. Importable from any test folder (`from killed_writer import
kill_mid_write`)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

# Writes `megabytes` MiB through the kit's atomic writer, then holds the file open mid-write until killed.
WRITER = """
import sys, time
from eaglekit.io import atomic_write
with atomic_write(sys.argv[1], "wb") as handle:
    for _ in range(int(sys.argv[2])):
        handle.write(b"\\0" * (1 << 20))
    handle.flush()
    print("writing", flush=True)
    time.sleep(300)
"""


def start_writer(target: Path, megabytes: int) -> subprocess.Popen:
    """A process in the middle of writing `target` atomically (it has written `megabytes` MiB and waits)."""
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(target), str(megabytes)], stdout=subprocess.PIPE, text=True
    )
    if writer.stdout.readline().strip() != "writing":
        writer.kill()
        raise RuntimeError(f"the writer of {target} did not start (exit code {writer.wait()})")
    return writer


def kill(writer: subprocess.Popen) -> None:
    writer.send_signal(signal.SIGKILL)
    writer.wait()


def kill_mid_write(target: Path, megabytes: int) -> Path:
    """SIGKILL a real process mid-write of `target`; returns the temp file it left (checked: `megabytes`
    MiB)."""
    kill(start_writer(target, megabytes))
    left = list(target.parent.glob(f".{target.name}.*.tmp"))
    assert len(left) == 1 and left[0].stat().st_size == megabytes << 20, (
        left
    )  # the fault is real: a large half-written file
    return left[0]
