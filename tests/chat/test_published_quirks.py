"""Published templates with a quirk the kit once got wrong (issue 25): each test runs the real template
(tests/fixtures/chat_templates) through the fast path and the oracle, and checks what each assistant
turn trains against what the server would have sent and the target generated."""

from __future__ import annotations


import pytest

from eaglekit.chat import (
    ChatTemplateError,
    render_conversation,
    template_layout,
    tokenize_conversation,
    tokenize_conversation_reference,
)
from support import TOOLS, fixture_tokenizer  # noqa: E402  (shared test helpers, tests/support.py)


@pytest.fixture(scope="module")
def tokenizers(embedded_model_dir):
    return {
        name: fixture_tokenizer(embedded_model_dir, name)
        for name in ("kimi_k25", "glm46", "hermes3_tool_use", "minimax_m2", "deepseek_v31")
    }


def trained_turns(tokenizer, result) -> list[tuple[str, str]]:
    """(the sample's text before the turn, the turn's trained text) for every run of loss_mask 1, in order."""
    turns = []
    for sample in result.samples:
        mask = sample.loss_mask
        position = 0
        while position < len(mask):
            if not mask[position]:
                position += 1
                continue
            end = position
            while end < len(mask) and mask[end]:
                end += 1
            turns.append(
                (
                    tokenizer.decode(sample.input_ids[:position]),
                    tokenizer.decode(sample.input_ids[position:end]),
                )
            )
            position = end
    return turns


def both_paths(tokenizer, messages, tools=None, template_kwargs=None):
    fast = tokenize_conversation(tokenizer, messages, tools=tools, template_kwargs=template_kwargs)
    oracle = tokenize_conversation_reference(
        tokenizer, messages, tools=tools, template_kwargs=template_kwargs
    )
    assert fast.samples == oracle.samples
    assert (fast.trained_tokens, fast.generated_tokens) == (oracle.trained_tokens, oracle.generated_tokens)
    return fast, oracle


def assert_turns_as_served(tokenizer, messages, result, expected, tools=None, template_kwargs=None):
    """Each assistant turn trains exactly `expected[k]`, right after its prompt as the server renders it."""
    assistant = [index for index, message in enumerate(messages) if message["role"] == "assistant"]
    turns = trained_turns(tokenizer, result)
    assert [text for _, text in turns] == expected
    for (before, _), index in zip(turns, assistant):
        assert before == render_conversation(
            tokenizer,
            messages[:index],
            add_generation_prompt=True,
            tools=tools,
            template_kwargs=template_kwargs,
        )


KIMI_CALL = {
    "id": "functions.bash:0",
    "type": "function",
    "function": {"name": "bash", "arguments": {"cmd": "ls"}},
}
KIMI_CONVERSATION = [
    {"role": "system", "content": "You are Kimi."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4.", "reasoning": "Two plus two is four."},
    {"role": "user", "content": "List the files."},
    {"role": "assistant", "content": "", "reasoning": "I should run ls.", "tool_calls": [KIMI_CALL]},
    {"role": "tool", "content": "a.py b.py", "tool_call_id": "functions.bash:0"},
    {"role": "assistant", "content": "a.py and b.py.", "reasoning": "The tool listed two files."},
    {"role": "user", "content": "Thanks."},
    {"role": "assistant", "content": "You are welcome."},
]


def test_kimi_k25_reasoning_is_placed_inside_the_think_block_its_generation_prompt_opens(tokenizers):
    """Kimi-K2.5's generation prompt ends in `<think>`; its history writes every turn up to the last plain
    answer as `<think></think>` + content. The target generated, after that prompt, its reasoning, then
    `</think>`, content, calls and `<|im_end|>` (no second think block in the content, as "fold" wrote it)."""
    tokenizer = tokenizers["kimi_k25"]
    fast, _ = both_paths(tokenizer, KIMI_CONVERSATION, tools=TOOLS)
    call = (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.bash:0<|tool_call_argument_begin|>"
        '{"cmd": "ls"}<|tool_call_end|><|tool_calls_section_end|>'
    )
    expected = [
        "Two plus two is four.</think>4.<|im_end|>",
        "I should run ls.</think>" + call + "<|im_end|>",
        "The tool listed two files.</think>a.py and b.py.<|im_end|>",
        "</think>You are welcome.<|im_end|>",
    ]
    assert_turns_as_served(tokenizer, KIMI_CONVERSATION, fast, expected, tools=TOOLS)
    for before, _ in trained_turns(tokenizer, fast):
        assert before.endswith("<|im_assistant|>assistant<|im_middle|><think>")
    assert template_layout(tokenizer).reasoning == "splice"


def call(name: str = "bash", call_id: str = "call00001", **arguments) -> dict:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": arguments or {"cmd": "ls"}},
    }


GLM_CONVERSATION = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4.", "reasoning": "Two plus two."},
    {"role": "user", "content": "List the files."},
    {"role": "assistant", "content": "", "reasoning": "Run ls.", "tool_calls": [call()]},
    {"role": "tool", "content": "a.py b.py", "tool_call_id": "call00001"},
    {"role": "assistant", "content": "a.py and b.py."},
]


def test_glm46_turn_closed_by_the_next_role_token_trains_that_token(tokenizers):
    """GLM-4.6 writes no end-of-turn token: the next message's role token closes an assistant turn, and
    the last turn has none. The model stops by generating `<|user|>` after an answer and `<|observation|>`
    after tool calls (both are eos ids in its generation_config): that token is the turn's trained end,
    written after the last turn too. A truncated last turn ends at its last generated token."""
    tokenizer = tokenizers["glm46"]
    fast, _ = both_paths(tokenizer, GLM_CONVERSATION, tools=TOOLS)
    calls = "\n<tool_call>bash\n<arg_key>cmd</arg_key>\n<arg_value>ls</arg_value>\n</tool_call>"
    expected = [
        "\n<think>Two plus two.</think>\n4.<|user|>",
        "\n<think>Run ls.</think>" + calls + "<|observation|>",
        "\n<think></think>\na.py and b.py.<|user|>",
    ]
    assert_turns_as_served(tokenizer, GLM_CONVERSATION, fast, expected, tools=TOOLS)
    layout = template_layout(tokenizer)
    assert (layout.end_of_turn, layout.call_end_of_turn, layout.closers) == (
        "<|user|>",
        "<|observation|>",
        ("<|user|>", "<|observation|>"),
    )
    cut = tokenize_conversation(tokenizer, GLM_CONVERSATION, tools=TOOLS, truncated=True)
    assert (
        cut.samples
        == tokenize_conversation_reference(tokenizer, GLM_CONVERSATION, tools=TOOLS, truncated=True).samples
    )
    assert trained_turns(tokenizer, cut)[-1][1] == "\n<think></think>\na.py and b.py."


HERMES_CONVERSATION = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "List the files."},
    {"role": "assistant", "content": "", "tool_calls": [call()]},
    {"role": "tool", "content": "a.py b.py", "tool_call_id": "call00001"},
    {"role": "assistant", "content": "a.py and b.py."},
    {"role": "user", "content": "Thanks."},
    {"role": "assistant", "content": "You are welcome."},
]


def test_hermes3_tool_use_is_probed_with_the_conversations_tools(tokenizers):
    """Hermes-3's tool_use template iterates `tools` unguarded: it renders only with tool definitions, so the
    layout probe renders with the conversation's tools (a probe tool where it has none). The template also
    closes the last tool result without the newline it writes once a turn follows: the turn after it is
    trained after the prompt the server sent (`</tool_response><|im_end|>`), as generated."""
    tokenizer = tokenizers["hermes3_tool_use"]
    fast, _ = both_paths(tokenizer, HERMES_CONVERSATION, tools=TOOLS)
    expected = [
        '<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls"}}\n</tool_call><|im_end|>',
        "a.py and b.py.<|im_end|>",
        "You are welcome.<|im_end|>",
    ]
    assert_turns_as_served(tokenizer, HERMES_CONVERSATION, fast, expected, tools=TOOLS)
    assert template_layout(tokenizer, tools=TOOLS).end_of_turn == "<|im_end|>"
    assert template_layout(tokenizer).end_of_turn == "<|im_end|>"  # probed with a probe tool


MINIMAX_CONVERSATION = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4.", "reasoning": "Two plus two."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "6."},  # no reasoning: undefined after the `<think>\n` prompt
    {"role": "user", "content": "And 4+4?"},
    {"role": "assistant", "content": "8.", "reasoning": "Four plus four."},
]


def test_minimax_m2_turn_without_reasoning_is_a_counted_reject_and_the_others_are_trained(tokenizers):
    """MiniMax-M2's generation prompt always opens `<think>\\n`; a turn without reasoning renders no think
    block, so its rendering does not extend its prompt: nothing the target generated is known for it. That
    turn is left out (listed in rejected_turns, mask 0 where it is context); the others are trained."""
    tokenizer = tokenizers["minimax_m2"]
    fast, oracle = both_paths(tokenizer, MINIMAX_CONVERSATION)
    assert [index for index, _ in oracle.rejected_turns] == [
        3
    ] and fast.rejected_turns == oracle.rejected_turns
    kept = [message for index, message in enumerate(MINIMAX_CONVERSATION) if index != 3]
    expected = ["Two plus two.\n</think>\n\n4.[e~[", "Four plus four.\n</think>\n\n8.[e~["]
    turns = trained_turns(tokenizer, fast)
    assert [text for _, text in turns] == expected
    assert turns[1][0] == render_conversation(tokenizer, MINIMAX_CONVERSATION[:5], add_generation_prompt=True)
    assert turns[0][0] == render_conversation(tokenizer, kept[:1], add_generation_prompt=True)
    assert fast.generated_tokens == fast.trained_tokens
    with pytest.raises(ChatTemplateError, match="no assistant turn can be defined"):
        tokenize_conversation(tokenizer, MINIMAX_CONVERSATION[:4][2:])
