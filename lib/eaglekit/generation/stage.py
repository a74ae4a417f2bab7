"""Stage 3 as one library call: `run_generation_stage(params, run_dir)` does what notebook 03 computes,
without the plots.

In order: the prompts stage 2 wrote, requested in its planned training order (`prep/order.json`); the capacity
plan before launch (`plan.plan_generation`); the endpoints (those in params, or the embedded server, started
here and stopped at the end); the generation run (`generate`: resumable, Ctrl-C/SIGTERM stop it cleanly); the
training data from the answers (`tokenized.build_tokenized_data`); the stage's metrics event; and its outcome
for the runner (how many prompts failed for good).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from eaglekit.config import Params
from eaglekit.generation.client import EndpointSpec
from eaglekit.generation.logs import GenerationSummary, generation_table, read_errors
from eaglekit.generation.capacity import CapacityPlan
from eaglekit.generation.plan import plan_generation
from eaglekit.generation.prompts import PromptSource, history_reasoning_for
from eaglekit.generation.run import generate
from eaglekit.generation.server import serving_endpoints
from eaglekit.generation.tokenized import TokenizedDataSummary, build_tokenized_data, check_first_answers
from eaglekit.io import read_jsonl
from eaglekit.run_folder import Metrics, prompt_files, record_stage_outcome, stage_dir
from eaglekit.run_log import under_runner
from eaglekit.target import load_tokenizer
from eaglekit.training.order import TrainingOrder, read_training_order, requests_before_each_size

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationResult:
    """What stage 3 did, for display: the plan, the endpoints, the run's summary, the training data, the
    errors."""

    run_dir: Path
    generation_dir: Path
    sources: list[PromptSource]
    plan: CapacityPlan
    endpoints: list[tuple[str, str]]  # (label, url) of each endpoint generated with
    summary: GenerationSummary
    tokenized: TokenizedDataSummary
    records: pd.DataFrame  # one row per answer, no text (`generation_table`)
    errors: list[dict[str, Any]]  # latest error record of each prompt that failed for good, with its history


def _log_size_readiness(order: TrainingOrder, sources: list[PromptSource], sizes: list[int]) -> None:
    """One line per data size: how many requests of each partition must be answered before it can train."""
    partition_of = {(source.dataset, str(record.get("id"))): source.partition
                    for source in sources for _, record in read_jsonl(source.path)}
    for row in requests_before_each_size(order, partition_of, sizes):
        parts = ", ".join(f"{row[partition][0]} of {row[partition][1]} {partition}" for partition in row if partition != "size")
        logger.info("size %d (and the held-out set) answered after %s requests (prep/order.json)", row["size"], parts)


def _first_answers_check(sources: list[PromptSource], tokenizer, params: Params):
    """The usage check on each dataset's first answers (`check_first_answers`), for `generate`."""
    conversations: dict[str, dict[str, dict]] = {}
    for source in sources:
        conversations.setdefault(source.dataset, {}).update(
            (str(record["id"]), record) for _, record in read_jsonl(source.path))

    def check(dataset: str, records: list[dict]) -> None:
        check_first_answers(dataset, records, conversations[dataset], tokenizer,
                            params.generation.max_usage_disagreement, params.prep.chat_template_kwargs)
    return check


def run_generation_stage(params: Params, run_dir: str | os.PathLike) -> GenerationResult:
    """Stage 3 without plots: plan, serve, generate, tokenize the answers, log metrics, record the stage
    outcome.

    Writes generation/ (generations.jsonl, errors.jsonl, metrics.jsonl, ...,
    tokenized/<dataset>/tokenized_data.jsonl), the stage's metrics event and its outcome. Rerunning resumes by
    stable id.
    """
    out = Path(run_dir)
    generation_dir = stage_dir(out, "generation")
    prompts = prompt_files(out)
    if not prompts:
        raise FileNotFoundError(f"no prompts.<partition>.jsonl under {out / 'prep'}: run 02_prep first")
    sources = [PromptSource(dataset, partition, path) for dataset, partition, path in prompts]
    plan = plan_generation(params, prompts)
    settings = params.generation
    tokenizer = load_tokenizer(params.target)
    # Past turns' reasoning goes in the request as prep rendered it, so the server renders the same prompt.
    history_reasoning = history_reasoning_for(tokenizer, params.prep.chat_template_kwargs)
    # Prep's planned training order: the held-out set and the first data sizes' samples are requested first.
    order = read_training_order(out, params.training.heldout_size, params.run.seed)
    if order is not None:
        _log_size_readiness(order, sources, params.training.data_sizes)
    # The embedded server stops at the end of the block.
    with serving_endpoints(params, log_path=out / "server.log") as serving:
        endpoint_specs = [EndpointSpec.from_params(endpoint) for endpoint in serving]
        summary = generate(
            sources, endpoint_specs, generation_dir, params.generation.partitions, temperature=settings.temperature, top_p=settings.top_p,
            retry=settings, request_timeout_s=settings.request_timeout_s, retry_errors=settings.retry_errors,
            log_interval_s=settings.log_interval_s, shutdown_grace_s=settings.shutdown_grace_s, seed=params.run.seed,
            # e.g. Qwen3's enable_thinking, as prep rendered it
            chat_template_kwargs=params.prep.chat_template_kwargs,
            history_reasoning=history_reasoning,
            priority=order.priority() if order is not None else None,
            first_answers_check=_first_answers_check(sources, tokenizer, params),
            # Under the runner the progress line (run.log, the cell's output) says it all: a tqdm bar saved in
            # the executed notebook would stay frozen at its first frame. By hand, in JupyterLab, the bar is
            # live.
            progress_bar=not under_runner(),
        )
    tokenized = build_tokenized_data(
        generation_dir, sources, generation_dir / "tokenized", tokenizer=tokenizer,
        truncated_policy=settings.truncated_policy, drop_flags=settings.drop_flags, use_token_ids=settings.use_token_ids,
        bad_input=settings.bad_answer, max_usage_disagreement=settings.max_usage_disagreement,
        template_kwargs=params.prep.chat_template_kwargs,
    )
    # One small row per answer (no text, no token ids): read once, line by line, whatever the log's size.
    records = pd.DataFrame(generation_table(generation_dir))
    with Metrics(out, "generation") as metrics:
        metrics.log(answers=len(records), truncated=int(records["truncated"].sum()),
                    mean_completion_tokens=float(records["completion_tokens"].mean()), errors=summary.errors)
    errors = list(read_errors(generation_dir).values())
    record_stage_outcome(out, "generation", errors=summary.errors,
                         detail=f"{summary.errors} prompts failed for good (see generation/errors.jsonl); --resume retries them")
    return GenerationResult(run_dir=out, generation_dir=generation_dir, sources=sources, plan=plan,
                            endpoints=[(endpoint.label, endpoint.url) for endpoint in serving], summary=summary,
                            tokenized=tokenized, records=records, errors=errors)
