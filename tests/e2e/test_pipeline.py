"""The whole pipeline on params/smoke.yaml through the runner (a staged run): six real papermill runs, real
server, real model, and the staged worker beside stage 3."""

import json
import subprocess
import sys

import pytest
import yaml

from eaglekit.paths import NOTEBOOKS_DIR, REPO_ROOT

pytestmark = pytest.mark.slow

STAGES = ["01_survey", "02_prep", "03_generation", "04_capture", "05_training", "06_analysis"]


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    scenario = yaml.safe_load((REPO_ROOT / "params" / "smoke.yaml").read_text())
    scenario["run"]["outputs_dir"] = str(root / "outputs")
    params_path = root / "smoke.yaml"
    params_path.write_text(yaml.safe_dump(scenario))
    result = subprocess.run(
        [sys.executable, "-m", "eaglekit.cli", "run", str(params_path), "--run-id", "smoke", "--staged"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return root / "outputs" / "smoke"


def test_every_stage_ran(smoke_run):
    state = json.loads((smoke_run / "state.json").read_text())
    assert state["completed"] == STAGES
    # The staged worker ran beside stage 3 and exited cleanly; how many sizes it staged depends on how soon
    # the 14 smoke prompts were answered (the test below stages every size deterministically).
    assert state["staged"]["exit_status"] == 0, state["staged"]
    assert "[staged] eaglekit.staged.worker: staged run:" in (smoke_run / "run.log").read_text()
    for stage in STAGES:
        assert (smoke_run / f"{stage}.ipynb").is_file()


def test_run_log_is_never_silent_for_more_than_30_s(smoke_run):
    from eaglekit.run_log import SILENCE_LIMIT_S
    from support import silent_stretches

    stretches = silent_stretches(smoke_run / "run.log", SILENCE_LIMIT_S)
    assert not stretches, "\n".join(f"{gap:.0f} s silent after: {before}" for before, _, gap in stretches)


def test_run_log_says_which_draft_stage_5_trains_and_which_part_stage_6_is_in(smoke_run):
    """Stage 5 names every draft, i of n, with the sweep's time left; stage 6 names each of its nine parts."""
    import re

    log = (smoke_run / "run.log").read_text()
    starts = re.findall(
        r"\[05_training\] eaglekit\.training\.sweep: stage 5: draft (\d+) of (\d+), "
        r"([^;\n]+); the sweep's time left (.*)",
        log,
    )
    total = int(starts[0][1])
    # smoke.yaml: sizes 4, 8, 12, one extra seed at the smallest size, the ablation pair
    assert [(int(index), int(of)) for index, of, _, _ in starts] == [
        (index, total) for index in range(1, total + 1)
    ] and total == 6
    assert [label for _, _, label, _ in starts] == [
        "size 4",
        "size 8",
        "size 12",
        "size 4, seed 1",
        "ablation: original answers",
        "ablation: regenerated answers",
    ]
    assert starts[0][3].startswith("not yet known") and all(
        left.startswith("at most") for *_, left in starts[1:]
    )
    parts = re.findall(r"\[06_analysis\] eaglekit\.analysis\.stage: stage 6, part (\d) of 9 done in", log)
    assert parts == [str(index) for index in range(1, 10)]


def test_executed_notebooks_hold_no_progress_bar_frozen_at_its_first_frame(smoke_run):
    import nbformat

    for stage in STAGES:
        notebook = nbformat.read(smoke_run / f"{stage}.ipynb", as_version=4)
        for cell in notebook.cells:
            for output in cell.get("outputs", []):
                data = output.get("data", {})
                assert "application/vnd.jupyter.widget-view+json" not in data, (
                    f"{stage}: a tqdm widget in cell [{cell.execution_count}]"
                )
                assert "0%|" not in output.get("text", ""), (
                    f"{stage}: a tqdm bar in cell [{cell.execution_count}]"
                )


def test_every_figure_a_notebook_saves_is_shown_in_it_too(smoke_run):
    # A library plot that switched the kernel to matplotlib's Agg backend left every later figure of stage 6
    # (accept length against data size, the topology sweep, the ablation) saved to figures/ but absent from
    # the executed notebook.
    import re

    import nbformat

    shown = []
    for stage in STAGES:
        notebook = nbformat.read(smoke_run / f"{stage}.ipynb", as_version=4)
        for cell in notebook.cells:
            images = [output for output in cell.get("outputs", []) if "image/png" in output.get("data", {})]
            for name in re.findall(r'savefig\(figures_dir / "([^"]+)"', cell.source):
                if (smoke_run / "figures" / name).is_file():
                    assert images, f"{stage}: figures/{name} saved, not shown in [{cell.execution_count}]"
                    shown.append(name)
    assert "06_accept_length_vs_data_size.png" in shown


def test_stage_outputs_feed_the_next_stage(smoke_run):
    prep = json.loads((smoke_run / "prep" / "summary.json").read_text())
    assert {source["source"] for source in prep["sources"]} == {"tooltalk", "sharegpt", "humaneval", "asdiv"}
    generations = (smoke_run / "generation" / "generations.jsonl").read_text().splitlines()
    assert len(generations) == sum(
        source["kept"] for source in prep["sources"] if source["data_class"] == "B"
    )
    assert (smoke_run / "capture" / "index.json").is_file()
    assert (smoke_run / "training" / "export" / "sglang" / "model.safetensors").is_file()
    summary = json.loads((smoke_run / "analysis" / "scaling_summary.json").read_text())
    assert summary  # the scaling answer, in numbers
    assert (smoke_run / "figures" / "06_accept_length_vs_data_size.png").stat().st_size > 10_000


def test_survey_notebook_runs_directly_with_papermill(tmp_path):
    """The documented direct path: papermill NOTEBOOK OUT -f params/X.yaml -p run_dir DIR."""
    import papermill

    params = yaml.safe_load((REPO_ROOT / "params" / "smoke.yaml").read_text())
    papermill.execute_notebook(
        str(NOTEBOOKS_DIR / "01_survey.ipynb"),
        str(tmp_path / "01_survey.ipynb"),
        parameters={**params, "run_dir": str(tmp_path / "run")},
        cwd=str(NOTEBOOKS_DIR),
        progress_bar=False,
    )
    assert (tmp_path / "run" / "survey").is_dir()
    assert list((tmp_path / "run" / "figures").glob("*.png"))


def test_the_sweep_splits_by_the_order_prep_planned_before_any_answer(smoke_run):
    """Stage 5's held-out set is prep's planned one (prep/order.json), and, where every planned sample was
    captured, the split stage 5 would make over the captured samples (the oracle)."""
    from eaglekit.capture.shards import ShardDataset
    from eaglekit.run_folder import tokenized_data_files
    from eaglekit.training.order import TrainingOrder
    from eaglekit.training.split import read_conversation_keys, split_heldout

    order = TrainingOrder.load(smoke_run / "prep" / "order.json")
    keys = [tuple(key) for key in ShardDataset(smoke_run / "capture").keys]
    sweep = json.loads((smoke_run / "training" / "sweep.json").read_text())
    heldout = [tuple(key) for key in sweep["heldout"]]
    assert heldout == [keys[index] for index in order.split(keys)[0]]
    assert set(heldout) <= set(order.heldout)
    if set(keys) == set(order.heldout) | set(order.train):
        conversations = read_conversation_keys(tokenized_data_files(smoke_run), keys)
        oracle, _ = split_heldout(
            [dataset for dataset, _ in keys], order.heldout_size, order.seed, conversations
        )
        assert heldout == [keys[index] for index in oracle]
    # Stage 3 said, before its first request, when each size could train.
    smallest = min(yaml.safe_load((smoke_run / "params.yaml").read_text())["training"]["data_sizes"])
    assert f"size {smallest} (and the held-out set) answered after " in (smoke_run / "run.log").read_text()


class StillRunning:
    """Generation reported as running: the worker stages every size whose slice the logs have settled."""

    def running(self) -> bool:
        return True

    def wait(self, seconds: float) -> None:
        raise AssertionError("the finished run's slices are all settled: the worker never waits for one")


def test_the_staged_worker_trains_each_size_on_the_subset_stage_5_trained_it_on(smoke_run, tmp_path):
    """On a copy of the finished run's prep and answers, with generation reported as running, the worker
    stages every size; each size trained on exactly the samples stage 5 trained that size on (the nested
    prefix of prep's order over the final capture), and the forecast was rewritten after each size."""
    import shutil

    from eaglekit.capture.shards import ShardDataset
    from eaglekit.config import load_params
    from eaglekit.staged import StagedRecord, read_forecast_history
    from eaglekit.staged.worker import StagedWorker
    from eaglekit.training.order import TrainingOrder

    run_dir = tmp_path / "run"
    for name in ("prep", "generation"):
        shutil.copytree(smoke_run / name, run_dir / name)
    params = load_params(smoke_run / "params.yaml")
    sizes = sorted(params.training.data_sizes)
    assert StagedWorker(params, run_dir, StillRunning()).run() == sizes

    order = TrainingOrder.load(smoke_run / "prep" / "order.json")
    keys = [tuple(key) for key in ShardDataset(smoke_run / "capture").keys]
    heldout, train = order.split(keys)
    record = StagedRecord.load(run_dir, params.run.seed, params.training.heldout_size)
    assert record.heldout == [keys[index] for index in heldout]
    for size in sizes:
        assert record.slices[size].train == [keys[index] for index in train[:size]], size
        assert record.slices[size].status == "done"
    assert record.vocab_counted_over == sizes[0]
    history = read_forecast_history(run_dir)
    assert [entry["sizes"] for entry in history] == [
        [float(size) for size in sizes[:count]] for count in range(1, len(sizes) + 1)
    ]
    assert history[0]["line"].startswith(("not yet known: one size measured", "go:")), history[0]["line"]
    assert all(entry["generation_running"] for entry in history)
    answer = json.loads((run_dir / "analysis" / "answer.json").read_text())
    assert answer["sizes"] == [float(size) for size in sizes]
