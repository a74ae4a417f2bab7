"""Split samples for templates that move text they wrote earlier into the last user turn (Mistral: the tool
definitions before it, the system prompt inside it while it is last): every turn's prompt is composed
from the full rendering and one small rendering per stretch, and samples are cut as the oracle cuts."""

from __future__ import annotations

import json

from eaglekit.chat.render import Renderer, small_context
from eaglekit.chat.template import PROBE_ASSISTANT, PROBE_USER, ChatTemplateError, TemplateLayout, after_nth
from eaglekit.chat.tokens import Rendered
from eaglekit.chat.turns import UNPROBED, GeneratedTurn, history_turns, locate_turns, shape_facts


def injected_groups(renderer: Renderer, template_messages: list[dict], indices: list[int],
                    generated: list[GeneratedTurn], layout: TemplateLayout) -> list[Rendered] | None:
    """Samples of the split policy for a template that writes the system prompt and tool definitions into
    the last user turn (Mistral: the tools before the last user message, the system prompt inside it
    only while it is the last message), cut where the oracle cuts; None where a check fails.

    Every turn's prompt P_i is composed, not rendered whole: the history before the last user message
    u as the full rendering shows it (there the tools sit before the conversation's last user message
    only and the system prompt nowhere), then what follows the assistant turn a before u (the anchor) in
    a rendering of the system prompt, a's small context, a and the messages from u on. The turns of u's
    stretch are read off one rendering of the stretch; the first turn's prompt (u is last there: the
    system prompt shows) with the system prompt inserted as `_system_insertion` probed, or, where the
    stretch has one turn or the probe does not read so, its own small prompt. Samples are then cut with
    the oracle's own criterion (P_{i+1} does not extend P_i + turn i) on the composed texts. Checked: the
    anchor reads the same in the full rendering and the small one, and the last turn's prompt and the last
    turn of the sample before the last sample equal their real renderings.
    """
    messages = template_messages[: indices[-1] + 1]
    count = len(indices)
    end_of_turn = layout.end_of_turn
    users = [index for index, message in enumerate(messages) if message["role"] == "user"]
    if not users or users[0] > indices[0] or any(message["role"] != "system" for message in messages[: users[0]]):
        return None  # a turn before any user message, or something else before it: the oracle decides
    if not _users_distinct(messages, users):
        return None
    system = messages[: users[0]]
    facts = shape_facts(renderer, layout)
    if facts.system_insertion is UNPROBED:
        facts.system_insertion = _system_insertion(renderer)
    insertion = facts.system_insertion
    full = renderer.whole(messages)
    history = history_turns(full, generated, layout)
    if history is None:
        return None
    position_of = {index: position for position, index in enumerate(indices)}
    composed: list[str] = [""] * count  # per turn: its prompt P_i as the oracle renders it
    for number, user in enumerate(users):
        stop = users[number + 1] if number + 1 < len(users) else len(messages)
        turns = [position for position in range(count) if user < indices[position] < stop]
        if not turns:
            continue
        if number > 0 and messages[user - 1]["role"] != "assistant":
            return None
        anchor = None if number == 0 else position_of[user - 1]
        prefix = _stretch_prefix(messages, system, None if number == 0 else user - 1)
        if anchor is None:
            def compose(text: str) -> str | None:
                return text
            cursor = 0
        else:
            # The anchor ends at the k-th end-of-turn token of the small rendering (k as in its own small
            # prompt and turn: the system prompt and tools add none before it).
            seen = (generated[anchor].prompt + generated[anchor].text).count(end_of_turn)
            anchor_start, anchor_end = history[anchor]
            anchor_text = full[anchor_start:anchor_end]

            def compose(text: str) -> str | None:
                at = after_nth(text, end_of_turn, seen)
                if at < 0 or not text.startswith(anchor_text, at - len(anchor_text)):
                    return None
                return full[:anchor_end] + text[at:]
            cursor = anchor_end
        first = None
        if len(turns) > 1:
            stretch = prefix + messages[user: indices[turns[-1]] + 1]
            text = full if stretch == messages else \
                compose(renderer.whole(stretch))
            located = None if text is None else locate_turns(text, generated, turns[0], turns[-1], cursor)
            if not isinstance(located, Rendered):
                return None
            for position, (start, _) in zip(turns[1:], located.spans[1:]):
                composed[position] = text[:start]
            if indices[turns[0]] == user + 1:  # the first turn's prompt: the stretch's, cut, u last
                first = _with_system(text[: located.spans[0][0]], prefix, messages[user], insertion)
        if first is None:
            first = compose(renderer.prompt(prefix + messages[user: indices[turns[0]]]))
        if first is None:
            return None
        composed[turns[0]] = first
    return _cut_and_check(renderer, messages, indices, composed, generated, full, layout)


def _cut_and_check(renderer: Renderer, messages: list[dict], indices: list[int], composed: list[str],
                   generated: list[GeneratedTurn], full: str, layout: TemplateLayout) -> list[Rendered] | None:
    """The composed prompts cut into samples by the oracle's criterion (P_{i+1} does not extend P_i + turn i),
    then checked against real renderings; None where a check fails."""
    count = len(indices)
    groups: list[Rendered] = []
    current: Rendered | None = None
    for position in range(count):
        prompt = composed[position]
        if current is not None and not prompt.startswith(current.text[: current.spans[-1][1]]):
            groups.append(current)
            current = None
        if current is None:
            current = Rendered("", history=full)
        current.text = prompt + generated[position].text + generated[position].tail
        current.spans.append((len(prompt), len(prompt) + len(generated[position].text)))
    assert current is not None
    groups.append(current)
    # Real checks: the last turn's prompt, and the last turn of the sample before the last.
    checks = [count - 1] + ([count - 1 - len(groups[-1].spans)] if len(groups) > 1 else [])
    for position in checks:
        if renderer.prompt(messages[: indices[position]]) != composed[position]:
            return None
    # The oracle's last sample is the full rendering where that extends the last prompt.
    if layout.reasoning == "splice":
        if renderer.last(messages, composed[-1]) != groups[-1].text:
            return None
    elif full.startswith(composed[-1]) and full != groups[-1].text:
        return None
    return groups


def _system_insertion(renderer: Renderer) -> tuple[str, str] | None:
    """(separator, tail) where a prompt whose last message is a user message u reads off a rendering that
    goes on after u: that rendering cut where the next turn's text starts, with the system prompt and the
    separator inserted before u's content, followed by `tail` up to the cut (Mistral: "\\n\\n" and
    "[/INST]"); probed with and without a system prompt, with and without a turn before u. None where the
    probes do not all read so: the stretch's first prompt is then rendered."""
    def pair(system: str | None, before: list[dict], user: str, answer: str) -> tuple[str, str, str] | None:
        head = [{"role": "system", "content": system}] if system is not None else []
        conversation = head + before + [{"role": "user", "content": user}]
        prompt = renderer.prompt(conversation)
        whole = renderer.whole(conversation + [{"role": "assistant", "content": answer}])
        at = whole.rfind(answer)
        return None if at < 0 else (prompt, whole[:at], system or "")

    earlier = [{"role": "user", "content": PROBE_USER + "0"}, {"role": "assistant", "content": PROBE_ASSISTANT + "0"}]
    try:
        probes = [pair(PROBE_USER + "SYSTEM1", [], PROBE_USER + "1", PROBE_ASSISTANT + "1"),
                  pair(PROBE_USER + "SYSTEM2", earlier, PROBE_USER + "2", PROBE_ASSISTANT + "2"),
                  pair(None, earlier, PROBE_USER + "3", PROBE_ASSISTANT + "3")]
    except ChatTemplateError:
        return None
    if any(probe is None for probe in probes):
        return None
    prompt, cut, system = probes[0]
    user = PROBE_USER + "1"
    at = cut.rfind(user)
    if at < 0 or not prompt.startswith(cut[:at] + system) or not prompt.endswith(cut[at:]):
        return None
    separator, tail = prompt[at + len(system): len(prompt) - len(cut) + at], cut[at + len(user):]
    for number, (prompt, cut, system) in enumerate(probes):
        content = {"role": "user", "content": PROBE_USER + str(number + 1)}
        head = [{"role": "system", "content": system}] if system else []
        if _with_system(cut, head, content, (separator, tail)) != prompt:
            return None
    return separator, tail


def _with_system(cut: str, prefix: list[dict], user: dict, insertion: tuple[str, str] | None) -> str | None:
    """A stretch's rendering `cut` where its first turn starts, as the prompt of that turn (u last): the
    system prompt (the prefix's first message, if a system message) inserted before u's content as
    `_system_insertion` probed; None where it cannot be read so (the prompt is then rendered)."""
    content = user.get("content")
    if insertion is None or not isinstance(content, str) or not content:
        return None
    separator, tail = insertion
    if not cut.endswith(content + tail):
        return None
    if not prefix or prefix[0]["role"] != "system":
        return cut
    system = prefix[0].get("content")
    if not isinstance(system, str) or not system:  # the probes had a system prompt with text
        return None
    at = len(cut) - len(content) - len(tail)
    return cut[:at] + system + separator + cut[at:]


def _users_distinct(messages: list[dict], users: list[int]) -> bool:
    """Whether no two user messages are equal: Mistral finds the last user message by equality, so an
    earlier equal one gets the tools as well, which the composition does not show."""
    keys = [json.dumps(messages[index], sort_keys=True, default=str) for index in users]
    return len(set(keys)) == len(keys)


def _stretch_prefix(messages: list[dict], system: list[dict], anchor: int | None) -> list[dict]:
    """What a small rendering of a stretch (from a user message on) starts with: the system prompt, then
    the assistant turn before the user message (the anchor) in its small context; for the first stretch
    the system prompt alone (the conversation's own beginning)."""
    if anchor is None:
        return list(system)
    return system + small_context(messages, anchor) + [messages[anchor]]
