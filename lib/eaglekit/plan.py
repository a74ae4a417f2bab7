"""`eaglekit plan params/X.yaml`: what a run will need, from params alone, before the weights or any data
exist.

Figures, each from the kit's own planners (the same functions the stages call once data is there):
- KV cache per token, exact for the target's attention (MHA/GQA or MLA; eaglekit.generation.capacity), and the
  concurrency each partition's server sustains without preemption at its worst-case sequence;
- hidden-state storage per capture slice (eaglekit.capture.plan.planned_slice_bytes), bf16 and fp8;
- training memory per GPU at the params' pack (eaglekit.training.memory.plan_training_memory);
- generation's GPU hours at the planned throughput;
- the forecast's horizon (analysis.full_data_size) and how many doublings past the largest planned size it is.

Whatever is not in params is an assumption, listed with the plan and where each value came from (a flag of
this command, a params field, or a worst case). The target's shape comes from `target.config` (the planner's
fields of config.json, so a plan works before the checkpoint is on disk), else from the model folder.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from eaglekit.capture.plan import planned_slice_bytes
from eaglekit.capture.shards import stored_bytes_per_token
from eaglekit.capture.inputs import capture_length
from eaglekit.config import Params
from eaglekit.generation.capacity import load_model_config
from eaglekit.generation.plan import capacity_plan, known_kv_pool, target_config
from eaglekit.training.memory import draft_config_for_target, plan_training_memory


@dataclass(frozen=True)
class Assumption:
    """A figure the plan rests on that params do not state, and where the value came from."""

    name: str
    value: float
    source: str


@dataclass
class RunPlan:
    """The plan's figures (`as_dict` for JSON) and the assumptions behind them."""

    target: dict[str, Any]
    capacity: dict[str, Any]
    slices: dict[str, list[dict[str, Any]]]
    training_memory: dict[str, Any]
    generation: dict[str, Any]
    horizon: dict[str, Any]
    assumptions: list[Assumption] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _worst_prompt_tokens(params: Params, partition: str) -> int:
    """The longest prompt prep admits to a partition: short up to prep.long_prompt_threshold, long up to the
    context (prep rejects a prompt of context_length tokens or more)."""
    longest = params.prep.context_length - 1
    return min(params.prep.long_prompt_threshold, longest) if partition == "short" else longest


def _prompt_count(params: Params, prompts: int | None) -> Assumption:
    if prompts is not None:
        return Assumption("prompts", prompts, "--prompts")
    limits = [dataset.limit for dataset in params.datasets if dataset.data_class == "B"]
    if limits and all(limit is not None for limit in limits):
        return Assumption("prompts", sum(limits), "the class-B datasets' `limit`s (an upper bound: prep drops some)")
    horizon = params.analysis.full_data_size or params.training.heldout_size + params.training.data_sizes[-1]
    return Assumption("prompts", horizon, "analysis.full_data_size (an upper bound: it counts class A too)")


def _capacity(params: Params, config: dict) -> tuple[dict[str, Any], dict[str, int]]:
    """Per-partition worst-case concurrency on one server; also {partition: recommended concurrency}."""
    partitions = [{"name": partition.name, "prompts": 0, "max_tokens": partition.max_tokens,
                   "prompt_tokens": _worst_prompt_tokens(params, partition.name),
                   "concurrency": partition.concurrency} for partition in params.generation.partitions]
    plan = capacity_plan(params, config, partitions)
    figures = {"attention": plan.attention, "kv_dtype": plan.kv_dtype, "kv_bytes_per_token": plan.kv_bytes_per_token,
               "kv_bytes_per_token_per_rank": plan.kv_bytes_per_token_per_rank, "naive_estimates": plan.naive_estimates,
               "kv_pool_tokens": plan.kv_pool_tokens, "kv_pool_source": known_kv_pool(params)[1],
               "partitions": plan.table()}
    return figures, {row.partition: row.recommended_concurrency for row in plan.partitions}


# One stream's decode rate when the params give none: the seed's Kimi-K2.5 plain decode on 8 GPUs (90 tok/s),
# an assumption the plan prints as one; analysis.baseline_tokens_per_s or --server-tokens-per-s replaces it.
ASSUMED_STREAM_TOKENS_PER_S = 90.0


def _generation_hours(params: Params, prompts: Assumption, answer_tokens: Assumption, server_tokens_per_s: Assumption) -> dict:
    servers = max(1, len(params.endpoints))
    gpus_per_server = params.generation.plan.tensor_parallel
    tokens = prompts.value * answer_tokens.value
    wall_hours = tokens / (server_tokens_per_s.value * servers) / 3600
    return {"answer_tokens": tokens, "servers": servers, "gpus_per_server": gpus_per_server,
            "wall_hours": wall_hours, "gpu_hours": wall_hours * servers * gpus_per_server}


def _training_memory(params: Params, config: dict) -> dict[str, Any]:
    training = params.training
    cuda = training.device.startswith("cuda")
    vocab = training.draft_vocab_size or min(32_000, int(load_model_config(config)["vocab_size"]))
    plan = plan_training_memory(
        draft_config_for_target(config, vocab, shape=training.draft_shape),
        gpu_memory_bytes=int(params.generation.plan.gpu_memory_gb * 1e9),
        pack_tokens=training.pack_tokens or training.max_length * training.micro_batch_size,
        ttt_steps=training.ttt_steps, world_size=training.nproc_per_node,
        parallel="fsdp" if training.parallel == "fsdp" else "ddp",
        attention="flex" if training.attention == "flex" or (training.attention == "auto" and cuda) else "eager",
        dtype="bf16" if cuda else "fp32", activation_checkpointing=training.activation_checkpointing)
    return plan.as_dict()


def plan_run(params: Params, *, prompts: int | None = None, tokens_per_sample: float | None = None,
             answer_tokens: float | None = None, server_tokens_per_s: float | None = None) -> RunPlan:
    """The whole run's plan from params; the keyword arguments replace the assumptions named after them."""
    config = target_config(params)
    text = load_model_config(config)
    capture_cap = capture_length(params)
    prompt_count = _prompt_count(params, prompts)
    short = params.generation.partitions[0]
    answers = Assumption("answer_tokens", answer_tokens, "--answer-tokens") if answer_tokens is not None else \
        Assumption("answer_tokens", short.max_tokens, f"generation.partitions[0].max_tokens ({short.name}): every "
                   "answer at its budget, an upper bound; a pilot run measures it")
    per_sample = Assumption("tokens_per_sample", tokens_per_sample, "--tokens-per-sample") if tokens_per_sample is not None \
        else Assumption("tokens_per_sample", capture_cap, "min(capture.max_seq_len, training.max_length): every sample "
                        "at the capture cap, an upper bound")
    capacity, recommended = _capacity(params, config)
    concurrency = recommended.get(short.name) or short.concurrency
    stream = params.analysis.baseline_tokens_per_s
    stream_source = f"analysis.baseline_tokens_per_s ({stream:g}, one stream)" if stream is not None else \
        f"{ASSUMED_STREAM_TOKENS_PER_S:g} tok/s a stream (the seed's Kimi-K2.5 plain decode; analysis.baseline_tokens_per_s unset)"
    throughput = Assumption("server_tokens_per_s", server_tokens_per_s, "--server-tokens-per-s") \
        if server_tokens_per_s is not None else Assumption(
            "server_tokens_per_s", concurrency * (stream or ASSUMED_STREAM_TOKENS_PER_S),
            f"{concurrency} in flight ({short.name}'s concurrency) x {stream_source}: optimistic, batched streams decode slower")
    sizes, heldout = params.training.data_sizes, params.training.heldout_size
    full = params.analysis.full_data_size
    total = max(full or 0, heldout + sizes[-1])
    hidden = int(text["hidden_size"])
    slices = {dtype: planned_slice_bytes(sizes, heldout, total, min(per_sample.value, capture_cap), hidden, dtype)
              for dtype in ("bf16", "fp8")}
    horizon = {"full_data_size": full, "largest_size": sizes[-1],
               "doublings_past_largest": None if full is None else round(math.log2(full / sizes[-1]), 2),
               "source": "analysis.full_data_size" if full else "unset: the forecast stops at the largest size"}
    target = {"model": params.target.model, "config_source": "target.config" if params.target.config else "the model folder",
              "num_hidden_layers": int(text["num_hidden_layers"]), "hidden_size": hidden,
              "vocab_size": int(text["vocab_size"]),
              "stored_bytes_per_token": {dtype: stored_bytes_per_token(hidden, dtype) for dtype in ("bf16", "fp8")}}
    return RunPlan(target=target, capacity=capacity, slices=slices, training_memory=_training_memory(params, config),
                   generation=_generation_hours(params, prompt_count, answers, throughput), horizon=horizon,
                   assumptions=[prompt_count, answers, per_sample, throughput, Assumption(
                       "training_gpu_memory_gb", params.generation.plan.gpu_memory_gb,
                       "generation.plan.gpu_memory_gb: training GPUs like the serving ones")])


def _bytes(value: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if value >= scale:
            return f"{value / scale:,.2f} {unit}"
    return f"{value:,.0f} B"


def _hours(hours: float) -> str:
    return f"{hours:,.1f} h" if hours >= 1 else f"{hours * 60:,.1f} min"


def format_plan(plan: RunPlan) -> str:
    """The plan as the lines `eaglekit plan` prints."""
    target, capacity, generation = plan.target, plan.capacity, plan.generation
    lines = [f"target {target['model']} ({target['config_source']}): {target['num_hidden_layers']} layers, "
             f"hidden {target['hidden_size']}, vocab {target['vocab_size']:,}",
             f"KV cache: {capacity['kv_bytes_per_token']:,} B/token ({capacity['attention']}, {capacity['kv_dtype']}); "
             f"{capacity['kv_bytes_per_token_per_rank']:,} B/token per rank; pool {capacity['kv_pool_tokens']:,} tokens "
             f"per rank ({capacity['kv_pool_source']})"]
    for row in capacity["partitions"]:
        lines.append(f"  {row['partition']}: worst case {row['tokens_per_sequence']:,} tokens a sequence "
                     f"({row['prompt_tokens']:,} prompt + {row['max_tokens']:,} answer): {row['sequences_that_fit']:,} fit; "
                     f"params ask {row['requested_concurrency']}, sustained {row['recommended_concurrency']} ({row['reason']})")
    lines.append(f"generation: {generation['answer_tokens']:,.0f} answer tokens on {generation['servers']} server(s) x "
                 f"{generation['gpus_per_server']} GPU(s): {_hours(generation['wall_hours'])} wall, "
                 f"{_hours(generation['gpu_hours'])} of GPU time")
    lines.append(f"capture storage per slice (bytes per token: bf16 {target['stored_bytes_per_token']['bf16']:,}, "
                 f"fp8 {target['stored_bytes_per_token']['fp8']:,}):")
    for bf16, fp8 in zip(plan.slices["bf16"], plan.slices["fp8"]):
        label = f"size {bf16['size']:,}" if bf16["size"] is not None else "untrained rest"
        lines.append(f"  {label:>16}: {bf16['samples']:>8,} samples  bf16 {_bytes(bf16['bytes']):>11} "
                     f"(disk {_bytes(bf16['cumulative_bytes'])})  fp8 {_bytes(fp8['bytes']):>11}")
    memory = plan.training_memory
    usable = memory["gpu_memory_bytes"] * memory["memory_fraction"]
    lines.append(f"training memory per GPU: {_bytes(memory['total_bytes'])} of {_bytes(usable)} usable "
                 f"at a {memory['pack_tokens']:,}-token pack ({memory['parallel']} x {memory['world_size']}, "
                 f"{memory['attention']}, {memory['dtype']}, checkpointing {'on' if memory['activation_checkpointing'] else 'off'}): "
                 f"{'fits' if memory['fits'] else 'does NOT fit'}; largest pack {memory['largest_pack_tokens']:,} tokens")
    horizon = plan.horizon
    lines.append(f"forecast horizon: {horizon['full_data_size'] or horizon['largest_size']:,} samples ({horizon['source']})"
                 + ("" if horizon["doublings_past_largest"] is None else
                    f", {horizon['doublings_past_largest']:g} doublings past the largest size {horizon['largest_size']:,}"))
    lines.append("assumed (not in params):")
    lines.extend(f"  {assumption.name} = {assumption.value:,.6g}: {assumption.source}" for assumption in plan.assumptions)
    return "\n".join(lines)
