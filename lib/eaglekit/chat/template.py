"""What every part of chat tokenization shares about a chat template: its errors, the probe words, the
history policies, `TemplateLayout` (what probing a template reveals; the probe is `layout`), and string search
over renderings (common prefixes, the n-th occurrence of a header, a turn's end at its end-of-turn token, a
header's history form: pure functions of text)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal


HistoryPolicy = Literal["split", "visible"]
HISTORY_POLICIES = ("split", "visible")

# Probe strings: plain ASCII words no template transforms and no tokenizer merges with neighbours.
PROBE_USER = "EAGLEKITPROBEUSER"
PROBE_ASSISTANT = "EAGLEKITPROBEASSISTANT"
PROBE_REASONING = "EAGLEKITPROBEREASONING"
PROBE_TOOL = "EAGLEKITPROBETOOL"
PROBE_CALL_ID = "call00001"  # 9 alphanumerics: Mistral's templates insist


class ChatTemplateError(ValueError):
    """The chat template cannot render or mask this conversation (says why and what to do)."""


class NotPrefixStableError(ChatTemplateError):
    """A turn's rendering does not extend the rendering of its prompt (the template rewrites it)."""


@dataclass(frozen=True)
class TemplateLayout:
    """What probing a chat template reveals; computed once per tokenizer, template and kwargs."""

    end_of_turn: str  # the control token closing an assistant turn, e.g. "<|im_end|>"
    end_of_turn_id: int
    reasoning: Literal["field", "fold", "splice"]
    tool_arguments: Literal["object", "string"]  # how the template wants `function.arguments`
    tool_calls: Literal["template", "hermes-text"]  # hermes-text: the template renders no tool calls
    # Whether a prompt's rendering stays a prefix when the conversation goes on, with a system prompt
    # and with tool definitions (Mistral moves both to the last user turn): where not, the fast path
    # hands such conversations to the oracle.
    stable_with_system: bool
    # Whether it stays one with a system message after an assistant turn (DeepSeek-V3.1 gathers every system
    # message into the prompt's beginning, so a later one changes what every earlier turn
    # was generated after).
    stable_with_late_system: bool
    stable_with_tools: bool
    control_tokens: tuple[str, ...]  # longest first: what is text when it appears inside a message
    family: str
    # Whether tokenizing text in pieces cut before a control token gives the same tokens as a whole
    # (byte-level BPE: yes; SentencePiece with a prefix space: no). Split samples then reuse the tokens
    # of the text they share with the previous sample.
    splits_at_control_tokens: bool = False
    # Whether tool definitions only add text before the first message (Qwen3's system block, Kimi's
    # tool_declare), never inside or after a turn (Llama 3's first user turn, Mistral's last): small
    # renderings whose beginning is discarded (a turn as generated, a split group's stretch) then leave
    # them out, which makes them several times cheaper.
    tools_in_preamble: bool = False
    # Whether tool definitions only add one block of text before the last user message's content
    # (Mistral): small renderings that start with a probe user turn and keep only what follows it
    # (each turn as generated) then leave them out too.
    tools_before_last_user: bool = False
    # Whether, inside a stretch of tool rounds, a turn's prompt is a later turn's prompt up to the turn's
    # header (no message renders differently for the tool rounds after it; probed with reasoning on some
    # rounds and several calls on one): split groups then read their prompts off one rendering per stretch.
    reads_tool_rounds: bool = False
    # Whether a turn with reasoning that a user message follows renders in every later prompt as in the
    # first one that holds it (so in the full rendering as in the prompt of the turn after it).
    keeps_history: bool = False
    # Whether a conversation's rendering up to its last turn extends that turn's prompt (its think opener
    # left out), with earlier stretches and tool rounds with reasoning before it (Kimi thinking blanks
    # them once the last turn is an answer): the prompt is then read off that rendering.
    extends_prompt: bool = False
    # Whether the template writes no end-of-turn token and the next message's role token closes an assistant
    # turn (GLM-4.6: `<|user|>` after an answer, `<|observation|>` after tool calls; the last turn has none).
    # The model generates that role token as its stop token (GLM's generation_config lists both as eos),
    # so it is the turn's trained end-of-turn token: `end_of_turn` after an answer, `call_end_of_turn`
    # after tool calls, appended to a turn written as generated (`Renderer.last`) where no message follows.
    next_turn_closes: bool = False
    call_end_of_turn: str = ""

    @property
    def closers(self) -> tuple[str, ...]:
        """Every token that ends an assistant turn: the end-of-turn token, and the one after tool calls."""
        if self.call_end_of_turn and self.call_end_of_turn != self.end_of_turn:
            return (self.end_of_turn, self.call_end_of_turn)
        return (self.end_of_turn,)

    def closer(self, message: dict) -> str:
        """What a turn written as generated ends with beyond the template's rendering of it where it is the
        last message: the role token that closes it (`next_turn_closes`), else nothing."""
        if not self.next_turn_closes:
            return ""
        return self.call_end_of_turn or self.end_of_turn if message.get("tool_calls") else self.end_of_turn


def control_tokens_in(text: str, control_tokens: Sequence[str]) -> list[str]:
    if not control_tokens:
        return []
    return re.findall("|".join(map(re.escape, control_tokens)), text)


def common_prefix_length(a: str, b: str) -> int:
    """len of the common prefix of a and b, by bisection on slice comparisons (C speed, not a char loop)."""
    low, high = 0, min(len(a), len(b))
    while low < high:  # a[:low] == b[:low]; the first difference, if any, is before `high`
        middle = (low + high + 1) // 2
        if a[low:middle] == b[low:middle]:
            low = middle
        else:
            high = middle - 1
    return low


def turn_end(text: str, start: int, closers: tuple[str, ...], truncated: bool) -> int:
    """End of the span starting at `start`: just after the first end-of-turn token (before it when the
    answer was cut at max_tokens, which never produced one), or the end of the text. The first of any of
    `closers` (`TemplateLayout.closers`) ends the turn."""
    found = [(at, closer) for closer in closers if (at := text.find(closer, start)) >= 0]
    if not found:
        return len(text)
    at, closer = min(found)
    return at if truncated else at + len(closer)


def after_nth(text: str, needle: str, count: int) -> int:
    """The position just after the count-th occurrence of `needle` in `text` (0 for count 0), or -1."""
    if count == 0:
        return 0
    found = find_nth(text, needle, 0, count - 1)
    return found + len(needle) if found >= 0 else -1


def history_header(header: str) -> str:
    """The header of a turn in its history form: without the think block the generation prompt opens."""
    for opener in ("<think>\n", "<think>"):
        if header.endswith(opener) and len(header) > len(opener):
            return header[: -len(opener)]
    return header


def find_nth(text: str, needle: str, start: int, skip: int) -> int:
    """Position of the (skip+1)-th occurrence of `needle` at or after `start`, or -1."""
    at = text.find(needle, start)
    for _ in range(skip):
        if at < 0:
            return -1
        at = text.find(needle, at + len(needle))
    return at
