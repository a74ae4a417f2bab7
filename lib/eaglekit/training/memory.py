"""Memory plan for draft training, beside the capture storage plan (eaglekit.capture.plan_capture_storage).

Two questions before a training run on GPUs:

1. What does one GPU hold? Model state: the trainable draft in fp32 master weights, its fp32
   gradients and AdamW's two fp32 moments (16 B per trainable parameter), the frozen target
   embeddings (fp32, 4 B per entry) and the target's lm_head for the teacher (fp32, cast once).
   DDP replicates all of it on every GPU; FSDP shards the draft (weights, gradients, moments, and
   the embedding table) across the ranks; the teacher head stays whole on each.
   Per token of a pack: the activations autograd keeps for backward, and the teacher's draft-vocab
   probabilities (Vd x 4 B). Activations are counted by a dry run of the kit's own training forward
   and chunked loss on the meta device (shapes only, no memory, any size): every tensor autograd
   saves, once per storage, weights excluded. That is exact for what the code saves, in fp32; the
   bf16 figure runs the dry run with bf16 weights (activations bf16 where autocast makes them bf16,
   fp32 where the code computes in fp32: norms, softmax, the loss), which leaves out autocast's
   per-op cast copies. Flex attention keeps query, keys, values, output and logsumexp per step; the
   eager backend keeps the (T x T) attention probabilities, so its memory per token grows with T.
   A fixed transient allowance covers one loss chunk's logits and one teacher chunk's full-vocab logits.
2. How long a pack fits a given GPU? The largest multiple of 128 tokens whose state + pack x bytes
   per token + transients stays under memory_fraction of the GPU.
Offline or online capture (the target's weights beside training) is the storage plan's choice.
"""

from __future__ import annotations

import bisect
import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch

from eaglekit.generation.capacity import load_model_config
from eaglekit.draft.model import DraftConfig, Eagle3DraftModel
from eaglekit.draft.head_loss import chunked_ttt_loss
from eaglekit.training.teacher import TargetSignals

ADAM_BYTES_PER_TRAINABLE = 4 + 4 + 4 + 4  # fp32 master weight, fp32 gradient, AdamW exp_avg and exp_avg_sq
FROZEN_BYTES_PER_PARAMETER = 4  # the target's embedding table, kept in fp32 by build_draft_from_target
TEACHER_HEAD_BYTES_PER_ENTRY = 4  # the target's lm_head, cast to fp32 once for the teacher
PACK_ALIGNMENT = 128  # flex attention's block size: packs are multiples of it
MEMORY_FRACTION = 0.9  # of each GPU planned: the rest is the CUDA context and allocator slack
LOSS_CHUNK_ROWS = 1024  # eaglekit.draft.head_loss default
TEACHER_CHUNK_ROWS = 1024  # eaglekit.training.target_signals default


def draft_config_for_target(target_config: str | os.PathLike | Mapping[str, Any], draft_vocab_size: int,
                            shape: str | None = None) -> DraftConfig:
    """The draft the kit builds for a target config (a path, folder or dict; multimodal configs use
    text_config); `shape`: params' training.draft_shape ("auto" or a preset of
    eaglekit.draft.config.DRAFT_SHAPES), None: derived."""
    return DraftConfig.from_target_config(load_model_config(target_config), draft_vocab_size=draft_vocab_size, shape=shape)


def parameter_counts(config: DraftConfig) -> tuple[int, int]:
    """(trainable, frozen) parameters of the draft, counted on the real module built on the meta device."""
    with torch.device("meta"):
        model = Eagle3DraftModel(config)
    trainable = sum(parameter.numel() for parameter in model.parameters() if parameter.requires_grad)
    frozen = sum(parameter.numel() for parameter in model.parameters() if not parameter.requires_grad)
    return trainable, frozen


def activation_bytes(config: DraftConfig, pack_tokens: int, ttt_steps: int, attention: str = "flex", dtype: str = "bf16",
                     checkpointing: bool = False) -> int:
    """Bytes autograd keeps for backward in one training micro-batch of one pack (dry run on meta).

    Runs the kit's forward (`return_normed_states`) and `chunked_ttt_loss` on meta tensors with every
    row counted (the worst case), and sums the distinct storages saved for backward, weights excluded.
    checkpointing: the unroll of eaglekit.training.unroll (each TTT step recomputed in backward). Then
    the count is what stays saved (outside the steps, and each step's inputs: the previous state, the
    earlier steps' keys and values, tokens and positions) plus the largest step's own activations,
    which its recomputation holds while backward passes through it: the peak, not the sum.
    """
    if dtype not in ("bf16", "fp32"):
        raise ValueError(f"dtype {dtype!r}: use 'bf16' or 'fp32'")

    meta = torch.device("meta")
    with meta:
        model = Eagle3DraftModel(config)
    if dtype == "bf16":
        model.to(torch.bfloat16)
    model.attention_backend = attention
    weights = {tensor.untyped_storage()._cdata for tensor in (*model.parameters(), *model.buffers())}
    input_ids = torch.zeros(1, pack_tokens, dtype=torch.int64, device=meta)
    aux = torch.zeros(1, pack_tokens, 3 * config.hidden_size, dtype=torch.bfloat16, device=meta)
    positions, documents = torch.zeros_like(input_ids), torch.zeros_like(input_ids)
    eligible = torch.ones(ttt_steps, 1, pack_tokens, dtype=torch.bool)  # on the host, as in training
    for step in range(ttt_steps):
        eligible[step, 0, max(0, pack_tokens - 2 - step) :] = False
    targets = TargetSignals(torch.zeros(1, pack_tokens, config.draft_vocab_size, device=meta),
                            torch.zeros_like(input_ids), torch.zeros(1, pack_tokens, dtype=torch.bool, device=meta))
    saved: dict[int, int] = {}
    alive: list[torch.Tensor] = []  # what the count names stays allocated, so no freed storage's id is reused

    def counter(into: dict[int, int], skipped: set[int]):
        """A saved-tensors hook: the bytes of each storage autograd saves go into `into`, those in `skipped`
        aside."""

        def count(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage()
            if storage._cdata not in skipped:
                into[storage._cdata] = storage.nbytes()
                alive.append(tensor)
            return tensor

        return count

    keep = counter(saved, weights)
    # with checkpointing: each step's own activations (held again while it recomputes)
    step_bytes: list[int] = []

    def run_step(function, *args: torch.Tensor):
        inputs = {keep(tensor).untyped_storage()._cdata for tensor in args if isinstance(tensor, torch.Tensor)}
        inside: dict[int, int] = {}
        # The innermost hooks apply: a step's own activations go to `inside`.
        with torch.autograd.graph.saved_tensors_hooks(counter(inside, weights | inputs), lambda tensor: tensor):
            outputs = function(*args)
        step_bytes.append(sum(inside.values()))
        return outputs

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        if checkpointing:
            from eaglekit.training.unroll import checkpointed_unroll

            states = [model.norm(state) for state in checkpointed_unroll(model, input_ids, aux, ttt_steps, positions, documents,
                                                                          checkpoint_fn=run_step)]
        else:
            states = model(input_ids, aux, ttt_steps, positions, documents, return_normed_states=True)
        chunked_ttt_loss(model, states, targets, eligible, torch.ones(ttt_steps, device=meta), 0.8)
    return sum(saved.values()) + max(step_bytes, default=0)


def activation_bytes_curve(config: DraftConfig, ttt_steps: int, attention: str = "flex", dtype: str = "bf16",
                           checkpointing: bool = False) -> tuple[float, float, float]:
    """(c0, c1, c2) with activation_bytes(T) = c0 + c1 T + c2 T^2, from dry runs at 3 small packs.

    Every saved tensor's size is a constant (the head's weight gradient), proportional to T, or, for
    the eager backend's attention probabilities, to T^2; three points fix the curve exactly (a test
    checks it against a dry run at a large T), so planning a 64K-token pack needs no 64K dry run.
    """
    key = (json.dumps(config.to_dict(), sort_keys=True), ttt_steps, attention, dtype, checkpointing)
    if key not in _CURVES:
        points = [PACK_ALIGNMENT, 2 * PACK_ALIGNMENT, 3 * PACK_ALIGNMENT]
        first, second, third = (activation_bytes(config, tokens, ttt_steps, attention, dtype, checkpointing) for tokens in points)
        step = PACK_ALIGNMENT
        c2 = (third - 2 * second + first) / (2 * step * step)
        c1 = (second - first) / step - c2 * (points[1] + points[0])
        c0 = first - c1 * points[0] - c2 * points[0] ** 2
        _CURVES[key] = (c0, c1, c2)
    return _CURVES[key]


_CURVES: dict[tuple, tuple[float, float, float]] = {}  # dry runs are pure functions of their arguments


@dataclass(frozen=True)
class TrainingMemoryPlan:
    """What one GPU holds to train a draft at `pack_tokens`, and the largest pack that fits it."""

    gpu_memory_bytes: int
    memory_fraction: float
    world_size: int
    parallel: str  # ddp | fsdp
    attention: str  # flex | eager
    dtype: str  # bf16 | fp32 (activations)
    ttt_steps: int
    pack_tokens: int
    trainable_parameters: int
    frozen_parameters: int
    model_state_bytes: int  # per GPU: draft weights, gradients, AdamW moments, frozen embeddings
    teacher_head_bytes: int  # per GPU: the target's lm_head in fp32
    activation_bytes_per_token: float  # at pack_tokens
    teacher_bytes_per_token: int  # draft-vocab teacher probabilities, argmax, flag
    transient_bytes: int  # one loss chunk and one teacher chunk of logits
    largest_pack_tokens: int  # 0 when even the model state does not fit
    activation_checkpointing: bool = False  # each TTT step recomputed in backward (eaglekit.training.unroll)

    @property
    def bytes_per_token(self) -> float:
        return self.activation_bytes_per_token + self.teacher_bytes_per_token

    @property
    def total_bytes(self) -> int:
        return int(self.model_state_bytes + self.teacher_head_bytes + self.transient_bytes + self.pack_tokens * self.bytes_per_token)

    @property
    def usable_bytes(self) -> int:
        return int(self.gpu_memory_bytes * self.memory_fraction)

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.usable_bytes

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "bytes_per_token": self.bytes_per_token, "total_bytes": self.total_bytes, "fits": self.fits}


def plan_training_memory(
    target_config: str | os.PathLike | Mapping[str, Any] | DraftConfig,
    *,
    gpu_memory_bytes: int,
    pack_tokens: int,
    draft_vocab_size: int = 32_000,
    ttt_steps: int = 7,
    world_size: int = 1,
    parallel: str = "ddp",
    attention: str = "flex",
    dtype: str = "bf16",
    activation_checkpointing: bool = False,
) -> TrainingMemoryPlan:
    """Per-GPU training memory at `pack_tokens`, and the largest pack (multiple of 128) that fits.

    target_config: the target's config.json (path, folder, dict) or a DraftConfig. gpu_memory_bytes:
    one GPU (H200: 141e9), of which MEMORY_FRACTION is planned.
    """
    if parallel not in ("ddp", "fsdp"):
        raise ValueError(f"parallel {parallel!r}: plan for 'ddp' or 'fsdp'")
    config = target_config if isinstance(target_config, DraftConfig) else draft_config_for_target(target_config, draft_vocab_size)
    trainable, frozen = parameter_counts(config)
    state = trainable * ADAM_BYTES_PER_TRAINABLE + frozen * FROZEN_BYTES_PER_PARAMETER
    if parallel == "fsdp":
        state = -(-state // world_size)
    teacher_head = config.vocab_size * config.hidden_size * TEACHER_HEAD_BYTES_PER_ENTRY
    # One loss chunk: logits, teacher rows and gradient (3 x rows x Vd fp32); one teacher chunk: rows x V
    # fp32.
    transient = 3 * LOSS_CHUNK_ROWS * config.draft_vocab_size * 4 + TEACHER_CHUNK_ROWS * config.vocab_size * 4
    teacher_per_token = config.draft_vocab_size * 4 + 8 + 1
    c0, c1, c2 = activation_bytes_curve(config, ttt_steps, attention, dtype, activation_checkpointing)

    def needed(tokens: int) -> float:
        return state + teacher_head + transient + c0 + c1 * tokens + c2 * tokens**2 + tokens * teacher_per_token

    usable = int(gpu_memory_bytes * MEMORY_FRACTION)
    # `needed` grows with the pack: bisect the packs of 1 to 2^18 - 1 units of 128 tokens for the last that
    # fits.
    units = range(1, (1 << 25) // PACK_ALIGNMENT)
    largest = PACK_ALIGNMENT * bisect.bisect_right(units, usable, key=lambda unit: needed(unit * PACK_ALIGNMENT))
    return TrainingMemoryPlan(
        gpu_memory_bytes=int(gpu_memory_bytes), memory_fraction=MEMORY_FRACTION, world_size=world_size, parallel=parallel,
        attention=attention, dtype=dtype, ttt_steps=ttt_steps, pack_tokens=pack_tokens, trainable_parameters=trainable,
        frozen_parameters=frozen, model_state_bytes=state, teacher_head_bytes=teacher_head,
        activation_bytes_per_token=(c0 + c1 * pack_tokens + c2 * pack_tokens**2) / pack_tokens,
        teacher_bytes_per_token=teacher_per_token, transient_bytes=transient, largest_pack_tokens=largest,
        activation_checkpointing=activation_checkpointing,
    )
