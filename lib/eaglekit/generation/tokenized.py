"""Stage 3's training data: generations -> `tokenized_data.jsonl` per dataset (DESIGN contract).

From the target's raw token ids when the server returned them, else by the target's chat template
(`eaglekit.chat`). Every record's prompt and completion token counts are checked against the
server's `usage` (`prompt_tokens`, `completion_tokens`): disagreements are counted per dataset and
the stage fails when a dataset's share passes `max_usage_disagreement` (a server whose template
differs from the kit's, e.g. no default system prompt, trains the draft on prompts the target never
saw). A truncated answer (finish_reason "length") ends at its last generated token: no end-of-turn
token is appended. A record that cannot be tokenized goes to `<tokenized_dir>/rejects.jsonl`
(dataset, id, file, line, reason) under bad_input "skip", and stops the stage under "fail".
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from eaglekit.generation.logs import GenerationLog
from eaglekit.generation.prompts import PromptSource
from eaglekit.generation.quality import QUALITY_FLAGS, TRUNCATED_POLICIES
from eaglekit.io import InputError, read_jsonl, write_jsonl

logger = logging.getLogger(__name__)


@dataclass
class TokenizedDataSummary:
    """What build_tokenized_data wrote and dropped, per dataset, and how raw ids and the template compare."""

    files: dict[str, Path]
    written: dict[str, int]
    dropped: dict[str, dict[str, int]]          # dataset -> reason -> count
    missing: dict[str, int]                     # prompts with no answer (errors or not yet generated)
    from_token_ids: int                         # samples built from the target's raw token ids
    from_chat_template: int                     # samples built by re-tokenizing text
    compared: int                               # samples with both raw ids and a re-tokenization
    disagreements: int                          # ... where the two token sequences differ
    disagreement_examples: list[str]            # first few ids that disagree
    usage_checked: dict[str, int] = None        # records whose counts were checked against the server's usage
    usage_disagreements: dict[str, int] = None  # ... where the prompt or completion token count differs
    usage_examples: list[str] = None            # first few: "dataset/id: prompt 51 vs server 38"
    rejected: dict[str, dict[str, int]] = None  # dataset -> reason -> count (rejects.jsonl)

    def usage_table(self) -> list[dict]:
        return [{"dataset": dataset, "checked": checked, "disagree": self.usage_disagreements.get(dataset, 0),
                 "rejected": sum((self.rejected.get(dataset) or {}).values())}
                for dataset, checked in self.usage_checked.items()]


class UsageMismatchError(ValueError):
    """Token counts disagree with the server's usage in too many records of a dataset."""


def _conversation_messages(conversation: dict) -> list[dict]:
    keys = ("role", "content", "reasoning", "tool_calls", "tool_call_id", "name")
    return [{key: value for key, value in message.items() if key in keys} for message in conversation["messages"]]


def _retokenize(tokenizer, conversation: dict, record: dict, template_kwargs: dict | None):
    """(prompt token count, the sample) of conversation + answer by the target's chat template."""
    from eaglekit.chat import tokenize_answer  # the chat module owns templates

    answer = {"role": "assistant", "content": record.get("content") or ""}
    if record.get("reasoning"):
        answer["reasoning"] = record["reasoning"]
    if record.get("tool_calls"):
        answer["tool_calls"] = record["tool_calls"]
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
        differ from the server's usage before UsageMismatchError stops the stage (checked where the
        record carries usage counts; the completion may count the end-of-turn token or not).
    """
    from eaglekit.chat import ChatTemplateError

    if bad_input not in ("skip", "fail"):
        raise ValueError(f"bad_input must be 'skip' or 'fail', got {bad_input!r}")
    if truncated_policy not in TRUNCATED_POLICIES:
        raise ValueError(f"truncated_policy must be one of {TRUNCATED_POLICIES}, got {truncated_policy!r}")
    drop_flags = set(drop_flags)
    if unknown := drop_flags - set(QUALITY_FLAGS):
        raise ValueError(f"unknown drop_flags {sorted(unknown)}; known: {QUALITY_FLAGS}")
    records = GenerationLog(output_dir)  # byte offsets only: a multi-GB log is never held in memory
    tokenized_dir = Path(tokenized_dir)
    summary = TokenizedDataSummary(files={}, written={}, dropped={}, missing={}, from_token_ids=0,
                                   from_chat_template=0, compared=0, disagreements=0, disagreement_examples=[],
                                   usage_checked={}, usage_disagreements={}, usage_examples=[], rejected={})
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
            record = records.get((dataset, conversation["id"]))
            if record is None:
                missing += 1
                continue
            if record.get("truncated") and truncated_policy == "drop":
                dropped["truncated"] += 1
                continue
            if flagged := drop_flags.intersection(record.get("flags", [])):
                dropped[sorted(flagged)[0]] += 1
                continue
            raw_ids = use_token_ids and record.get("token_ids") is not None and record.get("prompt_token_ids") is not None
            try:
                retokenized = _retokenize(tokenizer, conversation, record, template_kwargs) \
                    if tokenizer is not None else None
            except ChatTemplateError as error:
                if raw_ids:  # the server's own ids stand; only the comparison with the template is lost
                    retokenized = None
                else:
                    where = InputError(path, line, "messages",
                                       f"{dataset}/{conversation['id']}: chat template: {error}")
                    if bad_input == "fail":
                        raise where from None
                    rejected["chat template"] += 1
                    rejects.append({"dataset": dataset, "id": conversation["id"], **where.as_record()})
                    continue
            if raw_ids:
                prompt_ids, completion_ids = list(record["prompt_token_ids"]), list(record["token_ids"])
                input_ids = prompt_ids + completion_ids
                loss_mask = [0] * len(prompt_ids) + [1] * len(completion_ids)
                summary.from_token_ids += 1
                if retokenized is not None and not record.get("truncated"):
                    summary.compared += 1
                    sample = retokenized[1]
                    generated = [token for token, mask in zip(sample.input_ids, sample.loss_mask) if mask]
                    if list(sample.input_ids[:len(prompt_ids)]) != prompt_ids or generated != completion_ids:
                        summary.disagreements += 1
                        if len(summary.disagreement_examples) < max_examples:
                            summary.disagreement_examples.append(f"{dataset}/{conversation['id']}")
                prompt_count, completion_count = len(prompt_ids), len(completion_ids)
            elif retokenized is not None:
                prompt_count, sample = retokenized
                input_ids, loss_mask = list(sample.input_ids), list(sample.loss_mask)
                completion_count = sum(loss_mask)
                summary.from_chat_template += 1
            else:
                raise ValueError(f"{dataset}/{conversation['id']}: the server returned no token ids; pass the "
                                 "target's tokenizer so the answer is re-tokenized with its chat template")
            server_prompt, server_completion = record.get("prompt_tokens"), record.get("completion_tokens")
            if server_prompt is not None and server_completion is not None:
                checked += 1
                # Servers differ on whether the end-of-turn token counts as a completion token.
                completion_ok = server_completion in (completion_count, completion_count - 1)
                if server_prompt != prompt_count or not completion_ok:
                    disagree += 1
                    if len(summary.usage_examples) < max_examples:
                        summary.usage_examples.append(
                            f"{dataset}/{conversation['id']}: prompt {prompt_count} vs server {server_prompt}, "
                            f"completion {completion_count} vs server {server_completion}")
            samples.append({"id": conversation["id"], "input_ids": input_ids, "loss_mask": loss_mask,
                            "source": conversation.get("source", dataset),
                            "meta": {**(conversation.get("meta") or {}), "dataset": dataset,
                                     "partition": record["partition"], "finish_reason": record["finish_reason"],
                                     "truncated": bool(record.get("truncated")), "flags": record.get("flags", []),
                                     "token_source": "target" if raw_ids else "chat_template"}})
        path = tokenized_dir / dataset / "tokenized_data.jsonl"
        summary.written[dataset] = write_jsonl(path, samples)
        summary.files[dataset] = path
        summary.dropped[dataset] = dict(dropped)
        summary.missing[dataset] = missing
        summary.rejected[dataset] = dict(rejected)
        summary.usage_checked[dataset] = checked
        summary.usage_disagreements[dataset] = disagree
    records.close()
    write_jsonl(tokenized_dir / "rejects.jsonl", rejects)
    for dataset, checked in summary.usage_checked.items():
        disagree = summary.usage_disagreements[dataset]
        if checked and disagree / checked > max_usage_disagreement:
            raise UsageMismatchError(
                f"{dataset}: {disagree} of {checked} records have prompt or completion token counts that differ "
                f"from the server's usage (allowed share {max_usage_disagreement}); e.g. "
                f"{'; '.join(e for e in summary.usage_examples if e.startswith(dataset + '/'))[:600]}. The server's "
                "chat template or tokenizer is not the kit's: serve the target with its own template, or raise "
                "generation.max_usage_disagreement knowingly")
    if summary.compared:
        logger.info("raw token ids vs re-tokenized text: %d of %d disagree", summary.disagreements, summary.compared)
    return summary
