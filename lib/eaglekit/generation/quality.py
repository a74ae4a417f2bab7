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
    answered = content.strip() or tool_calls
    thought = (reasoning or "").strip()
    found = {"empty": not answered and not thought, "truncated": finish_reason == "length",
             "repetition_loop": has_repetition_loop(content) or has_repetition_loop(reasoning or ""),
             "reasoning_without_answer": thought and not answered}
    return [flag for flag in QUALITY_FLAGS if found[flag]]

