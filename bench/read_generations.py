"""Reading a multi-GB generation log: peak memory / file size and seconds per GB, per reader.

Builds a synthetic `generations.jsonl` shaped like a real run's (answers of a few KB, reasoning, raw
token ids for prompt and answer, the small fields first) plus the prompts file it answers, then
runs each reader in a fresh process and measures its peak resident memory above the process's
baseline (after imports) and its wall time:

- `finished_keys` (resume), `summarize_generations` (the engine's and the notebook's counts),
  `generation_table` (notebook 03's table and plots), `GenerationLog` (index by key, then every
  record once, e.g. for building training data): all stream, goal peak / size <= 0.2;
- `read_generations` (every record in one dict, the old way), on a slice of the file only, since
  on the whole file it needs several times the file's size in RAM.

Run: `python bench/read_generations.py [--size-gb 2] [--dir /tmp]`. The files are deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

READERS = {
    "finished_keys": "finished_keys(out / 'generations.jsonl')",
    "summarize_generations": "summarize_generations(out, sources)",
    "generation_table": "generation_table(out)",
    "GenerationLog (index + every record)": "sum(1 for _ in GenerationLog(out))",
    "read_generations (full dict)": "read_generations(out)",
}

CHILD = """
import resource, sys, time
from pathlib import Path
from eaglekit.generation import (GenerationLog, PromptSource, finished_keys, generation_table,
                                 read_generations, summarize_generations)

def rss_kb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])

out, prompts = Path(sys.argv[1]), Path(sys.argv[2])
sources = [PromptSource("bench", "short", prompts)]
baseline = rss_kb()
started = time.perf_counter()
result = {expression}
elapsed = time.perf_counter() - started
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(elapsed, (peak - baseline) * 1024)
"""


def build(folder: Path, size_bytes: int, seed: int = 0) -> tuple[Path, Path, int]:
    """generations.jsonl of about size_bytes, and the prompts.jsonl it answers; returns
    (out, prompts, records)."""
    rng = random.Random(seed)
    words = [
        "the",
        "model",
        "answer",
        "token",
        "draft",
        "speculative",
        "def",
        "return",
        "x",
        "=",
        "(",
        ")",
        "for",
        "in",
        "range",
        "print",
        "value",
        "\\n",
        "if",
        "else",
        "data",
        "loss",
        "step",
    ]
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(200, 2000))) for _ in range(64)]
    out = folder / "out"
    out.mkdir(parents=True, exist_ok=True)
    prompts_path = folder / "prompts.jsonl"
    written, count = 0, 0
    with open(out / "generations.jsonl", "w") as generations, open(prompts_path, "w") as prompts:
        while written < size_bytes:
            content = texts[count % len(texts)]
            reasoning = texts[(count * 7) % len(texts)][:3000]
            completion = rng.randint(50, 4000)
            record = {
                "dataset": "bench",
                "id": f"bench-{count:08d}",
                "partition": "short",
                "endpoint": "sglang-kimi",
                "session": 1,
                "attempts": 1,
                "latency_s": 12.5,
                "prompt_tokens": 300,
                "completion_tokens": completion,
                "finish_reason": "stop",
                "truncated": False,
                "flags": [],
                "reasoning_field": "reasoning_content",
                "finished_at": 1.7e9 + count,
                "content": content,
                "reasoning": reasoning,
                "tool_calls": None,
                "prompt_token_ids": list(range(1000, 1300)),
                "token_ids": [rng.randrange(160_000) for _ in range(min(completion, 1500))],
            }
            line = json.dumps(record, ensure_ascii=False) + "\n"
            generations.write(line)
            prompts.write(
                json.dumps(
                    {
                        "id": record["id"],
                        "source": "bench",
                        "messages": [{"role": "user", "content": "q"}],
                        "meta": {},
                    }
                )
                + "\n"
            )
            written += len(line.encode())
            count += 1
    return out, prompts_path, count


def measure(expression: str, out: Path, prompts: Path) -> tuple[float, int]:
    result = subprocess.run(
        [sys.executable, "-c", CHILD.format(expression=expression), str(out), str(prompts)],
        capture_output=True,
        text=True,
        check=True,
    )
    elapsed, peak = result.stdout.split()
    return float(elapsed), int(peak)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-gb", type=float, default=2.0)
    parser.add_argument("--slice-gb", type=float, default=0.25, help="file size for the full-dict reader")
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="eaglekit-bench-read-", dir=args.dir))
    try:
        started = time.perf_counter()
        out, prompts, records = build(root / "big", int(args.size_gb * 1e9))
        size = (out / "generations.jsonl").stat().st_size
        print(
            f"built {size / 1e9:.2f} GB, {records:,} records ({size / records / 1e3:.1f} KB each) "
            f"in {time.perf_counter() - started:.0f} s"
        )
        small_out, small_prompts, small_records = build(root / "slice", int(args.slice_gb * 1e9))
        small_size = (small_out / "generations.jsonl").stat().st_size
        print(f"{'reader':40s} {'file GB':>8s} {'peak MB':>9s} {'peak/size':>10s} {'s/GB':>7s}")
        for name, expression in READERS.items():
            full = not name.startswith("read_generations")
            folder, prompt_file, file_size = (
                (out, prompts, size) if full else (small_out, small_prompts, small_size)
            )
            elapsed, peak = measure(expression, folder, prompt_file)
            print(
                f"{name:40s} {file_size / 1e9:8.2f} {peak / 1e6:9.1f} {peak / file_size:10.3f} "
                f"{elapsed / (file_size / 1e9):7.1f}"
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
