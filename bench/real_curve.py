"""A real tau-versus-data curve on the embedded target, and the forecast backtested on it, size by
size (issue 35, point 6).

The data is a real run folder's samples, in prep's planned order: `--answers regenerated` (default), stage 3's
output (ShareGPT first turns answered by the embedded target, SmolLM2-135M-Instruct, through `transformers
serve`, tokenized by the kit: generation/tokenized/sharegpt/tokenized_data.jsonl); `--answers original`, the
dataset's own answers that prep tokenized beside the prompts (prep/sharegpt/original_tokenized_data.jsonl,
prep.original_answers): no stage 3, so a curve of 6+ doublings fits one session on 2 cores
(bench/real_curve.yaml makes that run folder with the kit's survey and prep).

1. samples: prep's planned order (prep/order.json: its held-out keys, then its training order), keeping the
   samples whose whole sequence (prompt + answer) is at most `--max-length` tokens (default 384). The kit
   would truncate longer ones to max_length instead, and a truncated long prompt keeps no answer token: on 2
   CPU cores their prompts would cost most of the capture and train nothing. What is left is split in that
   order into `--selection-size` samples (the held-out set that decides when a draft stopped improving and
   which checkpoint is kept, as stage 5's), the training pool (the nested sizes are its prefixes, as stage 5's
   nested subsets), and the rest: the **scoring set**, which neither trains nor selects (so the measured tau
   is not the selection's optimistic one).
2. capture: the kit's `capture_to_shards` (EAGLE-3's default layers, the target in float32, features bf16).
3. sweep: the kit's `train_size_sweep` with stage 5's draft (`build_draft_from_target`, draft vocab from the
   largest subset) and `TrainSettings` from `--params`' training section (default: the kit's defaults) with
   `--set` overrides. The default here is until_converged (patience 3, eval every 25 steps, the kit's anneal)
   with a step cap `--set max_steps=N`: a size stopped by the cap is a lower bound, passed to the forecast as
   one. `--seeds-at` trains one more draft (init and data order seed 1) at those sizes: the training noise,
   passed to the forecast as `seed_accept_lengths` and printed as seed-to-seed differences.
4. score: each best checkpoint's offline tau of a greedy chain (`checkpoints.offline_agreements_by_dataset`,
   training's `per_position_agreement`) on the scoring set, and `acceptance.sweep_acceptance`'s paired
   bootstrap replicates (the same resampled scoring samples for every size).
5. backtest: for each m from 3, `eaglekit.analysis.forecast.forecast` from the first m sizes (horizon and full
   data: the largest size; planned sizes: all), its tau and union interval at every later size against the
   measured tau (covered, error, width), and its verdict at `--break-even` against what
   the largest size measured.

Everything is cached under the output folder (split, capture shards, per-size training folders that resume,
per-size agreements), so a rerun only does what is missing; `--table` only prints from the cache.

    .venv/bin/eaglekit run bench/real_curve.yaml --stages survey,prep --run-id realcurve
    nice -n 5 .venv/bin/python bench/real_curve.py /work/realcurve/orig --run outputs/realcurve \
        --answers original --truncate --max-length 128 --sizes 30,60,120,240,480,960,1920 \
        --selection-size 60 --set learning_rate=1e-3 --set max_steps=600 --set micro_batch_size=4 \
        --set grad_accumulation_steps=1 --set draft_vocab_size=4096 --set ttt_steps=3 \
        [--train-sizes ... --seeds-at 30,60,120 --stop-after train]

(docs/forecast.md, "A real curve": the numbers, the command and the date.)
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eaglekit.config import Params, load_params
from eaglekit.io import read_jsonl, write_json

DATASET = "sharegpt"


# ---------------------------------------------------------------------------------------------------
# 1. samples and split
# ---------------------------------------------------------------------------------------------------
def build_split(out: Path, run: Path, args: argparse.Namespace) -> dict[str, Any]:
    """{"selection", "train", "scoring": sample ids in order, ...}, cached in split.json, and the chosen
    samples' tokenized lines in tokenized.jsonl (the capture's input)."""
    path = out / "split.json"
    if path.exists():
        split = json.loads(path.read_text())
        if (
            split.get("answers", "regenerated") != args.answers
            or split.get("truncate", False) != args.truncate
        ):
            raise SystemExit(
                f"{path}: made from {split.get('answers', 'regenerated')} answers (truncate "
                f"{split.get('truncate', False)}); this run asks {args.answers} (truncate "
                f"{args.truncate}): use another folder"
            )
        if (
            split["max_length"] != args.max_length
            or split["selection_size"] != args.selection_size
            or split["pool"] != max(args.sizes)
        ):
            raise SystemExit(
                f"{path}: made with max_length {split['max_length']}, selection {split['selection_size']}, "
                f"pool {split['pool']}; this run asks {args.max_length}, {args.selection_size}, "
                f"{max(args.sizes)}: use another folder"
            )
        return split
    order = json.loads((run / "prep" / "order.json").read_text())
    tokenized = answers_file(run, args.answers)
    lines = {record["id"]: fitted(record, args) for _, record in read_jsonl(tokenized)}
    planned = [sample_id for dataset, sample_id in order["heldout"] + order["train"] if dataset == DATASET]
    kept = [sample_id for sample_id in planned if lines.get(sample_id) is not None]
    pool = max(args.sizes)
    if len(kept) < args.selection_size + pool + 20:
        raise SystemExit(
            f"only {len(kept)} samples of at most {args.max_length} tokens: not enough for selection "
            f"{args.selection_size} + pool {pool} + a scoring set"
        )
    split = {
        "run": str(run),
        "answers": args.answers,
        "truncate": args.truncate,
        "max_length": args.max_length,
        "selection_size": args.selection_size,
        "pool": pool,
        "planned": len(planned),
        "answered": sum(sample_id in lines for sample_id in planned),
        "kept": len(kept),
        "selection": kept[: args.selection_size],
        "train": kept[args.selection_size : args.selection_size + pool],
        "scoring": kept[args.selection_size + pool :],
    }
    out.mkdir(parents=True, exist_ok=True)
    staging = out / "tokenized.jsonl.tmp"
    staging.write_text("".join(json.dumps(lines[sample_id]) + "\n" for sample_id in kept))
    staging.rename(out / "tokenized.jsonl")
    write_json(path, split)
    print(
        f"split: {len(planned)} planned, {split['answered']} answered, {len(kept)} of at most "
        f"{args.max_length} tokens: selection {len(split['selection'])}, training pool {pool}, "
        f"scoring {len(split['scoring'])}",
        flush=True,
    )
    return split


def answers_file(run: Path, answers: str) -> Path:
    """The tokenized samples: the target's regenerated answers (stage 3) or the dataset's own
    (prep, original_answers)."""
    if answers == "regenerated":
        return run / "generation" / "tokenized" / DATASET / "tokenized_data.jsonl"
    return run / "prep" / DATASET / "original_tokenized_data.jsonl"


def fitted(record: dict[str, Any], args: argparse.Namespace) -> dict[str, Any] | None:
    """The sample as the bench trains it: whole when at most --max-length tokens; with --truncate, cut to it
    when at least --min-answer-tokens answer tokens remain (the kit would truncate to max_length
    too); else None (left out)."""
    sample = {key: record[key] for key in ("id", "input_ids", "loss_mask")}
    if len(sample["input_ids"]) <= args.max_length:
        return sample
    if not args.truncate or sum(sample["loss_mask"][: args.max_length]) < args.min_answer_tokens:
        return None
    return {
        **sample,
        "input_ids": sample["input_ids"][: args.max_length],
        "loss_mask": sample["loss_mask"][: args.max_length],
    }


# ---------------------------------------------------------------------------------------------------
# 2-3. capture and the sweep (the kit's)
# ---------------------------------------------------------------------------------------------------
def recipe(args: argparse.Namespace) -> tuple[Params, Any]:
    """(params, TrainSettings): `--params`' file or the kit's defaults, `--set` training
    overrides, max_length."""
    from eaglekit.training import TrainSettings

    params = load_params(args.params) if args.params else Params()
    overrides = {"max_length": args.max_length}
    for item in args.set:
        key, _, value = item.partition("=")
        overrides[key] = json.loads(value)
    params = Params.model_validate(
        {**params.model_dump(), "training": {**params.training.model_dump(), **overrides}}
    )
    return params, TrainSettings.from_params(params)


def capture(out: Path, params: Params, model_dir: Path, args: argparse.Namespace) -> None:
    from eaglekit.capture import capture_to_shards, load_target

    if (out / "capture" / "index.json").exists() and (out / "capture.done").exists():
        return
    report = capture_to_shards(
        load_target(model_dir),
        {DATASET: out / "tokenized.jsonl"},
        out / "capture",
        model_name=params.target.model,
        max_seq_len=args.max_length,
        max_tokens_per_batch=8192,
        progress=False,
    )
    (out / "capture.done").write_text(json.dumps(report.as_dict(), default=str))
    print(
        f"capture: {report.samples} samples, {report.captured_tokens} tokens, {report.seconds:.0f}s",
        flush=True,
    )


class Kit:
    """What every draft of the bench shares: the captured samples, the split as positions, the draft vocab."""

    def __init__(
        self,
        out: Path,
        split: dict[str, Any],
        params: Params,
        settings: Any,
        model_dir: Path,
        sizes: list[int],
    ):
        from eaglekit.capture.shards import ShardDataset
        from eaglekit.draft.model import load_target_head_weights
        from eaglekit.draft.vocab import count_generated_tokens, default_draft_vocab_size, select_draft_vocab
        from eaglekit.training import TargetArgmaxCache, nested_subsets

        self.samples = ShardDataset(out / "capture")
        position = {sample_id: index for index, (_, sample_id) in enumerate(self.samples.keys)}
        self.selection = [position[sample_id] for sample_id in split["selection"]]
        self.train_order = [position[sample_id] for sample_id in split["train"]]
        self.scoring = [position[sample_id] for sample_id in split["scoring"]]
        self.subsets = nested_subsets(self.train_order, sizes)
        self.head = load_target_head_weights(model_dir)
        # Stage 5's draft vocab: the most frequent generated tokens of the largest subset, for every size.
        counts = count_generated_tokens(
            (self.samples.tokens(index) for index in self.subsets[max(sizes)]), self.head.config.vocab_size
        )
        self.vocab = select_draft_vocab(
            counts, params.training.draft_vocab_size or default_draft_vocab_size(self.head.config.vocab_size)
        )
        self.layers = tuple(
            self.samples.capture_layer_ids
        )  # the layers the shards hold, as stage 5 passes them
        self.params, self.settings = params, settings
        self.cache = TargetArgmaxCache(self.head.lm_head)

    def build(self, seed: int) -> Any:
        from eaglekit.draft.model import build_draft_from_target

        return build_draft_from_target(
            self.head,
            self.vocab.d2t,
            self.vocab.t2d,
            self.layers,
            seed=seed,
            shape=self.params.training.draft_shape,
        )


def sweep(out: Path, kit: Kit, sizes: list[int]) -> None:
    """Train `sizes` of the sweep (the split and the draft vocab are the whole sweep's, so two processes can
    train different sizes at once); each size's row goes to rows/size-<n>.json."""
    from eaglekit.training import train_size_sweep

    started = time.perf_counter()
    rows = train_size_sweep(
        lambda: kit.build(kit.params.run.seed),
        kit.head.lm_head,
        kit.samples,
        sizes,
        len(kit.selection),
        out / "training",
        kit.settings,
        split=(kit.selection, kit.train_order),
        target_cache=kit.cache,
    )
    for row in rows:
        write_json(out / "rows" / f"size-{row['size']:07d}.json", row)
    print(f"sweep: sizes {sizes} in {time.perf_counter() - started:.0f}s", flush=True)


def sweep_rows(out: Path, sizes: list[int]) -> list[dict[str, Any]]:
    missing = [size for size in sizes if not (out / "rows" / f"size-{size:07d}.json").exists()]
    if missing:
        raise SystemExit(
            f"sizes {missing} are not trained yet in {out / 'training'}: "
            "run without --table (or with --train-sizes)"
        )
    return [json.loads((out / "rows" / f"size-{size:07d}.json").read_text()) for size in sizes]


def extra_seed(out: Path, kit: Kit, size: int, seed: int) -> dict[str, Any]:
    """One more draft at `size` on the same samples, init and data order from `seed`."""
    from eaglekit.training import IndexedSubset, train_draft

    settings = dataclasses.replace(kit.settings, seed=seed)
    result = train_draft(
        kit.build(seed),
        kit.head.lm_head,
        IndexedSubset(kit.samples, kit.subsets[size]),
        IndexedSubset(kit.samples, kit.selection),
        out / "training" / f"seed{seed}" / f"size-{size:07d}",
        settings,
        target_cache=kit.cache,
    )
    return {
        "size": size,
        "seed": seed,
        "steps": result.steps,
        "step_cap": result.step_cap,
        "best_step": result.best_step,
        "converged": result.converged,
        "stopped": result.stopped,
        "best_checkpoint": str(result.best_checkpoint),
    }


# ---------------------------------------------------------------------------------------------------
# 4. score on the scoring set
# ---------------------------------------------------------------------------------------------------
def agreements(kit: Kit, checkpoint: Path, steps: int) -> dict[str, list[np.ndarray]]:
    """{dataset: [(P, steps) bool]} of one best checkpoint on the scoring set, cached
    beside it (newer than it)."""
    from eaglekit.analysis.checkpoints import load_draft_checkpoint, offline_agreements_by_dataset
    from eaglekit.training import IndexedSubset

    cache = checkpoint.with_name(f"scoring_agreements_chain{steps}.npz")
    if cache.exists() and cache.stat().st_mtime >= checkpoint.stat().st_mtime:
        stored = np.load(cache)
        return {DATASET: [stored[f"s{index}"] for index in range(len(stored.files))]}
    draft = load_draft_checkpoint(checkpoint, kit.head.embed_tokens)
    grouped = offline_agreements_by_dataset(
        draft, kit.head.lm_head, IndexedSubset(kit.samples, kit.scoring), steps, kit.settings.max_length
    )
    np.savez(cache, **{f"s{index}": value for index, value in enumerate(grouped[DATASET])})
    return grouped


# ---------------------------------------------------------------------------------------------------
# 5. the backtest
# ---------------------------------------------------------------------------------------------------
def measured_truth(tau: float, low: float, high: float, break_even: float) -> str:
    """What the largest size measured against break-even: 'go' / 'no-go' when its interval is on one side."""
    return (
        "go"
        if low > break_even
        else "no-go"
        if high < break_even
        else "either (its interval holds break-even)"
    )


def backtest(
    sizes: list[float],
    taus: np.ndarray,
    lows: np.ndarray,
    highs: np.ndarray,
    replicates: np.ndarray,
    lower_bounds: list[float],
    seeds: dict[float, list[float]],
    args: argparse.Namespace,
    chain: int,
    confidence: float,
) -> tuple[str, list[dict[str, Any]]]:
    """Markdown tables (forecast against measured, size by size; by doublings ahead; the verdict at each
    break-even against what the largest size measured) and their rows. The forecast at one break-even gives
    the same taus and intervals as at another (break-even only changes the verdict), so
    taus come from the first."""
    from eaglekit.analysis.forecast import forecast

    rows, lines, verdicts = [], [], {break_even: [] for break_even in args.break_even}
    lines.append(
        "| fit on (sizes) | predicts (doublings ahead) | forecast tau [interval] | measured tau "
        "[95%] | error | covered | width |"
    )
    lines.append("|---|---|---|---|---|---|---|")
    for count in range(args.min_fit, len(sizes) + 1):
        fit_text = f"{int(sizes[0])}-{int(sizes[count - 1])} ({count})"
        for break_even in args.break_even:
            result = forecast(
                sizes[:count],
                taus[:count],
                replicates[:, :count],
                planned_sizes=sizes,
                full_size=sizes[-1],
                break_even=break_even,
                max_accept_length=chain + 1,
                confidence=confidence,
                lower_bound_sizes=[size for size in lower_bounds if size <= sizes[count - 1]],
                seed_accept_lengths={
                    size: values for size, values in seeds.items() if size <= sizes[count - 1]
                }
                or None,
                looks=args.looks,
                seed=args.seed,
            )
            truth = measured_truth(taus[-1], lows[-1], highs[-1], break_even)
            right = (
                "no claim"
                if result.verdict == "not yet known"
                else "yes"
                if result.verdict == truth
                else "**no**"
                if truth in ("go", "no-go")
                else "not decidable"
            )
            bounds = (
                "-"
                if result.verdict_bounds is None
                else f"[{result.verdict_bounds[0]:.3f}, {result.verdict_bounds[1]:.3f}]"
            )
            crossing = (
                "-"
                if result.crossing_size is None
                else (
                    result.crossing_size
                    if isinstance(result.crossing_size, str)
                    else f"{result.crossing_size:,.0f}"
                )
            )
            verdicts[break_even].append(
                f"| {fit_text} | {result.verdict} | {bounds} | {crossing} | {right} |"
            )
            rows.append(
                {
                    "fit_sizes": count,
                    "break_even": break_even,
                    "verdict": result.verdict,
                    "line": result.line,
                    "verdict_bounds": result.verdict_bounds,
                    "crossing_size": result.crossing_size,
                    "truth": truth,
                    "right": right,
                    "lower_bound_sizes": result.lower_bound_sizes,
                    "training_noise": result.training_noise,
                }
            )
            if break_even != args.break_even[0]:
                continue
            predicted = {
                prediction.data_size: prediction
                for prediction in result.predictions
                if not prediction.measured
            }
            for index in range(count, len(sizes)):
                prediction = predicted.get(sizes[index])
                if prediction is None:
                    lines.append(
                        f"| {fit_text} | {int(sizes[index])} | none (past the reach {result.reach:.0f}) | "
                        f"{taus[index]:.3f} [{lows[index]:.3f}, {highs[index]:.3f}] | - | - | - |"
                    )
                    continue
                covered = prediction.tau_low <= taus[index] <= prediction.tau_high
                row = {
                    "fit_sizes": count,
                    "size": sizes[index],
                    "doublings": float(np.log2(sizes[index] / sizes[count - 1])),
                    "tau": prediction.tau,
                    "low": prediction.tau_low,
                    "high": prediction.tau_high,
                    "by_family": prediction.by_model,
                    "measured": float(taus[index]),
                    "error": prediction.tau - float(taus[index]),
                    "covered": bool(covered),
                    "width": prediction.tau_high - prediction.tau_low,
                }
                rows.append(row)
                lines.append(
                    f"| {fit_text} | {int(sizes[index])} (+{row['doublings']:.0f}) | {prediction.tau:.3f} "
                    f"[{prediction.tau_low:.3f}, {prediction.tau_high:.3f}] | {taus[index]:.3f} "
                    f"[{lows[index]:.3f}, {highs[index]:.3f}] | {row['error']:+.3f} | "
                    f"{'yes' if covered else '**no**'} | {row['width']:.3f} |"
                )
    by_doubling: dict[int, list[dict]] = {}
    for row in rows:
        if "covered" in row:
            by_doubling.setdefault(round(row["doublings"]), []).append(row)
    summary = [
        "| doublings ahead | forecasts | covered | mean error | mean abs error | mean width |",
        "|---|---|---|---|---|---|",
    ]
    for doublings, group in sorted(by_doubling.items()):
        summary.append(
            f"| {doublings} | {len(group)} | {sum(row['covered'] for row in group)}/{len(group)} | "
            f"{np.mean([row['error'] for row in group]):+.3f} | "
            f"{np.mean([abs(row['error']) for row in group]):.3f} | "
            f"{np.mean([row['width'] for row in group]):.3f} |"
        )
    text = "\n".join(lines) + "\n\n" + "\n".join(summary)
    for break_even, verdict_lines in verdicts.items():
        truth = measured_truth(taus[-1], lows[-1], highs[-1], break_even)
        text += (
            f"\n\nBreak-even {break_even:.2f}; what the largest size measured: {truth}.\n\n"
            "| fit on (sizes) | verdict | bounds read (one-sided) | measured shape crosses at | "
            "right? |\n|---|---|---|---|---|\n" + "\n".join(verdict_lines)
        )
    return text, rows


def lower_bound_reason(row: dict[str, Any]) -> str:
    if row["stopped"] == "step_cap":
        return "yes (step cap)"
    return f"yes (still rising: recent gain {row.get('recent_gain', float('nan')):+.3f})"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", type=Path, help="output folder (cache), e.g. /work/realcurve")
    parser.add_argument(
        "--run", type=Path, default=Path("/work/h2h/tree/outputs/h2h"), help="run folder with stages 2-3 done"
    )
    parser.add_argument(
        "--params",
        default=None,
        help="params YAML whose training section is the recipe (default: kit defaults)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a training param (JSON value)",
    )
    parser.add_argument(
        "--sizes",
        default="10,20,40,80,160,320,640",
        type=lambda text: [int(part) for part in text.split(",")],
    )
    parser.add_argument(
        "--train-sizes",
        default="",
        type=lambda text: [int(part) for part in text.split(",") if part],
        help="train only these of --sizes (another process may train the others at once); default all",
    )
    parser.add_argument(
        "--selection-size",
        type=int,
        default=40,
        help="held-out samples that stop training and pick the checkpoint",
    )
    parser.add_argument(
        "--max-length", type=int, default=384, help="samples longer than this (prompt + answer) are left out"
    )
    parser.add_argument(
        "--answers",
        choices=["regenerated", "original"],
        default="regenerated",
        help="the target's answers from stage 3, or the dataset's own from prep (original_answers)",
    )
    parser.add_argument(
        "--truncate",
        action="store_true",
        help="cut longer samples to --max-length instead of leaving them out",
    )
    parser.add_argument(
        "--min-answer-tokens",
        type=int,
        default=32,
        help="with --truncate: answer tokens a cut sample keeps at least",
    )
    parser.add_argument(
        "--seeds-at",
        default="",
        type=lambda text: [int(part) for part in text.split(",") if part],
        help="sizes at which a second seed is trained (training noise)",
    )
    parser.add_argument(
        "--break-even",
        default="1.91,1.45",
        type=lambda text: [float(part) for part in text.split(",")],
        help="the verdicts' break-even taus: 1.91, this target's embedded loop on this CPU "
        "(docs/demo_run.md); 1.45, issue 14's goal",
    )
    parser.add_argument(
        "--looks",
        type=int,
        default=None,
        help="verdicts the run issues (default: one per size and the final one)",
    )
    parser.add_argument(
        "--min-fit", type=int, default=3, help="fewest sizes a backtest forecast is fitted on"
    )
    parser.add_argument("--seed", type=int, default=0, help="the forecast's training-noise draws")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--stop-after", choices=["split", "capture", "train"], default=None)
    parser.add_argument(
        "--table", action="store_true", help="only score what is trained and print the tables (no training)"
    )
    parser.add_argument(
        "--out-json", type=Path, default=None, help="write the measured curve and backtest rows here"
    )
    args = parser.parse_args()
    args.sizes = sorted(args.sizes)
    if set(args.train_sizes) - set(args.sizes):
        parser.error(
            f"--train-sizes {sorted(set(args.train_sizes) - set(args.sizes))} are not in --sizes {args.sizes}"
        )
    if args.looks is None:
        args.looks = len(args.sizes) + 1
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s: %(message)s"
    )  # training's progress lines
    from eaglekit.analysis.acceptance import sweep_acceptance
    from eaglekit.analysis.answer import lower_bound_sizes
    from eaglekit.target import resolve_model

    params, settings = recipe(args)
    model_dir = resolve_model(params.target.model)
    split = build_split(args.out, args.run, args)
    if args.stop_after == "split":
        return
    capture(args.out, params, model_dir, args)
    if args.stop_after == "capture":
        return
    kit = Kit(args.out, split, params, settings, model_dir, args.sizes)
    if not args.table:
        sweep(args.out, kit, args.train_sizes or args.sizes)
        for size in args.seeds_at:
            seed_row = extra_seed(args.out, kit, size, seed=1)
            print(json.dumps(seed_row), flush=True)
    if args.stop_after == "train":
        return
    rows = sweep_rows(args.out, args.sizes)
    chain = params.analysis.chain_steps
    confidence = params.analysis.confidence
    by_size = {float(row["size"]): agreements(kit, Path(row["best_checkpoint"]), chain) for row in rows}
    scored = sweep_acceptance(
        by_size, chain, params.analysis.bootstrap_resamples, confidence, params.run.seed
    )
    summary = scored.summary.set_index("data_size")
    sizes = [float(size) for size in scored.data_sizes]
    taus = np.array([summary.loc[size, "tau_pooled"] for size in sizes], dtype=np.float64)
    lows = np.array([summary.loc[size, "tau_pooled_low"] for size in sizes], dtype=np.float64)
    highs = np.array([summary.loc[size, "tau_pooled_high"] for size in sizes], dtype=np.float64)
    replicates = scored.pooled_replicates[DATASET]
    # The kit's rule (stage 6's): capped, or labelled converged while still rising by
    # more than min_improvement.
    lower_bounds = sorted(lower_bound_sizes(rows, params.training))

    seeds: dict[float, list[float]] = {}
    seed_lines = []
    for size in args.seeds_at:
        checkpoint = args.out / "training" / "seed1" / f"size-{size:07d}" / "best.pt"
        if not checkpoint.exists():
            continue
        other = sweep_acceptance(
            {float(size): agreements(kit, checkpoint, chain)},
            chain,
            params.analysis.bootstrap_resamples,
            confidence,
            params.run.seed,
        ).summary.iloc[0]
        seeds[float(size)] = [float(other["tau_pooled"])]
        seed_lines.append(
            f"| {size} | {taus[sizes.index(float(size))]:.3f} | {float(other['tau_pooled']):.3f} | "
            f"{float(other['tau_pooled']) - taus[sizes.index(float(size))]:+.3f} |"
        )

    curve = [
        "| size | steps (cap) | stopped | best step | selection tau (best) "
        "| scoring tau [95%] | lower bound |",
        "|---|---|---|---|---|---|---|",
    ]
    for index, row in enumerate(rows):
        curve.append(
            f"| {row['size']} | {row['steps']} ({row['step_cap']}) | {row['stopped']} | {row['best_step']} | "
            f"{row['best_accept_length']:.3f} | {taus[index]:.3f} [{lows[index]:.3f}, {highs[index]:.3f}] | "
            f"{lower_bound_reason(row) if float(row['size']) in lower_bounds else 'no'} |"
        )
    positions = sum(len(value) for value in by_size[sizes[0]][DATASET])
    print(
        f"\n## The measured curve ({len(kit.scoring)} scoring samples, {positions} chain starts; "
        f"draft vocab {kit.vocab.size}, coverage {kit.vocab.coverage:.3f}; chain {chain})\n"
    )
    print("\n".join(curve))
    if seed_lines:
        print("\n## Seed to seed (seed 0 vs seed 1, same samples, same scoring set)\n")
        print("| size | seed 0 tau | seed 1 tau | difference |\n|---|---|---|---|\n" + "\n".join(seed_lines))
    text, backtest_rows = backtest(
        sizes, taus, lows, highs, replicates, lower_bounds, seeds, args, chain, confidence
    )
    print(
        f"\n## Backtest (forecast at confidence {confidence}, looks {args.looks}, "
        f"horizon = full data = {int(sizes[-1])})\n"
    )
    print(text)
    if args.out_json:
        write_json(
            args.out_json,
            {
                "date": datetime.date.today().isoformat(),
                "sizes": sizes,
                "taus": taus.tolist(),
                "lows": lows.tolist(),
                "highs": highs.tolist(),
                "sweep": rows,
                "seeds": seeds,
                "backtest": backtest_rows,
                "settings": settings.to_dict(),
            },
        )


if __name__ == "__main__":
    main()
