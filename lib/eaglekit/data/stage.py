"""Stages 1 and 2 as one library call each: the dataset survey and prompt prep, from params
into the run folder.

`run_survey_stage(params, run_dir)` does what notebook 01 shows: one streaming pass per source with
the target's tokenizer (`data.survey.survey_sources`), the tables saved under `survey/` and the
length, turn and partition figures under `figures/`.

`run_prep_stage(params, run_dir)` does what notebook 02 shows: every source normalized, deduplicated,
split into class A (tokenized now) and class B (prompts partitioned by measured length) under
`prep/`, written atomically (`data.prep.prepare_sources`), and the partition figure.

Both read only `params.datasets`, `params.target` (the tokenizer) and `params.prep`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
import pandas as pd

from eaglekit.chat import TokenizedConversation, mask_html
from eaglekit.config import Params
from eaglekit.data.prep import PrepSummary, first_sample, plot_partitions, prepare_sources
from eaglekit.data.sources import SourceSpec
from eaglekit.data.survey import SurveyTables, plot_survey, save_survey, survey_sources
from eaglekit.run_folder import stage_dir
from eaglekit.target import load_tokenizer
from eaglekit.training.order import write_training_order

PARTITIONS_FIGURE = "02_partitions.png"


@dataclass(frozen=True)
class SurveyResult:
    """Stage 1's answer: the survey's tables and the files it wrote (paths inside the run folder)."""

    # summary (one row per source), lengths (one row per kept record), rejects (by reason)
    tables: SurveyTables
    files: tuple[Path, ...]  # survey/survey_summary.csv, survey_summary.json, survey_rejects.csv
    figures: tuple[Path, ...]  # figures/survey_*.png

    @property
    def summary(self) -> pd.DataFrame:
        return self.tables.summary

    @property
    def rejects(self) -> pd.DataFrame:
        return self.tables.rejects


@dataclass(frozen=True)
class PrepResult:
    """Stage 2's answer: per-source counts, the files written under prep/ and the partition figure."""

    summary: PrepSummary
    prep_dir: Path
    files: tuple[Path, ...]  # every JSONL under prep/, relative to it
    figure: Path  # figures/02_partitions.png
    first_sample: TokenizedConversation | None  # the first class-A sample as trained; None without class A
    # that sample through the target's tokenizer, trained tokens highlighted (chat.mask_html)
    first_sample_html: str

    def table(self) -> pd.DataFrame:
        """One row per source: read, kept, duplicates, rejected, short, long, tokens,
        template, split, samples."""
        return self.summary.table()

    def rejects_by_reason(self) -> pd.DataFrame:
        return self.summary.rejects_by_reason()


def source_specs(params: Params) -> list[SourceSpec]:
    """The sources the params name, or a ValueError saying how to name some."""
    specs = [dataset.to_spec() for dataset in params.datasets]
    if not specs:
        raise ValueError("params name no datasets: add a `datasets:` list (see params/demo.yaml)")
    return specs


def run_survey_stage(params: Params, run_dir: str | os.PathLike) -> SurveyResult:
    """Stage 1 without display: survey every source, save the tables in `survey/`, the
    figures in `figures/`."""
    out = Path(run_dir)
    specs = source_specs(params)  # before the tokenizer loads: a params mistake fails at once
    tables = survey_sources(specs, load_tokenizer(params.target), params.prep)
    files = save_survey(tables, stage_dir(out, "survey"))
    figures = plot_survey(tables, out / "figures")
    return SurveyResult(tables=tables, files=tuple(files), figures=tuple(figures))


def run_prep_stage(params: Params, run_dir: str | os.PathLike) -> PrepResult:
    """Stage 2 without display: prep every source into `prep/` (atomically) and draw the partition figure."""
    out = Path(run_dir)
    specs = source_specs(params)  # before the tokenizer loads: a params mistake fails at once
    tokenizer = load_tokenizer(params.target)
    prep_dir = stage_dir(out, "prep")
    summary = prepare_sources(specs, tokenizer, prep_dir, params.prep)
    # The held-out set and training order, fixed from prep's ids before any answer exists (prep/order.json).
    write_training_order(prep_dir, params.training.heldout_size, params.run.seed)
    figure = plot_partitions(summary, out / "figures" / PARTITIONS_FIGURE)
    files = tuple(sorted(path.relative_to(prep_dir) for path in prep_dir.rglob("*.jsonl")))
    sample = first_sample(prep_dir)
    sample_html = mask_html(tokenizer, sample) if sample is not None else "<p>no class-A samples in this run</p>"
    return PrepResult(summary=summary, prep_dir=prep_dir, files=files, figure=figure, first_sample=sample,
                      first_sample_html=sample_html)
