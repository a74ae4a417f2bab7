"""Non-finite guards: a NaN or inf in captured features, a step's loss or gradient, or a draft's weights
stops training or scoring, naming the sample, its shard file and the step.

NaN spreads without raising anything. One NaN feature makes the step's loss NaN, AdamW then makes every
weight NaN, and torch's argmax takes NaN for the maximum, so a NaN draft proposes one token everywhere.
That token can match the target by accident: a run logged `loss nan` and reported held-out tau 3.0, the
maximum its chain allows. So the loop checks each batch's features and each step's loss and gradient
norm before the optimizer steps (the checkpoints keep the weights from before the fault), and held-out
scoring refuses a draft whose weights or logits are not finite. On the device each check is one
reduction per batch. The flag is read in the same host sync as the step's loss, so the checks add no sync.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from eaglekit.training.prefetch import SerializedSamples
from eaglekit.training.split import IndexedSubset

FEATURES = ("aux_hidden_states", "final_hidden_states")
RECAPTURE = ("recapture it (delete that shard and rerun the capture into this folder: it captures a missing shard's samples "
             "again) or leave the sample out")


class NonFiniteError(RuntimeError):
    """Training or scoring met a NaN or inf. The message says where: the sample, the shard, the step or the
    tensor."""


def all_finite(*tensors: torch.Tensor) -> torch.Tensor:
    """A bool scalar on the tensors' device, true when every entry is finite. Reading it is the caller's
    sync."""
    return torch.stack([torch.isfinite(tensor).all() for tensor in tensors]).all()


def first_non_finite(sample: dict) -> str | None:
    """Where a sample's first non-finite feature is (`aux_hidden_states at token 5 (nan)`), or None when all
    are finite."""
    for name in FEATURES:
        bad = ~torch.isfinite(sample[name])  # (T, F)
        if bad.any():
            token = int(bad.any(dim=-1).nonzero()[0])
            value = float(sample[name][token][bad[token]][0])
            return f"{name} at token {token} ({value})"
    return None


def sample_source(samples: Sequence[dict], sample: dict) -> str | None:
    """The shard file a sample's features were read from; None when they come from no file (online, in
    memory)."""
    from eaglekit.capture.shards import ShardDataset

    source = samples
    while isinstance(source, (IndexedSubset, SerializedSamples)):
        source = source.samples
    if isinstance(source, ShardDataset):
        for record in source.samples:
            if str(record["id"]) == str(sample["id"]) and record["dataset"] == sample.get("dataset"):
                return str(source.output_dir / record["shard"])
    return None


def raise_for_features(read: Iterable[dict], samples: Sequence[dict], where: str) -> None:
    """Raise NonFiniteError naming the first sample of `read` whose features hold a NaN or inf (nothing when
    none does). samples: what they were read from (`sample_source` finds the shard)."""
    for sample in read:
        problem = first_non_finite(sample)
        if problem is not None:
            shard = sample_source(samples, sample)
            raise NonFiniteError(f"{where}: sample {sample.get('dataset', '')}/{sample['id']}{f' in shard {shard}' if shard else ''} holds "
                                 f"a non-finite feature, {problem}. Training on it would turn every weight into NaN; "
                                 f"{RECAPTURE if shard else 'fix the features this sample was given'}")


def check_step(step: int, loss: float, gradient_norm: float, non_finite_batches: int, read: Sequence[Sequence[dict]],
               samples: Sequence[dict]) -> None:
    """Before optimizer step `step`: its features (`non_finite_batches`: micro-batches over all ranks with a
    non-finite one), its loss and its gradient norm must be finite. read: this rank's micro-batches."""
    flat = [sample for micro_batch in read for sample in micro_batch]
    if non_finite_batches:
        raise_for_features(flat, samples, f"step {step}")
        raise NonFiniteError(f"step {step}: another rank's batch holds a non-finite feature (that rank's error names the sample)")
    if not (math.isfinite(loss) and math.isfinite(gradient_norm)):
        ids = ", ".join(f"{sample.get('dataset', '')}/{sample['id']}" for sample in flat[:8])
        raise NonFiniteError(f"step {step}: loss {loss}, gradient norm {gradient_norm} on finite features (samples {ids}): training "
                             "diverged. The optimizer did not step, so last.pt and best.pt hold the weights from before; "
                             "lower training.learning_rate or training.grad_clip and train this size again")


def non_finite_weights(model: torch.nn.Module) -> list[str]:
    """Names of the model's floating-point parameters and buffers that hold a NaN or inf."""
    return [name for name, tensor in model.state_dict().items() if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())]


def require_finite_draft(model: torch.nn.Module, where: str) -> None:
    """Refuse to score a draft whose weights hold a NaN or inf: its argmax is index 0 everywhere, so any tau
    from it is fake."""
    bad = non_finite_weights(model)
    if bad:
        raise NonFiniteError(f"{where}: the draft's weights {bad[:6]}{' ...' if len(bad) > 6 else ''} hold NaN or inf, so no "
                             "accept length is computed from it (a NaN draft proposes one token everywhere and can match the "
                             "target by accident); use an earlier checkpoint or train it again")
