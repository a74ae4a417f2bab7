"""`eaglekit evaluate` end to end on the embedded target: a small fitted draft exported with the kit's own
export functions (SGLang and vLLM folders), a prompts file in the kit's schema and OpenAI's, a chain and a
tree."""

from __future__ import annotations

import json

import pytest
import torch
from eaglekit.cli import main
from support import fit_draft_on_greedy_answers
from eaglekit.draft.model import load_target_head_weights
from eaglekit.analysis.evaluate import load_draft_for_target, read_prompts
from eaglekit.draft.export import export_sglang, export_vllm
from eaglekit.io import InputError
from transformers import AutoModelForCausalLM

pytestmark = pytest.mark.usefixtures("one_torch_thread")

QUESTIONS = ["Name two colors.", "What is two plus two?"]
MAX_NEW_TOKENS = 12


@pytest.fixture(scope="module")
def target(embedded_model_dir):
    return AutoModelForCausalLM.from_pretrained(embedded_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def fitted(embedded_model_dir, target):
    """A draft overfitted for a few steps on the target's own greedy answers; (draft, prompts, sequences)."""
    return fit_draft_on_greedy_answers(
        embedded_model_dir, QUESTIONS, MAX_NEW_TOKENS, steps=10, ttt_steps=2, target=target
    )


@pytest.fixture(scope="module")
def exports(tmp_path_factory, target, fitted):
    """The fitted draft exported with the kit's own functions, in both formats."""
    draft = fitted[0]
    root = tmp_path_factory.mktemp("exports")
    sglang = export_sglang(draft, target.config, root / "sglang")
    vllm = export_vllm(draft, target.config, root / "vllm", verifier_name_or_path="embedded")
    return sglang, vllm


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    lines = [
        # The kit's conversation schema; the trailing assistant turn is the reference answer and is dropped.
        {
            "id": "kit-1",
            "source": "test",
            "messages": [
                {"role": "user", "content": QUESTIONS[0]},
                {"role": "assistant", "content": "Red and blue."},
            ],
            "meta": {},
        },
        # OpenAI messages as a bare list.
        [{"role": "system", "content": "You are brief."}, {"role": "user", "content": QUESTIONS[1]}],
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_evaluate_command_end_to_end(tmp_path, embedded_model_dir, exports, prompts_file, capsys):
    sglang_dir, _ = exports
    out = tmp_path / "out.json"
    code = main(
        [
            "evaluate",
            "--target",
            str(embedded_model_dir),
            "--draft",
            str(sglang_dir),
            "--prompts",
            str(prompts_file),
            "--topology",
            "chain:2",
            "--topology",
            "tree:3,2,6",
            "--max-new-tokens",
            str(MAX_NEW_TOKENS),
            "--json",
            str(out),
            "--resamples",
            "200",
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0, printed
    report = json.loads(out.read_text())
    chain, tree = report["topologies"]
    assert (chain["topology"], chain["steps"], chain["top_k"], chain["draft_tokens"]) == ("chain:2", 2, 1, 3)
    assert (tree["topology"], tree["steps"], tree["top_k"], tree["draft_tokens"]) == ("tree:3,2,6", 3, 2, 6)
    assert (
        chain["vllm_speculative_config"]["num_speculative_tokens"] == 2
        and tree["vllm_speculative_config"] is None
    )
    for record in (chain, tree):
        assert record["outputs_equal"] is True
        rows = record["per_prompt"]
        assert [row["prompt"] for row in rows] == ["kit-1", "line2"]
        # tau_server counts completion tokens (prefill token included, budget cuts applied) per verification.
        assert record["tau_server"] == pytest.approx(
            sum(r["output_tokens"] for r in rows) / sum(r["verification_steps"] for r in rows)
        )
        assert (
            1.0 <= record["tau_loop"] <= record["steps"] + 1
            and 1.0 <= record["tau_offline"] <= record["steps"] + 1
        )
        low, high = record["tau_loop_interval"]
        assert low <= record["tau_loop"] <= high
        assert record["tokens_per_s"] > 0 and record["greedy_tokens_per_s"] > 0
        assert record["speedup"] == pytest.approx(record["tokens_per_s"] / record["greedy_tokens_per_s"])
    # The fitted draft accepts something, and the tree (which holds the chain's first two levels) no less
    # offline.
    assert chain["tau_offline"] > 1.1
    assert tree["tau_offline"] >= chain["tau_offline"] - 1e-9
    assert "tau loop" in printed and "lossless    yes" in printed and "tree:3,2,6" in printed


def test_vllm_and_sglang_exports_load_the_same_draft(embedded_model_dir, exports, target):
    sglang_dir, vllm_dir = exports
    from_sglang, from_vllm = (
        load_draft_for_target(sglang_dir, target),
        load_draft_for_target(vllm_dir, target),
    )
    # The two configs spell the capture layers differently (SGLang id + 1); both must land on the same layers.
    assert from_sglang.config.capture_layer_indices == from_vllm.config.capture_layer_indices == (2, 15, 27)
    for name, tensor in from_sglang.state_dict().items():
        assert torch.equal(tensor, from_vllm.state_dict()[name]), name
    assert from_sglang.fc.weight.dtype == torch.float32  # a bf16 export runs in the target's dtype


def test_bad_prompts_and_topologies_fail_clearly(tmp_path, embedded_model_dir, exports, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"messages": [{"role": "user", "content": "hi"}]}\n'
        '{"messages": [{"role": "robot", "content": "x"}]}\n'
    )
    with pytest.raises(InputError, match=r"bad.jsonl:2: field 'messages\[0\].role'"):
        read_prompts(path)
    path.write_text('{"prompt": "hi"}\n')
    with pytest.raises(InputError, match=r"bad.jsonl:1: field 'messages'"):
        read_prompts(path)
    path.write_text('{"messages": [{"role": "assistant", "content": "only an answer"}]}\n')
    with pytest.raises(InputError, match="only assistant turns"):
        read_prompts(path)
    assert (
        main(
            [
                "evaluate",
                "--target",
                str(embedded_model_dir),
                "--draft",
                str(exports[0]),
                "--prompts",
                str(path),
                "--topology",
                "tree:3,1,8",
            ]
        )
        == 2
    )
    assert "with top-k 1 the tree is a chain" in capsys.readouterr().err
    assert (
        main(
            [
                "evaluate",
                "--target",
                str(embedded_model_dir),
                "--draft",
                str(exports[0]),
                "--prompts",
                str(path),
            ]
        )
        == 1
    )
    assert "only assistant turns" in capsys.readouterr().err


@pytest.fixture(scope="module")
def heldout_samples(target, fitted):
    """The greedy sequences as capture stores them: features, final hidden states, loss mask on the answer."""
    draft, prompts, sequences = fitted
    samples = []
    with torch.no_grad():
        for index, (prompt, sequence) in enumerate(zip(prompts, sequences)):
            hidden = target(torch.tensor([sequence]), output_hidden_states=True).hidden_states
            samples.append(
                {
                    "id": f"s{index}",
                    "dataset": "demo",
                    "input_ids": torch.tensor(sequence),
                    "loss_mask": torch.tensor([0] * len(prompt) + [1] * (len(sequence) - len(prompt))),
                    "aux_hidden_states": torch.cat(
                        [hidden[i] for i in draft.config.capture_layer_indices], dim=-1
                    )[0],
                    "final_hidden_states": hidden[-1][0],
                }
            )
    return samples


def test_tree_depths_from_captured_features_with_top_k_1_equal_the_chain_evaluation(
    embedded_model_dir, fitted, heldout_samples
):
    """K = 1 from shards-style samples gives training's chain agreement exactly (same rows, same leading
    agreements)."""
    import numpy as np
    from eaglekit.topology import Topology
    from eaglekit.analysis.topology_sweep import tree_depths_by_dataset
    from eaglekit.training import per_position_agreement

    draft = fitted[0]
    lm_head = load_target_head_weights(embedded_model_dir).lm_head
    chain = per_position_agreement(draft, lm_head, heldout_samples, 2)
    depths = tree_depths_by_dataset(
        draft, lm_head, heldout_samples, [Topology.chain(2), Topology.parse("tree:2,2,5")]
    )
    for sample, tree_depths in zip(chain, depths[Topology.chain(2)]["demo"]):
        assert (
            tree_depths.tolist() == np.logical_and.accumulate(sample.agreement, axis=1).sum(axis=1).tolist()
        )
    assert (
        sum(int(array.sum()) for array in depths[Topology.chain(2)]["demo"]) > 0
    )  # the draft accepts something


def test_measured_topology_sweep(target, embedded_model_dir, exports, heldout_samples):
    """Real step costs on this machine, a small grid scored on the held-out samples, a recommendation."""
    from eaglekit.topology import Topology
    from eaglekit.analysis.topology_sweep import (
        measure_step_costs,
        pool_datasets,
        recommend,
        sweep_table,
        tree_depths_by_dataset,
    )

    draft = load_draft_for_target(exports[0], target)
    costs = measure_step_costs(
        target, draft, context_length=32, verify_tokens=(1, 8), draft_nodes=(1, 8), repeats=2
    )
    assert (
        costs.target_step_s > 0
        and costs.verify_base_s > 0
        and costs.draft_base_s > 0
        and "cpu" in costs.source
    )
    grid = [Topology.chain(1), Topology.chain(2), Topology.parse("tree:2,2,4"), Topology.parse("tree:2,2,6")]
    depths = tree_depths_by_dataset(
        draft, load_target_head_weights(embedded_model_dir).lm_head, heldout_samples, grid
    )
    table = sweep_table(
        {topology: pool_datasets(by_dataset) for topology, by_dataset in depths.items()},
        costs,
        num_resamples=100,
    )
    assert set(table["topology"]) == {str(topology) for topology in grid}
    # A tree that holds the chain's path with more tokens never accepts less on the same rows.
    by_name = table.set_index("topology")
    assert by_name.loc["tree:2,2,6", "tau"] >= by_name.loc["chain:2", "tau"] - 1e-9
    choice = recommend(table, costs)
    assert choice["sglang"]["topology"] in by_name.index and "vllm" in choice


def test_an_export_with_nan_weights_is_refused_before_any_tau(tmp_path):
    """A NaN written into an exported model.safetensors (an export from before the guard, or a damaged copy):
    evaluating it names the folder instead of reporting the accept length a NaN draft fakes."""
    from safetensors.torch import load_file, save_file

    from support import samples_from_target, tiny_draft, tiny_target

    tiny = tiny_target()
    folder = export_sglang(
        tiny_draft(tiny, samples_from_target(tiny, 3, seed=5)), tiny.config, tmp_path / "sglang"
    )
    tensors = load_file(folder / "model.safetensors")
    tensors["lm_head.weight"][3, 1] = float("nan")
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(RuntimeError, match=rf"{folder}: the draft's weights \['lm_head.weight'\] hold NaN"):
        load_draft_for_target(folder, tiny)
