"""Stage 5 reads any target through its TargetLayout (head tensors by the layout's names, Kimi-K2.5's
`language_model.*` too; a whole stage 5 on tiny DeepSeek-V3 and Kimi-K2.5-shaped targets). Stage 5 under
torchrun: `torchrun -m eaglekit.training` with 2 gloo processes (launched and streamed the way notebook 05
does) writes the same weights and sweep.json as one process on the same global batch; killed mid-run and
launched again, it continues the same loss curve."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from eaglekit.capture import capture_to_shards
from eaglekit.config import load_params
from eaglekit.io import write_json
from eaglekit.training.record import SweepRecord
from eaglekit.topology import Topology
from eaglekit.training import load_checkpoint
from eaglekit.training.stage import launch_training_stage, run_training_stage
from eaglekit.draft.model import build_draft_from_target, load_target_head_weights
from eaglekit.target import target_layout
from support import samples_from_target, tiny_target, tiny_target_folder

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SIZES = [4, 8]


@pytest.fixture(scope="module")
def captured_run(tmp_path_factory) -> tuple[Path, Path]:
    """A run folder whose stage 4 finished offline on a tiny real target; returns (run folder, target
    folder)."""
    root = tmp_path_factory.mktemp("stage5")
    target = tiny_target()
    target_dir = root / "target"
    target.save_pretrained(target_dir)
    run_dir = root / "run"
    for dataset in ("alpha", "beta"):
        folder = run_dir / "prep" / dataset
        folder.mkdir(parents=True)
        with open(folder / "tokenized_data.jsonl", "w") as handle:
            for sample in samples_from_target(
                target, 7, seed=len(dataset), datasets=(dataset,), max_length=30
            ):
                handle.write(
                    json.dumps(
                        {
                            "id": sample["id"],
                            "input_ids": sample["input_ids"].tolist(),
                            "loss_mask": sample["loss_mask"].tolist(),
                            "source": dataset,
                            "meta": {},
                        }
                    )
                    + "\n"
                )
    files = {dataset: run_dir / "prep" / dataset / "tokenized_data.jsonl" for dataset in ("alpha", "beta")}
    capture_to_shards(
        target,
        files,
        run_dir / "capture",
        model_name=str(target_dir),
        capture_layer_ids=[1, 2, 3],
        max_seq_len=64,
        progress=False,
    )
    write_json(run_dir / "capture" / "plan.json", {"mode": "offline"})
    return run_dir, target_dir


def write_params(path: Path, target_dir: Path, **training) -> Path:
    settings = {
        "data_sizes": SIZES,
        "heldout_size": 4,
        "ttt_steps": 2,
        "speculative_tokens": 2,
        "learning_rate": 3.0e-3,
        "min_learning_rate": 3.0e-4,
        "warmup_steps": 1,
        "schedule": "equal_steps",
        "max_steps": 4,
        "micro_batch_size": 1,
        "grad_accumulation_steps": 2,
        "eval_interval": 2,
        "max_length": 48,
        "log_interval_s": 0.01,
        **training,
    }
    path.write_text(
        yaml.safe_dump(
            {
                "run": {"name": "stage5", "outputs_dir": str(path.parent)},
                "target": {"model": str(target_dir)},
                "training": settings,
                "analysis": {"chain_steps": 2, "ablation": False},
            }
        )
    )
    return path


def fresh_run(captured_run, name: str) -> Path:
    source, _ = captured_run
    run_dir = source.parent / name
    shutil.copytree(source, run_dir)
    return run_dir


def train_losses(run_dir: Path, size: int) -> list[tuple[int, float]]:
    lines = (run_dir / "training" / f"size-{size:07d}" / "metrics.jsonl").read_text().splitlines()
    return [
        (record["step"], record["loss"]) for record in map(json.loads, lines) if record["split"] == "train"
    ]


def test_torchrun_two_processes_equal_one_process_and_resume_after_kill(captured_run, tmp_path):
    _, target_dir = captured_run
    # One process, padded micro-batches: global batch 1 sample x 4 micro-batches.
    single_dir = fresh_run(captured_run, "single")
    single_params = load_params(write_params(tmp_path / "single.yaml", target_dir, grad_accumulation_steps=4))
    single = run_training_stage(single_params, single_dir)

    # torchrun, 2 gloo processes, packed: 2 ranks x 1 sample x 2 micro-batches, through the notebook's
    # launcher.
    parallel_dir = fresh_run(captured_run, "torchrun")
    parallel_params = load_params(
        write_params(tmp_path / "ddp.yaml", target_dir, parallel="ddp", nproc_per_node=2, pack_tokens=64)
    )
    lines: list[str] = []
    sweep = launch_training_stage(parallel_params, parallel_dir, on_line=lines.append)
    assert any("step 4/4" in line for line in lines), lines[-20:]  # progress lines streamed as they came
    assert sweep == SweepRecord.load_run(parallel_dir)
    for key in ("sizes", "heldout", "draft_vocab", "capture_layer_ids", "topology", "export", "capture_mode"):
        assert getattr(sweep, key) == getattr(single, key), key
    assert sweep.draft_vocab.coverage_curve[-1] == [300, 1.0] and sweep.sizes == SIZES
    assert sweep.topology == Topology.chain(2) and all(
        entry.topology == Topology.chain(2) for entry in sweep.runs
    )
    for size in SIZES:
        one = load_checkpoint(single_dir / "training" / f"size-{size:07d}" / "last.pt")["model"]
        two = load_checkpoint(parallel_dir / "training" / f"size-{size:07d}" / "last.pt")["model"]
        for name in one:
            torch.testing.assert_close(two[name], one[name], rtol=1e-4, atol=2e-5, msg=f"size {size}: {name}")
        assert [loss for _, loss in train_losses(parallel_dir, size)] == pytest.approx(
            [loss for _, loss in train_losses(single_dir, size)], rel=1e-5
        )
    assert (parallel_dir / "training" / "export" / "sglang" / "model.safetensors").exists()

    # Kill the torchrun group after the first size's third step, launch again: the same curve.
    killed_dir = fresh_run(captured_run, "killed")
    metrics = killed_dir / "training" / f"size-{SIZES[0]:07d}" / "metrics.jsonl"

    def interrupt_after_step_three(line: str) -> None:
        if (
            metrics.exists()
            and sum('"split": "train"' in record for record in metrics.read_text().splitlines()) >= 3
        ):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        launch_training_stage(parallel_params, killed_dir, on_line=interrupt_after_step_three)
    assert not (killed_dir / "training" / "sweep.json").exists()
    launch_training_stage(parallel_params, killed_dir, on_line=lambda line: None)
    for size in SIZES:
        assert train_losses(killed_dir, size) == train_losses(parallel_dir, size)


def test_online_capture_trains_through_the_same_interface_as_the_shards(captured_run, tmp_path):
    """Stage 5 does not branch on the capture mode: with plan.json saying online and no shards, the target
    recomputes the features and the sweep has the same split, vocab and (bf16 features aside) the same
    taus."""
    _, target_dir = captured_run
    path = write_params(tmp_path / "p.yaml", target_dir)
    scenario = yaml.safe_load(path.read_text())
    scenario["target"]["capture_layers"] = [
        1,
        2,
        3,
    ]  # as the shards were captured (the tiny target's defaults collide)
    path.write_text(yaml.safe_dump(scenario))
    params = load_params(path)
    offline = run_training_stage(params, fresh_run(captured_run, "offline"))
    online_dir = fresh_run(captured_run, "online")
    for path in (online_dir / "capture").iterdir():
        path.unlink()
    write_json(online_dir / "capture" / "plan.json", {"mode": "online"})
    online = run_training_stage(params, online_dir)
    assert online.capture_mode == "online" and offline.capture_mode == "offline"
    assert sorted(online.heldout) == sorted(offline.heldout) and online.draft_vocab == offline.draft_vocab
    assert online.capture_layer_ids == offline.capture_layer_ids == [1, 2, 3]
    # Online features are float32 where the shards hold bf16: the taus agree to bf16 rounding.
    for one, two in zip(online.runs, offline.runs):
        assert one.size == two.size and one.best_accept_length == pytest.approx(
            two.best_accept_length, abs=0.05
        )


def test_a_nan_in_a_capture_shard_stops_stage_5_naming_the_shard_and_the_sample(captured_run, tmp_path):
    """One NaN in one training sample's features, written into its real shard file: the stage stops at the
    step that reads it, naming the shard and the sample, instead of logging `loss nan` and scoring a NaN
    draft."""
    from safetensors.torch import load_file, save_file

    from eaglekit.capture.shards import ShardDataset
    from eaglekit.run_folder import tokenized_data_files
    from eaglekit.training.order import sweep_split
    from eaglekit.training.split import nested_subsets, read_conversation_keys

    _, target_dir = captured_run
    run_dir = fresh_run(captured_run, "nan")
    params = load_params(write_params(tmp_path / "p.yaml", target_dir))
    captured = ShardDataset(run_dir / "capture")
    keys = captured.keys
    _, order = sweep_split(
        run_dir,
        keys,
        params.training.heldout_size,
        params.run.seed,
        read_conversation_keys(tokenized_data_files(run_dir), keys),
    )
    record = captured.samples[
        nested_subsets(order, SIZES)[SIZES[0]][0]
    ]  # a sample the smallest size trains on
    shard = run_dir / "capture" / record["shard"]
    tensors = load_file(shard)
    tensors["aux_hidden_states"][record["offset"] + 3, 0] = float("nan")
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(RuntimeError, match="non-finite feature") as error:
        run_training_stage(params, run_dir)
    assert f"sample {record['dataset']}/{record['id']} in shard {shard}" in str(error.value)
    assert not (run_dir / "training" / "sweep.json").exists()


def test_a_torn_best_checkpoint_is_found_on_read_and_retrained_on_rerun(captured_run, tmp_path):
    """best.pt of the smaller size cut in half after the sweep: reading sweep.json's checkpoints names it;
    rerunning stage 5 restores or retrains that size, and the sweep lists a best.pt that loads, with the same
    held-out tau."""
    _, target_dir = captured_run
    run_dir = fresh_run(captured_run, "torn_best")
    params = load_params(write_params(tmp_path / "p.yaml", target_dir))
    first = run_training_stage(params, run_dir)
    best = run_dir / first.runs[0].best_checkpoint
    with open(best, "r+b") as handle:
        handle.truncate(best.stat().st_size // 2)
    with pytest.raises(
        ValueError, match=f"{best}: torn checkpoint: .*bytes, sweep.json recorded"
    ):  # TornCheckpointError
        SweepRecord.load_run(run_dir).checkpoints(run_dir)
    second = run_training_stage(params, run_dir)
    assert load_checkpoint(best)["progress"]["step"] == second.runs[0].best_step
    assert list(second.checkpoints(run_dir)) == SIZES  # every checkpoint verified against sweep.json
    assert [entry.best_accept_length for entry in second.runs] == [
        entry.best_accept_length for entry in first.runs
    ]


def test_params_and_sizes_are_checked_before_training(captured_run, tmp_path):
    from eaglekit.config import ParamsError

    run_dir, target_dir = captured_run
    with pytest.raises(ParamsError, match="nproc_per_node 2 needs parallel"):
        load_params(write_params(tmp_path / "a.yaml", target_dir, nproc_per_node=2))
    with pytest.raises(ParamsError, match="pack_tokens 32 < max_length 48"):
        load_params(write_params(tmp_path / "b.yaml", target_dir, pack_tokens=32))
    with pytest.raises(ValueError, match=r"--sizes \[5\] are not in training.data_sizes"):
        run_training_stage(load_params(write_params(tmp_path / "c.yaml", target_dir)), run_dir, sizes=[5])


def test_notebook_05_launches_torchrun_streams_its_lines_and_plots_the_sweep(captured_run, tmp_path):
    """With training.nproc_per_node > 1, notebook 05 runs the stage under torchrun (2 gloo processes here),
    prints the workers' progress lines as its own output, and draws its figures from the files they wrote."""
    import papermill

    from eaglekit.paths import NOTEBOOKS_DIR

    _, target_dir = captured_run
    run_dir = fresh_run(captured_run, "notebook")
    (run_dir / "figures").mkdir(exist_ok=True)
    params = load_params(
        write_params(tmp_path / "nb.yaml", target_dir, parallel="ddp", nproc_per_node=2, pack_tokens=64)
    )
    notebook = NOTEBOOKS_DIR / "05_training.ipynb"
    declared = set(papermill.inspect_notebook(str(notebook)))
    parameters = {
        key: value for key, value in dict(params.sections(), run_dir=str(run_dir)).items() if key in declared
    }
    executed = tmp_path / "05_training.ipynb"
    papermill.execute_notebook(
        str(notebook),
        str(executed),
        parameters=parameters,
        kernel_name="python3",
        cwd=str(notebook.parent),
        progress_bar=False,
    )
    printed = "".join(
        "".join(output["text"])
        for cell in json.loads(executed.read_text())["cells"]
        for output in cell.get("outputs", [])
        if output.get("output_type") == "stream"
    )
    assert f"size-{SIZES[-1]:07d}: step 4/4" in printed, printed[-2000:]  # a worker's progress line, streamed
    assert SweepRecord.load_run(run_dir).sizes == SIZES
    for figure in (
        "05_vocab_coverage.png",
        "05_loss_accuracy_by_position.png",
        "05_heldout_accept_length.png",
    ):
        assert (run_dir / "figures" / figure).stat().st_size > 0, figure


@pytest.mark.parametrize("family", ["llama", "deepseek_v3", "kimi_k25"])
def test_head_tensors_are_the_text_models_own(family, tmp_path):
    layout = target_layout(tiny_target_folder(family, tmp_path / family))
    head = load_target_head_weights(layout)
    text_model = layout.load_text_model(dtype=torch.float32)
    assert head.config.hidden_size == layout.hidden_size and head.config.vocab_size == layout.vocab_size
    assert head.config.num_hidden_layers == layout.num_hidden_layers
    torch.testing.assert_close(
        head.embed_tokens, text_model.get_input_embeddings().weight.detach(), rtol=0, atol=0
    )
    torch.testing.assert_close(
        head.lm_head, text_model.get_output_embeddings().weight.detach(), rtol=0, atol=0
    )
    torch.testing.assert_close(head.final_norm, text_model.model.norm.weight.detach(), rtol=0, atol=0)
    draft_vocab = 16
    draft = build_draft_from_target(
        head, torch.zeros(draft_vocab, dtype=torch.int64), torch.arange(layout.vocab_size) < draft_vocab
    )
    assert draft.config.hidden_size == layout.hidden_size and draft.config.vocab_size == layout.vocab_size
    assert draft.config.target_num_hidden_layers == layout.num_hidden_layers


def test_wrapper_config_is_the_text_config(tmp_path):
    """The Kimi wrapper's top-level config has no hidden_size: reading it (as AutoConfig of the folder did) is
    wrong."""
    layout = target_layout(tiny_target_folder("kimi_k25", tmp_path / "kimi"))
    assert layout.is_wrapper and "hidden_size" not in layout.config
    assert load_target_head_weights(layout).config.hidden_size == layout.text_config["hidden_size"]


@pytest.mark.parametrize("family", ["deepseek_v3", "kimi_k25"])
def test_stage5_on_moe_mla_targets(family, tmp_path):
    target_dir = tiny_target_folder(family, tmp_path / "target")
    layout = target_layout(target_dir)
    model = layout.load_text_model(dtype=torch.float32).eval()
    run_dir = tmp_path / "run"
    generator = torch.Generator().manual_seed(0)
    files = {}
    for dataset in ("alpha", "beta"):
        folder = run_dir / "prep" / dataset
        folder.mkdir(parents=True)
        files[dataset] = folder / "tokenized_data.jsonl"
        with open(files[dataset], "w") as handle:
            for index in range(6):
                length = int(torch.randint(12, 24, (1,), generator=generator))
                input_ids = torch.randint(
                    0, 400, (length,), generator=generator
                ).tolist()  # a vocab prefix: the draft vocab stays small
                loss_mask = [0] * 4 + [1] * (length - 4)
                handle.write(
                    json.dumps(
                        {
                            "id": f"{dataset}-{index}",
                            "input_ids": input_ids,
                            "loss_mask": loss_mask,
                            "source": dataset,
                            "meta": {},
                        }
                    )
                    + "\n"
                )
    capture_to_shards(
        model,
        files,
        run_dir / "capture",
        model_name=str(target_dir),
        capture_layer_ids=[1, 2, 3],
        max_seq_len=32,
        progress=False,
    )
    write_json(run_dir / "capture" / "plan.json", {"mode": "offline"})
    params_path = tmp_path / "params.yaml"
    params_path.write_text(
        yaml.safe_dump(
            {
                "run": {"name": "layout", "outputs_dir": str(tmp_path)},
                "target": {"model": str(target_dir), "capture_layers": [1, 2, 3]},
                "training": {
                    "data_sizes": [4, 8],
                    "heldout_size": 4,
                    "ttt_steps": 2,
                    "speculative_tokens": 2,
                    "draft_vocab_size": 64,
                    "learning_rate": 3.0e-3,
                    "min_learning_rate": 3.0e-4,
                    "warmup_steps": 1,
                    "schedule": "equal_steps",
                    "max_steps": 2,
                    "micro_batch_size": 1,
                    "grad_accumulation_steps": 2,
                    "eval_interval": 2,
                    "max_length": 32,
                    "log_interval_s": 60,
                },
                "analysis": {"chain_steps": 2, "ablation": False},
            }
        )
    )
    sweep = run_training_stage(load_params(params_path), run_dir)
    assert sweep == SweepRecord.load_run(run_dir) and sweep.sizes == [4, 8]
    assert sweep.draft_vocab.size == 64 and sweep.capture_layer_ids == [1, 2, 3]
    exported = json.loads((run_dir / sweep.export["sglang"] / "config.json").read_text())
    assert exported["hidden_size"] == layout.hidden_size and exported["vocab_size"] == layout.vocab_size
    assert exported["draft_vocab_size"] == 64


def _draft_lines(caplog) -> list[str]:
    return [
        record.getMessage() for record in caplog.records if record.getMessage().startswith("stage 5: draft")
    ]


def test_checkpoints_are_picked_on_a_selection_split_and_extra_seeds_reach_stage_6_as_measured_noise(
    captured_run, tmp_path, caplog
):
    """Stage 5 cuts the held-out set in two: every draft's best checkpoint is picked on the selection side
    (its best tau is that side's), sweep.json's `heldout` is the other side alone; both are stable across a
    resume. The extra seed at the small size trains on that size's samples, is listed with its checkpoint
    verified, and stage 6 scores it on the scored side and hands it to the forecast as measured training
    noise, not the prior."""
    from eaglekit.analysis.checkpoints import load_draft_checkpoint
    from eaglekit.analysis.forecast import training_noise
    from eaglekit.analysis.stage import _seed_accept_lengths
    from eaglekit.capture.shards import ShardDataset
    from eaglekit.run_folder import tokenized_data_files
    from eaglekit.training import per_position_agreement, simulated_accept_length
    from eaglekit.training.order import sweep_split
    from eaglekit.training.split import IndexedSubset, read_conversation_keys

    _, target_dir = captured_run
    run_dir = fresh_run(captured_run, "selection")
    params = load_params(
        write_params(tmp_path / "p.yaml", target_dir, heldout_size=6, noise_seeds=1, noise_seed_max_size=4)
    )
    caplog.set_level("INFO", logger="eaglekit.training.sweep")
    sweep = run_training_stage(params, run_dir)
    # The log counts every draft of the stage (two sizes, then the extra seed) and prices the rest from timed
    # steps.
    lines = _draft_lines(caplog)
    assert [line.split(";")[0].split(", done")[0] for line in lines] == [
        "stage 5: draft 1 of 3, size 4",
        "stage 5: draft 1 of 3, size 4",
        "stage 5: draft 2 of 3, size 8",
        "stage 5: draft 2 of 3, size 8",
        "stage 5: draft 3 of 3, size 4, seed 1",
        "stage 5: draft 3 of 3, size 4, seed 1",
    ]
    assert "time left not yet known (12 steps at the step caps" in lines[0]
    assert "time left about " in lines[2] and "(8 steps at " in lines[2] and "time left about " in lines[4]
    assert "done: 4 steps in" in lines[1] and "(step_cap)" in lines[1]
    caplog.clear()
    captured = ShardDataset(run_dir / "capture")
    keys = captured.keys
    heldout_indices, _ = sweep_split(
        run_dir, keys, 6, params.run.seed, read_conversation_keys(tokenized_data_files(run_dir), keys)
    )
    assert sweep.heldout == [keys[index] for index in heldout_indices]  # every sample no draft trained on
    assert sweep.selection and sweep.scored and set(sweep.selection).isdisjoint(sweep.scored)
    assert sorted(sweep.selection + sweep.scored) == sorted(sweep.heldout)
    assert not sweep.picked_on_scored and SweepRecord.load_run(run_dir) == sweep

    head = load_target_head_weights(target_layout(target_dir))
    position = {key: index for index, key in enumerate(keys)}

    def tau_on(entry, side):
        draft = load_draft_checkpoint(run_dir / entry.best_checkpoint, head.embed_tokens)
        samples = IndexedSubset(captured, [position[key] for key in side])
        return simulated_accept_length(per_position_agreement(draft, head.lm_head, samples, 2, 48), 2)[
            "simulated_accept_length"
        ]

    for entry in sweep.runs + sweep.noise_seeds:  # each best tau is the selection side's, where it was picked
        assert entry.heldout_size == len(sweep.selection)
        assert tau_on(entry, sweep.selection) == pytest.approx(entry.best_accept_length, abs=1e-6), (
            entry.variant
        )

    seeds = sweep.seed_checkpoints(run_dir)
    assert seeds == {4: [run_dir / "training" / "seed-1" / "size-0000004" / "best.pt"]}
    assert [(entry.size, entry.noise_seed, entry.samples_by_dataset) for entry in sweep.noise_seeds] == [
        (4, 1, sweep.runs[0].samples_by_dataset)
    ]
    scored = [captured[position[key]] for key in sweep.scored]
    measured = _seed_accept_lengths(sweep, run_dir, head, scored, 2, 48)  # what stage 6 hands the forecast
    assert measured == {4.0: [pytest.approx(tau_on(sweep.noise_seeds[0], sweep.scored), abs=1e-6)]}
    noise = training_noise(
        {4.0: sweep.runs[0].best_accept_length, 8.0: sweep.runs[1].best_accept_length}, measured
    )
    assert noise.seeds_by_size == {4.0: 1} and "pooled with 1 extra seeds" in noise.source

    # A resume finds every draft trained: the same cut, the same drafts, the same record; the log says each
    # resumed at its end.
    again = run_training_stage(params, run_dir)
    assert all("resumed at step 4" in line for line in _draft_lines(caplog)[1::2])
    assert (again.heldout, again.selection, again.scored) == (sweep.heldout, sweep.selection, sweep.scored)
    assert again.runs == sweep.runs and again.noise_seeds == sweep.noise_seeds
