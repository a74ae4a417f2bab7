"""Stage 6's entry: the one-thread context of its timed loops (the whole stage runs in tests/e2e/test_pipeline.py)."""

import dataclasses

import pytest
import torch

from eaglekit.analysis.stage import AnalysisResult, one_torch_thread


def test_one_torch_thread_restores_the_thread_count_even_on_error():
    before = torch.get_num_threads()
    with pytest.raises(RuntimeError):
        with one_torch_thread():
            assert torch.get_num_threads() == 1
            raise RuntimeError("a failed loop")
    assert torch.get_num_threads() == before


def test_the_result_is_frozen():
    assert dataclasses.is_dataclass(AnalysisResult) and AnalysisResult.__dataclass_params__.frozen
