"""Topology: SGLang's S/K/T and vLLM's num_speculative_tokens, text form, records, serving flags."""

from __future__ import annotations

import pytest
from eaglekit.topology import Topology, parse_topologies


def test_chain_and_tree_round_trip_through_text_and_records():
    chain, tree = Topology.parse("chain:3"), Topology.parse("tree:5,8,32")
    assert (chain.steps, chain.top_k, chain.draft_tokens, chain.kind) == (3, 1, 4, "chain")
    assert (tree.steps, tree.top_k, tree.draft_tokens, tree.kind) == (5, 8, 32, "tree")
    assert str(chain) == "chain:3" and str(tree) == "tree:5,8,32"
    for topology in (chain, tree):
        assert Topology.parse(str(topology)) == topology
        assert Topology.from_dict(topology.to_dict()) == topology
    # The record uses the keys notebook 06 and checkpoint_evaluation.summarize already write.
    assert chain.to_dict() == {"topology": "chain", "steps": 3, "top_k": 1, "draft_tokens": 4}
    assert Topology.chain(3) == Topology(3)


def test_ceiling_and_candidates():
    # Accept length counts the bonus token: a tree of depth S emits at most S + 1 per verification.
    assert Topology.parse("tree:5,8,32").ceiling == 6 and Topology.chain(3).ceiling == 4
    # K + (S - 1) K^2 candidates: SGLang picks T - 1 of them.
    assert Topology.parse("tree:5,8,32").candidates == 8 + 4 * 64
    assert Topology.chain(4).candidates == 4


@pytest.mark.parametrize(
    "text, message",
    [
        ("chain", "write chain:k"),
        ("tree:5,8", "write chain:k"),
        ("beam:3", "write chain:k"),
        ("chain:x", "write chain:k"),
        ("chain:0", "steps S must be >= 1"),
        ("tree:3,0,4", "top-k K must be >= 1"),
        ("tree:3,1,8", "with top-k 1 the tree is a chain"),
        ("tree:2,2,8", r"must be in \[2, 7\]"),  # K + (S-1) K^2 = 6 candidates: at most 7 tokens
        ("tree:2,2,1", r"must be in \[2, 7\]"),
    ],
)
def test_bad_topologies_say_how_to_write_one(text, message):
    with pytest.raises(ValueError, match=message):
        Topology.parse(text)


def test_record_kind_must_agree_with_top_k():
    with pytest.raises(ValueError, match="makes it a tree"):
        Topology.from_dict({"topology": "chain", "steps": 3, "top_k": 2, "draft_tokens": 6})
    with pytest.raises(ValueError, match="lacks"):
        Topology.from_dict({"steps": 3})


def test_serving_settings():
    tree = Topology.parse("tree:5,8,32")
    assert tree.sglang_flags() == [
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-num-steps",
        "5",
        "--speculative-eagle-topk",
        "8",
        "--speculative-num-draft-tokens",
        "32",
    ]
    assert tree.vllm_speculative_config("/d") is None  # vLLM's EAGLE-3 proposer drafts a chain
    chain = Topology.chain(3)
    assert chain.vllm_speculative_config("/d") == {
        "method": "eagle3",
        "model": "/d",
        "num_speculative_tokens": 3,
    }
    assert "--speculative-num-draft-tokens 4" in chain.sglang_command_line


def test_parse_topologies_drops_duplicates_and_needs_one():
    assert [str(t) for t in parse_topologies(["chain:3", "tree:3,1,4", "tree:5,8,32"])] == [
        "chain:3",
        "tree:5,8,32",
    ]
    with pytest.raises(ValueError, match="no topology"):
        parse_topologies([])


# ---------------------------------------------------------------------------------------------------
# the sweep's cost model, table and recommendation (pure numbers; the measured sweep runs in test_evaluate)
# ---------------------------------------------------------------------------------------------------
def test_cost_model_reduces_to_the_break_even_model_of_scaling():
    from eaglekit.analysis.topology_sweep import StepCosts

    costs = StepCosts(
        target_step_s=0.011, verify_base_s=0.012, verify_token_s=0.0, draft_base_s=0.002, draft_node_s=0.0
    )
    chain = Topology.chain(3)
    # The chain model: speedup = tau T_target / (T_verify + g T_draft), break-even tau = (T_verify + g
    # T_draft) / T_target.
    assert costs.predicted_speedup(chain, 2.1) == pytest.approx(2.1 * 0.011 / (0.012 + 3 * 0.002))
    assert costs.break_even_accept_length(chain) == pytest.approx((0.012 + 3 * 0.002) / 0.011)
    # Per-token verification and per-node draft costs make wide trees pay for their width.
    costly = StepCosts(
        target_step_s=0.011,
        verify_base_s=0.012,
        verify_token_s=0.001,
        draft_base_s=0.002,
        draft_node_s=0.0005,
    )
    tree = Topology.parse("tree:5,8,32")
    assert costly.cycle_s(tree, 3.0) == pytest.approx(
        0.012 + 31 * 0.001 + (0.002 + 2 * 0.0005) + 4 * (0.002 + 7 * 0.0005)
    )
    tau = costly.break_even_accept_length(tree)
    assert costly.predicted_speedup(tree, tau) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="target_step_s"):
        StepCosts(target_step_s=0, verify_base_s=1, verify_token_s=0, draft_base_s=1, draft_node_s=0)


def test_sweep_table_and_recommendation():
    import matplotlib

    matplotlib.use("Agg")
    import numpy as np
    from eaglekit.analysis.topology_sweep import (
        StepCosts,
        default_topology_grid,
        plot_topology_sweep,
        recommend,
        sweep_table,
    )

    costs = StepCosts(
        target_step_s=0.010,
        verify_base_s=0.011,
        verify_token_s=0.0002,
        draft_base_s=0.001,
        draft_node_s=0.0001,
    )
    depths = {
        Topology.chain(1): [np.array([1, 0, 1, 1]), np.array([0, 1])],
        Topology.chain(3): [np.array([3, 0, 2, 1]), np.array([0, 3])],
        Topology.parse("tree:3,2,6"): [np.array([3, 1, 2, 2]), np.array([1, 3])],
    }
    table = sweep_table(depths, costs, draft_dir="/d", num_resamples=200)
    by_name = table.set_index("topology")
    assert by_name.loc["chain:3", "tau"] == pytest.approx(
        1 + 9 / 6
    )  # 1 + mean accepted depth, pooled over rows
    assert by_name.loc["tree:3,2,6", "tau"] == pytest.approx(1 + 12 / 6)
    assert (table["tau_low"] <= table["tau"]).all() and (table["tau"] <= table["tau_high"]).all()
    assert list(table["predicted_speedup"]) == sorted(table["predicted_speedup"], reverse=True)
    assert (
        by_name.loc["tree:3,2,6", "vllm_setting"] == ""
        and '"num_speculative_tokens": 3' in by_name.loc["chain:3", "vllm_setting"]
    )
    choice = recommend(table, costs)
    assert choice["sglang"]["topology"] == table.iloc[0]["topology"]
    assert choice["sglang"]["flags"] == Topology.parse(choice["sglang"]["topology"]).sglang_command_line
    assert choice["vllm"]["topology"] in {"chain:1", "chain:3"} and choice["vllm"][
        "num_speculative_tokens"
    ] in {1, 3}
    assert choice["sglang"]["pays_off"] == (choice["sglang"]["predicted_speedup"] > 1)
    figure = plot_topology_sweep(table, recommended=choice["sglang"]["topology"])
    assert len(figure.axes) == 2
    with pytest.raises(ValueError, match="no start rows"):
        sweep_table({Topology.chain(2): [np.array([], dtype=int)]}, costs)
    grid = default_topology_grid(max_steps=4, top_ks=(2, 4), draft_tokens=(4, 16, 64))
    assert Topology.chain(4) in grid and Topology.parse("tree:2,2,4") in grid
    assert all(topology.draft_tokens <= 1 + topology.candidates for topology in grid)
    assert Topology.parse("tree:2,4,16") in grid and not any(str(t) == "tree:2,2,16" for t in grid)


def test_cost_line_fit_is_robust_to_noise():
    from eaglekit.analysis.topology_sweep import _fit_line

    assert _fit_line([1, 5, 9], [1.0, 1.4, 1.8]) == pytest.approx((1.0, 0.1))
    assert _fit_line([1, 5, 9], [1.2, 1.0, 1.1]) == pytest.approx((1.1, 0.0))  # no size effect measured: flat
    base, per_item = _fit_line([1, 2, 9], [0.01, 0.02, 4.0])  # the least-squares intercept is negative
    assert base == pytest.approx(0.01) and per_item == pytest.approx((4.0 - 0.01) / 8)
    assert _fit_line([4, 4], [2.0, 4.0]) == (3.0, 0.0)


@pytest.mark.usefixtures("one_torch_thread")
def test_recommendation_goes_through_the_real_loop_and_into_the_metrics_event(tmp_path, monkeypatch):
    import eaglekit.analysis.evaluate as evaluate_module
    from eaglekit.analysis.checkpoints import heldout_prompts
    from eaglekit.draft.model import build_draft_from_target, load_target_head_weights
    from eaglekit.analysis.topology_sweep import LOOP_CHECK_FIELDS, check_recommendation, sweep_event
    from eaglekit.draft.vocab import count_generated_tokens, select_draft_vocab
    from support import samples_from_target, tiny_target

    target = tiny_target()
    target.save_pretrained(tmp_path / "target")
    samples = samples_from_target(target, 3, seed=2)
    vocab = select_draft_vocab(count_generated_tokens(samples, target.config.vocab_size), 200)
    draft = build_draft_from_target(
        load_target_head_weights(tmp_path / "target"), vocab.d2t, vocab.t2d, capture_layer_indices=(1, 3, 5)
    )
    prompts = heldout_prompts(samples, 2, max_prompt_tokens=64)
    tree = Topology.parse("tree:2,2,4")
    recommendation = {
        "summary": "s",
        "sglang": {"topology": str(tree), "flags": tree.sglang_command_line, "predicted_speedup": 1.25},
        "vllm": {"topology": "chain:1", "num_speculative_tokens": 1},
    }
    checked = check_recommendation(
        recommendation, target, draft, prompts, steps=2, max_new_tokens=5, num_resamples=20
    )
    assert {
        key: checked[key] for key in recommendation
    } == recommendation and "loop_check" not in recommendation
    assert [record["topology"] for record in checked["loop_check"]] == ["tree:2,2,4", "chain:2"]
    assert all(
        tuple(record) == LOOP_CHECK_FIELDS and record["outputs_equal"] for record in checked["loop_check"]
    )
    # The same numbers as evaluate_draft on the same prompts (timings aside).
    direct = evaluate_module.evaluate_draft(
        target,
        draft,
        [prompt["input_ids"] for prompt in prompts],
        [tree, Topology.chain(2)],
        5,
        num_resamples=20,
    ).records()
    for record, expected in zip(checked["loop_check"], direct):
        assert [record[key] for key in ("tau_loop", "tau_server", "tau_offline")] == [
            expected[key] for key in ("tau_loop", "tau_server", "tau_offline")
        ]
    # A chain recommendation equal to the reported chain is checked once.
    chain = {"sglang": {"topology": "chain:2", "flags": "", "predicted_speedup": 0.9}}
    assert (
        len(
            check_recommendation(
                chain, target, draft, prompts[:1], steps=2, max_new_tokens=3, num_resamples=10
            )["loop_check"]
        )
        == 1
    )

    event = sweep_event(checked)
    assert event == {
        "event": "topology_sweep",
        "recommended": "tree:2,2,4",
        "flags": tree.sglang_command_line,
        "predicted_speedup": 1.25,
        "vllm_num_speculative_tokens": 1,
        "loop_check": checked["loop_check"],
    }
    assert (
        sweep_event(chain)["vllm_num_speculative_tokens"] is None and sweep_event(chain)["loop_check"] is None
    )

    # A loop whose output differed from greedy is refused, naming the topology.
    class Lossy:
        def records(self):
            return [{**record, "outputs_equal": record["topology"] == "chain:2"} for record in direct]

    monkeypatch.setattr(evaluate_module, "evaluate_draft", lambda *args, **kwargs: Lossy())
    with pytest.raises(RuntimeError, match=r"differs from plain greedy decoding for \['tree:2,2,4'\]"):
        check_recommendation(recommendation, target, draft, prompts, steps=2, max_new_tokens=5)
