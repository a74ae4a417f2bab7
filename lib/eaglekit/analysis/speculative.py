"""A reference greedy chain speculative-decoding loop: transformers target + the kit's EAGLE-3 draft.

It runs EAGLE-3 the way SGLang does (one request, `--speculative-algorithm EAGLE3`, chain: top-k 1,
`speculative_num_steps` k, `speculative_num_draft_tokens` k + 1), small enough to read in one sitting:

    prefill   target over the prompt x_0..x_{n-1}: KV cache, the three captured features f_0..f_{n-1},
              and the first output token x_n = argmax (the "pending" token: emitted, not yet in the cache)
    extend    draft over rows 0..n-1: row t carries feature f_t and token x_{t+1} at RoPE position t;
              the last row's logits propose d_1
    propose   k - 1 draft decode steps: step j feeds d_j and the previous pre-norm state at position
              (last extend row) + j and proposes d_{j+1}
    verify    target over [x_n, d_1..d_k] (k + 1 tokens): its argmax y_0..y_k and features
    accept    the longest prefix with d_j == y_{j-1}, a tokens; emit y_0..y_a (a drafted + 1 bonus)
    rollback  crop the target cache to the accepted length (drop d_{a+1}..d_k) and the draft cache to the
              extend rows (drop the decode rows), then extend the draft over the a + 1 verified rows
              (features of x_n, d_1..d_a; tokens y_0..y_a) -- and repeat from `propose`.

Both caches always hold the same number of rows: one per token the target has processed; the pending
token rides in the draft's last row. Greedy acceptance keeps the target's output exactly: every emitted
token is the target's argmax given a prefix made only of target-argmax tokens, so the output equals plain
greedy decoding token for token (up to floating-point differences between a (k+1)-token and a 1-token
forward, which the tests show do not flip an argmax on the embedded model in float32).

Accept length is reported as SGLang reports it: completion tokens / verification steps
(`acceptance.server_accept_length`). The first token comes from the prefill, not from a verification
step, and counts as a completion token there too, so a request's tau is (1 + sum(a_i + 1)) / steps.

`offline_estimate.offline_chain_agreement` computes DESIGN's offline tau on the same sequence (the draft
unrolled by its training-time-test forward over the target's own greedy continuation), so the two can be
compared.

Trees (SGLang's `--speculative-eagle-topk K > 1`, `topology.Topology`): `tree_speculative_decode` replaces
propose/verify/accept/rollback with their tree forms (`tree`): the draft grows SGLang's tree from the
pending row (its tree keys live apart from the draft cache, so the draft's rollback is to drop them), the
target verifies the T tree tokens in one forward under a 4-D ancestor mask (transformers passes a 4-D mask
to the attention unchanged) at positions cached + depth, the deepest matching root path is accepted, and
the target cache keeps only that path's rows (`keep_target_cache_rows`).
`offline_estimate.offline_tree_acceptance` is the offline estimate for any topology; with K = 1 it equals the
chain's. `decode_with_topology` picks the loop.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn
from transformers import DynamicCache

from eaglekit.capture import LayerInputCapture, base_model_of, validate_capture_layer_ids
from eaglekit.draft.model import DraftConfig, DraftKVCache, Eagle3DraftModel
from eaglekit.analysis.tree import SGLANG_SLOTS, DraftTree, accept_tree, grow_tree, path_to, select_tree, verification_mask
from eaglekit.topology import Topology

STOP_LENGTH = "length"
STOP_EOS = "eos"


class DraftModel(Protocol):
    """What the loop needs from a draft: the server-style `extend`/`decode` of `Eagle3DraftModel`."""

    config: DraftConfig

    def extend(self, input_ids: torch.Tensor, aux_hidden_states: torch.Tensor, start_position: int,
               cache: DraftKVCache) -> tuple[torch.Tensor, torch.Tensor]: ...

    def decode(self, input_ids: torch.Tensor, hidden_states: torch.Tensor, position: int,
               cache: DraftKVCache) -> tuple[torch.Tensor, torch.Tensor]: ...

    def draft_to_target_ids(self) -> torch.Tensor: ...


# ---------------------------------------------------------------------------------------------------
# results
# ---------------------------------------------------------------------------------------------------
@dataclass
class GreedyResult:
    """Plain greedy decoding of one prompt: output_ids (generated tokens only), wall seconds, stop reason."""

    output_ids: list[int]
    seconds: float
    stop_reason: str

    @property
    def tokens_per_second(self) -> float:
        return len(self.output_ids) / self.seconds if self.seconds > 0 else float("nan")


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """Run the timed loops on one torch thread: on a shared 2-core machine two threads contend and slow plain
    decoding several-fold, which would distort the greedy-vs-speculative comparison."""
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads_before)


@dataclass
class SpeculativeResult:
    """One request through the speculative loop.

    output_ids: generated tokens (the prompt excluded), prefill token first.
    accepted_per_step: per verification, how many drafted tokens the target agreed with (0..k), before any
      truncation by max_new_tokens or EOS. emitted_per_step: tokens that verification added to the output.
    chain_start_rows: per verification, the draft row whose logits proposed d_1 (the row carrying the
      pending token) -- the row index `offline_chain_agreement` uses for the same chain.
    """

    output_ids: list[int]
    prompt_length: int
    steps: int
    accepted_per_step: list[int] = field(default_factory=list)
    emitted_per_step: list[int] = field(default_factory=list)
    chain_start_rows: list[int] = field(default_factory=list)
    seconds: float = 0.0
    stop_reason: str = STOP_LENGTH
    topology: Topology | None = None

    @property
    def verification_steps(self) -> int:
        return len(self.accepted_per_step)

    @property
    def tokens_per_second(self) -> float:
        return len(self.output_ids) / self.seconds if self.seconds > 0 else float("nan")

    @property
    def accept_length(self) -> float:
        """SGLang's completion_tokens / spec_verify_ct for this request (NaN without any verification)."""
        return len(self.output_ids) / self.verification_steps if self.verification_steps else float("nan")

    @property
    def loop_accept_length(self) -> float:
        """Tokens per verification the loop accepted, bonus included, prefill token excluded, before any cut
        by max_new_tokens or EOS: mean(a_i + 1). The quantity the offline estimate predicts."""
        steps = self.verification_steps
        return (sum(self.accepted_per_step) + steps) / steps if steps else float("nan")


def tokens_per_second(results: Sequence[GreedyResult | SpeculativeResult]) -> float:
    """Tokens over wall seconds, each summed over the requests: how a loop's speed is compared with plain
    decoding's (NaN when nothing was timed)."""
    seconds = sum(result.seconds for result in results)
    return sum(len(result.output_ids) for result in results) / seconds if seconds > 0 else float("nan")


# ---------------------------------------------------------------------------------------------------
# checks
# ---------------------------------------------------------------------------------------------------
def check_draft_fits_target(target: nn.Module, draft: DraftModel) -> list[int]:
    """Fail fast when the draft was built for another target; returns the capture layer ids to hook."""
    config = target.config
    if draft.config.hidden_size != config.hidden_size:
        raise ValueError(f"draft hidden_size {draft.config.hidden_size} != target hidden_size {config.hidden_size}: "
                         "the draft was built for another target model; build it from this target's config")
    if draft.config.vocab_size != config.vocab_size:
        raise ValueError(f"draft vocab_size {draft.config.vocab_size} != target vocab_size {config.vocab_size}: "
                         "d2t/t2d would map to the wrong tokens; build the draft from this target's config")
    return validate_capture_layer_ids(draft.config.capture_layer_indices, config.num_hidden_layers)


def raise_if_lossy(differing: Sequence, where: str) -> None:
    """The loop must be lossless: raise when any output differed from plain greedy decoding. differing: what
    they were (prompts, topologies), `where` saying which, e.g. "on prompts"."""
    if differing:
        raise RuntimeError(f"the speculative loop's output differs from plain greedy decoding {where} {differing}: "
                           "a bug in eaglekit.analysis.speculative")


def _check_budget(target: nn.Module, prompt_length: int, max_new_tokens: int, steps: int) -> None:
    """steps: draft tokens per verification (0 for plain greedy decoding)."""
    if prompt_length == 0:
        raise ValueError("empty prompt: pass at least one token (the chat template's tokens count)")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    # The last verification may run k drafted tokens past the final output position.
    needed = prompt_length + max_new_tokens + steps
    limit = int(target.config.max_position_embeddings)
    if needed > limit:
        raise ValueError(f"prompt ({prompt_length}) + max_new_tokens ({max_new_tokens}) + draft steps ({steps}) = {needed} "
                         f"exceeds the target's max_position_embeddings {limit}; shorten the prompt or max_new_tokens")


# ---------------------------------------------------------------------------------------------------
# the target side
# ---------------------------------------------------------------------------------------------------
def device_of(target: nn.Module) -> torch.device:
    return base_model_of(target).get_input_embeddings().weight.device


def target_forward(
    target: nn.Module, input_ids: torch.Tensor, cache: DynamicCache, capture_layer_ids: Sequence[int],
    attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the target over new tokens (1, T) on top of `cache` (which grows by T rows).

    attention_mask/position_ids: for a tree, an additive 4-D mask (1, 1, T, cached + T), which
    transformers passes to the attention as it is, and each node's position (1, T); default causal.
    Returns (greedy choices (T,): argmax at each new position, i.e. the target's next token after it;
    aux features (1, T, 3H): the residual streams entering the three capture layers, concatenated as
    `capture.py` stores them, taken with its pre-hooks).
    """
    extra = {} if attention_mask is None else {"attention_mask": attention_mask, "position_ids": position_ids}
    with LayerInputCapture(base_model_of(target), capture_layer_ids) as capture:
        logits = target(input_ids=input_ids, cache=cache, use_cache=True, **extra).logits  # (1, T, V)
    aux_hidden_states = torch.cat([capture.captured[layer_id].to(logits.device) for layer_id in capture_layer_ids], dim=-1)
    return logits[0].argmax(-1), aux_hidden_states


def crop_target_cache(cache: DynamicCache, length: int) -> None:
    """Drop rows past `length` (the rejected drafted tokens). transformers crops by a negative count."""
    excess = cache.get_seq_length() - length
    if excess > 0:
        cache.crop(-excess)


def crop_draft_cache(cache: DraftKVCache, length: int) -> None:
    """Drop draft rows past `length`: the decode rows of the last proposal (keys (B, KV, L, D))."""
    if cache.keys is not None and cache.length > length:
        cache.keys = cache.keys[:, :, :length]
        cache.values = cache.values[:, :, :length]


# ---------------------------------------------------------------------------------------------------
# plain greedy decoding: the baseline and the reference output
# ---------------------------------------------------------------------------------------------------
@torch.inference_mode()
def greedy_decode(target: nn.Module, prompt_ids: Sequence[int], max_new_tokens: int,
                  eos_token_ids: Sequence[int] = ()) -> GreedyResult:
    """Plain greedy decoding with the target's KV cache, one token per forward (what
    `generate(do_sample=False)` does, without its per-step bookkeeping). Stops after an EOS token (kept) or
    `max_new_tokens`."""
    _check_budget(target, len(prompt_ids), max_new_tokens, steps=0)
    device = device_of(target)
    eos = set(int(token) for token in eos_token_ids)
    started = time.perf_counter()
    cache = DynamicCache(config=target.config)
    input_ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    output: list[int] = []
    stop_reason = STOP_LENGTH
    while len(output) < max_new_tokens:
        # Only the last position's logits are needed: (1, T, H) -> (1, 1, V).
        logits = target(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1).logits
        token = int(logits[0, -1].argmax())
        output.append(token)
        if token in eos:
            stop_reason = STOP_EOS
            break
        input_ids = torch.tensor([[token]], dtype=torch.long, device=device)
    return GreedyResult(output_ids=output, seconds=time.perf_counter() - started, stop_reason=stop_reason)


# ---------------------------------------------------------------------------------------------------
# the speculative loop: propose, verify, accept
# ---------------------------------------------------------------------------------------------------
def propose(
    draft: DraftModel, first_logits: torch.Tensor, last_state: torch.Tensor, last_row: int, steps: int,
    cache: DraftKVCache, draft_to_target: torch.Tensor,
) -> torch.Tensor:
    """Greedy chain proposal d_1..d_k.

    first_logits (1, Vd): the last extend row's logits (they propose d_1); last_state (1, 1, H): that row's
    pre-norm state; last_row: its RoPE position p. Decode step j feeds d_j at position p + j (DESIGN's
    positions rule) with the previous step's pre-norm state, and its logits propose d_{j+1}.
    Returns target ids (k,). Appends k - 1 decode rows to `cache` (the caller crops them after verifying).
    """
    # Top-1 over the draft vocab, mapped to the target's ids (SGLang hot_token_id).
    proposals = [draft_to_target[first_logits.argmax(-1)]]  # each (1,)
    hidden_states = last_state
    for step in range(1, steps):
        logits, hidden_states = draft.decode(proposals[-1].view(1, 1), hidden_states, last_row + step, cache)
        proposals.append(draft_to_target[logits[:, -1].argmax(-1)])
    return torch.cat(proposals)


def verify(
    target: nn.Module, pending_token: int, proposals: torch.Tensor, cache: DynamicCache, capture_layer_ids: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One target forward over [pending, d_1..d_k]: (k + 1,) greedy choices y_0..y_k and (1, k + 1, 3H)
    features.

    y_{j-1} is what the target itself would emit where d_j stands, given that d_1..d_{j-1} were its own
    choices.
    """
    block = torch.cat([torch.tensor([pending_token], device=proposals.device), proposals]).view(1, -1)
    return target_forward(target, block, cache, capture_layer_ids)


def accept(proposals: torch.Tensor, target_choices: torch.Tensor) -> int:
    """Number of drafted tokens accepted: the longest prefix with d_j == y_{j-1}.

    Greedy (temperature 0) acceptance: the target's distribution is a point mass on its argmax, so the
    rejection-sampling rule min(1, p_target / p_draft) accepts d_j exactly when it is the argmax, and
    the residual distribution at the first rejection is that same point mass: the bonus token y_a.
    proposals (k,), target_choices (k + 1,) -> a in 0..k; the emitted tokens are y_0..y_a.
    """
    agree = (proposals == target_choices[:-1]).to(torch.int64)
    # cumprod zeroes everything after the first disagreement; its sum is the prefix length.
    return int(agree.cumprod(0).sum())


def _record(result: SpeculativeResult, tokens: list[int], accepted: int, last_row: int, max_new_tokens: int,
            eos: set[int]) -> list[int] | None:
    """One verification into `result`: its tokens cut to the remaining budget and just after the first EOS.
    Returns the tokens emitted, or None when the output ends here (stop_reason set)."""
    emitted = tokens[: max_new_tokens - len(result.output_ids)]
    eos_end = next((index + 1 for index, token in enumerate(emitted) if token in eos), None)
    emitted, hit_eos = emitted[:eos_end], eos_end is not None
    result.accepted_per_step.append(accepted)
    result.emitted_per_step.append(len(emitted))
    result.chain_start_rows.append(last_row)
    result.output_ids.extend(emitted)
    if hit_eos or len(result.output_ids) >= max_new_tokens:
        result.stop_reason = STOP_EOS if hit_eos else STOP_LENGTH
        return None
    return emitted


@torch.inference_mode()
def _prefill(
    target: nn.Module, draft: DraftModel, prompt_ids: Sequence[int], topology: Topology, max_new_tokens: int,
    eos_token_ids: Sequence[int], started: float,
) -> tuple[SpeculativeResult, tuple | None]:
    """What both loops start with: the checks, then the target over the prompt, then the draft extends over
    the same rows, tokens shifted by one.

    Returns (result, state). The result holds the target's first token (x_n, the pending token). state is None
    when that token already ends the output (EOS or a budget of 1; result.seconds is then timed from
    `started`), else (capture layer ids, EOS ids, the draft-to-target id map, target cache, draft cache,
    pending token, the draft's logits (1, n, Vd) and pre-norm states (1, n, H) over the prompt rows).
    """
    capture_layer_ids = check_draft_fits_target(target, draft)
    _check_budget(target, len(prompt_ids), max_new_tokens, topology.steps)
    eos = {int(token) for token in eos_token_ids}
    draft_to_target = draft.draft_to_target_ids().to(device_of(target))
    result = SpeculativeResult(output_ids=[], prompt_length=len(prompt_ids), steps=topology.steps, topology=topology)
    target_cache, draft_cache = DynamicCache(config=target.config), DraftKVCache()
    prompt = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device_of(target))
    target_choices, aux_hidden_states = target_forward(target, prompt, target_cache, capture_layer_ids)
    pending_token = int(target_choices[-1])
    result.output_ids.append(pending_token)
    result.stop_reason = STOP_EOS if pending_token in eos else STOP_LENGTH
    if pending_token in eos or max_new_tokens == 1:
        result.seconds = time.perf_counter() - started
        return result, None
    # Row t carries f_t and x_{t+1}: the prompt shifted left, the pending token in the last row.
    extend_tokens = torch.cat([prompt[0, 1:], target_choices[-1:]]).view(1, -1)
    draft_logits, draft_states = draft.extend(extend_tokens, aux_hidden_states, 0, draft_cache)
    return result, (capture_layer_ids, eos, draft_to_target, target_cache, draft_cache, pending_token, draft_logits, draft_states)


@torch.inference_mode()
def speculative_decode(
    target: nn.Module, draft: DraftModel, prompt_ids: Sequence[int], steps: int, max_new_tokens: int,
    eos_token_ids: Sequence[int] = (),
) -> SpeculativeResult:
    """Greedy chain speculative decoding of one prompt with `steps` (k) draft tokens per verification.

    Output equals `greedy_decode` token for token; stops after an EOS (kept) or `max_new_tokens`. As in
    SGLang, the draft length is not shortened near the budget: the last verification may check drafted
    tokens that are then cut off (counted in accepted_per_step, not in emitted_per_step).
    """
    if steps < 1:
        raise ValueError(f"draft steps k must be >= 1, got {steps}")
    started = time.perf_counter()
    result, state = _prefill(target, draft, prompt_ids, Topology.chain(steps), max_new_tokens, eos_token_ids, started)
    if state is None:
        return result
    capture_layer_ids, eos, draft_to_target, target_cache, draft_cache, pending_token, draft_logits, draft_states = state

    while True:
        processed = target_cache.get_seq_length()  # == draft_cache.length: rows 0..processed-1
        last_row = processed - 1  # the row carrying the pending token
        proposals = propose(draft, draft_logits[:, -1], draft_states[:, -1:], last_row, steps, draft_cache, draft_to_target)
        target_choices, aux_hidden_states = verify(target, pending_token, proposals, target_cache, capture_layer_ids)
        accepted = accept(proposals, target_choices)
        emitted = _record(result, target_choices[: accepted + 1].tolist(), accepted, last_row, max_new_tokens, eos)
        if emitted is None:
            break
        # Rollback: keep the pending token and the accepted drafts in the target cache; drop the draft's
        # decode rows, then extend it over those verified rows with the target's features. Their tokens,
        # shifted by one, are d_1..d_a, y_a == y_0..y_a: exactly the emitted tokens.
        crop_target_cache(target_cache, processed + accepted + 1)
        crop_draft_cache(draft_cache, processed)
        pending_token = emitted[-1]
        extend_tokens = target_choices[: accepted + 1].view(1, -1)
        draft_logits, draft_states = draft.extend(extend_tokens, aux_hidden_states[:, : accepted + 1], processed, draft_cache)
    result.seconds = time.perf_counter() - started
    return result


# ---------------------------------------------------------------------------------------------------
# the tree loop: SGLang's EAGLE tree (S steps, top-k K, T draft tokens), verified in one forward
# ---------------------------------------------------------------------------------------------------
def keep_target_cache_rows(cache: DynamicCache, cached: int, kept: Sequence[int]) -> None:
    """Rollback after a tree verification: keep rows 0..cached-1 and, of the T tree rows after them, the
    accepted path `kept` (node indices, root first), in that order. Keys/values (B, KV, L, D) per layer."""
    index = torch.as_tensor([*range(cached), *(cached + node for node in kept)], dtype=torch.long)
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(2, index.to(layer.keys.device))
        layer.values = layer.values.index_select(2, index.to(layer.values.device))


def propose_tree(
    draft: DraftModel, first_logits: torch.Tensor, last_state: torch.Tensor, last_row: int, pending_token: int,
    cache: DraftKVCache, topology: Topology, draft_to_target: torch.Tensor, draft_attention: str = SGLANG_SLOTS,
) -> DraftTree:
    """SGLang's draft tree from the row carrying the pending token (`tree.grow_tree`, `select_tree`).

    first_logits (1, Vd), last_state (1, 1, H): that row's logits and pre-norm state; last_row: its position.
    The tree's draft keys live in a `TreeKeyValues` of their own: `cache` (the extend rows) is not touched,
    so the draft's rollback is to drop them.
    """
    start = torch.tensor([last_row], device=first_logits.device)
    candidates = grow_tree(draft, first_logits, last_state[:, -1], start, cache.keys, cache.values, topology.steps, topology.top_k,
                           draft_to_target, draft_attention)
    return select_tree(candidates, topology.draft_tokens, torch.tensor([pending_token], device=first_logits.device))


def verify_tree(
    target: nn.Module, tree: DraftTree, cache: DynamicCache, capture_layer_ids: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One target forward over the T tree tokens: node n at position (cached) + depth, seeing the cache and
    its ancestors. Returns greedy choices (T,) (the target's next token after each node) and features (1, T,
    3H)."""
    cached = cache.get_seq_length()
    dtype = next(target.parameters()).dtype
    mask = verification_mask(tree, cached, dtype)
    positions = (cached + tree.depths).to(tree.tokens.device)  # (1, T)
    return target_forward(target, tree.tokens, cache, capture_layer_ids, attention_mask=mask, position_ids=positions)


@torch.inference_mode()
def tree_speculative_decode(
    target: nn.Module, draft: DraftModel, prompt_ids: Sequence[int], topology: Topology, max_new_tokens: int,
    eos_token_ids: Sequence[int] = (), draft_attention: str = SGLANG_SLOTS,
) -> SpeculativeResult:
    """Greedy speculative decoding of one prompt with SGLang's draft tree (any topology; a chain topology runs
    the chain through the tree code, which tests compare with `speculative_decode`).

    Each cycle: grow and select the tree from the pending row, verify its T tokens in one target forward
    (4-D tree mask), accept the deepest matching root path (a drafted tokens), emit the target's choices
    along it (a + 1 tokens: the bonus is the choice at the accepted node), keep only the path's rows in the
    target cache, drop the tree's draft keys, and extend the draft over the path with the target's features.
    Output equals `greedy_decode` token for token (same argument as the chain: every emitted token is the
    target's argmax after a prefix of its own argmax tokens). `accepted_per_step` holds accepted depths.
    """
    started = time.perf_counter()
    result, state = _prefill(target, draft, prompt_ids, topology, max_new_tokens, eos_token_ids, started)
    if state is None:
        return result
    capture_layer_ids, eos, draft_to_target, target_cache, draft_cache, pending_token, draft_logits, draft_states = state

    while True:
        processed = target_cache.get_seq_length()
        last_row = processed - 1
        tree = propose_tree(draft, draft_logits[:, -1], draft_states[:, -1:], last_row, pending_token, draft_cache,
                            topology, draft_to_target, draft_attention)
        target_choices, aux_hidden_states = verify_tree(target, tree, target_cache, capture_layer_ids)
        choice_at_parent = target_choices[tree.parents[0].clamp(min=0)].view(1, -1)
        accepted_depth, accepted_node = accept_tree(tree, choice_at_parent)
        path = path_to(tree, int(accepted_node[0]))  # root first, a + 1 nodes
        accepted = int(accepted_depth[0])
        path_index = torch.tensor(path, device=target_choices.device)
        emitted = _record(result, target_choices[path_index].tolist(), accepted, last_row, max_new_tokens, eos)
        if emitted is None:
            break
        keep_target_cache_rows(target_cache, processed, path)
        pending_token = emitted[-1]
        # The path's rows carry the features of its nodes and, shifted by one, the target's choices there.
        draft_logits, draft_states = draft.extend(target_choices[path_index].view(1, -1), aux_hidden_states[:, path_index],
                                                  processed, draft_cache)
    result.seconds = time.perf_counter() - started
    return result


def decode_with_topology(
    target: nn.Module, draft: DraftModel, prompt_ids: Sequence[int], topology: Topology, max_new_tokens: int,
    eos_token_ids: Sequence[int] = (), draft_attention: str = SGLANG_SLOTS,
) -> SpeculativeResult:
    """The chain loop for a chain, the tree loop for a tree; the result carries the topology."""
    if topology.is_chain:
        return speculative_decode(target, draft, prompt_ids, topology.steps, max_new_tokens, eos_token_ids)
    return tree_speculative_decode(target, draft, prompt_ids, topology, max_new_tokens, eos_token_ids, draft_attention)


# ---------------------------------------------------------------------------------------------------
# a draft with known answers: the loop's ceiling, and the test of multi-token acceptance
# ---------------------------------------------------------------------------------------------------
class OracleDraft:
    """Wraps a real draft (its caches and compute run as usual) but proposes known tokens.

    `sequence_ids` is the full sequence the target will produce (prompt + greedy output). A row at RoPE
    position p proposes token p + 2 (the row carries token p + 1), so the proposal is right unless p + 2 is
    in `wrong_positions`, where it proposes another draft-vocab token. Every generated token (from
    `prompt_length` on) must be in the draft vocab. Use it to measure what the loop gives at accept length
    k + 1, or to test acceptance.
    """

    def __init__(self, draft: Eagle3DraftModel, sequence_ids: Sequence[int], prompt_length: int,
                 wrong_positions: Sequence[int] = ()):
        self.draft = draft
        self.config = draft.config
        self.prompt_length = prompt_length
        self.wrong_positions = frozenset(int(position) for position in wrong_positions)
        draft_to_target = draft.draft_to_target_ids()
        sequence = torch.as_tensor(list(sequence_ids), dtype=torch.long)
        generated = sequence[prompt_length:]
        if not bool(draft.t2d[generated].all()):
            missing = sorted(set(generated[~draft.t2d[generated]].tolist()))
            raise ValueError(f"generated tokens {missing[:10]} are not in the draft vocab; use a draft vocab that covers them")
        # draft_to_target is ascending, so searchsorted finds each token's draft id (prompt tokens: never
        # proposed).
        self.sequence_draft_ids = torch.searchsorted(draft_to_target, sequence).clamp(max=self.config.draft_vocab_size - 1)

    def draft_to_target_ids(self) -> torch.Tensor:
        return self.draft.draft_to_target_ids()

    def _forced_logits(self, positions: Sequence[int], like: torch.Tensor) -> torch.Tensor:
        """(1, n, Vd) logits whose argmax at a row of position p is the draft id of token p + 2."""
        size = self.config.draft_vocab_size
        logits = torch.zeros(1, len(positions), size, dtype=like.dtype, device=like.device)
        for row, position in enumerate(positions):
            wanted = position + 2
            if wanted < self.prompt_length or wanted >= len(self.sequence_draft_ids):
                continue  # a prompt row (its logits are never used) or past the known sequence: draft id 0
            draft_id = int(self.sequence_draft_ids[wanted])
            # A confident proposal (probability ~1 - 1e-5 at a 1024-token draft vocab), so a tree's cumulative
            # scores rank the oracle's own path first, as a well-trained draft's would.
            logits[0, row, (draft_id + 1) % size if wanted in self.wrong_positions else draft_id] = 20.0
        return logits

    def extend(self, input_ids: torch.Tensor, aux_hidden_states: torch.Tensor, start_position: int,
               cache: DraftKVCache) -> tuple[torch.Tensor, torch.Tensor]:
        logits, states = self.draft.extend(input_ids, aux_hidden_states, start_position, cache)
        return self._forced_logits(range(start_position, start_position + input_ids.shape[1]), logits), states

    def decode(self, input_ids: torch.Tensor, hidden_states: torch.Tensor, position: int,
               cache: DraftKVCache) -> tuple[torch.Tensor, torch.Tensor]:
        logits, states = self.draft.decode(input_ids, hidden_states, position, cache)
        return self._forced_logits(range(position, position + 1), logits), states

    def forward_nodes(self, input_ids: torch.Tensor, hidden_states: torch.Tensor, positions: torch.Tensor,
                      key_values) -> tuple[torch.Tensor, torch.Tensor]:
        """Tree nodes (1, N) at their own positions (1, N): every node at position p proposes token p + 2."""
        prenorm = self.draft.step(input_ids, hidden_states, positions, key_values)
        return self._forced_logits([int(position) for position in positions[0].tolist()], self.draft.logits(prenorm)), prenorm
