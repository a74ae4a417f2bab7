"""The template probe: `template_layout` renders small probe conversations once per tokenizer, template and
kwargs and records what the tokenization paths rely on (end-of-turn token, where reasoning goes, how tool
calls are written, which renderings stay prefixes of later ones) as a `TemplateLayout`."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

from eaglekit.chat.messages import Marker, fold_reasoning, to_template_messages
from eaglekit.chat.render import Renderer, render_template
from eaglekit.chat.template import (PROBE_ASSISTANT, PROBE_CALL_ID, PROBE_REASONING, PROBE_TOOL, PROBE_USER, ChatTemplateError,
                                    TemplateLayout, common_prefix_length, control_tokens_in, history_header)


_LAYOUT_CACHE: dict[tuple, TemplateLayout] = {}
_LAYOUT_CACHE_SIZE = 256
_NEEDS_TOOLS: dict[tuple[int, int, str, str], bool] = {}  # per template: renders only with tool definitions
# (its description is not PROBE_TOOL: the tool-call probe looks for that word in a rendering with them)
PROBE_TOOLS = [{"type": "function", "function": {"name": "probe", "description": "EAGLEKITPROBEDEFINITION",
                                                 "parameters": {"type": "object", "properties": {}}}}]


def _renders(tokenizer: Any, messages: list[dict], add_generation_prompt: bool, tools: list | None,
             template_kwargs: dict) -> bool:
    """Whether the template renders `messages` (a ChatTemplateError: it does not)."""
    try:
        render_template(tokenizer, messages, add_generation_prompt, tools, template_kwargs)
    except ChatTemplateError:
        return False
    return True


def _needs_tools(tokenizer: Any, template_kwargs: dict) -> bool:
    """Whether the template cannot render a probe conversation without tool definitions but can with them
    (where it cannot render it even then, the probe says why)."""
    user = [{"role": "user", "content": PROBE_USER}]
    return not _renders(tokenizer, user, True, None, template_kwargs) \
        and _renders(tokenizer, user, True, PROBE_TOOLS, template_kwargs)


def _chat_template_text(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise ChatTemplateError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has no chat template: "
            "set tokenizer.chat_template (the target's own template) before tokenizing conversations"
        )
    if not isinstance(template, str):
        raise ChatTemplateError("tokenizer has several named chat templates; set tokenizer.chat_template to one string")
    return template


def _control_tokens(tokenizer: Any, template: str) -> tuple[str, ...]:
    """Special added tokens, plus non-special added tokens the template writes itself (as
    transformers does)."""
    added = (getattr(tokenizer, "added_tokens_decoder", None) or {}).values()
    tokens = [token.content for token in added
              if token.content and not token.content.isspace() and (token.special or token.content in template)]
    return tuple(sorted(set(tokens), key=len, reverse=True))


def _probe_user() -> list[dict]:
    # fresh each call: a render never sees another's messages
    return [{"role": "user", "content": PROBE_USER}]


def _probe_assistant() -> dict:
    return {"role": "assistant", "content": PROBE_ASSISTANT}


def template_layout(tokenizer: Any, template_kwargs: dict | None = None, tools: list | None = None) -> TemplateLayout:
    """Probe the chat template once: end-of-turn token, where reasoning goes, tool-argument form, family.

    tools: the conversation's tool definitions (normalized). A template that renders only with tool
    definitions (Hermes-3's tool_use iterates `tools` unguarded) is probed with them, or with a probe tool
    where there are none: its layout is then cached per tool list (boundedly). Other templates ignore them."""
    template = _chat_template_text(tokenizer)
    template_kwargs = dict(template_kwargs or {})
    # len(tokenizer) counts added tokens: a tokenizer given more special tokens is probed again.
    key = (id(tokenizer), len(tokenizer), template, json.dumps(template_kwargs, sort_keys=True, default=str))
    control_tokens = _control_tokens(tokenizer, template)
    if key not in _NEEDS_TOOLS:
        _NEEDS_TOOLS[key] = _needs_tools(tokenizer, template_kwargs)
    # The probes render with the tools the template needs (marked, as a conversation's are), else with none.
    base = Marker(SimpleNamespace(control_tokens=control_tokens))(tools or PROBE_TOOLS) if _NEEDS_TOOLS[key] else None
    if base is not None:
        key = (*key, json.dumps(base, sort_keys=True, default=str))
    cached = _LAYOUT_CACHE.get(key)
    if cached is not None:
        return cached
    if len(_LAYOUT_CACHE) >= _LAYOUT_CACHE_SIZE:  # a dataset may give every record its own tool list
        del _LAYOUT_CACHE[next(iter(_LAYOUT_CACHE))]
    user, assistant = _probe_user(), _probe_assistant()
    prompt = render_template(tokenizer, user, True, base, template_kwargs)
    turn = render_template(tokenizer, user + [assistant], False, base, template_kwargs)
    end_of_turn, next_turn_closes = _end_of_turn(tokenizer, turn, base, template_kwargs, control_tokens)
    call, tool_arguments, tool_calls = _tool_call_form(tokenizer, base, template_kwargs)
    call_end_of_turn = _call_closer(tokenizer, user + [call], control_tokens, template_kwargs, base) \
        if next_turn_closes and tool_calls == "template" else ""
    reasoning = _reasoning_placement(tokenizer, prompt, turn, call, base, template_kwargs)
    stability = _tool_stability(tokenizer, call, base, template_kwargs)
    layout = TemplateLayout(
        **stability,
        end_of_turn=end_of_turn,
        next_turn_closes=next_turn_closes,
        call_end_of_turn=call_end_of_turn,
        end_of_turn_id=tokenizer.convert_tokens_to_ids(end_of_turn),
        reasoning=reasoning,
        tool_arguments=tool_arguments,
        tool_calls=tool_calls,
        control_tokens=control_tokens,
        family=_family(template, prompt, end_of_turn, reasoning),
        splits_at_control_tokens=_splits_at_control_tokens(tokenizer, end_of_turn),
    )
    layout = replace(layout, reads_tool_rounds=_reads_tool_rounds(tokenizer, layout, template_kwargs, base),
                     keeps_history=_keeps_history(tokenizer, layout, template_kwargs, base),
                     extends_prompt=_extends_prompt(tokenizer, layout, template_kwargs, base))
    _LAYOUT_CACHE[key] = layout
    return layout


def _end_of_turn(tokenizer: Any, turn: str, base: list | None, template_kwargs: dict, control_tokens) -> tuple[str, bool]:
    """(the token that closes an assistant turn, whether it is the next turn's role token),
    from the probe turn."""
    at = turn.find(PROBE_ASSISTANT)
    if at < 0:
        raise ChatTemplateError("chat template: an assistant turn's content does not appear in its rendering")
    closing = turn[at + len(PROBE_ASSISTANT):]
    end_of_turn = next((token for token in control_tokens_in(closing, control_tokens)), "")
    next_turn_closes = False
    if not end_of_turn and not closing:
        # No end-of-turn token (GLM-4.6): the turn is closed by the next message's role token, which the
        # model generates as its stop token; found by what follows the turn once a user message follows.
        following = render_template(tokenizer, _probe_user() + [_probe_assistant(), {"role": "user", "content": PROBE_USER + "2"}],
                                    False, base, template_kwargs)
        after = following[following.find(PROBE_ASSISTANT) + len(PROBE_ASSISTANT):]
        end_of_turn = next((token for token in control_tokens_in(after, control_tokens) if after.startswith(token)), "")
        next_turn_closes = bool(end_of_turn)
    if not end_of_turn:
        raise ChatTemplateError(
            f"chat template closes an assistant turn with {closing!r}, which holds no control token: the "
            "end-of-turn token cannot be located; use the target's own template (with its special tokens added)"
        )
    return end_of_turn, next_turn_closes


def _tool_call_form(tokenizer: Any, base: list | None, template_kwargs: dict) -> tuple[dict, str, str]:
    """(the probe call turn, tool arguments as "object" or "string", tool calls rendered by the "template" or
    as "hermes-text")."""
    user = _probe_user()
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": PROBE_CALL_ID, "type": "function", "function": {"name": "probe", "arguments": {"x": PROBE_TOOL}}}]}
    tool_arguments = "object" if _renders(tokenizer, user + [call], False, base, template_kwargs) else "string"
    if tool_arguments == "string":
        call["tool_calls"][0]["function"]["arguments"] = json.dumps({"x": PROBE_TOOL})
    tool_calls = "template" if PROBE_TOOL in render_template(tokenizer, user + [call], False, base, template_kwargs) \
        else "hermes-text"
    return call, tool_arguments, tool_calls


def _reasoning_placement(tokenizer: Any, prompt: str, turn: str, call: dict, base: list | None, template_kwargs: dict) -> str:
    """Where reasoning goes: "field" (the template renders reasoning_content), "fold" (written in the content,
    where the model wrote it) or "splice" (the kit places the think block itself)."""
    user, assistant = _probe_user(), _probe_assistant()
    reasoning_turns = [{**assistant, "reasoning_content": PROBE_REASONING},
                       {**call, "reasoning_content": PROBE_REASONING}]
    shown = all(PROBE_REASONING in render_template(tokenizer, user + [message], False, base, template_kwargs)
                for message in reasoning_turns)
    folded_turn = {"role": "assistant", "content": fold_reasoning(PROBE_REASONING, PROBE_ASSISTANT)}
    folded = render_template(tokenizer, user + [folded_turn], False, base, template_kwargs)
    if shown:
        return "field"
    if (turn.startswith(prompt) and not turn[len(prompt):].startswith("<think>") and folded.startswith(prompt)
            and fold_reasoning(PROBE_REASONING, PROBE_ASSISTANT) in folded and history_header(prompt) == prompt):
        # content is written verbatim: the reasoning goes where the model wrote it. Not where the generation
        # prompt opens a think block (Kimi-K2.5: "<think>" then history's "<think></think>" extends it):
        # the model wrote its reasoning inside that block, not as a second one in the content.
        return "fold"
    return "splice"  # the template writes its own think block or cuts reasoning: place it ourselves


def _tool_stability(tokenizer: Any, call: dict, base: list | None, template_kwargs: dict) -> dict[str, bool]:
    """Where the template puts tool definitions, and which earlier prompts stay prefixes of later ones."""
    user, assistant = _probe_user(), _probe_assistant()
    probe_tools = base or PROBE_TOOLS
    two_turns = [*user, assistant, {"role": "user", "content": PROBE_USER + "2"}]

    def stable(messages: list[dict], tools: list | None, later: int = 2) -> bool:
        """Whether the prompt of `messages` without its last `later` messages stays a prefix of its prompt."""
        try:
            first = render_template(tokenizer, messages[:-later], True, tools, template_kwargs)
            later = render_template(tokenizer, messages, True, tools, template_kwargs)
        except ChatTemplateError:
            return False
        return later.startswith(history_header(first))

    def with_and_without_tools(messages: list[dict], generation_prompt: bool) -> tuple[list[dict], str, str] | None:
        try:
            return (messages, render_template(tokenizer, messages, generation_prompt, probe_tools, template_kwargs),
                    render_template(tokenizer, messages, generation_prompt, None, template_kwargs))
        except ChatTemplateError:
            return None

    def inserted_before_last_user(messages: list[dict], with_tools: str, without: str) -> bool:
        added = len(with_tools) - len(without)
        at = common_prefix_length(with_tools, without)
        if added <= 0 or with_tools[at + added:] != without[at:]:
            return False  # not one inserted block
        users = [message["content"] for message in messages if message["role"] == "user"]
        last_user = without.rfind(users[-1])
        earlier = without.find(users[-2]) + len(users[-2]) if len(users) > 1 else 0
        return earlier <= at <= last_user

    rounds = [*user, call, {"role": "tool", "content": PROBE_USER + "3", "tool_call_id": PROBE_CALL_ID},
              {**assistant, "reasoning_content": PROBE_REASONING}]
    # Each probe conversation rendered once with the probe tool and once without (None: cannot render).
    tool_renderings = [with_and_without_tools(messages, generation_prompt) for messages, generation_prompt in
                       ((rounds, False), (rounds[:-1], True), (two_turns, True))]
    return {
        # with tools, the same text after a preamble (or the same text, where the template ignores tools: DeepSeek)
        "tools_in_preamble": all(pair is not None and pair[1].endswith(pair[2]) for pair in tool_renderings),
        "tools_before_last_user": all(pair is not None and inserted_before_last_user(*pair) for pair in tool_renderings),
        "stable_with_system": stable([{"role": "system", "content": PROBE_REASONING}, *two_turns], base),
        "stable_with_late_system": stable([*user, assistant, {"role": "system", "content": PROBE_REASONING},
                                           {"role": "user", "content": PROBE_USER + "2"}], base, 3),
        "stable_with_tools": stable(two_turns, probe_tools),
    }


def _probe_rounds(number: int, calls: int, reasoning: bool, content: str) -> list[dict]:
    """A probe assistant turn (kit schema) with `calls` tool calls, then their results."""
    turn = {"role": "assistant", "content": content, "tool_calls": [
        {"id": f"call{number * 10 + call:05d}", "type": "function",
         "function": {"name": "probe", "arguments": {"x": PROBE_TOOL}}} for call in range(calls)]}
    results = [{"role": "tool", "content": PROBE_TOOL, "tool_call_id": call["id"]} for call in turn["tool_calls"]]
    return [{**turn, "reasoning": PROBE_REASONING} if reasoning else turn, *results]


def _prompts_extend(tokenizer: Any, layout: TemplateLayout, template_kwargs: dict, conversation: list[dict],
                    ends: list[int], tools: list | None, whole: bool = False) -> bool:
    """Whether the prompt of `conversation` (`whole`: its rendering without a generation prompt) extends the
    prompt of each of its prefixes up to `ends` (their generation prompt's think opener left out)."""
    messages = to_template_messages(conversation, layout, Marker(layout))
    renderer = Renderer(tokenizer, layout, tools, template_kwargs)
    try:
        last = renderer.whole(messages) if whole else renderer.prompt(messages)
        return all(last.startswith(history_header(renderer.prompt(messages[:end]))) for end in ends)
    except ChatTemplateError:
        return False


def _reads_tool_rounds(tokenizer: Any, layout: TemplateLayout, template_kwargs: dict, tools: list | None) -> bool:
    """Whether the prompt of each turn in a probe stretch of tool rounds (reasoning on some turns, content
    on some, two calls on one) is the stretch's last prompt up to that turn's header."""
    if layout.tool_calls != "template":
        return False
    rounds: list[dict] = [{"role": "user", "content": PROBE_USER}]
    for number, (calls, reasoning, content) in enumerate([(1, True, ""), (1, False, PROBE_ASSISTANT), (2, True, ""),
                                                          (1, False, "")]):
        rounds += _probe_rounds(number + 1, calls, reasoning, content)
    turns = [index for index, message in enumerate(rounds) if message["role"] == "assistant"]
    return _prompts_extend(tokenizer, layout, template_kwargs, rounds, turns[1:], tools)


def _keeps_history(tokenizer: Any, layout: TemplateLayout, template_kwargs: dict, tools: list | None) -> bool:
    """Whether turns with reasoning that a user message follows (a tool-call turn right after its results,
    an answer) render in a prompt as in every later prompt, once answers and user messages follow (Kimi
    thinking shows such a tool-call turn's reasoning until an answer follows)."""
    answer = {"role": "assistant", "content": PROBE_ASSISTANT, "reasoning": PROBE_REASONING}
    conversation = [{"role": "user", "content": PROBE_USER}, *_probe_rounds(1, 1, True, ""),
                    {"role": "user", "content": PROBE_USER + "2"}, answer,
                    {"role": "user", "content": PROBE_USER + "3"}, answer, {"role": "user", "content": PROBE_USER + "4"}]
    return _prompts_extend(tokenizer, layout, template_kwargs, conversation, [4, 6], tools)


def _extends_prompt(tokenizer: Any, layout: TemplateLayout, template_kwargs: dict, tools: list | None) -> bool:
    """Whether a probe conversation's rendering up to its last turn (an answer with reasoning after tool
    rounds, one with reasoning, and an earlier stretch) extends the last turn's prompt."""
    answer = {"role": "assistant", "content": PROBE_ASSISTANT, "reasoning": PROBE_REASONING}
    conversation = [{"role": "user", "content": PROBE_USER}, answer, {"role": "user", "content": PROBE_USER + "2"},
                    *_probe_rounds(1, 1, True, ""), *_probe_rounds(2, 1, False, PROBE_ASSISTANT), answer]
    return _prompts_extend(tokenizer, layout, template_kwargs, conversation, [len(conversation) - 1], tools, whole=True)


def _call_closer(tokenizer: Any, messages: list[dict], control_tokens: tuple[str, ...], template_kwargs: dict,
                 tools: list | None) -> str:
    """The role token that closes a tool-call turn where the next message does (GLM-4.6's `<|observation|>`):
    what a tool result adds right after the turn's rendering; "" where it adds no such token."""
    try:
        alone = render_template(tokenizer, messages, False, tools, template_kwargs)
        followed = render_template(tokenizer, messages + [{"role": "tool", "content": PROBE_USER + "3",
                                                           "tool_call_id": PROBE_CALL_ID}], False, tools, template_kwargs)
    except ChatTemplateError:
        return ""
    after = followed[len(alone):] if followed.startswith(alone) else ""
    return next((token for token in control_tokens_in(after, control_tokens) if after.startswith(token)), "")


def _splits_at_control_tokens(tokenizer: Any, control_token: str) -> bool:
    before, after = " Hello world\n\n ", f"{control_token}\n\n  Hi there"
    whole = tokenizer(before + after, add_special_tokens=False)["input_ids"]
    parts = tokenizer([before, after], add_special_tokens=False)["input_ids"]
    return whole == parts[0] + parts[1]


def _family(template: str, prompt: str, end_of_turn: str, reasoning: str) -> str:
    """A readable name for the template's family (reported, never used to decide anything)."""
    thinking = "reasoning_content" in template or "<think>" in template
    if "<|im_start|>" in prompt:
        return "chatml-qwen3 (thinking)" if thinking else "chatml"
    if "<|start_header_id|>" in prompt:
        return "llama3"
    if "<|im_assistant|>" in prompt:
        return "kimi (thinking)" if thinking else "kimi"
    if "<｜Assistant｜>" in prompt:
        return "deepseek (thinking)" if "<think>" in template else "deepseek"
    if "[INST]" in prompt:
        return "mistral"
    if "<start_of_turn>" in prompt:
        return "gemma"
    if "[gMASK]" in prompt:
        return "glm (thinking)" if thinking else "glm"
    if "<|assistant|>" in prompt:
        return "phi3" if end_of_turn == "<|end|>" else "zephyr"
    return f"other (end of turn {end_of_turn}, reasoning {reasoning})"


def template_family(tokenizer: Any, template_kwargs: dict | None = None) -> str:
    return template_layout(tokenizer, template_kwargs).family
