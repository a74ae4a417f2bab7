"""String search over renderings: common prefixes, the n-th occurrence of a header, a turn's end at its
end-of-turn token, a header's history form. Pure functions of text."""

from __future__ import annotations

import re
from collections.abc import Sequence


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


def turn_end(text: str, start: int, end_of_turn: str | tuple[str, ...], truncated: bool) -> int:
    """End of the span starting at `start`: just after the first end-of-turn token (before it when the
    answer was cut at max_tokens, which never produced one), or the end of the text. `end_of_turn` may
    be several tokens (`TemplateLayout.closers`): the first of any of them ends the turn."""
    closers = (end_of_turn,) if isinstance(end_of_turn, str) else end_of_turn
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
