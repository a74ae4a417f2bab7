"""Capacity planning before a generation run: KV-cache bytes per token, sequences that fit, ETA, storage.

Pure functions over a target's `config.json` (a path or a dict), so a plan can be made for a model
that is not on disk. The KV-cache formulas follow what SGLang and vLLM allocate:

- MHA / GQA: each layer stores one key and one value vector per KV head.
  bytes/token = 2 x layers x kv_heads x head_dim x dtype_bytes.
  Llama-3.1-8B (32 layers, 8 KV heads, head_dim 128, bf16) = 131,072 B.
- MLA (DeepSeek-V3, Kimi-K2 family): each layer stores the compressed latent plus the decoupled
  RoPE key, shared by all heads.
  bytes/token = layers x (kv_lora_rank + qk_rope_head_dim) x dtype_bytes.
  Kimi-K2.5 (61 layers, 512 + 64, bf16) = 70,272 B.

Where a "1.75 MB/token" estimate for Kimi-K2.5 comes from (see `naive_kv_estimates`): the generic
MHA formula applied to an MLA config, with kv_heads = num_key_value_heads = 64 and head_dim =
hidden_size / heads = 7168 / 64 = 112, gives 2 x 61 x 64 x 112 x 2 = 1,748,992 B = 1.75 MB
(decimal). That is exactly 2 x layers x hidden_size x 2 bytes, the textbook full-MHA cache; it
ignores `kv_lora_rank` and is 24.9x what SGLang stores. Expanding MLA to real per-head keys
(qk_nope 128 + rope 64 = 192) and values (128) gives a different, larger 2,498,560 B = 2.50 MB, so
that is not the source.

Tensor parallelism: SGLang shards GQA KV heads across ranks (replicating them when there are fewer
KV heads than ranks) but replicates the MLA latent on every rank, so MLA gains no KV room from TP.

Concurrency from length distributions (`length_plan`). SGLang pages its KV cache and admits a request
by its actual length plus an estimate of what it will still generate (min(max_new_tokens - generated,
SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION = 4096) x new_token_ratio, a ratio that decays while nothing is
retracted); when the running sequences outgrow the pool it retracts some (frees their KV and
recomputes them later). So what matters is what the running sequences actually hold, not each
one's worst case. In a steady continuous batch, a sequence of prompt P and answer L is running for
a share of time proportional to L and holds P + t tokens at its t-th step, so one slot holds on
average E[L P + L (L + 1) / 2] / E[L] tokens, and C slots hold C times that (the expected occupancy).
The occupancy of one slot is a random variable (which sequence, how far along); the sum over C
independent slots is close to normal, and retractions become likely where it exceeds the pool with
probability `retraction_risk` (1% by default): the largest C with C mu + z sigma sqrt(C) <= pool.
The no-preemption worst case (every sequence at prompt p95 + max_tokens at once) is reported beside
it: it is what fits without ever retracting, and it leaves most of the pool idle when answers are
shorter than max_tokens.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import NormalDist
from typing import Any

import numpy as np

from eaglekit.io import InputError, read_json

DTYPE_BYTES: dict[str, int] = {"fp32": 4, "float32": 4, "fp16": 2, "float16": 2, "bf16": 2, "bfloat16": 2,
                               "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element for a KV-cache dtype name ("bf16", "fp16", "fp8", ...)."""
    try:
        return DTYPE_BYTES[dtype.lower()]
    except KeyError:
        raise ValueError(f"unknown KV-cache dtype {dtype!r}; use one of {sorted(DTYPE_BYTES)}") from None


def load_model_config(config: str | os.PathLike | Mapping[str, Any]) -> dict[str, Any]:
    """The language-model part of a config: a `config.json` path, a model folder, or a dict.

    Multimodal wrappers (Kimi-K2.5, Llava-style) keep the decoder under `text_config`; that part is
    what owns the KV cache, so it is returned.
    """
    source: str | os.PathLike = "<dict>"
    if isinstance(config, Mapping):
        data = dict(config)
    else:
        path = Path(config)
        if path.is_dir():
            path = path / "config.json"
        source = path
        data = read_json(path, "fix it or download the model again, or pass the config as a dict",
                         missing="pass the model folder, its config.json, or a dict")
    if isinstance(data.get("text_config"), Mapping):
        data = {**data["text_config"]}
    for field in ("num_hidden_layers", "hidden_size", "num_attention_heads"):
        if not isinstance(data.get(field), int):
            raise InputError(source, None, field, "missing or not an integer; the capacity plan needs it")
    return data


def attention_kind(config: str | os.PathLike | Mapping[str, Any]) -> str:
    """"MLA" when the config has a `kv_lora_rank`, "MHA" when KV heads == heads, else "GQA"."""
    model = load_model_config(config)
    if model.get("kv_lora_rank"):
        return "MLA"
    kv_heads = model.get("num_key_value_heads") or model["num_attention_heads"]
    return "MHA" if kv_heads == model["num_attention_heads"] else "GQA"


def _head_dim(model: Mapping[str, Any]) -> int:
    # Configs such as Gemma and Qwen3 set head_dim explicitly and it differs from hidden / heads.
    return int(model.get("head_dim") or model["hidden_size"] // model["num_attention_heads"])


def kv_cache_bytes_per_token(config: str | os.PathLike | Mapping[str, Any], dtype: str = "bf16",
                             tensor_parallel: int = 1) -> int:
    """KV-cache bytes one token occupies on one GPU rank (all layers).

    tensor_parallel=1 gives the whole-model figure (Llama-3.1-8B bf16: 131,072; Kimi-K2.5: 70,272).
    """
    model = load_model_config(config)
    element_bytes = dtype_bytes(dtype)
    layers = model["num_hidden_layers"]
    if model.get("kv_lora_rank"):
        # The latent (kv_lora_rank) and the decoupled RoPE key (qk_rope_head_dim) are cached once per
        # layer and replicated on every TP rank.
        return layers * (int(model["kv_lora_rank"]) + int(model.get("qk_rope_head_dim", 0))) * element_bytes
    kv_heads = int(model.get("num_key_value_heads") or model["num_attention_heads"])
    kv_heads_per_rank = max(1, math.ceil(kv_heads / tensor_parallel))
    return 2 * layers * kv_heads_per_rank * _head_dim(model) * element_bytes


def naive_kv_estimates(config: str | os.PathLike | Mapping[str, Any], dtype: str = "bf16") -> dict[str, int]:
    """Estimates people quote for an MLA model, beside what the server really stores (bytes/token).

    - "actual": `kv_cache_bytes_per_token` (the latent).
    - "mha_formula_hidden_size": 2 x layers x kv_heads x (hidden / heads) x bytes, the generic GQA
      formula run on an MLA config. Kimi-K2.5 bf16: 1,748,992 B = the "1.75 MB/token" estimate.
    - "mla_expanded_per_head": layers x heads x (qk_nope + qk_rope + v_head_dim) x bytes, the cache
      if MLA were decompressed to per-head keys and values. Kimi-K2.5 bf16: 2,498,560 B.
    """
    model = load_model_config(config)
    element_bytes = dtype_bytes(dtype)
    layers, heads = model["num_hidden_layers"], model["num_attention_heads"]
    kv_heads = int(model.get("num_key_value_heads") or heads)
    estimates = {
        "actual": kv_cache_bytes_per_token(model, dtype),
        "mha_formula_hidden_size": 2 * layers * kv_heads * (model["hidden_size"] // heads) * element_bytes,
    }
    if model.get("kv_lora_rank"):
        per_head = int(model.get("qk_nope_head_dim", 0)) + int(model.get("qk_rope_head_dim", 0)) + int(
            model.get("v_head_dim", 0))
        estimates["mla_expanded_per_head"] = layers * heads * per_head * element_bytes
    return estimates


def hidden_state_bytes_per_token(hidden_size: int, dtype_bytes: int = 2) -> int:
    """Stage 4 offline storage per token: three aux layers (3H) plus the final hidden state (H).

    Kimi-K2.5 (H=7168) bf16: 57,344 B; Llama-3.1-8B (H=4096): 32,768 B.
    """
    return 4 * hidden_size * dtype_bytes


def kv_pool_bytes_per_rank(gpu_memory_bytes: int, memory_fraction: float, weight_bytes: int,
                           tensor_parallel: int = 1) -> int:
    """KV pool left on one rank: SGLang's `mem_fraction_static` covers weights plus the KV pool.

    weight_bytes is the whole model's weights; each rank holds 1/tensor_parallel of them. Activations
    and CUDA graphs live in the remaining (1 - memory_fraction).
    """
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
    pool = int(gpu_memory_bytes * memory_fraction - weight_bytes / tensor_parallel)
    if pool <= 0:
        raise ValueError(
            f"weights ({weight_bytes / 1e9:.1f} GB over {tensor_parallel} GPUs) do not fit in "
            f"{memory_fraction:.2f} x {gpu_memory_bytes / 1e9:.1f} GB per GPU; raise tensor_parallel or memory_fraction")
    return pool


@dataclass(frozen=True)
class PartitionPlan:
    """How many sequences of one partition fit in the KV pool, and how long the partition takes."""

    partition: str
    prompts: int
    prompt_tokens: int                 # per sequence, the planning length (e.g. p95 of the partition)
    max_tokens: int                    # completion budget per request
    tokens_per_sequence: int           # prompt_tokens + max_tokens, the worst case a slot must hold
    sequences_that_fit: int            # every running sequence at its worst case, no preemption
    recommended_concurrency: int       # what to set (see `reason`)
    requested_concurrency: int | None
    eta_seconds: float | None          # from a measured throughput, when given
    # From length distributions (None when only the worst case could be planned):
    completion_source: str = "max_tokens (worst case)"  # where the completion lengths came from
    mean_prompt_tokens: float | None = None
    mean_completion_tokens: float | None = None
    expected_tokens_per_sequence: float | None = None   # what one running slot holds on average
    expected_kv_occupancy: float | None = None          # share of the pool at the requested concurrency
    retraction_concurrency: int | None = None           # above it, retractions become likely
    reason: str = ""


@dataclass(frozen=True)
class LengthPlan:
    """Concurrency from measured length distributions (see the module docstring)."""

    mean_prompt_tokens: float
    mean_completion_tokens: float
    expected_tokens_per_sequence: float    # mu: one running slot, time-averaged
    tokens_per_sequence_std: float         # sigma of one slot's occupancy
    retraction_concurrency: int            # largest C with P(C slots > pool) <= retraction_risk
    retraction_risk: float


def length_plan(kv_pool_tokens: int, prompt_tokens: Sequence[int] | np.ndarray,
                completion_tokens: Sequence[int] | np.ndarray, retraction_risk: float = 0.01,
                page_size: int = 1) -> LengthPlan:
    """Expected KV tokens per running sequence and the concurrency where retractions become likely.

    prompt_tokens, completion_tokens: measured lengths, paired (one pilot answer each) or two
    independent samples (prompts from prep, completions from the datasets' own answers); with
    different sizes, every prompt is combined with the mean behaviour of the completions.
    page_size: the server's KV page (a sequence holds whole pages: half a page more on average).
    """
    prompts = np.asarray(prompt_tokens, dtype=np.float64)
    completions = np.maximum(np.asarray(completion_tokens, dtype=np.float64), 1.0)
    if prompts.size == 0 or completions.size == 0:
        raise ValueError("length_plan needs at least one prompt length and one completion length")
    if not 0 < retraction_risk < 0.5:
        raise ValueError(f"retraction_risk must be in (0, 0.5), got {retraction_risk}")
    pad = (page_size - 1) / 2
    weights = completions / completions.sum()
    if prompts.size == completions.size:
        # Paired: slot occupancy is P + t, sequence chosen with probability L / sum(L), t uniform in 1..L.
        first = prompts + (completions + 1) / 2                                     # E[P + t | sequence]
        second = prompts ** 2 + prompts * (completions + 1) + (completions + 1) * (2 * completions + 1) / 6
        mean = float(weights @ first)
        variance = float(weights @ second) - mean ** 2
    else:
        # Independent: P and L drawn apart; E[P + t] = E[P] + E_w[(L+1)/2], variances add.
        step_mean = float(weights @ ((completions + 1) / 2))
        step_second = float(weights @ ((completions + 1) * (2 * completions + 1) / 6))
        mean = float(prompts.mean()) + step_mean
        variance = float(prompts.var()) + step_second - step_mean ** 2
    mean += pad
    sigma = math.sqrt(max(variance, 0.0))
    z = NormalDist().inv_cdf(1 - retraction_risk)
    # C mu + z sigma sqrt(C) = pool, a quadratic in sqrt(C).
    root = (-z * sigma + math.sqrt(z * z * sigma * sigma + 4 * mean * kv_pool_tokens)) / (2 * mean)
    return LengthPlan(mean_prompt_tokens=float(prompts.mean()), mean_completion_tokens=float(completions.mean()),
                      expected_tokens_per_sequence=mean, tokens_per_sequence_std=sigma,
                      retraction_concurrency=max(0, int(root * root)), retraction_risk=retraction_risk)


def _recommend(requested: int | None, worst_case: int, lengths: LengthPlan | None, pool_tokens: int) -> tuple[int, str]:
    """What to set and why, in one sentence the notebook prints."""
    if lengths is None:
        recommended = worst_case if requested is None else min(worst_case, requested)
        return max(recommended, 0), (
            f"no completion lengths measured: planned on the worst case (every sequence at prompt p95 + max_tokens), "
            f"{worst_case} fit; run a pilot (or give the datasets' own answers) to plan from real lengths")
    safe = lengths.retraction_concurrency
    def occupancy(concurrency: int) -> float:
        return concurrency * lengths.expected_tokens_per_sequence / pool_tokens
    if requested is None:
        return safe, (f"{safe} keeps retractions unlikely ({lengths.retraction_risk:.0%} risk); expected KV occupancy "
                      f"{occupancy(safe):.0%}")
    if requested <= safe:
        return requested, (
            f"set the requested {requested}: expected KV occupancy {occupancy(requested):.0%}, retractions become "
            f"likely only above about {safe}; the no-preemption worst case ({worst_case}) would leave about "
            f"{1 - occupancy(min(requested, worst_case)):.0%} of the pool idle")
    return safe, (
        f"set {safe}, not the requested {requested}: at {requested} the running sequences would fill "
        f"{occupancy(requested):.0%} of the pool on average and the server would retract (recompute) some; "
        f"{safe} keeps that under {lengths.retraction_risk:.0%} risk")


def sequences_that_fit(kv_pool_tokens: int, tokens_per_sequence: int) -> int:
    """Whole sequences of tokens_per_sequence tokens that fit in a KV pool of kv_pool_tokens tokens."""
    return kv_pool_tokens // tokens_per_sequence


@dataclass(frozen=True)
class CapacityPlan:
    """A whole run's plan: KV figures, per-partition concurrency and ETA, stage 4 storage."""

    attention: str
    kv_dtype: str
    kv_bytes_per_token: int            # whole model, one copy
    kv_bytes_per_token_per_rank: int
    naive_estimates: dict[str, int]
    kv_pool_bytes_per_rank: int
    kv_pool_tokens: int
    partitions: list[PartitionPlan]
    hidden_state_bytes_per_token: int
    hidden_state_storage_bytes: int | None   # for expected_total_tokens, when given
    eta_seconds: float | None

    def table(self) -> list[dict[str, Any]]:
        """One row per partition, for a pandas DataFrame in the notebook."""
        return [asdict(partition) for partition in self.partitions]


def plan_capacity(config: str | os.PathLike | Mapping[str, Any], *, gpu_memory_bytes: int, memory_fraction: float,
                  weight_bytes: int, partitions: Sequence[Mapping[str, Any]], tensor_parallel: int = 1,
                  kv_dtype: str = "bf16", measured_requests_per_second: Mapping[str, float] | None = None,
                  expected_total_tokens: int | None = None, hidden_state_dtype_bytes: int = 2,
                  page_size: int = 1, retraction_risk: float = 0.01,
                  kv_pool_tokens: int | None = None) -> CapacityPlan:
    """Plan a generation run on one server instance (tensor_parallel GPUs).

    partitions: mappings with "name", "prompts" (count), "prompt_tokens" (planning length, e.g. p95),
    "max_tokens", and optionally "concurrency" (what params ask for), "prompt_lengths" and
    "completion_lengths" (measured distributions; then the plan is made from them, see
    `length_plan`) and "completion_source" (where those came from, for the report).
    Without completion lengths the plan is the no-preemption worst case, capped at the request.
    measured_requests_per_second: per partition name, from a pilot run, for the ETA.
    expected_total_tokens: tokens stage 4 will capture (prompt + answer over all samples).
    kv_pool_tokens: the server's KV pool in tokens when it is known (SGLang logs `max_total_num_tokens`;
    the embedded server's `kv_cache_tokens`); it then replaces the estimate from GPU memory.
    """
    model = load_model_config(config)
    per_token = kv_cache_bytes_per_token(model, kv_dtype)
    per_token_per_rank = kv_cache_bytes_per_token(model, kv_dtype, tensor_parallel)
    if kv_pool_tokens is None:
        pool = kv_pool_bytes_per_rank(gpu_memory_bytes, memory_fraction, weight_bytes, tensor_parallel)
        pool_tokens = pool // per_token_per_rank
    else:
        pool_tokens, pool = int(kv_pool_tokens), int(kv_pool_tokens) * per_token_per_rank
    plans = []
    for index, partition in enumerate(partitions):
        for field in ("name", "prompts", "prompt_tokens", "max_tokens"):
            if field not in partition:
                raise InputError("partitions", index + 1, field, "missing from the partition spec")
        tokens_per_sequence = int(partition["prompt_tokens"]) + int(partition["max_tokens"])
        fit = sequences_that_fit(pool_tokens, tokens_per_sequence)
        requested = None if partition.get("concurrency") is None else int(partition["concurrency"])
        lengths, measured = None, {}
        if all(partition.get(key) is not None and len(partition[key])
               for key in ("completion_lengths", "prompt_lengths")):
            # An answer never holds more than max_tokens, whatever the pilot's own budget was.
            completions = np.minimum(np.asarray(partition["completion_lengths"]), int(partition["max_tokens"]))
            lengths = length_plan(pool_tokens, partition["prompt_lengths"], completions, page_size=page_size,
                                  retraction_risk=retraction_risk)
            # Planned from the lengths; without them PartitionPlan's defaults (the worst case) stand.
            measured = dict(completion_source=str(partition.get("completion_source", "measured")),
                            mean_prompt_tokens=round(lengths.mean_prompt_tokens, 1),
                            mean_completion_tokens=round(lengths.mean_completion_tokens, 1),
                            expected_tokens_per_sequence=round(lengths.expected_tokens_per_sequence, 1),
                            expected_kv_occupancy=None if requested is None else
                            round(requested * lengths.expected_tokens_per_sequence / pool_tokens, 4),
                            retraction_concurrency=lengths.retraction_concurrency)
        recommended, reason = _recommend(requested, fit, lengths, pool_tokens)
        rate = (measured_requests_per_second or {}).get(partition["name"])
        if rate is not None and rate < 0:
            raise ValueError(f"partition {partition['name']!r}: throughput must be positive, got {rate} requests/s")
        plans.append(PartitionPlan(
            partition=str(partition["name"]), prompts=int(partition["prompts"]),
            prompt_tokens=int(partition["prompt_tokens"]), max_tokens=int(partition["max_tokens"]),
            tokens_per_sequence=tokens_per_sequence, sequences_that_fit=fit,
            recommended_concurrency=recommended, requested_concurrency=requested,
            eta_seconds=int(partition["prompts"]) / rate if rate else None,  # at the measured rate
            reason=reason, **measured))
    etas = [plan.eta_seconds for plan in plans]
    hidden_per_token = hidden_state_bytes_per_token(model["hidden_size"], hidden_state_dtype_bytes)
    return CapacityPlan(
        attention=attention_kind(model), kv_dtype=kv_dtype, kv_bytes_per_token=per_token,
        kv_bytes_per_token_per_rank=per_token_per_rank, naive_estimates=naive_kv_estimates(model, kv_dtype),
        kv_pool_bytes_per_rank=pool, kv_pool_tokens=pool_tokens, partitions=plans,
        hidden_state_bytes_per_token=hidden_per_token,
        hidden_state_storage_bytes=None if expected_total_tokens is None else expected_total_tokens * hidden_per_token,
        eta_seconds=None if any(eta is None for eta in etas) else float(sum(etas)))
