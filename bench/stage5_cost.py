"""Stage 5's cost on captured data, side by side in one run: the target argmax cached per
sample against recomputed.

Two measurements on a run folder's capture (stage 4 done), with the demo's training settings by default:

1. Before/after breakdown of one training step (`--micro-batch` samples, padded as the demo trains) and one
   held-out evaluation (`--heldout` samples), each part timed on its own: the teacher (full-vocab head, or the
   draft-vocab rows with the argmax from `TargetArgmaxCache`), the draft forward, the chunked loss,
   backward, the optimizer; for the evaluation the target argmax and the draft unroll.
2. End to end: `train_draft` for `--steps` steps on 20 samples with an evaluation every `--eval-interval`,
   once with the cache and once without (`target_cache=False`: the full head at every use; the held-out
   head at counted chain starts only is in both), and the check that both wrote the same losses and taus.
   The cached run pays each argmax once, in its first epoch and first evaluation, as stage 5 does.

Rounds alternate before/after so a change of load on a shared machine hits both alike; medians of
`--repeats` rounds. `uptime` is printed before and after.

    nice -n 10 python bench/stage5_cost.py --run-dir /tmp/demo56 --threads 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from eaglekit.draft.model import build_draft_from_target, load_target_head_weights
from eaglekit.draft.head_loss import chunked_ttt_loss
from eaglekit.target import resolve_model, target_layout
from eaglekit.capture.shards import ShardDataset
from eaglekit.training import (
    IndexedSubset,
    TargetArgmaxCache,
    TrainSettings,
    collate,
    eligible_rows,
    per_position_agreement,
    target_signals,
    train_draft,
)
from eaglekit.draft.vocab import count_generated_tokens, select_draft_vocab


class Timer:
    """Named wall-clock parts of one round: `with timer("teacher"): ...`."""

    def __init__(self) -> None:
        self.parts: dict[str, float] = {}

    def __call__(self, name: str):
        timer = self

        class Part:
            def __enter__(self):
                self.started = time.perf_counter()

            def __exit__(self, *exc):
                timer.parts[name] = timer.parts.get(name, 0.0) + time.perf_counter() - self.started

        return Part()


def training_step(
    model, optimizer, head, samples, settings: TrainSettings, cache: TargetArgmaxCache | None, draft_head
) -> tuple[dict, float]:
    """train_draft's step for one padded micro-batch, part by part (same calls, same order)."""
    timer = Timer()
    batch = collate(samples, settings.max_length)
    rows = eligible_rows(batch, settings.ttt_steps)
    counts = rows.sum(dim=(1, 2)).float()
    lengths = batch.lengths.tolist()
    with timer("teacher"):
        known = cache.batch_argmax(samples, settings.max_length) if cache is not None else None
        targets = target_signals(
            batch.final_hidden_states,
            head,
            model.draft_to_target_ids(),
            model.t2d,
            lengths=lengths,
            target_argmax=known,
            draft_lm_head=draft_head if cache is not None else None,
        )
    with timer("draft forward"):
        states = model(
            batch.input_ids,
            batch.aux_hidden_states,
            settings.ttt_steps,
            batch.position_ids,
            batch.document_ids,
            return_normed_states=True,
        )
    with timer("loss (chunked head)"):
        loss, _ = chunked_ttt_loss(model, states, targets, rows, counts, settings.step_weight)
    with timer("backward"):
        loss.backward()
    with timer("optimizer"):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return timer.parts, float(loss.detach())


@torch.no_grad()
def agreement_before(model, head, heldout, settings: TrainSettings) -> list[np.ndarray]:
    """per_position_agreement as it was before the cache (commit fdab070): the full-vocab target argmax of
    every held-out token at every evaluation, and the draft head over every row of every step."""
    model.eval()
    draft_to_target = model.draft_to_target_ids()
    results = []
    for start in range(0, len(heldout), settings.micro_batch_size):
        chunk = [heldout[i] for i in range(start, min(start + settings.micro_batch_size, len(heldout)))]
        batch = collate(chunk, settings.max_length)
        step_logits = model(batch.input_ids, batch.aux_hidden_states, settings.ttt_steps)
        target_argmax = (batch.final_hidden_states.float() @ head.float().T).argmax(-1)
        length = batch.input_ids.shape[1]
        eligible = eligible_rows(batch, settings.ttt_steps)
        agree = torch.zeros(settings.ttt_steps, *batch.input_ids.shape, dtype=torch.bool)
        for step, logits in enumerate(step_logits):
            rows = length - 1 - step
            if rows > 0:
                agree[step, :, :rows] = (
                    draft_to_target[logits[:, :rows].argmax(-1)] == target_argmax[:, 1 + step :]
                )
        complete = eligible.all(dim=0)
        for row in range(len(chunk)):
            start_rows = torch.nonzero(complete[row]).flatten()
            results.append(agree[:, row, start_rows].T.numpy())
    model.train()
    return results


def evaluation(
    model, head, heldout, settings: TrainSettings, cache: TargetArgmaxCache | None
) -> tuple[dict, list[np.ndarray]]:
    """One held-out evaluation (before: the old code; after: the kit with the cache), and
    the target argmax alone."""
    timer = Timer()
    with timer("target argmax"):
        if cache is None:
            for start in range(0, len(heldout), settings.micro_batch_size):
                batch = collate(
                    [heldout[i] for i in range(start, min(start + settings.micro_batch_size, len(heldout)))],
                    settings.max_length,
                )
                (batch.final_hidden_states.float() @ head.T).argmax(-1)
        else:
            for start in range(0, len(heldout), settings.micro_batch_size):
                cache.batch_argmax(
                    [heldout[i] for i in range(start, min(start + settings.micro_batch_size, len(heldout)))],
                    settings.max_length,
                )
    with timer("whole evaluation"):
        if cache is None:
            agreements = agreement_before(model, head, heldout, settings)
        else:
            agreements = [
                sample.agreement
                for sample in per_position_agreement(
                    model,
                    head,
                    heldout,
                    settings.ttt_steps,
                    settings.max_length,
                    settings.micro_batch_size,
                    target_cache=cache,
                )
            ]
    return timer.parts, agreements


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--run-dir", required=True, help="a run folder whose capture/ holds shards (read only)"
    )
    parser.add_argument("--target", default="embedded:smollm2-135m-instruct")
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--ttt-steps", type=int, default=3)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--max-length", type=int, default=448)
    parser.add_argument("--heldout", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="end-to-end train_draft steps (0: skip)")
    parser.add_argument("--eval-interval", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"before: {uptime()}; torch threads {torch.get_num_threads()}")

    samples = ShardDataset(Path(args.run_dir) / "capture")
    target = load_target_head_weights(
        target_layout(resolve_model(args.target))
    )  # any target, a multimodal wrapper too
    head = target.lm_head.float()  # (V, H)
    heldout = IndexedSubset(samples, list(range(args.heldout)))
    train = IndexedSubset(samples, list(range(args.heldout, len(samples))))
    vocab = select_draft_vocab(
        count_generated_tokens((train[i] for i in range(len(train))), head.shape[0]), args.draft_vocab
    )
    build = lambda: build_draft_from_target(target, vocab.d2t, vocab.t2d, seed=0)
    settings = TrainSettings(
        ttt_steps=args.ttt_steps,
        micro_batch_size=args.micro_batch,
        grad_accumulation_steps=1,
        max_length=args.max_length,
        learning_rate=1e-3,
        warmup_steps=10,
        max_steps=args.steps or 1,
        eval_interval=args.eval_interval,
        patience=100,
        log_interval_s=1e9,
    )
    step_samples = [train[i] for i in range(args.micro_batch)]
    tokens = sum(min(len(s["input_ids"]), args.max_length) for s in step_samples)
    print(
        f"V {head.shape[0]:,} H {head.shape[1]}, draft vocab {args.draft_vocab:,}, TTT {args.ttt_steps}; "
        f"step: {args.micro_batch} samples, {tokens} tokens; held-out: {args.heldout} samples, "
        f"{sum(min(len(heldout[i]['input_ids']), args.max_length) for i in range(len(heldout)))} tokens"
    )

    # 1. Breakdown. Each variant has its own draft and optimizer (same init): the steps train them alike.
    variants = {}
    for name in ("before", "after"):
        model = build()
        cache = TargetArgmaxCache(head) if name == "after" else None
        draft_head = head[model.draft_to_target_ids()].contiguous() if cache is not None else None
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        variants[name] = dict(
            model=model,
            cache=cache,
            draft_head=draft_head,
            optimizer=optimizer,
            step=[],
            eval=[],
            loss=[],
            agreements=None,
        )
    for variant in (
        variants.values()
    ):  # warmup; fills the cache (the first epoch / first evaluation pays the argmax once)
        training_step(
            variant["model"],
            variant["optimizer"],
            head,
            step_samples,
            settings,
            variant["cache"],
            variant["draft_head"],
        )
        evaluation(variant["model"], head, heldout, settings, variant["cache"])
    for _ in range(args.repeats):
        for variant in variants.values():
            parts, loss = training_step(
                variant["model"],
                variant["optimizer"],
                head,
                step_samples,
                settings,
                variant["cache"],
                variant["draft_head"],
            )
            variant["step"].append(parts)
            variant["loss"].append(loss)
            parts, agreements = evaluation(variant["model"], head, heldout, settings, variant["cache"])
            variant["eval"].append(parts)
            variant["agreements"] = agreements
    median = lambda rounds, key: statistics.median(parts.get(key, 0.0) for parts in rounds)
    print("\none training step, median seconds per part:")
    keys = ["teacher", "draft forward", "loss (chunked head)", "backward", "optimizer"]
    print(f"{'':12s}" + "".join(f"{key:>21s}" for key in keys) + f"{'total':>10s}")
    totals = {}
    for name, variant in variants.items():
        totals[name] = statistics.median(sum(parts.values()) for parts in variant["step"])
        print(
            f"{name:12s}"
            + "".join(f"{median(variant['step'], key):21.3f}" for key in keys)
            + f"{totals[name]:10.3f}"
        )
    print(
        f"step: before / after = {totals['before'] / totals['after']:.2f}x; "
        f"losses per round before {[round(x, 5) for x in variants['before']['loss']]} after "
        f"{[round(x, 5) for x in variants['after']['loss']]}"
    )
    print("\none held-out evaluation, median seconds (target argmax also timed alone):")
    evals = {}
    for name, variant in variants.items():
        evals[name] = median(variant["eval"], "whole evaluation")
        print(
            f"{name:12s} whole {evals[name]:7.3f}  target argmax alone "
            f"{median(variant['eval'], 'target argmax'):7.3f}  "
            f"({sum(len(a) for a in variant['agreements'])} chain starts)"
        )
    pairs = list(zip(variants["before"]["agreements"], variants["after"]["agreements"]))
    differing = sum(int((a != b).sum()) if a.shape == b.shape else a.size + b.size for a, b in pairs)
    print(
        "agreement entries that differ, old evaluation code vs the kit with the cache (drafts trained "
        f"alike): {differing} of {sum(a.size for a, _ in pairs)}"
    )
    print(
        f"evaluation: before / after = {evals['before'] / evals['after']:.2f}x; "
        f"one evaluation = {evals['before'] / totals['before']:.2f} steps before, "
        f"{evals['after'] / totals['after']:.2f} steps after"
    )

    # 2. End to end: train_draft with and without the cache, alternating; same metrics expected.
    if args.steps:
        seconds: dict[str, list[float]] = {"recomputed": [], "cached": []}
        lines: dict[str, list[dict]] = {}
        with tempfile.TemporaryDirectory() as folder:
            for round_index in range(2):
                for name in ("recomputed", "cached"):
                    out = Path(folder) / f"{name}-{round_index}"
                    started = time.perf_counter()
                    train_draft(
                        build(),
                        head,
                        IndexedSubset(train, list(range(20))),
                        heldout,
                        out,
                        settings,
                        target_cache=name == "cached",
                    )
                    seconds[name].append(time.perf_counter() - started)
                    lines[name] = [
                        json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
                    ]
        keys_of = lambda line: {k: v for k, v in line.items() if k not in ("seconds",)}
        loss_diff = max(
            abs(a["loss"] - b["loss"])
            for a, b in zip(lines["recomputed"], lines["cached"])
            if a["split"] == "train"
        )
        tau_diff = max(
            abs(a["simulated_accept_length"] - b["simulated_accept_length"])
            for a, b in zip(lines["recomputed"], lines["cached"])
            if a["split"] == "heldout"
        )
        same_steps = [keys_of(a)["step"] for a in lines["recomputed"]] == [
            keys_of(b)["step"] for b in lines["cached"]
        ]
        evaluations = sum(1 for line in lines["cached"] if line["split"] == "heldout")
        print(
            f"\ntrain_draft, {args.steps} steps + {evaluations} evaluations (20 training samples), "
            f"seconds per run recomputed {[round(s, 1) for s in seconds['recomputed']]} cached "
            f"{[round(s, 1) for s in seconds['cached']]}: "
            f"{min(seconds['recomputed']) / min(seconds['cached']):.2f}x (best of 2 each)"
        )
        print(
            f"same metrics: max |loss diff| {loss_diff:.2e}, "
            f"max |tau diff| {tau_diff:.2e}, same step lines {same_steps}"
        )
    print(f"\nafter: {uptime()}")


if __name__ == "__main__":
    main()
