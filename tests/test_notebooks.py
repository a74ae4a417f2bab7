"""Committed notebooks: outputs stripped, exactly one `parameters` cell, thin (no def, class or lambda: logic
lives in lib/eaglekit, a cell is a library call and a display)."""

import ast
import json
from pathlib import Path

import nbformat
import pytest

from eaglekit.paths import REPO_ROOT

STAGE_NOTEBOOKS = sorted((REPO_ROOT / "notebooks").glob("*.ipynb"))
NOTEBOOKS = STAGE_NOTEBOOKS + sorted((REPO_ROOT / "tests" / "fixtures" / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.name for path in NOTEBOOKS])
def test_notebook_is_stripped_and_parameterized(path: Path):
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    code_cells = [cell for cell in notebook.cells if cell.cell_type == "code"]
    for cell in code_cells:
        assert not cell.outputs, f"{path.name}: a cell is committed with outputs (strip them)"
        assert cell.execution_count is None, f"{path.name}: a cell is committed with an execution count"
    tagged = [cell for cell in code_cells if "parameters" in cell.metadata.get("tags", [])]
    assert len(tagged) == 1, f"{path.name}: needs exactly one cell tagged `parameters`"
    tree = ast.parse(tagged[0].source)
    assert all(isinstance(node, (ast.Assign, ast.AnnAssign)) for node in tree.body), (
        "parameters cell holds literal assignments only"
    )
    for node in tree.body:
        value = node.value
        ast.literal_eval(value)  # literal defaults only: papermill does not recompute derived values
    definitions = [
        f"cell {index} line {line}: {kind}"
        for index, cell in enumerate(notebook.cells)
        if cell.cell_type == "code"
        for line, kind in definitions_in(cell.source)
    ]
    assert not definitions, f"{path.name}: notebooks are thin, move these into lib/eaglekit: {definitions}"


THIN = {
    ast.FunctionDef: "def",
    ast.AsyncFunctionDef: "async def",
    ast.ClassDef: "class",
    ast.Lambda: "lambda",
}


def definitions_in(source: str) -> list[tuple[int, str]]:
    """(line, kind) of every def, class and lambda in a code cell, nested ones included."""
    return [(node.lineno, THIN[type(node)]) for node in ast.walk(ast.parse(source)) if type(node) in THIN]


def test_thin_check_finds_every_definition():
    source = (
        "rows = [x for x in range(3)]\n"
        "def helper():\n    return sorted(rows, key=lambda x: -x)\n"
        "class Holder:\n    pass\n"
        "if rows:\n    async def later():\n        pass\n"
        "captured = open(path, load=lambda: model)\n"
    )
    assert sorted(definitions_in(source)) == [
        (2, "def"),
        (3, "lambda"),
        (4, "class"),
        (7, "async def"),
        (9, "lambda"),
    ]
    assert definitions_in("table = pd.DataFrame(rows).round(3)\nprint(sorted(rows))") == []


def test_stage_notebooks_are_named_for_the_runner():
    from eaglekit.runner import STAGE_FILE

    for path in sorted((REPO_ROOT / "notebooks").glob("*.ipynb")):
        assert STAGE_FILE.match(path.name), f"{path.name}: stage notebooks are NN_<name>.ipynb"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.name for path in NOTEBOOKS])
def test_papermill_sees_every_parameter(path: Path):
    """papermill's parser must read each parameters line, or the runner's values are silently dropped."""
    import papermill

    notebook = nbformat.read(path, as_version=4)
    cell = next(cell for cell in notebook.cells if "parameters" in cell.metadata.get("tags", []))
    assigned = {
        target.id
        for node in ast.parse(cell.source).body
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
    }
    assert set(papermill.inspect_notebook(str(path))) == assigned


@pytest.mark.parametrize("path", STAGE_NOTEBOOKS, ids=[path.name for path in STAGE_NOTEBOOKS])
def test_each_notebook_names_its_stage_to_the_run_folder(path: Path):
    """run_dir_for(..., stage=<its stage>) is what stops a notebook run by hand from leaving an empty folder
    or running into a finished stage's folder; a notebook that calls it without its stage has neither
    guard."""
    from eaglekit.runner import STAGE_FILE

    source = "\n".join(
        cell.source for cell in nbformat.read(path, as_version=4).cells if cell.cell_type == "code"
    )
    stage = STAGE_FILE.match(path.name).group(2)
    assert f'run_dir_for(params, run_dir, stage="{stage}")' in source, path.name


@pytest.mark.slow
def test_analysis_run_by_hand_with_no_run_folder_says_how_to_name_one_and_leaves_none(tmp_path):
    """`jupyter nbconvert --execute notebooks/06_analysis.ipynb` on a machine with no run: a located error
    naming EAGLEKIT_RUN_DIR, and no outputs/<name>-interactive/ left behind."""
    import os
    import subprocess
    import sys

    env = {key: value for key, value in os.environ.items() if not key.startswith("EAGLEKIT_")}
    notebook = tmp_path / "06_analysis.ipynb"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "papermill",
            str(REPO_ROOT / "notebooks" / "06_analysis.ipynb"),
            str(notebook),
            "-y",
            json.dumps({"run": {"name": "byhand", "outputs_dir": str(tmp_path / "outputs")}}),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert result.returncode != 0
    assert (
        "RunFolderError" in result.stderr
        and "EAGLEKIT_RUN_DIR=outputs/<run id> jupyter nbconvert" in result.stderr
    ), result.stderr[-3000:]
    assert not (tmp_path / "outputs").exists()
