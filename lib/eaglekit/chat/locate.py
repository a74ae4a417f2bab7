"""Finding generated turns in a rendering of the conversation: each turn's header and span, left to right,
as generated (split samples) or as the template shows it (the "visible" policy)."""

from __future__ import annotations

from eaglekit.chat.template import TemplateLayout
from eaglekit.chat.text import find_nth, history_header, turn_end
from eaglekit.chat.tokens import Rendered
from eaglekit.chat.turns import GeneratedTurn


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
