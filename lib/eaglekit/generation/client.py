"""OpenAI-compatible endpoints for generation: client pools, probing, health, least-in-flight routing.

Per endpoint, one `openai.AsyncOpenAI` client on the SDK's aiohttp transport, its connection pool
sized to the concurrency we put on it, and a read timeout long enough for a 16K-token answer
(see `Endpoint.__init__`). Each endpoint is probed once for what it accepts: SGLang and vLLM return raw
token ids when asked with `return_token_ids` (SGLang as the choice's `response_token_ids`, vLLM as its
`token_ids`; see `parse_chat_response`); a server that rejects unknown
fields (`transformers serve` answers 422) gets plain requests instead of failing the run.

Routing: a request goes to the healthy endpoint with the fewest requests in flight and a free slot.
An endpoint that fails `unhealthy_after` transient errors in a row is skipped until its health
check passes again, so a dead server costs each in-flight request one attempt, not all of them.
A 429 or 503 with `Retry-After` pauses that endpoint (only that one) for the time asked.

What an HTTP status means for the run (the status sets of `eaglekit.generation.errors`):
- 401, 403: the key is missing, wrong or rotated. Every later request would fail the same way, so
  `EndpointAuthError` stops the run at once; no prompt is marked failed by it.
- 400, 413, 422: about this request (prompt too long, bad field): `RequestRejected`, recorded for
  the prompt, never retried within the run.
- everything else (408, 429, 5xx, and other 4xx such as a proxy's 404 during a restart): transient,
  retried with backoff; a 200 whose body is not a chat completion is a transient `bad_response`, and
  one that ends with finish_reason "abort" or "error" (the server gave up) a transient `finish_abort` /
  `finish_error`. "length" is an answer, recorded as truncated.
Health checks and `/v1/models` send the same key as the requests (a keyed server answers 401 to
anything without it).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import ssl
import time
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import aiohttp
import httpx2
import openai

from eaglekit.config import EndpointParams
from eaglekit.generation.errors import (
    AUTH_STATUS_CODES, REQUEST_STATUS_CODES, RETRY_AFTER_STATUS_CODES, EndpointAuthError, EndpointModelChangedError,
    RequestRejected, TransientError, parse_retry_after)

logger = logging.getLogger(__name__)

# Finish reasons that mean no answer: retried, then recorded as an error ("length" is a truncated answer).
GAVE_UP_FINISH_REASONS = frozenset({"abort", "error"})
# The most bytes an answer's body may hold: BODY_BYTES_PER_TOKEN per answer token (text escaped as \uXXXX runs
# to ~18 B a token, each token id ~7 B), BODY_BYTES_PER_PROMPT_CHAR per request character (the prompt's token
# ids come back), and BODY_BASE_BYTES for the rest. A body past it is a server fault: reading stops there, so
# a runaway answer (one of 210 MB was seen) costs the cap, not the kernel's memory.
BODY_BYTES_PER_TOKEN = 64
BODY_BYTES_PER_PROMPT_CHAR = 8
BODY_BASE_BYTES = 1 << 20
ERROR_BODY_BYTES = 64 << 10  # of an HTTP error's body: enough for the server's message
CONNECT_TIMEOUT_S = 10.0  # to open a connection, of a request or a control call
CONTROL_DEADLINE_S = 30.0  # a health check or model list, whole (a server that drips bytes never stalls one)
PROBE_DEADLINE_S = 120.0  # the probe's one-token answer, whole: a loaded server may queue it a while


@dataclass(frozen=True)
class EndpointSpec:
    """Where to send requests. model=None takes the first model the server lists at /v1/models.

    name: the label in records and log lines (params `endpoints[].name`; default the URL).
    api_key_env: the environment variable the key came from, named in an authentication error.
    concurrency: the most requests in flight on this endpoint (params `endpoints[].concurrency`);
        None: the partition's concurrency.
    """

    base_url: str
    model: str | None = None
    api_key: str = "EMPTY"
    name: str | None = None
    api_key_env: str | None = None
    concurrency: int | None = None

    @classmethod
    def from_params(cls, endpoint: EndpointParams) -> EndpointSpec:
        """One endpoint of params `endpoints` (or the embedded server's): the key read from its environment
        variable now, the label as the name."""
        return cls(base_url=endpoint.url, model=endpoint.model, api_key=endpoint.api_key(), name=endpoint.label,
                   api_key_env=endpoint.api_key_env, concurrency=endpoint.concurrency)

    @property
    def label(self) -> str:
        return self.name or self.base_url.rstrip("/")


@dataclass(frozen=True)
class EndpointCapabilities:
    """What one probe found: the fields this server accepts and returns."""

    model: str
    accepts_token_ids: bool          # answers `return_token_ids` with completion token ids
    returns_prompt_token_ids: bool   # ... and the prompt's token ids
    rejects_unknown_fields: bool     # answered 4xx to `return_token_ids` (e.g. 422 from transformers serve)
    reasoning_field: str | None      # "reasoning_content" or "reasoning" when the answer carried the key
    served_model: str | None = None  # the `model` the probe's answer named; later answers must name it too


class AnswerTooLarge(RequestRejected):
    """A 200 whose body passed the size cap (`answer_body_cap`): recorded for the prompt, naming the endpoint,
    never retried (the same request would run away again); the rest of the run goes on."""

    kind = "too_large"

    def __init__(self, endpoint: str, cap: int):
        super().__init__(200, f"endpoint {endpoint}: the answer's body passed {cap:,} bytes (max_tokens x "
                              f"{BODY_BYTES_PER_TOKEN} B + the prompt's allowance); reading stopped there")


@dataclass(frozen=True)
class ChatAnswer:
    """One parsed chat completion (choice 0) and what the server said about its tokens."""

    content: str
    reasoning: str | None
    finish_reason: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    prompt_token_ids: list[int] | None
    token_ids: list[int] | None
    tool_calls: list[dict[str, Any]] | None = None   # OpenAI shape, as the server sent them
    reasoning_field: str | None = None               # "reasoning_content" or "reasoning": where it came from


def _bad(reason: str, data: Any) -> TransientError:
    try:
        shown = json.dumps(data)[:300]
    except (TypeError, ValueError):
        shown = repr(data)[:300]
    return TransientError("bad_response", f"{reason}: {shown}")


def _optional(container: dict, key: str, kind: type, where: str, data: Any) -> Any:
    """container[key] when it is a `kind` (JSON true is not an int here), None when absent or null."""
    value = container.get(key)
    if value is not None and (not isinstance(value, kind) or (kind is int and isinstance(value, bool))):
        raise _bad(f"{where}{key} is {type(value).__name__}, expected {kind.__name__}", data)
    return value


def _token_list(value: Any, where: str, data: Any) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(token, int) and not isinstance(token, bool) for token in value):
        raise _bad(f"{where} is not a list of token ids", data)
    return value


def parse_chat_response(data: Any) -> ChatAnswer:
    """Read choice 0 of a chat completion, whichever server dialect sent it; validate every field used.

    Anything that is not a well-formed chat completion (no choices, choice 0 null or a string, no
    `message`, `usage` not an object, token ids not integers, ...) raises TransientError
    ("bad_response"): the prompt is retried and, past the attempt limit, recorded as an error. A
    choice without `message` is never taken for an empty answer.

    Reasoning: `reasoning_content` (SGLang, vLLM < 0.17) or `reasoning` (vLLM 0.17+).
    Token ids, as the engines' own protocol models name them (tests/fixtures/serving/*_chat_protocol.json):
    SGLang 0.5.23 puts a chat answer's ids on the choice as `response_token_ids` and the prompt's as
    the choice's `prompt_token_ids`; vLLM as the choice's `token_ids` (end-of-turn id included) and a
    top-level `prompt_token_ids`. SGLang's `sglext` extension (`input_ids` / `output_ids`) is the
    fallback.
    """
    if not isinstance(data, dict):
        raise _bad("response is not a JSON object", data)
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices:
        raise _bad("no choices in response", data)
    choice = choices[0]
    if not isinstance(choice, dict):
        raise _bad(f"choices[0] is {type(choice).__name__}, not an object", data)
    message = choice.get("message")
    if not isinstance(message, dict):
        raise _bad("choices[0] has no message object", data)
    content = _optional(message, "content", str, "message.", data)
    reasoning_field = next((name for name in ("reasoning_content", "reasoning") if message.get(name)), None)
    reasoning = _optional(message, reasoning_field, str, "message.", data) if reasoning_field else None
    tool_calls = _optional(message, "tool_calls", list, "message.", data)
    if tool_calls is not None:
        for index, call in enumerate(tool_calls):
            if not isinstance(call, dict) or not isinstance(call.get("function"), dict) \
                    or not isinstance(call["function"].get("name"), str):
                raise _bad(f"message.tool_calls[{index}] has no function.name", data)
    finish_reason = _optional(choice, "finish_reason", str, "choices[0].", data)
    usage = data.get("usage")
    if usage is not None and not isinstance(usage, dict):
        raise _bad(f"usage is {type(usage).__name__}, not an object", data)
    usage = usage or {}
    prompt_tokens = _optional(usage, "prompt_tokens", int, "usage.", data)
    completion_tokens = _optional(usage, "completion_tokens", int, "usage.", data)
    extension = data.get("sglext")
    if extension is not None and not isinstance(extension, dict):
        raise _bad("sglext is not an object", data)
    extension = extension or {}
    # SGLang's chat choice: `response_token_ids`; vLLM's (and SGLang's completions choice): `token_ids`.
    token_ids = _token_list(choice.get("response_token_ids"), "choices[0].response_token_ids", data)
    if token_ids is None:
        token_ids = _token_list(choice.get("token_ids"), "choices[0].token_ids", data)
    output_ids = extension.get("output_ids")
    if token_ids is None and isinstance(output_ids, list) and output_ids:
        token_ids = _token_list(output_ids[0], "sglext.output_ids[0]", data)
    prompt_token_ids = _token_list(
        choice.get("prompt_token_ids") or data.get("prompt_token_ids") or extension.get("input_ids"),
        "prompt_token_ids", data)
    return ChatAnswer(
        content=content or "", reasoning=reasoning or None, finish_reason=finish_reason,
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
        prompt_token_ids=prompt_token_ids, token_ids=token_ids, tool_calls=tool_calls or None,
        reasoning_field=reasoning_field)


def answer_body_cap(max_tokens: int, request_bytes: int) -> int:
    """The most bytes a chat answer's body may hold (see BODY_BYTES_PER_TOKEN)."""
    return BODY_BASE_BYTES + BODY_BYTES_PER_TOKEN * max_tokens + BODY_BYTES_PER_PROMPT_CHAR * request_bytes


async def _read_capped(response, cap: int) -> bytes | None:
    """The body, or None once it passes `cap` bytes (reading stops there)."""
    chunks, size = [], 0
    async for chunk in response.aiter_bytes():
        size += len(chunk)
        if size > cap:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


@functools.cache
def tls_context() -> ssl.SSLContext:
    """One TLS context per process for every client: building one loads the CA store (~50 ms)."""
    return httpx2.create_ssl_context()


class Endpoint:
    """One OpenAI-compatible server: its client, in-flight count, health and probed capabilities."""

    def __init__(self, spec: EndpointSpec, max_connections: int, request_timeout_s: float):
        self.spec = spec
        # The whole request, sending to the last byte of the answer: httpx's timeout bounds only each read, so
        # a server that sends a byte a second would hold a request (and a stop) for ever.
        self.request_deadline_s = request_timeout_s
        self.base_url = spec.base_url.rstrip("/")
        # Health lives at the server root (SGLang, vLLM, transformers serve all serve /health there).
        self.root_url = self.base_url.removesuffix("/v1")
        # One AsyncOpenAI client per endpoint on the SDK's aiohttp transport (the `openai[aiohttp]`
        # extra), its connection pool sized to the concurrency. The SDK's default httpx transport
        # costs ~1.8 ms of client CPU per request at concurrency 256, aiohttp ~0.6 ms
        # (bench/generation.py), and a 256-connection httpx pool scans every connection per request.
        self.http_client = openai.DefaultAioHttpClient(
            limits=httpx2.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            timeout=httpx2.Timeout(request_timeout_s, connect=CONNECT_TIMEOUT_S), verify=tls_context())
        # max_retries=0: retries are the engine's, with its own backoff, routing and attempt counts.
        self.client = openai.AsyncOpenAI(base_url=self.base_url, api_key=spec.api_key, max_retries=0,
                                         http_client=self.http_client)
        # The SDK's own headers (auth, user agent, platform), computed once: see `_post_chat`.
        self._headers = {"Authorization": f"Bearer {spec.api_key}", "Content-Type": "application/json",
                         **{name: value for name, value in self.client.default_headers.items()
                            if isinstance(value, str)}}
        self._chat_url = f"{self.base_url}/chat/completions"
        # Health checks and probes get their own small pool: they must answer while every request
        # connection is busy (or stale after a server restart), and quickly.
        # The key goes with them too: a keyed server answers 401 to /health and /v1/models without it.
        self.control_client = httpx2.AsyncClient(timeout=httpx2.Timeout(10.0, connect=CONNECT_TIMEOUT_S),
                                                 verify=tls_context(),
                                                 headers={"Authorization": f"Bearer {spec.api_key}"})
        self.in_flight = 0
        self.healthy = True
        self.consecutive_failures = 0
        self.paused_until = 0.0   # monotonic time before which a Retry-After asked us not to send
        self.capabilities: EndpointCapabilities | None = None

    @property
    def name(self) -> str:
        return self.spec.label

    def _auth_error(self, status: int, url: str, message: str) -> EndpointAuthError:
        return EndpointAuthError(self.name, status, url, message, self.spec.api_key_env)

    async def chat(self, messages: list[dict[str, Any]], max_tokens: int, temperature: float | None,
                   top_p: float | None, extra_body: dict[str, Any] | None,
                   tools: list[dict[str, Any]] | None = None,
                   chat_template_kwargs: dict[str, Any] | None = None) -> ChatAnswer:
        """One chat completion, no retries; raises TransientError, RequestRejected or EndpointAuthError.

        messages: OpenAI shape (assistant `tool_calls`, tool `tool_call_id` included); tools: the
        record's tool definitions in OpenAI function format, sent as `tools`. chat_template_kwargs:
        the kit's `prep.chat_template_kwargs` (e.g. {"enable_thinking": false} for Qwen3), sent as the
        top-level `chat_template_kwargs` object that SGLang, vLLM and `transformers serve` pass to the
        target's template (the openai client's `extra_body`), so the server renders the prompt as prep
        does; over any `chat_template_kwargs` already in extra_body.
        """
        assert self.capabilities is not None, "probe the endpoint before sending requests"
        body = dict(extra_body or {})
        if self.capabilities.accepts_token_ids:
            body["return_token_ids"] = True
        if tools:
            body["tools"] = tools
        if chat_template_kwargs:
            body["chat_template_kwargs"] = {**body.get("chat_template_kwargs", {}), **chat_template_kwargs}
        data = await self._post_chat(self.capabilities.model, messages, max_tokens, temperature, top_p, body)
        answer = parse_chat_response(data)
        served = self.capabilities.served_model
        if served is not None and isinstance(data.get("model"), str) and data["model"] != served:
            raise EndpointModelChangedError(self.name, served, data["model"])
        if answer.finish_reason in GAVE_UP_FINISH_REASONS:
            # The server gave up on the request (SGLang and vLLM "abort": cancelled, preempted, shut down;
            # vLLM "error"): whatever text came back is not an answer. Retried like any transient failure.
            raise TransientError(f"finish_{answer.finish_reason}",
                                 f"the server ended the request with finish_reason {answer.finish_reason!r} "
                                 f"after {answer.completion_tokens} tokens")
        return answer

    async def _post_chat(self, model: str, messages: list[dict[str, Any]], max_tokens: int,
                         temperature: float | None, top_p: float | None, extra_body: dict[str, Any],
                         deadline_s: float | None = None) -> Any:
        """One POST, whole within deadline_s (default the request deadline), its body within the size cap."""
        deadline_s = deadline_s or self.request_deadline_s
        body: dict[str, Any] = {**extra_body, "model": model, "messages": messages, "max_tokens": max_tokens}
        if temperature is not None:
            body["temperature"] = temperature
        if top_p is not None:
            body["top_p"] = top_p
        payload = json.dumps(body).encode()
        try:
            # The POST goes through the SDK client's own HTTP client and pool with the SDK's headers,
            # but skips its per-request option building (typed options, deep copies, URL merging:
            # ~0.4 ms a request, the bulk of the client's cost at 1,000 requests/s). We read
            # non-standard fields (token_ids, reasoning) from the JSON, so its models add nothing.
            status, headers, content = await asyncio.wait_for(
                self._post_capped(payload, answer_body_cap(max_tokens, len(payload))), deadline_s)
        except asyncio.TimeoutError:
            raise TransientError("timeout", f"no whole answer within {deadline_s:g} s "
                                            "(generation.request_timeout_s bounds the whole request)") from None
        except (httpx2.TransportError, aiohttp.ClientError, OSError) as error:
            # The aiohttp transport maps every dropped connection to httpx2.ConnectTimeout; the
            # aiohttp error it chains tells a real timeout (a TimeoutError) from a reset.
            cause = error.__cause__ or error
            timed_out = isinstance(cause, TimeoutError) or (cause is error and isinstance(error, httpx2.TimeoutException))
            raise TransientError("timeout" if timed_out else "connection", f"{type(cause).__name__}: {cause}") from None
        if status >= 400:
            message = content.decode("utf-8", "replace")[:2000]
            if status in AUTH_STATUS_CODES:
                raise self._auth_error(status, self._chat_url, message)
            if status in REQUEST_STATUS_CODES:
                raise RequestRejected(status, message)
            retry_after = parse_retry_after(headers.get("retry-after")) if status in RETRY_AFTER_STATUS_CODES else None
            raise TransientError(f"http_{status}", message, status, retry_after)
        try:
            return json.loads(content)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise TransientError("bad_response", f"response is not JSON: {error}") from None

    async def _post_capped(self, payload: bytes, cap: int) -> tuple[int, Any, bytes]:
        """(status, headers, body) of one POST, the body read in chunks and never past `cap` (AnswerTooLarge);
        an error's body only up to ERROR_BODY_BYTES."""
        async with self.http_client.stream("POST", self._chat_url, content=payload, headers=self._headers) as response:
            limit = cap if response.status_code < 400 else ERROR_BODY_BYTES
            content = await _read_capped(response, limit)
            if content is None and response.status_code < 400:
                raise AnswerTooLarge(self.name, cap)
            return response.status_code, response.headers, content if content is not None else b"(body cut)"

    async def list_models(self) -> list[str]:
        """Model ids at /v1/models (with the key). Raises EndpointAuthError on 401/403."""
        url = f"{self.base_url}/models"
        try:
            response = await asyncio.wait_for(self.control_client.get(url, timeout=30.0), CONTROL_DEADLINE_S)
        except asyncio.TimeoutError:
            raise TransientError("timeout", f"{url}: no whole answer within {CONTROL_DEADLINE_S:g} s") from None
        if response.status_code in AUTH_STATUS_CODES:
            raise self._auth_error(response.status_code, url, response.text)
        response.raise_for_status()
        try:
            listed = response.json().get("data", [])
            return [model["id"] for model in listed if isinstance(model, dict) and isinstance(model.get("id"), str)]
        except (ValueError, AttributeError) as error:
            raise TransientError("bad_response", f"{url} did not answer a model list: {error}") from None

    async def probe(self) -> EndpointCapabilities:
        """Ask once with `return_token_ids`; on a 4xx ask plainly. Sets and returns the capabilities.

        Raises TransientError when the server cannot be reached (the caller retries later) and
        EndpointAuthError when it refuses the key.
        """
        try:
            model = self.spec.model or (await self.list_models())[0]
        except IndexError:
            raise RequestRejected(404, f"{self.base_url}/models lists no model; pass the model name") from None
        except (httpx2.HTTPError, OSError) as error:
            raise TransientError("connection", f"{type(error).__name__}: {error}") from None
        messages = [{"role": "user", "content": "Say OK."}]
        rejects_unknown_fields = False
        try:
            data = await self._post_chat(model, messages, 1, 0.0, None, {"return_token_ids": True}, PROBE_DEADLINE_S)
        except RequestRejected as error:
            if error.status not in (400, 422):
                raise
            logger.info("%s rejected return_token_ids (HTTP %d); sending plain requests", self.name, error.status)
            rejects_unknown_fields = True
            data = await self._post_chat(model, messages, 1, 0.0, None, {}, PROBE_DEADLINE_S)
        answer = parse_chat_response(data)
        message = data["choices"][0]["message"]  # validated by parse_chat_response
        self.capabilities = EndpointCapabilities(
            model=model, accepts_token_ids=answer.token_ids is not None,
            returns_prompt_token_ids=answer.prompt_token_ids is not None,
            rejects_unknown_fields=rejects_unknown_fields,
            reasoning_field=next((name for name in ("reasoning_content", "reasoning") if name in message), None),
            served_model=data.get("model") if isinstance(data.get("model"), str) else None)
        return self.capabilities

    async def check_health(self) -> bool:
        """True when the server answers /health with 2xx (or, lacking that route, lists its models).

        Raises EndpointAuthError when the server refuses the key (health can never pass then).
        """
        try:
            url = f"{self.root_url}/health"
            response = await asyncio.wait_for(self.control_client.get(url), CONTROL_DEADLINE_S)
            if response.status_code == 404:
                url = f"{self.base_url}/models"
                response = await asyncio.wait_for(self.control_client.get(url), CONTROL_DEADLINE_S)
            if response.status_code in AUTH_STATUS_CODES:
                raise self._auth_error(response.status_code, url, response.text)
            return response.is_success
        except (httpx2.HTTPError, OSError, asyncio.TimeoutError):
            return False

    def pause(self, seconds: float) -> None:
        """Send nothing here for `seconds` (a Retry-After); the pool routes to other endpoints meanwhile."""
        self.paused_until = max(self.paused_until, time.monotonic() + seconds)

    async def aclose(self) -> None:
        await self.client.close()
        await self.control_client.aclose()


class EndpointPool:
    """Least-in-flight routing over healthy endpoints, partitions sharing each by the room a request takes:
    one of a partition whose concurrency there is C (capped by the endpoint's own) takes 1/C of it, and a
    request is sent only while the endpoint's shares add up to at most 1 (so the long partition starts as the
    short one drains; with one partition: in flight < C).

    Single event loop, so state changes need no lock: waiters park on futures that every change
    (a released slot, an endpoint back to health, a stop) resolves, and then re-check.
    """

    def __init__(self, endpoints: list[Endpoint], unhealthy_after: int = 3, health_interval_s: float = 5.0):
        if not endpoints:
            raise ValueError("no endpoints: give at least one base_url (or use the embedded server)")
        self.endpoints = endpoints
        self.unhealthy_after = unhealthy_after
        self.health_interval_s = health_interval_s
        self._waiters: list[asyncio.Future] = []
        self.unhealthy_since: dict[str, float] = {}
        self.shares = {endpoint.name: Fraction(0) for endpoint in endpoints}

    @property
    def in_flight(self) -> int:
        return sum(endpoint.in_flight for endpoint in self.endpoints)

    @staticmethod
    def share(limit: int, endpoint: Endpoint) -> Fraction:
        return Fraction(1, min(limit, endpoint.spec.concurrency or limit))

    def _pick(self, limit: int) -> Endpoint | None:
        now = time.monotonic()
        candidates = [endpoint for endpoint in self.endpoints
                      if endpoint.healthy and endpoint.capabilities is not None and endpoint.paused_until <= now
                      and self.shares[endpoint.name] + self.share(limit, endpoint) <= 1]
        return min(candidates, key=lambda endpoint: endpoint.in_flight, default=None)

    def _next_unpause(self) -> float | None:
        now = time.monotonic()
        pauses = [endpoint.paused_until for endpoint in self.endpoints if endpoint.paused_until > now]
        return min(pauses) - now if pauses else None

    def notify(self) -> None:
        """Wake every waiter to re-check (a slot freed, health changed, or the run is stopping)."""
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def acquire(self, limit: int, stop: asyncio.Event | None = None) -> Endpoint | None:
        """Wait for a slot (in_flight < limit and the endpoint's own cap) on a healthy endpoint; take it on
        the least busy one.

        Returns None once `stop` is set (call `notify` after setting it to wake waiters).
        """
        while True:
            if stop is not None and stop.is_set():
                return None
            endpoint = self._pick(limit)
            if endpoint is not None:  # no await between the pick and this: nothing else can take the room
                endpoint.in_flight += 1
                self.shares[endpoint.name] += self.share(limit, endpoint)
                return endpoint
            loop = asyncio.get_running_loop()
            waiter = loop.create_future()
            self._waiters.append(waiter)
            # A paused endpoint frees up by the clock, not by an event: wake up when its pause ends.
            wake = self._next_unpause()
            timer = loop.call_later(wake + 0.001, self.notify) if wake is not None else None
            try:
                await waiter
            finally:
                if timer is not None:
                    timer.cancel()

    def release(self, endpoint: Endpoint, transient_failure: bool, limit: int) -> None:
        """Give the slot (taken with `limit`) back; count a transient failure toward marking the endpoint
        unhealthy."""
        endpoint.in_flight -= 1
        self.shares[endpoint.name] -= self.share(limit, endpoint)
        if transient_failure:
            endpoint.consecutive_failures += 1
            if endpoint.healthy and endpoint.consecutive_failures >= self.unhealthy_after:
                endpoint.healthy = False
                self.unhealthy_since[endpoint.name] = time.monotonic()
                logger.warning("%s marked unhealthy after %d failures in a row; skipping it until /health passes",
                               endpoint.name, endpoint.consecutive_failures)
        else:
            endpoint.consecutive_failures = 0
        self.notify()

    async def probe_all(self, wait_s: float) -> None:
        """Probe every endpoint; an unreachable one starts unhealthy. Fails when none answers in wait_s."""
        deadline = time.monotonic() + wait_s
        errors: dict[str, str] = {}
        while True:
            for endpoint in self.endpoints:
                if endpoint.capabilities is not None:
                    continue
                try:
                    capabilities = await endpoint.probe()
                    logger.info("%s (%s): %s", endpoint.name, endpoint.base_url, capabilities)
                    endpoint.healthy = True
                except TransientError as error:
                    errors[endpoint.name] = str(error)
                    endpoint.healthy = False
            if any(endpoint.capabilities is not None for endpoint in self.endpoints):
                return
            if time.monotonic() >= deadline:
                details = "; ".join(f"{name}: {error}" for name, error in errors.items())
                raise ConnectionError(f"no endpoint answered within {wait_s:.0f} s ({details}). "
                                      "Start the server or fix base_url, then rerun: finished prompts are kept.")
            await asyncio.sleep(min(1.0, self.health_interval_s))

    async def health_loop(self) -> None:
        """Forever: re-check unhealthy (or never-probed) endpoints and bring back those that pass."""
        while True:
            await asyncio.sleep(self.health_interval_s)
            for endpoint in self.endpoints:
                if endpoint.healthy and endpoint.capabilities is not None:
                    continue
                try:
                    if not await endpoint.check_health():
                        continue
                    if endpoint.capabilities is None:
                        await endpoint.probe()
                except (TransientError, RequestRejected):
                    continue
                except EndpointAuthError:
                    raise  # the run stops: the engine watches this task
                except Exception:  # a bug here must not silently stop recovery for the rest of a 2-day run
                    logger.exception("health check of %s failed unexpectedly; trying again", endpoint.name)
                    continue
                endpoint.healthy = True
                endpoint.consecutive_failures = 0
                down = time.monotonic() - self.unhealthy_since.pop(endpoint.name, time.monotonic())
                logger.warning("%s is healthy again after %.0f s", endpoint.name, down)
                self.notify()

    async def aclose(self) -> None:
        for endpoint in self.endpoints:
            await endpoint.aclose()
