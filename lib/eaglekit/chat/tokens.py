"""Tokens and loss mask of a marked rendering: quoted control tokens tokenized as text, the characters in a
turn's span mapped to mask 1 (a token is trained when its first character lies in a span), split samples
reusing the tokens of the text they share; the result types and an HTML view of a sample."""

from __future__ import annotations

import bisect
import html
import re
from dataclasses import dataclass, field
from typing import Any

from eaglekit.chat.messages import MARK_RANGE, Marker
from eaglekit.chat.template import TemplateLayout, common_prefix_length


@dataclass(frozen=True)
class TokenizedConversation:
    input_ids: list[int]  # (T,)
    loss_mask: list[int]  # (T,) 1 on tokens the target generated, 0 elsewhere


@dataclass(frozen=True)
class ConversationSamples:
    """The training samples of one conversation and what they keep of what the target generated."""

    samples: list[TokenizedConversation]
    generated_tokens: int  # tokens of every assistant turn as the target generated it
    trained_tokens: int  # tokens with loss_mask 1 over all samples
    fallback: bool = False  # the fast path handed this conversation to the oracle
    boundary_merges: int = 0  # oracle only: turns whose prompt tokens are not a token prefix of the turn's
    # Assistant turns that cannot be defined as generated, (message index, reason): trained nowhere (their
    # text stays the later turns' context, mask 0) and counted, while the conversation's other turns are
    # trained. MiniMax-M2: a turn without reasoning after a generation prompt that opens `<think>`.
    rejected_turns: tuple[tuple[int, str], ...] = ()

    @property
    def split(self) -> bool:
        return len(self.samples) > 1


@dataclass
class Rendered:
    """A marked rendering and the character spans [start, end) of the assistant turns it trains."""

    text: str
    spans: list[tuple[int, int]] = field(default_factory=list)
    history: str | None = None  # a rendering this one shares its beginning with (split samples)


def tokenize_marked(tokenizer: Any, text: str, marker: Marker) -> tuple[list[int], list[int]]:
    """Token ids and each token's start offset (in `text`'s coordinates) of a marked rendering.

    Without marks this is one tokenizer call. With marks, the text is cut at each mark: the pieces
    between are tokenized as usual (the template's control tokens stay control tokens) and each
    marked token as plain text (`split_special_tokens=True`), all of its tokens starting at the mark.
    """
    return _tokenize_many(tokenizer, [text], marker)[0]


def tokenized_sample(tokenizer: Any, rendered: Rendered, marker: Marker,
                     tokens: tuple[list[int], list[int]] | None = None) -> TokenizedConversation:
    input_ids, starts = tokens if tokens is not None else tokenize_marked(tokenizer, rendered.text, marker)
    loss_mask = [0] * len(input_ids)
    # Token starts are sorted: each span's tokens are one slice, found by bisection.
    for span_start, span_end in rendered.spans:
        first, last = bisect.bisect_left(starts, span_start), bisect.bisect_left(starts, span_end)
        loss_mask[first:last] = [1] * (last - first)
    return TokenizedConversation(input_ids=input_ids, loss_mask=loss_mask)


def _samples_sharing_history(tokenizer: Any, rendered: list[Rendered], marker: Marker,
                             layout: TemplateLayout) -> list[TokenizedConversation]:
    """Split samples share their beginning with the sample before them and with a history rendering
    (`Rendered.history`: the full rendering or a long stretch's). The tokenizer splits text at control
    tokens before anything else (checked per tokenizer), so each sample keeps the tokens of whichever of
    the two shares more text with it, up to the last control token inside the shared text, and only its
    rest is tokenized; a history rendering is tokenized only where a sample keeps from it. Rests and
    histories are cut at control tokens and each distinct piece is tokenized once (`_tokenize_pieces`).
    Linear in the conversation, not quadratic. Where the kept text's tokens do not hold that control
    token as one token at its place, the sample is tokenized whole."""
    control_ids = {tokenizer.convert_tokens_to_ids(token) for token in layout.control_tokens}
    control = marker.pattern  # the layout's control tokens, longest first
    # Per sample: what it keeps tokens of (0: the sample before it, 1: its history rendering, None:
    # nothing), and where its own tokenization starts.
    bases: list[tuple[int | None, int]] = []
    previous: str | None = None
    for item in rendered:
        shared = [(common_prefix_length(text, item.text), -order, text)
                  for order, text in enumerate((previous, item.history)) if text is not None]
        previous = item.text
        if not shared:
            bases.append((None, 0))
            continue
        common, order, base = max(shared)  # the sample before on a tie
        # The last control token lying wholly inside the shared text: the tokens before it are kept.
        cut = _last_match(base, common, control)
        bases.append((-order, cut) if cut > 0 else (None, 0))
    histories = sorted({item.history for item, (order, _) in zip(rendered, bases) if order == 1})
    tokens = _tokenize_pieces(tokenizer, [item.text[cut:] for item, (_, cut) in zip(rendered, bases)] + histories,
                              marker, control, control_ids)
    whole = dict(zip(histories, tokens[len(rendered):]))  # the history renderings kept from, tokenized whole
    samples = []
    before: tuple[list[int], list[int]] = ([], [])  # the tokens of the sample before
    for item, (order, cut), (rest_ids, rest_starts) in zip(rendered, bases, tokens):
        ids, starts = rest_ids, rest_starts
        if order is not None:
            base_ids, base_starts = before if order == 0 else whole[item.history]
            keep = bisect.bisect_left(base_starts, cut)
            if keep < len(base_ids) and base_starts[keep] == cut and base_ids[keep] in control_ids:
                ids = base_ids[:keep] + rest_ids
                starts = base_starts[:keep] + [cut + start for start in rest_starts]
            else:  # the control token is not one token there: no cut to trust
                ids, starts = tokenize_marked(tokenizer, item.text, marker)
        before = (ids, starts)
        samples.append(tokenized_sample(tokenizer, item, marker, (ids, starts)))
    return samples


def _last_match(text: str, end: int, pattern: re.Pattern) -> int:
    """Start of the last match of `pattern` lying wholly inside text[:end], or -1: searched in a window
    before `end` that grows until it holds one (a control token is rarely far), not from the start."""
    window = 256
    while True:
        start = max(0, end - window)
        found = -1
        for match in pattern.finditer(text, start, end):
            if match.start() > start or start == 0:  # one at the window's edge may be part of a longer token
                found = match.start()
        if found >= 0 or start == 0:
            return found
        window *= 4


def _tokenize_pieces(tokenizer: Any, texts: list[str], marker: Marker, control: re.Pattern,
                     control_ids: set[int]) -> list[tuple[list[int], list[int]]]:
    """`tokenize_marked` of each text, for a tokenizer that splits text at control tokens first: every text
    cut before each control token, each distinct piece tokenized once (the samples of a conversation share
    most of theirs: user messages, tool results, Mistral's tool list), a text's tokens its pieces' tokens
    in order. A text with a piece whose control token is not its first token is tokenized whole."""
    cuts: list[list[int]] = []
    pieces: dict[str, int] = {}
    for text in texts:
        starts = [0] + [match.start() for match in control.finditer(text) if match.start() > 0]
        cuts.append(starts)
        for start, end in zip(starts, starts[1:] + [len(text)]):
            pieces.setdefault(text[start:end], len(pieces))
    piece_tokens = _tokenize_many(tokenizer, list(pieces), marker)
    results = []
    for text, starts in zip(texts, cuts):
        ids: list[int] = []
        offsets: list[int] = []
        for start, end in zip(starts, starts[1:] + [len(text)]):
            piece_ids, piece_starts = piece_tokens[pieces[text[start:end]]]
            if start > 0 and not (piece_ids and piece_ids[0] in control_ids and piece_starts[0] == 0):
                ids, offsets = tokenize_marked(tokenizer, text, marker)
                break
            ids += piece_ids
            offsets += [start + offset for offset in piece_starts]
        results.append((ids, offsets))
    return results


def _tokenize_many(tokenizer: Any, texts: list[str], marker: Marker) -> list[tuple[list[int], list[int]]]:
    """`tokenize_marked` of each text, in two batched tokenizer calls: the pieces between marks of every
    text in one, the marked tokens of every text (as plain text) in the other."""
    pieces: list[str] = []
    piece_starts: list[int] = []
    literals: list[str] = []
    marks: list[int] = []
    plans: list[list[tuple[bool, int]]] = []  # per text: (a marked token?, its index) in order
    for text in texts:
        plan, cursor = [], 0
        for match in MARK_RANGE.finditer(text):
            plan += [(False, len(pieces)), (True, len(literals))]
            pieces.append(text[cursor: match.start()])
            piece_starts.append(cursor)
            literals.append(marker.unmark(match.group(0)))
            marks.append(match.start())
            cursor = match.end()
        plan.append((False, len(pieces)))
        pieces.append(text[cursor:])
        piece_starts.append(cursor)
        plans.append(plan)
    plain = tokenizer(pieces, add_special_tokens=False, return_offsets_mapping=True) if pieces else None
    literal = tokenizer(literals, add_special_tokens=False, split_special_tokens=True) if literals else None
    results = []
    for plan in plans:
        ids: list[int] = []
        offsets: list[int] = []
        for marked, index in plan:
            if marked:
                ids += literal["input_ids"][index]
                offsets += [marks[index]] * len(literal["input_ids"][index])
            else:
                ids += plain["input_ids"][index]
                offsets += [piece_starts[index] + start for start, _ in plain["offset_mapping"][index]]
        results.append((ids, offsets))
    return results


def finish_samples(tokenizer: Any, rendered: list[Rendered], marker: Marker, bodies: list[str],
                   layout: TemplateLayout | None = None) -> ConversationSamples:
    """Tokenize the samples (reusing their history's tokens where `layout` allows) and
    count what they train."""
    if layout is not None and layout.splits_at_control_tokens and len(rendered) > 1:
        samples = _samples_sharing_history(tokenizer, rendered, marker, layout)
    else:
        samples = [tokenized_sample(tokenizer, item, marker) for item in rendered]
    trained = sum(sum(sample.loss_mask) for sample in samples)
    # What the target generated: each turn's text as generated, tokenized on its own (batched).
    generated = sum(len(ids) for ids, _ in _tokenize_many(tokenizer, [body for body in bodies if body], marker))
    return ConversationSamples(samples, generated, trained)


def mask_html(tokenizer: Any, sample: TokenizedConversation, max_tokens: int = 600) -> str:
    """A sample as HTML: trained tokens (loss_mask 1) highlighted, control tokens boxed."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    parts = []
    for token_id, mask in list(zip(sample.input_ids, sample.loss_mask))[:max_tokens]:
        text = html.escape(tokenizer.decode([token_id]))
        style = "background:#c6f6c6;" if mask else ""
        if token_id in special:
            style += "border:1px solid #888;"
        parts.append(f'<span style="{style}">{text}</span>' if style else text)
    more = "" if len(sample.input_ids) <= max_tokens else f"… ({len(sample.input_ids) - max_tokens} more tokens)"
    return ('<pre style="white-space:pre-wrap;font-size:11px">' + "".join(parts) + more + "</pre>")
