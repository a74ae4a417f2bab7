"""Dataset survey (stage 1): streaming per-source statistics as pandas DataFrames, and their plots.

Per source: rows read, rows rejected by reason, duplicates (same normalized conversation seen
earlier in any source), turns per conversation, prompt and response token lengths (p50/p90/p99/max),
share over the context limit, class, and short/long partition counts. Records stream through: only
a few integers per row are kept (turns, prompt, response and conversation tokens), about 16 bytes a
row, so hundreds of thousands of rows fit easily; texts are tokenized in batches so the tokenizer's
Rust side runs in parallel.

Definitions (the same as prep): prompt = the source's multi-turn policy applied to the conversation
and rendered with the target's chat template and generation prompt; response = the record's own
assistant answer to that prompt (reasoning + content, plain tokens; 0 when it has none);
conversation = the whole conversation rendered (class A only; 0 for class B). Over the context: class A by
conversation tokens, class B by prompt tokens (no room left to answer).
"""

from __future__ import annotations

import json

from array import array
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from eaglekit.chat import ChatTemplateError, render_conversation
from eaglekit.io import atomic_write, write_json
from eaglekit.config import PrepParams
from eaglekit.data.prep import content_hash, partition_of, prep_settings, rejects_table
from eaglekit.data.sources import Reject, SourceSpec, iter_source, prompt_messages

_BATCH = 256


@dataclass(frozen=True)
class SurveyTables:
    """What `survey_sources` measured, as DataFrames (one streaming pass per source)."""

    summary: pd.DataFrame  # one row per source
    # one row per kept record: source, turns, prompt_tokens, response_tokens, conversation_tokens
    lengths: pd.DataFrame
    rejects: pd.DataFrame  # source, reason, count


class _SourceStats:
    def __init__(self, spec: SourceSpec):
        self.spec = spec
        self.read = 0
        self.duplicates = 0
        self.rejects: Counter[str] = Counter()
        self.turns = array("i")
        self.prompt_tokens = array("i")
        self.response_tokens = array("i")
        self.conversation_tokens = array("i")


def survey_sources(
    specs: Sequence[SourceSpec],
    tokenizer: Any,
    prep: PrepParams | None = None,
    **fields: Any,
) -> SurveyTables:
    """Stream every source once and return the summary, per-row lengths and reject counts.

    prep: the `prep` params section (its context_length and long_prompt_threshold, as prep uses them);
    or its fields as keywords, validated into one (see `prep.prepare_sources`).
    """
    settings = prep_settings(prep, fields)
    context_length, long_prompt_threshold = settings.context_length, settings.long_prompt_threshold
    seen: set[bytes] = set()
    all_stats: list[_SourceStats] = []
    for spec in specs:
        stats = _SourceStats(spec)
        all_stats.append(stats)
        pending: list[tuple[str, str, str]] = []  # (prompt text, response text, conversation text)

        def flush() -> None:
            # One tokenizer call per column (nothing to call when nothing is pending).
            columns = (stats.prompt_tokens, stats.response_tokens, stats.conversation_tokens)
            for column, texts in zip(columns, zip(*pending)):
                column.extend(len(ids) for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"])
            pending.clear()

        for item in iter_source(spec):
            stats.read += 1
            if isinstance(item, Reject):
                stats.rejects[item.reason_kind] += 1
                continue
            key = bytes.fromhex(content_hash(item.messages)[:32])
            if key in seen:
                stats.duplicates += 1
                continue
            seen.add(key)
            prompt, answer = prompt_messages(item.messages, spec.multi_turn)
            response = "" if answer is None else "\n".join(filter(None, [
                answer.get("reasoning", ""), answer["content"],
                json.dumps(answer["tool_calls"], ensure_ascii=False) if answer.get("tool_calls") else ""]))
            stats.turns.append(len(item.messages))
            # The whole conversation is rendered for class A only: class B is judged by its prompt, and
            # skipping the full render makes a survey of long chat logs several times cheaper.
            tools = item.meta.get("tools")
            try:
                conversation = render_conversation(tokenizer, item.messages, tools=tools) \
                    if spec.data_class == "A" else ""
                prompt_text = render_conversation(tokenizer, prompt, add_generation_prompt=True, tools=tools)
            except ChatTemplateError:
                # the target's template cannot hold it: prep rejects it, with the reason
                stats.rejects["chat template"] += 1
                continue
            pending.append((prompt_text, response, conversation))
            if len(pending) >= _BATCH:
                flush()
        flush()
    return SurveyTables(
        summary=_summary(all_stats, context_length, long_prompt_threshold),
        lengths=_lengths(all_stats),
        rejects=rejects_table((stats.spec.name, stats.rejects) for stats in all_stats),
    )


def _quantiles(values: np.ndarray, prefix: str) -> dict[str, float]:
    measured = [*np.percentile(values, [50, 90, 99]), values.max()] if values.size else [float("nan")] * 4
    return {f"{prefix}_{name}": float(value) for name, value in zip(("p50", "p90", "p99", "max"), measured)}


def _summary(all_stats: list[_SourceStats], context_length: int, long_prompt_threshold: int) -> pd.DataFrame:
    rows = []
    for stats in all_stats:
        prompts, conversations, responses, turns = (np.frombuffer(values, dtype=np.int32) for values in (
            stats.prompt_tokens, stats.conversation_tokens, stats.response_tokens, stats.turns))
        measured = conversations if stats.spec.data_class == "A" else prompts
        over = measured > context_length if stats.spec.data_class == "A" else measured >= context_length
        within = prompts[~over] if stats.spec.data_class == "B" else np.zeros(0, np.int32)
        short = int(sum(partition_of(int(p), long_prompt_threshold) == "short" for p in within))
        row: dict[str, Any] = {
            "source": stats.spec.name, "class": stats.spec.data_class, "multi_turn": stats.spec.multi_turn,
            "rows_read": stats.read, "rejected": sum(stats.rejects.values()), "duplicates": stats.duplicates,
            "kept": int(turns.size), "turns_mean": float(turns.mean()) if turns.size else float("nan"),
            "turns_max": int(turns.max()) if turns.size else 0,
        }
        row |= _quantiles(prompts, "prompt_tokens") | _quantiles(responses, "response_tokens")
        row |= _quantiles(conversations if stats.spec.data_class == "A" else np.zeros(0, np.int32), "conversation_tokens")
        row |= {"over_context_share": float(over.mean()) if over.size else 0.0,
                "short": short if stats.spec.data_class == "B" else 0,
                "long": int(within.size - short) if stats.spec.data_class == "B" else 0}
        rows.append(row)
    return pd.DataFrame(rows)


def _lengths(all_stats: list[_SourceStats]) -> pd.DataFrame:
    columns = ("turns", "prompt_tokens", "response_tokens", "conversation_tokens")  # _SourceStats' arrays
    frames = [pd.DataFrame({"source": stats.spec.name, **{name: np.frombuffer(getattr(stats, name), dtype=np.int32)
                                                           for name in columns}}) for stats in all_stats if stats.turns]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=["source", *columns])


def save_survey(result: SurveyTables, out_dir: Path) -> list[Path]:
    """Write summary.csv, summary.json and rejects.csv atomically into `out_dir` (the run directory)."""
    out_dir = Path(out_dir)
    paths = [out_dir / "survey_summary.csv", out_dir / "survey_summary.json", out_dir / "survey_rejects.csv"]
    with atomic_write(paths[0]) as handle:
        result.summary.to_csv(handle, index=False)
    write_json(paths[1], result.summary.to_dict(orient="records"))
    with atomic_write(paths[2]) as handle:
        result.rejects.to_csv(handle, index=False)
    return paths


def plot_survey(result: SurveyTables, figures_dir: Path) -> list[Path]:
    """Length histograms per source (log x), turns distribution, partition sizes; PNGs in `figures_dir`."""
    import matplotlib.pyplot as plt

    figures_dir = Path(figures_dir)
    figures_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    lengths = result.lengths
    for column in ("prompt_tokens", "response_tokens"):
        figure, axis = plt.subplots(figsize=(8, 4.5))
        positive = lengths[lengths[column] > 0]
        if not positive.empty:
            bins = np.logspace(0, np.log10(max(2, positive[column].max())) + 0.05, 50)
            for source, group in positive.groupby("source", sort=False):
                axis.hist(group[column], bins=bins, histtype="step", label=str(source))
            axis.legend(fontsize="small")
        axis.set_xscale("log")
        axis.set_xlabel(f"{column.replace('_', ' ')} (log)")
        axis.set_ylabel("conversations")
        axis.set_title(f"{column.replace('_', ' ')} per source")
        written.append(_save(figure, figures_dir / f"survey_{column}.png"))
    figure, axis = plt.subplots(figsize=(8, 4.5))
    for source, group in lengths.groupby("source", sort=False):
        counts = group["turns"].value_counts().sort_index()
        axis.plot(counts.index, counts.values, marker=".", label=str(source))
    axis.set_xscale("log")
    axis.set_yscale("log")
    axis.set_xlabel("messages per conversation")
    axis.set_ylabel("conversations")
    axis.legend(fontsize="small")
    written.append(_save(figure, figures_dir / "survey_turns.png"))
    figure, axis = plt.subplots(figsize=(8, 4.5))
    summary = result.summary.set_index("source")
    summary[["short", "long"]].plot.bar(stacked=True, ax=axis)
    axis.set_ylabel("class-B prompts")
    axis.set_title("partition sizes")
    written.append(_save(figure, figures_dir / "survey_partitions.png"))
    return written


def _save(figure: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    with atomic_write(path, "wb") as handle:
        figure.savefig(handle, format="png", dpi=110, bbox_inches="tight")
    plt.close(figure)
    return path
