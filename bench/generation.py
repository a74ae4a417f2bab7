"""Generation engine benchmarks, each measured side by side in one run.

1. Scheduling: against a local endpoint whose answers take long-tailed (lognormal) random times, the
   engine's wall time vs the ideal (sum of latencies / concurrency, the latencies being the endpoint's
   own answer times, which the server sums), vs wave batching (send `concurrency` requests, wait for
   all, repeat) against the same server, and where the rest goes: the tail any in-order continuous
   scheduler pays (simulated), the client's HTTP round trip, start-up. Goal: <= 1.05 x ideal.
2. Client overhead: requests/s against an instant local endpoint at concurrency 256, with the client
   process's CPU time per request (what bounds it) and the server process's CPU share (to show the
   server is not what we measure). Goal: >= 1,000 requests/s on 2 cores.
3. `--embedded`: the real embedded server (SmolLM2-135M on CPU) through the engine at concurrency
   1, 8, 32: completion tokens/s.
4. `--capacity`: the capacity plan checked against the embedded server with a small KV cache: a
   pilot measures prompt and completion lengths and the rate, `eaglekit.generation.capacity` plans the
   concurrency from them, then the same prompts run at the no-preemption worst case and at the
   planned concurrency: errors, completion tokens/s, and the pilot-rate ETA against the wall time.
5. `--partitions`: a short and a long partition (lognormal answer lengths, `--token-seconds` a token, the
   issue-38 run's shape at about 1/20 of its time) on the fault endpoint, once with each partition drained
   before the next (the engine before the overlap) and once with the long one starting in the room the short
   one's drain frees: wall times side by side, and the ETA the progress records gave at 10%, 25% and 50% of
   each run against the time actually left.

The endpoint is tests/fault_endpoint.py in its own process (a separate interpreter, so its work does
not share the client's GIL). Run: `python bench/generation.py [--requests N] [--embedded]`.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import openai

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from eaglekit.generation.client import EndpointSpec  # noqa: E402
from eaglekit.config import PartitionParams  # noqa: E402
from eaglekit.generation import PromptSource, generate, read_generations  # noqa: E402


def start_endpoint(token_seconds: float = 0.001) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "tests" / "fault_endpoint.py"),
            "--port",
            "0",
            "--token-seconds",
            str(token_seconds),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    line = process.stdout.readline()
    if not line.startswith("READY"):
        raise RuntimeError(f"fault endpoint did not start: {line!r}")
    return process, f"http://127.0.0.1:{line.split()[1]}/v1"


def write_prompts(path: Path, texts: list[str]) -> Path:
    with open(path, "w") as handle:
        for index, text in enumerate(texts):
            handle.write(
                json.dumps(
                    {"id": f"b{index}", "source": "bench", "messages": [{"role": "user", "content": text}]}
                )
                + "\n"
            )
    return path


def greedy_makespan(latencies: list[float], concurrency: int) -> float:
    """Wall time of a perfect continuous scheduler that starts requests in this order."""
    slots = [0.0] * concurrency
    for latency in latencies:
        heapq.heappush(slots, heapq.heappop(slots) + latency)
    return max(slots)


async def waves(base_url: str, texts: list[str], concurrency: int) -> float:
    """The baseline: batches of `concurrency` requests, each batch waiting for its slowest member."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="EMPTY", max_retries=0)
    started = time.perf_counter()
    for start in range(0, len(texts), concurrency):
        await asyncio.gather(
            *[
                client.chat.completions.create(
                    model="fault-model", messages=[{"role": "user", "content": text}], max_tokens=16
                )
                for text in texts[start : start + concurrency]
            ]
        )
    await client.close()
    return time.perf_counter() - started


def bench_scheduling(workdir: Path, requests: int, concurrency: int, median_s: float, sigma: float) -> None:
    rng = random.Random(0)
    latencies = [round(median_s * rng.lognormvariate(0.0, sigma), 4) for _ in range(requests)]
    texts = [f"q{index} #sleep:{latency}" for index, latency in enumerate(latencies)]
    prompts = write_prompts(workdir / "tail.jsonl", texts)
    requested_ideal = sum(latencies) / concurrency
    best_in_order = greedy_makespan(latencies, concurrency)
    process, base_url = start_endpoint()
    try:
        service_before = server_stats(base_url)["service_seconds"]
        started = time.perf_counter()
        generate(
            [PromptSource("bench", "short", prompts)],
            [EndpointSpec(base_url)],
            workdir / "tail_out",
            [PartitionParams(name="short", concurrency=concurrency, max_tokens=16)],
            progress_bar=False,
            log_interval_s=3600,
        )
        engine = time.perf_counter() - started
        service = server_stats(base_url)["service_seconds"] - service_before
        wave = asyncio.run(waves(base_url, texts, concurrency))
    finally:
        process.kill()
    records = list(read_generations(workdir / "tail_out").values())
    window = request_window(records)
    ideal = service / concurrency
    client_latency = sum(record["latency_s"] for record in records)
    print(
        f"[1] long-tailed latencies: {requests} requests, concurrency {concurrency}, lognormal median "
        f"{median_s * 1000:.0f} ms sigma {sigma} (mean {sum(latencies) / requests * 1000:.0f} "
        f"ms, max {max(latencies):.2f} s)"
    )
    print(
        f"    ideal = the endpoint's answer times (request read to response written, summed by the server) / "
        f"concurrency = {ideal:.2f} s"
    )
    print(
        f"    engine {engine:.2f} s | waves {wave:.2f} s | best in-order continuous scheduler (simulated on "
        f"the requested times) {best_in_order:.2f} s"
    )
    print(
        f"    engine / ideal = {engine / ideal:.3f} (goal <= 1.05) | waves / ideal = {wave / ideal:.3f} | "
        f"waves / engine = {wave / engine:.2f}x"
    )
    print(
        f"    where the rest goes: the last requests' tail {best_in_order / requested_ideal:.3f} x (any "
        f"in-order scheduler) | HTTP round trip {(client_latency - service) / requests * 1000:.2f} "
        f"ms/request on the client | start-up and summary {engine - window:.2f} s | requested times / "
        f"concurrency {requested_ideal:.2f} s (timer overshoot in the server: "
        f"{(service - sum(latencies)) / requests * 1000:.2f} ms/request)"
    )


def request_window(records: list[dict]) -> float:
    """First request start to last finish, from the records (no file setup, probe or summary)."""
    return max(r["finished_at"] for r in records) - min(r["finished_at"] - r["latency_s"] for r in records)


def server_stats(base_url: str) -> dict:
    return httpx.get(base_url.removesuffix("/v1") + "/stats").json()


def bench_overhead(workdir: Path, requests: int, concurrency: int) -> None:
    prompts = write_prompts(workdir / "instant.jsonl", [f"q{index}" for index in range(requests)])
    process, base_url = start_endpoint()
    try:
        server_before = server_stats(base_url)["cpu_seconds"]
        client_before = time.process_time()
        started = time.perf_counter()
        summary = generate(
            [PromptSource("bench", "short", prompts)],
            [EndpointSpec(base_url)],
            workdir / "instant_out",
            [PartitionParams(name="short", concurrency=concurrency, max_tokens=16)],
            progress_bar=False,
            log_interval_s=3600,
        )
        wall = time.perf_counter() - started
        client_cpu = time.process_time() - client_before
        server_cpu = server_stats(base_url)["cpu_seconds"] - server_before
    finally:
        process.kill()
    assert summary.datasets["bench"].done == requests
    # Request-only window from the records: first request start to last finish,
    # without file setup and summary.
    span = request_window(list(read_generations(workdir / "instant_out").values()))
    print(
        f"[2] instant endpoint, concurrency {concurrency}: {requests} requests in {wall:.2f} s wall = "
        f"{requests / wall:.0f} requests/s ({requests / span:.0f}/s over the request "
        f"window {span:.2f} s; goal >= 1000)"
    )
    print(
        f"    client CPU {client_cpu:.2f} s = {client_cpu / requests * 1e6:.0f} us/request (bound: "
        f"{requests / client_cpu:.0f} requests/s per core) | server CPU {server_cpu:.2f} s = "
        f"{server_cpu / requests * 1e6:.0f} us/request ({server_cpu / wall:.0%} of one core)"
    )


def bench_embedded(workdir: Path, max_tokens: int, levels: list[int]) -> None:
    try:
        from eaglekit.target import resolve_model
        from eaglekit.generation.server import EmbeddedServer

        model_dir = resolve_model("embedded:smollm2-135m-instruct")
    except Exception as error:  # the embedded model is optional for this bench
        print(f"[3] embedded server skipped: {type(error).__name__}: {error}")
        return
    with EmbeddedServer(model_dir, log_path=workdir / "server.log") as server:
        for concurrency in levels:
            count = max(8, 2 * concurrency)
            prompts = write_prompts(
                workdir / f"embedded_{concurrency}.jsonl",
                [f"Write a short sentence about the number {index}." for index in range(count)],
            )
            started = time.perf_counter()
            generate(
                [PromptSource("bench", "short", prompts)],
                [EndpointSpec(server.base_url, model=server.model_name)],
                workdir / f"embedded_out_{concurrency}",
                [PartitionParams(name="short", concurrency=concurrency, max_tokens=max_tokens)],
                temperature=0.0,
                progress_bar=False,
                log_interval_s=3600,
            )
            wall = time.perf_counter() - started
            tokens = sum(
                r["completion_tokens"] or 0
                for r in read_generations(workdir / f"embedded_out_{concurrency}").values()
            )
            print(
                f"[3] embedded SmolLM2-135M, concurrency {concurrency:>2}: {count} requests x <= "
                f"{max_tokens} tokens, {tokens} completion tokens in {wall:.1f} s "
                f"= {tokens / wall:.1f} tokens/s"
            )


def bench_capacity(workdir: Path, kv_cache_tokens: int, max_tokens: int, requested: int, count: int) -> None:
    from eaglekit.generation.capacity import length_plan, sequences_that_fit
    from eaglekit.target import resolve_model
    from eaglekit.generation.plan import pilot_lengths
    from eaglekit.config import ServerParams
    from eaglekit.generation.server import EmbeddedServer

    model_dir = resolve_model("embedded:smollm2-135m-instruct")
    context = "Background: " + " ".join(f"fact {index} is about item {index * 7}." for index in range(20))
    topics = ["a cat", "the sea", "rain", "a bridge", "bread", "a clock", "the moon", "a river"]

    def prompts(name: str, count: int, offset: int) -> list[PromptSource]:
        texts = [
            f"{context[: 40 + 70 * ((offset + index) % 11)]}\nName one colour linked to "
            f"{topics[(offset + index) % len(topics)]}. One word."
            for index in range(count)
        ]
        return [PromptSource("bench", "short", write_prompts(workdir / f"{name}.jsonl", texts))]

    settings = ServerParams(kv_cache_tokens=kv_cache_tokens)
    with EmbeddedServer(
        model_dir, settings=settings, log_path=workdir / "capacity_server.log", cb_page_size=64
    ) as server:
        endpoint = [EndpointSpec(server.base_url, model=server.model_name, name="embedded")]

        def run(name: str, sources: list[PromptSource], concurrency: int) -> tuple[float, object]:
            started = time.perf_counter()
            summary = generate(
                sources,
                endpoint,
                workdir / name,
                [PartitionParams(name="short", concurrency=concurrency, max_tokens=max_tokens)],
                temperature=0.0,
                progress_bar=False,
                log_interval_s=3600,
            )
            return time.perf_counter() - started, summary

        pilot_concurrency = 4
        run("pilot", prompts("pilot", count, 0), pilot_concurrency)
        pilot = pilot_lengths(workdir / "pilot")["short"]
        prompt_p95 = int(np.quantile(pilot.prompt_tokens, 0.95))
        worst = sequences_that_fit(kv_cache_tokens, prompt_p95 + max_tokens)
        plan = length_plan(kv_cache_tokens, pilot.prompt_tokens, pilot.completion_tokens, page_size=64)
        planned = min(requested, plan.retraction_concurrency)
        print(
            f"[4] capacity plan, embedded SmolLM2-135M, KV cache {kv_cache_tokens} tokens (pages of 64), "
            f"max_tokens {max_tokens}: pilot of {count} at concurrency {pilot_concurrency}: prompt mean "
            f"{np.mean(pilot.prompt_tokens):.0f} (p95 {prompt_p95}), completion mean "
            f"{np.mean(pilot.completion_tokens):.1f} tokens, {pilot.requests_per_second:.2f} req/s"
        )
        print(
            f"    no-preemption worst case {worst}; from lengths: {plan.expected_tokens_per_sequence:.0f} "
            f"tokens per running sequence, retractions likely above {plan.retraction_concurrency}; "
            f"requested {requested} -> planned {planned} (expected occupancy "
            f"{planned * plan.expected_tokens_per_sequence / kv_cache_tokens:.0%})",
            flush=True,
        )
        for label, concurrency in (("worst case", max(1, worst)), ("planned", planned)):
            sources = prompts(f"run_{concurrency}", count, 100)
            wall, summary = run(f"run_{concurrency}", sources, concurrency)
            counts = summary.datasets["bench"]
            tokens = counts.completion_tokens
            eta = count / pilot.requests_per_second
            print(
                f"    {label:10s} concurrency {concurrency:>3}: {counts.done}/{count} answered, "
                f"{counts.errors} errors, {wall:.1f} s, {count / wall:.2f} req/s, "
                f"{tokens / wall:.1f} completion tok/s (pilot-rate ETA {eta:.1f} s, "
                f"at the pilot's concurrency {pilot_concurrency})",
                flush=True,
            )


def partition_texts(
    rng: np.random.Generator, name: str, count: int, mean_tokens: float, max_tokens: int
) -> list[str]:
    lengths = np.clip(rng.lognormal(np.log(mean_tokens) - 0.5, 1.0, count), 1, max_tokens).astype(int)
    return [f"{name}{index} #tokens:{tokens}" for index, tokens in enumerate(lengths.tolist())]


def bench_partitions(workdir: Path, token_seconds: float, scale: float) -> None:
    from eaglekit.generation import GenerationEngine, run_engine
    from eaglekit.io import format_duration, read_jsonl

    rng = np.random.default_rng(0)
    short = partition_texts(rng, "s", int(1500 * scale), 400, 4096)
    long = partition_texts(rng, "l", int(100 * scale), 1500, 8192)
    sources = [
        PromptSource("chat", "short", write_prompts(workdir / "short.jsonl", short)),
        PromptSource("code", "long", write_prompts(workdir / "long.jsonl", long)),
    ]
    partitions = [
        PartitionParams(name="short", concurrency=64, max_tokens=4096),
        PartitionParams(name="long", concurrency=8, max_tokens=8192),
    ]
    process, base_url = start_endpoint(token_seconds)
    results = {}
    try:
        for overlap in (False, True):
            output = workdir / f"partitions_{overlap}"
            engine = GenerationEngine(
                sources,
                [EndpointSpec(base_url)],
                output,
                partitions,
                progress_bar=False,
                log_interval_s=1.0,
                overlap_partitions=overlap,
                eta_min_seconds=30.0 / 20,
            )
            started = time.perf_counter()
            run_engine(engine)
            wall = time.perf_counter() - started
            records = [record for _, record in read_jsonl(output / "metrics.jsonl")]
            answers = list(read_generations(output).values())
            short_end = max(r["finished_at"] for r in answers if r["partition"] == "short")
            long_start = min(r["finished_at"] - r["latency_s"] for r in answers if r["partition"] == "long")
            results[overlap] = (wall, records, long_start - short_end)
    finally:
        process.kill()
    tokens = sum(int(text.rsplit(":", 1)[1]) for text in short + long)
    print(
        f"[5] two partitions: {len(short)} short (concurrency 64, max 4096) then {len(long)} long "
        f"(concurrency 8, max 8192), {tokens} tokens at {token_seconds * 1000:.1f} ms a token"
    )
    before, after = results[False][0], results[True][0]
    print(
        f"    wall: drained one after the other {before:.1f} s | long starting in the short drain's room "
        f"{after:.1f} s | {before / after:.3f}x ({before - after:.1f} s less)"
    )
    for overlap, (wall, records, gap) in results.items():
        end = records[-1]["elapsed_s"]
        print(
            f"    {'overlap' if overlap else 'drained'}: first long request sent {gap:+.1f} s after the last "
            "short answer; the ETA the run said, against the time left:"
        )
        for share in (0.10, 0.25, 0.50):
            record = min(records[:-1], key=lambda record: abs(record["elapsed_s"] - share * end))
            left = end - record["elapsed_s"]
            print(
                f"      at {record['elapsed_s']:.1f} s ({share:.0%}): {record['eta_total']} | actual "
                f"{format_duration(left)}"
                f" ({left:.1f} s) | long {record['eta']['long']}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=4000, help="requests in the long-tail bench")
    parser.add_argument("--concurrency", type=int, default=32, help="concurrency in the long-tail bench")
    parser.add_argument("--median-ms", type=float, default=100.0)
    parser.add_argument("--sigma", type=float, default=0.6)
    parser.add_argument("--instant-requests", type=int, default=5000)
    parser.add_argument(
        "--embedded", action="store_true", help="also measure the embedded server (minutes on CPU)"
    )
    parser.add_argument("--embedded-max-tokens", type=int, default=32)
    parser.add_argument(
        "--capacity", action="store_true", help="only [4]: the capacity plan against the embedded server"
    )
    parser.add_argument("--capacity-kv-tokens", type=int, default=2048)
    parser.add_argument("--capacity-max-tokens", type=int, default=128)
    parser.add_argument(
        "--capacity-prompts", type=int, default=16, help="prompts in the pilot and in each run"
    )
    parser.add_argument("--capacity-requested", type=int, default=32)
    parser.add_argument(
        "--partitions",
        action="store_true",
        help="only [5]: two partitions, drained vs overlapped, and the ETA",
    )
    parser.add_argument(
        "--token-seconds", type=float, default=0.002, help="[5]: the fault endpoint's seconds a token"
    )
    parser.add_argument(
        "--partitions-scale", type=float, default=1.0, help="[5]: prompts x this (1: 1,500 + 100)"
    )
    args = parser.parse_args()
    import logging

    logging.getLogger("eaglekit").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory() as directory:
        workdir = Path(directory)
        if args.partitions:
            bench_partitions(workdir, args.token_seconds, args.partitions_scale)
            return
        if args.capacity:
            bench_capacity(
                workdir,
                args.capacity_kv_tokens,
                args.capacity_max_tokens,
                args.capacity_requested,
                args.capacity_prompts,
            )
            return
        bench_scheduling(workdir, args.requests, args.concurrency, args.median_ms / 1000, args.sigma)
        bench_overhead(workdir, args.instant_requests, 256)
        if args.embedded:
            bench_embedded(workdir, args.embedded_max_tokens, [1, 8, 32])
        else:
            print("[3] embedded server: pass --embedded to measure it")


if __name__ == "__main__":
    main()
