"""The teacher: the target's distribution over the draft vocab at every position, and its greedy token.

At TTT step i, row t predicts the token at t+2+i; its teacher is the target distribution at position
t+1+i restricted to the draft vocab (softmax over the draft-vocab columns of the target logits), or with
`distill="argmax"` the one-hot of the target's greedy token. Rows whose target argmax is outside the
draft vocab add no loss (`TargetSignals.in_draft`).

The target's greedy token (an argmax over the full target vocab, the costliest part of the teacher)
never changes for a sample: `TargetArgmaxCache` computes it once per sample for a whole sweep, the
training teacher then needs only the draft-vocab rows of the head, and held-out evaluations only the
draft. Results equal the recomputing path (`train_draft(target_cache=False)`) to float tolerance.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

DISTILL_TARGETS = ("soft", "argmax")


@dataclass
class TargetSignals:
    """Teacher at every position. probs (B, T, Vd) float32 over the draft vocab; argmax (B, T) target ids;
    in_draft (B, T): the target argmax is a draft-vocab token."""

    probs: torch.Tensor
    argmax: torch.Tensor
    in_draft: torch.Tensor


@torch.no_grad()
def target_signals(final_hidden_states: torch.Tensor, target_lm_head: torch.Tensor, draft_to_target: torch.Tensor, t2d: torch.Tensor,
                   chunk_rows: int = 1024, lengths: Sequence[int] | None = None, distill: str = "soft",
                   target_argmax: torch.Tensor | None = None, draft_lm_head: torch.Tensor | None = None) -> TargetSignals:
    """final (B, T, H) @ lm_head (V, H)^T -> draft-vocab teacher, `chunk_rows` rows at a time.

    distill "soft": probs = softmax over the draft-vocab columns of the target logits. "argmax": probs =
    one-hot of the best draft-vocab column, which is the target's greedy token wherever that token is in
    the draft vocab (the only rows that count, `in_draft`), so the loss is cross-entropy on hard labels.

    The full-vocab logits exist for one chunk only ((chunk, V) instead of (B, T, V): 2.7 GB for a 4K
    pack of a 163,840-token vocab). Pass an fp32 head to skip a per-call cast. lengths (host ints, one
    per row): only each row's first lengths[b] positions are computed (padding and pack tails are no
    target of any counted row); the rest hold zeros.

    target_argmax (B, T): the target's greedy token, known beforehand (`TargetArgmaxCache.batch_argmax`,
    0 past each row's length as here). With it, draft_lm_head (Vd, H) = lm_head[draft_to_target] replaces
    the full head: the teacher needs only the draft-vocab logits, Vd/V of the work (1/6 for the demo).
    """
    if distill not in DISTILL_TARGETS:
        raise ValueError(f"distill={distill!r}: use one of {list(DISTILL_TARGETS)}")
    batch, length, hidden = final_hidden_states.shape
    if draft_lm_head is not None and target_argmax is None:
        raise ValueError("draft_lm_head needs target_argmax: the draft-vocab rows alone cannot give the target's greedy token")
    if target_argmax is not None and target_argmax.shape != (batch, length):
        raise ValueError(f"target_argmax shape {tuple(target_argmax.shape)} != final_hidden_states' (B, T) {(batch, length)}")
    head = (target_lm_head if draft_lm_head is None else draft_lm_head).float()
    flat = final_hidden_states.reshape(batch * length, hidden)
    probs = torch.zeros(batch * length, draft_to_target.shape[0], dtype=torch.float32, device=flat.device)
    argmax = torch.zeros(batch * length, dtype=torch.int64, device=flat.device)
    for row in range(batch):
        stop = row * length + (length if lengths is None else int(lengths[row]))
        for start in range(row * length, stop, chunk_rows):
            end = min(start + chunk_rows, stop)
            logits = flat[start:end].float() @ head.T  # (chunk, V), or (chunk, Vd) with draft rows only
            if target_argmax is None:
                argmax[start:end] = logits.argmax(-1)
            draft_logits = logits if draft_lm_head is not None else logits[:, draft_to_target]  # (chunk, Vd)
            if distill == "argmax":
                probs[start:end].scatter_(1, draft_logits.argmax(-1, keepdim=True), 1.0)
            else:
                probs[start:end] = torch.softmax(draft_logits, dim=-1)
    argmax = argmax.view(batch, length) if target_argmax is None else target_argmax.to(flat.device)
    return TargetSignals(probs=probs.view(batch, length, -1), argmax=argmax, in_draft=t2d[argmax])


class TargetArgmaxCache:
    """The target's greedy token at every position of a sample, computed once per distinct sample.

    The argmax over the full target vocab ((T, H) @ (V, H)^T, 28M multiply-adds per token for
    SmolLM2-135M) depends only on the sample's final hidden states and the head, neither of which
    changes while drafts train: held-out samples are scored at every evaluation and training samples
    come back every epoch, so `train_draft` and `train_size_sweep` compute it once per sample here.
    The key is a digest of the (cut) final hidden states themselves, not the sample id: samples are
    read anew from shards at each access, and one id can name different contents (the ablation's
    original and regenerated answers). One cache serves one head (`bind`).
    """

    def __init__(self, target_lm_head: torch.Tensor, chunk_rows: int = 1024):
        self.head = target_lm_head.detach().float()  # (V, H)
        self.chunk_rows = chunk_rows
        self._argmax: dict[bytes, torch.Tensor] = {}  # digest -> (L,) int64 on the host
        self.hits = self.misses = 0

    def bind(self, target_lm_head: torch.Tensor) -> None:
        """Refuse a head other than the one the cached argmaxes came from; compute new ones on its device
        (train_draft's rank device, while the sweep built the cache from the head it was given)."""
        head = target_lm_head.detach().float()
        if head.shape != self.head.shape or not torch.equal(head.to(self.head.device), self.head):
            raise ValueError(f"TargetArgmaxCache holds argmaxes of another target head ({tuple(self.head.shape)}): "
                             "build one cache per target")
        self.head = head

    @staticmethod
    def key(final_hidden_states: torch.Tensor) -> bytes:
        """Digest of (L, H) states: dtype, shape and every byte."""
        states = final_hidden_states.detach().cpu().contiguous()
        digest = hashlib.blake2b(states.view(-1).view(torch.uint8).numpy().tobytes(), digest_size=20)
        digest.update(f"{states.dtype}{tuple(states.shape)}".encode())
        return digest.digest()

    @torch.no_grad()
    def argmax(self, sample: dict, max_length: int) -> torch.Tensor:
        """(L,) int64 on the host, L = min(len(sample), max_length): the target's argmax at each position."""
        final = sample["final_hidden_states"][:max_length]  # (L, H)
        key = self.key(final)
        cached = self._argmax.get(key)
        if cached is not None:
            self.hits += 1
            return cached
        self.misses += 1
        states = final.to(self.head.device, torch.float32)
        # (chunk, V) -> (chunk,)
        tokens = torch.cat([(states[start : start + self.chunk_rows] @ self.head.T).argmax(-1)
                            for start in range(0, states.shape[0], self.chunk_rows)]).cpu()
        self._argmax[key] = tokens
        return tokens

    def batch_argmax(self, samples: Sequence[dict], max_length: int) -> torch.Tensor:
        """(B, T) for `collate(samples, max_length)`: row b holds sample b's argmax, then 0 (the padding's, as
        uncached)."""
        return torch.nn.utils.rnn.pad_sequence([self.argmax(sample, max_length) for sample in samples], batch_first=True)


@dataclass
class Teacher:
    """The target's head as one training run's teacher, on the run's device.

    target_lm_head (V, H) fp32 (cast once, not per micro-batch); draft_to_target (Vd,) and t2d (V,) from the
    draft; with a `TargetArgmaxCache`, draft_lm_head (Vd, H) = target_lm_head[draft_to_target]: padded
    micro-batches then take their teacher from the draft-vocab rows only (packs still use the full head).
    """

    target_lm_head: torch.Tensor
    draft_to_target: torch.Tensor
    t2d: torch.Tensor
    cache: TargetArgmaxCache | None = None
    draft_lm_head: torch.Tensor | None = None

    @classmethod
    def for_draft(cls, draft_to_target: torch.Tensor, t2d: torch.Tensor, target_lm_head: torch.Tensor, device: torch.device,
                  target_cache: TargetArgmaxCache | bool) -> "Teacher":
        """target_cache: True, a new cache; a cache, shared (bound to this head); False, recompute every
        argmax."""
        head = target_lm_head.to(device, torch.float32)
        cache = TargetArgmaxCache(head) if target_cache is True else (target_cache or None)
        if cache is not None:
            cache.bind(head)
        draft_lm_head = head[draft_to_target.to(device)].contiguous() if cache is not None else None
        return cls(head, draft_to_target, t2d, cache, draft_lm_head)

    def signals(self, final_hidden_states: torch.Tensor, lengths: Sequence[int], distill: str,
                samples: Sequence[dict] | None, max_length: int) -> TargetSignals:
        """The teacher of one micro-batch: final (B, T, H) on the device, lengths host ints (B,).
        samples: a padded micro-batch's samples in row order (their cached argmax lines up with collate's
        layout), None for a pack."""
        known = self.cache.batch_argmax(samples, max_length) if self.cache is not None and samples is not None else None
        return target_signals(final_hidden_states, self.target_lm_head, self.draft_to_target, self.t2d, lengths=lengths,
                              distill=distill, target_argmax=known, draft_lm_head=self.draft_lm_head if known is not None else None)
