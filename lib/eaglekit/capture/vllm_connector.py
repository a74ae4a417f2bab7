"""vLLM's hidden-states connector for a CPU-only torch. Runs inside the vLLM server, never in the kit.

vLLM 0.32's `ExampleHiddenStatesConnector` copies each finished request's hidden states to pinned
host memory on a CUDA side stream; on a CPU build `pin_memory=True` raises ("requires a CUDA or other
accelerator backend") at the first finished request and the engine core dies. On CPU the features
already live in host memory, so this subclass clones them and hands the write to the stock thread
pool with an event that is always complete: the file format, the `.lock` protocol and the
`kv_transfer_params.hidden_states_path` answer stay the stock connector's.

`capture.vllm_capture` copies this file next to the server's storage folder and names it with
`kv_connector_module_path`, so the vLLM venv needs no eaglekit install. On GPU the stock connector is used.
"""

from __future__ import annotations

import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)


class _CompletedCopy:
    """Stands in for the stock connector's torch.cuda.Event: on CPU the copy is done when it returns."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending) -> None:
        if not self._is_tp_rank_zero:
            return
        # Slot of every token of the request: its blocks' slots in order, cut to the token count.
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slot_mapping = (block_ids.reshape(-1, 1) * self._block_size + offsets.reshape(1, -1)).flatten()
        hidden_states = extract_from_kv_cache(self._kv_cache, slot_mapping, pending.token_ids.shape[0]).clone()  # (T, layers, H)
        tensors = {"hidden_states": hidden_states, "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        copied = _CompletedCopy()
        future = self._executor.submit(self._write_tensors, tensors, copied, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = copied
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
