"""The TTT loss, written plainly: the reference the chunked head loss (eaglekit.draft.head_loss) must equal.

Loss (DESIGN "EAGLE-3 facts"): at TTT step i, row t predicts the token at t+2+i against the teacher at
row t+1+i (eaglekit.training.teacher). A row counts when the predicted token exists and was generated
by the target (loss_mask == 1 there, `eligible_rows`) and the target's argmax is in the draft vocab.
Step i's summed cross-entropy is divided by the number of counted rows of step i over the whole
optimizer step (all micro-batches, all ranks), so accumulation and DDP give the same gradient as one
big batch; steps are weighted step_weight^i. This version materializes every step's (B, T, Vd) logits;
training uses the chunked one, which never does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eaglekit.training.teacher import TargetSignals


def ttt_loss(
    step_logits: list[torch.Tensor],
    targets: TargetSignals,
    eligible: torch.Tensor,
    counts: torch.Tensor,
    step_weight: float,
    draft_to_target: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted soft cross-entropy over TTT steps.

    step_logits: k tensors (B, T, Vd); eligible (k, B, T); counts (k,) normalizers (global eligible rows).
    Returns (loss scalar, stats (k, 4) float64: summed CE, counted rows, correct top-1, eligible rows).
    Step i row t is compared with the target at row t+1+i.
    """
    length = step_logits[0].shape[1]
    loss = step_logits[0].new_zeros((), dtype=torch.float32)
    stats = torch.zeros(len(step_logits), 4, dtype=torch.float64)
    for step, logits in enumerate(step_logits):
        rows = length - 1 - step
        if rows <= 0:
            continue
        step_eligible = eligible[step][:, :rows]
        counted = step_eligible & targets.in_draft[:, 1 + step :]
        log_probs = F.log_softmax(logits[:, :rows].float(), dim=-1)
        cross_entropy = -(targets.probs[:, 1 + step :] * log_probs).sum(-1)  # (B, rows)
        summed = (cross_entropy * counted).sum()
        loss = loss + (step_weight**step) * summed / counts[step].clamp(min=1)
        with torch.no_grad():
            proposed = draft_to_target[logits[:, :rows].argmax(-1)]
            correct = ((proposed == targets.argmax[:, 1 + step :]) & step_eligible).sum()
            stats[step] = torch.tensor([float(summed), float(counted.sum()), float(correct), float(step_eligible.sum())],
                                       dtype=torch.float64)
    return loss, stats
