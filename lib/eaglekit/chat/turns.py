"""Each assistant turn as the target generated it (`GeneratedTurn`), learnt from a small rendering of the
turn after its least context, with what a context's shape tells kept across conversations; and finding those
turns in a rendering of the conversation: each turn's header and span, left to right, as generated (split
samples) or as the template shows it (the "visible" policy)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from eaglekit.chat.render import Renderer, small_context
from eaglekit.chat.template import PROBE_USER, ChatTemplateError, TemplateLayout, control_tokens_in, find_nth, history_header, turn_end
from eaglekit.chat.tokens import Rendered


@dataclass(frozen=True)
class GeneratedTurn:
    """One assistant turn as the target generated it, learnt from a small rendering, and how to find it
    in any rendering of the conversation."""

    header: str  # the text before the turn in any rendering (the generation prompt's tail)
    text: str  # the turn as generated: reasoning as the template writes it, content, calls, end-of-turn token
    # How many occurrences of the header's history form a scan from the turn's caller skips to reach the
    # turn: where the header is a tool result's closing (DeepSeek, Mistral) each result before it writes one.
    skip: int
    prompt: str  # the turn's prompt in its small context (it ends in `header`)
    # what follows the turn in its small rendering (the end-of-turn token of a truncated turn, a newline)
    tail: str
    # Whether the small context's shape showed the prompt to be the turn's rendering up to its header, then
    # the header: the prompt can then be read off a rendering that holds the turn.
    prompt_readable: bool


# What a small context's shape tells about the turns after it (see generated_turns), per tokenizer,
# template, kwargs and tool list: found on the first conversation that has the shape, kept for the next.
# Bounded: a dataset may give every record its own tool list (the oldest entry goes first).
_SHAPE_CACHE: dict[tuple, "ShapeFacts"] = {}
UNPROBED = object()  # a fact not probed yet (None is a probed "no")
_SHAPE_CACHE_SIZE = 64


@dataclass
class ShapeFacts:
    """Per small-context shape (its roles, calls and whether each has content): the header before the turn
    and the headers a scan skips (`_turn_header`), where its prompt reads off the turn's rendering
    (`_prompt_reading`), and whether the prompt is that rendering up to the header, then the header."""

    headers: dict[tuple, tuple[str, int]] = field(default_factory=dict)
    readings: dict[tuple, tuple[int, int] | None] = field(default_factory=dict)
    up_to_header: dict[tuple, bool] = field(default_factory=dict)
    probe_prompt: str | None = None  # the prompt of the probe user turn alone (every turn after a user turn)
    # Where a stretch's first prompt reads off the stretch's rendering (Mistral's system prompt), probed on
    # first use: `_system_insertion`.
    system_insertion: Any = UNPROBED


def shape_facts(renderer: Renderer, layout: TemplateLayout) -> ShapeFacts:
    tokenizer = renderer.tokenizer
    key = (layout, id(tokenizer), len(tokenizer), tokenizer.chat_template,
           json.dumps(renderer.kwargs, sort_keys=True, default=str), json.dumps(renderer.tools, sort_keys=True,
                                                                                 default=str))
    if key not in _SHAPE_CACHE and len(_SHAPE_CACHE) >= _SHAPE_CACHE_SIZE:
        del _SHAPE_CACHE[next(iter(_SHAPE_CACHE))]
    return _SHAPE_CACHE.setdefault(key, ShapeFacts())


def generated_turns(renderer: Renderer, template_messages: list[dict], indices: list[int], layout: TemplateLayout,
                    truncated: bool) -> list[GeneratedTurn] | None:
    """Each assistant turn (at `indices` of `template_messages`) as the target generated it.

    Rendered in a small context: a probe user turn, plus the previous assistant turn and the tool
    results since, where the turn follows tools. None when the template does not extend the prompt.
    truncated: the last turn was cut at max_tokens (its text ends before the end-of-turn token).
    """
    generated: list[GeneratedTurn] = []
    # What a context's shape tells, found on its first context and kept across conversations (_SHAPE_CACHE):
    # - the header and the headers to skip depend on the context's shape only (its roles and calls;
    #   message text cannot hold a control token);
    # - where the shape's first context's prompt was found to be the turn's rendering up to the turn's
    #   header (no generation prompt of its own, as in Qwen3, Kimi, Mistral): (the header's occurrences
    #   in the prompt, in the turn's rendering). The prompt of a later context of that shape is then read
    #   off the turn's rendering instead of rendered (one render per turn, not two), where the rendering
    #   holds the header as often as the shape's first did;
    # - whether that prompt is the turn's rendering up to the turn's header, then the header (whether or
    #   not the rendering goes on as the prompt does: DeepSeek closes the think block the prompt opens).
    facts = shape_facts(renderer, layout)
    headers, readings, up_to_header = facts.headers, facts.readings, facts.up_to_header
    # Every turn after a user turn shares the probe context (the same in every conversation).
    probe = json.dumps([{"role": "user", "content": PROBE_USER}], sort_keys=True)
    prompts_by_context: dict[str, str] = {} if facts.probe_prompt is None else {probe: facts.probe_prompt}
    for position, index in enumerate(indices):
        context = small_context(template_messages, index)
        messages = context + [template_messages[index]]
        try:
            key = json.dumps(context, sort_keys=True, default=str)
            shape = tuple((message["role"], len(message.get("tool_calls") or []), bool(message.get("content")))
                          for message in context)
            rendered = None
            if key not in prompts_by_context and readings.get(shape) is not None:
                rendered = renderer.whole(messages)
                read = _read_prompt(rendered, headers[shape][0], readings[shape])
                if read is not None:
                    prompts_by_context[key] = read
            if key not in prompts_by_context:
                prompts_by_context[key] = renderer.prompt(context)
            prompt = prompts_by_context[key]
            if key == probe:
                facts.probe_prompt = prompt
            if shape not in headers:
                headers[shape] = _turn_header(renderer, context, prompt, layout)
            header, skip = headers[shape]
            if shape not in readings:
                rendered = renderer.whole(messages)
                readings[shape] = _prompt_reading(rendered, prompt, header, layout)
                context_header = history_header(header)
                at = find_nth(rendered, context_header, 0, prompt.count(context_header) - 1)
                up_to_header[shape] = at >= 0 and rendered[:at] + header == prompt
            turn = renderer.last(messages, prompt, rendered)
        except ChatTemplateError:
            return None  # the small context is not legal for this template: the oracle decides
        if not turn.startswith(prompt) or not prompt.endswith(header):
            return None
        end = turn_end(turn, len(prompt), layout.closers, truncated and position == len(indices) - 1)
        generated.append(GeneratedTurn(header=header, text=turn[len(prompt): end], skip=skip, prompt=prompt,
                                       tail=turn[end:], prompt_readable=up_to_header[shape]))
    return generated


def _prompt_reading(rendered: str, prompt: str, header: str, layout: TemplateLayout) -> tuple[int, int] | None:
    """(the context header's occurrences in `prompt`, in `rendered`) where `prompt` is `rendered` up to
    its last occurrence of the context header, then `header`: what `_read_prompt` needs; else None."""
    context_header = history_header(header)
    if not control_tokens_in(context_header, layout.control_tokens) or \
            prompt.rfind(context_header) != len(prompt) - len(header):
        return None
    reading = (prompt.count(context_header), rendered.count(context_header))
    return reading if _read_prompt(rendered, header, reading) == prompt else None


def _read_prompt(rendered: str, header: str, reading: tuple[int, int]) -> str | None:
    """A turn's prompt read off the turn's rendering: up to the context header's n-th occurrence, then
    the header; None where the rendering holds the context header another number of times, or does not
    extend what was read."""
    context_header = history_header(header)
    before, total = reading
    if rendered.count(context_header) != total:
        return None
    at = find_nth(rendered, context_header, 0, before - 1)
    prompt = rendered[:at] + header
    return prompt if at >= 0 and rendered.startswith(prompt) else None


def _turn_header(renderer: Renderer, context: list[dict], prompt: str, layout: TemplateLayout) -> tuple[str, int]:
    """The header before an assistant turn that follows `context` (whose prompt is `prompt`), and how many
    of its occurrences among the context's tool results a scan skips."""
    without = renderer.whole(context)
    results_from = len(renderer.whole(context[:2])) if len(context) > 2 else 0
    # The header is what the generation prompt adds (`<|im_assistant|>assistant<|im_middle|>`), which
    # tells an assistant turn from any other; else the prompt's tail from its last control token.
    added = prompt[len(without):] if prompt.startswith(without) else ""
    header = added if control_tokens_in(history_header(added), layout.control_tokens) else _header(prompt, layout)
    # Where the header is a tool result's closing (DeepSeek, Mistral), each result writes one: the
    # turn starts after the last, so a scan skips the ones before it.
    skip = max(prompt.count(history_header(header), results_from) - 1, 0) if results_from else 0
    return header, skip


def _header(prompt: str, layout: TemplateLayout) -> str:
    """The end of a prompt from its last control token: what precedes a turn's body in any rendering."""
    body = history_header(prompt)  # its last control token is looked for before a think opener
    last = max((body.rfind(token) for token in layout.control_tokens), default=-1)
    return prompt[last:] if last >= 0 else prompt[-16:]


def history_turns(full: str, generated: list[GeneratedTurn],
                  layout: TemplateLayout, cursor: int = 0) -> list[tuple[int, int]] | None:
    """Each turn in the full rendering (from `cursor` on), as the template shows it there: (its header's
    start, its end)."""
    turns = []
    for turn in generated:
        context_header = history_header(turn.header)
        at = find_nth(full, context_header, cursor, turn.skip)
        if at < 0:
            return None
        cursor = turn_end(full, at + len(context_header), layout.closers, False)
        turns.append((at, cursor))
    return turns


def locate_group(text: str, generated: list[GeneratedTurn], first: int, last: int,
                 layout: TemplateLayout, cursor: int = 0, context_from: int = 0) -> Rendered | int | None:
    """Spans of turns first..last (as generated) in `text` from `cursor` on; turns context_from..first-1
    before them are context, found by header.

    Returns the rendering with its spans, or the position of the first turn not found as generated
    (None when even the context turns cannot be followed).
    """
    context = history_turns(text, generated[context_from:first], layout, cursor)
    if context is None:
        return None
    return locate_turns(text, generated, first, last, context[-1][1] if context else cursor)


def locate_turns(text: str, generated: list[GeneratedTurn], first: int, last: int,
                 cursor: int) -> Rendered | int:
    """Spans of turns first..last as generated in `text` from `cursor` on, or the first turn not found."""
    rendered = Rendered(text)
    for position in range(first, last + 1):
        header, body = generated[position].header, generated[position].text
        at = text.find(header + body, cursor)
        if at < 0:
            return position
        start = at + len(header)
        rendered.spans.append((start, start + len(body)))
        cursor = start + len(body)
    return rendered


def locate_visible(text: str, generated: list[GeneratedTurn], layout: TemplateLayout,
                   truncated: bool) -> Rendered | None:
    """Spans of every turn as `text` shows it: as generated where it is, else header to end-of-turn."""
    rendered = Rendered(text)
    cursor = 0
    for position, turn in enumerate(generated):
        header, body, skip = turn.header, turn.text, turn.skip
        context_header = history_header(header)  # a history turn has no think opener before it
        at = text.find(header + body, cursor)
        next_header = find_nth(text, context_header, cursor, skip)
        if at >= 0 and at == next_header:
            start, end = at + len(header), at + len(header) + len(body)
        elif next_header >= 0:
            start = next_header + len(context_header)
            end = turn_end(text, start, layout.closers, truncated and position == len(generated) - 1)
        else:
            return None
        rendered.spans.append((start, end))
        cursor = end
    if truncated:
        rendered.text = text[: rendered.spans[-1][1]]
    return rendered
