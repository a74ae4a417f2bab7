"""Split samples for templates that rewrite history (Qwen3, Kimi thinking, DeepSeek drop or blank earlier
reasoning): groups grown greedily over candidate cuts, each group's text composed from a history
rendering and a small rendering of its own stretch (`_Composer`) instead of rendered whole."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from typing import Any

from eaglekit.chat.render import Renderer, small_context
from eaglekit.chat.template import ChatTemplateError, TemplateLayout
from eaglekit.chat.tokens import Rendered
from eaglekit.chat.turns import GeneratedTurn, history_turns, locate_group


# A split group whose stretch (messages since the user message before it) is longer than this takes its
# history from its stretch's own rendering rather than from the full one (see _Composer).
_SHORT_STRETCH = 16

# Split groups: candidate ends tried one by one (each confirmed as a cut or not) before galloping.
_WALKED_ENDS = 3


def split_groups(renderer: Renderer, small: Renderer, template_messages: list[dict], messages: Sequence[dict],
                 indices: list[int], generated: list[GeneratedTurn], layout: TemplateLayout) -> list[Rendered] | None:
    """Samples of the split policy, cut where the oracle cuts; None when the spans cannot be found.

    The whole conversation is tried first (one render: every template that does not rewrite history
    ends here). Otherwise groups grow greedily over candidate ends and close at the first turn no
    longer rendered as generated. Each group's text is composed, not rendered whole: the history
    before it as the full rendering shows it, then its own stretch rendered in a small context
    (`_Composer`); linear in the conversation's length instead of quadratic. Where composing fails a
    check, every group is rendered whole (one render per group).
    """
    count = len(indices)
    full = _full_rendering(renderer, template_messages[: indices[-1] + 1], generated, layout)
    whole = locate_group(full, generated, 0, count - 1, layout)
    if isinstance(whole, Rendered):
        return [whole]
    user_after = [any(message["role"] == "user" for message in messages[indices[position] + 1: indices[position + 1]])
                  for position in range(count - 1)]
    history = history_turns(full, generated, layout)
    if history is not None:
        # A group can only end before a user message (where Qwen3, Kimi thinking and Mistral rewrite) or
        # at a turn the full rendering no longer shows as generated (Qwen3's empty think block, DeepSeek).
        ends = [position for position in range(count - 1) if user_after[position]
                or not full.startswith(generated[position].header + generated[position].text, history[position][0])]
        composer = _Composer(renderer, small, template_messages, indices, generated, layout, full, history, user_after)
        kinds = [(position < count - 1 and user_after[position], bool(messages[index].get("reasoning")))
                 for position, index in enumerate(indices)]
        groups = _greedy_groups(composer.attempt, ends + [count - 1], count, kinds)
        # One real check per conversation beyond the last group's: the group before it, which has the
        # longest composed history, against its own prompt rendered whole (already done where that group
        # ends a long stretch, whose rendering it was checked against).
        before_last = count - 1 - len(groups[-1].spans) if groups is not None and len(groups) > 1 else None
        if before_last is not None and (before_last + 1 - len(groups[-2].spans), before_last) not in composer.checked \
                and composer.turn_after_prompt(before_last) != groups[-2].text:
            groups = None
        if groups is not None:
            return groups
    texts: dict[int, str] = {count - 1: full}  # one render per sample end

    def attempt(first: int, last: int) -> Rendered | int | None:
        if last not in texts:
            texts[last] = renderer.last(template_messages[: indices[last] + 1])
        return locate_group(texts[last], generated, first, last, layout)

    ends = [position for position in range(count - 1) if user_after[position]]
    groups = _greedy_groups(attempt, ends + [count - 1], count)
    for group in groups or []:
        group.history = full  # samples share their beginning with the full rendering up to its first rewrite
    return groups


def _full_rendering(renderer: Renderer, messages: list[dict], generated: list[GeneratedTurn],
                    layout: TemplateLayout) -> str:
    """The conversation up to its last turn as the oracle's last sample holds it (`Renderer.last`). The
    turn's prompt is read off the conversation's rendering (up to the turn's header, then the header)
    where the template's probe says that rendering extends the prompt (`extends_prompt`) and the turn's
    small context showed the prompt to be its rendering up to its header; else it is rendered."""
    if layout.extends_prompt and generated[-1].prompt_readable:
        whole = renderer.whole(messages)
        turns = history_turns(whole, generated, layout)
        if turns is not None:
            return renderer.last(messages, whole[: turns[-1][0]] + generated[-1].header, whole)
    return renderer.last(messages)


def _greedy_groups(attempt, ends: list[int], count: int, kinds: Sequence[Any] = ()) -> list[Rendered] | None:
    """Grow each group over the candidate ends while every turn in it stays as generated; close a group
    at the first turn that does not (the turns up to it stay as generated past the previous end).

    Most candidate ends are cuts, so the first few are walked one by one, a cut confirmed when the next
    group's prompt does not extend this group up to its last turn (the oracle's criterion), read off the
    next group's text, which is needed anyway. An end is walked while walking has confirmed at least as
    many ends of its kind (`kinds[end]`) as it refuted: Kimi thinking rewrites only at user messages,
    Qwen3 also after a turn without reasoning. Past them the last good end is found by galloping then
    bisecting (a group that fails at one end fails at every later one: a rewritten turn stays
    rewritten): O(log) attempts per group, each no longer than twice the group. Every cut is checked
    with the oracle's criterion at the end; None when one fails or a group cannot be found.
    """
    located_at = functools.cache(attempt)  # each (first, last) rendered at most once

    groups: list[Rendered] = []
    walked: dict[Any, list[int]] = {}  # per kind of end: [confirmed, refuted] cuts so far
    start = 0
    while start < count:
        candidates = [end for end in ends if end >= start]
        good: tuple[int, Rendered] | None = None  # (index in candidates, its group)
        bad: tuple[int, int] | None = None  # (index in candidates, the first turn not as generated there)
        index, step = 0, 1
        while True:
            located = located_at(start, candidates[index])
            if located is None:
                return None
            if not isinstance(located, Rendered):
                bad = (index, located)
                break
            good = (index, located)
            if index == len(candidates) - 1:
                break
            end = candidates[index]
            tally = walked.setdefault(kinds[end] if kinds else None, [0, 0])
            if index < _WALKED_ENDS and tally[0] >= tally[1]:
                following = located_at(end + 1, candidates[index + 1])
                cut = isinstance(following, Rendered) and not _continues(located, following)
                tally[0 if cut else 1] += 1
                if cut:
                    break
                index += 1
            else:
                index, step = min(index + step, len(candidates) - 1), step * 2
        while bad is not None and bad[0] - (good[0] if good else -1) > 1:
            middle = ((good[0] if good else -1) + bad[0]) // 2
            located = located_at(start, candidates[middle])
            if located is None:
                return None
            if isinstance(located, Rendered):
                good = (middle, located)
            else:
                bad = (middle, located)
        best = None if good is None else (candidates[good[0]], good[1])
        if bad is not None and (best is None or bad[1] > best[0]):
            # The turns up to the first one not as generated stay so past the last good end: close there.
            closing = located_at(start, bad[1]) if bad[1] < candidates[bad[0]] else None
            if not isinstance(closing, Rendered):
                return None
            best = (bad[1], closing)
        if best is None:
            return None
        groups.append(best[1])
        start = best[0] + 1
    if any(_continues(previous, following) for previous, following in itertools.pairwise(groups)):
        return None
    return groups


def _continues(previous: Rendered, following: Rendered) -> bool:
    """Whether `following`'s first prompt extends `previous` up to its last turn: no cut between them."""
    return following.text[: following.spans[0][0]].startswith(previous.text[: previous.spans[-1][1]])


class _Composer:
    """A split group's text without rendering the conversation up to it.

    A group's sample is a history rendering up to the end of an anchor turn, then what follows the
    anchor in a small rendering: the anchor's own small context (`small_context`), the anchor and the
    messages up to the group's last turn, written as generated.
    Templates rewrite earlier turns when a user message follows them (Qwen3 keeps the reasoning of
    every turn since the last user message; Mistral moves the system prompt and tools to the last one)
    or when the turn is no longer last, so the history up to the anchor reads as the group's own
    rendering would show it, in one of two renderings:
    - the full rendering, up to the turn before the user message that opened the group's stretch
      (every turn before it has a user message after it in both), when that stretch is short or the last;
    - the rendering of the group's whole stretch (up to the turn before the next user message), up
      to the previous group's last turn, when the stretch is long (an agent's tool rounds): one render
      per long stretch instead of one per group.
    Both need the template to render a tool round the same whatever rounds follow it (probed per
    template: `TemplateLayout.reads_tool_rounds`); elsewhere the history comes from the full rendering
    up to the turn before the stretch's user message. Within a stretch of tool rounds, a group's prompt
    after the anchor is read off one rendering of the stretch up to its last turn's prompt (the history
    rendering itself where that is the stretch's, else one small rendering per stretch instead of one
    per group: `_read_after_anchor`).
    Checked: the anchor reads the same in the history and the small rendering (per group), a group
    that ends where its history rendering ends comes out as that rendering (per long stretch, and the
    last group as the full rendering), and the group before the last comes out as its prompt rendered
    whole (per conversation, by `split_groups`).
    """

    def __init__(self, renderer: Renderer, small: Renderer, template_messages: list[dict], indices: list[int],
                 generated: list[GeneratedTurn], layout: TemplateLayout, full: str, history: list[tuple[int, int]],
                 user_after: list[bool]):
        self.renderer, self.small, self.template_messages, self.indices = renderer, small, template_messages, indices
        self.generated, self.layout = generated, layout
        count = len(indices)
        # History renderings by the turn they end at: the full one, and the long stretches' (lazily).
        self.sources: dict[int, tuple[str, list[tuple[int, int]]] | None] = {count - 1: (full, history)}
        self.rendered: dict[int, str] = {}  # real renders of groups without history to share
        # Small renderings by (anchor, turn): the turn's prompt from the anchor's small context on.
        self.small_prompts: dict[tuple[int, int], str | None] = {}
        # groups (first, last turn) found equal to a real rendering
        self.checked: set[tuple[int, int]] = set()
        self.users = [index for index, message in enumerate(template_messages) if message["role"] == "user"]
        self.stretch_end = list(range(count))  # each turn's last turn before the next user message
        for position in range(count - 2, -1, -1):
            if not user_after[position]:  # no user message between this turn and the next
                self.stretch_end[position] = self.stretch_end[position + 1]

    def turn_after_prompt(self, last: int) -> str:
        """The conversation up to turn `last`: its prompt rendered, the turn as generated after it (as
        `Renderer.last` writes it; the turn's text does not depend on what precedes its small context)."""
        return self.renderer.prompt(self.template_messages[: self.indices[last]]) + self.generated[last].text + \
            self.generated[last].tail

    def _source(self, end: int) -> tuple[str, list[tuple[int, int]]] | None:
        if end not in self.sources:
            text = self.turn_after_prompt(end)
            turns = history_turns(text, self.generated[: end + 1], self.layout)
            self.sources[end] = None if turns is None else (text, turns)
        return self.sources[end]

    def _anchor(self, first: int) -> tuple[int, int] | None:
        """(the anchor turn, the turn its history rendering ends at) for a group starting at turn `first`."""
        start = self.indices[first]
        opened = [index for index in self.users if index < start]
        if first == 0 or not opened:
            return None
        count = len(self.indices)
        # Where the template renders a tool round the same whatever rounds follow (`reads_tool_rounds`),
        # the group's stretch up to the turn before it reads as in the stretch's own rendering.
        if self.users[-1] < start and self.layout.reads_tool_rounds:  # the last stretch: the full rendering's
            return first - 1, count - 1
        if start - opened[-1] > _SHORT_STRETCH and self.layout.reads_tool_rounds:
            return first - 1, self.stretch_end[first]
        before = self._before_stretch(first)
        return (before, count - 1) if before >= 0 else None

    def attempt(self, first: int, last: int) -> Rendered | int | None:
        anchored = self._anchor(first)
        if anchored is None:  # no history to share: rendered as the oracle renders it
            if last not in self.rendered:
                self.rendered[last] = self.turn_after_prompt(last)
            located = locate_group(self.rendered[last], self.generated, first, last, self.layout)
            if isinstance(located, Rendered):
                located.history = self.sources[len(self.indices) - 1][0]
            return located
        anchor_position, source_end = anchored
        source = self._source(source_end)
        if source is None:
            return None
        history_text, history = source
        # The group's turns are found in the composed text from the end of the anchor turn on.
        cursor, context_from = history[anchor_position][1], anchor_position + 1
        if source_end == len(self.indices) - 1:
            # A group that spans user messages (Kimi thinking) takes the stretches before its last turn's
            # from the full rendering as well: in its last turn's prompt they precede a user message too.
            anchor_position = max(anchor_position, self._before_stretch(last))
        history_start, history_end = history[anchor_position]
        after_anchor = self._after_anchor(anchor_position, last, history_text[history_start:history_end], source_end)
        if after_anchor is None:
            return None
        text = history_text[:history_end] + after_anchor + self.generated[last].text + self.generated[last].tail
        if last == source_end:
            if text != history_text:
                return None
            self.checked.add((first, last))
        located = locate_group(text, self.generated, first, last, self.layout, cursor, context_from)
        if isinstance(located, Rendered):
            located.history = history_text
        return located

    def _before_stretch(self, position: int) -> int:
        """The last turn before the user message that opens turn `position`'s stretch (-1: none)."""
        opened = max((user for user in self.users if user < self.indices[position]), default=-1)
        return max((before for before in range(position) if self.indices[before] < opened), default=-1)

    def _after_anchor(self, anchor_position: int, last: int, anchor_text: str, source_end: int) -> str | None:
        """Turn `last`'s prompt after the anchor turn, ending in the turn's header: read off its stretch's
        rendering where the template allows it, else rendered."""
        read = self._read_after_anchor(anchor_position, last, anchor_text, source_end)
        return read if read is not None else self._rendered_after_anchor(anchor_position, last, anchor_text)

    def _read_after_anchor(self, anchor_position: int, last: int, anchor_text: str, source_end: int) -> str | None:
        """Turn `last`'s prompt after the anchor, read off a rendering of the turns after it up to the last
        turn before the next user message (the stretch's end): the prompt of a turn is that rendering up to
        the turn's header, then the header (`_read_prompt`), since the turns after it in its stretch change
        nothing before it. The rendering is the history rendering itself where that ends at the stretch's
        end (the last stretch in the full rendering, a long stretch in its own), else the stretch end's
        prompt rendered small (one render per stretch instead of one per group). Only across tool rounds:
        every message from the turn to the stretch's end is an assistant turn with tool calls or a tool
        result, so a template that looks for the last message of some kind (Kimi thinking: the last
        assistant turn without tool calls) finds the same one in both. None elsewhere, where `last` ends
        its stretch (its own rendering is the stretch's) or where its header cannot be found."""
        anchor = self.template_messages[self.indices[anchor_position]]
        if anchor_position == last - 1 and self.generated[last].prompt_readable and \
                (self.layout.keeps_history or "reasoning_content" not in anchor):
            # No turn between the anchor and this one: what lies between (a user message, tool results)
            # reads as in the history rendering, where the anchor's history ends (the turn opens its
            # stretch, or its stretch's rendering is the history), and the turn's header as its small
            # context's prompt showed it. After an anchor with reasoning only where the template keeps
            # history (else the turn's prompt may show it where the history rendering does not: the small
            # rendering's anchor check says).
            text, turns = self._source(source_end)
            return text[turns[anchor_position][1]: turns[last][0]] + self.generated[last].header
        end = self.stretch_end[last]
        rounds = self.template_messages[self.indices[last]: self.indices[end]]
        if not self.layout.reads_tool_rounds or self.small.tools or last == end or \
                not all(message["role"] == "tool" or message.get("tool_calls") for message in rounds):
            return None
        if end == source_end:
            text, turns = self._source(source_end)
            start = turns[anchor_position][1]
        else:
            text = self._rendered_after_anchor(anchor_position, end, anchor_text)
            start = 0
        turns = None if text is None else \
            history_turns(text, self.generated[anchor_position + 1: last + 1], self.layout, start)
        return None if turns is None else text[start: turns[-1][0]] + self.generated[last].header

    def _rendered_after_anchor(self, anchor_position: int, last: int, anchor_text: str) -> str | None:
        """Turn `last`'s prompt after the anchor, from one small rendering: the anchor's small context, the
        anchor (with its reasoning: a template may show it there, as Kimi thinking does for a tool-call turn
        that a user message follows) and the messages up to the turn; None where the anchor does not read
        there as `anchor_text` (its history rendering) or the template cannot render it."""
        messages = self.template_messages
        anchor = self.indices[anchor_position]
        if (anchor_position, last) not in self.small_prompts:
            context = small_context(messages, anchor)
            try:  # the prompt of the turn; the turn follows as generated (as `Renderer.last` writes it)
                small = self.small.prompt(context + messages[anchor: self.indices[last]])
            except ChatTemplateError:
                small = None
            self.small_prompts[anchor_position, last] = small
        small = self.small_prompts[anchor_position, last]
        # The small context's prompt (rendered once per turn by generated_turns) ends in the anchor's
        # header: the anchor starts there in the small rendering too.
        header_at = len(self.generated[anchor_position].prompt) - len(self.generated[anchor_position].header)
        if small is None or header_at < 0 or not small.startswith(anchor_text, header_at):
            return None
        return small[header_at + len(anchor_text):]
