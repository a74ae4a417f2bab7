"""Chat tokenization on small hand-written templates (the published ones: tests/test_templates.py).

Templates: the embedded SmolLM2's ChatML (default system prompt) and three written here in the
styles of common families, set on the embedded tokenizer with their special tokens added:
Llama-3 header tokens with <|eot_id|>; a thinking template that drops the reasoning of turns before
the last user message; a Zephyr-style template with a default system prompt.
"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from eaglekit.chat import (
    NotPrefixStableError,
    template_layout,
    tokenize_conversation,
    tokenize_conversation_reference,
)


def one(result):
    """The single sample of a conversation the template does not rewrite."""
    assert len(result.samples) == 1
    return result.samples[0]


# Llama 3 puts "\n\n" after <|end_header_id|>; SmolLM2's BPE tokenizes a trailing "\n\n" differently
# from "\n\n" followed by text, so a per-prefix diff would not be an oracle there (the real Llama-3
# tokenizer keeps "\n\n" one token either way). The header here ends in one "\n", which is stable.
LLAMA3_STYLE = (
    "{{- '<|begin_of_text|>' -}}"
    "{%- for m in messages -%}"
    "{%- set role = 'ipython' if m.role == 'tool' else m.role -%}"
    "{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n' + (m.content | trim) + '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n' -}}{%- endif -%}"
)
THINKING_STYLE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}"
    "{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if loop.index0 > ns.last_user and m.reasoning_content -%}"
    "{{- '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{{- m.content + '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'tool' -%}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
DEFAULT_SYSTEM_STYLE = (
    "{%- if messages[0].role != 'system' -%}"
    "{{- '<|system|>\\nYou are a friendly assistant who answers briefly.</s>\\n' -}}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{{- '<|' + m.role + '|>\\n' + m.content + '</s>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)
TEMPLATE_TOKENS = {
    "llama3": (LLAMA3_STYLE, ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]),
    "thinking": (THINKING_STYLE, []),
    "default_system": (DEFAULT_SYSTEM_STYLE, ["<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "</s>"]),
}


@pytest.fixture(scope="module")
def tokenizers(embedded_model_dir):
    loaded = {"chatml": AutoTokenizer.from_pretrained(embedded_model_dir)}
    for name, (template, special) in TEMPLATE_TOKENS.items():
        tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir)
        if special:
            tokenizer.add_special_tokens({"additional_special_tokens": special})
        tokenizer.chat_template = template
        loaded[name] = tokenizer
    return loaded


MULTI_TURN = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Germany?"},
    {"role": "assistant", "content": "Berlin."},
]
TOOL_TURNS = [
    {"role": "system", "content": "You can call tools."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    },
    {"role": "tool", "content": '{"temp_c": 18}'},
    {"role": "assistant", "content": "It is 18 degrees."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You're welcome."},
]
EMPTY_SYSTEM = [
    {"role": "system", "content": ""},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
]
UNICODE = [
    {"role": "user", "content": "Traduis « café » en 日本語 🙂"},
    {"role": "assistant", "content": "コーヒー ☕ — naïve façade 🎉"},
    {"role": "user", "content": "Ελληνικά;"},
    {"role": "assistant", "content": "Καφές."},
]
LAST_TURN_REASONING = MULTI_TURN[:3] + [
    {"role": "assistant", "content": "Berlin.", "reasoning": "Germany's capital is Berlin."}
]
CONVERSATIONS = {
    "multi_turn": MULTI_TURN,
    "tool_turns": TOOL_TURNS,
    "empty_system": EMPTY_SYSTEM,
    "unicode": UNICODE,
    "last_turn_reasoning": LAST_TURN_REASONING,
}


def masked_text(tokenizer, tokenized) -> str:
    return tokenizer.decode([i for i, m in zip(tokenized.input_ids, tokenized.loss_mask) if m])


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("template", ["chatml", "llama3", "thinking", "default_system"])
def test_one_pass_matches_per_prefix_reference(tokenizers, template, conversation):
    tokenizer = tokenizers[template]
    messages = CONVERSATIONS[conversation]
    fast = one(tokenize_conversation(tokenizer, messages))
    reference = one(tokenize_conversation_reference(tokenizer, messages))
    assert fast == reference
    rendered = tokenizer.apply_chat_template(
        [{"role": m["role"], "content": m["content"]} for m in messages], tokenize=False
    )
    if not any(m.get("reasoning") for m in messages):
        assert fast.input_ids == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert sum(fast.loss_mask) > 0


@pytest.mark.parametrize("template", ["chatml", "llama3", "thinking", "default_system"])
def test_mask_is_exactly_assistant_bodies_and_end_of_turn(tokenizers, template):
    tokenizer = tokenizers[template]
    layout = template_layout(tokenizer)
    tokenized = one(tokenize_conversation(tokenizer, TOOL_TURNS))
    expected = "".join(m["content"] + layout.end_of_turn for m in TOOL_TURNS if m["role"] == "assistant")
    assert masked_text(tokenizer, tokenized) == expected
    # Nothing of the system, user or tool turns is trainable (the seed's shortcut would train on them).
    unmasked = tokenizer.decode([i for i, m in zip(tokenized.input_ids, tokenized.loss_mask) if not m])
    for message in TOOL_TURNS:
        if message["role"] != "assistant" and message["content"]:
            assert message["content"] in unmasked
    eot_positions = [i for i, t in enumerate(tokenized.input_ids) if t == layout.end_of_turn_id]
    assert (
        sum(tokenized.loss_mask[i] for i in eot_positions) == 3
    )  # only the assistant turns' end-of-turn tokens


def test_template_layouts(tokenizers):
    assert template_layout(tokenizers["chatml"]).end_of_turn == "<|im_end|>"
    assert template_layout(tokenizers["llama3"]).end_of_turn == "<|eot_id|>"
    assert template_layout(tokenizers["default_system"]).end_of_turn == "</s>"
    assert template_layout(tokenizers["thinking"]).reasoning == "field"
    assert template_layout(tokenizers["chatml"]).reasoning == "fold"


def test_default_system_prompt_is_not_trainable(tokenizers):
    for name, text in (
        ("chatml", "You are a helpful AI assistant named SmolLM"),
        ("default_system", "You are a friendly assistant who answers briefly."),
    ):
        tokenizer = tokenizers[name]
        tokenized = one(tokenize_conversation(tokenizer, MULTI_TURN))
        assert text in tokenizer.decode(tokenized.input_ids)
        assert text not in masked_text(tokenizer, tokenized)


def test_thinking_template_drops_earlier_reasoning_split_and_visible(tokenizers):
    tokenizer = tokenizers["thinking"]
    messages = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning": "EARLIER-REASONING two plus two"},
        {"role": "user", "content": "3+3?"},
        {"role": "assistant", "content": "6", "reasoning": "LATER-REASONING three plus three"},
    ]
    with pytest.raises(NotPrefixStableError):
        tokenize_conversation_reference(tokenizer, messages, history="visible")
    # split (default): two samples, each turn trained once with its reasoning, in the context it had.
    split = tokenize_conversation(tokenizer, messages)
    assert split.samples == tokenize_conversation_reference(tokenizer, messages).samples
    assert [masked_text(tokenizer, sample) for sample in split.samples] == [
        "<think>\nEARLIER-REASONING two plus two\n</think>\n\n4<|im_end|>",
        "<think>\nLATER-REASONING three plus three\n</think>\n\n6<|im_end|>",
    ]
    assert "EARLIER" not in tokenizer.decode(split.samples[1].input_ids)  # the history the server sent
    assert split.trained_tokens == split.generated_tokens
    # visible: one sequence; the dropped reasoning is not trained, and the counts say so.
    visible = tokenize_conversation(tokenizer, messages, history="visible")
    text = masked_text(tokenizer, one(visible))
    assert "EARLIER-REASONING" not in tokenizer.decode(one(visible).input_ids)
    assert "<think>\nLATER-REASONING three plus three\n</think>\n\n6<|im_end|>" in text
    assert text.startswith("4<|im_end|>")
    assert visible.trained_tokens < visible.generated_tokens
    # Its meaning: the reference on the conversation with the dropped reasoning removed beforehand.
    without_dropped = [dict(m) for m in messages]
    without_dropped[1].pop("reasoning")
    assert one(visible) == one(tokenize_conversation_reference(tokenizer, without_dropped, history="visible"))


def test_generation_engine_call_with_reasoning_on_a_template_without_reasoning(tokenizers):
    """The generation engine calls tokenize_conversation(tokenizer, messages + [answer with reasoning])."""
    tokenizer = tokenizers["chatml"]
    answer = {"role": "assistant", "content": "The answer is 42.", "reasoning": "6 times 7 is 42."}
    tokenized = one(tokenize_conversation(tokenizer, MULTI_TURN[:1] + [answer]))
    assert (
        masked_text(tokenizer, tokenized)
        == "<think>\n6 times 7 is 42.\n</think>\n\nThe answer is 42.<|im_end|>"
    )
    assert tokenized == one(tokenize_conversation_reference(tokenizer, MULTI_TURN[:1] + [answer]))


def test_long_agent_conversation_matches_reference(tokenizers):
    messages = [{"role": "system", "content": "You are a coding agent."}]
    for step in range(20):
        messages += [
            {"role": "user", "content": f"Step {step}: run the tests"}
            if step == 0
            else {"role": "tool", "content": f"output of step {step - 1}: {'ok ' * step}"},
            {
                "role": "assistant",
                "content": (
                    f'<tool_call>\n{{"name": "bash", "arguments": {{"cmd": "pytest -k {step}"}}}}'
                    "\n</tool_call>"
                ),
            },
        ]
    for name in ("chatml", "llama3"):
        assert (
            tokenize_conversation(tokenizers[name], messages).samples
            == tokenize_conversation_reference(tokenizers[name], messages).samples
        )
