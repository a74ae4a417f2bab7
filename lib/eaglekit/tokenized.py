"""Stage 3's training data: generations -> `tokenized_data.jsonl` per dataset (DESIGN contract).

From the target's raw token ids when the server returned them, else by the target's chat template
(`eaglekit.chat`). Both paths are compared when both are possible.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from eaglekit.generation import QUALITY_FLAGS, TRUNCATED_POLICIES, PromptSource, read_generations
from eaglekit.io import read_jsonl, write_jsonl

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


def _retokenize(tokenizer, conversation_messages: list[dict], record: dict):
    from eaglekit.chat import tokenize_conversation  # the chat module owns how templates render reasoning

    answer = {"role": "assistant", "content": record["content"]}
    if record.get("reasoning"):
        answer["reasoning"] = record["reasoning"]
    return tokenize_conversation(tokenizer, [*conversation_messages, answer])


def build_tokenized_data(output_dir: str | Path, sources: Sequence[PromptSource], tokenized_dir: str | Path,
                         tokenizer=None, truncated_policy: str = "keep", drop_flags: Iterable[str] = (),
                         use_token_ids: bool = True, max_examples: int = 10) -> TokenizedDataSummary:
    """Write `tokenized_dir/<dataset>/tokenized_data.jsonl` from the answers in output_dir.

    With raw ids (and use_token_ids): input_ids = prompt_token_ids + token_ids, loss_mask 0 on the
    prompt and 1 on every generated token (the end-of-turn token the server returns included).
    Otherwise `eaglekit.chat.tokenize_conversation` renders conversation + answer (reasoning the way
    the template renders it). When both are possible (tokenizer given) they are compared on the
    prompt tokens and the generated (loss_mask == 1) tokens; truncated answers are not compared
    (the template closes the turn that the target never closed).
    truncated_policy: "keep" (meta.truncated = True) or "drop". drop_flags: quality flags to drop.
    """
    if truncated_policy not in TRUNCATED_POLICIES:
        raise ValueError(f"truncated_policy must be one of {TRUNCATED_POLICIES}, got {truncated_policy!r}")
    drop_flags = set(drop_flags)
    if unknown := drop_flags - set(QUALITY_FLAGS):
        raise ValueError(f"unknown drop_flags {sorted(unknown)}; known: {QUALITY_FLAGS}")
    records = read_generations(output_dir)
    tokenized_dir = Path(tokenized_dir)
    summary = TokenizedDataSummary(files={}, written={}, dropped={}, missing={}, from_token_ids=0,
                                   from_chat_template=0, compared=0, disagreements=0, disagreement_examples=[])
    conversations: dict[str, list[tuple[dict, str]]] = defaultdict(list)
    for source in sources:
        for _, conversation in read_jsonl(source.path):
            conversations[source.dataset].append((conversation, source.partition))
    for dataset, dataset_conversations in conversations.items():
        dropped: Counter = Counter()
        missing = 0
        samples = []
        for conversation, _partition in dataset_conversations:
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
            messages = [{key: value for key, value in message.items() if key in ("role", "content", "reasoning")}
                        for message in conversation["messages"]]
            raw_ids = use_token_ids and record.get("token_ids") is not None and record.get("prompt_token_ids") is not None
            retokenized = _retokenize(tokenizer, messages, record) if tokenizer is not None else None
            if raw_ids:
                prompt_ids, completion_ids = list(record["prompt_token_ids"]), list(record["token_ids"])
                input_ids = prompt_ids + completion_ids
                loss_mask = [0] * len(prompt_ids) + [1] * len(completion_ids)
                summary.from_token_ids += 1
                if retokenized is not None and not record.get("truncated"):
                    summary.compared += 1
                    generated = [token for token, mask in zip(retokenized.input_ids, retokenized.loss_mask) if mask]
                    if list(retokenized.input_ids[:len(prompt_ids)]) != prompt_ids or generated != completion_ids:
                        summary.disagreements += 1
                        if len(summary.disagreement_examples) < max_examples:
                            summary.disagreement_examples.append(f"{dataset}/{conversation['id']}")
            elif retokenized is not None:
                input_ids, loss_mask = list(retokenized.input_ids), list(retokenized.loss_mask)
                summary.from_chat_template += 1
            else:
                raise ValueError(f"{dataset}/{conversation['id']}: the server returned no token ids; pass the "
                                 "target's tokenizer so the answer is re-tokenized with its chat template")
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
    if summary.compared:
        logger.info("raw token ids vs re-tokenized text: %d of %d disagree", summary.disagreements, summary.compared)
    return summary
