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
    # The record uses the keys notebook 06 and specdec.summarize already write.
    assert chain.to_dict() == {"topology": "chain", "steps": 3, "top_k": 1, "draft_tokens": 4}
    assert Topology.chain(3) == Topology(3) == Topology.from_vllm(3) == Topology.from_sglang(3, 1, 99)


def test_ceiling_and_candidates():
    # Accept length counts the bonus token: a tree of depth S emits at most S + 1 per verification.
    assert Topology.parse("tree:5,8,32").ceiling == 6 and Topology.chain(3).ceiling == 4
    # K + (S - 1) K^2 candidates: SGLang picks T - 1 of them.
    assert Topology.parse("tree:5,8,32").candidates == 8 + 4 * 64
    assert Topology.chain(4).candidates == 4


@pytest.mark.parametrize("text, message", [
    ("chain", "write chain:k"),
    ("tree:5,8", "write chain:k"),
    ("beam:3", "write chain:k"),
    ("chain:x", "write chain:k"),
    ("chain:0", "steps S must be >= 1"),
    ("tree:3,0,4", "top-k K must be >= 1"),
    ("tree:3,1,8", "with top-k 1 the tree is a chain"),
    ("tree:2,2,8", r"must be in \[2, 7\]"),  # K + (S-1) K^2 = 6 candidates: at most 7 tokens
    ("tree:2,2,1", r"must be in \[2, 7\]"),
])
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
    assert tree.sglang_flags() == ["--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "5",
                                   "--speculative-eagle-topk", "8", "--speculative-num-draft-tokens", "32"]
    assert tree.vllm_speculative_config("/d") is None  # vLLM's EAGLE-3 proposer drafts a chain
    chain = Topology.chain(3)
    assert chain.vllm_speculative_config("/d") == {"method": "eagle3", "model": "/d", "num_speculative_tokens": 3}
    assert chain.vllm_command_line("/d") == "--speculative-config '{\"method\": \"eagle3\", \"model\": \"/d\", \"num_speculative_tokens\": 3}'"
    assert "--speculative-num-draft-tokens 4" in chain.sglang_command_line


def test_parse_topologies_drops_duplicates_and_needs_one():
    assert [str(t) for t in parse_topologies(["chain:3", "tree:3,1,4", "tree:5,8,32"])] == ["chain:3", "tree:5,8,32"]
    with pytest.raises(ValueError, match="no topology"):
        parse_topologies([])
