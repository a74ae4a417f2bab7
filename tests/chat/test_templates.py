"""Published chat templates (tests/fixtures/chat_templates): the one-pass mask against the per-prefix oracle.

Each fixture template is set on the embedded SmolLM2 tokenizer with its special tokens added. A
seeded generator builds conversations each template accepts (84 messages, system prompts where
legal, tool definitions, one and several tool calls, tool results, empty assistant content with tool
calls, reasoning on some turns, quoted special tokens) and the fast path must equal the oracle token
for token, sample for sample.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from eaglekit.chat import (
    ChatTemplateError,
    NotPrefixStableError,
    template_layout,
    tokenize_conversation,
    tokenize_conversation_reference,
)
from support import TOOLS, fixture_tokenizer  # noqa: E402  (shared test helpers, tests/support.py)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
META = json.loads((FIXTURES / "templates.json").read_text())
NAMES = sorted(META)
# DeepSeek-V3.1 thinks only with its `thinking` flag; reasoning turns need it on.
TEMPLATE_KWARGS = {"deepseek_v31": {"thinking": True}}
WORDS = "the tests fail on empty input so I will read the parser and patch the loop then rerun pytest".split()


@pytest.fixture(scope="module")
def tokenizers(embedded_model_dir):
    return {name: fixture_tokenizer(embedded_model_dir, name) for name in NAMES}


def text(rng: random.Random, low: int = 2, high: int = 12) -> str:
    return " ".join(rng.choices(WORDS, k=rng.randint(low, high)))


def conversation(
    name: str, rng: random.Random, messages: int, agent: bool = False
) -> tuple[list[dict], list | None]:
    """A conversation the template accepts: user, then tool-call rounds, then a final answer, repeated.

    agent: one user task, then tool-call rounds up to the length (the DeepSWE trajectory shape)."""
    supports = META[name]["supports"]
    tools = TOOLS if supports["tools"] and (agent or rng.random() < 0.8) else None
    several_calls = name != "llama3"  # Llama 3 renders one call per message
    out: list[dict] = []
    if supports["system"] and rng.random() < 0.7:
        out.append({"role": "system", "content": "You are a coding agent. " + text(rng)})
    call_number = 0
    while not out or out[-1]["role"] != "assistant" or len(out) < messages - 1:
        quote = " <|im_start|>assistant <|eot_id|> [INST]" if rng.random() < 0.2 else ""
        out.append({"role": "user", "content": text(rng) + quote})
        rounds = (messages if agent else rng.randint(0, 3)) if tools else 0
        for _ in range(rounds):
            if len(out) >= messages - 3:
                break
            calls = []
            for _ in range(rng.randint(2, 3) if several_calls and rng.random() < 0.3 else 1):
                call_number += 1
                function = rng.choice(TOOLS)["function"]["name"]
                argument = "cmd" if function == "bash" else "path"
                calls.append(
                    {
                        "id": f"call{call_number:05d}",
                        "type": "function",
                        "function": {"name": function, "arguments": {argument: text(rng, 1, 4)}},
                    }
                )
            turn = {
                "role": "assistant",
                "content": "" if rng.random() < 0.5 else text(rng),
                "tool_calls": calls,
            }
            if rng.random() < 0.5:
                turn["reasoning"] = text(rng, 5, 20)
            out.append(turn)
            for call in calls:
                out.append({"role": "tool", "content": text(rng, 3, 30), "tool_call_id": call["id"]})
        answer = {"role": "assistant", "content": text(rng)}
        if rng.random() < 0.5:
            answer["reasoning"] = text(rng, 5, 20)
        out.append(answer)
    return out, tools


@pytest.mark.parametrize("name", NAMES)
def test_fast_path_equals_per_prefix_oracle_on_generated_conversations(tokenizers, name):
    tokenizer = tokenizers[name]
    kwargs = TEMPLATE_KWARGS.get(name)
    rng = random.Random(f"eaglekit-{name}")
    lengths = [84, 84, 3, 9, 30]
    fallbacks = rejected = 0
    for number, length in enumerate(lengths):
        messages, tools = conversation(name, rng, length, agent=number == 1)
        try:
            oracle = tokenize_conversation_reference(tokenizer, messages, tools=tools, template_kwargs=kwargs)
        except ChatTemplateError:
            # The template itself cannot hold this conversation (DeepSeek-R1 renders a tool call that follows
            # tool output without the prompt it was generated after): both paths must say so.
            with pytest.raises(ChatTemplateError):
                tokenize_conversation(tokenizer, messages, tools=tools, template_kwargs=kwargs)
            rejected += 1
            continue
        fast = tokenize_conversation(tokenizer, messages, tools=tools, template_kwargs=kwargs)
        assert fast.samples == oracle.samples, f"{name}: {len(messages)} messages"
        assert fast.trained_tokens == oracle.trained_tokens and fast.trained_tokens > 0
        # A conversation with a turn that has no definition as generated (MiniMax-M2: no reasoning after its
        # `<think>` prompt; DeepSeek-R1: a tool call after tool output) keeps its other turns, and goes to
        # the oracle, which lists the turn in rejected_turns.
        assert fast.rejected_turns == oracle.rejected_turns
        fallbacks += fast.fallback and not fast.rejected_turns
        # The oracle checks every turn's trained tokens against its own per-prefix token difference;
        # only a BPE merge across the header's end may skip that (SmolLM2's tokenizer joins Llama 3's
        # "\n\n" after <|end_header_id|>, and "\n" + "\n" of an empty think block after the "<think>\n"
        # prompt of Qwen3 Thinking and DeepSeek-R1); no other template may.
        if name not in ("llama3", "qwen3_thinking", "deepseek_r1"):
            assert oracle.boundary_merges == 0
        if length == 84:
            continue
        # The truncated variant: the last answer's mask ends at its last generated token, no end-of-turn.
        cut = tokenize_conversation(tokenizer, messages, tools=tools, truncated=True, template_kwargs=kwargs)
        assert (
            cut.samples
            == tokenize_conversation_reference(
                tokenizer, messages, tools=tools, truncated=True, template_kwargs=kwargs
            ).samples
        )
        last = cut.samples[-1]
        if not any(index == len(messages) - 1 for index, _ in cut.rejected_turns):
            assert (
                last.loss_mask[-1] == 1
                and last.input_ids[-1] != template_layout(tokenizer, kwargs).end_of_turn_id
            )
    # MiniMax-M2: both paths refuse a conversation whose every turn lacks reasoning (none can be defined).
    assert rejected <= (len(lengths) - 1 if name in ("deepseek_r1", "minimax_m2") else 0)
    # No template hands these conversations to the oracle, Mistral with a system prompt and tools included
    # (its prompts are composed: chat.injected.injected_groups), except Hermes-3 tool_use: it writes the
    # last tool result's closing differently once a turn follows, so every turn after tool results opens a
    # sample whose prompt the fast path does not compose yet (the oracle's samples stand, counted).
    assert fallbacks == 0 or name == "hermes3_tool_use"


# Templates that rewrite history: the fast path composes each split sample from a history rendering
# and a small rendering of its own stretch (chat.split._Composer), so they get more conversations below.
SPLIT_TEMPLATES = ["deepseek_r1", "deepseek_v31", "kimi_k2_thinking", "qwen3", "qwen3_thinking"]


def fast_and_oracle(tokenizer, name: str, messages: list[dict], tools, truncated: bool = False):
    """(fast path, oracle) on one conversation, or None when the template cannot hold it
    (both paths say so)."""
    kwargs = TEMPLATE_KWARGS.get(name)
    try:
        oracle = tokenize_conversation_reference(
            tokenizer, messages, tools=tools, truncated=truncated, template_kwargs=kwargs
        )
    except ChatTemplateError:
        with pytest.raises(ChatTemplateError):
            tokenize_conversation(
                tokenizer, messages, tools=tools, truncated=truncated, template_kwargs=kwargs
            )
        return None
    return tokenize_conversation(
        tokenizer, messages, tools=tools, truncated=truncated, template_kwargs=kwargs
    ), oracle


@pytest.mark.parametrize("agent", [False, True], ids=["chat", "agent"])
@pytest.mark.parametrize("name", SPLIT_TEMPLATES)
def test_composed_split_samples_equal_the_oracle(tokenizers, name, agent):
    """More conversations for the templates that rewrite history, in both shapes: chat (short stretches,
    split at user messages and turns without reasoning) and agent (one long stretch of tool rounds, then
    a last user message: samples take their history from the stretch's own rendering), truncated too."""
    tokenizer = tokenizers[name]
    rng = random.Random(f"composed-{name}-{agent}")
    split = 0
    for number, length in enumerate([84, 84, 50, 50]):
        messages, tools = conversation(name, rng, length, agent=agent)
        pair = fast_and_oracle(tokenizer, name, messages, tools, truncated=number == 3)
        if pair is None:
            continue
        fast, oracle = pair
        assert fast.samples == oracle.samples, f"{name}: conversation {number}, {len(messages)} messages"
        assert (fast.trained_tokens, fast.generated_tokens) == (
            oracle.trained_tokens,
            oracle.generated_tokens,
        )
        assert not fast.fallback or fast.rejected_turns
        split += fast.split
    # DeepSeek-R1 cannot hold consecutive tool rounds (see above): both paths reject all of its agent
    # conversations and most of its chat ones. Every other case has split conversations.
    assert split >= (0 if (name, agent) == ("deepseek_r1", True) else 1)


def user_after_tools(name: str, seed: int) -> tuple[list[dict], list | None]:
    """A chat conversation whose answers between tool results and a user message are left out."""
    messages, tools = conversation(name, random.Random(f"hole-{seed}"), 40)
    return [
        message
        for number, message in enumerate(messages)
        if not (
            message["role"] == "assistant"
            and not message.get("tool_calls")
            and 0 < number < len(messages) - 1
            and messages[number - 1]["role"] == "tool"
            and messages[number + 1]["role"] == "user"
        )
    ], tools


@pytest.mark.parametrize("name", ["kimi_k2_thinking", "qwen3"])
def test_tool_call_turn_followed_by_a_user_message_equals_the_oracle(tokenizers, name):
    """A user message right after tool results (no answer between): Kimi thinking keeps the reasoning of
    the tool-call turn before it in later prompts (no answer follows it there) while the full rendering
    blanks it (an answer follows later). The composition must not take that turn from the full rendering
    (the fast path once did, silently)."""
    tokenizer = tokenizers[name]
    for seed in range(6):
        messages, tools = user_after_tools(name, seed)
        fast, oracle = fast_and_oracle(tokenizer, name, messages, tools)
        assert fast.samples == oracle.samples, f"{name}: conversation {seed}"


def test_template_that_shows_reasoning_before_a_user_message_does_not_keep_history(tokenizers, monkeypatch):
    """The probe `keeps_history` is what stops a group's prompt being read off the full rendering after
    an anchor with reasoning: Kimi thinking fails it; with its answer forced, the readings are wrong where
    a tool-call turn right before a user message has reasoning, and the oracle says so."""
    from eaglekit.chat import layout

    tokenizer = tokenizers["kimi_k2_thinking"]
    assert not template_layout(tokenizer).keeps_history and template_layout(tokenizers["qwen3"]).keeps_history
    monkeypatch.setattr(layout, "_LAYOUT_CACHE", {})
    monkeypatch.setattr(layout, "_keeps_history", lambda *arguments: True)
    differing = 0
    for seed in range(6):
        messages, tools = user_after_tools("kimi_k2_thinking", seed)
        fast, oracle = fast_and_oracle(tokenizer, "kimi_k2_thinking", messages, tools)
        differing += fast.samples != oracle.samples
    assert differing > 0


def test_property_check_catches_a_fast_path_that_takes_history_as_final(tokenizers, monkeypatch):
    """The comparison has teeth where the composition's assumption matters. A fast path that takes a
    split sample's history from the full rendering up to the previous sample's end (Qwen3 drops the
    reasoning of a stretch there, which the stretch's own samples still show) passes the fast path's
    own checks, and the oracle comparison must catch it."""
    from eaglekit.chat import split

    monkeypatch.setattr(
        split._Composer,
        "_anchor",
        lambda self, first: None if first == 0 else (first - 1, len(self.indices) - 1),
    )
    tokenizer = tokenizers["qwen3"]
    differing = 0
    for seed in (3, 4, 6, 8):  # conversations with tool rounds inside chat stretches
        messages, tools = conversation("qwen3", random.Random(f"naive-{seed}"), 30)
        fast, oracle = fast_and_oracle(tokenizer, "qwen3", messages, tools)
        differing += fast.samples != oracle.samples
    assert differing > 0


def test_property_check_catches_prompts_read_off_the_full_rendering(tokenizers, monkeypatch):
    """Split groups read their last turn's prompt off a rendering they already have: the history
    rendering for a turn right after its anchor, else within tool rounds the stretch's
    (chat.split._Composer._read_after_anchor). A reading taken off the full rendering across earlier turns of
    the stretch (which it shows without their reasoning, as Qwen3 writes them once a later user message
    follows) passes the fast path's own checks, and the oracle comparison must catch it."""
    from eaglekit.chat import split

    def read_off_full(self, anchor_position, last, anchor_text, source_end):
        text, turns = self.sources[len(self.indices) - 1]
        if last == self.stretch_end[last]:
            return None
        return text[turns[anchor_position][1] : turns[last][0]] + self.generated[last].header

    monkeypatch.setattr(split._Composer, "_read_after_anchor", read_off_full)
    tokenizer = tokenizers["qwen3"]
    differing = 0
    for seed in range(4):
        messages, tools = conversation("qwen3", random.Random(f"reading-{seed}"), 40)
        fast, oracle = fast_and_oracle(tokenizer, "qwen3", messages, tools)
        differing += fast.samples != oracle.samples
    assert differing > 0


def test_template_that_rewrites_earlier_tool_rounds_is_not_read(embedded_model_dir, monkeypatch):
    """Reading prompts off a stretch's rendering relies on the template's probe (`reads_tool_rounds`). A
    Qwen3 variant that drops a turn's reasoning once two more assistant turns follow it renders a tool
    round differently as more rounds follow: the probe says so, the fast path renders each group's prompt
    and equals the oracle; with the probe's answer forced, the readings are wrong and the oracle says so."""
    from eaglekit.chat import layout

    tokenizer = fixture_tokenizer(embedded_model_dir, "qwen3")
    condition = "{%- if loop.index0 > ns.last_query_index %}"
    assert condition in tokenizer.chat_template
    tokenizer.chat_template = tokenizer.chat_template.replace(
        condition,
        (
            "{%- set here = loop.index0 %}{%- set later = namespace(count=0) %}"
            "{%- for other in messages[here + 1:] %}"
            '{%- if other.role == "assistant" %}{%- set later.count = later.count + 1 %}'
            "{%- endif %}{%- endfor %}"
            "{%- if here > ns.last_query_index and later.count < 2 %}"
        ),
        1,
    )
    conversations = [conversation("qwen3", random.Random(f"recent-{seed}"), 40) for seed in (0, 2, 4)]
    assert not template_layout(tokenizer).reads_tool_rounds and template_layout(tokenizer).tools_in_preamble
    for messages, tools in conversations:
        fast, oracle = fast_and_oracle(tokenizer, "qwen3", messages, tools)
        assert fast.samples == oracle.samples and not fast.fallback and fast.split
    monkeypatch.setattr(layout, "_LAYOUT_CACHE", {})
    monkeypatch.setattr(layout, "_reads_tool_rounds", lambda *arguments: True)
    assert template_layout(tokenizer).reads_tool_rounds
    differing = sum(
        pair[0].samples != pair[1].samples
        for pair in (
            fast_and_oracle(tokenizer, "qwen3", messages, tools) for messages, tools in conversations
        )
    )
    assert differing > 0


def mistral_conversation(
    rng: random.Random, length: int, agent: bool, system: bool, tools: bool
) -> tuple[list[dict], list | None]:
    """A Mistral conversation with or without a system prompt (legal only first) and tool definitions."""
    messages, _ = conversation("mistral", rng, length, agent=agent)
    messages = [message for message in messages if message["role"] != "system"]
    if system:
        messages.insert(0, {"role": "system", "content": "You are a coding agent. " + text(rng)})
    return messages, TOOLS if tools else None


@pytest.mark.parametrize("agent", [False, True], ids=["chat", "agent"])
def test_mistral_composed_prompts_equal_the_oracle(tokenizers, agent):
    """Mistral writes the tool definitions before the last user message and the system prompt into it
    while it is the last message, so the oracle cuts at every user message (tools) and after the first
    turn of each stretch (system prompt). The fast path composes every turn's prompt
    (chat.injected.injected_groups); with and without each, truncated too, it must equal the oracle, never
    handing the conversation over."""
    tokenizer = tokenizers["mistral"]
    rng = random.Random(f"mistral-{agent}")
    split = 0
    for number, (length, system, tools) in enumerate(
        [(60, True, True), (40, True, False), (30, False, True), (30, True, True)]
    ):
        messages, tool_list = mistral_conversation(rng, length, agent, system, tools)
        fast, oracle = fast_and_oracle(tokenizer, "mistral", messages, tool_list, truncated=number == 3)
        assert fast.samples == oracle.samples, f"conversation {number}: {len(messages)} messages"
        assert (fast.trained_tokens, fast.generated_tokens) == (
            oracle.trained_tokens,
            oracle.generated_tokens,
        )
        assert not fast.fallback
        split += fast.split
    assert split >= 3


def test_mistral_composition_without_the_system_prompt_is_caught_by_the_real_checks(tokenizers, monkeypatch):
    """A composition that leaves the system prompt out of every small rendering (so no composed prompt
    shows it) is caught by the fast path's own check against the last turn's prompt rendered whole: the
    conversation goes to the oracle, and the samples stay the oracle's."""
    from eaglekit.chat import injected

    tokenizer = tokenizers["mistral"]
    messages, tools = mistral_conversation(random.Random("mistral-system"), 30, False, True, False)
    fast, oracle = fast_and_oracle(tokenizer, "mistral", messages, tools)
    assert fast.samples == oracle.samples and not fast.fallback and fast.split
    original = injected._stretch_prefix
    monkeypatch.setattr(
        injected, "_stretch_prefix", lambda messages, system, anchor: original(messages, [], anchor)
    )
    fast, oracle = fast_and_oracle(tokenizer, "mistral", messages, tools)
    assert fast.fallback and fast.samples == oracle.samples


def test_mistral_stretch_first_prompt_read_off_the_stretch_is_checked(tokenizers, monkeypatch):
    """A stretch's first prompt (its user message last: Mistral shows the system prompt there) is read off
    the stretch's rendering with the system prompt inserted as probed (chat.injected._system_insertion:
    Mistral's "[INST]" + system + "\\n\\n" + content + "[/INST]"; Qwen3 has no such reading). A wrong
    separator is caught by the real check of the sample before the last where that is the last stretch's first
    turn (the conversation goes to the oracle, and the samples stay the oracle's); the real checks do not
    reach an earlier stretch's, and there the oracle comparison says the samples differ."""
    from eaglekit.chat import injected, turns
    from eaglekit.chat.render import Renderer

    def insertion(name: str) -> tuple[str, str] | None:
        tokenizer = tokenizers[name]
        layout = template_layout(tokenizer, TEMPLATE_KWARGS.get(name))
        return injected._system_insertion(Renderer(tokenizer, layout, TOOLS, TEMPLATE_KWARGS.get(name) or {}))

    assert insertion("mistral") == ("\n\n", "[/INST]")
    assert insertion("qwen3") is None
    tokenizer = tokenizers["mistral"]
    # Seed "a": the last stretch has several turns; "b": one (its first prompt is rendered, as ever).
    conversations = [mistral_conversation(random.Random(seed), 30, False, True, True) for seed in ("a", "b")]
    for messages, tools in conversations:
        fast, oracle = fast_and_oracle(tokenizer, "mistral", messages, tools)
        assert fast.samples == oracle.samples and not fast.fallback and fast.split
    monkeypatch.setattr(turns, "_SHAPE_CACHE", {})
    monkeypatch.setattr(injected, "_system_insertion", lambda renderer: ("\n", "[/INST]"))
    fast, oracle = fast_and_oracle(tokenizer, "mistral", *conversations[0])
    assert fast.fallback and fast.samples == oracle.samples
    fast, oracle = fast_and_oracle(tokenizer, "mistral", *conversations[1])
    assert not fast.fallback and fast.samples != oracle.samples


def test_mistral_equal_user_messages_go_to_the_oracle(tokenizers, monkeypatch):
    """Mistral finds the last user message by equality, so an earlier user message equal to it gets the
    tool definitions too. The composition does not show that and the real checks (last two samples) do
    not reach an early stretch: such conversations go to the oracle. Without that guard the fast path is
    wrong, and the oracle comparison says so."""
    from eaglekit.chat import injected

    tokenizer = tokenizers["mistral"]
    messages, tools = mistral_conversation(random.Random("mistral-equal"), 40, False, True, True)
    users = [index for index, message in enumerate(messages) if message["role"] == "user"]
    assert len(users) >= 5
    messages[users[1]] = dict(messages[users[0]])  # the second stretch's prompt has the tools twice
    fast, oracle = fast_and_oracle(tokenizer, "mistral", messages, tools)
    assert fast.fallback and fast.samples == oracle.samples
    monkeypatch.setattr(injected, "_users_distinct", lambda messages, users: True)
    fast, oracle = fast_and_oracle(tokenizer, "mistral", messages, tools)
    assert not fast.fallback and fast.samples != oracle.samples


@pytest.mark.parametrize("name", NAMES)
def test_split_trains_every_generated_turn_exactly_once(tokenizers, name):
    """Every assistant turn's text as generated appears masked in exactly one sample, in order."""
    tokenizer = tokenizers[name]
    kwargs = TEMPLATE_KWARGS.get(name)
    for seed in range(20):  # DeepSeek-R1 cannot hold some tool rounds (see above): take one it can
        messages, tools = conversation(name, random.Random(f"once-{name}-{seed}"), 30)
        try:
            result = tokenize_conversation(tokenizer, messages, tools=tools, template_kwargs=kwargs)
            break
        except ChatTemplateError:
            continue
    masked = "".join(
        tokenizer.decode([t for t, m in zip(s.input_ids, s.loss_mask) if m]) for s in result.samples
    )
    rejected = {index for index, _ in result.rejected_turns}
    for index, message in enumerate(messages):
        if message["role"] == "assistant" and index not in rejected:
            # Llama 3 writes a tool-call turn as the call alone (its model generates no text beside it).
            # Llama 3 and Mistral write a tool-call turn as the call alone, dropping content and folded
            # reasoning (a known limit, see README): its model generates no text beside a call.
            # Hermes-3 tool_use writes it as the calls alone too.
            piece = (
                ""
                if name in ("llama3", "mistral", "hermes3_tool_use") and message.get("tool_calls")
                else message.get("reasoning") or message["content"]
            )
            if piece:
                assert masked.count(piece) >= 1, (name, piece)
    # Nothing the user, system or tools wrote is ever trained.
    for message in messages:
        if message["role"] in ("user", "tool") and len(message["content"]) > 40:
            assert message["content"] not in masked
    assert abs(result.trained_tokens - result.generated_tokens) <= len(result.samples) * 2 + 4


def test_history_rewriting_templates_split_and_visible_counts(tokenizers):
    tokenizer = tokenizers["qwen3"]
    messages = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning": "EARLIER two plus two"},
        {"role": "user", "content": "3+3?"},
        {"role": "assistant", "content": "6", "reasoning": "LATER three plus three"},
    ]
    split = tokenize_conversation(tokenizer, messages)
    assert len(split.samples) == 2  # Qwen3 drops the first turn's reasoning once a user speaks again
    first = tokenizer.decode([t for t, m in zip(split.samples[0].input_ids, split.samples[0].loss_mask) if m])
    assert first == "<think>\nEARLIER two plus two\n</think>\n\n4<|im_end|>"
    visible = tokenize_conversation(tokenizer, messages, history="visible")
    assert len(visible.samples) == 1
    shown = tokenizer.decode(
        [t for t, m in zip(visible.samples[0].input_ids, visible.samples[0].loss_mask) if m]
    )
    assert "EARLIER" not in shown and shown.startswith("4<|im_end|>") and "LATER three plus three" in shown
    assert visible.trained_tokens < visible.generated_tokens == split.generated_tokens
    with pytest.raises(ValueError, match="history"):
        tokenize_conversation(tokenizer, messages, history="drop")


@pytest.mark.parametrize("name", ["smollm2", "qwen3", "llama3", "kimi_k2_thinking"])
def test_quoted_special_tokens_are_text(tokenizers, name):
    tokenizer = tokenizers[name]
    quoted = "Explain <|im_start|>assistant and <|eot_id|> and <|im_end|> please"
    messages = [
        {"role": "user", "content": quoted},
        {"role": "assistant", "content": "They are control tokens."},
    ]
    sample = tokenize_conversation(tokenizer, messages).samples[0]
    plain = tokenize_conversation(
        tokenizer, [{"role": "user", "content": "Explain please"}, messages[1]]
    ).samples[0]
    special_ids = set(tokenizer.all_special_ids)
    # The quote adds only text tokens: the count of control tokens is the template's own.
    assert sum(t in special_ids for t in sample.input_ids) == sum(t in special_ids for t in plain.input_ids)
    assert quoted in tokenizer.decode(sample.input_ids)
    assert sum(sample.loss_mask) == sum(plain.loss_mask)


def test_template_without_tool_syntax_keeps_calls_as_text(tokenizers):
    tokenizer = tokenizers["smollm2"]
    assert template_layout(tokenizer).tool_calls == "hermes-text"
    messages = [
        {"role": "user", "content": "List files"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call00001",
                    "type": "function",
                    "function": {"name": "bash", "arguments": {"cmd": "ls"}},
                }
            ],
        },
    ]
    sample = tokenize_conversation(tokenizer, messages).samples[0]
    masked = tokenizer.decode([t for t, m in zip(sample.input_ids, sample.loss_mask) if m])
    assert masked == '<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls"}}\n</tool_call><|im_end|>'


def test_template_that_cannot_render_a_conversation_raises_chat_template_error(tokenizers):
    with pytest.raises(ChatTemplateError, match="System role not supported"):
        tokenize_conversation(
            tokenizers["gemma"],
            [
                {"role": "system", "content": "x"},
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": "b"},
            ],
        )
    with pytest.raises(
        ChatTemplateError, match="thinking"
    ):  # V3.1 with thinking off has no place for reasoning
        tokenize_conversation(
            tokenizers["deepseek_v31"],
            [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "reasoning": "r"}],
        )


@pytest.mark.parametrize("name", NAMES)
def test_visible_policy_is_one_sequence_that_trains_only_assistant_text(tokenizers, name):
    tokenizer = tokenizers[name]
    kwargs = TEMPLATE_KWARGS.get(name)
    for seed in range(20):
        messages, tools = conversation(name, random.Random(f"visible-{name}-{seed}"), 30, agent=seed % 2 == 1)
        try:
            split = tokenize_conversation(tokenizer, messages, tools=tools, template_kwargs=kwargs)
        except ChatTemplateError:
            continue
        try:
            visible = tokenize_conversation(
                tokenizer, messages, tools=tools, history="visible", template_kwargs=kwargs
            )
        except NotPrefixStableError:
            # The oracle's "visible" is defined only for conversations the template does not rewrite, and the
            # fast path hands it those with a turn it cannot define (rejected_turns) and Hermes-3 tool_use's
            # (it rewrites the last tool result's closing once a turn follows it).
            if split.rejected_turns or name == "hermes3_tool_use":
                continue
            raise
        assert len(visible.samples) == 1
        assert visible.trained_tokens <= visible.generated_tokens == split.generated_tokens
        if len(split.samples) == 1:  # nothing rewritten: both policies are the same sample
            assert visible.samples == split.samples
        sample = visible.samples[0]
        masked = tokenizer.decode([t for t, m in zip(sample.input_ids, sample.loss_mask) if m])
        for message in messages:
            if message["role"] in ("user", "tool", "system") and len(message["content"]) > 40:
                assert message["content"] not in masked
        # Every turn ends in its end-of-turn token (GLM-4.6: the role token that closes it, `<|user|>` or
        # `<|observation|>`).
        closers = template_layout(tokenizer, kwargs, tools).closers
        assert sum(masked.count(closer) for closer in closers) == sum(
            message["role"] == "assistant" for message in messages
        ) - len(visible.rejected_turns)
        break
    else:
        if name != "hermes3_tool_use":  # every generated conversation of it has tool results
            pytest.fail(f"{name}: no conversation of 20 could be checked")


def test_shape_cache_is_bounded_when_every_record_has_its_own_tools(tokenizers, monkeypatch):
    """What a context's shape tells is kept per tool list (chat.turns._SHAPE_CACHE); records with distinct
    tool lists (Glaive gives each its own) must not grow it without bound, and the samples
    stay the oracle's."""
    from eaglekit.chat import turns

    monkeypatch.setattr(turns, "_SHAPE_CACHE", {})
    monkeypatch.setattr(turns, "_SHAPE_CACHE_SIZE", 3)
    tokenizer = tokenizers["llama3"]  # tools inside the first user message: small renders keep them
    messages, _ = conversation("llama3", random.Random("bounded"), 9)
    for number in range(5):
        tools = [
            {**TOOLS[0], "function": {**TOOLS[0]["function"], "description": f"Run a shell command {number}"}}
        ]
        fast, oracle = fast_and_oracle(tokenizer, "llama3", messages, tools)
        assert fast.samples == oracle.samples
    assert len(turns._SHAPE_CACHE) == 3


def test_template_whose_rendering_does_not_extend_the_last_prompt_renders_it(tokenizers, monkeypatch):
    """The last turn's prompt is read off the conversation's rendering only where the probe
    `extends_prompt` says that rendering extends it: Kimi thinking fails it (once the last turn is an
    answer it blanks the reasoning of the tool rounds before it, which the prompt shows). With its answer
    forced, the last samples are wrong and the oracle says so."""
    from eaglekit.chat import layout

    tokenizer = tokenizers["kimi_k2_thinking"]
    assert (
        not template_layout(tokenizer).extends_prompt and template_layout(tokenizers["qwen3"]).extends_prompt
    )
    monkeypatch.setattr(layout, "_LAYOUT_CACHE", {})
    monkeypatch.setattr(layout, "_extends_prompt", lambda *arguments: True)
    differing = 0
    for seed in range(8):  # one of them ends in tool rounds with reasoning, then an answer
        messages, tools = conversation("kimi_k2_thinking", random.Random(f"extends-{seed}"), 40)
        fast, oracle = fast_and_oracle(tokenizer, "kimi_k2_thinking", messages, tools)
        differing += fast.samples != oracle.samples
    assert differing > 0


def with_late_system(name: str, seed: int) -> tuple[list[dict], list | None]:
    """A chat conversation with system messages inserted before user messages after its first turn."""
    rng = random.Random(f"late-system-{name}-{seed}")
    messages, tools = conversation(name, rng, 30)
    first = next(index for index, message in enumerate(messages) if message["role"] == "assistant")
    users = [index for index, message in enumerate(messages) if message["role"] == "user" and index > first]
    for index in sorted(rng.sample(users, min(len(users), 2)), reverse=True):
        messages.insert(index, {"role": "system", "content": "Later system prompt. " + text(rng)})
    return messages, tools


@pytest.mark.parametrize("name", NAMES)
def test_fast_path_equals_the_oracle_with_system_messages_anywhere(tokenizers, name):
    """System messages after the first turn: DeepSeek-V3.1 gathers every system message into the
    prompt's beginning, so the prompt of a turn before one lacks it, and the full rendering is no prompt the
    server sent (the fast path once trained turn 1 under it, silently). Both paths agree on every template
    (or both refuse the conversation: Gemma has no system role, Mistral takes one only first)."""
    tokenizer = tokenizers[name]
    checked = 0
    for seed in range(3):
        messages, tools = with_late_system(name, seed)
        pair = fast_and_oracle(tokenizer, name, messages, tools)
        if pair is None:
            continue
        fast, oracle = pair
        assert fast.samples == oracle.samples, f"{name}: conversation {seed}"
        assert fast.rejected_turns == oracle.rejected_turns
        checked += 1
    assert checked or name in ("gemma", "mistral")


def test_deepseek_v31_turn_before_a_late_system_message_is_trained_without_it(tokenizers):
    tokenizer = tokenizers["deepseek_v31"]
    messages = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "3+3?"},
        {"role": "assistant", "content": "Six."},
    ]
    fast = tokenize_conversation(tokenizer, messages)
    assert fast.samples == tokenize_conversation_reference(tokenizer, messages).samples
    first = tokenizer.decode(fast.samples[0].input_ids)
    assert "Answer in French." not in first and first.endswith("4.<｜end▁of▁sentence｜>")
