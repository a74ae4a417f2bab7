"""The oracle: `tokenize_conversation_reference` renders and tokenizes every assistant turn's prompt and the
turn itself (quadratic in the conversation) and defines what is trained; the fast path must equal it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from eaglekit.chat.prompts import prepare
from eaglekit.chat.template import HistoryPolicy, NotPrefixStableError, turn_end
from eaglekit.chat.tokens import ConversationSamples, Rendered, finish_samples, tokenize_marked


def tokenize_conversation_reference(tokenizer: Any, messages: Sequence[dict], *, tools: list | None = None,
                                    history: HistoryPolicy = "split", truncated: bool = False,
                                    template_kwargs: dict | None = None) -> ConversationSamples:
    """The oracle: per assistant turn, render and tokenize its prompt and the turn; quadratic in messages.

    The turn's span is the text difference (to the first end-of-turn token); samples are cut where
    P_{i+1} stops extending F_i up to turn i's span (see the `eaglekit.chat` package doc). Each sample is
    tokenized whole, and every turn is then checked at the token level: where the prompt's own tokens are a
    prefix of the turn's own tokens, the turn's trained tokens must equal the token difference, or
    NotPrefixStableError is raised. Where they are not (the tokenizer merges across the boundary,
    e.g. SmolLM2's BPE on Llama 3's "\\n\\n" header end) the whole-sample tokenization stands and the
    turn is counted in `boundary_merges`.
    history="visible" is only defined here for conversations the template does not rewrite: it raises
    NotPrefixStableError otherwise. truncated: the last turn was cut at max_tokens (no end-of-turn token).
    """
    layout, marker, template_messages, renderer, indices = prepare(tokenizer, messages, tools, template_kwargs)
    rendered: list[Rendered] = []
    bodies: list[str] = []
    token_diffs: list[tuple[int, int, list[int] | None]] = []  # (sample, span index, expected trained tokens)
    current: Rendered | None = None
    current_end = 0
    rejected: list[tuple[int, str]] = []
    for position, index in enumerate(indices):
        last = position == len(indices) - 1
        prompt = renderer.prompt(template_messages[:index])
        try:
            turn = renderer.last(template_messages[: index + 1], prompt)
            if not turn.startswith(prompt):
                raise NotPrefixStableError("the turn's rendering does not extend its prompt's")
        except NotPrefixStableError as error:
            # This turn has no definition as generated; the others keep theirs (it stays their context).
            rejected.append((index, str(error)))
            continue
        start = len(prompt)
        end = turn_end(turn, start, layout.closers, truncated and last)
        bodies.append(turn[start:end])
        if current is not None and not prompt.startswith(current.text[:current_end]):
            if history == "visible":
                raise NotPrefixStableError(f"message {index}: the template rewrites earlier turns")
            rendered.append(current)
            current = None
        if current is None:
            current = Rendered(turn)
        current.text = turn
        current.spans.append((start, end))
        current_end = end
        prompt_ids = tokenize_marked(tokenizer, prompt, marker)[0]
        turn_ids = tokenize_marked(tokenizer, turn[:end], marker)[0]
        expected = turn_ids[len(prompt_ids):] if turn_ids[: len(prompt_ids)] == prompt_ids else None
        token_diffs.append((len(rendered), len(current.spans) - 1, expected))
    if current is None:
        raise NotPrefixStableError(f"no assistant turn can be defined as generated: message {rejected[0][0]}: "
                                   f"{rejected[0][1]}")
    if truncated:
        current.text = current.text[:current_end]
    rendered.append(current)
    result = finish_samples(tokenizer, rendered, marker, bodies)
    merges = 0
    for sample_index, span_index, expected in token_diffs:
        if expected is None:
            merges += 1
            continue
        span_start, span_end = rendered[sample_index].spans[span_index]
        ids, starts = tokenize_marked(tokenizer, rendered[sample_index].text, marker)
        trained = [token for token, start in zip(ids, starts) if span_start <= start < span_end]
        if trained != expected:
            raise NotPrefixStableError(f"turn {span_index + 1} of sample {sample_index + 1}: the trained tokens differ "
                                       "from the per-prefix token difference")
    return ConversationSamples(result.samples, result.generated_tokens, result.trained_tokens, False, merges,
                               tuple(rejected))
