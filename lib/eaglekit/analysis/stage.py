"""Stage 6 as one library call: every draft of the stage-5 sweep scored, the real loop, break-even and the
scaling answer.

`run_analysis_stage(params, run_dir)` does what notebook 06 computes, without the plots, in this order:
1. offline acceptance per draft and dataset on the sweep's held-out samples (`checkpoints`, `acceptance`);
2. the real speculative-decoding loop with the largest draft on held-out prompts
   (`checkpoints.evaluate_speculative_loop`);
3. preflight (the doctor) on the exported SGLang draft;
4. break-even (`break_even`) for the loop's own timings and, when params.analysis gives serving timings, for
   those;
5. the benchmark prompts through the real loop with every draft (`benchmark`);
6. the scaling answer on the pooled held-out curve (`answer.sweep_scaling`) and the go / no-go forecast
   (`forecast`);
7. which topology to serve (`topology_sweep`), checked through the real tree loop;
8. the ablation (original vs regenerated answers) when stage 5 trained it;
9. live serving measurements when endpoints are configured (`live_serving`).
It writes analysis/{acceptance, acceptance_per_position, doctor, topology_sweep}.csv, benchmark.csv,
ablation.csv and serving.csv when measured, analysis/scaling_summary.json, analysis/answer.json (the go /
no-go forecast, `forecast`), and the `topology_sweep` and `headline` metrics events, and
returns an `AnalysisResult` that the notebook displays and plots (figures/06_*.png are the notebook's).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from eaglekit.analysis.acceptance import SweepAcceptance, sweep_acceptance
from eaglekit.analysis.answer import (SweepScaling, analysis_summary_record, answer_in_words, break_even_cases, forecast_answer,
                                      headline_metrics, lower_bound_sizes, seed_accept_lengths, serving_case, sweep_scaling,
                                      write_summary_record)
from eaglekit.analysis.benchmark import BenchmarkRun, benchmark_drafts
from eaglekit.analysis.break_even import BreakEven, break_even_from_throughput
from eaglekit.analysis.checkpoints import (LoopReport, evaluate_speculative_loop, heldout_prompts, heldout_samples, load_draft_checkpoint,
                                           offline_agreements_by_size, score_ablation)
from eaglekit.analysis.forecast import ANSWER_FILE, AnswerFile
from eaglekit.analysis.live_serving import LiveServing, measure_live_serving
from eaglekit.analysis.speculative import one_torch_thread
from eaglekit.analysis.topology_sweep import (StepCosts, check_recommendation, default_topology_grid, measure_step_costs, pool_datasets,
                                              recommend, sweep_event, sweep_table, tree_depths_by_dataset)
from eaglekit.capture import load_target, open_captured_samples
from eaglekit.capture.inputs import capture_length
from eaglekit.config import Params
from eaglekit.draft.doctor import findings_frame, preflight_table, run_doctor
from eaglekit.draft.model import load_target_head_weights
from eaglekit.io import format_duration
from eaglekit.run_folder import Metrics, stage_dir, sweep_path, tokenized_data_files
from eaglekit.target import load_tokenizer, resolve_model
from eaglekit.topology import Topology
from eaglekit.training.record import SweepRecord

SUMMARY_FILE = "scaling_summary.json"
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AnalysisResult:
    """What stage 6 measured, in the order `run_analysis_stage` measured it. Every tau is for `topology`
    (a greedy chain of analysis.chain_steps) unless a table names its own."""

    run_dir: Path
    topology: Topology
    sweep: SweepRecord
    # the held-out samples every draft is scored on (sweep.scored): id, dataset, input_ids, loss_mask, ...
    heldout: list[dict]
    acceptance: SweepAcceptance  # offline acceptance per draft and dataset, with bootstrap intervals
    offline_seconds: float
    loop_prompts: list[dict]  # held-out prompts of the real loop (and the topology check and live serving)
    loop: LoopReport  # the largest draft through the real loop against plain greedy decoding
    loop_seconds: float
    doctor: pd.DataFrame  # preflight findings on the exported SGLang draft
    seed_case: BreakEven | None  # the user's serving measurement (params.analysis); None when not given
    embedded_case: BreakEven  # the loop's own timings
    benchmark: BenchmarkRun
    scaling: SweepScaling
    step_costs: StepCosts
    topology_grid_size: int
    topology_samples: int
    topology_table: pd.DataFrame  # offline tau and predicted speedup per chain and SGLang tree
    serve: dict  # the recommended SGLang flags and vLLM setting, with the real tree loop's check
    ablation: pd.DataFrame | None  # None when stage 5 trained no ablation
    live_doctor: pd.DataFrame | None  # the doctor against the SGLang server's info, when an endpoint is set
    live: LiveServing
    summary: dict[str, Any]  # what analysis/scaling_summary.json holds
    stage_seconds: float
    answer: list[str]  # the answer in plain words, paragraphs built from the numbers
    # analysis/answer.json: the go / no-go forecast and the sizes it rests on
    forecast: AnswerFile | None = None

    @property
    def largest_size(self) -> int:
        return self.sweep.largest.size

    @property
    def break_even(self) -> float:
        """Break-even tau of the embedded loop: what the scaling answer sizes data for."""
        return self.embedded_case.break_even_accept_length

    @property
    def ceiling(self) -> float:
        """The chain's ceiling tau, k + 1."""
        return self.topology.steps + 1.0

    def break_even_table(self) -> pd.DataFrame:
        serving = [] if self.seed_case is None else [
            {"case": "serving (params.analysis)", "topology": "as served", **self.seed_case.to_dict()}]
        return pd.DataFrame([*serving, {"case": "embedded loop, largest draft", "topology": self.topology.label,
                                        **self.embedded_case.to_dict()}])


def run_looks(run_dir: str | os.PathLike, data_sizes) -> int:
    """The verdicts a run issues: one here, plus one per size a staged run forecast from while generation ran
    (staged/slices.json). Each verdict spends (1 - confidence) / looks of the run's chance of a wrong "go"."""
    from eaglekit.staged.slices import StagedRecord, sizes_to_stage

    return 1 + (len(sizes_to_stage(data_sizes)) if StagedRecord.path(run_dir).exists() else 0)


def scored_samples(sweep: SweepRecord, captured) -> list[dict]:
    """The held-out samples stage 6 scores every draft on (`sweep.scored`, in its order), read from the
    capture: the selection side of the held-out set picked the checkpoints and is never scored (a version-1
    sweep: all of it is)."""
    scored = set(sweep.scored)
    return [sample for key, sample in zip(sweep.heldout, heldout_samples(sweep, captured)) if key in scored]


def _seed_accept_lengths(sweep: SweepRecord, run_dir: Path, head, heldout: list[dict], steps: int,
                         max_length: int) -> dict[float, list[float]]:
    """Held-out tau of the extra-seed drafts stage 5 trained (training.noise_seeds: training noise), scored on
    the same held-out samples as the sweep's drafts; {} when it trained none (the forecast then uses its
    documented prior)."""
    agreements = {size: [offline_agreements_by_size({size: path}, head.embed_tokens, head.lm_head, heldout, steps, max_length)[size]
                         for path in paths]
                  # each checked against sweep.json
                  for size, paths in sweep.seed_checkpoints(run_dir).items()}
    return seed_accept_lengths(agreements, steps)


class StageParts:
    """Stage 6's parts in the log, as each starts ("stage 6, part 3 of 9: the real loop ...") and ends (its
    time): on a large run a part takes minutes, and the runner's heartbeat says only that the stage still
    runs."""

    def __init__(self, total: int):
        self.total, self.done = total, 0

    @contextlib.contextmanager
    def part(self, what: str) -> Iterator[None]:
        self.done += 1
        index, started = self.done, time.perf_counter()
        logger.info("stage 6, part %d of %d: %s", index, self.total, what)
        yield
        logger.info("stage 6, part %d of %d done in %s", index, self.total, format_duration(time.perf_counter() - started))


@dataclass
class StageInputs:
    """What stage 6 reads from the run folder and the target."""

    sweep: SweepRecord
    model_dir: Path
    tokenizer: Any
    target_model: Any
    heldout: list[dict]  # the scored side of the held-out set (sweep.scored)
    checkpoints: dict[int, Path]  # {data size: best checkpoint}
    still_improving: dict  # {data size: recent gain} of drafts whose tau is a lower bound
    head: Any


def _stage_inputs(params: Params, out: Path) -> StageInputs:
    # training/sweep.json: fails here, naming the field, when it is malformed
    sweep = SweepRecord.load_run(out)
    if sweep.picked_on_scored:
        logger.warning("%s is from before the selection split: its drafts' best checkpoints were picked on the held-out samples "
                       "scored here, so every tau below is optimistic; rerun stage 5 for checkpoints picked on a selection split",
                       sweep_path(out))
    model_dir = resolve_model(params.target.model, revision=params.target.revision)
    target_model = load_target(model_dir, dtype=getattr(torch, params.target.dtype), trust_remote_code=params.target.trust_remote_code)
    captured = open_captured_samples(sweep.path(out, sweep.capture_dir), tokenized_data_files(out), target_model,
                                     capture_layer_ids=sweep.capture_layer_ids, max_seq_len=capture_length(params))
    # Drafts whose tau is a lower bound: capped, or still rising when patience stopped them.
    still_improving = lower_bound_sizes([entry.to_dict() for entry in sweep.runs], params.training)
    return StageInputs(sweep, model_dir, load_tokenizer(params.target), target_model, scored_samples(sweep, captured),
                       sweep.checkpoints(out), still_improving, load_target_head_weights(model_dir))


def run_analysis_stage(params: Params, run_dir: str | os.PathLike) -> AnalysisResult:
    """Stage 6 without plots over the run folder stage 5 filled (training/sweep.json); see the module
    docstring."""
    started = time.perf_counter()
    out = Path(run_dir)
    settings = params.analysis
    steps = settings.chain_steps  # k: every tau is for a greedy chain of k steps (top-1, k + 1 draft tokens)
    topology = Topology.chain(steps)
    analysis_dir = stage_dir(out, "analysis")
    metrics = Metrics(out, "analysis")
    torch.manual_seed(params.run.seed)
    max_length = params.training.max_length
    log = StageParts(9)

    with log.part("the sweep's drafts, the target and the scored held-out samples"):
        inputs = _stage_inputs(params, out)
    sweep, target_model, heldout, checkpoints, head = inputs.sweep, inputs.target_model, inputs.heldout, inputs.checkpoints, inputs.head
    with log.part(f"offline acceptance of {len(checkpoints)} drafts on {len(heldout)} held-out samples"):
        offline_started = time.perf_counter()
        agreements_by_size = offline_agreements_by_size(checkpoints, head.embed_tokens, head.lm_head, heldout, steps, max_length)
        offline_seconds = time.perf_counter() - offline_started
        acceptance = sweep_acceptance(agreements_by_size, steps, settings.bootstrap_resamples, settings.confidence, params.run.seed)
        acceptance.summary.to_csv(analysis_dir / "acceptance.csv", index=False)
        acceptance.per_position.to_csv(analysis_dir / "acceptance_per_position.csv", index=False)

    eos_token_ids = [int(inputs.tokenizer.eos_token_id)]
    with log.part(f"the real loop with the largest draft ({sweep.largest.size} samples) against greedy decoding"):
        largest_draft = load_draft_checkpoint(checkpoints[sweep.largest.size], head.embed_tokens)
        loop_started = time.perf_counter()
        loop_prompts, loop, embedded_case = timed_loop(params, target_model, largest_draft, heldout, eos_token_ids)
        loop_seconds = time.perf_counter() - loop_started
    loop.require_lossless()

    sglang_dir = sweep.path(out, sweep.export["sglang"])
    with log.part("the doctor on the SGLang export, and break-even"):
        doctor = preflight_table(inputs.model_dir / "config.json", sglang_dir, sweep.export["sglang"],
                                 list(largest_draft.config.capture_layer_indices), loop.summary["tau_loop_pooled"])
        doctor.to_csv(analysis_dir / "doctor.csv", index=False)
        seed_case = serving_case(settings)
    with log.part("the benchmark prompts through the real loop with every draft"):
        benchmark = benchmark_drafts(settings, target_model, inputs.tokenizer, checkpoints, head.embed_tokens, steps, max_length,
                                     eos_token_ids, template_kwargs=params.prep.chat_template_kwargs, seed=params.run.seed)
        benchmark.write(analysis_dir)
    with log.part("the scaling answer and the go / no-go forecast"):
        scaling, forecast, summary = _answer(params, out, inputs, acceptance, embedded_case, seed_case, loop, benchmark)
        forecast.save(analysis_dir / ANSWER_FILE)
    with log.part("which topology to serve, checked through the real tree loop"):
        topology_run = _topology(params, largest_draft, inputs, loop_prompts, str(sglang_dir), eos_token_ids)
        topology_run["table"].to_csv(analysis_dir / "topology_sweep.csv", index=False)
        summary["topology_sweep"] = topology_run["serve"]
        metrics.log(**sweep_event(topology_run["serve"]))
    with log.part("the ablation: original against regenerated answers"):
        ablation = score_ablation(sweep, out, head.embed_tokens, head.lm_head, heldout, steps, max_length,
                                  settings.bootstrap_resamples, settings.confidence, params.run.seed)
        if ablation is not None:
            ablation.to_csv(analysis_dir / "ablation.csv", index=False)
            summary["ablation"] = ablation.to_dict(orient="records")
    with log.part("live serving, where endpoints are set"):
        live_doctor, live = _live_serving(settings, inputs.model_dir, sglang_dir, loop_prompts, analysis_dir, summary)

    stage_seconds = time.perf_counter() - started
    summary["stage_seconds"] = stage_seconds
    write_summary_record(analysis_dir / SUMMARY_FILE, summary)
    metrics.log(event="headline", **headline_metrics(topology, scaling, loop.summary, embedded_case, seed_case,
                                                     lower_bound_sizes=inputs.still_improving, stage_seconds=stage_seconds))
    metrics.close()
    answer = answer_in_words(acceptance, scaling.pooled_dataset, topology, len(heldout), settings.confidence, embedded_case,
                             loop.summary, scaling.statements, seed_case, benchmark.summary, Path(settings.benchmark_prompts or "").name)
    return AnalysisResult(
        run_dir=out, topology=topology, sweep=sweep, heldout=heldout, acceptance=acceptance, offline_seconds=offline_seconds,
        loop_prompts=loop_prompts, loop=loop, loop_seconds=loop_seconds, doctor=doctor, seed_case=seed_case,
        embedded_case=embedded_case, benchmark=benchmark, scaling=scaling, step_costs=topology_run["step_costs"],
        topology_grid_size=topology_run["grid_size"], topology_samples=topology_run["samples"], topology_table=topology_run["table"],
        serve=topology_run["serve"], ablation=ablation, live_doctor=live_doctor, live=live, summary=summary,
        stage_seconds=stage_seconds, answer=[forecast.line, *answer], forecast=forecast,
    )


def timed_loop(params: Params, target_model, draft, heldout: list[dict], eos_token_ids: list[int]
               ) -> tuple[list[dict], LoopReport, BreakEven]:
    """The real loop with `draft` against greedy decoding on analysis.specdec_prompts held-out prompts (one
    torch thread), and the break-even its timings give: stage 6's, with the largest draft, and the staged
    run's, with the first."""
    settings = params.analysis
    prompts = heldout_prompts(heldout, settings.specdec_prompts, max_prompt_tokens=params.training.max_length)
    with one_torch_thread():
        loop = evaluate_speculative_loop(target_model, draft, [prompt["input_ids"] for prompt in prompts], settings.chain_steps,
                                         settings.specdec_max_new_tokens, eos_token_ids)
    summary = loop.summary
    case = break_even_from_throughput(summary["greedy_tokens_per_second"], summary["speculative_tokens_per_second"],
                                      summary["tau_loop_pooled"], draft_length=settings.chain_steps)
    return prompts, loop, case


def scaling_and_forecast(params: Params, run_dir: str | os.PathLike, acceptance: SweepAcceptance, cases: dict[str, float],
                         scaling_break_even: float, lower_bounds: dict, seed_accept_lengths: dict | None = None
                         ) -> tuple[SweepScaling, AnswerFile]:
    """The scaling answer on the pooled held-out curve (sized for `scaling_break_even`) and the go / no-go
    forecast against `cases` (`break_even_cases`: the user's serving timings when given, else this target's
    own loop), the horizon analysis.full_data_size (unset: the largest planned size): stage 6's, and the
    staged run's after each size."""
    settings, steps = params.analysis, params.analysis.chain_steps
    scaling = sweep_scaling(acceptance, scaling_break_even, max_accept_length=steps + 1.0, confidence=settings.confidence,
                            target_accept_length=settings.target_accept_length, lower_bound_sizes=lower_bounds)
    forecast = forecast_answer(acceptance, scaling, params.training.data_sizes, cases, max_accept_length=steps + 1.0,
                               confidence=settings.confidence, full_size=settings.full_data_size, lower_bound_sizes=lower_bounds,
                               seed_accept_lengths=seed_accept_lengths, looks=run_looks(run_dir, params.training.data_sizes),
                               seed=params.run.seed)
    return scaling, forecast


def _answer(params: Params, out: Path, inputs: StageInputs, acceptance: SweepAcceptance, embedded_case: BreakEven,
            seed_case: BreakEven | None, loop: LoopReport, benchmark: BenchmarkRun) -> tuple[SweepScaling, AnswerFile, dict]:
    """Stage 6's scaling answer (sized for the embedded loop's break-even), forecast and summary record."""
    steps = params.analysis.chain_steps
    seeds = _seed_accept_lengths(inputs.sweep, out, inputs.head, inputs.heldout, steps, params.training.max_length)
    scaling, forecast = scaling_and_forecast(params, out, acceptance, break_even_cases(seed_case, embedded_case),
                                             embedded_case.break_even_accept_length, inputs.still_improving, seeds)
    summary = analysis_summary_record(Topology.chain(steps), len(inputs.heldout), scaling, embedded_case, seed_case, loop.summary,
                                      params.analysis.benchmark_prompts, benchmark.summary)
    summary["forecast"] = {"verdict": forecast.verdict, "line": forecast.line, "sizes": forecast.sizes}
    return scaling, forecast, summary


def _topology(params: Params, largest_draft, inputs: StageInputs, loop_prompts: list[dict], draft_dir: str,
              eos_token_ids: list[int]) -> dict[str, Any]:
    """Which topology to serve; the grid is sized for a 2-core CPU (on a GPU: default_topology_grid() and
    every sample)."""
    settings, max_length = params.analysis, params.training.max_length
    grid = default_topology_grid(max_steps=4, top_ks=(2, 4), draft_tokens=(4, 8, 16))
    topology_samples = inputs.heldout[: settings.specdec_prompts]
    with one_torch_thread():
        step_costs = measure_step_costs(inputs.target_model, largest_draft, context_length=min(256, max_length))
        depths = tree_depths_by_dataset(largest_draft, inputs.head.lm_head, topology_samples, grid, max_length)
    table = sweep_table({served: pool_datasets(by_dataset) for served, by_dataset in depths.items()}, step_costs, draft_dir=draft_dir,
                        num_resamples=settings.bootstrap_resamples, confidence=settings.confidence, seed=params.run.seed)
    serve = check_recommendation(recommend(table, step_costs), inputs.target_model, largest_draft, loop_prompts, settings.chain_steps,
                                 settings.specdec_max_new_tokens, eos_token_ids, num_resamples=settings.bootstrap_resamples,
                                 confidence=settings.confidence, seed=params.run.seed)
    return {"grid_size": len(grid), "samples": len(topology_samples), "step_costs": step_costs, "table": table, "serve": serve}


def _live_serving(settings, model_dir: Path, sglang_dir: Path, loop_prompts: list[dict], analysis_dir: Path,
                  summary: dict) -> tuple[pd.DataFrame | None, LiveServing]:
    """The doctor against the running SGLang server's info (before measuring it), and the live measurements
    (analysis/serving.csv and the summary's `serving`, when measured)."""
    live_doctor = (findings_frame(run_doctor(model_dir / "config.json", draft_dir=sglang_dir, endpoint=settings.sglang_endpoint))
                   if settings.sglang_endpoint else None)
    live = measure_live_serving(loop_prompts, settings.specdec_max_new_tokens, sglang_endpoint=settings.sglang_endpoint,
                                baseline_endpoint=settings.baseline_endpoint, vllm_endpoint=settings.vllm_endpoint)
    if live.measured:
        live.summary.to_csv(analysis_dir / "serving.csv", index=False)
        summary["serving"] = live.records()
    return live_doctor, live
