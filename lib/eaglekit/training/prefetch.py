"""Reading the next steps' samples while this step trains: a background thread and a bounded queue.

At a 7168-wide target one 16K-token sample is about 0.5 GB of features (16,384 x 4 x 7168 x 2 B), so a
synchronous read stalls the GPU once per step. `Prefetcher` runs the same reads in one background
thread, `depth` steps ahead, and hands them over in the same order with the same content: the
training loop's data order stays a pure function of the data position (eaglekit.training.split).

- An exception in a read is re-raised in the consuming thread, at the item it failed on.
- `close()` (or leaving the `with` block: early stop, an error in the step, the end of training)
  stops the thread and waits for it; reads already queued are dropped.
- Reads run with autograd off (grad mode is per thread and on by default in a new one; online
  capture runs the target there).

Shard readers keep the last shard open in the reader object, so two threads must not read one
reader at once: `SerializedSamples` wraps the samples both threads touch (training and held-out
views of one capture) so their reads take one lock. Reads still overlap the step's compute, which
holds no lock.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Generic, TypeVar

import torch

from eaglekit.training.split import token_reader

Item = TypeVar("Item")
_DONE = object()


class SerializedSamples(Sequence):
    """`samples` with every read (`[i]`, `tokens(i)`) under one lock shared by all views of a capture."""

    def __init__(self, samples: Sequence[dict], lock: threading.Lock):
        self.samples, self.lock = samples, lock

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, position: int) -> dict:  # type: ignore[override]
        with self.lock:
            return self.samples[position]

    def tokens(self, position: int) -> dict:
        """As `token_reader(samples)`: the sample without its features where the samples can read so."""
        with self.lock:
            return token_reader(self.samples)(position)


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


class Prefetcher(Generic[Item]):
    """Iterate `read(key)` for `keys` in order, computed up to `depth` items ahead in a background thread.

    depth 0 reads synchronously in the caller's thread (the reference: same items, no thread).
    Use as a context manager, or call `close()`: a thread blocked on a full queue would otherwise
    outlive an early stop.
    """

    def __init__(self, read: Callable[[int], Item], keys: Iterator[int], depth: int = 2, name: str = "eaglekit-prefetch"):
        if depth < 0:
            raise ValueError(f"prefetch depth must be >= 0, got {depth}")
        self.read, self.keys, self.depth = read, keys, depth
        self._stop = threading.Event()
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._thread: threading.Thread | None = None
        if depth > 0:
            self._thread = threading.Thread(target=self._work, name=name, daemon=True)
            self._thread.start()

    def _work(self) -> None:
        try:
            with torch.no_grad():
                for key in self.keys:
                    if self._stop.is_set() or not self._put(self.read(key)):
                        return
        except BaseException as error:  # handed to the consumer, raised there
            self._put(_Failure(error))
            return
        self._put(_DONE)

    def _put(self, item: object) -> bool:
        """Queue `item` unless stopped (a timeout loop, so close() never waits on a full queue)."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> "Prefetcher[Item]":
        return self

    def __next__(self) -> Item:
        if self._thread is None:
            return self.read(next(self.keys))
        if self._stop.is_set():
            raise StopIteration
        item = self._queue.get()
        if item is _DONE:
            self.close()
            raise StopIteration
        if isinstance(item, _Failure):
            self.close()
            raise item.error
        return item

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def close(self) -> None:
        """Stop the reader thread and wait for it (its current read finishes first); drop queued reads."""
        self._stop.set()  # a put waiting on a full queue sees it within 50 ms
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def __enter__(self) -> "Prefetcher[Item]":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
