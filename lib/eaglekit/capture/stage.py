"""Stage 4 as one library call: `run_capture_stage(params, run_dir)` does what notebook 04
computes, without the plots.

In order: load the target; plan the storage (`capture/plan.json`: offline shards when they fit the
disk, else online); capture the shards (offline); count truncation per dataset; read a few samples
back through the interface stages 5 and 6 use (`open_captured_samples`) and check them against their
source lines; take per-layer feature norms; and, when `analysis.ablation` is on, capture the class-B
datasets' own answers into `capture/original/`: only those the ablation draft trains on, outside the
held-out split stage 5 makes (`training.ablation_sample_keys`). Each step logs its metrics event.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eaglekit.capture.checks import check_captured_samples, feature_norms, write_sample_subset
from eaglekit.capture.forward import FeatureSource, load_target
from eaglekit.capture.inputs import capture_length, read_tokenized_samples
from eaglekit.capture.layers import resolve_capture_layer_ids
from eaglekit.capture.online import CapturedSamples, open_captured_samples
from eaglekit.capture.plan import PLAN_FILE, InsufficientDiskError, StoragePlan, plan_capture_storage
from eaglekit.capture.run import CaptureReport, capture_samples
from eaglekit.config import Params
from eaglekit.io import read_jsonl, write_json
from eaglekit.run_folder import Metrics, original_answer_files, stage_dir, tokenized_data_files
from eaglekit.capture.sglang_capture import SGLANG_COMMAND
from eaglekit.target import TargetLayout, resolve_model, target_layout
from eaglekit.training import ablation_sample_keys, read_conversation_keys
from eaglekit.training.order import read_training_order, sweep_split

CHECKED_SAMPLES = 6  # samples read back and compared with their source lines
NORM_SAMPLES = 64  # samples whose per-layer feature norms are taken


@dataclass(frozen=True)
class CaptureResult:
    """What stage 4 did, for display: the plan, the capture (None online), and what was read back."""

    run_dir: Path
    capture_dir: Path
    data_files: dict[str, Path]  # dataset -> tokenized_data.jsonl
    model_dir: Path
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    load_seconds: float
    plan: StoragePlan
    capture_layer_ids: list[int]
    report: CaptureReport | None  # None in online mode: nothing stored
    # per dataset: samples, tokens, loss_tokens, truncated_samples, truncated_tokens, ...
    datasets: dict[str, dict[str, int]]
    checks: list[dict[str, Any]]  # one row per checked sample (`check_captured_samples`)
    norms: dict[str, torch.Tensor]  # "layer <i>" and "final" -> per-token L2 norms (sum T,)
    ablation_report: CaptureReport | None  # the original answers' capture, when the ablation ran
    ablation_note: str  # what happened to the ablation input, in words

    @property
    def truncated_samples(self) -> int:
        return sum(stats["truncated_samples"] for stats in self.datasets.values())

    @property
    def truncated_tokens(self) -> int:
        return sum(stats["truncated_tokens"] for stats in self.datasets.values())


def _capture_original_answers(params: Params, model: torch.nn.Module, capture_dir: Path, out: Path, data_files: dict[str, Path],
                              captured: CapturedSamples, capture_layer_ids: list[int], mode: str,
                              metrics: Metrics) -> tuple[CaptureReport | None, str]:
    """The ablation's input: the class-B datasets' own answers that the ablation draft trains on, into
    capture/original/."""
    original_files = original_answer_files(out)
    if params.analysis.ablation and original_files and mode == "offline" and model is None:
        return None, (f"ablation skipped: capture.engine {params.capture.engine} captured the sweep; "
                      "capture the original answers with it separately")
    if params.analysis.ablation and original_files and mode == "offline":
        main_keys = captured.keys
        original_keys = [(name, record["id"]) for name, path in original_files.items() for _, record in read_jsonl(path)]
        # the held-out split training makes
        heldout, _ = sweep_split(out, main_keys, params.training.heldout_size, params.run.seed,
                                 read_conversation_keys(data_files, main_keys))
        chosen = ablation_sample_keys(main_keys, original_keys, params.training.heldout_size, params.analysis.ablation_size,
                                      params.run.seed, heldout_indices=heldout)
        original_dir = capture_dir / "original"
        subset_files = write_sample_subset(original_files, set(chosen), original_dir / "inputs")
        report = capture_samples(params, model, subset_files, original_dir, capture_layer_ids, progress=False)
        metrics.log(event="capture_original", samples=report.samples, tokens=report.tokens, seconds=report.seconds,
                    truncated_samples=report.truncated_samples)
        return report, (f"ablation input: {report.samples} original answers ({report.tokens:,} tokens, "
                        f"{report.truncated_samples} truncated) into {original_dir.relative_to(out)} in {report.seconds:.1f}s")
    if params.analysis.ablation and mode == "online":
        return None, "ablation skipped: online mode keeps no shards; run the ablation where offline capture fits"
    if params.analysis.ablation:
        return None, "ablation skipped: no class-B dataset kept its own answers (prep.original_answers)"
    return None, "analysis.ablation is false: no original answers captured"


def load_feature_source(params: Params, layout: TargetLayout, capture_layer_ids: list[int], max_seq_len: int,
                         capture_dir: Path) -> tuple[torch.nn.Module | None, FeatureSource | None]:
    """(the transformers target, None) for engine transformers, else (None, the started engine)."""
    engine = params.capture.engine
    if engine == "transformers":
        device_map = "auto" if params.capture.device == "auto" else None
        model = load_target(layout.folder, device="cpu" if device_map else params.capture.device,
                            dtype=getattr(torch, params.target.dtype), device_map=device_map,
                            trust_remote_code=params.target.trust_remote_code)
        return model, None
    if engine == "vllm":
        from eaglekit.capture.vllm_capture import VllmCapture, vllm_settings_from_params

        settings = vllm_settings_from_params(params, layout, capture_layer_ids, max_seq_len)
        return None, VllmCapture.start(settings, layout, capture_dir / "engine")
    raise ValueError(f"capture.engine {engine}: SGLang's model runner runs under torchrun as one TP group, not inside stage 4; "
                     f"run `{SGLANG_COMMAND}` on the GPU node, then run stage 4 again (it resumes from the finished shards)")


def _slice_keys(params: Params, run_dir: Path, data_files: dict[str, Path], max_seq_len: int, vocab_size: int) -> list[dict] | None:
    """With capture.slices: the nested slices in training.data_sizes' order (None without)."""
    if not params.capture.slices:
        return None
    from eaglekit.capture.plan import nested_capture_slices

    return nested_capture_slices(data_files, vocab_size, max_seq_len, params.training.data_sizes, params.training.heldout_size,
                                 params.run.seed, order=read_training_order(run_dir, params.training.heldout_size, params.run.seed))


def run_capture_stage(params: Params, run_dir: str | os.PathLike) -> CaptureResult:
    """Stage 4 without plots: storage plan, capture, truncation counts, read-back checks, feature
    norms, ablation input.

    Writes `capture/plan.json`, the shards (offline) and the stage's metrics events (storage_plan, capture,
    truncation, feature_norms, capture_original). Resumes past samples already in the shards.
    """
    out = Path(run_dir)
    capture_dir = stage_dir(out, "capture")
    data_files = tokenized_data_files(out)
    if not data_files:
        raise FileNotFoundError(f"no tokenized_data.jsonl under {out}/prep or {out}/generation/tokenized: run stages 2-3 first")
    model_dir = resolve_model(params.target.model, revision=params.target.revision)
    layout = target_layout(model_dir, trust_remote_code=params.target.trust_remote_code)
    max_seq_len = capture_length(params)
    metrics = Metrics(out, "capture")
    engine = None
    try:
        started = time.perf_counter()
        capture_layer_ids = resolve_capture_layer_ids(params.target.capture_layers or None, layout.num_hidden_layers)
        model, engine = load_feature_source(params, layout, capture_layer_ids, max_seq_len, capture_dir)
        load_seconds = time.perf_counter() - started

        plan = plan_capture_storage(data_files, layout.hidden_size, layout.vocab_size, max_seq_len, capture_dir,
                                    mode=params.capture.mode, feature_dtype=params.capture.feature_dtype,
                                    slices=_slice_keys(params, out, data_files, max_seq_len, layout.vocab_size))
        if engine is not None and plan.mode == "online":
            raise InsufficientDiskError(f"capture.engine {params.capture.engine} writes shards, but the plan needs "
                                        f"{plan.planned_bytes:,} bytes with {plan.free_bytes:,} free: free disk, use "
                                        "capture.feature_dtype fp8, lower training.max_length, or capture.engine transformers (online)")
        write_json(capture_dir / PLAN_FILE, plan.as_dict())
        metrics.log(event="storage_plan", **plan.as_dict())

        report = None
        if plan.mode == "offline":
            report = capture_samples(params, engine or model, data_files, capture_dir, capture_layer_ids,
                                     slices=[part["keys"] for part in plan.slices] if plan.slices else None)
            metrics.log(event="capture", **{key: value for key, value in report.as_dict().items() if key != "datasets"})
            datasets = report.datasets
        else:
            _, stats = read_tokenized_samples(data_files, layout.vocab_size, max_seq_len)
            datasets = {name: dict(vars(dataset_stats)) for name, dataset_stats in stats.items()}
        if engine is not None:
            # the read-back below uses the shards; the ablation input needs a model only with transformers
            engine.close()
        metrics.log(event="truncation", max_seq_len=max_seq_len,
                    truncated_samples=sum(stats["truncated_samples"] for stats in datasets.values()),
                    truncated_tokens=sum(stats["truncated_tokens"] for stats in datasets.values()))

        # In the mode plan.json names, through the interface stages 5 and 6 read: shards, or features
        # recomputed per access.
        captured = open_captured_samples(capture_dir, data_files, model, capture_layer_ids=capture_layer_ids,
                                         max_seq_len=max_seq_len)
        step = max(1, len(captured) // CHECKED_SAMPLES)
        some = [captured[position] for position in range(0, len(captured), step)][:CHECKED_SAMPLES]
        checks = check_captured_samples(some, data_files, layout.hidden_size, len(capture_layer_ids))
        norm_step = max(1, len(captured) // NORM_SAMPLES)
        norms = feature_norms((captured[position] for position in range(0, len(captured), norm_step)), capture_layer_ids)
        metrics.log(event="feature_norms", **{name: float(values.median()) for name, values in norms.items()})

        ablation_report, ablation_note = _capture_original_answers(params, model, capture_dir, out, data_files, captured,
                                                                   capture_layer_ids, plan.mode, metrics)
    finally:
        if engine is not None:
            engine.close()
        metrics.close()
    return CaptureResult(run_dir=out, capture_dir=capture_dir, data_files=data_files, model_dir=Path(model_dir),
                         num_hidden_layers=layout.num_hidden_layers, hidden_size=layout.hidden_size, vocab_size=layout.vocab_size,
                         load_seconds=load_seconds, plan=plan, capture_layer_ids=capture_layer_ids, report=report, datasets=datasets,
                         checks=checks, norms=norms, ablation_report=ablation_report, ablation_note=ablation_note)
