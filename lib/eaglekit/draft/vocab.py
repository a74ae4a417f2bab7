"""Draft vocabulary: the N most frequent target tokens among the tokens the target generated.

The draft's lm_head covers only these N tokens; serving maps a draft id d to target id d + d2t[d]
(SGLang `hot_token_id`, vLLM `draft_id_to_target_id`). A target token outside the draft vocab can
never be proposed, so coverage (the share of generated tokens inside the vocab) caps acceptance.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

DEFAULT_DRAFT_VOCAB_SIZE = 32_000


@dataclass(frozen=True)
class DraftVocab:
    """draft_to_target (Vd,) int64 ascending target ids; d2t (Vd,) int64 = target_id - draft_id;
    t2d (V,) bool; coverage = share of counted tokens inside the vocab."""

    draft_to_target: torch.Tensor
    d2t: torch.Tensor
    t2d: torch.Tensor
    coverage: float
    counted_tokens: int

    @property
    def size(self) -> int:
        return int(self.draft_to_target.shape[0])


def default_draft_vocab_size(target_vocab_size: int) -> int:
    """32,000, or the target's whole vocab when it is smaller."""
    return min(DEFAULT_DRAFT_VOCAB_SIZE, target_vocab_size)


def count_generated_tokens(samples: Iterable[dict], vocab_size: int) -> torch.Tensor:
    """Frequency of each target token at loss_mask == 1 over `samples`; (V,) int64.

    Each sample needs "input_ids" (T,) and "loss_mask" (T,).
    """
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for index, sample in enumerate(samples):
        input_ids = torch.as_tensor(sample["input_ids"], dtype=torch.int64)
        loss_mask = torch.as_tensor(sample["loss_mask"]).bool()
        if input_ids.shape != loss_mask.shape:
            raise ValueError(f"sample {sample.get('id', index)!r}: input_ids {tuple(input_ids.shape)} and loss_mask "
                             f"{tuple(loss_mask.shape)} differ")
        generated = input_ids[loss_mask]
        if generated.numel() and int(generated.max()) >= vocab_size:
            raise ValueError(f"sample {sample.get('id', index)!r}: token id {int(generated.max())} >= vocab_size {vocab_size}; "
                             "wrong target?")
        counts += torch.bincount(generated, minlength=vocab_size)
    return counts


def select_draft_vocab(token_counts: torch.Tensor, draft_vocab_size: int) -> DraftVocab:
    """Keep the `draft_vocab_size` most frequent tokens (ties: lower id first).

    token_counts (V,) -> DraftVocab. When fewer tokens were seen than the vocab holds, the rest of the
    slots go to the lowest unseen ids (zero counts sort by id), so lm_head keeps its declared size;
    coverage is unaffected because those tokens never occurred.
    """
    vocab_size = int(token_counts.shape[0])
    if not 1 <= draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} must be in [1, {vocab_size}] (the target vocab)")
    # Stable sort on -count keeps lower ids first among equal counts.
    order = torch.sort(-token_counts, stable=True).indices
    draft_to_target = torch.sort(order[:draft_vocab_size]).values.to(torch.int64)
    d2t = draft_to_target - torch.arange(draft_vocab_size, dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_to_target] = True
    total = int(token_counts.sum())
    covered = int(token_counts[draft_to_target].sum())
    return DraftVocab(draft_to_target=draft_to_target, d2t=d2t, t2d=t2d, coverage=covered / total if total else 0.0, counted_tokens=total)


def coverage_curve(token_counts: torch.Tensor, sizes: Iterable[int]) -> dict[int, float]:
    """Share of counted tokens covered by the top-n vocab, for each n in `sizes` (for the coverage plot)."""
    sorted_counts = torch.sort(token_counts, descending=True).values
    cumulative = torch.cumsum(sorted_counts, 0)
    total = int(cumulative[-1]) if cumulative.numel() else 0
    return {int(n): (int(cumulative[min(n, len(cumulative)) - 1]) / total if total and n > 0 else 0.0) for n in sizes}
