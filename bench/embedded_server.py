"""Completion tokens/s of the embedded server (transformers serve, continuous
batching) at concurrency 1, 8, 32.

Measured side by side in one run against one server; prints the ratio of 32 to 1.
    python bench/embedded_server.py [--max-tokens 64] [--rounds 2] [--no-continuous-batching]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import openai

from eaglekit.target import resolve_model
from eaglekit.config import ServerParams
from eaglekit.generation.server import EmbeddedServer

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
    """Keep `concurrency` requests in flight until `requests` are done; returns
    (seconds, completion tokens)."""
    # A client per event loop: its connections belong to the loop that opened them.
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", timeout=600, max_retries=0)
    queue = list(range(requests))
    tokens = 0

    async def worker() -> None:
        nonlocal tokens
        while queue:
            index = queue.pop()
            answer = await client.chat.completions.create(
                model=model,
                max_tokens=max_tokens,
                temperature=0.0,
                messages=[{"role": "user", "content": PROMPTS[index % len(PROMPTS)]}],
            )
            tokens += answer.usage.completion_tokens

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    await client.close()
    return elapsed, tokens


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="requests per level = rounds x concurrency")
    parser.add_argument("--no-continuous-batching", action="store_true")
    args = parser.parse_args()
    settings = ServerParams(continuous_batching=not args.no_continuous_batching)
    with EmbeddedServer(resolve_model("embedded:smollm2-135m-instruct"), settings=settings) as server:
        print(
            f"server: transformers serve, continuous_batching={settings.continuous_batching}, "
            f"dtype={settings.dtype}, "
            f"kv_cache_tokens={settings.kv_cache_tokens}; max_tokens={args.max_tokens}"
        )
        rates = {}
        for concurrency in (1, 8, 32):
            seconds, tokens = asyncio.run(
                measure(
                    server.base_url,
                    server.model_name,
                    concurrency,
                    args.rounds * concurrency,
                    args.max_tokens,
                )
            )
            rates[concurrency] = tokens / seconds
            print(
                f"concurrency {concurrency:>2}: {tokens:5d} completion tokens in {seconds:6.1f} s = "
                f"{rates[concurrency]:6.1f} tok/s"
            )
        print(f"ratio concurrency 32 / concurrency 1: {rates[32] / rates[1]:.2f}x")


if __name__ == "__main__":
    main()
