"""Several processes, one draft: the torchrun process group, the wrapped model, per-rank packs, gradient sync.

DDP replicates the draft (gloo on CPU, nccl on GPU); FSDP (GPU only) shards the layer and the head.
Every rank calls `train_draft` with the same arguments; rank 0 logs and writes.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

from eaglekit.config import TrainingParams
from eaglekit.draft.model import Eagle3DraftModel
from eaglekit.training.batch import Batch
from eaglekit.training.packing import empty_pack, packed_micro_batches


@dataclass
class Distributed:
    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launched_world() -> tuple[int, int]:
    """(rank, world size) torchrun gave this process; (0, 1) outside torchrun."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def local_device(device: str) -> str:
    """This process's device: under torchrun a CUDA device is the GPU of its LOCAL_RANK (capture and training
    alike); otherwise `device` as configured."""
    if device.startswith("cuda") and "RANK" in os.environ:
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return device


def setup_distributed(parallel: str, device: torch.device) -> Distributed:
    """Join the torchrun process group for "ddp"/"fsdp" (gloo on CPU, nccl on GPU); "none" is one process."""
    if parallel == "none":
        return Distributed()
    if parallel not in ("ddp", "fsdp"):
        raise ValueError(f"parallel={parallel!r}: use 'none', 'ddp' or 'fsdp'")
    if parallel == "fsdp" and device.type != "cuda":
        raise ValueError("parallel='fsdp' is for GPU drafts too large to replicate; on CPU use 'ddp'")
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            raise RuntimeError(f"parallel={parallel!r} needs torchrun (RANK/WORLD_SIZE unset); "
                               "run `torchrun --nproc-per-node N ...` or use 'none'")
        if device.type == "cuda":
            dist.init_process_group(backend="nccl", device_id=device)
        else:
            dist.init_process_group(backend="gloo")
    return Distributed(rank=dist.get_rank(), world_size=dist.get_world_size())


def wrap_model(model: Eagle3DraftModel, parallel: str, device: torch.device, activation_checkpointing: bool = False) -> torch.nn.Module:
    """DDP replicates the draft; FSDP (torch's fully_shard) shards the layer and the head across GPUs.

    activation_checkpointing: the forward the loop calls checkpoints each TTT step
    (eaglekit.training.unroll.CheckpointedDraft, the draft's parameters unchanged); DDP wraps that.
    """
    if activation_checkpointing:
        if parallel == "fsdp":
            raise ValueError("activation checkpointing under parallel='fsdp' is not wired yet (FSDP's root must be the draft itself): "
                             "use parallel='ddp' with activation checkpointing, or fsdp without it")
        from eaglekit.training.unroll import CheckpointedDraft

        model = CheckpointedDraft(model)
    if parallel == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model.midlayer)
        fully_shard(model.lm_head)
        fully_shard(model)
    return model


def rank_packs(samples: Sequence[dict], training: TrainingParams, device: torch.device) -> list[Batch]:
    """This rank's samples of one step as packs of training.pack_tokens (eaglekit.training.packing).

    Ranks may need different numbers of packs. DDP syncs gradients once per step, so that is fine;
    FSDP all-gathers weights in every forward, so under FSDP all ranks agree on the largest count
    and the others add empty packs (no counted rows, zero gradient).
    """
    packs = packed_micro_batches(samples, training.pack_tokens, training.max_length, fixed_length=device.type == "cuda")
    if training.parallel == "fsdp":
        count = torch.tensor([len(packs)], device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        packs += [empty_pack(packs[0]) for _ in range(int(count) - len(packs))]
    return packs


def gradient_sync(wrapped: torch.nn.Module, parallel: str, enabled: bool) -> AbstractContextManager:
    """Skip the gradient all-reduce on all but the last micro-batch of an accumulation."""
    if parallel == "ddp" and not enabled:
        return wrapped.no_sync()
    if parallel == "fsdp":
        wrapped.set_requires_gradient_sync(enabled)
    return nullcontext()


def full_state_dicts(model: Eagle3DraftModel, optimizer: torch.optim.Optimizer, parallel: str) -> tuple[dict, dict]:
    """(model, optimizer) state on the host, whole (FSDP gathers its shards); the frozen target embeddings
    left out."""
    if parallel == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state = get_model_state_dict(model, options=options)
        model_state = {name: tensor for name, tensor in model_state.items() if not name.startswith("embed_tokens.")}
        return model_state, get_optimizer_state_dict(model, optimizer, options=options)
    return {name: tensor.detach().cpu() for name, tensor in model.trainable_state_dict().items()}, optimizer.state_dict()
