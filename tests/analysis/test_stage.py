"""Stage 6's entry: the one-thread context of its timed loops, the held-out side it scores (the whole stage
runs in tests/e2e/test_pipeline.py)."""

import dataclasses

import pytest
import torch

from eaglekit.analysis.stage import AnalysisResult, one_torch_thread, scored_samples
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
