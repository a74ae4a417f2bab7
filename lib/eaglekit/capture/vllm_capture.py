"""Capture through stock vLLM: the `extract_hidden_states` speculative method and a
hidden-states KV connector.

vLLM (0.32) owns tensor and data parallelism, so a target too large for one process (Kimi-K2.5 at TP8)
is captured at serving speed. Per sample we send its token ids as the prompt with `max_tokens: 1`;
the connector writes `<storage>/<request id>.safetensors` holding

    hidden_states  (T, len(layer ids), H)   the residual stream entering each listed layer, model dtype
    token_ids      int64 (T,)               the prompt ids

and the answer names the file in `kv_transfer_params.hidden_states_path` (a `.lock` beside it is
held exclusively until the write ends). We ask for the three aux layers and layer N: vLLM's slot for
layer N is the residual before the final norm, so we apply the target's final norm (RMSNorm, weight
and eps from its checkpoint) to get what the transformers path stores (`last_hidden_state`, what
lm_head consumes). Each file is checked (token ids equal the sample's, one slot per layer asked: a
public report says DeepSeek-architecture targets may silently return no final layer), copied into a
`CapturedSample` and deleted with its lock.

On a CPU build the stock `ExampleHiddenStatesConnector` fails (pinned memory); `vllm_connector.py`
(a subclass) is copied beside the storage folder and used instead. On GPU the stock connector is used.

The server is eaglekit.generation.server.VLLMServer with these configs (`VllmHiddenStatesServer`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import logging
import os
import shutil
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch
from safetensors.torch import load_file

from eaglekit.capture.inputs import TokenizedSample
from eaglekit.capture.shards import CapturedSample
from eaglekit.generation.server import ServerError, VLLMServer, default_vllm_python
from eaglekit.io import ClosesOnExit
from eaglekit.target import TargetLayout

logger = logging.getLogger(__name__)

CPU_CONNECTOR_FILE = Path(__file__).with_name("vllm_connector.py")
CPU_CONNECTOR_MODULE = "eaglekit_vllm_connector"  # the copy's module name inside the server
CPU_CONNECTOR_CLASS = "CpuHiddenStatesConnector"
STOCK_CONNECTOR_CLASS = "ExampleHiddenStatesConnector"


class VllmCaptureError(RuntimeError):
    """The server or one of its hidden-state files is not what capture needs; the message names the sample."""


@dataclass(frozen=True)
class VllmCaptureSettings:
    """How the capture server runs. `layer_ids` are the aux ids (output_hidden_states indices); N is added."""

    python: str  # the Python of a venv with vLLM
    model_dir: Path
    served_model: str  # the name requests use (the folder, as vLLM serves it by default)
    layer_ids: tuple[int, ...]
    num_hidden_layers: int
    max_model_len: int  # the longest sample + the one generated token
    dtype: str = "bfloat16"
    tensor_parallel: int = 1
    data_parallel: int = 1
    trust_remote_code: bool = False
    concurrency: int = 16
    startup_timeout_s: float = 900.0
    request_timeout_s: float = 3600.0
    cpu: bool = True  # the connector subclass where pinned memory is unavailable
    extra_args: tuple[str, ...] = ()

    @property
    def server_layer_ids(self) -> list[int]:
        return [*self.layer_ids, self.num_hidden_layers]  # aux layers, then the residual after the last layer


def server_command(settings: VllmCaptureSettings, port: int, storage_dir: Path) -> tuple[list[str], dict[str, str]]:
    """The capture server's argv and added environment (through eaglekit.generation.server.VLLMServer)."""
    server = _vllm_server(settings, storage_dir, port=port)
    return server.command(), server.env


def _vllm_server(settings: VllmCaptureSettings, storage_dir: Path, port: int | None = None, log_path: Path | None = None):
    """A VLLMServer with the speculative config that returns the layers, and the connector writing them into
    `storage_dir` (on CPU the subclass, copied beside it and put on the server's PYTHONPATH)."""
    speculative = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                   "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": settings.server_layer_ids}}}
    transfer = {"kv_connector": STOCK_CONNECTOR_CLASS, "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": str(storage_dir)}}
    environment: dict[str, str] = {}
    if settings.cpu:
        plugin_dir = storage_dir.parent / ".connector"
        plugin_dir.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(CPU_CONNECTOR_FILE, plugin_dir / f"{CPU_CONNECTOR_MODULE}.py")
        transfer.update(kv_connector=CPU_CONNECTOR_CLASS, kv_connector_module_path=CPU_CONNECTOR_MODULE)
        environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(plugin_dir), os.environ.get("PYTHONPATH")]))
    extra = ("--tensor-parallel-size", str(settings.tensor_parallel), "--data-parallel-size", str(settings.data_parallel),
             *settings.extra_args)
    return VLLMServer(settings.model_dir, python=settings.python, port=port, dtype=settings.dtype, max_model_len=settings.max_model_len,
                      enforce_eager=settings.cpu, speculative_config=speculative, kv_transfer_config=transfer, extra_args=extra,
                      env=environment, log_path=log_path, startup_timeout_s=settings.startup_timeout_s,
                      trust_remote_code=settings.trust_remote_code)


class VllmHiddenStatesServer:
    """A vLLM capture server (eaglekit.generation.server.VLLMServer) with its files under
    `work_dir/hidden_states`.

    Context manager: starts the server (the log's tail in the error when it dies or times out), drops the
    file its warm-up completion left, and stops it on exit.
    """

    def __init__(self, settings: VllmCaptureSettings, work_dir: str | os.PathLike):
        self.settings = settings
        self.work_dir = Path(work_dir)
        self.storage_dir = self.work_dir / "hidden_states"
        self.log_path = self.work_dir / "vllm_server.log"
        self.server = None
        self.startup_seconds = 0.0

    @property
    def url(self) -> str:
        return self.server.root_url

    def __enter__(self) -> "VllmHiddenStatesServer":
        self.storage_dir.mkdir(parents=True, exist_ok=True)
        self.server = _vllm_server(self.settings, self.storage_dir, log_path=self.log_path)
        try:
            self.server.start()
        except ServerError as error:
            raise VllmCaptureError(f"the vLLM capture server did not start: {error}") from None
        self.startup_seconds = self.server.startup_s
        self._drop_startup_file()
        logger.info("vLLM capture server on %s healthy after %.1f s (log %s)", self.url, self.startup_seconds, self.log_path)
        return self

    def _drop_startup_file(self, timeout_s: float = 20.0) -> None:
        """Delete the file of the start-up check's own completion. The connector writes it when the request
        finishes, which can be after the answer reached us: wait for it (bounded), take
        its lock, delete it."""
        deadline = time.monotonic() + timeout_s
        while not any(path.suffix == ".safetensors" for path in self.storage_dir.iterdir()) and time.monotonic() < deadline:
            time.sleep(0.1)
        for path in list(self.storage_dir.iterdir()):
            if path.suffix == ".safetensors":
                wait_until_written(path)
        for path in list(self.storage_dir.iterdir()):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()

    def __exit__(self, *exc_info) -> None:
        self.stop()


def rms_norm(hidden_states: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The target's final RMSNorm as transformers computes it: (T, H) float32 math, back to the input
    dtype, times weight."""
    variance = hidden_states.float().pow(2).mean(-1, keepdim=True)
    normed = (hidden_states.float() * torch.rsqrt(variance + eps)).to(hidden_states.dtype)
    return weight.to(hidden_states.dtype) * normed


def wait_until_written(path: str | os.PathLike) -> None:
    """Return once the connector has written `path`: it holds LOCK_EX on `<path>.lock` until the file is
    complete (no lock file: no write in progress)."""
    with contextlib.suppress(FileNotFoundError), open(f"{path}.lock") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)


def read_hidden_states_file(path: str, sample: TokenizedSample, num_layers: int, hidden_size: int) -> torch.Tensor:
    """The (T, layers, H) hidden states of `sample` from a connector file, after checking ids and
    counts; then deleted."""
    where = f"sample {sample.dataset}/{sample.id}"
    lock_path = path + ".lock"
    try:
        wait_until_written(path)
        tensors = load_file(path)
    except (OSError, RuntimeError) as error:
        raise VllmCaptureError(f"{where}: the server's hidden-state file {path} cannot be read ({error})") from None
    finally:
        for leftover in (path, lock_path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(leftover)
    hidden_states, token_ids = tensors.get("hidden_states"), tensors.get("token_ids")
    if hidden_states is None or token_ids is None:
        raise VllmCaptureError(f"{where}: {path} holds {sorted(tensors)}, not hidden_states and token_ids")
    expected = (len(sample.input_ids), num_layers, hidden_size)
    if tuple(hidden_states.shape) != expected:
        raise VllmCaptureError(
            f"{where}: the server returned hidden states of shape {tuple(hidden_states.shape)}, expected (tokens, layers, hidden) "
            f"{expected}; a missing layer slot (some targets return no final layer) or a cut prompt: check the server log")
    if token_ids.tolist() != list(sample.input_ids):
        raise VllmCaptureError(f"{where}: the server's file holds other token ids than the sample's ({token_ids.shape[0]} ids)")
    return hidden_states


@dataclass
class VllmCapture(ClosesOnExit):
    """A running vLLM capture server as capture's FeatureSource (`capture.forward.FeatureSource`)."""

    server: VllmHiddenStatesServer
    layout: TargetLayout
    final_norm_weight: torch.Tensor = field(repr=False)
    final_norm_eps: float = 1e-6
    # the shards' dtype; float32 to compare with a float32 target exactly
    output_dtype: torch.dtype = torch.bfloat16
    seconds_in_requests: float = 0.0

    @classmethod
    def start(cls, settings: VllmCaptureSettings, layout: TargetLayout, work_dir: str | os.PathLike) -> "VllmCapture":
        """Start the server (context-manage the returned object's `server`, or call `close`)."""
        weight = layout.read_tensors([layout.final_norm_name])[layout.final_norm_name]
        eps = float(layout.text_config.get("rms_norm_eps", 1e-6))
        server = VllmHiddenStatesServer(settings, work_dir).__enter__()
        return cls(server=server, layout=layout, final_norm_weight=weight, final_norm_eps=eps)

    def close(self) -> None:
        self.server.stop()

    hidden_size = property(lambda self: self.layout.hidden_size)
    num_hidden_layers = property(lambda self: self.layout.num_hidden_layers)
    vocab_size = property(lambda self: self.layout.vocab_size)
    dtype_name = property(lambda self: self.server.settings.dtype)

    def _request(self, client: httpx.Client, sample: TokenizedSample) -> str:
        body = {"model": self.server.settings.served_model, "prompt": list(sample.input_ids), "max_tokens": 1, "temperature": 0}
        response = client.post(f"{self.server.url}/v1/completions", json=body, timeout=self.server.settings.request_timeout_s)
        if response.status_code != 200:
            raise VllmCaptureError(f"sample {sample.dataset}/{sample.id}: the server answered {response.status_code}: "
                                   f"{response.text[:500]}")
        path = (response.json().get("kv_transfer_params") or {}).get("hidden_states_path")
        if not path:
            raise VllmCaptureError(f"sample {sample.dataset}/{sample.id}: the answer names no kv_transfer_params.hidden_states_path "
                                   "(is the server running with the hidden-states connector?)")
        return path

    def _captured(self, sample: TokenizedSample, path: str) -> CapturedSample:
        layers = len(self.server.settings.server_layer_ids)
        hidden_states = read_hidden_states_file(path, sample, layers, self.hidden_size)  # (T, 4, H)
        # (T, 3, H) -> (T, 3H), capture-layer order
        aux = hidden_states[:, :-1].reshape(hidden_states.shape[0], -1)
        # (T, H), post-norm
        final = rms_norm(hidden_states[:, -1], self.final_norm_weight, self.final_norm_eps)
        return CapturedSample.of(sample, aux.to(self.output_dtype), final.to(self.output_dtype))

    def capture_samples(self, samples: Sequence[TokenizedSample]) -> list[CapturedSample]:
        """One batch: every sample's request in flight at once (up to `concurrency`),
        features in sample order."""
        started = time.perf_counter()
        with httpx.Client() as client, concurrent.futures.ThreadPoolExecutor(self.server.settings.concurrency) as pool:
            paths = list(pool.map(lambda sample: self._request(client, sample), samples))
        captured = [self._captured(sample, path) for sample, path in zip(samples, paths, strict=True)]
        self.seconds_in_requests += time.perf_counter() - started
        return captured

    def capture_batches(self, batches: Iterable[Sequence[TokenizedSample]],
                        capture_layer_ids: Sequence[int]) -> Iterator[list[CapturedSample]]:
        if list(capture_layer_ids) != list(self.server.settings.layer_ids):
            raise ValueError(f"the vLLM server captures layers {list(self.server.settings.layer_ids)}, "
                             f"capture asked for {list(capture_layer_ids)}")
        for samples in batches:
            yield self.capture_samples(samples)


def vllm_settings_from_params(params, layout: TargetLayout, capture_layer_ids: Sequence[int], max_seq_len: int) -> VllmCaptureSettings:
    """The server settings stage 4 uses: params' capture.* (engine_python, TP/DP, engine
    args) and target.*."""
    capture = params.capture
    cuda = capture.device != "cpu"
    return VllmCaptureSettings(
        python=capture.engine_python or default_vllm_python(), model_dir=layout.folder, served_model=str(layout.folder),
        layer_ids=tuple(capture_layer_ids), num_hidden_layers=layout.num_hidden_layers, max_model_len=max_seq_len + 1,
        dtype=params.target.dtype, tensor_parallel=capture.tensor_parallel, data_parallel=capture.data_parallel,
        trust_remote_code=params.target.trust_remote_code, concurrency=capture.engine_concurrency,
        startup_timeout_s=capture.startup_timeout_s, cpu=not cuda, extra_args=tuple(capture.engine_args))
