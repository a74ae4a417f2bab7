"""Stage 3's capacity plan from params and the prompts prep wrote: the planner's inputs, measured.

The planner (eaglekit.capacity) takes per-partition prompt counts and a planning prompt length; here
they come from the `prompt_tokens` prep measured with the target's tokenizer (p95 per partition).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np

from eaglekit.capacity import CapacityPlan, plan_capacity
from eaglekit.config import Params
from eaglekit.io import read_jsonl
from eaglekit.models import resolve_model


def target_config(params: Params) -> dict:
    """The target's config.json: from params (`target.config`) when given, else from the resolved folder."""
    if params.target.config is not None:
        return dict(params.target.config)
    folder = resolve_model(params.target.model, revision=params.target.revision)
    return json.loads((folder / "config.json").read_text())


def weight_bytes(params: Params) -> int:
    """Weights in memory: `generation.plan.weight_gb`, else the size of the checkpoint's safetensors files."""
    if params.generation.plan.weight_gb is not None:
        return int(params.generation.plan.weight_gb * 1e9)
    folder = resolve_model(params.target.model, revision=params.target.revision)
    files = list(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no safetensors in {folder}: set generation.plan.weight_gb")
    return sum(path.stat().st_size for path in files)


def plan_generation(params: Params, prompts: list[tuple[str, str, Path]], planning_quantile: float = 0.95) -> CapacityPlan:
    """Capacity plan for this run's partitions (prompt length = the partition's p95 prompt tokens)."""
    lengths: dict[str, list[int]] = defaultdict(list)
    for _dataset, partition, path in prompts:
        for _line, record in read_jsonl(path):
            lengths[partition].append(int(record["meta"]["prompt_tokens"]))
    partitions = [
        {
            "name": partition.name,
            "prompts": len(lengths[partition.name]),
            "prompt_tokens": int(np.quantile(lengths[partition.name], planning_quantile)) if lengths[partition.name] else 0,
            "max_tokens": partition.max_tokens,
            "concurrency": partition.concurrency,
        }
        for partition in params.generation.partitions
    ]
    total_tokens = sum(sum(values) for values in lengths.values()) + sum(
        len(lengths[partition["name"]]) * partition["max_tokens"] for partition in partitions
    )
    plan = params.generation.plan
    return plan_capacity(
        target_config(params), gpu_memory_bytes=int(plan.gpu_memory_gb * 1e9), memory_fraction=plan.memory_fraction,
        weight_bytes=weight_bytes(params), partitions=partitions, tensor_parallel=plan.tensor_parallel,
        kv_dtype=plan.kv_dtype, expected_total_tokens=total_tokens,
    )
