"""What an endpoint's answer or error means for the run: the exceptions the client raises and the HTTP
statuses behind them (see eaglekit.generation.client's docstring for the policy each carries)."""

from __future__ import annotations

import email.utils
import math
import time

AUTH_STATUS_CODES = frozenset({401, 403})
REQUEST_STATUS_CODES = frozenset({400, 413, 422})  # about the request itself: terminal for the prompt
RETRY_AFTER_STATUS_CODES = frozenset({429, 503})
MAX_RETRY_AFTER_S = 600.0  # a server asking for more is honoured for this long, then asked again


class TransientError(Exception):
    """Worth retrying: connection error, timeout, 408, 429, 5xx, a malformed 200 (`bad_response`).

    retry_after_s: what the server asked for in `Retry-After` (429/503), else None.
    """

    def __init__(self, kind: str, message: str, status: int | None = None, retry_after_s: float | None = None):
        super().__init__(f"{kind}: {message}")
        self.kind, self.message, self.status, self.retry_after_s = kind, message, status, retry_after_s


class RequestRejected(Exception):
    """About the request itself (400 prompt too long, 413, 422): record the server's message, do not retry."""

    kind = "rejected"

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status, self.message = status, message


class EndpointFatalError(RuntimeError):
    """A fault of the endpoint, not of a prompt: the run stops at once, no prompt is marked failed, and a
    resume (once the endpoint is fixed) requests again whatever was in flight."""


class EndpointModelChangedError(EndpointFatalError):
    """An answer names another model than the probe found: the server was restarted with another model
    mid-run. Answers of two models would train one draft silently; the run stops, naming the endpoint and both
    models."""

    def __init__(self, endpoint: str, probed: str, answered: str):
        super().__init__(
            f"endpoint {endpoint}: an answer came from model {answered!r}, but the run started on {probed!r} (the probe's "
            "answer): the server now serves another model. Answers so far are kept, each from the probed model; serve "
            f"{probed!r} again and rerun with --resume, or start a new run id for the new model.")
        self.endpoint, self.probed, self.answered = endpoint, probed, answered


class EndpointAuthError(EndpointFatalError):
    """401/403: the endpoint refuses our key. Stops the run; the message names the endpoint and the fix."""

    def __init__(self, endpoint: str, status: int, url: str, message: str, api_key_env: str | None):
        where = f"the environment variable {api_key_env}" if api_key_env else \
            "an environment variable named by `api_key_env` in the endpoint's params"
        super().__init__(
            f"endpoint {endpoint}: HTTP {status} from {url}: the server refuses the API key ({message[:300]}). "
            f"Put a valid key in {where}, then rerun with --resume: finished prompts are kept and no prompt "
            "was marked failed by this.")
        self.endpoint, self.status, self.url = endpoint, status, url


def parse_retry_after(value: str | None) -> float | None:
    """Seconds to wait from a `Retry-After` header: delta-seconds or an HTTP date; None when absent or bad."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = email.utils.parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError, IndexError):
            return None
    if math.isnan(seconds):
        return None
    return min(max(0.0, seconds), MAX_RETRY_AFTER_S)
