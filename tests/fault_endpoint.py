"""A small fault-injecting OpenAI-compatible endpoint on 127.0.0.1, for tests and bench.

A real HTTP/1.1 server (asyncio streams, keep-alive) rather than an ASGI app, because a test needs
to cut a connection mid-request (a TCP reset), which an ASGI framework does not allow, and the bench
needs a server whose per-request cost is far below the client's.

Behaviour per prompt is set by directives in the last message's text, so one server serves a whole
mixed run and the test reads what it asked for:
    #fault:500x2     answer HTTP 500 to the first 2 attempts of this prompt, then succeed
    #fault:429x1 / #fault:503x3 / #fault:408x1   same, other statuses
    #fault:resetx1   reset the TCP connection instead of answering (first attempt)
    #fault:slowx1    sleep `slow_seconds` before answering (past the client's timeout)
    #fault:drip      a whole answer, one byte every `drip_seconds` (no read waits long; the whole takes
                     minutes)
    #fault:huge      a valid answer `huge_bytes` long (a runaway body), streamed in 1 MiB chunks
    #fault:400       always 400 with a context-length message (x<n> works too); also 413, 422, 404
    #fault:401 / #fault:403   the key refused (x<n> works too)
    #retryafter:1.5  add `Retry-After: 1.5` to this prompt's 429/503 answers
    Malformed 200s (x<n> works too): #fault:nullchoice (choices[0] null), #fault:strchoice (a string),
    #fault:nomessage (a choice without message), #fault:nochoices (empty list), #fault:usagelist
    (usage a list), #fault:notjson (not JSON), #fault:badids (token_ids strings)
    #fault:toolcall  answer with tool calls (content null), OpenAI shape
    #fault:length    finish_reason "length" (truncated)
    #fault:abort / #fault:error   finish_reason "abort" / "error" (the server gave up: retried; x<n> works
                                  too)
    #fault:empty     empty content
    #fault:loop      content that ends in a repetition loop
    #fault:think     reasoning but empty content
    #sleep:0.25      answer after 0.25 s (bench latency distributions)
    #tokens:300      an answer of 300 tokens (fewer, finish_reason "length", past the request's max_tokens),
                     made at `token_seconds` a token: a decode of realistic length and time (ETA and
                     partition-overlap tests); each one's (prompt, start, end) is kept in `spans`, its seconds
                     in `in_flight`/`peak_in_flight`
Attempts are counted per prompt text. With `api_key` set, every route (health and models too)
answers 401 unless `Authorization: Bearer <api_key>` is sent; tests rotate it mid-run by assigning
`server.options.api_key` (and swap the served model by assigning `server.options.served_model`).
`last_request` holds the last chat request's JSON body, `chat_requests` all of them.
Server-wide options choose the dialect. `token_ids="sglang"` / `"vllm"` answer exactly in the
shape of that engine's own pydantic `ChatCompletionResponse` dump (the fixtures
tests/fixtures/serving/{sglang,vllm}_chat_protocol.json, built by protocol_fixtures.py from the
engines' models; tests/generation/test_protocol.py validates these answers against the models):
SGLang returns ids on the choice as `response_token_ids` + `prompt_token_ids`, vLLM as the choice's
`token_ids` + top-level `prompt_token_ids`, each only when the request asks `return_token_ids`.
`reasoning_field` turns the reasoning parser on (`reasoning_content`: SGLang and vLLM < 0.17;
`reasoning`: vLLM 0.17+); `strict_fields` 422s unknown request fields (like `transformers serve`).

Run in-process with `FaultEndpoint(...)` (a thread with its own event loop), or as a process:
`python tests/fault_endpoint.py --port 8123 --token-ids vllm --reasoning-field reasoning`
(prints `READY <port>` once listening; GET /stats gives request counts, server CPU seconds and the
sum of chat completions' service times, request read to response written).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import socket
import struct
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

DIRECTIVE = re.compile(r"#fault:(\w+?)(?:x(\d+))?(?=\s|$)")
SLEEP = re.compile(r"#sleep:([0-9.]+)")
TOKENS = re.compile(r"#tokens:(\d+)")
RETRY_AFTER = re.compile(r"#retryafter:([0-9.]+)")
KNOWN_FIELDS = {
    "model",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "stream",
    "stop",
    "seed",
    "frequency_penalty",
    "tools",
    "chat_template_kwargs",
}  # transformers serve's own fields
TRANSIENT_STATUSES = {"500": 500, "502": 502, "503": 503, "504": 504, "429": 429, "408": 408, "404": 404}
REQUEST_STATUSES = {"400": 400, "413": 413, "422": 422, "401": 401, "403": 403}
MALFORMED = {"nullchoice", "strchoice", "nomessage", "nochoices", "usagelist", "notjson", "badids"}


@dataclass
class FaultOptions:
    token_ids: str | None = None  # None (ignore return_token_ids), "vllm" or "sglang"
    reasoning_field: str | None = None  # None, "reasoning_content" or "reasoning"
    strict_fields: bool = False  # 422 on fields outside KNOWN_FIELDS, like `transformers serve`
    slow_seconds: float = 5.0
    model: str = "fault-model"
    api_key: str | None = None  # require `Authorization: Bearer <api_key>` on every route
    served_model: str | None = (
        None  # answers name this model whatever was asked (a restart with another model)
    )
    drip_seconds: float = 1.0  # #fault:drip: one byte of the answer every this many seconds
    huge_bytes: int = 256 << 20  # #fault:huge: the answer's content length
    token_seconds: float = 0.001  # #tokens:N: seconds per generated token


def fake_token_ids(text: str) -> list[int]:
    """Deterministic stand-in token ids: one per character (the tests check plumbing, not a vocab)."""
    return [ord(character) % 50_000 for character in text]


@dataclass
class FaultServer:
    options: FaultOptions
    attempts: Counter = field(default_factory=Counter)
    statuses: Counter = field(default_factory=Counter)
    requests: int = 0
    huge_bytes_sent: int = 0
    service_seconds: float = 0.0  # sum over chat completions of request read -> response written
    last_headers: dict = field(default_factory=dict)  # of the last chat completion, names lower-cased
    last_request: dict = field(default_factory=dict)  # the last chat completion's JSON body
    chat_requests: list = field(default_factory=list)  # every chat completion's JSON body, in arrival order
    control_headers: list = field(default_factory=list)  # (path, authorization) of GET requests
    in_flight: int = 0  # chat completions being answered now
    peak_in_flight: int = 0  # the most answered at once
    spans: list = field(default_factory=list)  # (prompt, start, end) of each #tokens answer, time.monotonic()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                    request_line, *header_lines = head.decode("latin-1").split("\r\n")
                    method, path, _ = request_line.split(" ", 2)
                    headers = {}
                    for line in header_lines:
                        if ":" in line:
                            name, value = line.split(":", 1)
                            headers[name.strip().lower()] = value.strip()
                    body = await reader.readexactly(int(headers.get("content-length", "0")))
                except (asyncio.IncompleteReadError, ConnectionError):
                    return  # the client went away (killed, timed out, or closing a keep-alive connection)
                received = time.perf_counter()
                if path.rstrip("/") == "/v1/chat/completions":
                    self.last_headers = headers
                if method == "GET":
                    self.control_headers.append((path, headers.get("authorization")))
                key = self.options.api_key
                if key is not None and headers.get("authorization") != f"Bearer {key}":
                    keep_going = self.send(
                        writer, 401, {"error": {"message": "Invalid API key", "code": 401}}
                    )
                    if path.rstrip("/") == "/v1/chat/completions":
                        self.requests += 1
                else:
                    keep_going = await self.respond(method, path, body, writer)
                if path.rstrip("/") == "/v1/chat/completions":
                    self.service_seconds += time.perf_counter() - received
                if not keep_going or headers.get("connection", "").lower() == "close":
                    return
        finally:
            if not writer.transport.is_closing():
                writer.close()

    async def respond(self, method: str, path: str, body: bytes, writer: asyncio.StreamWriter) -> bool:
        if method == "GET" and path.rstrip("/") in ("/health", "/v1/health"):
            return self.send(writer, 200, {"status": "ok"})
        if method == "GET" and path.rstrip("/") == "/v1/models":
            return self.send(
                writer, 200, {"object": "list", "data": [{"id": self.options.model, "object": "model"}]}
            )
        if method == "GET" and path.rstrip("/") == "/stats":
            return self.send(
                writer,
                200,
                {
                    "requests": self.requests,
                    "statuses": dict(self.statuses),
                    "cpu_seconds": time.process_time(),
                    "service_seconds": self.service_seconds,
                },
            )
        if method != "POST" or path.rstrip("/") != "/v1/chat/completions":
            return self.send(writer, 404, {"detail": "Not Found"})
        self.requests += 1
        request = json.loads(body)
        self.last_request = request
        self.chat_requests.append(request)
        unknown = sorted(set(request) - KNOWN_FIELDS)
        if self.options.strict_fields and unknown:
            return self.send(
                writer,
                422,
                {
                    "detail": [
                        {
                            "type": "extra_forbidden",
                            "loc": ["body", name],
                            "msg": "Extra inputs are not permitted",
                        }
                        for name in unknown
                    ]
                },
            )
        prompt = str(request["messages"][-1]["content"])
        self.attempts[prompt] += 1
        attempt = self.attempts[prompt]
        kind, count = None, None
        if match := DIRECTIVE.search(prompt):
            kind, count = match.group(1), int(match.group(2)) if match.group(2) else None
        if (sleep := SLEEP.search(prompt)) is not None:
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
            try:
                await asyncio.sleep(float(sleep.group(1)))
            finally:
                self.in_flight -= 1
        if (tokens := TOKENS.search(prompt)) is not None and kind is None:
            return await self.send_tokens(writer, request, prompt, int(tokens.group(1)))
        failing = kind is not None and (count is None or attempt <= count)
        if failing and kind in TRANSIENT_STATUSES:
            headers = {}
            if (retry_after := RETRY_AFTER.search(prompt)) is not None:
                headers["retry-after"] = retry_after.group(1)
            return self.send(
                writer, TRANSIENT_STATUSES[kind], {"error": {"message": f"injected {kind}"}}, headers
            )
        if failing and kind == "400":
            return self.send(
                writer,
                400,
                {
                    "object": "error",
                    "code": 400,
                    "message": (
                        "This model's maximum context length is 32 tokens. However, you requested 99 tokens."
                    ),
                },
            )
        if failing and kind in REQUEST_STATUSES:
            return self.send(writer, REQUEST_STATUSES[kind], {"error": {"message": f"injected {kind}"}})
        if failing and kind in MALFORMED:
            return self.send_malformed(writer, kind, self.completion(request, prompt, None))
        if failing and kind == "reset":
            self.statuses["reset"] += 1
            # SO_LINGER 0 makes close() send RST: the client sees a connection reset, not a clean close.
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
            return False
        if failing and kind == "slow":
            await asyncio.sleep(self.options.slow_seconds)
        if failing and kind == "drip":
            return await self.send_dripping(
                writer, json.dumps(self.completion(request, prompt, None)).encode()
            )
        if failing and kind == "huge":
            return await self.send_huge(writer)
        return self.send(writer, 200, self.completion(request, prompt, kind if failing else None))

    async def send_tokens(
        self, writer: asyncio.StreamWriter, request: dict, prompt: str, wanted: int
    ) -> bool:
        """An answer of `wanted` tokens (one a character), cut at the request's max_tokens, after that many
        tokens' decode time."""
        limit = request.get("max_tokens") or request.get("max_completion_tokens") or wanted
        made = min(wanted, int(limit))
        started = time.monotonic()
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            await asyncio.sleep(made * self.options.token_seconds)
        finally:
            self.in_flight -= 1
        self.spans.append((prompt, started, time.monotonic()))
        answer = self.completion(request, prompt, "length" if made < wanted else None)
        message = answer["choices"][0]["message"]
        message["content"] = "t" * made
        message.pop(self.options.reasoning_field or "", None)
        answer["usage"]["completion_tokens"] = made
        return self.send(writer, 200, answer)

    async def send_dripping(self, writer: asyncio.StreamWriter, body: bytes) -> bool:
        """A whole, valid answer sent one byte every `drip_seconds` (each read arrives well within any read
        timeout)."""
        self.statuses["drip"] += 1
        writer.write(
            (
                f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
            ).encode()
        )
        for index in range(len(body)):
            writer.write(body[index : index + 1])
            await writer.drain()
            await asyncio.sleep(self.options.drip_seconds)
        return True

    async def send_huge(self, writer: asyncio.StreamWriter) -> bool:
        """A valid chat completion whose content is `huge_bytes` long, streamed in 1 MiB chunks;
        `huge_bytes_sent` counts what left before the client stopped reading."""
        self.statuses["huge"] += 1
        head = (
            b'{"object": "chat.completion", "choices": [{"index": 0, "finish_reason": "stop", '
            b'"message": {"role": "assistant", "content": "'
        )
        tail = b'"}}], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}'
        chunk = b"x" * (1 << 20)
        chunks = self.options.huge_bytes // len(chunk)
        writer.write(
            f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
            f"{len(head) + chunks * len(chunk) + len(tail)}\r\n\r\n".encode()
            + head
        )
        for _ in range(chunks):
            writer.write(chunk)
            await writer.drain()
            self.huge_bytes_sent += len(chunk)
        writer.write(tail)
        return True

    def completion(self, request: dict, prompt: str, kind: str | None) -> dict:
        content, reasoning, finish_reason = f"Answer: {prompt}", "Let me think.", "stop"
        if kind in ("length", "abort", "error"):
            finish_reason = kind
        elif kind == "empty":
            content = ""
        elif kind == "loop":
            content = "Start. " + "the same words again " * 40
        elif kind == "think":
            content = ""
        elif kind == "toolcall":
            content, finish_reason = None, "tool_calls"
        prompt_text = "".join(str(message["content"]) for message in request["messages"])
        completion_text = (reasoning if self.options.reasoning_field else "") + (content or "")
        tool_calls = (
            [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps({"city": prompt[:20]})},
                }
            ]
            if kind == "toolcall"
            else None
        )
        ids = (
            fake_token_ids(completion_text) + [0] if request.get("return_token_ids") else None
        )  # + end-of-turn id
        prompt_ids = fake_token_ids(prompt_text) if ids is not None else None
        usage = {
            "prompt_tokens": len(prompt_text),
            "completion_tokens": len(completion_text),
            "total_tokens": len(prompt_text) + len(completion_text),
        }
        head = {
            "id": f"chatcmpl-{self.requests}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.options.served_model or request.get("model", self.options.model),
        }
        dialect = self.options.token_ids
        if dialect == "sglang":
            return self._sglang(head, content, reasoning, tool_calls, finish_reason, ids, prompt_ids, usage)
        if dialect == "vllm":
            return self._vllm(head, content, reasoning, tool_calls, finish_reason, ids, prompt_ids, usage)
        message = {"role": "assistant", "content": content}
        if tool_calls:
            message["tool_calls"] = tool_calls
        if self.options.reasoning_field:
            message[self.options.reasoning_field] = reasoning
        return {
            **head,
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}],
            "usage": usage,
        }

    def _reasoning(self, message: dict, own_field: str, reasoning: str) -> None:
        """The engine's own reasoning field, null without a reasoning parser (`reasoning_field` None);
        a `reasoning_field` other than the engine's own is an older release's name, sent beside it."""
        field_name = self.options.reasoning_field
        message[own_field] = reasoning if field_name == own_field else None
        if field_name and field_name != own_field:
            message[field_name] = reasoning

    def _sglang(
        self, head: dict, content, reasoning, tool_calls, finish_reason, ids, prompt_ids, usage
    ) -> dict:
        """SGLang 0.5.23's `ChatCompletionResponse.model_dump()`
        (tests/fixtures/serving/sglang_chat_protocol.json): ids on the choice as `response_token_ids` /
        `prompt_token_ids`, only when asked; None fields dropped where its serializers drop them."""
        message = {"role": "assistant", "content": content}
        self._reasoning(message, "reasoning_content", reasoning)
        if tool_calls:
            message["tool_calls"] = [
                {"id": call["id"], "index": index, **{key: call[key] for key in ("type", "function")}}
                for index, call in enumerate(tool_calls)
            ]
        choice = {
            "index": 0,
            "message": message,
            "logprobs": None,
            "finish_reason": finish_reason,
            "matched_stop": 0 if finish_reason == "stop" else None,
        }
        if ids is not None:
            choice["prompt_token_ids"], choice["response_token_ids"] = prompt_ids, ids
        usage = {
            "prompt_tokens": usage["prompt_tokens"],
            "total_tokens": usage["total_tokens"],
            "completion_tokens": usage["completion_tokens"],
            "prompt_tokens_details": None,
            "reasoning_tokens": 0,
            "completion_tokens_details": None,
        }
        return {**head, "choices": [choice], "usage": usage, "metadata": None}

    def _vllm(
        self, head: dict, content, reasoning, tool_calls, finish_reason, ids, prompt_ids, usage
    ) -> dict:
        """vLLM 0.32's `ChatCompletionResponse.model_dump()` (tests/fixtures/serving/vllm_chat_protocol.json):
        generated ids as the choice's `token_ids` (end-of-turn id included), prompt ids top-level."""
        message = {
            "role": "assistant",
            "content": content,
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
        }
        if tool_calls:
            message["tool_calls"] = tool_calls
        self._reasoning(message, "reasoning", reasoning)
        choice = {
            "index": 0,
            "message": message,
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
            "token_ids": ids,
            "routed_experts": None,
        }
        usage = {**usage, "prompt_tokens_details": None, "completion_tokens_details": None}
        return {
            **head,
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": None,
            "usage": usage,
            "prompt_logprobs": None,
            "prompt_token_ids": prompt_ids,
            "prompt_text": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }

    def send_malformed(self, writer: asyncio.StreamWriter, kind: str, good: dict) -> bool:
        """A 200 that is not a well-formed chat completion, as broken proxies and servers send them."""
        if kind == "notjson":
            return self.send(writer, 200, None, raw=b"<html>upstream error</html>")
        payload = dict(good)
        if kind == "nullchoice":
            payload["choices"] = [None]
        elif kind == "strchoice":
            payload["choices"] = ["Answer: text"]
        elif kind == "nomessage":
            payload["choices"] = [{"index": 0, "finish_reason": "stop"}]
        elif kind == "nochoices":
            payload["choices"] = []
        elif kind == "usagelist":
            payload["usage"] = [1, 2, 3]
        elif kind == "badids":
            payload["choices"] = [
                {**good["choices"][0], "token_ids": ["a", "b"], "response_token_ids": ["a", "b"]}
            ]
        return self.send(writer, 200, payload)

    def send(
        self,
        writer: asyncio.StreamWriter,
        status: int,
        payload: dict | None,
        headers: dict[str, str] | None = None,
        raw: bytes | None = None,
    ) -> bool:
        self.statuses[str(status)] += 1
        body = raw if raw is not None else json.dumps(payload).encode()
        reason = {
            200: "OK",
            400: "Bad Request",
            401: "Unauthorized",
            403: "Forbidden",
            404: "Not Found",
            408: "Request Timeout",
            413: "Content Too Large",
            422: "Unprocessable Entity",
            429: "Too Many Requests",
            503: "Service Unavailable",
        }.get(status, "Error")
        extra = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
        writer.write(
            f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n{extra}"
            f"content-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        return True


class FaultEndpoint:
    """The fault server in a background thread: `with FaultEndpoint(options) as endpoint:
    endpoint.base_url`."""

    def __init__(self, options: FaultOptions | None = None, port: int = 0):
        self.server = FaultServer(options or FaultOptions())
        self.port = port
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        listener = self._loop.run_until_complete(
            asyncio.start_server(self.server.handle, "127.0.0.1", self.port, reuse_address=True)
        )
        self.port = listener.sockets[0].getsockname()[1]
        self._listener = listener
        self._started.set()
        self._loop.run_forever()
        listener.close()
        # Connection handlers still parked on keep-alive reads: cancel them so the loop closes cleanly.
        pending = [task for task in asyncio.all_tasks(self._loop) if not task.done()]
        for task in pending:
            task.cancel()
        self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self._loop.close()

    def start(self) -> "FaultEndpoint":
        self._thread.start()
        if not self._started.wait(10):
            raise RuntimeError("fault endpoint did not start within 10 s")
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def __enter__(self) -> "FaultEndpoint":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


async def serve_forever(options: FaultOptions, port: int) -> None:
    server = FaultServer(options)
    listener = await asyncio.start_server(server.handle, "127.0.0.1", port, reuse_address=True, backlog=1024)
    print(f"READY {listener.sockets[0].getsockname()[1]}", flush=True)
    async with listener:
        await listener.serve_forever()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--token-ids", choices=["vllm", "sglang"], default=None)
    parser.add_argument("--reasoning-field", choices=["reasoning_content", "reasoning"], default=None)
    parser.add_argument("--strict-fields", action="store_true")
    parser.add_argument("--slow-seconds", type=float, default=5.0)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--token-seconds", type=float, default=0.001)
    args = parser.parse_args(argv)
    options = FaultOptions(
        token_ids=args.token_ids,
        reasoning_field=args.reasoning_field,
        strict_fields=args.strict_fields,
        slow_seconds=args.slow_seconds,
        api_key=args.api_key,
        token_seconds=args.token_seconds,
    )
    try:
        asyncio.run(serve_forever(options, args.port))
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
