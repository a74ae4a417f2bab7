"""Chat tokenization with a loss mask: the target's own chat template, one pass, linear in messages.

`tokenize_conversation` renders the whole conversation once with the tokenizer's chat template,
tokenizes that text once with character offsets, and marks as trainable (mask 1) every token whose
first character lies inside an assistant turn's body: from the end of the template's assistant
header to the end of that turn's end-of-turn token. That body is what the target generated after
the generation prompt: reasoning (with its `<think>` wrapper where the template writes one), content,
and the end-of-turn token. System, user and tool turns, headers, default system prompts and the
newline after the end-of-turn token are 0.

`tokenize_conversation_reference` computes the same thing the slow, obvious way: for each assistant
turn it renders the prompt (prefix + generation prompt) and the prefix including the turn, and takes
the token diff up to the first end-of-turn token. It costs one render and tokenization per assistant
turn (quadratic in messages) and is the correctness oracle in tests and the bench.

What the mask means when a template is not prefix-stable: thinking templates in the Qwen3 /
DeepSeek-R1 style drop the reasoning of assistant turns that precede the last user message, so the
rendering of a prefix is not a prefix of the full rendering. Here the mask is defined on the
rendering of the whole conversation, i.e. the exact tokens the target is conditioned on when it sees
this conversation: a turn whose reasoning the template drops contributes its content and
end-of-turn token only; the last turns keep their reasoning. This equals the reference run on the
conversation with the dropped reasoning removed beforehand (tested); the reference itself raises
`NotPrefixStableError` on such input instead of guessing.

Message dicts follow the kit's schema: `{"role", "content", "reasoning"?}`. Reasoning is passed to
the template as `reasoning_content` (the key Qwen3 and DeepSeek templates read). A template that
never renders reasoning (SmolLM2's ChatML) gets it folded into the content as
`<think>\\n{reasoning}\\n</think>\\n\\n{content}`, which is the text such a model generated before a
server's reasoning parser split it off; nothing the target produced is silently dropped.

Tokenization uses `add_special_tokens=False`: the template writes its own BOS where it has one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# Probe strings: plain ASCII words no template transforms and no tokenizer merges with neighbours.
_PROBE_USER = "EAGLEKITPROBEUSER"
_PROBE_ASSISTANT = "EAGLEKITPROBEASSISTANT"
_PROBE_REASONING = "EAGLEKITPROBEREASONING"


class ChatTemplateError(ValueError):
    """The tokenizer's chat template cannot be used for masked tokenization (says why and what to do)."""


class NotPrefixStableError(ChatTemplateError):
    """Rendering a prefix of the conversation does not yield a prefix of the full token ids."""


@dataclass(frozen=True)
class TokenizedConversation:
    input_ids: list[int]  # (T,)
    loss_mask: list[int]  # (T,) 1 on tokens the target generated, 0 elsewhere


@dataclass(frozen=True)
class TemplateLayout:
    """What one probe of a chat template reveals; computed once per tokenizer and template."""

    assistant_header: str  # text before each assistant turn's body, e.g. "<|im_start|>assistant\n"
    end_of_turn: str  # the special token closing an assistant turn, e.g. "<|im_end|>"
    end_of_turn_id: int
    generation_prompt: str  # what add_generation_prompt=True appends
    renders_reasoning: bool  # whether the template writes a message's `reasoning_content`


_LAYOUT_CACHE: dict[tuple[int, str], TemplateLayout] = {}


def _chat_template_text(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise ChatTemplateError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has no chat template: "
            "set tokenizer.chat_template (the target's own template) before tokenizing conversations"
        )
    if not isinstance(template, str):
        raise ChatTemplateError("tokenizer has several named chat templates; set tokenizer.chat_template to one string")
    return template


def _render_raw(tokenizer: Any, template_messages: list[dict], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(template_messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def template_layout(tokenizer: Any) -> TemplateLayout:
    """Probe the chat template once: assistant header, end-of-turn token, generation prompt, reasoning support."""
    template = _chat_template_text(tokenizer)
    key = (id(tokenizer), template)
    cached = _LAYOUT_CACHE.get(key)
    if cached is not None:
        return cached
    user = [{"role": "user", "content": _PROBE_USER}]
    user_only = _render_raw(tokenizer, user, add_generation_prompt=False)
    with_prompt = _render_raw(tokenizer, user, add_generation_prompt=True)
    with_assistant = _render_raw(tokenizer, user + [{"role": "assistant", "content": _PROBE_ASSISTANT}], False)
    if not with_assistant.startswith(user_only) or _PROBE_ASSISTANT not in with_assistant:
        raise ChatTemplateError("chat template: rendering [user, assistant] does not extend rendering [user]")
    tail = with_assistant[len(user_only):]
    body_start = tail.index(_PROBE_ASSISTANT)
    assistant_header = tail[:body_start]
    closing = tail[body_start + len(_PROBE_ASSISTANT):]
    special_ids = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    encoding = tokenizer(closing, add_special_tokens=False, return_offsets_mapping=True)
    end_of_turn, end_of_turn_id = "", -1
    for token_id, (start, end) in zip(encoding["input_ids"], encoding["offset_mapping"]):
        if token_id in special_ids:
            end_of_turn, end_of_turn_id = closing[start:end], token_id
            break
    if not end_of_turn:
        raise ChatTemplateError(
            f"chat template closes an assistant turn with {closing!r}, which holds no special token: "
            "the end-of-turn token cannot be located; use the target's own template"
        )
    header_ids = _encode(tokenizer, assistant_header)
    if not any(token_id in special_ids for token_id in header_ids):
        raise ChatTemplateError(
            f"assistant header {assistant_header!r} holds no special token, so it could also occur inside "
            "message text; this template is not supported by the one-pass tokenizer"
        )
    with_reasoning = _render_raw(
        tokenizer, user + [_template_message({"role": "assistant", "content": _PROBE_ASSISTANT,
                                              "reasoning": _PROBE_REASONING}, fold_reasoning=False)], False
    )
    layout = TemplateLayout(
        assistant_header=assistant_header,
        end_of_turn=end_of_turn,
        end_of_turn_id=end_of_turn_id,
        generation_prompt=with_prompt[len(user_only):] if with_prompt.startswith(user_only) else "",
        renders_reasoning=_PROBE_REASONING in with_reasoning,
    )
    _LAYOUT_CACHE[key] = layout
    return layout


def _template_message(message: dict, fold_reasoning: bool) -> dict:
    """Kit schema -> the dict chat templates read (`reasoning` becomes `reasoning_content`)."""
    reasoning = message.get("reasoning") or ""
    if message["role"] != "assistant" or not reasoning:
        return {"role": message["role"], "content": message["content"]}
    if fold_reasoning:
        return {"role": "assistant", "content": f"<think>\n{reasoning}\n</think>\n\n{message['content']}"}
    return {"role": "assistant", "content": message["content"], "reasoning_content": reasoning}


def render_conversation(tokenizer: Any, messages: Sequence[dict], add_generation_prompt: bool = False) -> str:
    """The chat-template text of `messages` (kit schema), reasoning passed or folded as the template needs."""
    layout = template_layout(tokenizer)
    fold = not layout.renders_reasoning
    return _render_raw(tokenizer, [_template_message(m, fold) for m in messages], add_generation_prompt)


def prompt_token_count(tokenizer: Any, messages: Sequence[dict]) -> int:
    """Tokens the target reads before answering: `messages` rendered with the generation prompt."""
    return len(_encode(tokenizer, render_conversation(tokenizer, messages, add_generation_prompt=True)))


def _assistant_spans(text: str, layout: TemplateLayout, assistant_count: int) -> list[tuple[int, int]]:
    """Character spans [start, end) of each assistant turn's body, found left to right in one scan."""
    spans: list[tuple[int, int]] = []
    cursor = 0
    for turn in range(assistant_count):
        header_at = text.find(layout.assistant_header, cursor)
        if header_at < 0:
            raise ChatTemplateError(
                f"assistant turn {turn + 1} of {assistant_count}: the template did not render its header "
                f"{layout.assistant_header!r}; the template drops or renames assistant turns"
            )
        start = header_at + len(layout.assistant_header)
        end_at = text.find(layout.end_of_turn, start)
        if end_at < 0:
            raise ChatTemplateError(f"assistant turn {turn + 1}: no end-of-turn token {layout.end_of_turn!r} after it")
        cursor = end_at + len(layout.end_of_turn)
        spans.append((start, cursor))
    if text.find(layout.assistant_header, cursor) >= 0:
        raise ChatTemplateError(
            f"the rendering holds more assistant headers than the conversation's {assistant_count} assistant "
            "turns (does a message contain the template's special tokens as text?)"
        )
    return spans


def tokenize_conversation(tokenizer: Any, messages: Sequence[dict]) -> TokenizedConversation:
    """`input_ids` and `loss_mask` of a conversation in one render and one tokenization.

    messages: kit schema dicts `{"role", "content", "reasoning"?}`, N of them.
    Returns (T,) ids and (T,) mask; cost is linear in the total text (and so in N).
    """
    layout = template_layout(tokenizer)
    text = render_conversation(tokenizer, messages)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids = list(encoding["input_ids"])
    offsets = encoding["offset_mapping"]
    assistant_count = sum(1 for m in messages if m["role"] == "assistant")
    spans = _assistant_spans(text, layout, assistant_count)
    loss_mask = [0] * len(input_ids)
    # Tokens and spans are both sorted by position: one merge-like walk, linear in T + spans.
    span_index = 0
    for token_index, (token_start, _token_end) in enumerate(offsets):
        while span_index < len(spans) and token_start >= spans[span_index][1]:
            span_index += 1
        if span_index == len(spans):
            break
        if spans[span_index][0] <= token_start:
            loss_mask[token_index] = 1
    return TokenizedConversation(input_ids=input_ids, loss_mask=loss_mask)


def tokenize_conversation_reference(tokenizer: Any, messages: Sequence[dict]) -> TokenizedConversation:
    """Reference: per assistant turn, diff the tokens of prefix+turn against prefix+generation prompt.

    Quadratic in messages; raises NotPrefixStableError where a prefix's tokens are not a prefix of
    the full conversation's tokens (thinking templates dropping earlier reasoning, token merges
    across a turn boundary).
    """
    layout = template_layout(tokenizer)
    input_ids = _encode(tokenizer, render_conversation(tokenizer, messages))
    loss_mask = [0] * len(input_ids)
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt_ids = _encode(tokenizer, render_conversation(tokenizer, messages[:index], add_generation_prompt=True))
        turn_ids = _encode(tokenizer, render_conversation(tokenizer, messages[: index + 1]))
        if turn_ids[: len(prompt_ids)] != prompt_ids:
            raise NotPrefixStableError(f"message {index}: the generation prompt's tokens are not a prefix of the turn's")
        if input_ids[: len(turn_ids)] != turn_ids:
            raise NotPrefixStableError(
                f"message {index}: tokens of the conversation up to this turn are not a prefix of the full "
                "conversation's tokens (the template rewrites earlier turns, e.g. drops their reasoning)"
            )
        generated = turn_ids[len(prompt_ids):]
        if layout.end_of_turn_id in generated:
            generated = generated[: generated.index(layout.end_of_turn_id) + 1]
        for position in range(len(prompt_ids), len(prompt_ids) + len(generated)):
            loss_mask[position] = 1
    return TokenizedConversation(input_ids=input_ids, loss_mask=loss_mask)
