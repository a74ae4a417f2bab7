"""The executed notebook: papermill's saves go through the kit's atomic handler, which also says what runs
now."""

import datetime as dt

import nbformat
from papermill.iorw import write_ipynb

from eaglekit.executed_notebook import notebook_saves, running_cell


def test_the_running_cell_is_named_by_its_coming_number_its_first_statement_and_its_time(tmp_path):
    output = tmp_path / "06_analysis.ipynb"
    notebook_saves(output)
    assert running_cell(output) == ""  # nothing saved yet
    done = nbformat.v4.new_code_cell("x = 1")
    done.execution_count, done.metadata["papermill"] = 3, {"status": "completed"}
    running = nbformat.v4.new_code_cell(
        "from eaglekit.analysis.stage import run_analysis_stage\n\nresult = run_analysis_stage(params, out)"
    )
    started = dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=75)
    running.metadata["papermill"] = {"status": "running", "start_time": started.isoformat()}
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [done, running]
    write_ipynb(notebook, str(output))  # papermill's own save, through the registered handler
    assert running_cell(output) in (
        " in cell [4] (`result = run_analysis_stage(params, out)`) for 1m15s",
        " in cell [4] (`result = run_analysis_stage(params, out)`) for 1m16s",
    )
    assert (
        nbformat.read(output, as_version=4).cells[1].metadata.papermill.status == "running"
    )  # and the file is whole
