"""The fast path: `tokenize_conversation`, linear in the conversation. Each turn as generated from a small
rendering, one rendering of the whole conversation, split samples composed where the template rewrites
history; a conversation whose checks fail goes to the oracle (`reference`), counted as a fallback."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from eaglekit.chat.injected import injected_groups
from eaglekit.chat.prompts import prepare
from eaglekit.chat.reference import tokenize_conversation_reference
from eaglekit.chat.render import Renderer
from eaglekit.chat.split import split_groups
from eaglekit.chat.template import HISTORY_POLICIES, HistoryPolicy
from eaglekit.chat.tokens import ConversationSamples, finish_samples
from eaglekit.chat.turns import generated_turns, locate_visible


def tokenize_conversation(tokenizer: Any, messages: Sequence[dict], *, tools: list | None = None,
                          history: HistoryPolicy = "split", truncated: bool = False,
                          template_kwargs: dict | None = None) -> ConversationSamples:
    """Training samples of a conversation: `input_ids` and `loss_mask`, in time linear in its length.

    messages: kit schema dicts `{"role", "content", "reasoning"?, "tool_calls"?, "tool_call_id"?}`;
    messages after the last assistant turn are context for nothing and are dropped.
    tools: the record's tool definitions (`meta.tools`), passed to the template as `tools=`.
    history: "split" (default) or "visible" (see the `eaglekit.chat` package doc).
    truncated: the last assistant turn was cut at max_tokens: its mask ends at its last generated
        token and no end-of-turn token follows it.
    Raises ChatTemplateError (with the reason) when the template cannot render the conversation.
    """
    if history not in HISTORY_POLICIES:
        raise ValueError(f"history must be one of {HISTORY_POLICIES}, got {history!r}")
    layout, marker, template_messages, renderer, indices = prepare(tokenizer, messages, tools, template_kwargs)
    unstable = (tools and not layout.stable_with_tools) or \
        (not layout.stable_with_system and any(message["role"] == "system" for message in messages))
    if not layout.stable_with_late_system and any(message["role"] == "system" for message in messages[indices[0]:]):
        # A system message after a turn changes that turn's context where no span shows it (DeepSeek-V3.1
        # moves it to the beginning): the per-prefix oracle renders every turn's prompt (counted).
        return _fallback(tokenizer, messages, tools, history, truncated, template_kwargs)
    # A template that moves text it wrote earlier (Mistral: the system prompt, only while a user turn is
    # last; the tools, before the last user turn) changes the context of earlier turns in ways the
    # spans do not show: every turn's prompt is composed and cut as the oracle cuts (injected_groups).
    # "visible" reads one rendering as it is.
    # Renderings whose beginning is discarded leave out tool definitions where those only add a preamble.
    small = Renderer(tokenizer, layout, None, renderer.kwargs) if layout.tools_in_preamble and renderer.tools \
        else renderer
    # Each turn as generated, from a small rendering that starts with a probe user turn: the tools may
    # be left out too where they only add a block before the last user message (Mistral).
    generated = generated_turns(Renderer(tokenizer, layout, None, renderer.kwargs)
                                if layout.tools_before_last_user and renderer.tools else small,
                                template_messages, indices, layout, truncated)
    if generated is None:
        return _fallback(tokenizer, messages, tools, history, truncated, template_kwargs)
    if history == "visible":
        full = renderer.last(template_messages[: indices[-1] + 1])
        rendered = locate_visible(full, generated, layout, truncated)
        groups = None if rendered is None else [rendered]
    elif unstable:
        groups = injected_groups(renderer, template_messages, indices, generated, layout)
    else:
        groups = split_groups(renderer, small, template_messages, messages, indices, generated, layout)
    if groups is not None and truncated and history == "split":
        groups[-1].text = groups[-1].text[: groups[-1].spans[-1][1]]
    if groups is None:
        return _fallback(tokenizer, messages, tools, history, truncated, template_kwargs)
    return finish_samples(tokenizer, groups, marker, [turn.text for turn in generated], layout)


def _fallback(tokenizer, messages, tools, history, truncated, template_kwargs) -> ConversationSamples:
    return replace(tokenize_conversation_reference(tokenizer, messages, tools=tools, history=history, truncated=truncated,
                                                   template_kwargs=template_kwargs), fallback=True)
