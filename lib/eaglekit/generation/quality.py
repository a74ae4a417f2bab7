"""Quality flags of one answer (empty, truncated, repetition loop, reasoning without an answer): recorded with
every generation; which flagged answers training drops is a params choice (`generation.drop_flags`)."""

from __future__ import annotations

QUALITY_FLAGS = ("empty", "truncated", "repetition_loop", "reasoning_without_answer")
TRUNCATED_POLICIES = ("keep", "drop")


def has_repetition_loop(text: str, min_span_chars: int = 200, max_period_chars: int = 200, min_repeats: int = 3) -> bool:
    """True when the text ends in a loop: a block of 1..max_period_chars characters repeated back to back.

    The last `span` characters have period p exactly when text[-span:] == text[-span-p:-p]; we need the
    periodic tail to cover at least max(min_span_chars, min_repeats x p) characters. Each check is a
    C-speed slice comparison, so a 16K-token answer costs well under a millisecond per period.
    """
    for period in range(1, max_period_chars + 1):
        span = max(min_span_chars, min_repeats * period)
        if len(text) < span + period:
            break
        if text[-span:] == text[-span - period:-period]:
            return True
    return False


def quality_flags(content: str, reasoning: str | None, finish_reason: str | None,
                  tool_calls: list | None = None) -> list[str]:
    """Flags for one answer, in QUALITY_FLAGS order. Filtering on them is a prep-for-training param.

    An answer that is only tool calls is not empty.
    """
    flags = []
    if not content.strip() and not (reasoning or "").strip() and not tool_calls:
        flags.append("empty")
    if finish_reason == "length":
        flags.append("truncated")
    if has_repetition_loop(content) or has_repetition_loop(reasoning or ""):
        flags.append("repetition_loop")
    if (reasoning or "").strip() and not content.strip() and not tool_calls:
        flags.append("reasoning_without_answer")
    return flags

