"""ShareGPT scaling of the kit's default recipe, scored on chat prompts from sources
outside the training data.

The measurement of issue 14, point 3, on the embedded target (SmolLM2-135M-Instruct):

1. prompts: ShareGPT first turns from the packaged `sharegpt` dataset (the kit's reader and adapter,
   `first_user` policy; the shipped file is torn, 17,296 records read cleanly), shuffled with the seed,
   duplicates dropped, prompts over `--max-prompt-tokens` left out (counted). Outside-source prompts:
   first turns of the packaged `chitchat` and LLaMA-Factory `alpaca` demo datasets (half each), sources
   that no draft trains on.
2. answers: every prompt answered greedily by the target, `--new-tokens` (96) new tokens. This is done
   IN-PROCESS with batched greedy `transformers` generate (left padding, float32), not through the kit's
   generation stage and embedded server: on this shared 2-core machine the server path ran at about
   0.1-0.2 requests/s, too slow for 1,000+ answers in one session. The answers are still the target's
   greedy answers; the sample's tokens are the prompt ids exactly as rendered by the chat template
   (`eaglekit.chat.prompt_token_ids`) followed by the generated ids (no re-tokenization), loss mask 1
   on the generated ids. Left padding can change float32 rounding, so `--check-unbatched` prompts are
   regenerated one at a time and compared (reported, not assumed).
3. capture: the kit's `capture_to_shards` (EAGLE-3's default layers) into `capture-sharegpt/` and
   `capture-outside/`.
4. sweep: one draft per size (default 60 / 240 / 960) with the kit's `train_draft`, on nested prefixes
   of the shuffled ShareGPT prompts after the first `--heldout-size`, which form the held-out set that
   decides (until_converged) when a draft stopped improving and which checkpoint is kept, as
   `train_size_sweep` does; prefixes instead of its stratified split so that the smaller sizes can be
   trained while the larger ones are still being generated. Draft vocab: the most frequent generated
   tokens of each draft's own training samples (stage 5 counts the largest subset for every size).
   `--variants` trains recipe variants of bench/recipe_ablation.py at every size (the lever ablation).
5. score: each best checkpoint's offline simulated tau of a greedy chain (DESIGN's offline tau; pooled,
   95% percentile bootstrap over samples) on the outside-source set, which neither selects checkpoints
   nor trains; and `--loop-prompts` outside prompts through the real speculative loop
   (`eaglekit.analysis.benchmark.score_drafts_on_prompts`) to check offline ~ loop.

Everything is cached under the output folder (prompts, answers appended per batch, capture shards,
per-size training folders that resume), so a rerun only does what is missing.

    nice -n 10 python bench/sharegpt_scaling.py outputs/sharegpt-scaling --sizes 60,240,960

`--stop-after generate|capture` stops after a stage; `--out-rows` appends the score rows as JSONL and
`--summarize` prints them as a markdown table with paired-bootstrap differences and the slope per doubling.
A second process may train on what is captured (`--no-capture`) while the first captures; two captures
into one folder at once are not supported.
The recipe is `--params`' training section (default: the kit's TrainingParams defaults) with
`--set key=value` overrides (e.g. `--set ttt_steps=3 --set draft_vocab_size=4096`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eaglekit.chat import prompt_token_ids
from eaglekit.config import Params, load_params
from eaglekit.io import read_jsonl
from eaglekit.target import load_tokenizer, resolve_model
from eaglekit.data.sources import SourceRecord, SourceSpec, iter_source, prompt_messages

SHAREGPT = "sharegpt"
OUTSIDE_SOURCES = (("chitchat", "chitchat"), ("alpaca", "llamafactory_alpaca"))


# ---------------------------------------------------------------------------------------------------
# 1. prompts
# ---------------------------------------------------------------------------------------------------
def first_turn_prompts(
    dataset: str,
    package: str,
    count: int,
    tokenizer: Any,
    max_prompt_tokens: int,
    seed: int,
    read_limit: int | None = None,
) -> tuple[list[dict], dict[str, int]]:
    """`count` distinct first-turn prompts of a packaged dataset, seeded shuffle, each at most
    `max_prompt_tokens` tokens after the chat template. Returns (prompts [{"id", "dataset", "messages",
    "prompt_ids"}], counts of what was read, rejected, duplicated, too long)."""
    records, rejected = [], 0
    for record in iter_source(SourceSpec(name=dataset, package=package, limit=read_limit)):
        if not isinstance(record, SourceRecord):
            rejected += 1
            continue
        records.append(record)
    random.Random(seed).shuffle(records)
    seen: set[str] = set()
    prompts, duplicates, too_long = [], 0, 0
    for record in records:
        if len(prompts) == count:
            break
        messages, _ = prompt_messages(record.messages, "first_user")
        key = json.dumps(messages, sort_keys=True)
        if key in seen:
            duplicates += 1
            continue
        seen.add(key)
        ids = prompt_token_ids(tokenizer, messages)
        if len(ids) > max_prompt_tokens:
            too_long += 1
            continue
        prompts.append(
            {
                "id": f"{dataset}-{record.meta['record']}",
                "dataset": dataset,
                "messages": messages,
                "prompt_ids": ids,
            }
        )
    if len(prompts) < count:
        raise SystemExit(
            f"{dataset}: only {len(prompts)} usable prompts of {count} asked "
            f"({len(records)} read, {rejected} rejected, {duplicates} duplicates, {too_long} too long)"
        )
    return prompts, {
        "read": len(records),
        "rejected": rejected,
        "duplicates": duplicates,
        "too_long": too_long,
    }


# ---------------------------------------------------------------------------------------------------
# 2. greedy answers, batched, in-process
# ---------------------------------------------------------------------------------------------------
@torch.no_grad()
def greedy_answers(
    model: Any, prompts: list[list[int]], new_tokens: int, pad_id: int, eos_ids: list[int]
) -> list[list[int]]:
    """Greedy continuations of left-padded prompts (one batch). Each answer stops after its first EOS
    (kept, as the target emitted it) or at `new_tokens`."""
    width = max(len(ids) for ids in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, ids in enumerate(prompts):
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        attention[row, width - len(ids) :] = 1
    output = model.generate(
        input_ids=input_ids,
        attention_mask=attention,
        max_new_tokens=new_tokens,
        do_sample=False,
        num_beams=1,
        pad_token_id=pad_id,
        eos_token_id=eos_ids,
        temperature=None,
        top_p=None,
        top_k=None,
    )
    answers = []
    for row in output[:, width:].tolist():
        answer = []
        for token in row:
            answer.append(token)
            if token in eos_ids:
                break
        answers.append(answer)
    return answers


def generate_cached(
    model: Any,
    prompts: list[dict],
    path: Path,
    new_tokens: int,
    pad_id: int,
    eos_ids: list[int],
    batch_size: int,
) -> dict[str, list[int]]:
    """Answers by prompt id; answers already in `path` (JSONL, appended per batch) are not regenerated.
    Batches hold prompts of similar length (sorted) so little padding is computed."""
    done = {record["id"]: record["answer_ids"] for _, record in read_jsonl(path)} if path.exists() else {}
    todo = sorted(
        (prompt for prompt in prompts if prompt["id"] not in done),
        key=lambda prompt: len(prompt["prompt_ids"]),
    )
    started = time.perf_counter()
    with path.open("a") as handle:
        for start in range(0, len(todo), batch_size):
            batch = todo[start : start + batch_size]
            for prompt, answer in zip(
                batch, greedy_answers(model, [p["prompt_ids"] for p in batch], new_tokens, pad_id, eos_ids)
            ):
                handle.write(
                    json.dumps({"id": prompt["id"], "dataset": prompt["dataset"], "answer_ids": answer})
                    + "\n"
                )
                done[prompt["id"]] = answer
            handle.flush()
            elapsed = time.perf_counter() - started
            print(
                f"generate {path.stem}: {start + len(batch)}/{len(todo)} in {elapsed:.0f}s "
                f"({(start + len(batch)) / elapsed:.2f} prompts/s)",
                flush=True,
            )
    return done


def build_prompts(out: Path, tokenizer: Any, args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    """(ShareGPT prompts in training order: the first `heldout_size` are the sweep's held-out, then the
    nested training prefixes; outside-source prompts), cached in prompts.json so reruns use the same."""
    path = out / "prompts.json"
    if path.exists():
        cached = json.loads(path.read_text())
        return cached["sharegpt"], cached["outside"]
    total = args.heldout_size + max(args.sizes)
    sharegpt, info = first_turn_prompts(
        SHAREGPT, SHAREGPT, total, tokenizer, args.max_prompt_tokens, args.seed
    )
    outside, outside_info = [], {}
    for dataset, package in OUTSIDE_SOURCES:
        chosen, outside_info[dataset] = first_turn_prompts(
            dataset, package, args.outside_per_source, tokenizer, args.max_prompt_tokens, args.seed
        )
        outside += chosen
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps({"sharegpt": sharegpt, "outside": outside, "read": {SHAREGPT: info, **outside_info}})
    )
    print(f"prompts: {len(sharegpt)} ShareGPT ({info}), outside {outside_info}", flush=True)
    return sharegpt, outside


def generate_all(
    out: Path, sharegpt: list[dict], outside: list[dict], model: Any, tokenizer: Any, args: argparse.Namespace
) -> dict[str, list[int]]:
    """Outside prompts first, then ShareGPT tier by tier (held-out + smallest size, ..., largest), so the
    smaller sizes can be trained while the larger ones still generate."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else int(tokenizer.eos_token_id)
    eos_ids = [int(tokenizer.eos_token_id)]
    answers = generate_cached(
        model, outside, out / "answers-outside.jsonl", args.new_tokens, pad_id, eos_ids, args.batch_size
    )
    for size in sorted(args.sizes):
        answers |= generate_cached(
            model,
            sharegpt[: args.heldout_size + size],
            out / "answers-sharegpt.jsonl",
            args.new_tokens,
            pad_id,
            eos_ids,
            args.batch_size,
        )
    return answers


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", type=Path, help="output folder (cache), e.g. outputs/sharegpt-scaling")
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
        "--sizes", default="60,240,960", type=lambda text: [int(part) for part in text.split(",")]
    )
    parser.add_argument(
        "--heldout-size",
        type=int,
        default=40,
        help="ShareGPT samples held out for convergence / best checkpoint",
    )
    parser.add_argument(
        "--outside-per-source",
        type=int,
        default=40,
        help="prompts from each outside source (chitchat, alpaca)",
    )
    parser.add_argument("--max-prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--batch-size", type=int, default=48, help="generation batch")
    parser.add_argument(
        "--check-unbatched", type=int, default=4, help="prompts regenerated alone to compare with the batch"
    )
    parser.add_argument(
        "--loop-prompts", type=int, default=8, help="outside prompts through the real speculative loop"
    )
    parser.add_argument("--loop-new-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--stop-after", choices=["generate", "capture"], default=None)
    parser.add_argument("--out-rows", type=Path, default=None, help="append score rows here (JSONL)")
    parser.add_argument(
        "--no-capture", action="store_true", help="train on what is captured already (no generation either)"
    )
    parser.add_argument(
        "--summarize",
        action="store_true",
        help="only print the table of the --out-rows drafts (paired bootstrap)",
    )
    parser.add_argument(
        "--variants",
        default="baseline",
        help="recipe variants of bench/recipe_ablation.py, trained at every size",
    )
    parser.add_argument(
        "--stop-at-step",
        type=int,
        default=None,
        help="resume a draft only up to its next evaluation at or after this step, "
        "then score its best checkpoint (a run cut short for time: reported as not converged)",
    )
    parser.add_argument(
        "--smoothing-evaluations",
        type=int,
        default=None,
        help="TrainSettings.smoothing_evaluations (until_converged judges improvement on the mean of this "
        "many held-out taus); 1: each tau alone, the rule before smoothing. Default: the kit's",
    )
    parser.add_argument(
        "--continue-from",
        default=None,
        metavar="VARIANT",
        help="start each anneal variant's draft from a copy of VARIANT's converged draft (same label and "
        "size) instead of step 0: the same run, without retraining the shared part",
    )
    parser.add_argument(
        "--label", default="recipe", help="names the draft folders: drafts/<label>-<variant>-size<n>"
    )
    return parser.parse_args()


# ---------------------------------------------------------------------------------------------------
# 3. capture (the kit's)
# ---------------------------------------------------------------------------------------------------
def write_tokenized(path: Path, prompts: list[dict], answers: dict[str, list[int]]) -> int:
    """tokenized_data.jsonl of the answered prompts: prompt ids then the target's ids, loss mask 1 on
    the answer. Rewritten whole (atomic rename) so a capture never reads half a file."""
    lines = []
    for prompt in prompts:
        if prompt["id"] in answers:
            answer = answers[prompt["id"]]
            lines.append(
                json.dumps(
                    {
                        "id": prompt["id"],
                        "input_ids": prompt["prompt_ids"] + answer,
                        "loss_mask": [0] * len(prompt["prompt_ids"]) + [1] * len(answer),
                    }
                )
            )
    staging = path.with_suffix(".tmp")
    staging.write_text("\n".join(lines) + "\n")
    staging.rename(path)
    return len(lines)


def capture_all(
    out: Path,
    sharegpt: list[dict],
    outside: list[dict],
    answers: dict[str, list[int]],
    model: Any,
    model_name: str,
    max_seq_len: int,
) -> None:
    """Capture whatever is answered; the kit's capture skips samples already in the shards (resume)."""
    from eaglekit.capture import capture_to_shards

    for name, prompts, datasets in (
        ("sharegpt", sharegpt, [SHAREGPT]),
        ("outside", outside, [dataset for dataset, _ in OUTSIDE_SOURCES]),
    ):
        files = {}
        for dataset in datasets:
            files[dataset] = out / f"tokenized-{dataset}.jsonl"
            write_tokenized(
                files[dataset], [prompt for prompt in prompts if prompt["dataset"] == dataset], answers
            )
        report = capture_to_shards(
            model,
            files,
            out / f"capture-{name}",
            model_name=model_name,
            max_seq_len=max_seq_len,
            max_tokens_per_batch=8192,
            progress=False,
        )
        print(
            f"capture-{name}: {report.samples} samples, {report.captured_samples} new, {report.seconds:.0f}s",
            flush=True,
        )


# ---------------------------------------------------------------------------------------------------
# 4-5. train (the kit's train_draft) and score on the outside sources
# ---------------------------------------------------------------------------------------------------
def recipe(args: argparse.Namespace) -> tuple[Params, Any]:
    """(params, TrainSettings): `--params`' file or the kit's defaults, with `--set` training overrides."""
    from eaglekit.training import TrainSettings

    params = load_params(args.params) if args.params else Params()
    overrides = {}
    for item in args.set:
        key, _, value = item.partition("=")
        overrides[key] = json.loads(value)
    if overrides:
        params = Params.model_validate(
            {**params.model_dump(), "training": {**params.training.model_dump(), **overrides}}
        )
    return params, TrainSettings.from_params(params)


def train_and_score(
    out: Path,
    label: str,
    variant: str,
    size: int,
    sharegpt: list[dict],
    params: Params,
    base: Any,
    head: Any,
    target: Any,
    tokenizer: Any,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """One draft: the first `size` training prompts (after the held-out ones), the recipe changed by
    `variant` (bench/recipe_ablation.py), trained until converged on the ShareGPT held-out; scored
    offline on the outside sources and, for `--loop-prompts`, through the real loop."""
    from eaglekit.analysis.acceptance import acceptance_tables
    from eaglekit.analysis.benchmark import score_drafts_on_prompts
    from eaglekit.analysis.checkpoints import offline_agreements_by_dataset
    from eaglekit.capture.shards import ShardDataset
    from eaglekit.training import IndexedSubset, load_checkpoint, load_draft_weights, train_draft
    from eaglekit.draft.vocab import count_generated_tokens, default_draft_vocab_size
    from recipe_ablation import variant_draft, variant_settings

    captured = ShardDataset(out / "capture-sharegpt")
    position = {sample_id: index for index, (_, sample_id) in enumerate(captured.keys)}
    heldout_ids = [prompt["id"] for prompt in sharegpt[: args.heldout_size]]
    train_ids = [prompt["id"] for prompt in sharegpt[args.heldout_size : args.heldout_size + size]]
    missing = [sample_id for sample_id in heldout_ids + train_ids if sample_id not in position]
    if missing:
        raise SystemExit(
            f"{len(missing)} samples of size {size} are not captured yet (first "
            f"{missing[0]}): generate and capture first"
        )
    heldout = IndexedSubset(captured, [position[sample_id] for sample_id in heldout_ids])
    train = IndexedSubset(captured, [position[sample_id] for sample_id in train_ids])
    outside_set = ShardDataset(out / "capture-outside")
    outside = IndexedSubset(outside_set, list(range(len(outside_set))))

    # Draft vocab: the most frequent generated tokens of this draft's own training data (stage 5 counts
    # the largest subset; here each size gets what its own samples give).
    counts = count_generated_tokens(
        (captured.tokens(index) for index in train.indices), head.config.vocab_size
    )
    settings = dataclasses.replace(variant_settings(variant, base), stop_at_step=args.stop_at_step)
    if args.smoothing_evaluations is not None:  # one stopping rule for every draft of a comparison
        settings = dataclasses.replace(settings, smoothing_evaluations=args.smoothing_evaluations)
    draft, vocab = variant_draft(
        variant,
        head,
        counts,
        params.training.draft_vocab_size or default_draft_vocab_size(head.config.vocab_size),
        params.run.seed,
    )
    if args.continue_from and not (out / "drafts" / label).exists():
        # An anneal variant continues the converged run of `--continue-from` (the same run up to its stop:
        # train_draft starts the anneal where that run stopped); any other difference is refused there.
        shutil.copytree(
            out / "drafts" / f"{args.label}-{args.continue_from}-size{size}", out / "drafts" / label
        )
    started = time.perf_counter()
    result = train_draft(draft, head.lm_head, train, heldout, out / "drafts" / label, settings, resume=True)
    train_seconds = time.perf_counter() - started
    load_draft_weights(draft, load_checkpoint(result.best_checkpoint))
    draft.eval()
    chain = params.analysis.chain_steps
    agreements = offline_agreements_by_dataset(draft, head.lm_head, outside, chain, settings.max_length)
    pooled = {"outside": [agreement for group in agreements.values() for agreement in group], **agreements}
    summary, _ = acceptance_tables(
        pooled, chain, params.analysis.bootstrap_resamples, params.analysis.confidence, params.run.seed
    )
    taus = {
        row["dataset"]: (
            float(row["tau_pooled"]),
            float(row["tau_pooled_low"]),
            float(row["tau_pooled_high"]),
        )
        for _, row in summary.iterrows()
    }
    row = {
        "label": label,
        "variant": variant,
        "size": size,
        "steps": result.steps,
        "step_cap": result.step_cap,
        "converged": result.converged,
        "stopped": result.stopped,
        "best_step": result.best_step,
        "sharegpt_heldout_tau": result.best_accept_length,
        "draft_vocab": vocab.size,
        "vocab_coverage": vocab.coverage,
        "outside_tau": taus["outside"],
        "outside_tau_by_source": {key: value for key, value in taus.items() if key != "outside"},
        "train_seconds": train_seconds,
        "seconds_per_step": None,
        "settings": {
            key: value
            for key, value in settings.to_dict().items()
            if key
            in (
                "ttt_steps",
                "step_weight",
                "learning_rate",
                "min_learning_rate",
                "warmup_steps",
                "max_steps",
                "patience",
                "min_improvement",
                "smoothing_evaluations",
                "decay_steps",
                "eval_interval",
                "micro_batch_size",
                "grad_accumulation_steps",
                "feature_noise",
                "distill",
            )
        },
        "load_average": os.getloadavg(),
    }  # 1 / 5 / 15 min, when training ended: s/step follows it
    train_times = [record["seconds"] for record in iterate_train(result.metrics_path)]
    restarts = [index for index in range(1, len(train_times)) if train_times[index] < train_times[index - 1]]
    train_times = (
        train_times[restarts[-1] :] if restarts else train_times
    )  # a resumed or continued run: its last process only
    if len(train_times) > 1:
        row["seconds_per_step"] = (train_times[-1] - train_times[0]) / (
            len(train_times) - 1
        )  # this process's steps, evals included
    if args.loop_prompts:
        prompts = [
            {"id": prompt["id"], "input_ids": prompt["prompt_ids"]}
            for prompt in outside_prompts_for_loop(out, args.loop_prompts)
        ]
        torch.set_num_threads(1)
        loop = score_drafts_on_prompts(
            target,
            {size: draft},
            prompts,
            chain,
            args.loop_new_tokens,
            [int(tokenizer.eos_token_id)],
            params.analysis.bootstrap_resamples,
            params.analysis.confidence,
            params.run.seed,
        ).summary.iloc[0]
        torch.set_num_threads(args.threads)
        row["loop"] = {
            "prompts": int(loop["prompts"]),
            "new_tokens": args.loop_new_tokens,
            "tau": float(loop["tau"]),
            "low": float(loop["tau_low"]),
            "high": float(loop["tau_high"]),
            "outputs_equal": bool(loop["outputs_equal"]),
        }
    return row


def iterate_train(metrics_path: Path):
    from eaglekit.training import iterate_metrics

    return iterate_metrics(metrics_path, "train")


def outside_prompts_for_loop(out: Path, count: int) -> list[dict]:
    """The first `count` outside prompts alternating sources (chitchat, alpaca, chitchat, ...)."""
    outside = json.loads((out / "prompts.json").read_text())["outside"]
    by_source = [
        [prompt for prompt in outside if prompt["dataset"] == dataset] for dataset, _ in OUTSIDE_SOURCES
    ]
    mixed = [prompt for group in zip(*by_source) for prompt in group]
    return mixed[:count]


def outside_counts(out: Path, label: str, head: Any, chain: int) -> Any:
    """Per-sample chain counts (eaglekit.analysis.acceptance.ChainCounts) of one trained draft's best
    checkpoint on the outside-source samples, in capture order (the same samples for every draft: paired)."""
    from eaglekit.analysis.acceptance import ChainCounts, chain_counts
    from eaglekit.analysis.checkpoints import load_draft_checkpoint
    from eaglekit.capture.shards import ShardDataset
    from eaglekit.training import IndexedSubset, per_position_agreement

    best = out / "drafts" / label / "best.pt"
    cache = best.with_name(f"outside_counts_chain{chain}.npz")
    if cache.exists() and cache.stat().st_mtime >= best.stat().st_mtime:  # computed from this checkpoint
        stored = np.load(cache)
        return ChainCounts(positions=stored["positions"], prefix_counts=stored["prefix_counts"])
    draft = load_draft_checkpoint(best, head.embed_tokens)
    outside = ShardDataset(out / "capture-outside")
    agreements = per_position_agreement(
        draft, head.lm_head, IndexedSubset(outside, list(range(len(outside)))), chain
    )
    counts = chain_counts([sample.agreement for sample in agreements], steps=chain)
    np.savez(cache, positions=counts.positions, prefix_counts=counts.prefix_counts)
    return counts


def paired_summary(
    out: Path, rows: list[dict], head: Any, chain: int, num_resamples: int, confidence: float, seed: int
) -> str:
    """Markdown: every row's outside tau with its interval and its paired difference to the same size's
    baseline (one set of bootstrap weights over the outside samples for every draft), and the baseline's
    slope per doubling of data (least squares of tau on log2 N, per replicate)."""
    from eaglekit.analysis.acceptance import (
        bootstrap_accept_length,
        percentile_interval,
        pooled_accept_length,
    )
    from eaglekit.analysis.curves import slope_per_doubling

    counts = [outside_counts(out, row["label"], head, chain) for row in rows]
    # The same samples and seed for every draft: the same resampling weights, so the replicates are paired
    # (over the samples with a position to score, as the kit's acceptance tables resample).
    taus = np.column_stack(
        [bootstrap_accept_length(c, num_resamples, seed).pooled_tau for c in counts]
    )  # (R, drafts)
    points = np.array([pooled_accept_length(c) for c in counts])
    low, high = percentile_interval(taus, confidence)
    lines = [
        "| variant | size | steps (cap) | converged | best step | s/step | outside tau [95%] | minus "
        "baseline [95%] | ShareGPT held-out tau | real loop tau [95%] |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for index, row in enumerate(rows):
        base = next(
            (
                other
                for other, candidate in enumerate(rows)
                if candidate["variant"] == "baseline" and candidate["size"] == row["size"]
            ),
            None,
        )
        difference = "-"
        if base is not None and base != index:
            d_low, d_high = percentile_interval(taus[:, index] - taus[:, base], confidence)
            difference = f"{points[index] - points[base]:+.3f} [{d_low:+.3f}, {d_high:+.3f}]"
        loop = row.get("loop")
        loop_text = (
            f"{loop['tau']:.3f} [{loop['low']:.3f}, "
            f"{loop['high']:.3f}] ({loop['prompts']} x {loop['new_tokens']})"
            if loop
            else "-"
        )
        per_step = f"{row['seconds_per_step']:.1f}" if row.get("seconds_per_step") else "-"
        lines.append(
            f"| {row['variant']} | {row['size']} | {row['steps']} ({row['step_cap']}) | {row['converged']} | "
            f"{row['best_step']} | {per_step} | {points[index]:.3f} [{low[index]:.3f}, {high[index]:.3f}] | "
            f"{difference} | {row['sharegpt_heldout_tau']:.3f} | {loop_text} |"
        )
    baseline = [index for index, row in enumerate(rows) if row["variant"] == "baseline"]
    log2_sizes = np.log2([rows[index]["size"] for index in baseline])
    if len(set(log2_sizes)) >= 2:
        slope = float(slope_per_doubling(log2_sizes, points[baseline]))
        s_low, s_high = percentile_interval(slope_per_doubling(log2_sizes, taus[:, baseline]), confidence)
        lines.append(
            "\nbaseline slope per doubling of data (least squares on log2 N over sizes "
            f"{[rows[index]['size'] for index in baseline]}): {slope:+.4f} "
            f"[{s_low:+.4f}, {s_high:+.4f}] (paired bootstrap over the "
            f"{int((counts[0].positions > 0).sum())} outside samples)"
        )
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s: %(message)s"
    )  # training's progress lines
    from eaglekit.capture import load_target
    from eaglekit.draft.model import load_target_head_weights

    params, base = recipe(args)
    tokenizer = load_tokenizer(params.target)
    sharegpt, outside = build_prompts(args.out, tokenizer, args)
    model_dir = resolve_model(params.target.model)
    if args.summarize:
        rows = [record for _, record in read_jsonl(args.out_rows)]
        print(
            paired_summary(
                args.out,
                rows,
                load_target_head_weights(model_dir),
                params.analysis.chain_steps,
                params.analysis.bootstrap_resamples,
                params.analysis.confidence,
                params.run.seed,
            )
        )
        return
    target = load_target(model_dir)
    answers = {} if args.no_capture else generate_all(args.out, sharegpt, outside, target, tokenizer, args)
    if args.check_unbatched and not args.no_capture:
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else int(tokenizer.eos_token_id)
        checked = outside[: args.check_unbatched]
        alone = [
            greedy_answers(
                target, [prompt["prompt_ids"]], args.new_tokens, pad_id, [int(tokenizer.eos_token_id)]
            )[0]
            for prompt in checked
        ]
        equal = sum(answer == answers[prompt["id"]] for prompt, answer in zip(checked, alone))
        print(f"unbatched check: {equal}/{len(checked)} answers equal to the batched ones", flush=True)
    if args.stop_after == "generate":
        return
    if (
        not args.no_capture
    ):  # one capture at a time per folder: a second process training meanwhile passes --no-capture
        capture_all(
            args.out, sharegpt, outside, answers, target, params.target.model, params.training.max_length
        )
    if args.stop_after == "capture":
        return
    head = load_target_head_weights(model_dir)
    for size in args.sizes:
        for variant in args.variants.split(","):
            label = f"{args.label}-{variant}-size{size}"
            row = train_and_score(
                args.out, label, variant, size, sharegpt, params, base, head, target, tokenizer, args
            )
            print(json.dumps(row), flush=True)
            if args.out_rows:
                with args.out_rows.open("a") as handle:
                    handle.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
