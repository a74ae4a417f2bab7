"""A prompt as the server renders it: its text, its token ids, and a class-B sample (the prompt, then the
target's answer, trained alone). `prepare` is the setup every tokenization path shares."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from eaglekit.chat.layout import template_layout
from eaglekit.chat.messages import Marker, normalize_tools, to_template_messages
from eaglekit.chat.render import Renderer
from eaglekit.chat.template import ChatTemplateError, TemplateLayout, turn_end
from eaglekit.chat.tokens import Rendered, TokenizedConversation, tokenize_marked, tokenized_sample


def _setup(tokenizer: Any, messages: Sequence[dict], tools: list | None, template_kwargs: dict | None
           ) -> tuple[TemplateLayout, Marker, list[dict], Renderer]:
    """(layout, marker, the marked template messages, a renderer with the marked tools)."""
    tools = normalize_tools(tools)
    layout = template_layout(tokenizer, template_kwargs, tools)
    marker = Marker(layout)
    renderer = Renderer(tokenizer, layout, marker(tools) if tools else None, dict(template_kwargs or {}))
    return layout, marker, to_template_messages(messages, layout, marker), renderer


def prepare(tokenizer: Any, messages: Sequence[dict], tools: list | None, template_kwargs: dict | None
            ) -> tuple[TemplateLayout, Marker, list[dict], Renderer, list[int]]:
    """(layout, marker, the marked template messages, a renderer with the marked tools, the indices of the
    assistant turns) of a conversation to train; ChatTemplateError where it has no assistant turn."""
    layout, marker, template_messages, renderer = _setup(tokenizer, messages, tools, template_kwargs)
    assistant_indices = [index for index, message in enumerate(messages) if message["role"] == "assistant"]
    if not assistant_indices:
        raise ChatTemplateError("the conversation has no assistant turn: nothing to train")
    return layout, marker, template_messages, renderer, assistant_indices


def render_conversation(tokenizer: Any, messages: Sequence[dict], add_generation_prompt: bool = False,
                        tools: list | None = None, template_kwargs: dict | None = None) -> str:
    """The chat-template text of `messages` (kit schema), reasoning and tool calls placed as
    the template needs."""
    _, marker, template_messages, renderer = _setup(tokenizer, messages, tools, template_kwargs)
    if add_generation_prompt:
        text = renderer.prompt(template_messages)
    elif template_messages and template_messages[-1]["role"] == "assistant":
        text = renderer.last(template_messages)
    else:
        text = renderer.whole(template_messages)
    return marker.unmark(text)


def prompt_token_ids(tokenizer: Any, messages: Sequence[dict], tools: list | None = None,
                     template_kwargs: dict | None = None) -> list[int]:
    """The tokens the target reads before answering: `messages` rendered with the generation prompt."""
    _, marker, template_messages, renderer = _setup(tokenizer, messages, tools, template_kwargs)
    return tokenize_marked(tokenizer, renderer.prompt(template_messages), marker)[0]


def prompt_token_count(tokenizer: Any, messages: Sequence[dict], tools: list | None = None,
                       template_kwargs: dict | None = None) -> int:
    return len(prompt_token_ids(tokenizer, messages, tools, template_kwargs))


def tokenize_answer(tokenizer: Any, messages: Sequence[dict], answer: dict, *, tools: list | None = None,
                    truncated: bool = False, template_kwargs: dict | None = None) -> tuple[int, TokenizedConversation]:
    """A class-B sample: the prompt `messages` as the server rendered it, then `answer`, trained alone.

    Earlier assistant turns inside the prompt (multi-turn context) are the dataset's, not the target's:
    mask 0. Returns (prompt token count, the sample). truncated: the answer was cut at max_tokens.
    """
    layout, marker, template_messages, renderer, _ = prepare(tokenizer, [*messages, answer], tools, template_kwargs)
    prompt = renderer.prompt(template_messages[:-1])
    turn = renderer.last(template_messages, prompt)
    end = turn_end(turn, len(prompt), layout.closers, truncated)
    rendered = Rendered(turn[:end] if truncated else turn, [(len(prompt), end)])
    return len(tokenize_marked(tokenizer, prompt, marker)[0]), tokenized_sample(tokenizer, rendered, marker)
