"""Prompt prep (stage 2): normalize, deduplicate, id, split class A / B, tokenize A, partition B.

Output layout under `out_dir` (the stage folder), all of it written into a sibling staging folder
and swapped into place at the end, so an interrupted prep leaves the previous complete output (or
nothing) and never a half-written file:

    <out_dir>/<source>/tokenized_data.jsonl    class A: {"id", "input_ids", "loss_mask", "source", "meta"}
    <out_dir>/<source>/prompts.short.jsonl     class B: conversations ending in the prompt to answer,
    <out_dir>/<source>/prompts.long.jsonl      split by measured prompt tokens (<= threshold: short)
    <out_dir>/rejects.jsonl                    one line per rejected record: source, file, line,
                                               record, field, reason
    <out_dir>/summary.json                     per-source counts and the settings used (written last)

Ids are `<source>-<first 16 hex of sha256>` over the normalized messages that are kept (the whole
conversation for class A, the prompt for class B), so they survive reordering and re-runs. A class-A
conversation whose chat template rewrites history is written as several samples under `history:
split` (`<id>.0`, `<id>.1`, ... with `meta.conversation_id`, `meta.sample` and `meta.samples`; see
eaglekit.chat).

A conversation the target's chat template cannot render is a rejected record (file, line, the
template's reason) like any other bad input; under `bad_input: fail` it stops the stage with that
message. A killed prep's staging folder is removed by the next prep (its process is gone).
Deduplication is global over sources in the given order: a later copy counts as a duplicate of its
own source and is not written.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import pandas as pd

from eaglekit.chat import (
    ChatTemplateError,
    TokenizedConversation,
    prompt_token_count,
    template_family,
    tokenize_answer,
    tokenize_conversation,
)
from eaglekit.config import PrepParams
from eaglekit.io import InputError, pid_alive, write_json
from eaglekit.data.readers import RecordLocation
from eaglekit.data.sources import Reject, SourceRecord, SourceSpec, iter_source, prompt_messages


def prep_settings(prep: PrepParams | None, fields: dict[str, Any]) -> PrepParams:
    """The `prep` section itself, or one validated from its fields given as keywords (not both)."""
    if prep is not None and fields:
        raise TypeError(f"pass the prep section or its fields, not both (got prep and {sorted(fields)})")
    return prep if prep is not None else PrepParams(**fields)


def content_hash(messages: Sequence[dict]) -> str:
    """sha256 hex of the canonical JSON of (role, content, reasoning[, tool_calls,
    tool_call_id]) per message."""
    canonical = [[m["role"], m["content"], m.get("reasoning", "")]
                 + ([m.get("tool_calls"), m.get("tool_call_id")] if m.get("tool_calls") or m.get("tool_call_id") else [])
                 for m in messages]
    return hashlib.sha256(json.dumps(canonical, ensure_ascii=False, separators=(",", ":")).encode("utf-8")).hexdigest()


def conversation_id(source: str, digest: str) -> str:
    return f"{source}-{digest[:16]}"


def partition_of(prompt_tokens: int, long_prompt_threshold: int) -> str:
    """short when the prompt fits the threshold, else long (by measured tokens, never by dataset)."""
    return "short" if prompt_tokens <= long_prompt_threshold else "long"


@dataclass
class SourceCounts:
    source: str
    data_class: str
    read: int = 0
    kept: int = 0
    duplicates: int = 0
    rejected: int = 0
    rejected_by_reason: dict[str, int] = field(default_factory=dict)
    partitions: dict[str, int] = field(default_factory=dict)  # class B: short/long counts
    tokens: int = 0  # class A: tokens written; class B: prompt tokens
    split: int = 0  # class A conversations written as several samples (the template rewrites history)
    samples: int = 0  # class A samples written
    generated_tokens: int = 0  # class A: tokens the target generated (every assistant turn as generated)
    trained_tokens: int = 0  # class A: tokens with loss_mask 1 (equal to generated under history "split")
    template_family: str = ""
    # class B: dataset answers the template cannot render (listed in rejects.jsonl)
    original_rejected: int = 0
    # class A: assistant turns of kept conversations that the template leaves undefined (eaglekit.chat's
    # rejected_turns: context with mask 0, not trained), each listed in rejects.jsonl as messages[i]
    rejected_turns: int = 0


@dataclass
class PrepSummary:
    out_dir: Path
    sources: list[SourceCounts]
    context_length: int
    long_prompt_threshold: int

    def table(self) -> pd.DataFrame:
        """One row per source: read, kept, duplicates, rejected, short, long, tokens."""
        return pd.DataFrame([
            {"source": counts.source, "class": counts.data_class, "read": counts.read, "kept": counts.kept,
             "duplicates": counts.duplicates, "rejected": counts.rejected,
             "short": counts.partitions.get("short", 0), "long": counts.partitions.get("long", 0),
             "tokens": counts.tokens, "template": counts.template_family, "split": counts.split,
             "samples": counts.samples, "rejected turns": counts.rejected_turns,
             "trained/generated": (round(counts.trained_tokens / counts.generated_tokens, 4)
                                   if counts.generated_tokens else None)}
            for counts in self.sources])

    def rejects_by_reason(self) -> pd.DataFrame:
        return rejects_table((counts.source, counts.rejected_by_reason) for counts in self.sources)


def rejects_table(reasons_by_source: Iterable[tuple[str, Mapping[str, int]]]) -> pd.DataFrame:
    """One row per source and reason (sorted within a source): source, reason, count."""
    return pd.DataFrame([{"source": source, "reason": reason, "count": count} for source, reasons in reasons_by_source
                         for reason, count in sorted(reasons.items())], columns=["source", "reason", "count"])


class _Outputs:
    """Lazily opened output files inside the staging folder."""

    def __init__(self, staging: Path):
        self.staging = staging
        self.handles: dict[Path, IO] = {}

    def write(self, relative: str, record: dict) -> None:
        path = self.staging / relative
        handle = self.handles.get(path)
        if handle is None:
            path.parent.mkdir(parents=True, exist_ok=True)
            handle = self.handles[path] = open(path, "w", encoding="utf-8")
        handle.write(json.dumps(record, ensure_ascii=False) + "\n")

    def close(self) -> None:
        for handle in self.handles.values():
            handle.flush()
            os.fsync(handle.fileno())
            handle.close()
        self.handles.clear()


def _remove_stale_staging(out_dir: Path) -> None:
    """Remove staging and old folders that a killed prep left beside `out_dir` (their process is gone)."""
    for path in out_dir.parent.glob(f".{out_dir.name}.*"):
        match = re.search(r"\.(?:staging|old)-(\d+)", path.name)
        if match is None or not path.is_dir():
            continue
        pid = int(match.group(1))
        if pid != os.getpid() and pid_alive(pid):
            continue
        shutil.rmtree(path, ignore_errors=True)


def _swap_into_place(staging: Path, out_dir: Path) -> None:
    """Replace `out_dir` by the finished staging folder (rename; the old output is removed after)."""
    previous = None
    if out_dir.exists():
        previous = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
        out_dir.rename(previous)
    staging.rename(out_dir)
    if previous is not None:
        shutil.rmtree(previous)


def prepare_sources(
    specs: Sequence[SourceSpec],
    tokenizer: Any,
    out_dir: Path,
    prep: PrepParams | None = None,
    **fields: Any,
) -> PrepSummary:
    """Run prompt prep over `specs` with the target's tokenizer and write the stage folder atomically.

    prep: the `prep` params section; or its fields as keywords (`context_length=256, ...`), validated
    into one by PrepParams (an unknown key or a wrong value fails there, naming it). Its fields:
    context_length: target context; class-A conversations with more tokens, and class-B prompts with
        at least this many (no room to answer), are rejected as "longer than the context".
    long_prompt_threshold: class-B prompts with more tokens go to the `long` partition.
    bad_input: "skip" counts and lists bad records in rejects.jsonl; "fail" raises the first
        InputError (file, line, field) and writes nothing.
    original_answers: for class B, also tokenize the dataset's own answer to each kept prompt into
        `<source>/original_tokenized_data.jsonl` (same ids), for the original-vs-regenerated ablation.
    history: class A conversations whose template rewrites earlier turns: "split" into one sample per
        stretch the template renders as generated (ids `<id>.<k>`), or "visible" (one sample, only what
        the template shows is trained). See eaglekit.chat.
    chat_template_kwargs: passed to the template (e.g. {"thinking": true} for DeepSeek-V3.1).
    A conversation the template cannot render is a rejected record (file, line, reason), never a
    failed stage, under bad_input "skip".
    """
    settings = prep_settings(prep, fields)
    context_length, long_prompt_threshold = settings.context_length, settings.long_prompt_threshold
    bad_input, history, chat_template_kwargs = settings.bad_input, settings.history, settings.chat_template_kwargs
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"source names must be unique (they name output folders): {names}")
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_staging(out_dir)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.staging-{os.getpid()}-", dir=out_dir.parent))
    family = template_family(tokenizer, chat_template_kwargs)
    outputs = _Outputs(staging)
    seen: set[bytes] = set()
    all_counts: list[SourceCounts] = []
    try:
        for spec in specs:
            counts = SourceCounts(source=spec.name, data_class=spec.data_class, template_family=family)
            all_counts.append(counts)
            rejected_by_reason: Counter[str] = Counter()

            def reject(rejected: Reject, answer: bool = False) -> None:
                """A bad record into rejects.jsonl (`answer`: a class-B dataset answer, its prompt kept)."""
                if bad_input == "fail":
                    raise rejected.error
                if answer:
                    counts.original_rejected += 1
                else:
                    counts.rejected += 1
                    rejected_by_reason[rejected.reason_kind] += 1
                outputs.write("rejects.jsonl", {"source": spec.name, **rejected.as_record()})

            for item in iter_source(spec):
                counts.read += 1
                if isinstance(item, Reject):
                    reject(item)
                    continue
                _prepare_record(spec, item, tokenizer, counts, seen, outputs, reject, settings)
            counts.rejected_by_reason = dict(rejected_by_reason)
        outputs.close()
        summary = PrepSummary(out_dir, all_counts, context_length, long_prompt_threshold)
        write_json(staging / "summary.json", {"context_length": context_length, "long_prompt_threshold": long_prompt_threshold,
                                              "bad_input": bad_input, "history": history, "template_family": family,
                                              "sources": [asdict(c) for c in all_counts]})
        _swap_into_place(staging, out_dir)
        return summary
    except BaseException:
        outputs.close()
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _rejected(location: RecordLocation, reason: str, field_name: str = "messages") -> Reject:
    """The record at `location` rejected for `reason`, naming its messages (or `field_name` in them)."""
    return Reject(InputError(location.path, location.line, field_name, reason), location.record)


def _prepare_record(spec: SourceSpec, item: SourceRecord, tokenizer: Any, counts: SourceCounts, seen: set[bytes],
                    outputs: _Outputs, reject, settings: PrepParams) -> None:
    location = item.location
    original_answer = None
    if spec.data_class == "A":
        if not any(m["role"] == "assistant" for m in item.messages):
            reject(_rejected(location, "no assistant turn (class A needs one)"))
            return
        kept_messages = item.messages
    else:
        kept_messages, original_answer = prompt_messages(item.messages, spec.multi_turn)
    digest = content_hash(kept_messages)
    key = bytes.fromhex(digest[:32])
    if key in seen:
        counts.duplicates += 1
        return
    record_id = conversation_id(spec.name, digest)
    prepare = _prepare_class_a if spec.data_class == "A" else _prepare_class_b
    if prepare(spec, item, kept_messages, original_answer, record_id, tokenizer, counts, outputs, reject, settings):
        seen.add(key)


def _prepare_class_a(spec: SourceSpec, item: SourceRecord, kept_messages: list, _answer, record_id: str, tokenizer: Any,
                     counts: SourceCounts, outputs: _Outputs, reject, settings: PrepParams) -> bool:
    """A conversation already in the target's words: tokenized whole (split where the template
    needs it). True: kept."""
    location, context_length = item.location, settings.context_length
    try:
        result = tokenize_conversation(tokenizer, kept_messages, tools=item.meta.get("tools"), history=settings.history,
                                       template_kwargs=settings.chat_template_kwargs)
    except ChatTemplateError as error:
        reject(_rejected(location, f"chat template: {error}"))
        return False
    longest = max(len(sample.input_ids) for sample in result.samples)
    if longest > context_length:
        reject(_rejected(location, f"longer than the context ({longest} tokens > {context_length})"))
        return False
    counts.kept += 1
    for index, reason in result.rejected_turns:
        # a template limit, not bad input: listed under any bad_input policy
        counts.rejected_turns += 1
        turn = _rejected(location, f"chat template turn not trained: {reason}", f"messages[{index}]")
        outputs.write("rejects.jsonl", {"source": spec.name, **turn.as_record()})
    counts.split += result.split
    counts.samples += len(result.samples)
    counts.generated_tokens += result.generated_tokens
    counts.trained_tokens += result.trained_tokens
    for index, sample in enumerate(result.samples):
        counts.tokens += len(sample.input_ids)
        # Split samples name their conversation, so held-out selection can keep them together.
        sample_meta = item.meta if not result.split else {**item.meta, "conversation_id": record_id,
                                                           "sample": index, "samples": len(result.samples)}
        outputs.write(f"{spec.name}/tokenized_data.jsonl", {
            "id": record_id if not result.split else f"{record_id}.{index}", "input_ids": sample.input_ids,
            "loss_mask": sample.loss_mask, "source": spec.name, "meta": sample_meta})
    return True


def _prepare_class_b(spec: SourceSpec, item: SourceRecord, kept_messages: list, original_answer, record_id: str, tokenizer: Any,
                     counts: SourceCounts, outputs: _Outputs, reject, settings: PrepParams) -> bool:
    """A prompt for the target to answer, in its partition's file; its dataset answer tokenized beside it
    (prep.original_answers). True: kept."""
    location, context_length = item.location, settings.context_length
    tools, template_kwargs = item.meta.get("tools"), settings.chat_template_kwargs
    try:
        prompt_tokens = prompt_token_count(tokenizer, kept_messages, tools=tools, template_kwargs=template_kwargs)
    except ChatTemplateError as error:
        reject(_rejected(location, f"chat template: {error}"))
        return False
    if prompt_tokens >= context_length:
        reason = f"longer than the context (prompt of {prompt_tokens} tokens >= {context_length})"
        reject(_rejected(location, reason))
        return False
    partition = partition_of(prompt_tokens, settings.long_prompt_threshold)
    counts.kept += 1
    counts.tokens += prompt_tokens
    counts.partitions[partition] = counts.partitions.get(partition, 0) + 1
    meta = {**item.meta, "prompt_tokens": prompt_tokens, "partition": partition, "multi_turn": spec.multi_turn}
    outputs.write(f"{spec.name}/prompts.{partition}.jsonl",
                  {"id": record_id, "source": spec.name, "messages": kept_messages, "meta": meta})
    if settings.original_answers and original_answer is not None:
        try:
            _, original = tokenize_answer(tokenizer, kept_messages, original_answer, tools=tools,
                                          template_kwargs=template_kwargs)
        except ChatTemplateError as error:
            # The prompt is kept for regeneration; only the ablation loses this answer (listed, counted).
            reject(_rejected(location, f"chat template (dataset answer, prompt kept): {error}"), answer=True)
            return True
        outputs.write(f"{spec.name}/original_tokenized_data.jsonl", {
            "id": record_id, "input_ids": original.input_ids[:context_length],
            "loss_mask": original.loss_mask[:context_length], "source": spec.name,
            "meta": {**meta, "origin": "dataset answer"}})
    return True


def plot_partitions(summary: PrepSummary, figure_path: Path) -> Path:
    """Class-B prompts per source, stacked by partition (what stage 3 will regenerate); a PNG
    at `figure_path`."""
    import matplotlib.pyplot as plt

    table = summary.table()
    class_b = table[table["class"] == "B"].set_index("source")
    figure, axis = plt.subplots(figsize=(7, 3.5))
    class_b[["short", "long"]].plot.barh(stacked=True, ax=axis)
    axis.set_xlabel("prompts")
    axis.set_title(f"class-B prompts by partition (long > {summary.long_prompt_threshold} prompt tokens)")
    figure.tight_layout()
    figure_path = Path(figure_path)
    figure_path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(figure_path, dpi=120)
    plt.close(figure)
    return figure_path


def first_sample(out_dir: Path) -> TokenizedConversation | None:
    """The first class-A sample written by a finished prep (for display), or None."""
    for path in sorted(Path(out_dir).glob("*/tokenized_data.jsonl")):
        with open(path, encoding="utf-8") as handle:
            line = handle.readline()
        if line.strip():
            record = json.loads(line)
            return TokenizedConversation(record["input_ids"], record["loss_mask"])
    return None
