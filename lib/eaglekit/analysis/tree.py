"""SGLang's EAGLE draft tree, for a batch of independent trees: grow, select, mask, accept.

One tree per start row (the row whose extend logits propose the first children; it carries the pending
token, the tree's root). The rule is SGLang's (`eagle_utils.select_top_k_tokens`,
`organize_draft_results`, `build_tree_kernel_efficient`), for a topology S, K, T:

    step 0    the start row's logits: the K most likely draft tokens are the depth-1 candidates, each
              scored by its log-probability; all K are expanded
    step i    (i = 1..S-1) one draft forward over the K expanded nodes of depth i: token = the node's own
              token, hidden state = its parent's pre-norm output (the start row's for depth 1), RoPE
              position = start row + i, attention = the prefix rows up to the start row plus the node's own
              ancestors (and itself). Each node's K best children get cumulative score = parent score +
              log-prob: K x K candidates of depth i + 1, of which the K best are expanded next
    select    the T - 1 best of all K + (S - 1) K^2 candidates by cumulative score, in candidate order
              (SGLang sorts the chosen indices, so a parent precedes its children); node 0 is the root
    verify    the target scores the T tokens in one forward: node n at position (root position) + depth,
              attending the cache and its ancestors (`verification_mask`)
    accept    the deepest node whose whole root path matches the target's greedy choices: a node matches
              when its token is what the target chose at its parent. Siblings hold distinct tokens, so at
              most one node per depth matches along a matching path.

SGLang scores with products of probabilities, here sums of log-probabilities: the same order. A child's
score never exceeds its parent's, so a chosen node's parent is chosen too (except on exact ties; a node
whose parent was not chosen is unreachable, as in SGLang's kernel, and never accepted). With K = 1 the
tree is the greedy chain of S steps.

Draft attention, two choices (`draft_attention`):
- "sglang" (default): what SGLang's kernels do. Its draft KV for a tree step is laid out per top-k slot
  (`assign_draft_cache_locs`: out_cache_loc (bs, topk, num_steps)), and `generate_draft_decode_kv_indices`
  gives the node in slot j at step i the prefix plus slot j's own keys of the earlier steps, even when
  `select_top_k_tokens` took that node's parent from another slot (only the hidden state follows the parent).
- "ancestors": EAGLE's reference tree mask, each node attends its true ancestors.
Both agree for K = 1 and on the first tree step; tokens, scores, hidden states and positions follow the
parent either way, so the loop stays lossless with both (only the proposals differ).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from eaglekit.draft.model import DraftKVCache, attend_prefix_and_steps
from eaglekit.topology import Topology

SGLANG_SLOTS = "sglang"
ANCESTORS = "ancestors"
DRAFT_ATTENTIONS = (SGLANG_SLOTS, ANCESTORS)


class TreeKeyValues:
    """Draft attention for tree nodes. A node sees prefix rows 0..limit (its tree's start row) and the keys
    of its own ancestors from earlier draft steps, plus its own: the chain's decode pattern, per branch.

    prefix_keys/values (1, KV, L, D): the extend rows; limits (N,): last visible prefix row per node.
    `follow(parents)` re-points every node's ancestry when the next step's nodes are chosen ("ancestors"),
    or keeps each top-k slot's own earlier keys ("sglang", see the module docstring).
    """

    def __init__(self, prefix_keys: torch.Tensor, prefix_values: torch.Tensor, limits: torch.Tensor,
                 draft_attention: str = SGLANG_SLOTS):
        if draft_attention not in DRAFT_ATTENTIONS:
            raise ValueError(f"draft_attention {draft_attention!r}: use one of {list(DRAFT_ATTENTIONS)}")
        self.prefix_keys, self.prefix_values = prefix_keys, prefix_values
        self.limits = limits
        self.draft_attention = draft_attention
        self.step_keys: list[torch.Tensor] = []  # per draft step (1, KV, N, D)
        self.step_values: list[torch.Tensor] = []
        # per stored step (N,): index of each current node's ancestor there
        self.ancestors: list[torch.Tensor] = []

    def follow(self, parents: torch.Tensor) -> None:
        """The next nodes' parents (N,), indices into the current nodes (of the same tree)."""
        if self.draft_attention == ANCESTORS:
            self.ancestors = [ancestor[parents] for ancestor in self.ancestors]
        self.limits = self.limits[parents]  # a tree's nodes share its start row either way

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
        """query (1, Hq, N, D), key/value (1, KV, N, D) -> (1, Hq, N, D)."""
        nodes = query.shape[2]
        self.step_keys.append(key)
        self.step_values.append(value)
        self.ancestors.append(torch.arange(nodes, device=query.device))
        visible = torch.arange(self.prefix_keys.shape[2], device=query.device)[None, :] <= self.limits[:, None]  # (N, L)
        # One key per step: that step's key of the node's ancestor.
        steps = list(zip(self.step_keys, self.step_values, self.ancestors))
        return attend_prefix_and_steps(query, self.prefix_keys, self.prefix_values, visible,
                                       [keys[:, :, ancestor] for keys, _, ancestor in steps],
                                       [values[:, :, ancestor] for _, values, ancestor in steps], scale)


@dataclass
class TreeCandidates:
    """Every node the draft scored, per tree, in SGLang's candidate order (B, C), C = K + (S - 1) K^2.

    tokens: target ids; scores: cumulative log-probabilities; parents: candidate index of the parent
    (-1: the root); depths: 1..S.
    """

    tokens: torch.Tensor
    scores: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor


def _forward_nodes(draft: nn.Module, tokens: torch.Tensor, states: torch.Tensor, positions: torch.Tensor,
                   key_values: TreeKeyValues) -> tuple[torch.Tensor, torch.Tensor]:
    """One draft forward over N nodes: tokens (1, N), states (1, N, H), positions (1, N) -> logits, pre-norm
    states.

    A draft that overrides its proposals (the oracle) provides `forward_nodes`; the kit's draft uses its
    hooks.
    """
    if hasattr(draft, "forward_nodes"):
        return draft.forward_nodes(tokens, states, positions, key_values)
    prenorm = draft.step(tokens, states, positions, key_values)
    return draft.logits(prenorm), prenorm


def grow_tree(
    draft: nn.Module, first_logits: torch.Tensor, first_states: torch.Tensor, start_positions: torch.Tensor,
    prefix_keys: torch.Tensor, prefix_values: torch.Tensor, steps: int, top_k: int, draft_to_target: torch.Tensor,
    draft_attention: str = SGLANG_SLOTS,
) -> TreeCandidates:
    """Grow B trees of depth `steps` (S) and top-k `top_k` (K) at once (see the module docstring).

    first_logits (B, Vd): each start row's logits; first_states (B, H): its pre-norm state; start_positions
    (B,): its RoPE position, which is also the last prefix row its tree may see; prefix keys/values
    (1, KV, L, D): the draft's cache over the rows (the extend).
    """
    batch = first_logits.shape[0]
    device = first_logits.device
    log_probs = F.log_softmax(first_logits.float(), dim=-1)
    scores, draft_ids = log_probs.topk(top_k, dim=-1)  # (B, K)
    tokens = draft_to_target[draft_ids]
    candidate_tokens, candidate_scores = [tokens], [scores]
    candidate_parents = [torch.full((batch, top_k), -1, dtype=torch.long, device=device)]
    candidate_depths = [torch.ones(batch, top_k, dtype=torch.long, device=device)]
    # candidate index of each expanded node
    node_index = torch.arange(top_k, device=device).expand(batch, top_k)
    states = first_states[:, None, :].expand(batch, top_k, first_states.shape[-1])  # (B, K, H)
    key_values = TreeKeyValues(prefix_keys, prefix_values, start_positions.repeat_interleave(top_k), draft_attention)
    offset = top_k
    tree_of_node = torch.arange(batch, device=device).repeat_interleave(top_k)  # (B K,)
    for step in range(1, steps):
        positions = (start_positions[:, None] + step).expand(batch, top_k).reshape(1, -1)
        logits, prenorm = _forward_nodes(draft, tokens.reshape(1, -1), states.reshape(1, batch * top_k, -1), positions, key_values)
        child_log_probs, child_ids = F.log_softmax(logits[0].float(), dim=-1).topk(top_k, dim=-1)  # (B K, K)
        child_scores = (scores.reshape(-1, 1) + child_log_probs).reshape(batch, top_k * top_k)
        child_tokens = draft_to_target[child_ids].reshape(batch, top_k * top_k)
        candidate_tokens.append(child_tokens)
        candidate_scores.append(child_scores)
        candidate_parents.append(node_index.repeat_interleave(top_k, dim=1))
        candidate_depths.append(torch.full((batch, top_k * top_k), step + 1, dtype=torch.long, device=device))
        if step == steps - 1:
            break
        scores, best = child_scores.topk(top_k, dim=-1)  # (B, K): the next nodes to expand
        parent_slot = best // top_k
        tokens = child_tokens.gather(1, best)
        states = prenorm[0].reshape(batch, top_k, -1).gather(1, parent_slot[..., None].expand(-1, -1, prenorm.shape[-1]))
        node_index = offset + best
        offset += top_k * top_k
        key_values.follow((tree_of_node.view(batch, top_k) * top_k + parent_slot).reshape(-1))
    return TreeCandidates(
        tokens=torch.cat(candidate_tokens, dim=1), scores=torch.cat(candidate_scores, dim=1),
        parents=torch.cat(candidate_parents, dim=1), depths=torch.cat(candidate_depths, dim=1),
    )


@dataclass
class DraftTree:
    """B trees of T nodes; node 0 is the root (the pending token).

    tokens (B, T) target ids; parents (B, T) node index (-1 for the root and unreachable nodes);
    depths (B, T) (0 root); reachable (B, T); ancestors (B, T, T): [n, m] = m is n or an ancestor of n.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    reachable: torch.Tensor
    ancestors: torch.Tensor

    @property
    def size(self) -> int:
        return int(self.tokens.shape[1])


def select_tree(candidates: TreeCandidates, draft_tokens: int, root_tokens: torch.Tensor) -> DraftTree:
    """SGLang's `organize_draft_results`: the T - 1 best candidates, in candidate order, under the root.

    root_tokens (B,): the pending token of each tree.
    """
    batch, count = candidates.tokens.shape
    chosen = candidates.scores.topk(draft_tokens - 1, dim=-1).indices.sort(dim=-1).values  # (B, T-1)
    device = chosen.device
    node_of_candidate = torch.full((batch, count), -1, dtype=torch.long, device=device)
    node_of_candidate.scatter_(1, chosen, torch.arange(1, draft_tokens, device=device).expand(batch, -1))
    parent_candidates = candidates.parents.gather(1, chosen)
    parent_nodes = torch.where(parent_candidates < 0, torch.zeros_like(parent_candidates),
                               node_of_candidate.gather(1, parent_candidates.clamp(min=0)))
    # (B, T)
    parents = torch.cat([torch.full((batch, 1), -1, dtype=torch.long, device=device), parent_nodes], dim=1)
    tokens = torch.cat([root_tokens.view(batch, 1).to(candidates.tokens.dtype), candidates.tokens.gather(1, chosen)], dim=1)
    depths = torch.cat([torch.zeros(batch, 1, dtype=torch.long, device=device), candidates.depths.gather(1, chosen)], dim=1)
    reachable = torch.ones(batch, draft_tokens, dtype=torch.bool, device=device)
    ancestors = torch.zeros(batch, draft_tokens, draft_tokens, dtype=torch.bool, device=device)
    ancestors[:, 0, 0] = True
    rows = torch.arange(batch, device=device)
    for node in range(1, draft_tokens):  # parents precede children in candidate order
        parent = parents[:, node]
        ok = parent >= 0
        safe = parent.clamp(min=0)
        reachable[:, node] = ok & reachable[rows, safe]
        # An unreachable node sees the root and itself only; it is never accepted.
        ancestors[:, node] = torch.where(ok[:, None], ancestors[rows, safe], ancestors[:, 0])
        ancestors[:, node, node] = True
    parents = torch.where(reachable, parents, torch.full_like(parents, -1))
    parents[:, 0] = -1
    return DraftTree(tokens=tokens, parents=parents, depths=depths, reachable=reachable, ancestors=ancestors)


def verification_mask(tree: DraftTree, cached: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive 4-D attention mask (1, 1, T, cached + T) for the target's tree verification of tree 0:
    every node sees the whole cache, and within the tree only its ancestors and itself."""
    nodes = tree.size
    visible = torch.cat([torch.ones(nodes, cached, dtype=torch.bool, device=tree.tokens.device), tree.ancestors[0]], dim=1)
    mask = torch.zeros(nodes, cached + nodes, dtype=dtype, device=tree.tokens.device)
    return mask.masked_fill(~visible, torch.finfo(dtype).min)[None, None]


def accept_tree(tree: DraftTree, choice_at_parent: torch.Tensor,
                consistent: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The deepest node whose root path matches the target, per tree.

    choice_at_parent (B, T): the target's greedy token at each node's parent (ignored for the root).
    consistent (B, T), optional: whether a node may be extended (offline on teacher-forced data: its token
    is the sample's, so the target's choices below it were computed on this path). Default: all.
    Returns (accepted depth (B,), accepted node (B,)): depth 0 / node 0 when no drafted token matched.
    """
    batch, nodes = tree.tokens.shape
    rows = torch.arange(batch, device=tree.tokens.device)
    matched = (tree.tokens == choice_at_parent) & tree.reachable
    extendable = torch.ones_like(matched) if consistent is None else consistent
    full = torch.zeros_like(matched)
    full[:, 0] = True
    for node in range(1, nodes):
        parent = tree.parents[:, node].clamp(min=0)
        full[:, node] = matched[:, node] & full[rows, parent] & (extendable[rows, parent] | (tree.parents[:, node] == 0))
    depth = torch.where(full, tree.depths, torch.full_like(tree.depths, -1))
    return tuple(depth.max(dim=1))


def path_to(tree: DraftTree, node: int, index: int = 0) -> list[int]:
    """Node indices from the root to `node` in tree `index`, root first."""
    path = [node]
    while path[-1] != 0:
        path.append(int(tree.parents[index, path[-1]]))
    return path[::-1]


def slice_candidates(candidates: TreeCandidates, top_k: int, steps: int) -> TreeCandidates:
    """The candidates of a shallower tree with the same K: growth is step by step, so the first
    K + (S - 1) K^2 candidates of a deeper tree are exactly the S-step tree's."""
    count = top_k + (steps - 1) * top_k ** 2
    return TreeCandidates(tokens=candidates.tokens[:, :count], scores=candidates.scores[:, :count],
                          parents=candidates.parents[:, :count], depths=candidates.depths[:, :count])


@torch.no_grad()
def offline_tree_depths_grid(
    draft: nn.Module, input_ids: torch.Tensor, aux_hidden_states: torch.Tensor, target_argmax: torch.Tensor,
    start_rows: torch.Tensor, topologies: list[Topology], rows_per_chunk: int = 128, draft_attention: str = SGLANG_SLOTS,
) -> dict[Topology, torch.Tensor]:
    """Accepted depth of SGLang's tree grown from each start row of one sequence, for several topologies,
    from captured features. Each top-k is grown once to the deepest S asked for; shallower trees and every
    T are read off the same candidates (`slice_candidates`).

    input_ids (T,): the sequence; aux_hidden_states (T, 3H): the target's features at each position;
    target_argmax (T,): the target's greedy next token after each position; start_rows (P,): rows t whose
    tree is scored (t + S <= T - 1 for the deepest S, so every depth has a target token). Row t carries
    token t + 1 (the pending token, the root) at position t, as in the loop. A node of depth d proposes
    token t + 1 + d, so it matches when it equals target_argmax[t + d] (the target's choice after its
    parent); it may be extended only when it also equals the sequence's token t + 1 + d, because the
    target's choices below it were computed on that token (teacher-forced data; on a greedy continuation
    both conditions are one). Returns {topology: (P,) accepted depths in 0..S}.
    """
    length = int(input_ids.shape[0])
    deepest = max(topology.steps for topology in topologies)
    if len(start_rows) and int(start_rows.max()) + deepest > length - 1:
        raise ValueError(f"start rows up to {int(start_rows.max())} need {deepest} target tokens after them; "
                         f"the sequence has {length}")
    device = input_ids.device
    draft_to_target = draft.draft_to_target_ids().to(device)
    # The extend over every row at once: row t carries f_t and token t + 1 (the last row the target's choice).
    extend_tokens = torch.cat([input_ids[1:], target_argmax[-1:]]).view(1, -1)
    cache = DraftKVCache()
    logits, prenorm = draft.extend(extend_tokens, aux_hidden_states.view(1, length, -1), 0, cache)
    # token t + 1 + d may run past the end
    sequence_next = torch.cat([input_ids, input_ids.new_full((deepest + 2,), -1)])
    depths: dict[Topology, list[torch.Tensor]] = {topology: [] for topology in topologies}
    by_top_k: dict[int, list[Topology]] = {}
    for topology in topologies:
        by_top_k.setdefault(topology.top_k, []).append(topology)
    for begin in range(0, len(start_rows), rows_per_chunk):
        rows = start_rows[begin : begin + rows_per_chunk].to(device)
        for top_k, group in by_top_k.items():
            grown_steps = max(topology.steps for topology in group)
            grown = grow_tree(draft, logits[0, rows], prenorm[0, rows], rows, cache.keys, cache.values,
                              grown_steps, top_k, draft_to_target, draft_attention)
            for topology in group:
                candidates = slice_candidates(grown, top_k, topology.steps)
                tree = select_tree(candidates, topology.draft_tokens, input_ids[rows + 1])
                # (P, T): the target's choice where a node of depth d stands, target_argmax[t + d] (the root's
                # is unused).
                choice_at_parent = target_argmax[(rows[:, None] + tree.depths.clamp(min=1)).clamp(max=length - 1)]
                consistent = tree.tokens == sequence_next[rows[:, None] + 1 + tree.depths]
                accepted, _ = accept_tree(tree, choice_at_parent, consistent)
                depths[topology].append(accepted)
    empty = torch.zeros(0, dtype=torch.long, device=device)
    return {topology: torch.cat(parts) if parts else empty for topology, parts in depths.items()}
