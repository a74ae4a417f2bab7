"""Stage 3's input: stage 2's `prompts.jsonl` files read, validated, and turned into OpenAI-shape requests."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaglekit.io import InputError, parse_json_text, read_jsonl

PROMPT_ROLES = ("user", "tool")
# How past assistant turns carry their reasoning in a request, as prep renders them (the template's
# `TemplateLayout.reasoning`, see `history_reasoning_for`): "field" sends it as the message's
# `reasoning_content`, the key SGLang's template rendering reads and vLLM accepts (it passes it to the
# template as both `reasoning_content` and `reasoning`); "fold" writes `<think>\n{reasoning}\n</think>\n\n`
# before the content, as prep does for templates that render content verbatim (ChatML, Llama).
HISTORY_REASONING = ("field", "fold")


@dataclass(frozen=True)
class PromptSource:
    """One stage-2 `prompts.jsonl`: conversations whose last message is the prompt to answer."""

    dataset: str
    partition: str
    path: Path


@dataclass(frozen=True)
class PromptItem:
    dataset: str
    partition: str
    id: str
    messages: list[dict[str, Any]]          # what the server gets, in OpenAI shape
    tools: list[dict[str, Any]] | None = None  # the record's `meta.tools`, OpenAI function format


def _tool_call_request(call: Any, path: Path, line: int, where: str, fallback_id: str) -> dict[str, Any]:
    """One assistant tool call in the shape OpenAI-compatible servers accept (arguments as a JSON string)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InputError(path, line, f"{where}.function.name", "a tool call needs function.name (OpenAI shape)")
    arguments = function.get("arguments", {})
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": call.get("id") or fallback_id, "type": call.get("type") or "function",
            "function": {"name": function["name"], "arguments": arguments}}


def history_reasoning_for(tokenizer: Any, template_kwargs: dict | None = None) -> str:
    """"fold" or "field": how requests carry past reasoning so the server renders the prompt prep rendered."""
    from eaglekit.chat.layout import template_layout

    return "fold" if template_layout(tokenizer, template_kwargs).reasoning == "fold" else "field"


def _request_messages(messages: list[Any], path: Path, line: int, history_reasoning: str = "field") -> list[dict[str, Any]]:
    """Validate a conversation and keep what the server needs: role, content, reasoning of past
    assistant turns (per `history_reasoning`), tool calls and their ids."""
    request: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict) or message.get("role") not in ("system", "user", "assistant", "tool"):
            raise InputError(path, line, where, "needs role system|user|assistant|tool and string content")
        tool_calls = message.get("tool_calls")
        content = message.get("content")
        if not isinstance(content, str) and not (content is None and tool_calls):
            raise InputError(path, line, where, "needs role system|user|assistant|tool and string content")
        out: dict[str, Any] = {"role": message["role"], "content": content}
        reasoning = message.get("reasoning")
        if message["role"] == "assistant" and isinstance(reasoning, str) and reasoning:
            if history_reasoning == "fold":
                from eaglekit.chat.messages import fold_reasoning

                out["content"] = fold_reasoning(reasoning, content or "")
            else:
                out["reasoning_content"] = reasoning
        if tool_calls:
            if message["role"] != "assistant" or not isinstance(tool_calls, list):
                raise InputError(path, line, f"{where}.tool_calls", "only an assistant message carries a list of tool calls")
            # Fallback ids are 9 alphanumerics, the shape Mistral's template insists on (as prep writes them).
            out["tool_calls"] = [_tool_call_request(call, path, line, f"{where}.tool_calls[{number}]",
                                                    f"call{index:03d}{number:02d}")
                                 for number, call in enumerate(tool_calls)]
        if message["role"] == "tool":
            for key in ("tool_call_id", "name"):
                if isinstance(message.get(key), str):
                    out[key] = message[key]
        request.append(out)
    # A tool result without an id answers the call of the same position in the assistant turn before it.
    pending: list[str] = []
    for out in request:
        if out["role"] == "assistant":
            pending = [call["id"] for call in out.get("tool_calls", [])]
        elif out["role"] == "tool" and "tool_call_id" not in out and pending:
            out["tool_call_id"] = pending.pop(0)
    return request


def _request_tools(tools: Any, path: Path, line: int) -> list[dict[str, Any]] | None:
    """meta.tools as OpenAI `tools`: [{"type": "function", "function": {...}}]; bare functions are wrapped."""
    if tools is None or tools == []:
        return None
    tools = parse_json_text(tools)  # some datasets keep the definitions as a JSON string
    if isinstance(tools, str):
        raise InputError(path, line, "meta.tools", "a string that is not JSON tool definitions")
    if not isinstance(tools, list):
        raise InputError(path, line, "meta.tools", "expected a list of tool definitions")
    request = []
    for index, tool in enumerate(tools):
        if isinstance(tool, dict) and isinstance(tool.get("function"), dict) and isinstance(tool["function"].get("name"), str):
            request.append({"type": tool.get("type") or "function", "function": tool["function"]})
        elif isinstance(tool, dict) and isinstance(tool.get("name"), str):
            request.append({"type": "function", "function": tool})
        else:
            raise InputError(path, line, f"meta.tools[{index}]", "needs function.name (OpenAI function format)")
    return request


def load_prompts(sources: Sequence[PromptSource], history_reasoning: str = "field") -> tuple[list[PromptItem], int]:
    """Read every prompts file; returns (items in file order, duplicate ids skipped).

    history_reasoning: how past assistant turns carry their reasoning ("field" or "fold", see
    HISTORY_REASONING); the stage takes it from the target's template (`history_reasoning_for`).

    Fails with the file, line and field on a malformed conversation.
    """
    if history_reasoning not in HISTORY_REASONING:
        raise ValueError(f"history_reasoning must be one of {HISTORY_REASONING}, not {history_reasoning!r}")
    items: list[PromptItem] = []
    seen: set[tuple[str, str]] = set()
    duplicates = 0
    for source in sources:
        path = Path(source.path)
        if not path.exists():
            raise FileNotFoundError(f"{path}: prompts file for dataset {source.dataset!r} not found; run stage 2 first")
        for line_number, conversation in read_jsonl(path):
            if not isinstance(conversation, dict):
                raise InputError(path, line_number, None, "expected a JSON object (a conversation)")
            conversation_id = conversation.get("id")
            if not isinstance(conversation_id, str) or not conversation_id:
                raise InputError(path, line_number, "id", "missing or not a non-empty string")
            messages = conversation.get("messages")
            if not isinstance(messages, list) or not messages:
                raise InputError(path, line_number, "messages", "missing or empty")
            request = _request_messages(messages, path, line_number, history_reasoning)
            if request[-1]["role"] not in PROMPT_ROLES:
                raise InputError(path, line_number, f"messages[{len(messages) - 1}].role",
                                 f"last message is {request[-1]['role']!r}; a prompt to answer ends with a user "
                                 "(or tool) message (class-A conversations go straight to tokenization)")
            meta = conversation.get("meta")
            tools = _request_tools(meta.get("tools") if isinstance(meta, dict) else None, path, line_number)
            key = (source.dataset, conversation_id)
            if key in seen:
                duplicates += 1
                continue
            seen.add(key)
            items.append(PromptItem(source.dataset, source.partition, conversation_id, request, tools))
    return items, duplicates

