"""The offline estimate on one sequence, beside the loop: the draft scored against the target along the
prompt + the target's own greedy continuation, without decoding.

`speculative` runs the real loop and counts tau as a server does; this module gives DESIGN's offline tau on
the same tokens, so the two can be compared request by request. One target forward yields the features
and the argmax at every position; then either the draft's training-time-test unroll scores a chain of k
steps from every start row (`offline_chain_agreement`), or SGLang's tree is grown and accepted from every
start row (`offline_tree_acceptance`, any topology; with top-k 1 it equals the chain). Start rows match
the loop's `SpeculativeResult.chain_start_rows`. Tables of many sequences go to `acceptance`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from transformers import DynamicCache

from eaglekit.analysis.acceptance import depth_agreement
from eaglekit.analysis.speculative import check_draft_fits_target, device_of, target_forward
from eaglekit.analysis.tree import SGLANG_SLOTS, offline_tree_depths_grid
from eaglekit.draft.model import Eagle3DraftModel
from eaglekit.topology import Topology


@dataclass
class OfflineChainAgreement:
    """Draft top-1 agreement with the target along one greedy sequence.

    agreement (P, k) bool: row = a chain start, column i = step i + 1 proposed the target's argmax there.
    start_rows (P,): the draft row that proposes d_1 (the row carrying the pending token), matching
    `SpeculativeResult.chain_start_rows`. Only complete chains inside the sequence are kept.
    """

    agreement: np.ndarray
    start_rows: np.ndarray
    tokens: int
    seconds: float


def _target_pass(target: nn.Module, draft: Eagle3DraftModel, sequence_ids: Sequence[int],
                 prompt_length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input ids (1, T), the target's argmax and its capture layers' features at every position): one
    forward."""
    check_draft_fits_target(target, draft)
    length = len(sequence_ids)
    if not 1 <= prompt_length <= length:
        raise ValueError(f"prompt_length {prompt_length} must be in [1, {length}] (the sequence length)")
    input_ids = torch.tensor([list(sequence_ids)], dtype=torch.long, device=device_of(target))
    target_argmax, aux_hidden_states = target_forward(target, input_ids, DynamicCache(config=target.config),
                                                      list(draft.config.capture_layer_indices))
    return input_ids, target_argmax, aux_hidden_states


@torch.inference_mode()
def offline_chain_agreement(
    target: nn.Module, draft: Eagle3DraftModel, sequence_ids: Sequence[int], prompt_length: int, steps: int
) -> OfflineChainAgreement:
    """DESIGN's offline chain evaluation of one sequence: prompt + the target's own greedy continuation.

    One target forward gives the features and argmax at every position; the draft's training-time-test
    unroll (`Eagle3DraftModel.forward`, equal to KV-cache decoding) runs k steps from every row at once.
    Row t, step i feeds token t+1+i at position t+i and proposes token t+2+i; it agrees when that equals
    the target's argmax at t+1+i. On a greedy continuation the unroll's input tokens equal the draft's own
    proposals whenever earlier steps agreed, so a row's leading agreements are what the loop accepts there.
    Chain starts: rows prompt_length-1 (the first generated token pending) .. T-1-k (all k targets exist).
    """
    started = time.perf_counter()
    input_ids, target_argmax, aux_hidden_states = _target_pass(target, draft, sequence_ids, prompt_length)
    device, length = input_ids.device, input_ids.shape[1]
    step_logits = draft(input_ids, aux_hidden_states, steps)  # k x (1, T, Vd)
    draft_to_target = draft.draft_to_target_ids().to(device)
    first_row, last_row = prompt_length - 1, length - 1 - steps
    start_rows = np.arange(first_row, last_row + 1) if last_row >= first_row else np.zeros(0, dtype=np.int64)
    agreement = np.zeros((len(start_rows), steps), dtype=bool)
    if len(start_rows):
        rows = torch.as_tensor(start_rows, device=device)
        for step, logits in enumerate(step_logits):
            proposed = draft_to_target[logits[0, rows].argmax(-1)]  # (P,)
            agreement[:, step] = (proposed == target_argmax[rows + 1 + step]).cpu().numpy()
    return OfflineChainAgreement(agreement=agreement, start_rows=start_rows, tokens=length, seconds=time.perf_counter() - started)


@dataclass
class OfflineTreeAcceptance:
    """SGLang's tree scored from every chain start of one greedy sequence.

    accepted_depths (P,): drafted tokens the tree from each start row would have accepted (0..S);
    start_rows (P,): as `OfflineChainAgreement.start_rows`. `agreement` is the (P, S) depth table
    (column j-1: accepted >= j) that `acceptance.chain_counts` and the bootstrap tables take as they are.
    """

    accepted_depths: np.ndarray
    start_rows: np.ndarray
    topology: Topology
    tokens: int
    seconds: float

    @property
    def agreement(self) -> np.ndarray:
        return depth_agreement(self.accepted_depths, self.topology.steps)


@torch.inference_mode()
def offline_tree_acceptance(
    target: nn.Module, draft: Eagle3DraftModel, sequence_ids: Sequence[int], prompt_length: int, topology: Topology,
    draft_attention: str = SGLANG_SLOTS,
) -> OfflineTreeAcceptance:
    """The offline estimate for any topology on one sequence (prompt + the target's greedy continuation):
    one target forward for features and argmax, then `tree.offline_tree_depths_grid` from every start row
    `offline_chain_agreement` uses (prompt_length - 1 .. T - 1 - S). With K = 1 its depths are the chain's
    leading agreements."""
    started = time.perf_counter()
    batched_ids, target_argmax, aux_hidden_states = _target_pass(target, draft, sequence_ids, prompt_length)
    input_ids, length = batched_ids[0], batched_ids.shape[1]
    first_row, last_row = prompt_length - 1, length - 1 - topology.steps
    start_rows = torch.arange(first_row, max(last_row + 1, first_row), device=input_ids.device)
    depths = offline_tree_depths_grid(draft, input_ids, aux_hidden_states[0], target_argmax, start_rows, [topology],
                                      draft_attention=draft_attention)[topology]
    return OfflineTreeAcceptance(accepted_depths=depths.cpu().numpy(), start_rows=start_rows.cpu().numpy(), topology=topology,
                                 tokens=length, seconds=time.perf_counter() - started)
