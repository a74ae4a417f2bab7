"""The draft head's training loss, chunked: soft cross-entropy over the draft vocab, never all logits at once.

The TTT loss (eaglekit.training.loss's module docstring has the definition) needs, per TTT step i and
counted row t, the draft's log-softmax over the draft vocab against the target's distribution at
row t+1+i. Written plainly (`eaglekit.training.ttt_loss`, the reference) it materializes logits,
log-probabilities and their gradients for every row of every step: k x T x Vd floats several times
over (7 x 4096 x 32,000 x 4 B = 3.7 GB per copy for a 4K pack), and most of the time goes to
elementwise passes over them.

Here the rows of all steps that can count (chosen on the host from `loss_mask`, so no device sync)
are gathered into one (N, H) matrix and the head runs over it in chunks of `chunk_rows` rows. Each
chunk computes its logits, the loss, and at once the gradient (softmax * sum(p) - p, scaled by the
row weight) with respect to the chunk's hidden states and the head weight; the logits are then
dropped. Backward only scales those stored gradients. Peak extra memory: one chunk's logits plus
(N, H) and (Vd, H) gradients, whatever k and T are. The head weight's gradient lives in one fp32
buffer for all steps.

Soft cross-entropy of one row with teacher p and logits z: sum(p) * logsumexp(z) - p . z (p sums to 1
up to rounding; keeping sum(p) makes this equal the reference to float tolerance).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class _ChunkedSoftCrossEntropy(torch.autograd.Function):
    """loss = sum_n row_weights[n] * CE(hidden[n] @ weight^T, teacher_probs[teacher_rows[n]]).

    hidden (N, H), weight (Vd, H), teacher_probs (M, Vd) float32, teacher_rows (N,) int64,
    row_weights (N,) float32. Returns (loss (), cross_entropy (N,) float32, draft_argmax (N,) int64);
    only the loss carries gradients.
    """

    @staticmethod
    def forward(ctx, hidden, weight, teacher_probs, teacher_rows, row_weights, chunk_rows: int):
        rows = hidden.shape[0]
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        cross_entropy = torch.empty(rows, dtype=torch.float32, device=hidden.device)
        draft_argmax = torch.empty(rows, dtype=torch.int64, device=hidden.device)
        for start in range(0, rows, chunk_rows):
            stop = min(start + chunk_rows, rows)
            chunk = hidden[start:stop]  # (c, H)
            logits = (chunk @ weight.T).float()  # (c, Vd): the only logits alive at any time
            probs = teacher_probs.index_select(0, teacher_rows[start:stop])  # (c, Vd)
            probs_sum = probs.sum(-1)
            log_normalizer = torch.logsumexp(logits, dim=-1)  # (c,)
            cross_entropy[start:stop] = probs_sum * log_normalizer - torch.linalg.vecdot(probs, logits)
            draft_argmax[start:stop] = logits.argmax(-1)
            # d CE / d logits = softmax(z) * sum(p) - p, times the row weight w; in place in `logits`
            # (few passes over (c, Vd): on a CPU these elementwise passes cost as much as the matmul).
            weights = row_weights[start:stop, None]
            grad_logits = (logits.sub_(log_normalizer[:, None]).exp_().mul_(probs_sum[:, None] * weights)
                           .addcmul_(probs, weights, value=-1.0))
            grad_hidden[start:stop] = (grad_logits.to(weight.dtype) @ weight).to(hidden.dtype)
            grad_weight += (grad_logits.T.to(chunk.dtype) @ chunk).float()
        loss = (cross_entropy * row_weights).sum()
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(cross_entropy, draft_argmax)
        return loss, cross_entropy, draft_argmax

    @staticmethod
    def backward(ctx, grad_loss, _grad_cross_entropy, _grad_argmax):
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_loss.to(grad_hidden.dtype), (grad_weight * grad_loss).to(ctx.weight_dtype), None, None, None, None


def chunked_soft_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    teacher_probs: torch.Tensor,
    teacher_rows: torch.Tensor,
    row_weights: torch.Tensor,
    chunk_rows: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weighted soft cross-entropy of `hidden @ weight^T` against teacher rows, chunk by chunk.

    hidden (N, H) (normed states), weight (Vd, H), teacher_probs (M, Vd), teacher_rows (N,) into it,
    row_weights (N,). Returns (loss, per-row cross-entropy (N,), per-row draft argmax (N,)).
    """
    if chunk_rows <= 0:
        raise ValueError(f"chunk_rows must be positive, got {chunk_rows}")
    return _ChunkedSoftCrossEntropy.apply(hidden, weight, teacher_probs, teacher_rows, row_weights, chunk_rows)


@dataclass
class HeadTeacher:
    """What `DraftHead(hidden, teacher)` needs besides the hidden rows: teacher_probs (M, Vd) float32,
    rows (N,) into it, row_weights (N,) float32, and the chunk size."""

    probs: torch.Tensor
    rows: torch.Tensor
    row_weights: torch.Tensor
    chunk_rows: int = 1024


@dataclass
class SelectedRows:
    """The rows that can count, all TTT steps together, built on the host.

    rows (N,): flat index b*T + t of the draft row; teacher_rows (N,): b*T + t+1+i, the target row it
    is compared with; steps (N,): the TTT step i; eligible_by_step (k,) int64: rows per step.
    """

    rows: torch.Tensor
    teacher_rows: torch.Tensor
    steps: torch.Tensor
    eligible_by_step: torch.Tensor

    @classmethod
    def from_eligible(cls, eligible: torch.Tensor) -> "SelectedRows":
        """eligible (k, B, T) bool, on the CPU: computing indices there keeps the device stream free of
        syncs."""
        by_step = eligible.reshape(eligible.shape[0], -1)  # (k, B T)
        # nonzero (N, 2): [step, flat row], step by step and rows ascending within a step
        steps, rows = torch.nonzero(by_step).T.contiguous()
        # Row t of step i is eligible only if token t+2+i exists in its sample, so t+1+i < T: same batch row.
        return cls(rows, rows + 1 + steps, steps, by_step.sum(1))

    def to(self, device: torch.device) -> "SelectedRows":
        """Pinned, non-blocking copies on CUDA (a pageable copy would wait for the GPU to drain)."""
        cuda = device.type == "cuda"
        moved = (tensor.pin_memory().to(device, non_blocking=True) if cuda else tensor.to(device)
                 for tensor in (self.rows, self.teacher_rows, self.steps))
        return SelectedRows(*moved, self.eligible_by_step)


def chunked_ttt_loss(
    model: torch.nn.Module,
    step_states: list[torch.Tensor],
    targets,
    eligible: torch.Tensor,
    counts: torch.Tensor,
    step_weight: float,
    chunk_rows: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The TTT loss of `eaglekit.training.ttt_loss` from the unroll's normed states, head chunked.

    model: the draft (unwrapped: its `lm_head` and `draft_to_target_ids`); step_states: k tensors
    (B, T, H) from `model(..., return_normed_states=True)`; targets: TargetSignals over (B, T);
    eligible (k, B, T) bool on the CPU; counts (k,) global counted-row normalizers on the device.
    Returns (loss, stats (k, 4) float64 on the device: summed CE, counted rows, correct top-1,
    eligible rows), the reference's numbers to float tolerance, without a host sync.
    """
    device = step_states[0].device
    batch, length, hidden_size = step_states[0].shape
    selected = SelectedRows.from_eligible(eligible.cpu()).to(device)
    states = torch.stack(step_states).reshape(len(step_states) * batch * length, hidden_size)  # (k B T, H)
    hidden = states.index_select(0, selected.steps * (batch * length) + selected.rows)  # (N, H)
    teacher_rows = selected.teacher_rows
    counted = targets.in_draft.reshape(-1).index_select(0, teacher_rows)  # (N,) target argmax is draftable
    step_scale = step_weight ** torch.arange(len(step_states), device=device, dtype=torch.float32) / counts.float().clamp(min=1)
    row_weights = counted.float() * step_scale.index_select(0, selected.steps)
    teacher = HeadTeacher(targets.probs.reshape(batch * length, -1), teacher_rows, row_weights, chunk_rows)
    loss, cross_entropy, draft_argmax = model.lm_head(hidden, teacher)
    with torch.no_grad():
        proposed = model.draft_to_target_ids().index_select(0, draft_argmax)
        correct = proposed == targets.argmax.reshape(-1).index_select(0, teacher_rows)
        per_row = torch.stack([cross_entropy * counted, counted.float(), correct.float(), torch.ones_like(cross_entropy)], dim=1)
        stats = torch.zeros(len(step_states), 4, dtype=torch.float64, device=device)
        stats.index_add_(0, selected.steps, per_row.double())
    return loss, stats
