"""Live serving measurement: accept length and tokens/s against SGLang and vLLM endpoints.

Accept length follows DESIGN.md: tokens emitted per target verification step, bonus included.

Prompts travel as token ids (chat template already applied), so both servers see the very prompts the
embedded loop ran: SGLang on native `POST /generate`, vLLM on `POST /v1/completions` (a list of ints as the
prompt, no template applied to it).

SGLang reports, per finished request, `meta_info.spec_verify_ct` (verification steps) beside
`meta_info.completion_tokens`; tau = completion_tokens / spec_verify_ct, pooled over requests as
sum/sum with the per-request mean beside it. /generate returns meta_info at the top level of the response
(`{"text", "output_ids", "meta_info"}`); `spec_verify_ct` is present only when the server was started with a
speculative algorithm, and only for requests with at least one verification step: a speculating server's
request without it counts as 0 steps (`with_zero_verification_steps`).
The topology (chain or tree, steps, top-k, draft tokens) is read from SGLang's server info.

vLLM exposes server-wide Prometheus counters at `/metrics` (their names and parsing: `vllm_counters`).
tau = 1 + delta(accepted) / delta(drafts) between a read before and after the run. The counters are
server-wide: any other traffic during the run is counted too, so measure on an otherwise idle server.

Tokens/s here is client-side: completion tokens over the wall-clock time of each request, requests
sent one at a time (concurrency 1), prefill included. The baseline endpoint gets the same prompts
and the same sampling settings.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import httpx
import pandas as pd

from eaglekit.analysis.acceptance import server_accept_length
from eaglekit.analysis.vllm_counters import VllmSpecCounters, parse_vllm_spec_counters

Prompt = Mapping[str, Any]  # {"id", "input_ids"}: the chat template already applied


def root_url(url: str) -> str:
    """Server root from a base URL that may end in /v1 (OpenAI clients) or a slash."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def _post_json(client: httpx.Client, url: str, body: dict) -> dict:
    try:
        response = client.post(url, json=body)
    except httpx.HTTPError as error:
        raise ConnectionError(f"POST {url} failed: {error!r}; is the server running and reachable?") from error
    if response.status_code != 200:
        raise RuntimeError(f"POST {url} answered {response.status_code}: {response.text[:500]}")
    return response.json()


def _get(client: httpx.Client, url: str) -> httpx.Response:
    try:
        return client.get(url)
    except httpx.HTTPError as error:
        raise ConnectionError(f"GET {url} failed: {error!r}; is the server running and reachable?") from error


def _get_ok(url: str, timeout: float) -> httpx.Response:
    with httpx.Client(timeout=timeout) as client:
        response = _get(client, url)
    if response.status_code != 200:
        raise RuntimeError(f"GET {url} answered {response.status_code}: {response.text[:300]}")
    return response


# ----------------------------------------------------------------------------- SGLang


def get_sglang_server_info(url: str, timeout: float = 30.0) -> dict:
    """SGLang's server info: `GET /server_info` (recent releases), falling back to `GET /get_server_info`."""
    base = root_url(url)
    with httpx.Client(timeout=timeout) as client:
        for path in ("/server_info", "/get_server_info"):
            response = _get(client, base + path)
            if response.status_code == 200:
                return response.json()
            if response.status_code != 404:
                raise RuntimeError(f"GET {base + path} answered {response.status_code}: {response.text[:300]}")
    raise RuntimeError(f"{base} has neither /server_info nor /get_server_info: is it an SGLang server?")


@dataclass(frozen=True)
class SpeculationSetup:
    """How a server speculates: recorded beside every accept length it reports."""

    algorithm: str | None = None  # e.g. "EAGLE3"; None when the server does not speculate
    topology: str | None = None  # "chain" (top-k 1) or "tree"
    steps: int | None = None  # draft steps per cycle
    topk: int | None = None
    draft_tokens: int | None = None  # tokens verified per cycle (SGLang's speculative_num_draft_tokens)
    draft_model_path: str | None = None


def sglang_speculation(server_info: Mapping[str, Any]) -> SpeculationSetup:
    """Read the speculative setup out of SGLang's server info (ServerArgs fields)."""
    algorithm = server_info.get("speculative_algorithm")
    if not algorithm:
        return SpeculationSetup()
    topk = server_info.get("speculative_eagle_topk")
    return SpeculationSetup(
        algorithm=str(algorithm),
        topology=None if topk is None else ("chain" if int(topk) == 1 else "tree"),
        steps=server_info.get("speculative_num_steps"),
        topk=topk,
        draft_tokens=server_info.get("speculative_num_draft_tokens"),
        draft_model_path=server_info.get("speculative_draft_model_path"),
    )


@dataclass(frozen=True)
class RequestRecord:
    """One request's measurement."""

    prompt_id: str
    completion_tokens: int
    wall_s: float  # client-side, one request at a time
    verification_steps: int | None  # SGLang spec_verify_ct; None when not reported
    server_latency_s: float | None  # SGLang meta_info.e2e_latency, when present
    finish_reason: str | None


def _prompt_id(prompt: Prompt, index: int) -> str:
    if "id" not in prompt:
        raise ValueError(f"prompt {index} has no 'id'; give every prompt a stable id")
    return str(prompt["id"])


def _token_ids(prompt: Prompt, index: int, route: str) -> list[int]:
    if "input_ids" not in prompt:
        raise ValueError(f"prompt {index} ({prompt.get('id')!r}) has no 'input_ids' for {route}: render it with the "
                         "target's chat template first (the servers apply none to token ids)")
    return [int(token) for token in prompt["input_ids"]]


def _one_at_a_time(url: str, route: str, prompts: Sequence[Prompt], timeout: float, body: Callable[[list[int]], dict],
                   record: Callable[[str, str, dict, float], RequestRecord]) -> list[RequestRecord]:
    """POST each prompt's token ids to `route` in turn (concurrency 1), timed: `body(ids)` is the request,
    `record(base, prompt_id, answer, wall_s)` reads the answer."""
    base = root_url(url)
    records = []
    with httpx.Client(timeout=timeout) as client:
        for index, prompt in enumerate(prompts):
            prompt_id, request = _prompt_id(prompt, index), body(_token_ids(prompt, index, route))
            started = time.perf_counter()
            answer = _post_json(client, base + route, request)
            records.append(record(base, prompt_id, answer, time.perf_counter() - started))
    return records


def run_sglang_requests(url: str, prompts: Sequence[Prompt], max_new_tokens: int = 256, temperature: float = 0.0,
                        timeout: float = 600.0) -> list[RequestRecord]:
    """Send prompts one at a time to SGLang's /generate and record tokens, time and verification steps."""
    def record(base: str, prompt_id: str, answer: dict, wall_s: float) -> RequestRecord:
        meta = answer.get("meta_info")
        if meta is None or "completion_tokens" not in meta:
            raise RuntimeError(f"{base}: the answer to prompt {prompt_id!r} carries no meta_info.completion_tokens: "
                               "is it an SGLang server?")
        finish = meta.get("finish_reason")
        return RequestRecord(
            prompt_id=prompt_id,
            completion_tokens=int(meta["completion_tokens"]),
            wall_s=wall_s,
            verification_steps=None if meta.get("spec_verify_ct") is None else int(meta["spec_verify_ct"]),
            server_latency_s=None if meta.get("e2e_latency") is None else float(meta["e2e_latency"]),
            finish_reason=finish.get("type") if isinstance(finish, Mapping) else finish,
        )

    sampling = {"max_new_tokens": max_new_tokens, "temperature": temperature}
    return _one_at_a_time(url, "/generate", prompts, timeout, lambda ids: {"input_ids": ids, "sampling_params": sampling}, record)


def run_openai_requests(url: str, prompts: Sequence[Prompt], model: str, max_tokens: int = 256, temperature: float = 0.0,
                        timeout: float = 600.0) -> list[RequestRecord]:
    """Send prompts one at a time to an OpenAI-compatible `POST /v1/completions` (vLLM, a baseline); no
    meta_info.

    The token ids go as `prompt`: vLLM takes a list of ints as the prompt and applies no template to it, so it
    sees token for token what SGLang's /generate gets from the same ids (a chat request would wrap the text in
    the template again). Completion tokens come from `usage` (the rate is built on it).
    """
    def record(base: str, prompt_id: str, answer: dict, wall_s: float) -> RequestRecord:
        usage = answer.get("usage") or {}
        if "completion_tokens" not in usage:
            raise RuntimeError(f"{base}: the answer to prompt {prompt_id!r} has no usage.completion_tokens")
        return RequestRecord(prompt_id, int(usage["completion_tokens"]), wall_s, None, None,
                             answer["choices"][0].get("finish_reason"))

    return _one_at_a_time(url, "/v1/completions", prompts, timeout, lambda ids: {
        "model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": temperature, "stream": False}, record)


# ----------------------------------------------------------------------------- summaries


@dataclass(frozen=True)
class ServingMeasurement:
    """One endpoint's result over a prompt set; tau fields are None for a baseline."""

    endpoint: str
    server: str  # "sglang", "vllm" or "openai"
    role: str  # "speculative" or "baseline"
    algorithm: str | None
    topology: str | None
    steps: int | None
    topk: int | None
    draft_tokens: int | None
    requests: int
    completion_tokens: int
    wall_s: float
    tokens_per_s: float  # sum tokens / sum wall time
    tokens_per_s_request_mean: float
    tau_pooled: float | None = None
    tau_request_mean: float | None = None
    tau_source: str | None = None  # how tau was obtained
    verification_steps: int | None = None


def _measurement(records: Sequence[RequestRecord], endpoint: str, server: str, role: str,
                 setup: SpeculationSetup = SpeculationSetup(), **tau: Any) -> ServingMeasurement:
    """One endpoint's row: throughput from its records, the setup it speculates with, tau fields as given."""
    if not records:
        raise ValueError(f"{endpoint}: no requests were measured")
    tokens = sum(record.completion_tokens for record in records)
    wall = sum(record.wall_s for record in records)
    per_request = [record.completion_tokens / record.wall_s for record in records if record.wall_s > 0]
    return ServingMeasurement(endpoint, server, role, setup.algorithm, setup.topology, setup.steps, setup.topk,
                              setup.draft_tokens, len(records), tokens, wall, tokens / wall,
                              sum(per_request) / len(per_request), **tau)


def with_zero_verification_steps(records: Sequence[RequestRecord]) -> list[RequestRecord]:
    """Records from a speculating SGLang with a missing spec_verify_ct read as 0 steps.

    SGLang writes the spec_* keys into meta_info only when spec_verify_ct > 0 (tokenizer_manager.py),
    so a request that never reached a verification step (answered by its prefill alone) lacks the
    key although the server speculates. Only for records of a server known to speculate."""
    return [record if record.verification_steps is not None else replace(record, verification_steps=0)
            for record in records]


def summarize_sglang(records: Sequence[RequestRecord], endpoint: str, setup: SpeculationSetup, role: str) -> ServingMeasurement:
    """Pool SGLang records: tau from completion_tokens / spec_verify_ct (sum/sum and per-request mean)."""
    if not records:
        raise ValueError(f"{endpoint}: no requests were measured")
    tau: dict[str, Any] = {}
    if role == "speculative":
        records = with_zero_verification_steps(records)
        if not any(record.verification_steps for record in records):
            raise RuntimeError(
                f"{endpoint}: no spec_verify_ct in meta_info for {[r.prompt_id for r in records][:5]}: the server is "
                "not speculating (start SGLang with --speculative-algorithm EAGLE3 --speculative-draft-model-path "
                "DRAFT)"
            )
        # Pooled over every request (a 0-step request's prefill token counts, as SGLang counts it per
        # request); the per-request mean over the requests that had verification steps (the others have no
        # tau).
        verified = [record for record in records if record.verification_steps]
        accept = server_accept_length([r.completion_tokens for r in verified], [r.verification_steps for r in verified])
        tau = {"tau_pooled": sum(r.completion_tokens for r in records) / accept.verification_steps,
               "tau_request_mean": accept.per_request_mean, "verification_steps": accept.verification_steps,
               "tau_source": "sglang meta_info completion_tokens / spec_verify_ct"}
    else:
        speculating = [record.prompt_id for record in records if record.verification_steps is not None]
        if speculating:
            raise RuntimeError(f"{endpoint}: the baseline reports spec_verify_ct for {speculating[:5]}: "
                               "start it without --speculative-algorithm")
    return _measurement(records, endpoint, "sglang", role, setup, **tau)


def measurements_frame(measurements: Sequence[ServingMeasurement]) -> pd.DataFrame:
    """Rows per endpoint; speedup = tokens/s over the baseline row's tokens/s (when there is one)."""
    frame = pd.DataFrame([asdict(measurement) for measurement in measurements])
    baselines = frame[frame["role"] == "baseline"]
    frame["speedup"] = frame["tokens_per_s"] / float(baselines["tokens_per_s"].iloc[0]) if len(baselines) else math.nan
    return frame


def records_frame(records: Sequence[RequestRecord], endpoint: str) -> pd.DataFrame:
    """Per-request rows (with each request's own tau where it has verification steps)."""
    frame = pd.DataFrame([asdict(record) for record in records]).assign(endpoint=endpoint)
    steps = frame["verification_steps"].astype("float64")
    frame["tau"] = frame["completion_tokens"] / steps
    frame["tokens_per_s"] = frame["completion_tokens"] / frame["wall_s"]
    return frame


def measure_sglang(
    speculative_url: str,
    prompts: Sequence[Prompt],
    baseline_url: str | None = None,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    timeout: float = 600.0,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """SGLang with speculation, and optionally the same prompts against a baseline SGLang without it.

    Returns (summary, per_request): summary has one row per endpoint with topology, tau pooled and
    per-request mean, tokens/s and speedup over the baseline.
    """
    setup = sglang_speculation(get_sglang_server_info(speculative_url, timeout))
    if setup.algorithm is None:
        raise RuntimeError(f"{speculative_url}: server info has no speculative_algorithm; start SGLang with --speculative-algorithm EAGLE3")
    speculative = run_sglang_requests(speculative_url, prompts, max_new_tokens, temperature, timeout)
    speculative = with_zero_verification_steps(speculative)  # the server speculates (its server info says so)
    measurements = [summarize_sglang(speculative, speculative_url, setup, "speculative")]
    per_request = [records_frame(speculative, speculative_url)]
    if baseline_url is not None:
        baseline = run_sglang_requests(baseline_url, prompts, max_new_tokens, temperature, timeout)
        measurements.append(summarize_sglang(baseline, baseline_url, SpeculationSetup(), "baseline"))
        per_request.append(records_frame(baseline, baseline_url))
    return measurements_frame(measurements), pd.concat(per_request, ignore_index=True)


# ----------------------------------------------------------------------------- vLLM


def read_vllm_spec_counters(url: str, timeout: float = 30.0) -> VllmSpecCounters:
    """GET {root}/metrics and parse the spec-decode counters."""
    metrics_url = root_url(url) + "/metrics"
    return parse_vllm_spec_counters(_get_ok(metrics_url, timeout).text, metrics_url)


def measure_vllm(
    speculative_url: str,
    prompts: Sequence[Prompt],
    model: str,
    baseline_url: str | None = None,
    baseline_model: str | None = None,
    max_tokens: int = 256,
    temperature: float = 0.0,
    timeout: float = 600.0,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """vLLM with speculation: tau = 1 + delta(accepted) / delta(drafts) around the run; optional baseline.

    Prompts are {"id", "input_ids"}, sent as token ids (`run_openai_requests`), the baseline likewise.
    Topology is recorded as a chain of as many steps as vLLM reports draft positions. Returns (summary,
    per_request); summary also carries per-position acceptance (accepted at position i / drafts) as
    `acceptance_per_position`.
    """
    before = read_vllm_spec_counters(speculative_url, timeout)
    records = run_openai_requests(speculative_url, prompts, model, max_tokens, temperature, timeout)
    delta = read_vllm_spec_counters(speculative_url, timeout).minus(before)
    if delta.drafts <= 0:
        raise RuntimeError(f"{speculative_url}: the drafts counter did not move during the run; speculation was not used")
    steps = len(delta.accepted_per_position) or None
    # A chain verifies its k drafts plus one token, as SGLang counts; no per-request tau (the counters are
    # server-wide).
    setup = SpeculationSetup("vllm speculative_config", "chain", steps, 1, None if steps is None else steps + 1)
    measurements = [_measurement(records, speculative_url, "vllm", "speculative", setup,
                                 tau_pooled=1.0 + delta.accepted_tokens / delta.drafts, verification_steps=int(delta.drafts),
                                 tau_source="vllm /metrics 1 + delta accepted / delta drafts (server-wide counters)")]
    per_request = [records_frame(records, speculative_url)]
    if baseline_url is not None:
        baseline = run_openai_requests(baseline_url, prompts, baseline_model or model, max_tokens, temperature, timeout)
        measurements.append(_measurement(baseline, baseline_url, "openai", "baseline"))
        per_request.append(records_frame(baseline, baseline_url))
    summary = measurements_frame(measurements)
    summary["acceptance_per_position"] = [
        [count / delta.drafts for count in delta.accepted_per_position] if row.role == "speculative" else None
        for row in summary.itertuples()
    ]
    return summary, pd.concat(per_request, ignore_index=True)


# ----------------------------------------------------------------------------- notebook 06's live measurement


def served_model_id(url: str, timeout: float = 30.0) -> str:
    """The model name an OpenAI-compatible server serves: the first entry of `GET /v1/models`.

    vLLM answers requests only for the name it serves (`--served-model-name`, else the path it loaded).
    """
    models_url = root_url(url) + "/v1/models"
    response = _get_ok(models_url, timeout)
    try:
        return str(response.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise RuntimeError(f"GET {models_url} answered without a model id (expected {{\"data\": [{{\"id\": ...}}]}}): "
                           f"{response.text[:300]}") from None


@dataclass(frozen=True)
class LiveServing:
    """Notebook 06's live measurement: one summary row per endpoint measured, per-request rows per server."""

    # measure_sglang / measure_vllm summaries stacked; None when no endpoint is configured
    summary: pd.DataFrame | None
    per_request: dict[str, pd.DataFrame]  # "sglang" / "vllm" -> per-request rows (baseline rows included)

    @property
    def measured(self) -> bool:
        return self.summary is not None

    def records(self) -> list[dict] | None:
        """The summary as JSON-ready rows (scaling_summary.json's "serving"), None when nothing was
        measured."""
        return None if self.summary is None else self.summary.to_dict(orient="records")

    def note(self) -> str:
        if self.summary is None:
            return "no live endpoints configured (analysis.sglang_endpoint / analysis.vllm_endpoint are unset): skipped"
        return f"live serving measured on {len(self.summary)} endpoint(s): {', '.join(self.summary['endpoint'])}"


def measure_live_serving(
    prompts: Sequence[Prompt],
    max_new_tokens: int,
    sglang_endpoint: str | None = None,
    baseline_endpoint: str | None = None,
    vllm_endpoint: str | None = None,
    timeout: float = 600.0,
) -> LiveServing:
    """The same prompts ({"id", "input_ids"}, chat template applied) against each configured endpoint.

    Both servers get the token ids, so both measure the very prompts the embedded loop ran: SGLang on
    /generate (with `baseline_endpoint`, the same target without speculation, beside it), vLLM on
    /v1/completions under the model name it serves. No endpoint configured: nothing is sent and
    `summary` is None.
    """
    summaries, per_request = [], {}
    # Only id and token ids travel: loop prompts carry more (their dataset), which no server needs.
    token_prompts = [{"id": _prompt_id(prompt, index), "input_ids": list(prompt["input_ids"])} for index, prompt in enumerate(prompts)]
    if sglang_endpoint:
        summary, per_request["sglang"] = measure_sglang(sglang_endpoint, token_prompts, baseline_url=baseline_endpoint,
                                                        max_new_tokens=max_new_tokens, timeout=timeout)
        summaries.append(summary)
    if vllm_endpoint:
        summary, per_request["vllm"] = measure_vllm(vllm_endpoint, token_prompts, model=served_model_id(vllm_endpoint),
                                                    max_tokens=max_new_tokens, timeout=timeout)
        summaries.append(summary)
    return LiveServing(summary=pd.concat(summaries, ignore_index=True) if summaries else None, per_request=per_request)
