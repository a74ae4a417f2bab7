"""The pipeline runner: stage notebooks executed in order with papermill into a run folder.

`outputs/<run_id>/` receives `params.yaml` (resolved), `environment.json`, `run.log`,
`state.json` (which stages finished), and each executed notebook `NN_<stage>.ipynb`.
Stages are the notebooks `NN_<name>.ipynb` found in the notebooks folder; a notebook whose
metadata says `"eaglekit": {"needs_endpoint": true}` gets the endpoints (the embedded server,
started once for the run, when params name none).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import nbformat

from eaglekit.config import Params, dump_params, load_params, repo_path
from eaglekit.io import atomic_write, write_json
from eaglekit.paths import NOTEBOOKS_DIR
from eaglekit.runs import new_run_id, write_environment

STAGE_FILE = re.compile(r"^(\d\d)_([a-z0-9_]+)\.ipynb$")


class RunError(RuntimeError):
    pass


@dataclass(frozen=True)
class Stage:
    number: str  # "01"
    name: str  # "survey"
    notebook: Path
    needs_endpoint: bool

    @property
    def label(self) -> str:
        return f"{self.number}_{self.name}"


def discover_stages(notebooks_dir: Path = NOTEBOOKS_DIR) -> list[Stage]:
    stages = []
    for path in sorted(Path(notebooks_dir).glob("*.ipynb")):
        match = STAGE_FILE.match(path.name)
        if not match:
            continue
        metadata = nbformat.read(path, as_version=4).metadata.get("eaglekit", {})
        stages.append(Stage(match[1], match[2], path, bool(metadata.get("needs_endpoint", False))))
    return stages


def select_stages(stages: list[Stage], wanted: list[str] | None) -> list[Stage]:
    """`wanted` holds stage names or numbers ("prep", "02", "02_prep"); None means all."""
    if not wanted:
        return stages
    chosen = []
    for item in wanted:
        match = [stage for stage in stages if item in (stage.name, stage.number, stage.label)]
        if not match:
            known = ", ".join(stage.label for stage in stages)
            raise RunError(f"unknown stage {item!r}; stages here: {known}")
        chosen.extend(stage for stage in match if stage not in chosen)
    return sorted(chosen, key=lambda stage: stage.number)


def _logger(run_dir: Path) -> logging.Logger:
    logger = logging.getLogger(f"eaglekit.run.{run_dir.name}")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    if not logger.handlers:
        formatter = logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%Y-%m-%d %H:%M:%S")
        for handler in (logging.FileHandler(run_dir / "run.log"), logging.StreamHandler()):
            handler.setFormatter(formatter)
            logger.addHandler(handler)
    return logger


def _read_state(run_dir: Path) -> dict:
    path = run_dir / "state.json"
    return json.loads(path.read_text()) if path.exists() else {"completed": [], "failed": None}


def _save_params(run_dir: Path, params: Params) -> None:
    """params.yaml is the resolved params; on a resume with changed params the old file is kept beside it."""
    text = dump_params(params)
    path = run_dir / "params.yaml"
    if path.exists() and path.read_text(encoding="utf-8") != text:
        stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        shutil.copy2(path, run_dir / f"params.before-{stamp}.yaml")
    with atomic_write(path) as handle:
        handle.write(text)


def run_pipeline(
    params_path: str | Path,
    stages: list[str] | None = None,
    run_id: str | None = None,
    resume: bool = False,
    notebooks_dir: Path = NOTEBOOKS_DIR,
    kernel_name: str = "python3",
) -> Path:
    """Run the selected stages; returns the run folder. Raises RunError naming the failed cell."""
    import papermill
    from traitlets.config import Config

    from eaglekit.server import serving_endpoints

    # The kernel's ZMQ sockets on 127.0.0.1 use CurveZMQ when the kernelspec supports it
    # (ipykernel does), instead of plain text and a warning from every stage.
    kernel_config = Config({"KernelManager": {"transport_encryption": "auto"}})

    params = load_params(params_path)  # fail before creating anything
    all_stages = discover_stages(notebooks_dir)
    if not all_stages:
        raise RunError(f"no stage notebooks (NN_name.ipynb) in {notebooks_dir}")
    chosen = select_stages(all_stages, stages)
    outputs = repo_path(params.run.outputs_dir)
    if resume:
        if not run_id:
            raise RunError("--resume needs --run-id: the run folder to continue")
        run_dir = outputs / run_id
        if not run_dir.is_dir():
            raise RunError(f"--resume: no run folder {run_dir}")
    else:
        run_id = run_id or new_run_id(params.run.name)
        run_dir = outputs / run_id
        if run_dir.exists():
            raise RunError(f"run folder {run_dir} exists and runs are never overwritten: pick another --run-id or pass --resume")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "figures").mkdir(exist_ok=True)
    logger = _logger(run_dir)
    state = _read_state(run_dir)
    if resume:
        done = set(state["completed"])
        skipped = [stage.label for stage in chosen if stage.label in done]
        chosen = [stage for stage in chosen if stage.label not in done]
        logger.info("resuming run %s: done already %s; to run %s", run_id, skipped or "none", [s.label for s in chosen])
    _save_params(run_dir, params)
    write_environment(run_dir)
    logger.info("run %s: stages %s -> %s", run_id, [stage.label for stage in chosen], run_dir)

    with contextlib.ExitStack() as stack:
        endpoints = None
        for stage in chosen:
            if stage.needs_endpoint and endpoints is None:
                logger.info("starting endpoints (embedded server unless params name endpoints)")
                endpoints = stack.enter_context(serving_endpoints(params, log_path=run_dir / "server.log"))
                logger.info("endpoints: %s", [endpoint.url for endpoint in endpoints])
            parameters = dict(params.sections(), run_dir=str(run_dir))
            if stage.needs_endpoint:
                parameters["endpoints"] = [endpoint.model_dump(mode="json") for endpoint in endpoints]
            declared = set(papermill.inspect_notebook(str(stage.notebook)))
            parameters = {key: value for key, value in parameters.items() if key in declared}
            output = run_dir / stage.notebook.name
            logger.info("stage %s: running %s", stage.label, stage.notebook)
            started = time.monotonic()
            try:
                papermill.execute_notebook(
                    str(stage.notebook), str(output), parameters=parameters, kernel_name=kernel_name,
                    cwd=str(stage.notebook.parent), progress_bar=False, log_output=False,
                    config=kernel_config,
                )
            except KeyboardInterrupt:
                state["failed"] = stage.label
                write_json(run_dir / "state.json", state)
                logger.error("interrupted in stage %s; continue with: eaglekit run %s --run-id %s --resume", stage.label, params_path, run_id)
                raise
            except papermill.PapermillExecutionError as error:
                state["failed"] = stage.label
                write_json(run_dir / "state.json", state)
                cell_source = "\n".join("    " + line for line in (error.source or "").splitlines()[:15])
                message = (
                    f"stage {stage.label} failed in cell [{error.exec_count}]:\n{cell_source}\n"
                    f"{error.ename}: {error.evalue}\n"
                    f"executed notebook: {output}\n"
                    f"after fixing, continue with: eaglekit run {params_path} --run-id {run_id} --resume"
                )
                logger.error(message)
                raise RunError(message) from None
            state["completed"] = [*state["completed"], stage.label]
            state["failed"] = None
            write_json(run_dir / "state.json", state)
            logger.info("stage %s: done in %.1fs", stage.label, time.monotonic() - started)
    logger.info("run %s complete: %s", run_id, run_dir)
    return run_dir
