"""Step time with and without the prefetching sample reader, side by side in one run.

Each step reads its samples (`--samples` per step) and trains on them (the kit's packed + chunked TTT
step, forward and backward, eaglekit.training), either reading in the step (synchronous, what the loop
did before) or through eaglekit.training.prefetch.Prefetcher (`--depth` steps ahead in a background
thread). Rounds alternate the two, so load from other processes hits both alike; the median of
`--repeats` rounds of `--steps` steps is printed with the ratio.

The read is simulated: each sample read sleeps `--read-ms` (default: about the step's own compute,
measured first) on top of returning the in-memory sample, because a capture small enough for this
machine sits in the page cache and reads in microseconds. At the seed target (hidden 7168) the features
are 4H x 2 B = 57,344 B per token: 0.47 GB for an 8K-token sample, 0.94 GB for 16K; at 2 GB/s from
NVMe that is 0.25-0.5 s per sample, the order of a training step.

    python bench/prefetch.py --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_step import PRESETS, make_samples  # noqa: E402

from eaglekit.draft.head_loss import chunked_ttt_loss  # noqa: E402
from eaglekit.draft.model import DraftConfig, Eagle3DraftModel  # noqa: E402
from eaglekit.training import eligible_rows, target_signals  # noqa: E402
from eaglekit.training.packing import packed_micro_batches  # noqa: E402
from eaglekit.training.prefetch import Prefetcher  # noqa: E402


class SlowSamples(Sequence):
    """In-memory samples whose every read waits `seconds` (a disk read, simulated)."""

    def __init__(self, samples: list[dict], seconds: float):
        self.samples, self.seconds = samples, seconds

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, position: int) -> dict:  # type: ignore[override]
        time.sleep(self.seconds)
        sample = self.samples[position]
        return {
            key: value.clone() if isinstance(value, torch.Tensor) else value for key, value in sample.items()
        }


def train_step(
    model: Eagle3DraftModel,
    head: torch.Tensor,
    samples: list[dict],
    pack_tokens: int,
    max_length: int,
    ttt_steps: int,
) -> float:
    model.zero_grad(set_to_none=True)
    loss_total = 0.0
    packs = packed_micro_batches(samples, pack_tokens, max_length)
    eligible = [eligible_rows(batch, ttt_steps) for batch in packs]
    counts = torch.stack([rows.sum(dim=(1, 2)) for rows in eligible]).sum(0).float()
    for batch, rows in zip(packs, eligible):
        targets = target_signals(
            batch.final_hidden_states,
            head,
            model.draft_to_target_ids(),
            model.t2d,
            lengths=batch.lengths.tolist(),
        )
        states = model(
            batch.input_ids,
            batch.aux_hidden_states,
            ttt_steps,
            batch.position_ids,
            batch.document_ids,
            return_normed_states=True,
        )
        loss, _ = chunked_ttt_loss(model, states, targets, rows, counts, 0.8)
        loss.backward()
        loss_total += float(loss.detach())
    return loss_total


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="smollm2")
    parser.add_argument("--draft-vocab", type=int, default=8_000)
    parser.add_argument("--samples", type=int, default=4, help="samples per step")
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--pack-tokens", type=int, default=256)
    parser.add_argument("--ttt-steps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6, help="steps per timed round")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument(
        "--read-ms",
        type=float,
        default=None,
        help="simulated read per sample (default: step compute / samples)",
    )
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = PRESETS[args.preset]
    config = DraftConfig(
        hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        head_dim=shape["head_dim"],
        vocab_size=shape["vocab"],
        draft_vocab_size=args.draft_vocab,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
    )
    torch.manual_seed(0)
    model = Eagle3DraftModel(config)
    model.attention_backend = "eager"
    model.set_draft_vocab(
        torch.zeros(args.draft_vocab, dtype=torch.int64), torch.arange(config.vocab_size) < args.draft_vocab
    )
    head = torch.randn(config.vocab_size, config.hidden_size) * config.hidden_size**-0.5
    pool = make_samples(args.samples * args.steps, args.max_length, config, seed=0)
    step = lambda samples: train_step(model, head, samples, args.pack_tokens, args.max_length, args.ttt_steps)

    step(pool[: args.samples])  # warmup
    started = time.perf_counter()
    for index in range(args.steps):
        step(pool[index * args.samples : (index + 1) * args.samples])
    compute = (time.perf_counter() - started) / args.steps
    read_seconds = (args.read_ms / 1e3) if args.read_ms is not None else compute / args.samples
    reader = SlowSamples(pool, read_seconds)
    read_step = lambda index: [reader[index * args.samples + slot] for slot in range(args.samples)]
    print(
        f"{args.preset}-shaped draft H={config.hidden_size}, {args.samples} samples/step (<= "
        f"{args.max_length} tokens), {torch.get_num_threads()} torch threads; "
        f"compute alone {compute * 1e3:.0f} ms/step; simulated read {read_seconds * 1e3:.0f} ms/sample "
        f"({read_seconds * args.samples * 1e3:.0f} ms/step; the capture here is in memory)"
    )

    timings: dict[str, list[float]] = {"synchronous": [], f"prefetch depth {args.depth}": []}
    losses: dict[str, list[float]] = {name: [] for name in timings}
    for _ in range(args.repeats):
        for name, depth in (("synchronous", 0), (f"prefetch depth {args.depth}", args.depth)):
            started = time.perf_counter()
            with Prefetcher(read_step, iter(range(args.steps)), depth) as upcoming:
                round_losses = [step(samples) for samples in upcoming]
            timings[name].append((time.perf_counter() - started) / args.steps)
            losses[name] = round_losses
    synchronous = statistics.median(timings["synchronous"])
    for name, seconds in timings.items():
        median = statistics.median(seconds)
        print(
            f"{name:20s} {median * 1e3:8.0f} "
            f"ms/step ({min(seconds) * 1e3:.0f}-{max(seconds) * 1e3:.0f})  {synchronous / median:5.2f}x"
        )
    same = losses["synchronous"] == losses[f"prefetch depth {args.depth}"]
    print(
        f"same losses with and without prefetch: {'yes' if same else 'NO'}; ideal overlap: "
        f"{(compute + read_seconds * args.samples) / max(compute, read_seconds * args.samples):.2f}x"
    )


if __name__ == "__main__":
    main()
