"""Stage 3's capacity plan from params and the prompts prep wrote: the planner's inputs, measured.

The planner (eaglekit.generation.capacity) takes per-partition prompt counts, a planning prompt length and, to
plan from real lengths rather than the worst case, length distributions. Here they are measured:
- prompt lengths: the `prompt_tokens` prep counted with the target's tokenizer (p95 per partition
  for the worst case, the whole distribution for the length plan);
- completion lengths, first found of: a pilot run's generation folder (`generation.plan.pilot_dir`:
  the target's own answers, paired with their prompts as the server counted them, and the pilot's
  measured request rate for the ETA); the datasets' own answers (prep's `original_tokenized_data.jsonl`,
  tokens at loss_mask 1; a thinking target usually answers longer than the datasets did); else none,
  and the plan is the worst case.
A pilot's answers must be a finished sample: the first minutes of a big run over-represent short
answers (they finish first).
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from eaglekit.generation.capacity import CapacityPlan, plan_capacity
from eaglekit.config import Params, repo_path
from eaglekit.generation.logs import generation_table
from eaglekit.generation.server import EMBEDDED_ENDPOINT
from eaglekit.io import read_jsonl
from eaglekit.target import resolve_model


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


def known_kv_pool(params: Params) -> tuple[int | None, str]:
    """The server's KV pool per rank in tokens when params know it (None: planned from GPU memory), and where
    the figure comes from.

    The embedded server's pool is its own bounded `server.kv_cache_tokens`, not a GPU's memory. It serves when
    params name no endpoint (the params file `eaglekit plan` reads) or only the one `serving_endpoints` started
    for it (what the runner hands stage 3's notebook).
    """
    settings = params.generation.plan
    if settings.kv_pool_tokens is not None:
        return settings.kv_pool_tokens, "generation.plan.kv_pool_tokens"
    if params.server.embedded and all(endpoint.name == EMBEDDED_ENDPOINT for endpoint in params.endpoints):
        return params.server.kv_cache_tokens, "server.kv_cache_tokens (the embedded server)"
    return None, "generation.plan: gpu_memory_gb x memory_fraction less the weights, per rank"


def capacity_plan(params: Params, config: dict, partitions: list[dict[str, Any]], **measured: Any) -> CapacityPlan:
    """`plan_capacity` on params `generation.plan`'s hardware and the pool `known_kv_pool` finds: the one mapping
    `eaglekit plan` and stage 3 share. measured: plan_capacity's expected_total_tokens and
    measured_requests_per_second."""
    settings = params.generation.plan
    pool_tokens, _source = known_kv_pool(params)
    return plan_capacity(
        config, gpu_memory_bytes=int(settings.gpu_memory_gb * 1e9), memory_fraction=settings.memory_fraction,
        weight_bytes=weight_bytes(params) if pool_tokens is None else 0, partitions=partitions,
        tensor_parallel=settings.tensor_parallel, kv_dtype=settings.kv_dtype, page_size=settings.page_size,
        retraction_risk=settings.retraction_risk, kv_pool_tokens=pool_tokens, **measured)


@dataclass(frozen=True)
class MeasuredLengths:
    """Length samples of one partition and where they came from; a pilot's measured rate."""

    prompt_tokens: list[int]
    completion_tokens: list[int]
    source: str
    requests_per_second: float | None = None   # a pilot's, at the pilot's own concurrency


def pilot_lengths(generation_dir: str | Path) -> dict[str, MeasuredLengths]:
    """Per partition, the pilot's (prompt, completion) token counts as the server reported them, and
    its request rate: answers / (last finish - first start)."""
    table = generation_table(generation_dir)
    rows = [row for row in (dict(zip(table, values)) for values in zip(*table.values()))
            if isinstance(row.get("completion_tokens"), int) and isinstance(row.get("prompt_tokens"), int)]
    found: dict[str, MeasuredLengths] = {}
    for partition in sorted({row["partition"] for row in rows}):
        chosen = [row for row in rows if row["partition"] == partition]
        started = min(row["finished_at"] - row["latency_s"] for row in chosen)
        span = max(row["finished_at"] for row in chosen) - started
        truncated = sum(bool(row.get("truncated")) for row in chosen) / len(chosen)
        # Answers cut at the pilot's own max_tokens are lower bounds of what the run will generate.
        caveat = f"; {truncated:.0%} cut at the pilot's max_tokens: lengths are a lower bound" if truncated > 0.05 else ""
        found[partition] = MeasuredLengths(
            [row["prompt_tokens"] for row in chosen], [row["completion_tokens"] for row in chosen],
            f"pilot {Path(generation_dir).parent.name or Path(generation_dir).name} ({len(chosen)} answers{caveat})",
            requests_per_second=len(chosen) / span if span > 0 else None)
    return found


def dataset_answer_lengths(prep_dir: str | Path) -> dict[str, MeasuredLengths]:
    """Per partition, (prompt, answer) token counts of the datasets' own answers that prep tokenized."""
    prompts: dict[str, list[int]] = defaultdict(list)
    answers: dict[str, list[int]] = defaultdict(list)
    for path in sorted(Path(prep_dir).glob("*/original_tokenized_data.jsonl")):
        for _line, record in read_jsonl(path):
            meta = record.get("meta") or {}
            if "partition" not in meta or "prompt_tokens" not in meta:
                continue
            prompts[meta["partition"]].append(int(meta["prompt_tokens"]))
            answers[meta["partition"]].append(int(sum(record["loss_mask"])))
    return {partition: MeasuredLengths(prompts[partition], answers[partition],
                                       f"datasets' own answers ({len(answers[partition])})")
            for partition in answers}


def plan_generation(params: Params, prompts: list[tuple[str, str, Path]]) -> CapacityPlan:
    """Capacity plan for this run's partitions from measured lengths (see the module docstring).

    prompts: (dataset, partition, prompts file) from prep; the datasets' own answers are in their grandparent
    folder.
    """
    lengths: dict[str, list[int]] = defaultdict(list)
    for _dataset, partition, path in prompts:
        for _line, record in read_jsonl(path):
            lengths[partition].append(int(record["meta"]["prompt_tokens"]))
    pilot_dir = params.generation.plan.pilot_dir
    measured: dict[str, MeasuredLengths] = pilot_lengths(repo_path(pilot_dir)) if pilot_dir is not None else {}
    if prompts:
        for partition, found in dataset_answer_lengths(Path(prompts[0][2]).parent.parent).items():
            measured.setdefault(partition, found)
    partitions = []
    for partition in params.generation.partitions:
        prompt_lengths = lengths[partition.name]
        spec = {"name": partition.name, "prompts": len(prompt_lengths),
                "prompt_tokens": int(np.quantile(prompt_lengths, 0.95)) if prompt_lengths else 0,
                "max_tokens": partition.max_tokens, "concurrency": partition.concurrency}
        found = measured.get(partition.name)
        if found is not None and prompt_lengths:
            # Paired lengths when they come from the same answers; else this run's prompts with the
            # sampled completions (independent draws).
            paired = found.source.startswith("pilot")
            spec.update(prompt_lengths=found.prompt_tokens if paired else prompt_lengths,
                        completion_lengths=found.completion_tokens, completion_source=found.source)
        partitions.append(spec)
    total_tokens = sum(sum(values) for values in lengths.values()) + sum(
        len(lengths[partition["name"]]) * partition["max_tokens"] for partition in partitions
    )
    rates = {name: found.requests_per_second for name, found in measured.items() if found.requests_per_second}
    return capacity_plan(params, target_config(params), partitions, expected_total_tokens=total_tokens,
                         measured_requests_per_second=rates or None)
