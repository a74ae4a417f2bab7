"""Bench: the fast path against the per-prefix oracle, per published chat template.

Usage: python bench/tokenize_mask.py [--conversations 4] [--messages 84] [--templates qwen3,...]
                                     [--shape agent|chat] [--repeats 3]

For each fixture template (tests/fixtures/chat_templates, set on the embedded SmolLM2 tokenizer with
its special tokens) it builds conversations of 84 messages (system prompt where legal, tool
definitions, one and several tool calls, tool results, reasoning on some turns; `agent`: one task
then tool rounds, `chat`: a user turn every few rounds), checks that both paths give identical
samples, and prints per template: samples per conversation, how many conversations the fast path
handed to the oracle, the seconds of each path (per conversation the best of --repeats runs, garbage
collection off while timing, as timeit does: the machine is shared) and the speed ratio (goal >= 10x).
The load average is printed with the table.

The oracle renders and tokenizes every turn's prompt and turn: quadratic in the conversation. The fast
path is linear: one render of the whole conversation, each turn as generated in a small context, and
for templates that rewrite history (Qwen3, Kimi thinking, DeepSeek; split into one sample per
stretch) each sample composed from a history rendering plus its own stretch rendered small (one
rendering per stretch of tool rounds, or read off the history rendering where the template allows it).
Mistral moves the system prompt and tool definitions to the last user message (the system prompt only
while that message is last): there every turn's prompt is composed (the history from the full
rendering, each stretch from one small rendering with the system prompt and tools) and cut as the
oracle cuts; a conversation with two equal user messages still goes to the oracle (fallbacks).
DeepSeek-R1 renders a tool call that follows tool output without the prompt the model was given, and
MiniMax-M2 a turn without reasoning without its `<think>` prompt: such turns are counted rejects
(`ConversationSamples.rejected_turns`) and their conversations go to the oracle (fallbacks), as do
Hermes-3 tool_use's with tool results (it rewrites the last result's closing once a turn follows).
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "chat"))


def best_of(repeats: int, run):
    """(the result, the least seconds of `repeats` runs), garbage collection off while timing (as timeit)."""
    best = float("inf")
    for _ in range(max(repeats, 1)):
        gc.disable()
        try:
            start = time.perf_counter()
            result = run()
            best = min(best, time.perf_counter() - start)
        finally:
            gc.enable()
    return result, best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--messages", type=int, default=84)
    parser.add_argument("--templates", default="", help="comma-separated fixture names (default: all)")
    parser.add_argument(
        "--shape",
        choices=["chat", "agent"],
        default="agent",
        help="agent: one task then tool rounds (DeepSWE-like); chat: a user turn every few rounds",
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs per conversation and path; the best counts"
    )
    arguments = parser.parse_args()
    try:
        from eaglekit.target import resolve_model

        model_dir = resolve_model("embedded:smollm2-135m-instruct")
    except Exception as error:  # the bench needs a real tokenizer; say which and why it is missing
        print(
            f"cannot resolve the embedded tokenizer: {error}\ninstall the embedded model (make setup)",
            file=sys.stderr,
        )
        return 2
    from test_templates import META, TEMPLATE_KWARGS, conversation, fixture_tokenizer

    from eaglekit.chat import ChatTemplateError, tokenize_conversation, tokenize_conversation_reference

    names = [name for name in arguments.templates.split(",") if name] or sorted(META)
    load = " ".join(f"{value:.2f}" for value in os.getloadavg())
    print(
        f"shape {arguments.shape}, {arguments.conversations} conversations of {arguments.messages} messages "
        f"per template, best of {arguments.repeats}; load average {load}"
    )
    print(
        f"{'template':<18}{'samples/conv':>13}{'fallbacks':>10}{'rejected':>9}{'fast s':>9}{'oracle s':>10}"
        f"{'ratio':>8}"
    )
    for name in names:
        tokenizer = fixture_tokenizer(model_dir, name)
        kwargs = TEMPLATE_KWARGS.get(name)
        rng = random.Random(f"bench-{name}")
        conversations = []
        rejected = 0
        while len(conversations) < arguments.conversations and rejected < 50:
            messages, tools = conversation(name, rng, arguments.messages, agent=arguments.shape == "agent")
            try:
                tokenize_conversation(
                    tokenizer, messages, tools=tools, template_kwargs=kwargs
                )  # also warms up
                conversations.append((messages, tools))
            except ChatTemplateError:
                rejected += 1
        fast_seconds = oracle_seconds = 0.0
        samples = fallbacks = 0
        for messages, tools in conversations:
            try:
                fast, seconds = best_of(
                    arguments.repeats,
                    functools.partial(
                        tokenize_conversation, tokenizer, messages, tools=tools, template_kwargs=kwargs
                    ),
                )
                fast_seconds += seconds
                oracle, seconds = best_of(
                    arguments.repeats,
                    functools.partial(
                        tokenize_conversation_reference,
                        tokenizer,
                        messages,
                        tools=tools,
                        template_kwargs=kwargs,
                    ),
                )
                oracle_seconds += seconds
            except ChatTemplateError:
                rejected += 1
                continue
            assert fast.samples == oracle.samples, f"{name}: fast path and oracle disagree"
            samples += len(fast.samples)
            fallbacks += fast.fallback
        done = len(conversations) - (rejected if rejected <= len(conversations) else 0)
        ratio = oracle_seconds / fast_seconds if fast_seconds else float("nan")
        print(
            f"{name:<18}{samples / max(done, 1):>13.1f}{fallbacks:>10}{rejected:>9}{fast_seconds:>9.3f}"
            f"{oracle_seconds:>10.3f}{ratio:>7.1f}x"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
