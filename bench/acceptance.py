"""Offline acceptance evaluation and the reference speculative loop against plain greedy decoding, side by
side.

    # embedded SmolLM2, untrained draft, k = 3, 4 prompts x 32 tokens
    python bench/acceptance.py
    python bench/acceptance.py --steps 1 3 5 --prompts 8 --max-new-tokens 64
    python bench/acceptance.py --draft-checkpoint outputs/<run>/draft/checkpoint.pt
    python bench/acceptance.py --steps 3 --topology tree:3,2,6 tree:5,8,32 --fit-iterations 20

One process, one thread by default (CPU timings on a shared machine are noisy; say so when quoting them).
Lines printed per k:
- offline: tokens/s of the offline chain evaluation (one target forward + the draft's k-step unroll per
  sequence)
- greedy: plain greedy loop with KV cache; generate: transformers' generate(do_sample=False) on the same
  prompts
- loop: the speculative loop with the draft, accept length the way a server counts it, offline tau, and the
  ratio
- oracle: the same loop with proposals forced right (what this loop gives at its ceiling accept length)
Lines per --topology (chains or SGLang trees, through `eaglekit.analysis.evaluate`): tau of the loop
(accepted + bonus per verification), as a server counts it, and offline on the greedy continuations, each
with a bootstrap interval over prompts; the lossless check; tokens/s against greedy; then the oracle tree
loop.
--fit-iterations N overfits the untrained draft for N Adam steps on the target's greedy answers to these
very prompts (so that drafts accept something and loop and offline tau can be compared; not a held-out
measurement).
An untrained draft accepts almost nothing, so its loop is slower than plain decoding: that is the honest
result.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from eaglekit.analysis.checkpoints import evaluate_speculative_loop
from eaglekit.draft.model import (
    DraftConfig,
    Eagle3DraftModel,
    build_draft_from_target,
    load_target_head_weights,
)
from eaglekit.target import resolve_model
from eaglekit.analysis.evaluate import evaluate_draft
from eaglekit.analysis.speculative import (
    OracleDraft,
    greedy_decode,
    speculative_decode,
    tree_speculative_decode,
)
from eaglekit.topology import Topology
from eaglekit.draft.vocab import default_draft_vocab_size, select_draft_vocab

QUESTIONS = [
    "Write a short story about a robot learning to paint.",
    "Explain how a refrigerator works.",
    "List five tips for learning a new language.",
    "Describe the water cycle for a ten-year-old.",
    "What are the pros and cons of remote work?",
    "Write a poem about the sea at night.",
    "How do vaccines train the immune system?",
    "Give me a recipe for a simple tomato soup.",
]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model",
        default="embedded:smollm2-135m-instruct",
        help="target: embedded:NAME, a folder, or a hub id",
    )
    parser.add_argument(
        "--draft-checkpoint",
        default=None,
        help="a stage-5 training checkpoint (.pt); default: an untrained draft",
    )
    parser.add_argument("--steps", type=int, nargs="+", default=[3], help="chain lengths k to measure")
    parser.add_argument("--prompts", type=int, default=4, help=f"how many prompts (at most {len(QUESTIONS)})")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (1 keeps a shared machine's timings sane)"
    )
    parser.add_argument("--skip-generate", action="store_true", help="do not time transformers' generate")
    parser.add_argument(
        "--topology",
        nargs="*",
        default=[],
        help="chain:k / tree:S,K,T topologies through eaglekit.analysis.evaluate",
    )
    parser.add_argument(
        "--fit-iterations", type=int, default=0, help="overfit the draft on the prompts' greedy answers first"
    )
    return parser.parse_args(argv)


def load_draft(
    model_dir, checkpoint_path: str | None, counts_from: list[list[int]], vocab_size: int
) -> Eagle3DraftModel:
    """The trained draft from a checkpoint, or an untrained one with a draft vocab from
    the target's own outputs."""
    head = load_target_head_weights(model_dir)
    if checkpoint_path is not None:
        from eaglekit.training import load_checkpoint, load_draft_weights

        checkpoint = load_checkpoint(checkpoint_path)
        draft = Eagle3DraftModel(DraftConfig.from_dict(checkpoint["draft_config"]))
        with torch.no_grad():
            draft.embed_tokens.weight.copy_(head.embed_tokens.float())
        load_draft_weights(draft, checkpoint)
        return draft.eval()
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for tokens in counts_from:
        counts += torch.bincount(torch.tensor(tokens, dtype=torch.int64), minlength=vocab_size)
    vocab = select_draft_vocab(counts, default_draft_vocab_size(vocab_size))
    return build_draft_from_target(head, vocab.d2t, vocab.t2d, seed=0).eval()


def time_generate(target, prompts: list[list[int]], max_new_tokens: int, eos: list[int]) -> tuple[int, float]:
    tokens, seconds = 0, 0.0
    for prompt in prompts:
        input_ids = torch.tensor([prompt])
        started = time.perf_counter()
        with torch.inference_mode():
            output = target.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=eos[0],
            )
        seconds += time.perf_counter() - started
        tokens += output.shape[1] - len(prompt)
    return tokens, seconds


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    eos = [int(tokenizer.eos_token_id)]
    encoded = [
        tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
        for question in QUESTIONS[: args.prompts]
    ]
    prompts = [list(item if isinstance(item, list) else item["input_ids"]) for item in encoded]
    print(
        f"target {args.model}: {target.config.num_hidden_layers} layers, hidden {target.config.hidden_size}; "
        f"{len(prompts)} prompts, max_new_tokens {args.max_new_tokens}, "
        f"torch threads {torch.get_num_threads()}, device cpu"
    )

    # The draft vocab of an untrained draft comes from the target's own greedy outputs,
    # as stage 5 would pick it.
    references = [greedy_decode(target, prompt, args.max_new_tokens, eos).output_ids for prompt in prompts]
    draft = load_draft(model_dir, args.draft_checkpoint, references, target.config.vocab_size)
    untrained = "untrained (random layer, target lm_head rows)"
    print(
        f"draft: {'checkpoint ' + args.draft_checkpoint if args.draft_checkpoint else untrained}, "
        f"draft vocab {draft.config.draft_vocab_size}"
    )
    if args.fit_iterations:
        started = time.perf_counter()
        fit_draft(
            draft,
            target,
            [prompt + reference for prompt, reference in zip(prompts, references)],
            [len(p) for p in prompts],
            args.fit_iterations,
        )
        print(
            f"draft overfitted on these prompts' greedy answers: {args.fit_iterations} Adam steps, "
            f"{time.perf_counter() - started:.1f} s"
        )

    if not args.skip_generate:
        generate_tokens, generate_seconds = time_generate(target, prompts, args.max_new_tokens, eos)
        print(
            f"generate       {generate_tokens / generate_seconds:8.2f} tok/s  "
            "(transformers generate, do_sample=False)"
        )

    for steps in args.steps:
        report = evaluate_speculative_loop(target, draft, prompts, steps, args.max_new_tokens, eos)
        summary = report.summary
        offline_tokens = sum(result.tokens for result in report.offline)
        offline_seconds = sum(result.seconds for result in report.offline)
        greedy_rate, loop_rate = summary["greedy_tokens_per_second"], summary["speculative_tokens_per_second"]
        topology = f"chain k={steps} (top-1, {steps + 1} draft tokens)"
        print(f"--- {topology}")
        print(
            f"offline eval   {offline_tokens / offline_seconds:8.2f} tok/s  ({offline_tokens} sequence "
            "tokens evaluated; "
            f"{offline_tokens / offline_seconds / greedy_rate:.1f}x the greedy decoding rate)"
        )
        print(f"greedy         {greedy_rate:8.2f} tok/s  (plain loop, KV cache)")
        print(
            f"loop           {loop_rate:8.2f} tok/s  speedup {summary['speedup']:.2f}x  "
            f"tau {summary['tau_loop_pooled']:.3f} (per-request mean "
            f"{summary['tau_loop_per_request_mean']:.3f}, {summary['generated_tokens']} tokens / "
            f"{summary['verification_steps']} verifications)  offline tau "
            f"{summary['tau_offline_pooled']:.3f} (gap {summary['tau_gap_loop_minus_offline']:+.3f})  "
            f"outputs equal greedy: {summary['outputs_equal']}"
        )
        if summary["speedup"] < 1.0:
            print(
                f"               the loop is {1 / summary['speedup']:.2f}x SLOWER than plain decoding at "
                f"accept length {summary['tau_loop_pooled']:.2f}: the draft does not pay for its own steps"
            )
        # The ceiling: the same loop (real draft compute, real caches) with every proposal forced right.
        greedy_seconds, oracle_seconds, oracle_tokens, oracle_verifications = 0.0, 0.0, 0, 0
        for prompt, reference in zip(prompts, report.greedy):
            oracle = OracleDraft(draft, prompt + reference.output_ids, len(prompt))
            greedy = greedy_decode(target, prompt, args.max_new_tokens, eos)
            result = speculative_decode(target, oracle, prompt, steps, args.max_new_tokens, eos)
            if result.output_ids != greedy.output_ids:
                raise RuntimeError(
                    f"oracle loop output differs from greedy on prompt {prompt[:8]}...: a bug in the loop"
                )
            greedy_seconds += greedy.seconds
            oracle_seconds += result.seconds
            oracle_tokens += len(result.output_ids)
            oracle_verifications += result.verification_steps
        oracle_rate, greedy_again = oracle_tokens / oracle_seconds, oracle_tokens / greedy_seconds
        print(
            f"oracle loop    {oracle_rate:8.2f} tok/s  speedup {oracle_rate / greedy_again:.2f}x over greedy "
            f"{greedy_again:.2f} tok/s timed alongside  tau "
            f"{oracle_tokens / max(oracle_verifications, 1):.3f} (ceiling k+1 = {steps + 1})"
        )
    for text in args.topology:
        topology = Topology.parse(text)
        record = evaluate_draft(
            target, draft, prompts, [topology], args.max_new_tokens, eos, num_resamples=500
        ).records()[0]
        print(f"--- {topology.label} (SGLang {topology.sglang_command_line})")
        for name in ("tau_loop", "tau_server", "tau_offline"):
            low, high = record[f"{name}_interval"]
            print(f"{name:<14} {record[name]:8.3f}  [{low:.3f}, {high:.3f}]")
        print(
            f"offline vs loop {100 * record['tau_offline_vs_loop']:+.1f}%  ({record['offline_positions']} "
            f"offline start rows, {record['verification_steps']} verifications)  outputs equal "
            f"greedy: {record['outputs_equal']}"
        )
        print(
            f"loop           {record['tokens_per_s']:8.2f} tok/s  vs greedy "
            f"{record['greedy_tokens_per_s']:.2f}  speedup {record['speedup']:.2f}x"
        )
        oracle_tokens, oracle_steps, oracle_seconds, greedy_seconds = 0, 0, 0.0, 0.0
        for prompt, reference in zip(prompts, references):
            oracle = OracleDraft(draft, prompt + reference, len(prompt))
            greedy = greedy_decode(target, prompt, args.max_new_tokens, eos)
            result = tree_speculative_decode(target, oracle, prompt, topology, args.max_new_tokens, eos)
            if result.output_ids != greedy.output_ids:
                raise RuntimeError(
                    "oracle tree loop output differs from greedy on prompt "
                    f"{prompt[:8]}...: a bug in the loop"
                )
            oracle_tokens += len(result.output_ids)
            oracle_steps += result.verification_steps
            oracle_seconds += result.seconds
            greedy_seconds += greedy.seconds
        print(
            f"oracle loop    {oracle_tokens / oracle_seconds:8.2f} tok/s  speedup "
            f"{greedy_seconds / oracle_seconds:.2f}x  tau {oracle_tokens / max(oracle_steps, 1):.3f} "
            f"(ceiling S+1 = {topology.ceiling})"
        )
    return 0


def fit_draft(
    draft: Eagle3DraftModel,
    target,
    sequences: list[list[int]],
    prompt_lengths: list[int],
    iterations: int,
    steps: int = 3,
) -> None:
    """Overfit the draft on the given sequences (TTT unroll, hard labels): a draft that accepts something."""
    import torch.nn.functional as F

    with torch.no_grad():
        features = []
        for sequence in sequences:
            hidden = target(torch.tensor([sequence]), output_hidden_states=True).hidden_states
            features.append(
                torch.cat([hidden[i] for i in draft.config.capture_layer_indices], dim=-1).clone()
            )
    # Draft id of each target token; -1 outside the draft vocab (those labels are skipped).
    target_to_draft = torch.where(
        draft.t2d, torch.cumsum(draft.t2d.long(), 0) - 1, torch.full_like(draft.t2d, -1, dtype=torch.long)
    )
    keep = [(torch.tensor([s]), f, n) for s, f, n in zip(sequences, features, prompt_lengths)]
    optimizer = torch.optim.Adam([p for p in draft.parameters() if p.requires_grad], lr=2e-3)
    draft.train()
    for _ in range(iterations):
        optimizer.zero_grad()
        loss = 0.0
        for ids, aux, prompt_length in keep:
            for step, logits in enumerate(draft(ids, aux, steps)):
                rows = slice(prompt_length - 1, ids.shape[1] - 2 - step)
                labels = target_to_draft[ids[0, prompt_length + 1 + step :]]
                in_vocab = labels >= 0
                loss = loss + F.cross_entropy(logits[0, rows][in_vocab], labels[in_vocab])
        loss.backward()
        optimizer.step()
    draft.eval()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
