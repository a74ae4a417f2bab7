"""Stages 1 and 2 as one call each: what they write into the run folder and return."""

from __future__ import annotations

from pathlib import Path

import pytest

from eaglekit.config import params_from_sections
from eaglekit.data.stage import run_prep_stage, run_survey_stage

DATA = Path(__file__).resolve().parents[1] / "fixtures" / "data"


@pytest.fixture(scope="module")
def params(embedded_model_dir):
    return params_from_sections(
        {
            "target": {"model": str(embedded_model_dir)},
            "datasets": [
                {
                    "name": "chat_a",
                    "format": "sharegpt",
                    "path": str(DATA / "sharegpt.jsonl"),
                    "data_class": "A",
                },
                {"name": "alpaca_b", "format": "alpaca", "path": str(DATA / "alpaca.json")},
            ],
            "prep": {"context_length": 256, "long_prompt_threshold": 40},
        }
    )


def test_survey_stage_saves_tables_and_figures(params, tmp_path):
    survey = run_survey_stage(params, tmp_path)
    assert list(survey.summary.source) == ["chat_a", "alpaca_b"]
    assert all(path.is_file() and path.parent == tmp_path / "survey" for path in survey.files)
    assert all(path.is_file() and path.parent == tmp_path / "figures" for path in survey.figures)


def test_prep_stage_writes_the_stage_folder_and_the_partition_figure(params, tmp_path):
    prepared = run_prep_stage(params, tmp_path)
    table = prepared.table().set_index("source")
    assert (
        table.loc["chat_a", "kept"] == 3
        and table.loc["alpaca_b", "short"] + table.loc["alpaca_b", "long"] == 3
    )
    assert prepared.prep_dir == tmp_path / "prep" and (tmp_path / "prep" / "summary.json").is_file()
    assert Path("chat_a/tokenized_data.jsonl") in prepared.files and prepared.figure.is_file()
    assert prepared.first_sample is not None and "background" in prepared.first_sample_html


def test_no_datasets_fails_before_any_model_loads(tmp_path):
    with pytest.raises(ValueError, match="add a `datasets:` list"):
        run_prep_stage(params_from_sections({"target": {"model": "embedded:no-such-model"}}), tmp_path)
