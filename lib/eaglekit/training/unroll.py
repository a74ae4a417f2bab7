"""The TTT unroll with activation checkpointing: each TTT step's activations recomputed in backward.

`Eagle3DraftModel.unroll` keeps every step's activations for backward (attention inputs and outputs,
the SwiGLU's intermediate-wide tensors, norms), ttt_steps times. `checkpointed_unroll` runs the same
steps through `torch.utils.checkpoint` (non-reentrant): a step keeps only its inputs (the previous
state and the earlier steps' keys and values, which later steps need anyway) and is run again when
backward reaches it, so the peak holds one step's activations instead of ttt_steps. The math is the
draft's own `step`, so losses and gradients equal the plain unroll's (tests/training/test_unroll.py).

The earlier steps' keys and values are explicit inputs and outputs of each checkpointed step: a step
builds its own `TrainingTimeTestKeyValues` from them, so the recomputation sees exactly the keys the
first run saw (appending to one shared cache would double them on recompute).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from eaglekit.draft.model import Eagle3DraftModel, TrainingTimeTestKeyValues, shift_left


def _step(model: Eagle3DraftModel, backend: str, document_ids: torch.Tensor | None, past_steps: int, tokens: torch.Tensor,
          hidden_states: torch.Tensor, position_ids: torch.Tensor, *past: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One TTT step from explicit state: -> (pre-norm output (B, T, H), this step's key, value
    (B, KV, T, D))."""
    key_values = TrainingTimeTestKeyValues(document_ids, backend)
    key_values.keys, key_values.values = list(past[:past_steps]), list(past[past_steps:])
    output = model.step(tokens, hidden_states, position_ids, key_values)
    return output, key_values.keys[-1], key_values.values[-1]


def checkpointed_unroll(
    model: Eagle3DraftModel,
    input_ids: torch.Tensor,
    aux_hidden_states: torch.Tensor,
    ttt_steps: int,
    position_ids: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
    checkpoint_fn: Callable[..., tuple[torch.Tensor, ...]] | None = None,
) -> list[torch.Tensor]:
    """`model.unroll` with each TTT step checkpointed: ttt_steps pre-norm states (B, T, H), the same values.

    input_ids (B, T), aux_hidden_states (B, T, 3H), position_ids / document_ids (B, T) as `model.forward`.
    checkpoint_fn(function, *args): how a step runs (default torch.utils.checkpoint, non-reentrant;
    eaglekit.training.memory passes a counting one for its dry run).
    """
    if checkpoint_fn is None:
        # No RNG in a draft step (no dropout), so the recomputation needs no saved RNG state.
        checkpoint_fn = lambda function, *args: checkpoint(function, *args, use_reentrant=False, preserve_rng_state=False)
    batch, length = input_ids.shape
    backend = model.resolved_attention_backend(input_ids.device)
    hidden_states = model.project_features(aux_hidden_states)  # (B, T, 3H) -> (B, T, H)
    if position_ids is None:
        position_ids = torch.arange(length, device=input_ids.device).expand(batch, length)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    step_states = []
    for ttt_step in range(ttt_steps):
        step_tokens = shift_left(input_ids, 1 + ttt_step, document_ids=document_ids)
        step = lambda *args, past=len(keys): _step(model, backend, document_ids, past, *args)
        hidden_states, key, value = checkpoint_fn(step, step_tokens, hidden_states, position_ids + ttt_step, *keys, *values)
        keys.append(key)
        values.append(value)
        step_states.append(hidden_states)
    return step_states


class CheckpointedDraft(nn.Module):
    """The draft's training forward (`Eagle3DraftModel.forward`) with the unroll checkpointed per TTT step.

    What the training loop calls (and DDP wraps) when `TrainSettings.activation_checkpointing` is on;
    its parameters are the draft's own, so optimizer, clipping and checkpoints see the same tensors.
    """

    def __init__(self, draft: Eagle3DraftModel):
        super().__init__()
        self.draft = draft

    def forward(self, input_ids: torch.Tensor, aux_hidden_states: torch.Tensor, ttt_steps: int, position_ids: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None, return_normed_states: bool = False) -> list[torch.Tensor]:
        step_states = checkpointed_unroll(self.draft, input_ids, aux_hidden_states, ttt_steps, position_ids, document_ids)
        if return_normed_states:
            return [self.draft.norm(hidden_states) for hidden_states in step_states]
        return [self.draft.logits(hidden_states) for hidden_states in step_states]
