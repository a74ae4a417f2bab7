"""Stage 3's training data: generations -> `tokenized_data.jsonl` per dataset (DESIGN contract).

From the target's raw token ids when the server returned them, else by the target's chat template
(`eaglekit.chat`). Every record's prompt and completion token counts are checked against the
server's `usage` (`prompt_tokens`, `completion_tokens`): a server whose template differs from the kit's
(e.g. no default system prompt) would train the draft on prompts the target never saw. A systematic
mismatch shows in the first answers: `check_first_answers` runs on a dataset's first
`EARLY_CHECK_ANSWERS` answers while generation runs and stops it there (UsageMismatchError), not after
the last answer. At the end, a record whose counts still disagree is left out of the training data
(rejects.jsonl, both counts named) and a share past `max_usage_disagreement` is a warning: a finished
generation never ends in this error.

A truncated answer (finish_reason "length") ends at its last generated token: no end-of-turn token is
appended. Re-tokenized from its text (a server without raw ids), the cut is not where the target's tokens
ended: the text of a cut answer can end inside a word or a UTF-8 character, and encoding it again merges or
splits the last tokens (on 1,003 ShareGPT answers cut at 96 tokens, counts off by -4 to +4, none further;
docs/long_runs.md). So for such a record a count within `TRUNCATION_BOUNDARY_TOKENS` of the server's is the
cut's boundary, not a disagreement, and its last `TRUNCATION_BOUNDARY_TOKENS` generated tokens get loss_mask
0: the draft never trains on a token the target may not have produced there. A record that cannot be tokenized
goes to `<tokenized_dir>/rejects.jsonl` (dataset, id, file, line, reason) under bad_input "skip", and stops
the stage under "fail".
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from eaglekit.generation.logs import GenerationLog
from eaglekit.generation.prompts import PromptSource
from eaglekit.generation.quality import QUALITY_FLAGS, TRUNCATED_POLICIES
from eaglekit.io import InputError, read_jsonl, write_jsonl

logger = logging.getLogger(__name__)

TRUNCATION_BOUNDARY_TOKENS = 4  # tokens at a cut re-tokenized text may merge or split (module docstring)
EARLY_CHECK_ANSWERS = 32  # a dataset's first answers checked against the server's usage while generation runs


@dataclass
class TokenizedDataSummary:
    """What build_tokenized_data wrote and dropped, per dataset, and how raw ids and the template compare."""

    files: dict[str, Path] = field(default_factory=dict)
    written: dict[str, int] = field(default_factory=dict)
    dropped: dict[str, dict[str, int]] = field(default_factory=dict)  # dataset -> reason -> count
    missing: dict[str, int] = field(default_factory=dict)  # unanswered prompts (errored or not yet generated)
    from_token_ids: int = 0  # samples built from the target's raw token ids
    from_chat_template: int = 0  # samples built by re-tokenizing text
    compared: int = 0  # samples with both raw ids and a re-tokenization
    disagreements: int = 0  # ... where the two token sequences differ
    disagreement_examples: list[str] = field(default_factory=list)  # first few ids that disagree
    usage_checked: dict[str, int] = field(default_factory=dict)  # records checked against the server's usage
    usage_disagreements: dict[str, int] = field(default_factory=dict)  # ... where a token count differs
    usage_examples: list[str] = field(default_factory=list)  # first few: "dataset/id: prompt 51 vs server 38"
    # dataset -> reason -> count (rejects.jsonl)
    rejected: dict[str, dict[str, int]] = field(default_factory=dict)

    def usage_table(self) -> list[dict]:
        return [{"dataset": dataset, "checked": checked, "disagree": self.usage_disagreements.get(dataset, 0),
                 "rejected": sum((self.rejected.get(dataset) or {}).values())}
                for dataset, checked in self.usage_checked.items()]


class UsageMismatchError(ValueError):
    """Token counts disagree with the server's usage in too many records of a dataset."""


def usage_disagreement(record: dict, prompt_count: int, completion_count: int, from_text: bool) -> str | None:
    """None when the kit's counts agree with the server's usage (or it gave none), else both counts in words.

    Servers differ on whether the end-of-turn token counts as a completion token. A truncated answer
    re-tokenized from its text may differ by up to TRUNCATION_BOUNDARY_TOKENS at the cut."""
    server_prompt, server_completion = record.get("prompt_tokens"), record.get("completion_tokens")
    if server_prompt is None or server_completion is None:
        return None
    if record.get("truncated") and from_text:
        completion_ok = abs(server_completion - completion_count) <= TRUNCATION_BOUNDARY_TOKENS
    else:
        completion_ok = server_completion in (completion_count, completion_count - 1)
    if server_prompt == prompt_count and completion_ok:
        return None
    return f"prompt {prompt_count} vs server {server_prompt}, completion {completion_count} vs server {server_completion}"


def _usage_error(dataset: str, disagree: int, checked: int, allowed: float, examples: list[str], when: str) -> str:
    return (f"{dataset}: {disagree} of {checked} {when} have prompt or completion token counts that differ from the "
            f"server's usage (allowed share {allowed}); e.g. {'; '.join(examples)[:600]}. The server's chat template or "
            "tokenizer is not the kit's: serve the target with its own template, or raise "
            "generation.max_usage_disagreement knowingly")


def check_first_answers(dataset: str, records: Sequence[dict], conversations: dict[str, dict], tokenizer,
                        max_usage_disagreement: float, template_kwargs: dict | None = None) -> int:
    """Re-tokenize a dataset's first answers and compare them with the server's usage; raise
    UsageMismatchError when more than max_usage_disagreement of them disagree (a systematic mismatch: stop
    now, not after the last answer).

    records: generation records (with text); conversations: the prompts by id. Returns how many were
    checked."""
    checked, examples = 0, []
    for record in records:
        conversation = conversations.get(record["id"])
        if conversation is None or record.get("prompt_tokens") is None or record.get("completion_tokens") is None:
            continue
        if record.get("token_ids") is not None and record.get("prompt_token_ids") is not None:
            continue  # trained on the server's own ids: what it saw is what the draft learns
        prompt_count, sample = _retokenize(tokenizer, conversation, record, template_kwargs)
        checked += 1
        if (words := usage_disagreement(record, prompt_count, sum(sample.loss_mask), from_text=True)) is not None:
            examples.append(f"{dataset}/{record['id']}: {words}")
    if checked and len(examples) / checked > max_usage_disagreement:
        raise UsageMismatchError(_usage_error(dataset, len(examples), checked, max_usage_disagreement, examples,
                                              "the first answers (checked while generating; generation stopped)"))
    return checked


def _mask_cut(loss_mask: list[int]) -> list[int]:
    """loss_mask 0 on the last TRUNCATION_BOUNDARY_TOKENS generated tokens (a truncated answer re-tokenized
    from text)."""
    cut = set([index for index, mask in enumerate(loss_mask) if mask][-TRUNCATION_BOUNDARY_TOKENS:])
    return [0 if index in cut else mask for index, mask in enumerate(loss_mask)]


def _conversation_messages(conversation: dict) -> list[dict]:
    keys = ("role", "content", "reasoning", "tool_calls", "tool_call_id", "name")
    return [{key: value for key, value in message.items() if key in keys} for message in conversation["messages"]]


def _retokenize(tokenizer, conversation: dict, record: dict, template_kwargs: dict | None):
    """(prompt token count, the sample) of conversation + answer by the target's chat template."""
    from eaglekit.chat import tokenize_answer  # the chat module owns templates

    answer = {"role": "assistant", "content": record.get("content") or "",
              **{key: record[key] for key in ("reasoning", "tool_calls") if record.get(key)}}
    return tokenize_answer(tokenizer, _conversation_messages(conversation), answer,
                           tools=(conversation.get("meta") or {}).get("tools"), truncated=bool(record.get("truncated")),
                           template_kwargs=template_kwargs)


def build_tokenized_data(output_dir: str | Path, sources: Sequence[PromptSource], tokenized_dir: str | Path,
                         tokenizer=None, truncated_policy: str = "keep", drop_flags: Iterable[str] = (),
                         use_token_ids: bool = True, max_examples: int = 10, bad_input: str = "skip",
                         max_usage_disagreement: float = 0.0, template_kwargs: dict | None = None
                         ) -> TokenizedDataSummary:
    """Write `tokenized_dir/<dataset>/tokenized_data.jsonl` from the answers in output_dir.

    With raw ids (and use_token_ids): input_ids = prompt_token_ids + token_ids, loss_mask 0 on the
    prompt and 1 on every generated token (the end-of-turn token the server returns included).
    Otherwise `eaglekit.chat.tokenize_conversation` renders conversation + answer (reasoning the way
    the template renders it). When both are possible (tokenizer given) they are compared on the
    prompt tokens and the generated (loss_mask == 1) tokens; truncated answers are not compared
    (the template closes the turn that the target never closed).
    truncated_policy: "keep" (meta.truncated = True) or "drop". drop_flags: quality flags to drop.
    bad_input: "skip" (rejects.jsonl) or "fail" (raise, naming dataset, id, file and line).
    max_usage_disagreement: the share of a dataset's records whose prompt or completion token count may
        differ from the server's usage (`usage_disagreement`) before a warning; each such record is left
        out (rejects.jsonl, field "usage"). The error that stops generation comes early, from
        `check_first_answers`.
    """
    from eaglekit.chat import ChatTemplateError

    drop_flags = _checked_options(bad_input, truncated_policy, drop_flags)
    records = GenerationLog(output_dir)  # byte offsets only: a multi-GB log is never held in memory
    tokenized_dir = Path(tokenized_dir)
    summary = TokenizedDataSummary()
    conversations: dict[str, list[tuple[dict, str, int]]] = defaultdict(list)
    for source in sources:
        for line, conversation in read_jsonl(source.path):
            conversations[source.dataset].append((conversation, str(source.path), line))
    rejects = []
    for dataset, dataset_conversations in conversations.items():
        dropped: Counter = Counter()
        rejected: Counter = Counter()
        missing = checked = disagree = 0
        samples = []
        for conversation, path, line in dataset_conversations:
            label = f"{dataset}/{conversation['id']}"
            record = records.get((dataset, conversation["id"]))
            if record is None:
                missing += 1
                continue
            if skipped := _dropped_because(record, truncated_policy, drop_flags):
                dropped[skipped] += 1
                continue
            raw_ids = use_token_ids and record.get("token_ids") is not None and record.get("prompt_token_ids") is not None
            try:
                retokenized = _retokenize(tokenizer, conversation, record, template_kwargs) \
                    if tokenizer is not None else None
            except ChatTemplateError as error:
                if not raw_ids:  # with raw ids the server's own ids stand; only the comparison is lost
                    where = InputError(path, line, "messages", f"{label}: chat template: {error}")
                    if bad_input == "fail":
                        raise where from None
                    rejected["chat template"] += 1
                    rejects.append({"dataset": dataset, "id": conversation["id"], **where.as_record()})
                    continue
                retokenized = None
            input_ids, loss_mask, prompt_count, completion_count = _sample_tokens(
                record, retokenized, raw_ids, summary, label, max_examples)
            if record.get("prompt_tokens") is not None and record.get("completion_tokens") is not None:
                checked += 1
            if (words := usage_disagreement(record, prompt_count, completion_count, from_text=not raw_ids)) is not None:
                disagree += 1
                if len(summary.usage_examples) < max_examples:
                    summary.usage_examples.append(f"{label}: {words}")
                rejected["usage"] += 1
                rejects.append({"dataset": dataset, "id": conversation["id"], "file": path, "line": line, "field": "usage",
                                "reason": f"token counts differ from the server's usage: {words}"})
                continue
            samples.append(_training_sample(conversation, dataset, record, input_ids, loss_mask, raw_ids))
        summary.files[dataset] = path = tokenized_dir / dataset / "tokenized_data.jsonl"
        summary.written[dataset] = write_jsonl(path, samples)
        summary.dropped[dataset], summary.missing[dataset], summary.rejected[dataset] = dict(dropped), missing, dict(rejected)
        summary.usage_checked[dataset], summary.usage_disagreements[dataset] = checked, disagree
    records.close()
    write_jsonl(tokenized_dir / "rejects.jsonl", rejects)
    _warn_on_usage(summary, tokenized_dir / "rejects.jsonl", max_usage_disagreement)
    return summary


def _training_sample(conversation: dict, dataset: str, record: dict, input_ids: list[int], loss_mask: list[int],
                     raw_ids: bool) -> dict:
    """One tokenized_data.jsonl line. A truncated answer re-tokenized from text has its cut's tokens
    masked."""
    if record.get("truncated") and not raw_ids:
        loss_mask = _mask_cut(loss_mask)
    return {"id": conversation["id"], "input_ids": input_ids, "loss_mask": loss_mask,
            "source": conversation.get("source", dataset),
            "meta": {**(conversation.get("meta") or {}), "dataset": dataset,
                     "partition": record["partition"], "finish_reason": record["finish_reason"],
                     "truncated": bool(record.get("truncated")), "flags": record.get("flags", []),
                     "token_source": "target" if raw_ids else "chat_template"}}


def _checked_options(bad_input: str, truncated_policy: str, drop_flags: Iterable[str]) -> set[str]:
    """The drop flags as a set, once every option is one build_tokenized_data knows."""
    if bad_input not in ("skip", "fail"):
        raise ValueError(f"bad_input must be 'skip' or 'fail', got {bad_input!r}")
    if truncated_policy not in TRUNCATED_POLICIES:
        raise ValueError(f"truncated_policy must be one of {TRUNCATED_POLICIES}, got {truncated_policy!r}")
    drop_flags = set(drop_flags)
    if unknown := drop_flags - set(QUALITY_FLAGS):
        raise ValueError(f"unknown drop_flags {sorted(unknown)}; known: {QUALITY_FLAGS}")
    return drop_flags


def _dropped_because(record: dict, truncated_policy: str, drop_flags: set[str]) -> str | None:
    """Why the answer stays out of the training data by the user's choice ("truncated", a flag), else None."""
    if record.get("truncated") and truncated_policy == "drop":
        return "truncated"
    if flagged := drop_flags.intersection(record.get("flags", [])):
        return sorted(flagged)[0]
    return None


def _sample_tokens(record: dict, retokenized, raw_ids: bool, summary: TokenizedDataSummary, label: str,
                   max_examples: int) -> tuple[list[int], list[int], int, int]:
    """(input_ids, loss_mask, prompt tokens, completion tokens) of one answer: the server's raw ids when there
    are some (compared with the re-tokenized text where both exist and the answer is whole), else the chat
    template's."""
    if raw_ids:
        prompt_ids, completion_ids = list(record["prompt_token_ids"]), list(record["token_ids"])
        summary.from_token_ids += 1
        if retokenized is not None and not record.get("truncated"):
            summary.compared += 1
            sample = retokenized[1]
            generated = [token for token, mask in zip(sample.input_ids, sample.loss_mask) if mask]
            if list(sample.input_ids[:len(prompt_ids)]) != prompt_ids or generated != completion_ids:
                summary.disagreements += 1
                if len(summary.disagreement_examples) < max_examples:
                    summary.disagreement_examples.append(label)
        loss_mask = [0] * len(prompt_ids) + [1] * len(completion_ids)
        return prompt_ids + completion_ids, loss_mask, len(prompt_ids), len(completion_ids)
    if retokenized is not None:
        prompt_count, sample = retokenized
        summary.from_chat_template += 1
        return list(sample.input_ids), list(sample.loss_mask), prompt_count, sum(sample.loss_mask)
    raise ValueError(f"{label}: the server returned no token ids; pass the "
                     "target's tokenizer so the answer is re-tokenized with its chat template")


def _warn_on_usage(summary: TokenizedDataSummary, rejects_path: Path, max_usage_disagreement: float) -> None:
    """A warning per dataset whose share of answers disagreeing with the server's usage passed the limit."""
    for dataset, checked in summary.usage_checked.items():
        disagree = summary.usage_disagreements[dataset]
        if checked and disagree / checked > max_usage_disagreement:
            examples = [example for example in summary.usage_examples if example.startswith(dataset + "/")]
            logger.warning("%s; those records are left out of the training data (%s)", _usage_error(
                dataset, disagree, checked, max_usage_disagreement, examples, "records"), rejects_path)
    if summary.compared:
        logger.info("raw token ids vs re-tokenized text: %d of %d disagree", summary.disagreements, summary.compared)
