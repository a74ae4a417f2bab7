"""Stage 6's entry: the one-thread context of its timed loops, the held-out side it scores (the whole stage
runs in tests/e2e/test_pipeline.py)."""

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from eaglekit.analysis import forecast as forecast_module
from eaglekit.analysis.acceptance import sweep_acceptance
from eaglekit.analysis.answer import forecast_answer
from eaglekit.analysis.stage import AnalysisResult, one_torch_thread, scaling_and_forecast, scored_samples
from eaglekit.config import load_params
from support import record


def test_one_torch_thread_restores_the_thread_count_even_on_error():
    before = torch.get_num_threads()
    with pytest.raises(RuntimeError):
        with one_torch_thread():
            assert torch.get_num_threads() == 1
            raise RuntimeError("a failed loop")
    assert torch.get_num_threads() == before


def test_the_result_is_frozen():
    assert dataclasses.is_dataclass(AnalysisResult) and AnalysisResult.__dataclass_params__.frozen


class Captured(list):
    """Captured samples as stage 6 reads them: `keys` in capture order, a sample per position."""

    def __init__(self, keys):
        super().__init__({"dataset": dataset, "id": sample_id} for dataset, sample_id in keys)
        self.keys = list(keys)


def test_stage_6_scores_only_the_held_out_side_that_did_not_pick_the_checkpoints():
    heldout = [("alpha", "a-1"), ("beta", "b-2"), ("alpha", "a-7"), ("beta", "b-9")]
    captured = Captured([("alpha", "t-0"), *reversed(heldout)])
    sweep = dataclasses.replace(record(), heldout=heldout, selection=[("alpha", "a-7"), ("beta", "b-2")])
    assert [(sample["dataset"], sample["id"]) for sample in scored_samples(sweep, captured)] == [
        ("alpha", "a-1"),
        ("beta", "b-9"),
    ]
    # A sweep.json from before the split picked on all of its held-out samples: all are scored, as they were.
    old = dataclasses.replace(sweep, selection=[])
    assert [(sample["dataset"], sample["id"]) for sample in scored_samples(old, captured)] == heldout


def test_the_forecast_reads_the_scaling_answers_leave_one_size_out_errors(tmp_path, monkeypatch):
    """Stage 6 (and the staged run, through `scaling_and_forecast`) fits the leave-one-size-out errors once,
    in the scaling answer; every break-even case's forecast reads them, and they are what the forecast
    computes on its own from the same points."""
    params = load_params(Path(__file__).resolve().parents[2] / "params" / "kimi_k25_big_run.yaml")
    sizes, steps = sorted(params.training.data_sizes), params.analysis.chain_steps
    assert len(sizes) >= forecast_module.SIZES_TO_RANK_MODELS  # both models can be scored on a left-out size
    generator = np.random.default_rng(0)
    rates = {size: min(0.9, 0.3 + 0.04 * np.log2(size / sizes[0])) for size in sizes}
    acceptance = sweep_acceptance(
        {
            size: {"alpha": [generator.random((12, steps)) < rate for _ in range(8)]}
            for size, rate in rates.items()
        },
        steps,
        num_resamples=40,
    )
    refits = []
    computed_here = forecast_module.leave_one_size_out_errors

    def recorded(*args, **kwargs):
        refits.append(args)
        return computed_here(*args, **kwargs)

    monkeypatch.setattr(forecast_module, "leave_one_size_out_errors", recorded)
    cases = {"serving (params.analysis)": 2.0, "embedded loop": 1.9}
    scaling, answer = scaling_and_forecast(params, tmp_path, acceptance, cases, 1.9, {})
    loo = scaling.answer.ceiling.loo_error
    assert all(value is not None for value in loo.values()) and refits == []  # handed over, not refitted
    alone = forecast_module.forecast(
        scaling.overall["data_size"].to_numpy(float),
        scaling.overall["tau_pooled"].to_numpy(float),
        acceptance.pooled_replicates[scaling.pooled_dataset],
        planned_sizes=sizes,
        break_even=1.9,
        max_accept_length=steps + 1.0,
        confidence=params.analysis.confidence,
    )
    assert len(refits) == 1 and alone.loo_rmse == loo
    assert alone.weight_rule == "inverse leave-one-size-out mean squared error"
    for item in answer.forecasts.values():
        assert item.loo_rmse == loo and item.model_weights == alone.model_weights
    # Errors fitted under one ceiling are not handed to a forecast under another.
    with pytest.raises(ValueError, match="one max_accept_length"):
        forecast_answer(acceptance, scaling, sizes, cases, max_accept_length=steps + 2.0, confidence=0.95)
