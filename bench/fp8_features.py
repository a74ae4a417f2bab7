"""FP8 features against bf16, on the same drafts: what `capture.feature_dtype: fp8` costs in accept length.

The embedded target (SmolLM2-135M-Instruct) answers templated questions greedily; its features are kept in
bf16 (the default shard format) and, beside them, round-tripped through the shard format's fp8 codec
(float8_e4m3fn, one scale per token per layer block: eaglekit.capture.shards.encode_fp8 / decode_fp8).
Two drafts train with the same seed, data order and settings, one on each; each is scored on held-out
features of its own format and on the other's, with a paired bootstrap over held-out samples.

    python bench/fp8_features.py [--prompts 96] [--heldout 24] [--steps 150]

Prints one table: held-out simulated tau (chain 3) per (trained on, scored on), and the paired differences.
The prompts are synthetic (templated arithmetic, naming and translation questions): a relative measurement of
the codec, not of a recipe.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from eaglekit.analysis.acceptance import chain_counts  # noqa: E402
from eaglekit.capture.shards import decode_fp8, encode_fp8  # noqa: E402
from eaglekit.draft.model import build_draft_from_target, load_target_head_weights  # noqa: E402
from eaglekit.draft.vocab import count_generated_tokens, select_draft_vocab  # noqa: E402
from eaglekit.target import resolve_model  # noqa: E402
from eaglekit.training.checkpoint import load_checkpoint, load_draft_weights  # noqa: E402
from eaglekit.training.heldout import heldout_batches, per_position_agreement  # noqa: E402
from eaglekit.training.loop import train_draft  # noqa: E402
from eaglekit.training.settings import TrainSettings  # noqa: E402

THINGS = ["color", "fruit", "animal", "city", "planet", "metal", "tree", "river", "language", "instrument"]
WORDS = ["hello", "thank you", "good night", "water", "friend", "book", "house", "sun"]


def questions(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    makers = [
        lambda: f"What is {rng.randint(2, 99)} plus {rng.randint(2, 99)}?",
        lambda: f"Name three kinds of {rng.choice(THINGS)}.",
        lambda: f"How do you say '{rng.choice(WORDS)}' in {rng.choice(['French', 'Spanish', 'German'])}?",
        lambda: f"Give one fact about the {rng.choice(THINGS)} you like most.",
    ]
    return [makers[index % len(makers)]() for index in range(count)]


@torch.no_grad()
def captured_samples(model_dir: Path, prompts: list[str], max_new_tokens: int) -> list[dict]:
    """Samples as stage 4 yields them: greedy answers, features at the EAGLE-3 layers (bf16),
    loss mask on the answer."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    layers = [2, target.config.num_hidden_layers // 2, target.config.num_hidden_layers - 3]
    samples = []
    for index, question in enumerate(prompts):
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )["input_ids"]
        sequence = target.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.eos_token_id,
        )[0]
        hidden = target(sequence[None], output_hidden_states=True).hidden_states
        loss_mask = torch.zeros_like(sequence)
        loss_mask[prompt.shape[1] :] = 1
        samples.append(
            {
                "id": f"q{index}",
                "dataset": "synthetic",
                "input_ids": sequence,
                "loss_mask": loss_mask,
                "aux_hidden_states": torch.cat([hidden[i][0] for i in layers], dim=-1).to(torch.bfloat16),
                "final_hidden_states": target.model.norm(hidden[-1][0]).to(torch.bfloat16),
            }
        )
    return samples


def as_fp8(samples: list[dict]) -> list[dict]:
    """The same samples through the shard format's fp8 codec (what a `feature_dtype: fp8` capture
    reads back)."""
    return [
        {
            **sample,
            "aux_hidden_states": decode_fp8(*encode_fp8(sample["aux_hidden_states"], 3)),
            "final_hidden_states": decode_fp8(*encode_fp8(sample["final_hidden_states"], 1)),
        }
        for sample in samples
    ]


def per_sample_chain(draft, target_lm_head: torch.Tensor, heldout: list[dict], steps: int) -> np.ndarray:
    """(samples, steps + 1) prefix-agreement counts per held-out sample, for a paired bootstrap."""
    batches = heldout_batches([len(sample["input_ids"]) for sample in heldout], batch_size=4)
    agreements = per_position_agreement(draft, target_lm_head, heldout, steps, batches=batches)
    counts = chain_counts([agreement.agreement for agreement in agreements], steps=steps)
    return np.concatenate([counts.positions[:, None], counts.prefix_counts], axis=1).astype(np.float64)


def tau(rows: np.ndarray) -> float:
    totals = rows.sum(axis=0)
    return float(1.0 + totals[1:].sum() / totals[0])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=96)
    parser.add_argument("--heldout", type=int, default=24)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--resamples", type=int, default=1000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    model_dir = resolve_model("embedded:smollm2-135m-instruct")
    bf16 = captured_samples(model_dir, questions(args.prompts), args.max_new_tokens)
    formats = {"bf16": bf16, "fp8": as_fp8(bf16)}
    head = load_target_head_weights(model_dir)
    vocab = select_draft_vocab(count_generated_tokens(bf16, head.config.vocab_size), 2048)
    settings = TrainSettings(
        ttt_steps=3,
        learning_rate=3e-3,
        min_learning_rate=3e-4,
        warmup_steps=10,
        schedule="equal_steps",
        max_steps=args.steps,
        micro_batch_size=4,
        grad_accumulation_steps=1,
        eval_interval=args.steps,
        max_length=256,
        decay_steps=0,
        prefetch_steps=0,
    )
    drafts = {}
    with tempfile.TemporaryDirectory() as folder:
        for name, samples in formats.items():
            draft = build_draft_from_target(head, vocab.d2t, vocab.t2d, seed=0)
            train, heldout = samples[args.heldout :], samples[: args.heldout]
            result = train_draft(
                draft, head.lm_head, train, heldout, Path(folder) / name, settings, target_cache=False
            )
            load_draft_weights(draft, load_checkpoint(result.best_checkpoint))
            drafts[name] = draft.eval()
    rows = {
        (trained, scored): per_sample_chain(drafts[trained], head.lm_head, formats[scored][: args.heldout], 3)
        for trained in formats
        for scored in formats
    }
    rng = np.random.default_rng(0)
    picks = rng.integers(0, args.heldout, size=(args.resamples, args.heldout))

    def difference(left, right) -> tuple[float, float, float]:
        values = np.array([tau(rows[left][pick]) - tau(rows[right][pick]) for pick in picks])
        return tau(rows[left]) - tau(rows[right]), *np.percentile(values, [2.5, 97.5])

    print(
        f"embedded SmolLM2, {args.prompts - args.heldout} training / {args.heldout} held-out samples x "
        f"{args.max_new_tokens} tokens, {args.steps} steps, chain 3, "
        f"draft vocab 2048 ({time.perf_counter() - started:.0f} s)"
    )
    print("| trained on | scored on | held-out tau |")
    print("|---|---|---|")
    for (trained, scored), value in rows.items():
        print(f"| {trained} | {scored} | {tau(value):.4f} |")
    for label, left, right in (
        ("fp8 pipeline - bf16 pipeline", ("fp8", "fp8"), ("bf16", "bf16")),
        ("bf16 draft: fp8 - bf16 features", ("bf16", "fp8"), ("bf16", "bf16")),
    ):
        point, low, high = difference(left, right)
        print(
            f"{label}: {point:+.4f} [{low:+.4f}, {high:+.4f}] (95%, paired bootstrap over held-out samples)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
