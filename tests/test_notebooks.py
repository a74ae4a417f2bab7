"""Committed notebooks: outputs stripped, exactly one `parameters` cell, thin (no class definitions)."""

import ast
from pathlib import Path

import nbformat
import pytest

from eaglekit.paths import REPO_ROOT

NOTEBOOKS = sorted((REPO_ROOT / "notebooks").glob("*.ipynb")) + sorted((REPO_ROOT / "tests" / "fixtures" / "notebooks").glob("*.ipynb"))


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
    assert all(isinstance(node, (ast.Assign, ast.AnnAssign)) for node in tree.body), "parameters cell holds literal assignments only"
    for node in tree.body:
        value = node.value
        ast.literal_eval(value)  # literal defaults only: papermill does not recompute derived values
    for cell in code_cells:
        assert not any(isinstance(node, ast.ClassDef) for node in ast.walk(ast.parse(cell.source))), f"{path.name}: no classes in notebooks"


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
    assigned = {target.id for node in ast.parse(cell.source).body for target in (node.targets if isinstance(node, ast.Assign) else [node.target])}
    assert set(papermill.inspect_notebook(str(path))) == assigned
