"""Kit-schema messages -> the dicts chat templates read: reasoning placed as the template's layout says,
tool calls in the template's argument form (or as Hermes text where it has no tool-call syntax), tool
definitions normalized, and every control token quoted inside a message string replaced by one
private-use character (`Marker`), so that the template's own control tokens are the only ones."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from eaglekit.io import parse_json_text
from eaglekit.chat.template import PROBE_CALL_ID, ChatTemplateError, TemplateLayout


# One private-use character stands for each control token quoted inside a message (see module doc).
_MARK_BASE = 0xF3000
MARK_RANGE = re.compile("[\U000F3000-\U000F3FFF]")


def fold_reasoning(reasoning: str, content: str) -> str:
    return f"<think>\n{reasoning}\n</think>\n\n{content}"


def _mark(value: Any, pattern: re.Pattern | None, index: dict[str, int]) -> Any:
    """Replace each control token inside strings (recursively) by its private-use character."""
    if isinstance(value, str):
        value = MARK_RANGE.sub("", value)  # a message cannot forge a mark
        if pattern is None:
            return value
        return pattern.sub(lambda match: chr(_MARK_BASE + index[match.group(0)]), value)
    if isinstance(value, dict):
        return {key: _mark(item, pattern, index) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_mark(item, pattern, index) for item in value]
    return value


class Marker:
    def __init__(self, layout: TemplateLayout):
        self.tokens = layout.control_tokens
        self.index = {token: position for position, token in enumerate(self.tokens)}
        self.pattern = re.compile("|".join(map(re.escape, self.tokens))) if self.tokens else None

    def __call__(self, value: Any) -> Any:
        return _mark(value, self.pattern, self.index)

    def unmark(self, text: str) -> str:
        return MARK_RANGE.sub(lambda match: self.tokens[ord(match.group(0)) - _MARK_BASE], text)


def format_tool_call(name: str, arguments: Any) -> str:
    """One tool call as Hermes/Qwen text; `arguments` may be a JSON string or object."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": parse_json_text(arguments)}, ensure_ascii=False) + "\n</tool_call>"


def _arguments(arguments: Any, form: str) -> Any:
    if form == "string":
        return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return parse_json_text(arguments)


def to_template_messages(messages: Sequence[dict], layout: TemplateLayout, marker: Marker) -> list[dict]:
    """Kit schema -> the dicts chat templates read; reasoning placed per layout, strings marked."""
    out = []
    for message in messages:
        role = message["role"]
        content = marker(message.get("content") or "")
        item: dict[str, Any] = {"role": role, "content": content}
        reasoning = marker(message.get("reasoning") or "")
        if role == "assistant" and reasoning:
            if layout.reasoning == "field":
                item["reasoning_content"] = reasoning
            elif layout.reasoning == "fold":
                item["content"] = fold_reasoning(reasoning, content)
            else:
                # the template may show it on some turns (Kimi's tool-call turns);
                # Renderer.last places the rest
                item["reasoning_content"] = reasoning
                item["_reasoning"] = reasoning
        if role == "assistant" and message.get("tool_calls") and layout.tool_calls == "hermes-text":
            # The template has no tool-call syntax (SmolLM2, Phi-3.5): the calls as Hermes text, the form
            # such models were tuned on, so they are trained rather than silently dropped.
            calls = [format_tool_call(marker(call["function"]["name"]), marker(call["function"].get("arguments", {})))
                     for call in message["tool_calls"]]
            item["content"] = "\n".join(([item["content"]] if item["content"] else []) + calls)
        elif role == "assistant" and message.get("tool_calls"):
            item["tool_calls"] = [
                {"id": call.get("id") or PROBE_CALL_ID, "type": "function",
                 "function": {"name": marker(call["function"]["name"]),
                              "arguments": marker(_arguments(call["function"].get("arguments", {}),
                                                             layout.tool_arguments))}}
                for call in message["tool_calls"]]
        if role == "tool":
            if message.get("tool_call_id"):
                item["tool_call_id"] = message["tool_call_id"]
            if message.get("name"):
                item["name"] = marker(message["name"])
        out.append(item)
    return out


def normalize_tools(tools: Any) -> list[dict] | None:
    """Tool definitions as templates take them: a list of `{"type": "function", "function": {...}}`.

    Accepts a JSON string (Glaive stores them so) and bare function schemas."""
    if not tools:
        return None
    tools = parse_json_text(tools)
    if isinstance(tools, str):
        raise ChatTemplateError("meta.tools is a string that is not JSON")
    if isinstance(tools, dict):
        tools = [tools]
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise ChatTemplateError("meta.tools must be a list of tool definitions (objects)")
    return [tool if "function" in tool else {"type": "function", "function": tool} for tool in tools] or None
