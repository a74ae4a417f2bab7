"""OpenAI-compatible endpoints for generation: client pools, probing, health, least-in-flight routing.

Per endpoint, one `openai.AsyncOpenAI` client on the SDK's aiohttp transport, its connection pool
sized to the concurrency we put on it, and a read timeout long enough for a 16K-token answer
(see `Endpoint.__init__`). Each endpoint is probed once for what it accepts: SGLang (since #30917) and vLLM return raw token ids when asked with `return_token_ids`
(vLLM puts `prompt_token_ids` on the response, SGLang on the choice); a server that rejects unknown
fields (`transformers serve` answers 422) gets plain requests instead of failing the run.

Routing: a request goes to the healthy endpoint with the fewest requests in flight and a free slot.
An endpoint that fails `unhealthy_after` transient errors in a row is skipped until its health
check passes again, so a dead server costs each in-flight request one attempt, not all of them.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import ssl
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import httpx2
import openai

logger = logging.getLogger(__name__)

TRANSIENT_STATUS_CODES = frozenset({408, 429})  # plus every 5xx


@dataclass(frozen=True)
class EndpointSpec:
    """Where to send requests. model=None takes the first model the server lists at /v1/models."""

    base_url: str
    model: str | None = None
    api_key: str = "EMPTY"


@dataclass(frozen=True)
class EndpointCapabilities:
    """What one probe found: the fields this server accepts and returns."""

    model: str
    accepts_token_ids: bool          # answers `return_token_ids` with completion token ids
    returns_prompt_token_ids: bool   # ... and the prompt's token ids
    rejects_unknown_fields: bool     # answered 4xx to `return_token_ids` (e.g. 422 from transformers serve)
    reasoning_field: str | None      # "reasoning_content" or "reasoning" when the answer carried the key


class TransientError(Exception):
    """Worth retrying: connection error, timeout, 408, 429 or 5xx."""

    def __init__(self, kind: str, message: str, status: int | None = None):
        super().__init__(f"{kind}: {message}")
        self.kind, self.message, self.status = kind, message, status


class RequestRejected(Exception):
    """Not worth retrying (400 prompt too long, 404 unknown model, ...): record the server's message."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status, self.message = status, message


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


def parse_chat_response(data: dict[str, Any]) -> ChatAnswer:
    """Read choice 0 of a chat completion, whichever server dialect sent it.

    Reasoning: `reasoning_content` (SGLang, vLLM < 0.17) or `reasoning` (vLLM 0.17+).
    Token ids: choice `token_ids`; prompt ids on the response (vLLM) or the choice (SGLang), or in
    SGLang's `sglext` extension (`input_ids` / `output_ids`).
    """
    try:
        choice = data["choices"][0]
        message = choice.get("message") or {}
    except (KeyError, IndexError, TypeError):
        raise TransientError("bad_response", f"no choices in response: {json.dumps(data)[:300]}") from None
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    usage = data.get("usage") or {}
    extension = data.get("sglext") or {}
    token_ids = choice.get("token_ids")
    if token_ids is None and isinstance(extension.get("output_ids"), list) and extension["output_ids"]:
        token_ids = extension["output_ids"][0]
    prompt_token_ids = choice.get("prompt_token_ids") or data.get("prompt_token_ids") or extension.get("input_ids")
    return ChatAnswer(
        content=message.get("content") or "", reasoning=reasoning or None, finish_reason=choice.get("finish_reason"),
        prompt_tokens=usage.get("prompt_tokens"), completion_tokens=usage.get("completion_tokens"),
        prompt_token_ids=prompt_token_ids, token_ids=token_ids)


@functools.cache
def tls_context() -> ssl.SSLContext:
    """One TLS context per process for every client: building one loads the CA store (~50 ms)."""
    return httpx2.create_ssl_context()


class Endpoint:
    """One OpenAI-compatible server: its client, in-flight count, health and probed capabilities."""

    def __init__(self, spec: EndpointSpec, max_connections: int, request_timeout_s: float,
                 connect_timeout_s: float = 10.0):
        self.spec = spec
        self.base_url = spec.base_url.rstrip("/")
        # Health lives at the server root (SGLang, vLLM, transformers serve all serve /health there).
        self.root_url = self.base_url[:-3] if self.base_url.endswith("/v1") else self.base_url
        self.max_connections = max_connections
        # One AsyncOpenAI client per endpoint on the SDK's aiohttp transport (the `openai[aiohttp]`
        # extra), its connection pool sized to the concurrency. The SDK's default httpx transport
        # costs ~1.8 ms of client CPU per request at concurrency 256, aiohttp ~0.6 ms
        # (bench/generation.py), and a 256-connection httpx pool scans every connection per request.
        self.http_client = openai.DefaultAioHttpClient(
            limits=httpx2.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            timeout=httpx2.Timeout(request_timeout_s, connect=connect_timeout_s), verify=tls_context())
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
        self.control_client = httpx2.AsyncClient(timeout=httpx2.Timeout(10.0, connect=connect_timeout_s),
                                                 verify=tls_context())
        self.in_flight = 0
        self.healthy = True
        self.consecutive_failures = 0
        self.capabilities: EndpointCapabilities | None = None

    @property
    def name(self) -> str:
        return self.base_url

    async def chat(self, messages: list[dict[str, str]], max_tokens: int, temperature: float | None,
                   top_p: float | None, extra_body: dict[str, Any] | None) -> ChatAnswer:
        """One chat completion, no retries; raises TransientError or RequestRejected."""
        assert self.capabilities is not None, "probe the endpoint before sending requests"
        body = dict(extra_body or {})
        if self.capabilities.accepts_token_ids:
            body["return_token_ids"] = True
        data = await self._post_chat(self.capabilities.model, messages, max_tokens, temperature, top_p, body)
        return parse_chat_response(data)

    async def _post_chat(self, model: str, messages: list[dict[str, str]], max_tokens: int,
                         temperature: float | None, top_p: float | None, extra_body: dict[str, Any]) -> dict:
        body: dict[str, Any] = {**extra_body, "model": model, "messages": messages, "max_tokens": max_tokens}
        if temperature is not None:
            body["temperature"] = temperature
        if top_p is not None:
            body["top_p"] = top_p
        try:
            # The POST goes through the SDK client's own HTTP client and pool with the SDK's headers,
            # but skips its per-request option building (typed options, deep copies, URL merging:
            # ~0.4 ms a request, the bulk of the client's cost at 1,000 requests/s). We read
            # non-standard fields (token_ids, reasoning) from the JSON, so its models add nothing.
            response = await self.http_client.post(self._chat_url, content=json.dumps(body).encode(),
                                                   headers=self._headers)
        except (httpx2.TransportError, aiohttp.ClientError, OSError) as error:
            # The aiohttp transport maps every dropped connection to httpx2.ConnectTimeout; the
            # aiohttp error it chains tells a real timeout (a TimeoutError) from a reset.
            cause = error.__cause__ or error
            timed_out = isinstance(cause, TimeoutError) or (cause is error and isinstance(error, httpx2.TimeoutException))
            raise TransientError("timeout" if timed_out else "connection", f"{type(cause).__name__}: {cause}") from None
        status = response.status_code
        if status >= 400:
            message = response.text[:2000]
            if status in TRANSIENT_STATUS_CODES or status >= 500:
                raise TransientError(f"http_{status}", message, status)
            raise RequestRejected(status, message)
        try:
            return json.loads(response.content)
        except json.JSONDecodeError as error:
            raise TransientError("bad_response", f"response is not JSON: {error}") from None

    async def list_models(self) -> list[str]:
        response = await self.control_client.get(f"{self.base_url}/models", timeout=30.0)
        response.raise_for_status()
        return [model["id"] for model in response.json().get("data", [])]

    async def probe(self) -> EndpointCapabilities:
        """Ask once with `return_token_ids`; on a 4xx ask plainly. Sets and returns the capabilities.

        Raises TransientError when the server cannot be reached (the caller retries later).
        """
        try:
            model = self.spec.model or (await self.list_models())[0]
        except IndexError:
            raise RequestRejected(404, f"{self.base_url}/models lists no model; pass the model name") from None
        except httpx2.HTTPError as error:
            raise TransientError("connection", f"{type(error).__name__}: {error}") from None
        messages = [{"role": "user", "content": "Say OK."}]
        rejects_unknown_fields = False
        try:
            data = await self._post_chat(model, messages, 1, 0.0, None, {"return_token_ids": True})
        except RequestRejected as error:
            if error.status not in (400, 422):
                raise
            logger.info("%s rejected return_token_ids (HTTP %d); sending plain requests", self.name, error.status)
            rejects_unknown_fields = True
            data = await self._post_chat(model, messages, 1, 0.0, None, {})
        choice = (data.get("choices") or [{}])[0]
        message = choice.get("message") or {}
        answer = parse_chat_response(data)
        self.capabilities = EndpointCapabilities(
            model=model, accepts_token_ids=answer.token_ids is not None,
            returns_prompt_token_ids=answer.prompt_token_ids is not None,
            rejects_unknown_fields=rejects_unknown_fields,
            reasoning_field=next((name for name in ("reasoning_content", "reasoning") if name in message), None))
        return self.capabilities

    async def check_health(self) -> bool:
        """True when the server answers /health with 2xx (or, lacking that route, lists its models)."""
        try:
            response = await self.control_client.get(f"{self.root_url}/health")
            if response.status_code == 404:
                response = await self.control_client.get(f"{self.base_url}/models")
            return response.is_success
        except (httpx2.HTTPError, OSError):
            return False

    async def aclose(self) -> None:
        await self.client.close()
        await self.control_client.aclose()


class EndpointPool:
    """Least-in-flight routing over healthy endpoints, with per-endpoint concurrency limits.

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

    @property
    def in_flight(self) -> int:
        return sum(endpoint.in_flight for endpoint in self.endpoints)

    def _pick(self, limit: int) -> Endpoint | None:
        candidates = [endpoint for endpoint in self.endpoints
                      if endpoint.healthy and endpoint.capabilities is not None and endpoint.in_flight < limit]
        return min(candidates, key=lambda endpoint: endpoint.in_flight, default=None)

    def notify(self) -> None:
        """Wake every waiter to re-check (a slot freed, health changed, or the run is stopping)."""
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def acquire(self, limit: int, stop: asyncio.Event | None = None) -> Endpoint | None:
        """Wait for a slot (in_flight < limit) on a healthy endpoint; take it on the least busy one.

        Returns None once `stop` is set (call `notify` after setting it to wake waiters).
        """
        while True:
            if stop is not None and stop.is_set():
                return None
            endpoint = self._pick(limit)
            if endpoint is not None:
                endpoint.in_flight += 1
                return endpoint
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            await waiter

    def release(self, endpoint: Endpoint, transient_failure: bool) -> None:
        """Give the slot back; count a transient failure toward marking the endpoint unhealthy."""
        endpoint.in_flight -= 1
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
                    logger.info("%s: %s", endpoint.name, capabilities)
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
