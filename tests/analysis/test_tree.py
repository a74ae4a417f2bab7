"""SGLang's tree rule on hand-made candidates and a scripted draft: selection, ancestry, acceptance."""

from __future__ import annotations

import math

import torch
from eaglekit.analysis.tree import (
    TreeCandidates,
    accept_tree,
    grow_tree,
    path_to,
    select_tree,
    verification_mask,
)


def _candidates(tokens, scores, parents, depths) -> TreeCandidates:
    as_long = lambda values: torch.tensor([values], dtype=torch.long)
    return TreeCandidates(
        tokens=as_long(tokens),
        scores=torch.tensor([scores]),
        parents=as_long(parents),
        depths=as_long(depths),
    )


def test_select_keeps_the_best_by_cumulative_score_in_candidate_order():
    # S=2, K=2: candidates 0,1 (depth 1) and 2..5 (children of 0: 2,3; of 1: 4,5).
    candidates = _candidates(
        tokens=[10, 11, 20, 21, 22, 23],
        scores=[-0.1, -1.0, -0.5, -3.0, -1.2, -4.0],
        parents=[-1, -1, 0, 0, 1, 1],
        depths=[1, 1, 2, 2, 2, 2],
    )
    tree = select_tree(candidates, draft_tokens=4, root_tokens=torch.tensor([7]))
    # T - 1 = 3 best: candidates 0 (-0.1), 2 (-0.5), 1 (-1.0) -> in candidate order 0, 1, 2.
    assert tree.tokens.tolist() == [[7, 10, 11, 20]]
    assert tree.parents.tolist() == [[-1, 0, 0, 1]] and tree.depths.tolist() == [[0, 1, 1, 2]]
    assert tree.ancestors[0].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    mask = verification_mask(tree, cached=2, dtype=torch.float32)
    assert mask.shape == (1, 1, 4, 6)
    assert (mask[0, 0, :, :2] == 0).all()  # the cache is visible to every node
    assert mask[0, 0, 3, 3] == 0 and mask[0, 0, 3, 4] < -1e30  # node 3 sees its parent 1, not its uncle 2

    # The target chose 10 after the root and 20 after node 1: depth 2 through node 3.
    depth, node = accept_tree(tree, choice_at_parent=torch.tensor([[0, 10, 10, 20]]))
    assert (int(depth), int(node)) == (2, 3) and path_to(tree, 3) == [0, 1, 3]
    # A later sibling's match does not count when the first-level token was rejected.
    depth, node = accept_tree(tree, choice_at_parent=torch.tensor([[0, 11, 11, 20]]))
    assert (int(depth), int(node)) == (1, 2)
    depth, _ = accept_tree(tree, choice_at_parent=torch.tensor([[0, 99, 99, 20]]))
    assert int(depth) == 0
    # Teacher-forced data: node 1 matches the target but not the sample, so nothing below it is trusted.
    depth, node = accept_tree(
        tree, torch.tensor([[0, 10, 10, 20]]), consistent=torch.tensor([[True, False, True, True]])
    )
    assert (int(depth), int(node)) == (1, 1)


def test_a_node_whose_parent_was_not_chosen_is_unreachable():
    # Scores that break the parent >= child order (SGLang's exact ties can): child 2 chosen, its parent 1 not.
    candidates = _candidates(
        tokens=[10, 11, 20], scores=[-0.1, -2.0, -1.5], parents=[-1, -1, 1], depths=[1, 1, 2]
    )
    tree = select_tree(candidates, draft_tokens=3, root_tokens=torch.tensor([7]))
    assert tree.tokens.tolist() == [[7, 10, 20]]
    assert tree.reachable.tolist() == [[True, True, False]] and tree.parents.tolist() == [[-1, 0, -1]]
    assert tree.ancestors[0, 2].tolist() == [True, False, True]  # root and itself only
    depth, _ = accept_tree(tree, torch.tensor([[0, 99, 20]]))  # its token "matches", but it hangs off nothing
    assert int(depth) == 0


class ScriptedDraft(torch.nn.Module):
    """A draft whose logits depend only on the input token: log-probs from a fixed table, states unchanged."""

    def __init__(self, table: dict[int, list[float]], vocab: int):
        super().__init__()
        self.table, self.vocab = table, vocab

    def logits_for(self, token: int) -> torch.Tensor:
        return torch.tensor(self.table.get(token, [0.0] * self.vocab))

    def forward_nodes(self, tokens, states, positions, key_values):
        return torch.stack([self.logits_for(int(token)) for token in tokens[0]])[None], states


def test_grow_expands_the_top_k_by_cumulative_log_prob():
    vocab = 4
    log = math.log
    # Root proposes 0 (p .6) and 1 (p .4); after 0: 2 (.55) 3 (.45); after 1: 2 (.9) 3 (.1).
    table = {0: [log(1e-9), log(1e-9), log(0.55), log(0.45)], 1: [log(1e-9), log(1e-9), log(0.9), log(0.1)]}
    draft = ScriptedDraft(table, vocab)
    first = torch.tensor([[log(0.6), log(0.4), log(1e-9), log(1e-9)]])
    keys = torch.zeros(1, 1, 3, 2)
    candidates = grow_tree(
        draft,
        first,
        torch.zeros(1, 2),
        torch.tensor([2]),
        keys,
        keys,
        3,
        2,
        draft_to_target=torch.arange(vocab),
    )
    scores = candidates.scores[0].exp()
    # Step 1 children: from 0: .33, .27; from 1: .36, .04. Best two to expand: (1->2) .36 and (0->2) .33.
    assert torch.allclose(scores[:6], torch.tensor([0.6, 0.4, 0.33, 0.27, 0.36, 0.04]), atol=1e-6)
    assert candidates.parents[0, :6].tolist() == [-1, -1, 0, 0, 1, 1]
    # Step 2 expands candidates 4 (token 2) and 2 (token 2), in score order.
    assert candidates.parents[0, 6:].tolist() == [4, 4, 2, 2]
    assert candidates.depths[0].tolist() == [1, 1, 2, 2, 2, 2, 3, 3, 3, 3]
    tree = select_tree(candidates, 6, torch.tensor([9]))
    assert tree.tokens[0, 0] == 9 and tree.size == 6


def test_draft_attention_slots_versus_ancestors():
    """SGLang's per-slot KV: after the slots swap parents, slot j still reads slot j's earlier key;
    "ancestors" reads the true parent's. Checked on the attention output itself."""
    from eaglekit.analysis.tree import ANCESTORS, SGLANG_SLOTS, TreeKeyValues

    prefix = torch.zeros(1, 1, 1, 2)  # one prefix row with a zero key and value
    step_one_keys = torch.tensor([[[[4.0, 0.0], [0.0, 4.0]]]])  # slot 0 and slot 1 keys (1, KV, N, D)
    step_one_values = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]])
    query = torch.tensor([[[[1.0, 0.0], [1.0, 0.0]]]])
    outputs = {}
    for mode in (SGLANG_SLOTS, ANCESTORS):
        key_values = TreeKeyValues(prefix, prefix, torch.zeros(2, dtype=torch.long), mode)
        key_values.attend(query, step_one_keys, step_one_values, scale=1.0)
        key_values.follow(torch.tensor([1, 1]))  # both next nodes are children of slot 1
        outputs[mode] = key_values.attend(query, torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2), scale=1.0)[
            0, 0
        ]
    # ancestors: both nodes see slot 1's key/value; slots: node 0 sees slot 0's (a large score on dimension
    # 0).
    assert torch.allclose(outputs[ANCESTORS][0], outputs[ANCESTORS][1])
    assert outputs[SGLANG_SLOTS][0, 0] > 0.5 and outputs[ANCESTORS][0, 0] < 0.01
    assert torch.allclose(
        outputs[SGLANG_SLOTS][1], outputs[ANCESTORS][1]
    )  # slot 1's parent is slot 1 in both
