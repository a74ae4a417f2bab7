"""Bench: one-pass masked tokenization against the per-prefix reference on 84-message agent conversations.

Usage: python bench/tokenize_mask.py [--conversations 8] [--messages 84] [--model embedded:smollm2-135m-instruct]

Builds agent-style conversations (system, user task, then assistant tool calls and tool outputs of
varied length, 84 messages each), asserts both implementations give identical input_ids and
loss_mask, and prints the speed ratio (goal >= 10x) and conversations per second of each.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from transformers import AutoTokenizer

from eaglekit.chat import tokenize_conversation, tokenize_conversation_reference


def agent_conversation(messages: int, seed: int) -> list[dict]:
    """system + user task + alternating assistant tool calls / tool outputs, `messages` in total."""
    rng = random.Random(seed)
    words = "def class return import pytest assert error value file line test fix patch repo".split()
    conversation = [{"role": "system", "content": "You are an autonomous coding agent. Use the bash tool."},
                    {"role": "user", "content": f"Issue #{seed}: tests fail on empty input. Fix it."}]
    while len(conversation) < messages - 1:
        command = " ".join(rng.choices(words, k=rng.randint(3, 12)))
        conversation.append({"role": "assistant", "content": "I will inspect the code.\n<tool_call>\n"
                             f'{{"name": "bash", "arguments": {{"cmd": "{command}"}}}}\n</tool_call>'})
        conversation.append({"role": "tool", "content": "\n".join(" ".join(rng.choices(words, k=10))
                                                                  for _ in range(rng.randint(1, 30)))})
    conversation.append({"role": "assistant", "content": "The fix is in place and the tests pass."})
    return conversation[:messages]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--messages", type=int, default=84)
    parser.add_argument("--model", default="embedded:smollm2-135m-instruct")
    arguments = parser.parse_args()
    try:
        from eaglekit.models import resolve_model

        model_dir = resolve_model(arguments.model)
    except Exception as error:  # the bench needs a real tokenizer; say which and why it is missing
        print(f"cannot resolve tokenizer {arguments.model!r}: {error}\n"
              "install the embedded model (make setup) or pass --model <local transformers folder>", file=sys.stderr)
        return 2
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    conversations = [agent_conversation(arguments.messages, seed) for seed in range(arguments.conversations)]
    tokenize_conversation(tokenizer, conversations[0])  # warm the template probe and jinja compile

    start = time.perf_counter()
    fast = [tokenize_conversation(tokenizer, c) for c in conversations]
    fast_seconds = time.perf_counter() - start
    start = time.perf_counter()
    reference = [tokenize_conversation_reference(tokenizer, c) for c in conversations]
    reference_seconds = time.perf_counter() - start

    assert fast == reference, "one-pass and per-prefix reference disagree"
    tokens = sum(len(t.input_ids) for t in fast)
    trainable = sum(sum(t.loss_mask) for t in fast)
    print(f"model={model_dir.name} conversations={len(conversations)} messages={arguments.messages} "
          f"tokens={tokens} trainable={trainable} identical=True")
    print(f"one-pass:  {fast_seconds:.3f} s  {len(conversations) / fast_seconds:.1f} conversations/s")
    print(f"reference: {reference_seconds:.3f} s  {len(conversations) / reference_seconds:.2f} conversations/s")
    print(f"speedup one-pass / reference: {reference_seconds / fast_seconds:.1f}x (goal >= 10x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
