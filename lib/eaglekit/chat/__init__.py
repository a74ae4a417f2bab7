"""Chat tokenization with a loss mask: the target's own chat template, in time linear in the conversation.

What is trained (the oracle, `tokenize_conversation_reference`): for assistant turn i, render the
prompt P_i = messages[:i] with the generation prompt and the turn F_i = messages[:i+1]; the turn's
span is F_i[len(P_i):] up to and including the template's first end-of-turn token. That span is what
the target generated after the server sent it P_i: reasoning (with the `<think>` wrapper the template
writes), content, tool calls and the end-of-turn token. Everything else is context (mask 0). The
oracle also tokenizes P_i and F_i and checks each turn's trained tokens against their token
difference (see its docstring for the one exception, a BPE merge across the boundary).

Where a template's F_i does not extend P_i (Mistral drops the system prompt once the conversation ends
in an assistant turn; Kimi thinking blanks earlier tool-call reasoning once a final answer follows;
DeepSeek-R1 writes a tool call after tool output under another header), F_i is P_i followed by the
turn as the template writes it in a small context (a probe user turn, plus the call and results the
turn answers): the prompt the server sent, then what the target generated.

Templates that rewrite history (Qwen3, Kimi thinking and DeepSeek drop or blank the reasoning of
earlier turns; Qwen3 also drops the empty `<think></think>` of a turn once it is no longer last;
Mistral moves the system prompt and tools to the last user turn) make P_{i+1} stop extending F_i.
No single sequence then holds every turn as the target produced it. `history="split"` (the default)
cuts the conversation there: a sample ends at each such turn and holds the history as the template
renders it plus the turns since the previous cut, each exactly as generated; every generated token
is trained exactly once, in the context the server gave it. `history="visible"` keeps one sequence
(the whole conversation as the template renders it) and masks only what the template shows of each
turn; `ConversationSamples.generated_tokens - trained_tokens` counts what it does not train.

The fast path (`tokenize_conversation`) is linear in the conversation where the oracle is quadratic.
It learns each turn's span as generated from the small render above, renders the whole conversation
once and finds `header + span` in it left to right. Where that rendering does not show every turn as
generated (the template rewrites history), each split sample is composed rather than rendered
(`_Composer`): a history rendering up to an anchor turn (the full rendering, or for a long stretch of
tool rounds the stretch's own), then the rest rendered in a small context, or read off a rendering
already made where probes of the template say it reads the same there (one small rendering per stretch
of tool rounds; the history rendering for a turn right after its anchor); group ends are confirmed
with the oracle's own criterion on the composed texts; samples reuse the tokens of the sample before
them or of the history rendering, whichever they share more text with (for tokenizers that split
text at control tokens first, as byte-level BPE does). Each conversation gets real checks (the last sample is the full rendering, the one before it
its prompt rendered whole); where a check or a search fails, each sample is rendered whole. A
template that moves text it wrote earlier (Mistral: the tools before the last user message, the
system prompt inside it while it is the last message) changes earlier turns' context where no span
shows it: there every turn's prompt is composed (`_injected_groups`: the history before its last user
message from the full rendering, the rest from one small rendering per stretch, with the system
prompt and tools) and samples are cut with the oracle's own criterion on the composed texts, checked
against the last turn's prompt and the sample before the last rendered whole. Where a check fails, or
two user messages are equal (Mistral finds the last one by equality), the conversation goes to the
oracle, counted in `ConversationSamples.fallback`. tests/test_templates.py
checks both paths agree token for token, sample for sample, on every published template in
tests/fixtures/chat_templates; bench/tokenize_mask.py measures the speed ratio.

Spans are character spans of the rendered text; a token is trained when its first character lies in
a span.

Special-token text inside messages (a user quoting `<|im_start|>assistant`) is text, never a control
token: before rendering, every control token inside message strings, tool calls and tool definitions
is replaced by one private-use character; the template's own control tokens are then the only ones
in the rendering, and each replaced token is tokenized as plain text.

Reasoning (`reasoning` in the kit's schema) is placed where the target's template puts it, probed
once per template (`TemplateLayout.reasoning`): "field" templates render `reasoning_content` on
every last turn (Qwen3); "fold" templates render content verbatim and get
`<think>\\n{reasoning}\\n</think>\\n\\n{content}` (ChatML, Llama: the text such a model generated before a
server's reasoning parser split it off); "splice" templates drop it on some last turns: Kimi thinking's
blank `<think></think>` is filled, and after a generation prompt that opens `<think>` (DeepSeek-R1,
V3.1 with `thinking`) the turn is written as generated: `{reasoning}\\n</think>\\n\\n` (or
`{reasoning}</think>`), then the rest of the turn as the template writes it.

Tool calls stay structured (OpenAI shape: `tool_calls` of `{"id", "type": "function", "function":
{"name", "arguments"}}`, `tool_call_id` on tool results) and are rendered only by the template, with
`tools=` the record's tool definitions. Arguments go to the template as an object, or as a JSON string
for templates that concatenate them (DeepSeek), probed once. A template with no tool-call syntax
(SmolLM2, Phi-3.5, Gemma) gets the calls as Hermes `<tool_call>` text in the content, so they are
trained rather than silently dropped.
"""

from __future__ import annotations

import bisect
import html
import itertools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

HistoryPolicy = Literal["split", "visible"]
HISTORY_POLICIES = ("split", "visible")

# Probe strings: plain ASCII words no template transforms and no tokenizer merges with neighbours.
_PROBE_USER = "EAGLEKITPROBEUSER"
_PROBE_ASSISTANT = "EAGLEKITPROBEASSISTANT"
_PROBE_REASONING = "EAGLEKITPROBEREASONING"
_PROBE_TOOL = "EAGLEKITPROBETOOL"
_PROBE_CALL_ID = "call00001"  # 9 alphanumerics: Mistral's templates insist
# One private-use character stands for each control token quoted inside a message (see module doc).
_MARK_BASE = 0xF3000
_MARK_RANGE = re.compile("[\U000F3000-\U000F3FFF]")


class ChatTemplateError(ValueError):
    """The chat template cannot render or mask this conversation (says why and what to do)."""


class NotPrefixStableError(ChatTemplateError):
    """A turn's rendering does not extend the rendering of its prompt (the template rewrites it)."""


@dataclass(frozen=True)
class TokenizedConversation:
    input_ids: list[int]  # (T,)
    loss_mask: list[int]  # (T,) 1 on tokens the target generated, 0 elsewhere


@dataclass(frozen=True)
class ConversationSamples:
    """The training samples of one conversation and what they keep of what the target generated."""

    samples: list[TokenizedConversation]
    generated_tokens: int  # tokens of every assistant turn as the target generated it
    trained_tokens: int  # tokens with loss_mask 1 over all samples
    fallback: bool = False  # the fast path handed this conversation to the oracle
    boundary_merges: int = 0  # oracle only: turns whose prompt tokens are not a token prefix of the turn's

    @property
    def split(self) -> bool:
        return len(self.samples) > 1


@dataclass(frozen=True)
class TemplateLayout:
    """What probing a chat template reveals; computed once per tokenizer, template and kwargs."""

    end_of_turn: str  # the control token closing an assistant turn, e.g. "<|im_end|>"
    end_of_turn_id: int
    reasoning: Literal["field", "fold", "splice"]
    tool_arguments: Literal["object", "string"]  # how the template wants `function.arguments`
    tool_calls: Literal["template", "hermes-text"]  # hermes-text: the template renders no tool calls
    # Whether a prompt's rendering stays a prefix when the conversation goes on, with a system prompt
    # and with tool definitions (Mistral moves both to the last user turn): where not, the fast path
    # hands such conversations to the oracle.
    stable_with_system: bool
    stable_with_tools: bool
    control_tokens: tuple[str, ...]  # longest first: what is text when it appears inside a message
    family: str
    # Whether tokenizing text in pieces cut before a control token gives the same tokens as a whole
    # (byte-level BPE: yes; SentencePiece with a prefix space: no). Split samples then reuse the tokens
    # of the text they share with the previous sample.
    splits_at_control_tokens: bool = False
    # Whether tool definitions only add text before the first message (Qwen3's system block, Kimi's
    # tool_declare), never inside or after a turn (Llama 3's first user turn, Mistral's last): small
    # renderings whose beginning is discarded (a turn as generated, a split group's stretch) then leave
    # them out, which makes them several times cheaper.
    tools_in_preamble: bool = False
    # Whether tool definitions only add one block of text before the last user message's content
    # (Mistral): small renderings that start with a probe user turn and keep only what follows it
    # (each turn as generated) then leave them out too.
    tools_before_last_user: bool = False
    # Whether, inside a stretch of tool rounds, a turn's prompt is a later turn's prompt up to the turn's
    # header (no message renders differently for the tool rounds after it; probed with reasoning on some
    # rounds and several calls on one): split groups then read their prompts off one rendering per stretch.
    reads_tool_rounds: bool = False
    # Whether a turn with reasoning that a user message follows renders in every later prompt as in the
    # first one that holds it (so in the full rendering as in the prompt of the turn after it).
    keeps_history: bool = False
    # Whether a conversation's rendering up to its last turn extends that turn's prompt (its think opener
    # left out), with earlier stretches and tool rounds with reasoning before it (Kimi thinking blanks
    # them once the last turn is an answer): the prompt is then read off that rendering.
    extends_prompt: bool = False


@dataclass
class _Rendered:
    """A marked rendering and the character spans [start, end) of the assistant turns it trains."""

    text: str
    spans: list[tuple[int, int]] = field(default_factory=list)
    history: str | None = None  # a rendering this one shares its beginning with (split samples)


_LAYOUT_CACHE: dict[tuple[int, int, str, str], TemplateLayout] = {}
# What a small context's shape tells about the turns after it (see _generated_bodies), per tokenizer,
# template, kwargs and tool list: found on the first conversation that has the shape, kept for the next.
# Bounded: a dataset may give every record its own tool list (the oldest entry goes first).
_SHAPE_CACHE: dict[tuple, "_ShapeFacts"] = {}
_UNPROBED = object()  # a fact not probed yet (None is a probed "no")
_SHAPE_CACHE_SIZE = 64
# A split group whose stretch (messages since the user message before it) is longer than this takes its
# history from its stretch's own rendering rather than from the full one (see _Composer).
_SHORT_STRETCH = 16
# Split groups: candidate ends tried one by one (each confirmed as a cut or not) before galloping.
_WALKED_ENDS = 3


# ---------------------------------------------------------------------------------------------
# Template access


def _chat_template_text(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise ChatTemplateError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has no chat template: "
            "set tokenizer.chat_template (the target's own template) before tokenizing conversations"
        )
    if not isinstance(template, str):
        raise ChatTemplateError("tokenizer has several named chat templates; set tokenizer.chat_template to one string")
    return template


def _render(tokenizer: Any, messages: list[dict], add_generation_prompt: bool, tools: list | None,
            template_kwargs: dict) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             tools=tools or None, **template_kwargs)
    except ChatTemplateError:
        raise
    except Exception as error:  # jinja's TemplateError, raise_exception(), a TypeError inside the template
        raise ChatTemplateError(f"the chat template cannot render this conversation: {type(error).__name__}: "
                                f"{error}") from None


def _control_tokens(tokenizer: Any, template: str) -> tuple[str, ...]:
    """Special added tokens, plus non-special added tokens the template writes itself (as transformers does)."""
    tokens = []
    for token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        content = token.content
        if content and not content.isspace() and (token.special or content in template):
            tokens.append(content)
    return tuple(sorted(set(tokens), key=len, reverse=True))


def template_layout(tokenizer: Any, template_kwargs: dict | None = None) -> TemplateLayout:
    """Probe the chat template once: end-of-turn token, where reasoning goes, tool-argument form, family."""
    template = _chat_template_text(tokenizer)
    template_kwargs = dict(template_kwargs or {})
    # len(tokenizer) counts added tokens: a tokenizer given more special tokens is probed again.
    key = (id(tokenizer), len(tokenizer), template, json.dumps(template_kwargs, sort_keys=True, default=str))
    cached = _LAYOUT_CACHE.get(key)
    if cached is not None:
        return cached
    control_tokens = _control_tokens(tokenizer, template)
    user = [{"role": "user", "content": _PROBE_USER}]
    assistant = {"role": "assistant", "content": _PROBE_ASSISTANT}
    prompt = _render(tokenizer, user, True, None, template_kwargs)
    turn = _render(tokenizer, user + [assistant], False, None, template_kwargs)
    at = turn.find(_PROBE_ASSISTANT)
    if at < 0:
        raise ChatTemplateError("chat template: an assistant turn's content does not appear in its rendering")
    closing = turn[at + len(_PROBE_ASSISTANT):]
    end_of_turn = next((token for token in _tokens_in(closing, control_tokens)), "")
    if not end_of_turn:
        raise ChatTemplateError(
            f"chat template closes an assistant turn with {closing!r}, which holds no control token: the "
            "end-of-turn token cannot be located; use the target's own template (with its special tokens added)"
        )
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": _PROBE_CALL_ID, "type": "function", "function": {"name": "probe", "arguments": {"x": _PROBE_TOOL}}}]}
    tool_arguments = "object"
    try:
        _render(tokenizer, user + [call], False, None, template_kwargs)
    except ChatTemplateError:
        tool_arguments = "string"
        call["tool_calls"][0]["function"]["arguments"] = json.dumps({"x": _PROBE_TOOL})
    tool_calls = "template" if _PROBE_TOOL in _render(tokenizer, user + [call], False, None, template_kwargs) \
        else "hermes-text"
    reasoning_turns = [{**assistant, "reasoning_content": _PROBE_REASONING},
                       {**call, "reasoning_content": _PROBE_REASONING}]
    shown = all(_PROBE_REASONING in _render(tokenizer, user + [message], False, None, template_kwargs)
                for message in reasoning_turns)
    folded = _render(tokenizer, user + [{"role": "assistant", "content": _fold(_PROBE_REASONING, _PROBE_ASSISTANT)}],
                     False, None, template_kwargs)
    if shown:
        reasoning = "field"
    elif (turn.startswith(prompt) and not turn[len(prompt):].startswith("<think>") and folded.startswith(prompt)
          and _fold(_PROBE_REASONING, _PROBE_ASSISTANT) in folded):
        reasoning = "fold"  # content is written verbatim: the reasoning goes where the model wrote it
    else:
        reasoning = "splice"  # the template writes its own think block or cuts reasoning: place it ourselves
    probe_tools = [{"type": "function", "function": {"name": "probe", "description": _PROBE_TOOL,
                                                      "parameters": {"type": "object", "properties": {}}}}]
    two_turns = [*user, assistant, {"role": "user", "content": _PROBE_USER + "2"}]

    def stable(messages: list[dict], tools: list | None) -> bool:
        try:
            first = _render(tokenizer, messages[:-2], True, tools, template_kwargs)
            later = _render(tokenizer, messages, True, tools, template_kwargs)
        except ChatTemplateError:
            return False
        return later.startswith(_context_header(first))

    def with_and_without_tools(messages: list[dict], generation_prompt: bool) -> tuple[list[dict], str, str] | None:
        try:
            return (messages, _render(tokenizer, messages, generation_prompt, probe_tools, template_kwargs),
                    _render(tokenizer, messages, generation_prompt, None, template_kwargs))
        except ChatTemplateError:
            return None

    def preamble_only(with_tools: str, without: str) -> bool:
        return with_tools.endswith(without)  # equal where the template ignores tools (DeepSeek)

    def inserted_before_last_user(messages: list[dict], with_tools: str, without: str) -> bool:
        added = len(with_tools) - len(without)
        at = _common_prefix_length(with_tools, without)
        if added <= 0 or with_tools[at + added:] != without[at:]:
            return False  # not one inserted block
        users = [message["content"] for message in messages if message["role"] == "user"]
        last_user = without.rfind(users[-1])
        earlier = without.find(users[-2]) + len(users[-2]) if len(users) > 1 else 0
        return earlier <= at <= last_user

    rounds = [*user, call, {"role": "tool", "content": _PROBE_USER + "3", "tool_call_id": _PROBE_CALL_ID},
              {**assistant, "reasoning_content": _PROBE_REASONING}]
    # Each probe conversation rendered once with the probe tool and once without (None: cannot render).
    tool_renderings = [with_and_without_tools(messages, generation_prompt) for messages, generation_prompt in
                       ((rounds, False), (rounds[:-1], True), (two_turns, True))]
    layout = TemplateLayout(
        tools_in_preamble=all(pair is not None and preamble_only(*pair[1:]) for pair in tool_renderings),
        tools_before_last_user=all(pair is not None and inserted_before_last_user(*pair) for pair in tool_renderings),
        stable_with_system=stable([{"role": "system", "content": _PROBE_REASONING}, *two_turns], None),
        stable_with_tools=stable(two_turns, probe_tools),
        end_of_turn=end_of_turn,
        end_of_turn_id=tokenizer.convert_tokens_to_ids(end_of_turn),
        reasoning=reasoning,
        tool_arguments=tool_arguments,
        tool_calls=tool_calls,
        control_tokens=control_tokens,
        family=_family(template, prompt, end_of_turn, reasoning),
        splits_at_control_tokens=_splits_at_control_tokens(tokenizer, end_of_turn),
    )
    layout = replace(layout, reads_tool_rounds=_reads_tool_rounds(tokenizer, layout, template_kwargs),
                     keeps_history=_keeps_history(tokenizer, layout, template_kwargs),
                     extends_prompt=_extends_prompt(tokenizer, layout, template_kwargs))
    _LAYOUT_CACHE[key] = layout
    return layout


def _probe_rounds(number: int, calls: int, reasoning: bool, content: str) -> list[dict]:
    """A probe assistant turn (kit schema) with `calls` tool calls, then their results."""
    turn = {"role": "assistant", "content": content, "tool_calls": [
        {"id": f"call{number * 10 + call:05d}", "type": "function",
         "function": {"name": "probe", "arguments": {"x": _PROBE_TOOL}}} for call in range(calls)]}
    results = [{"role": "tool", "content": _PROBE_TOOL, "tool_call_id": call["id"]} for call in turn["tool_calls"]]
    return [{**turn, "reasoning": _PROBE_REASONING} if reasoning else turn, *results]


def _prompts_extend(tokenizer: Any, layout: TemplateLayout, template_kwargs: dict, conversation: list[dict],
                    ends: list[int]) -> bool:
    """Whether the prompt of `conversation` extends the prompt of each of its prefixes up to `ends` (their
    generation prompt's think opener left out)."""
    messages = _template_messages(conversation, layout, _Marker(layout))
    renderer = _Renderer(tokenizer, layout, None, template_kwargs)
    try:
        last = renderer.prompt(messages)
        return all(last.startswith(_context_header(renderer.prompt(messages[:end]))) for end in ends)
    except ChatTemplateError:
        return False


def _reads_tool_rounds(tokenizer: Any, layout: TemplateLayout, template_kwargs: dict) -> bool:
    """Whether the prompt of each turn in a probe stretch of tool rounds (reasoning on some turns, content
    on some, two calls on one) is the stretch's last prompt up to that turn's header."""
    if layout.tool_calls != "template":
        return False
    rounds: list[dict] = [{"role": "user", "content": _PROBE_USER}]
    for number, (calls, reasoning, content) in enumerate([(1, True, ""), (1, False, _PROBE_ASSISTANT), (2, True, ""),
                                                          (1, False, "")]):
        rounds += _probe_rounds(number + 1, calls, reasoning, content)
    turns = [index for index, message in enumerate(rounds) if message["role"] == "assistant"]
    return _prompts_extend(tokenizer, layout, template_kwargs, rounds, turns[1:])


def _keeps_history(tokenizer: Any, layout: TemplateLayout, template_kwargs: dict) -> bool:
    """Whether turns with reasoning that a user message follows (a tool-call turn right after its results,
    an answer) render in a prompt as in every later prompt, once answers and user messages follow (Kimi
    thinking shows such a tool-call turn's reasoning until an answer follows)."""
    answer = {"role": "assistant", "content": _PROBE_ASSISTANT, "reasoning": _PROBE_REASONING}
    conversation = [{"role": "user", "content": _PROBE_USER}, *_probe_rounds(1, 1, True, ""),
                    {"role": "user", "content": _PROBE_USER + "2"}, answer,
                    {"role": "user", "content": _PROBE_USER + "3"}, answer, {"role": "user", "content": _PROBE_USER + "4"}]
    return _prompts_extend(tokenizer, layout, template_kwargs, conversation, [4, 6])


def _extends_prompt(tokenizer: Any, layout: TemplateLayout, template_kwargs: dict) -> bool:
    """Whether a probe conversation's rendering up to its last turn (an answer with reasoning after tool
    rounds, one with reasoning, and an earlier stretch) extends the last turn's prompt."""
    answer = {"role": "assistant", "content": _PROBE_ASSISTANT, "reasoning": _PROBE_REASONING}
    conversation = [{"role": "user", "content": _PROBE_USER}, answer, {"role": "user", "content": _PROBE_USER + "2"},
                    *_probe_rounds(1, 1, True, ""), *_probe_rounds(2, 1, False, _PROBE_ASSISTANT), answer]
    messages = _template_messages(conversation, layout, _Marker(layout))
    renderer = _Renderer(tokenizer, layout, None, template_kwargs)
    try:
        return renderer.whole(messages).startswith(_context_header(renderer.prompt(messages[:-1])))
    except ChatTemplateError:
        return False


def _splits_at_control_tokens(tokenizer: Any, control_token: str) -> bool:
    before, after = " Hello world\n\n ", f"{control_token}\n\n  Hi there"
    whole = tokenizer(before + after, add_special_tokens=False)["input_ids"]
    parts = tokenizer([before, after], add_special_tokens=False)["input_ids"]
    return whole == parts[0] + parts[1]


def _tokens_in(text: str, control_tokens: Sequence[str]) -> list[str]:
    if not control_tokens:
        return []
    return re.findall("|".join(map(re.escape, control_tokens)), text)


def _family(template: str, prompt: str, end_of_turn: str, reasoning: str) -> str:
    """A readable name for the template's family (reported, never used to decide anything)."""
    thinking = "reasoning_content" in template or "<think>" in template
    if "<|im_start|>" in prompt:
        return "chatml-qwen3 (thinking)" if thinking else "chatml"
    if "<|start_header_id|>" in prompt:
        return "llama3"
    if "<|im_assistant|>" in prompt:
        return "kimi (thinking)" if thinking else "kimi"
    if "<｜Assistant｜>" in prompt:
        return "deepseek (thinking)" if "<think>" in template else "deepseek"
    if "[INST]" in prompt:
        return "mistral"
    if "<start_of_turn>" in prompt:
        return "gemma"
    if "<|assistant|>" in prompt:
        return "phi3" if end_of_turn == "<|end|>" else "zephyr"
    return f"other (end of turn {end_of_turn}, reasoning {reasoning})"


def template_family(tokenizer: Any, template_kwargs: dict | None = None) -> str:
    return template_layout(tokenizer, template_kwargs).family


# ---------------------------------------------------------------------------------------------
# Kit schema -> template messages (control tokens in message strings marked)


def _fold(reasoning: str, content: str) -> str:
    return f"<think>\n{reasoning}\n</think>\n\n{content}"


def _mark(value: Any, pattern: re.Pattern | None, index: dict[str, int]) -> Any:
    """Replace each control token inside strings (recursively) by its private-use character."""
    if isinstance(value, str):
        value = _MARK_RANGE.sub("", value)  # a message cannot forge a mark
        if pattern is None:
            return value
        return pattern.sub(lambda match: chr(_MARK_BASE + index[match.group(0)]), value)
    if isinstance(value, dict):
        return {key: _mark(item, pattern, index) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_mark(item, pattern, index) for item in value]
    return value


class _Marker:
    def __init__(self, layout: TemplateLayout):
        self.tokens = layout.control_tokens
        self.index = {token: position for position, token in enumerate(self.tokens)}
        self.pattern = re.compile("|".join(map(re.escape, self.tokens))) if self.tokens else None

    def __call__(self, value: Any) -> Any:
        return _mark(value, self.pattern, self.index)

    def unmark(self, text: str) -> str:
        return _MARK_RANGE.sub(lambda match: self.tokens[ord(match.group(0)) - _MARK_BASE], text)


def format_tool_call(name: str, arguments: Any) -> str:
    """One tool call as Hermes/Qwen text; `arguments` may be a JSON string or object."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def _arguments(arguments: Any, form: str) -> Any:
    if form == "string":
        return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def _template_messages(messages: Sequence[dict], layout: TemplateLayout, marker: _Marker) -> list[dict]:
    """Kit schema -> the dicts chat templates read; reasoning placed per layout, strings marked."""
    out = []
    for message in messages:
        role = message["role"]
        content = marker(message.get("content") or "")
        item: dict[str, Any] = {"role": role, "content": content}
        reasoning = marker(message.get("reasoning") or "")
        if role == "assistant" and reasoning:
            if layout.reasoning == "field":
                item["reasoning_content"] = reasoning
            elif layout.reasoning == "fold":
                item["content"] = _fold(reasoning, content)
            else:  # the template may show it on some turns (Kimi's tool-call turns); _Renderer.last places the rest
                item["reasoning_content"] = reasoning
                item["_reasoning"] = reasoning
        if role == "assistant" and message.get("tool_calls") and layout.tool_calls == "hermes-text":
            # The template has no tool-call syntax (SmolLM2, Phi-3.5): the calls as Hermes text, the form
            # such models were tuned on, so they are trained rather than silently dropped.
            calls = [format_tool_call(marker(call["function"]["name"]), marker(call["function"].get("arguments", {})))
                     for call in message["tool_calls"]]
            item["content"] = "\n".join(([item["content"]] if item["content"] else []) + calls)
        elif role == "assistant" and message.get("tool_calls"):
            item["tool_calls"] = [
                {"id": call.get("id") or _PROBE_CALL_ID, "type": "function",
                 "function": {"name": marker(call["function"]["name"]),
                              "arguments": marker(_arguments(call["function"].get("arguments", {}),
                                                             layout.tool_arguments))}}
                for call in message["tool_calls"]]
        if role == "tool":
            if message.get("tool_call_id"):
                item["tool_call_id"] = message["tool_call_id"]
            if message.get("name"):
                item["name"] = marker(message["name"])
        out.append(item)
    return out


def _strip_private(messages: list[dict]) -> list[dict]:
    return [{key: value for key, value in message.items() if key != "_reasoning"} for message in messages]


class _Renderer:
    """Renders marked template messages for one tokenizer, layout, tool list and template kwargs."""

    def __init__(self, tokenizer: Any, layout: TemplateLayout, tools: list | None, template_kwargs: dict):
        self.tokenizer, self.layout, self.tools, self.kwargs = tokenizer, layout, tools, template_kwargs

    def prompt(self, messages: list[dict]) -> str:
        return _render(self.tokenizer, _strip_private(messages), True, self.tools, self.kwargs)

    def whole(self, messages: list[dict]) -> str:
        """messages rendered as history, without a generation prompt."""
        return _render(self.tokenizer, _strip_private(messages), False, self.tools, self.kwargs)

    def last(self, messages: list[dict], prompt: str | None = None, rendered: str | None = None) -> str:
        """messages ending in an assistant turn, that turn written as the target generated it.

        Where the template's rendering of the turn does not extend its prompt (Mistral drops the system
        prompt once the conversation ends in an assistant turn; DeepSeek-R1 renders a tool call after
        tool output under another header), the turn as the template writes it in a small context is
        appended to the prompt the server actually sent. rendered: `messages` already rendered (no
        generation prompt), where the caller has it.
        """
        prompt = self.prompt(messages[:-1]) if prompt is None else prompt
        try:
            turn = self._last(messages, prompt, rendered)
            if turn.startswith(prompt):
                return turn
        except NotPrefixStableError:
            pass
        context = _small_context(messages, len(messages) - 1)
        if context == messages[:-1]:  # already the smallest context: nothing else to try
            raise NotPrefixStableError("the chat template's rendering of this turn does not extend its prompt")
        small_prompt = self.prompt(context)
        small = self._last(context + [messages[-1]], small_prompt)
        if not small.startswith(small_prompt):
            raise NotPrefixStableError("the chat template's rendering of this turn does not extend its prompt, "
                                       "even in a two-message conversation")
        return prompt + small[len(small_prompt):]

    def _last(self, messages: list[dict], prompt: str, rendered: str | None = None) -> str:
        full = self.whole(messages) if rendered is None else rendered
        if self.layout.reasoning != "splice":
            return full
        reasoning = messages[-1].get("_reasoning", "")
        if full.startswith(prompt):
            rest = full[len(prompt):]
            if not reasoning or f"<think>{reasoning}" in rest or f"<think>\n{reasoning}" in rest:
                return full
            # The template blanks the turn's think block (Kimi thinking on a final answer): fill it.
            for empty, filled in (("<think></think>", f"<think>{reasoning}</think>"),
                                  ("<think>\n\n</think>\n\n", f"<think>\n{reasoning}\n</think>\n\n")):
                if rest.startswith(empty):
                    return prompt + filled + rest[len(empty):]
            if prompt.endswith("</think>"):
                raise ChatTemplateError("this turn has reasoning but the template's generation prompt closes the "
                                        "think block (thinking off): set the template's thinking flag in "
                                        "prep.chat_template_kwargs")
            # No think block and none opened by the prompt (DeepSeek-R1 after tool output): the model wrote it.
            return prompt + _fold(reasoning, "") + rest
        # The prompt opens a think block the template's history form does not have (DeepSeek-R1/V3.1).
        if not prompt.rstrip("\n").endswith("<think>"):
            raise NotPrefixStableError("the chat template's rendering of this turn does not extend its prompt")
        common = prompt.rfind("<think>")
        if full[:common] != prompt[:common]:
            raise NotPrefixStableError("the chat template renders this turn's history differently from its prompt")
        opened, rest = prompt[common:], full[common:]
        if rest.startswith("</think>"):  # DeepSeek-V3.1 writes the non-thinking closer on history turns
            rest = rest[len("</think>"):]
        close = "\n</think>\n\n" if opened.endswith("\n") else "</think>"
        return prompt + reasoning + close + rest


def _small_context(template_messages: list[dict], index: int) -> list[dict]:
    """The least context that renders turn `index` as in the conversation: a probe user turn, plus the
    previous assistant turn (without reasoning) and the tool results since, where the turn follows tools."""
    probe = {"role": "user", "content": _PROBE_USER}
    caller = index - 1
    while caller >= 0 and template_messages[caller]["role"] == "tool":
        caller -= 1
    if caller < index - 1:
        keep_from = caller if caller >= 0 and template_messages[caller]["role"] == "assistant" else caller + 1
        # Without their reasoning, so no template rewrites the context (Kimi blanks it once a final answer follows).
        return [probe, *({key: value for key, value in message.items() if key not in ("reasoning_content", "_reasoning")}
                         for message in template_messages[keep_from:index])]
    return [probe]


# ---------------------------------------------------------------------------------------------
# Tokenization of a marked rendering


def _tokenize_marked(tokenizer: Any, text: str, marker: _Marker) -> tuple[list[int], list[int]]:
    """Token ids and each token's start offset (in `text`'s coordinates) of a marked rendering.

    Without marks this is one tokenizer call. With marks, the text is cut at each mark: the pieces
    between are tokenized as usual (the template's control tokens stay control tokens) and each
    marked token as plain text (`split_special_tokens=True`), all of its tokens starting at the mark.
    """
    return _tokenize_many(tokenizer, [text], marker)[0]


def _sample(tokenizer: Any, rendered: _Rendered, marker: _Marker,
            tokens: tuple[list[int], list[int]] | None = None) -> TokenizedConversation:
    input_ids, starts = tokens if tokens is not None else _tokenize_marked(tokenizer, rendered.text, marker)
    loss_mask = [0] * len(input_ids)
    # Token starts are sorted: each span's tokens are one slice, found by bisection.
    for span_start, span_end in rendered.spans:
        first, last = bisect.bisect_left(starts, span_start), bisect.bisect_left(starts, span_end)
        loss_mask[first:last] = [1] * (last - first)
    return TokenizedConversation(input_ids=input_ids, loss_mask=loss_mask)


def _samples_sharing_history(tokenizer: Any, rendered: list[_Rendered], marker: _Marker,
                             layout: TemplateLayout) -> list[TokenizedConversation]:
    """Split samples share their beginning with the sample before them and with a history rendering
    (`_Rendered.history`: the full rendering or a long stretch's). The tokenizer splits text at control
    tokens before anything else (checked per tokenizer), so each sample keeps the tokens of whichever of
    the two shares more text with it, up to the last control token inside the shared text, and only its
    rest is tokenized; a history rendering is tokenized only where a sample keeps from it. Rests and
    histories are cut at control tokens and each distinct piece is tokenized once (`_tokenize_pieces`).
    Linear in the conversation, not quadratic. Where the kept text's tokens do not hold that control
    token as one token at its place, the sample is tokenized whole."""
    control_ids = {tokenizer.convert_tokens_to_ids(token) for token in layout.control_tokens}
    control = re.compile("|".join(map(re.escape, layout.control_tokens)))
    # Per sample: what it keeps tokens of (0: the sample before it, 1: its history rendering, None:
    # nothing), and where its own tokenization starts.
    bases: list[tuple[int | None, int]] = []
    previous: str | None = None
    for item in rendered:
        shared = [(_common_prefix_length(text, item.text), -order, text)
                  for order, text in enumerate((previous, item.history)) if text is not None]
        previous = item.text
        if not shared:
            bases.append((None, 0))
            continue
        common, order, base = max(shared)  # the sample before on a tie
        # The last control token lying wholly inside the shared text: the tokens before it are kept.
        cut = _last_match(base, common, control)
        bases.append((-order, cut) if cut > 0 else (None, 0))
    histories = sorted({item.history for item, (order, _) in zip(rendered, bases) if order == 1})
    tokens = _tokenize_pieces(tokenizer, [item.text[cut:] for item, (_, cut) in zip(rendered, bases)] + histories,
                              marker, control, control_ids)
    whole = dict(zip(histories, tokens[len(rendered):]))  # the history renderings kept from, tokenized whole
    samples = []
    before: tuple[list[int], list[int]] = ([], [])  # the tokens of the sample before
    for item, (order, cut), (rest_ids, rest_starts) in zip(rendered, bases, tokens):
        ids, starts = rest_ids, rest_starts
        if order is not None:
            base_ids, base_starts = before if order == 0 else whole[item.history]
            keep = bisect.bisect_left(base_starts, cut)
            if keep < len(base_ids) and base_starts[keep] == cut and base_ids[keep] in control_ids:
                ids = base_ids[:keep] + rest_ids
                starts = base_starts[:keep] + [cut + start for start in rest_starts]
            else:  # the control token is not one token there: no cut to trust
                ids, starts = _tokenize_marked(tokenizer, item.text, marker)
        before = (ids, starts)
        samples.append(_sample(tokenizer, item, marker, (ids, starts)))
    return samples


def _last_match(text: str, end: int, pattern: re.Pattern) -> int:
    """Start of the last match of `pattern` lying wholly inside text[:end], or -1: searched in a window
    before `end` that grows until it holds one (a control token is rarely far), not from the start."""
    window = 256
    while True:
        start = max(0, end - window)
        found = -1
        for match in pattern.finditer(text, start, end):
            if match.start() > start or start == 0:  # one at the window's edge may be part of a longer token
                found = match.start()
        if found >= 0 or start == 0:
            return found
        window *= 4


def _tokenize_pieces(tokenizer: Any, texts: list[str], marker: _Marker, control: re.Pattern,
                     control_ids: set[int]) -> list[tuple[list[int], list[int]]]:
    """`_tokenize_marked` of each text, for a tokenizer that splits text at control tokens first: every text
    cut before each control token, each distinct piece tokenized once (the samples of a conversation share
    most of theirs: user messages, tool results, Mistral's tool list), a text's tokens its pieces' tokens
    in order. A text with a piece whose control token is not its first token is tokenized whole."""
    cuts: list[list[int]] = []
    pieces: dict[str, int] = {}
    for text in texts:
        starts = [0] + [match.start() for match in control.finditer(text) if match.start() > 0]
        cuts.append(starts)
        for start, end in zip(starts, starts[1:] + [len(text)]):
            pieces.setdefault(text[start:end], len(pieces))
    piece_tokens = _tokenize_many(tokenizer, list(pieces), marker)
    results = []
    for text, starts in zip(texts, cuts):
        ids: list[int] = []
        offsets: list[int] = []
        for start, end in zip(starts, starts[1:] + [len(text)]):
            piece_ids, piece_starts = piece_tokens[pieces[text[start:end]]]
            if start > 0 and not (piece_ids and piece_ids[0] in control_ids and piece_starts[0] == 0):
                ids, offsets = _tokenize_marked(tokenizer, text, marker)
                break
            ids += piece_ids
            offsets += [start + offset for offset in piece_starts]
        results.append((ids, offsets))
    return results


def _tokenize_many(tokenizer: Any, texts: list[str], marker: _Marker) -> list[tuple[list[int], list[int]]]:
    """`_tokenize_marked` of each text, in two batched tokenizer calls: the pieces between marks of every
    text in one, the marked tokens of every text (as plain text) in the other."""
    pieces: list[str] = []
    piece_starts: list[int] = []
    literals: list[str] = []
    marks: list[int] = []
    plans: list[list[tuple[bool, int]]] = []  # per text: (a marked token?, its index) in order
    for text in texts:
        plan, cursor = [], 0
        for match in _MARK_RANGE.finditer(text):
            plan += [(False, len(pieces)), (True, len(literals))]
            pieces.append(text[cursor: match.start()])
            piece_starts.append(cursor)
            literals.append(marker.unmark(match.group(0)))
            marks.append(match.start())
            cursor = match.end()
        plan.append((False, len(pieces)))
        pieces.append(text[cursor:])
        piece_starts.append(cursor)
        plans.append(plan)
    plain = tokenizer(pieces, add_special_tokens=False, return_offsets_mapping=True) if pieces else None
    literal = tokenizer(literals, add_special_tokens=False, split_special_tokens=True) if literals else None
    results = []
    for plan in plans:
        ids: list[int] = []
        offsets: list[int] = []
        for marked, index in plan:
            if marked:
                ids += literal["input_ids"][index]
                offsets += [marks[index]] * len(literal["input_ids"][index])
            else:
                ids += plain["input_ids"][index]
                offsets += [piece_starts[index] + start for start, _ in plain["offset_mapping"][index]]
        results.append((ids, offsets))
    return results


def _common_prefix_length(a: str, b: str) -> int:
    """len of the common prefix of a and b, by bisection on slice comparisons (C speed, not a char loop)."""
    low, high = 0, min(len(a), len(b))
    while low < high:  # a[:low] == b[:low]; the first difference, if any, is before `high`
        middle = (low + high + 1) // 2
        if a[low:middle] == b[low:middle]:
            low = middle
        else:
            high = middle - 1
    return low


def _span_end(text: str, start: int, end_of_turn: str, truncated: bool) -> int:
    """End of the span starting at `start`: just after the first end-of-turn token (before it when the
    answer was cut at max_tokens, which never produced one), or the end of the text."""
    at = text.find(end_of_turn, start)
    if at < 0:
        return len(text)
    return at if truncated else at + len(end_of_turn)


# ---------------------------------------------------------------------------------------------
# Public entry points


def normalize_tools(tools: Any) -> list[dict] | None:
    """Tool definitions as templates take them: a list of `{"type": "function", "function": {...}}`.

    Accepts a JSON string (Glaive stores them so) and bare function schemas."""
    if not tools:
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError:
            raise ChatTemplateError("meta.tools is a string that is not JSON") from None
    if isinstance(tools, dict):
        tools = [tools]
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise ChatTemplateError("meta.tools must be a list of tool definitions (objects)")
    return [tool if "function" in tool else {"type": "function", "function": tool} for tool in tools] or None


def _prepare(tokenizer: Any, messages: Sequence[dict], tools: list | None, template_kwargs: dict | None):
    tools = normalize_tools(tools)
    layout = template_layout(tokenizer, template_kwargs)
    marker = _Marker(layout)
    template_messages = _template_messages(messages, layout, marker)
    renderer = _Renderer(tokenizer, layout, marker(tools) if tools else None, dict(template_kwargs or {}))
    assistant_indices = [index for index, message in enumerate(messages) if message["role"] == "assistant"]
    if not assistant_indices:
        raise ChatTemplateError("the conversation has no assistant turn: nothing to train")
    return layout, marker, template_messages, renderer, assistant_indices


def render_conversation(tokenizer: Any, messages: Sequence[dict], add_generation_prompt: bool = False,
                        tools: list | None = None, template_kwargs: dict | None = None) -> str:
    """The chat-template text of `messages` (kit schema), reasoning and tool calls placed as the template needs."""
    tools = normalize_tools(tools)
    layout = template_layout(tokenizer, template_kwargs)
    marker = _Marker(layout)
    renderer = _Renderer(tokenizer, layout, marker(tools) if tools else None, dict(template_kwargs or {}))
    template_messages = _template_messages(messages, layout, marker)
    if add_generation_prompt:
        text = renderer.prompt(template_messages)
    elif template_messages and template_messages[-1]["role"] == "assistant":
        text = renderer.last(template_messages)
    else:
        text = renderer.whole(template_messages)
    return marker.unmark(text)


def prompt_token_ids(tokenizer: Any, messages: Sequence[dict], tools: list | None = None,
                     template_kwargs: dict | None = None) -> list[int]:
    """The tokens the target reads before answering: `messages` rendered with the generation prompt."""
    tools = normalize_tools(tools)
    layout = template_layout(tokenizer, template_kwargs)
    marker = _Marker(layout)
    renderer = _Renderer(tokenizer, layout, marker(tools) if tools else None, dict(template_kwargs or {}))
    return _tokenize_marked(tokenizer, renderer.prompt(_template_messages(messages, layout, marker)), marker)[0]


def prompt_token_count(tokenizer: Any, messages: Sequence[dict], tools: list | None = None,
                       template_kwargs: dict | None = None) -> int:
    return len(prompt_token_ids(tokenizer, messages, tools, template_kwargs))


def _finish(tokenizer: Any, rendered: list[_Rendered], marker: _Marker, bodies: list[str],
            layout: TemplateLayout | None = None) -> ConversationSamples:
    """Tokenize the samples (reusing their history's tokens where `layout` allows) and count what they train."""
    if layout is not None and layout.splits_at_control_tokens and len(rendered) > 1:
        samples = _samples_sharing_history(tokenizer, rendered, marker, layout)
    else:
        samples = [_sample(tokenizer, item, marker) for item in rendered]
    trained = sum(sum(sample.loss_mask) for sample in samples)
    # What the target generated: each turn's text as generated, tokenized on its own (one batched call
    # for the turns that quote no control token).
    plain = [body for body in bodies if body and not _MARK_RANGE.search(body)]
    generated = sum(len(ids) for ids in tokenizer(plain, add_special_tokens=False)["input_ids"]) if plain else 0
    generated += sum(len(_tokenize_marked(tokenizer, body, marker)[0]) for body in bodies
                     if body and _MARK_RANGE.search(body))
    return ConversationSamples(samples, generated, trained)


def tokenize_answer(tokenizer: Any, messages: Sequence[dict], answer: dict, *, tools: list | None = None,
                    truncated: bool = False, template_kwargs: dict | None = None) -> tuple[int, TokenizedConversation]:
    """A class-B sample: the prompt `messages` as the server rendered it, then `answer`, trained alone.

    Earlier assistant turns inside the prompt (multi-turn context) are the dataset's, not the target's:
    mask 0. Returns (prompt token count, the sample). truncated: the answer was cut at max_tokens.
    """
    layout, marker, template_messages, renderer, _ = _prepare(tokenizer, [*messages, answer], tools, template_kwargs)
    prompt = renderer.prompt(template_messages[:-1])
    turn = renderer.last(template_messages, prompt)
    end = _span_end(turn, len(prompt), layout.end_of_turn, truncated)
    rendered = _Rendered(turn[:end] if truncated else turn, [(len(prompt), end)])
    return len(_tokenize_marked(tokenizer, prompt, marker)[0]), _sample(tokenizer, rendered, marker)


def tokenize_conversation_reference(tokenizer: Any, messages: Sequence[dict], *, tools: list | None = None,
                                    history: HistoryPolicy = "split", truncated: bool = False,
                                    template_kwargs: dict | None = None) -> ConversationSamples:
    """The oracle: per assistant turn, render and tokenize its prompt and the turn; quadratic in messages.

    The turn's span is the text difference (to the first end-of-turn token); samples are cut where
    P_{i+1} stops extending F_i up to turn i's span (see the module doc). Each sample is tokenized
    whole, and every turn is then checked at the token level: where the prompt's own tokens are a
    prefix of the turn's own tokens, the turn's trained tokens must equal the token difference, or
    NotPrefixStableError is raised. Where they are not (the tokenizer merges across the boundary,
    e.g. SmolLM2's BPE on Llama 3's "\\n\\n" header end) the whole-sample tokenization stands and the
    turn is counted in `boundary_merges`.
    history="visible" is only defined here for conversations the template does not rewrite: it raises
    NotPrefixStableError otherwise. truncated: the last turn was cut at max_tokens (no end-of-turn token).
    """
    layout, marker, template_messages, renderer, indices = _prepare(tokenizer, messages, tools, template_kwargs)
    rendered: list[_Rendered] = []
    bodies: list[str] = []
    token_diffs: list[tuple[int, int, list[int] | None]] = []  # (sample, span index, expected trained tokens)
    current: _Rendered | None = None
    current_end = 0
    for position, index in enumerate(indices):
        last = position == len(indices) - 1
        prompt = renderer.prompt(template_messages[:index])
        turn = renderer.last(template_messages[: index + 1], prompt)
        if not turn.startswith(prompt):
            raise NotPrefixStableError(f"message {index}: the turn's rendering does not extend its prompt's")
        start = len(prompt)
        end = _span_end(turn, start, layout.end_of_turn, truncated and last)
        bodies.append(turn[start:end])
        if current is not None and not prompt.startswith(current.text[:current_end]):
            if history == "visible":
                raise NotPrefixStableError(f"message {index}: the template rewrites earlier turns")
            rendered.append(current)
            current = None
        if current is None:
            current = _Rendered(turn)
        current.text = turn
        current.spans.append((start, end))
        current_end = end
        prompt_ids = _tokenize_marked(tokenizer, prompt, marker)[0]
        turn_ids = _tokenize_marked(tokenizer, turn[:end], marker)[0]
        expected = turn_ids[len(prompt_ids):] if turn_ids[: len(prompt_ids)] == prompt_ids else None
        token_diffs.append((len(rendered), len(current.spans) - 1, expected))
    assert current is not None
    if truncated:
        current.text = current.text[:current_end]
    rendered.append(current)
    result = _finish(tokenizer, rendered, marker, bodies)
    merges = 0
    for sample_index, span_index, expected in token_diffs:
        if expected is None:
            merges += 1
            continue
        span_start, span_end = rendered[sample_index].spans[span_index]
        ids, starts = _tokenize_marked(tokenizer, rendered[sample_index].text, marker)
        trained = [token for token, start in zip(ids, starts) if span_start <= start < span_end]
        if trained != expected:
            raise NotPrefixStableError(f"turn {span_index + 1} of sample {sample_index + 1}: the trained tokens differ "
                                       "from the per-prefix token difference")
    return ConversationSamples(result.samples, result.generated_tokens, result.trained_tokens, False, merges)


def tokenize_conversation(tokenizer: Any, messages: Sequence[dict], *, tools: list | None = None,
                          history: HistoryPolicy = "split", truncated: bool = False,
                          template_kwargs: dict | None = None) -> ConversationSamples:
    """Training samples of a conversation: `input_ids` and `loss_mask`, in time linear in its length.

    messages: kit schema dicts `{"role", "content", "reasoning"?, "tool_calls"?, "tool_call_id"?}`;
    messages after the last assistant turn are context for nothing and are dropped.
    tools: the record's tool definitions (`meta.tools`), passed to the template as `tools=`.
    history: "split" (default) or "visible" (see the module doc).
    truncated: the last assistant turn was cut at max_tokens: its mask ends at its last generated
        token and no end-of-turn token follows it.
    Raises ChatTemplateError (with the reason) when the template cannot render the conversation.
    """
    if history not in HISTORY_POLICIES:
        raise ValueError(f"history must be one of {HISTORY_POLICIES}, got {history!r}")
    layout, marker, template_messages, renderer, indices = _prepare(tokenizer, messages, tools, template_kwargs)
    unstable = (tools and not layout.stable_with_tools) or \
        (not layout.stable_with_system and any(message["role"] == "system" for message in messages))
    # A template that moves text it wrote earlier (Mistral: the system prompt, only while a user turn is
    # last; the tools, before the last user turn) changes the context of earlier turns in ways the
    # spans do not show: every turn's prompt is composed and cut as the oracle cuts (_injected_groups).
    # "visible" reads one rendering as it is.
    prompts: list[str] = []  # per turn: its small-context prompt (ends in its header) and what follows its span
    tails: list[str] = []
    readable: list[bool] = []  # per turn: whether its prompt is its own rendering up to its header
    # Renderings whose beginning is discarded leave out tool definitions where those only add a preamble.
    small = _Renderer(tokenizer, layout, None, renderer.kwargs) if layout.tools_in_preamble and renderer.tools \
        else renderer
    # Each turn as generated, from a small rendering that starts with a probe user turn: the tools may
    # be left out too where they only add a block before the last user message (Mistral).
    bodies = _generated_bodies(_Renderer(tokenizer, layout, None, renderer.kwargs)
                               if layout.tools_before_last_user and renderer.tools else small,
                               template_messages, indices, layout, truncated, prompts, tails, readable)
    if bodies is None:
        return _fallback(tokenizer, messages, tools, history, truncated, template_kwargs)
    if history == "visible":
        full = renderer.last(template_messages[: indices[-1] + 1])
        rendered = _locate_visible(full, bodies, layout, truncated)
        groups = None if rendered is None else [rendered]
    elif unstable:
        groups = _injected_groups(renderer, template_messages, indices, bodies, layout, prompts, tails)
    else:
        groups = _split_groups(renderer, small, template_messages, messages, indices, bodies, layout, prompts, tails,
                               readable)
    if groups is not None and truncated and history == "split":
        groups[-1].text = groups[-1].text[: groups[-1].spans[-1][1]]
    if groups is None:
        return _fallback(tokenizer, messages, tools, history, truncated, template_kwargs)
    return _finish(tokenizer, groups, marker, [body for _, body, _ in bodies], layout)


def _injected_groups(renderer: _Renderer, template_messages: list[dict], indices: list[int],
                     bodies: list[tuple[str, str, int]], layout: TemplateLayout, prompts: list[str],
                     tails: list[str]) -> list[_Rendered] | None:
    """Samples of the split policy for a template that writes the system prompt and tool definitions into
    the last user turn (Mistral: the tools before the last user message, the system prompt inside it
    only while it is the last message), cut where the oracle cuts; None where a check fails.

    Every turn's prompt P_i is composed, not rendered whole: the history before the last user message
    u as the full rendering shows it (there the tools sit before the conversation's last user message
    only and the system prompt nowhere), then what follows the assistant turn a before u (the anchor) in
    a rendering of the system prompt, a's small context, a and the messages from u on. The turns of u's
    stretch are read off one rendering of the stretch; the first turn's prompt (u is last there: the
    system prompt shows) with the system prompt inserted as `_system_insertion` probed, or, where the
    stretch has one turn or the probe does not read so, its own small prompt. Samples are then cut with
    the oracle's own criterion (P_{i+1} does not extend P_i + turn i) on the composed texts. Checked: the
    anchor reads the same in the full rendering and the small one, and the last turn's prompt and the last turn of the
    sample before the last sample equal their real renderings.
    """
    messages = template_messages[: indices[-1] + 1]
    count = len(indices)
    end_of_turn = layout.end_of_turn
    users = [index for index, message in enumerate(messages) if message["role"] == "user"]
    if not users or users[0] > indices[0] or any(message["role"] != "system" for message in messages[: users[0]]):
        return None  # a turn before any user message, or something else before it: the oracle decides
    if not _users_distinct(messages, users):
        return None
    system = messages[: users[0]]
    facts = _shape_facts(renderer, layout)
    if facts.system_insertion is _UNPROBED:
        facts.system_insertion = _system_insertion(renderer)
    insertion = facts.system_insertion
    full = renderer.whole(messages)
    history = _history_turns(full, bodies, layout)
    if history is None:
        return None
    position_of = {index: position for position, index in enumerate(indices)}
    composed: list[str] = [""] * count  # per turn: its prompt P_i as the oracle renders it
    for number, user in enumerate(users):
        stop = users[number + 1] if number + 1 < len(users) else len(messages)
        turns = [position for position in range(count) if user < indices[position] < stop]
        if not turns:
            continue
        if number > 0 and messages[user - 1]["role"] != "assistant":
            return None
        anchor = None if number == 0 else position_of[user - 1]
        prefix = _stretch_prefix(messages, system, None if number == 0 else user - 1)
        if anchor is None:
            def compose(text: str) -> str | None:
                return text
            cursor = 0
        else:
            # The anchor ends at the k-th end-of-turn token of the small rendering (k as in its own small
            # prompt and turn: the system prompt and tools add none before it).
            seen = (prompts[anchor] + bodies[anchor][1]).count(end_of_turn)
            anchor_start, anchor_end = history[anchor]
            anchor_text = full[anchor_start:anchor_end]

            def compose(text: str) -> str | None:
                at = _after_nth(text, end_of_turn, seen)
                if at < 0 or not text.startswith(anchor_text, at - len(anchor_text)):
                    return None
                return full[:anchor_end] + text[at:]
            cursor = anchor_end
        first = None
        if len(turns) > 1:
            stretch = prefix + messages[user: indices[turns[-1]] + 1]
            text = full if stretch == messages else \
                compose(renderer.whole(stretch))
            located = None if text is None else _locate_turns(text, bodies, turns[0], turns[-1], cursor)
            if not isinstance(located, _Rendered):
                return None
            for position, (start, _) in zip(turns[1:], located.spans[1:]):
                composed[position] = text[:start]
            if indices[turns[0]] == user + 1:  # the first turn's prompt: the stretch's, cut, u last
                first = _with_system(text[: located.spans[0][0]], prefix, messages[user], insertion)
        if first is None:
            first = compose(renderer.prompt(prefix + messages[user: indices[turns[0]]]))
        if first is None:
            return None
        composed[turns[0]] = first
    groups: list[_Rendered] = []
    current: _Rendered | None = None
    for position in range(count):
        prompt = composed[position]
        if current is not None and not prompt.startswith(current.text[: current.spans[-1][1]]):
            groups.append(current)
            current = None
        if current is None:
            current = _Rendered("", history=full)
        current.text = prompt + bodies[position][1] + tails[position]
        current.spans.append((len(prompt), len(prompt) + len(bodies[position][1])))
    assert current is not None
    groups.append(current)
    # Real checks: the last turn's prompt, and the last turn of the sample before the last.
    checks = [count - 1] + ([count - 1 - len(groups[-1].spans)] if len(groups) > 1 else [])
    for position in checks:
        if renderer.prompt(messages[: indices[position]]) != composed[position]:
            return None
    # The oracle's last sample is the full rendering where that extends the last prompt.
    if layout.reasoning == "splice":
        if renderer.last(messages, composed[-1]) != groups[-1].text:
            return None
    elif full.startswith(composed[-1]) and full != groups[-1].text:
        return None
    return groups


def _system_insertion(renderer: _Renderer) -> tuple[str, str] | None:
    """(separator, tail) where a prompt whose last message is a user message u reads off a rendering that
    goes on after u: that rendering cut where the next turn's text starts, with the system prompt and the
    separator inserted before u's content, followed by `tail` up to the cut (Mistral: "\\n\\n" and
    "[/INST]"); probed with and without a system prompt, with and without a turn before u. None where the
    probes do not all read so: the stretch's first prompt is then rendered."""
    def pair(system: str | None, before: list[dict], user: str, answer: str) -> tuple[str, str, str] | None:
        head = [{"role": "system", "content": system}] if system is not None else []
        conversation = head + before + [{"role": "user", "content": user}]
        prompt = renderer.prompt(conversation)
        whole = renderer.whole(conversation + [{"role": "assistant", "content": answer}])
        at = whole.rfind(answer)
        return None if at < 0 else (prompt, whole[:at], system or "")

    earlier = [{"role": "user", "content": _PROBE_USER + "0"}, {"role": "assistant", "content": _PROBE_ASSISTANT + "0"}]
    try:
        probes = [pair(_PROBE_USER + "SYSTEM1", [], _PROBE_USER + "1", _PROBE_ASSISTANT + "1"),
                  pair(_PROBE_USER + "SYSTEM2", earlier, _PROBE_USER + "2", _PROBE_ASSISTANT + "2"),
                  pair(None, earlier, _PROBE_USER + "3", _PROBE_ASSISTANT + "3")]
    except ChatTemplateError:
        return None
    if any(probe is None for probe in probes):
        return None
    prompt, cut, system = probes[0]
    user = _PROBE_USER + "1"
    at = cut.rfind(user)
    if at < 0 or not prompt.startswith(cut[:at] + system) or not prompt.endswith(cut[at:]):
        return None
    separator, tail = prompt[at + len(system): len(prompt) - len(cut) + at], cut[at + len(user):]
    for number, (prompt, cut, system) in enumerate(probes):
        content = {"role": "user", "content": _PROBE_USER + str(number + 1)}
        head = [{"role": "system", "content": system}] if system else []
        if _with_system(cut, head, content, (separator, tail)) != prompt:
            return None
    return separator, tail


def _with_system(cut: str, prefix: list[dict], user: dict, insertion: tuple[str, str] | None) -> str | None:
    """A stretch's rendering `cut` where its first turn starts, as the prompt of that turn (u last): the
    system prompt (the prefix's first message, if a system message) inserted before u's content as
    `_system_insertion` probed; None where it cannot be read so (the prompt is then rendered)."""
    content = user.get("content")
    if insertion is None or not isinstance(content, str) or not content:
        return None
    separator, tail = insertion
    if not cut.endswith(content + tail):
        return None
    if not prefix or prefix[0]["role"] != "system":
        return cut
    system = prefix[0].get("content")
    if not isinstance(system, str) or not system:  # the probes had a system prompt with text
        return None
    at = len(cut) - len(content) - len(tail)
    return cut[:at] + system + separator + cut[at:]


def _users_distinct(messages: list[dict], users: list[int]) -> bool:
    """Whether no two user messages are equal: Mistral finds the last user message by equality, so an
    earlier equal one gets the tools as well, which the composition does not show."""
    keys = [json.dumps(messages[index], sort_keys=True, default=str) for index in users]
    return len(set(keys)) == len(keys)


def _stretch_prefix(messages: list[dict], system: list[dict], anchor: int | None) -> list[dict]:
    """What a small rendering of a stretch (from a user message on) starts with: the system prompt, then
    the assistant turn before the user message (the anchor) in its small context; for the first stretch
    the system prompt alone (the conversation's own beginning)."""
    if anchor is None:
        return list(system)
    return system + _small_context(messages, anchor) + [messages[anchor]]


def _after_nth(text: str, needle: str, count: int) -> int:
    """The position just after the count-th occurrence of `needle` in `text` (0 for count 0), or -1."""
    if count == 0:
        return 0
    found = _find_nth(text, needle, 0, count - 1)
    return found + len(needle) if found >= 0 else -1


def _split_groups(renderer: _Renderer, small: _Renderer, template_messages: list[dict], messages: Sequence[dict],
                  indices: list[int],
                  bodies: list[tuple[str, str, int]], layout: TemplateLayout, prompts: list[str],
                  tails: list[str], readable: list[bool]) -> list[_Rendered] | None:
    """Samples of the split policy, cut where the oracle cuts; None when the spans cannot be found.

    The whole conversation is tried first (one render: every template that does not rewrite history
    ends here). Otherwise groups grow greedily over candidate ends and close at the first turn no
    longer rendered as generated. Each group's text is composed, not rendered whole: the history
    before it as the full rendering shows it, then its own stretch rendered in a small context
    (`_Composer`); linear in the conversation's length instead of quadratic. Where composing fails a
    check, every group is rendered whole (one render per group).
    """
    count = len(indices)
    full = _full_rendering(renderer, template_messages[: indices[-1] + 1], bodies, layout, readable)
    whole = _locate_group(full, bodies, 0, count - 1, layout)
    if isinstance(whole, _Rendered):
        return [whole]
    user_after = [any(message["role"] == "user" for message in messages[indices[position] + 1: indices[position + 1]])
                  for position in range(count - 1)]
    history = _history_turns(full, bodies, layout)
    if history is not None:
        # A group can only end before a user message (where Qwen3, Kimi thinking and Mistral rewrite) or
        # at a turn the full rendering no longer shows as generated (Qwen3's empty think block, DeepSeek).
        ends = [position for position in range(count - 1) if user_after[position]
                or not full.startswith(bodies[position][0] + bodies[position][1], history[position][0])]
        composer = _Composer(renderer, small, template_messages, indices, bodies, layout, prompts, tails, readable,
                             full, history)
        kinds = [(position < count - 1 and user_after[position], bool(messages[index].get("reasoning")))
                 for position, index in enumerate(indices)]
        groups = _greedy_groups(composer.attempt, ends + [count - 1], count, kinds)
        # One real check per conversation beyond the last group's: the group before it, which has the
        # longest composed history, against its own prompt rendered whole (already done where that group
        # ends a long stretch, whose rendering it was checked against).
        before_last = count - 1 - len(groups[-1].spans) if groups is not None and len(groups) > 1 else None
        if before_last is not None and (before_last + 1 - len(groups[-2].spans), before_last) not in composer.checked \
                and composer.turn_after_prompt(before_last) != groups[-2].text:
            groups = None
        if groups is not None:
            return groups
    texts: dict[int, str] = {count - 1: full}  # one render per sample end

    def attempt(first: int, last: int) -> _Rendered | int | None:
        if last not in texts:
            texts[last] = renderer.last(template_messages[: indices[last] + 1])
        return _locate_group(texts[last], bodies, first, last, layout)

    ends = [position for position in range(count - 1) if user_after[position]]
    groups = _greedy_groups(attempt, ends + [count - 1], count)
    for group in groups or []:
        group.history = full  # samples share their beginning with the full rendering up to its first rewrite
    return groups


def _full_rendering(renderer: _Renderer, messages: list[dict], bodies: list[tuple[str, str, int]],
                    layout: TemplateLayout, readable: list[bool]) -> str:
    """The conversation up to its last turn as the oracle's last sample holds it (`_Renderer.last`). The
    turn's prompt is read off the conversation's rendering (up to the turn's header, then the header)
    where the template's probe says that rendering extends the prompt (`extends_prompt`) and the turn's
    small context showed the prompt to be its rendering up to its header; else it is rendered."""
    if layout.extends_prompt and readable[-1]:
        whole = renderer.whole(messages)
        turns = _history_turns(whole, bodies, layout)
        if turns is not None:
            return renderer.last(messages, whole[: turns[-1][0]] + bodies[-1][0], whole)
    return renderer.last(messages)


def _greedy_groups(attempt, ends: list[int], count: int, kinds: Sequence[Any] = ()) -> list[_Rendered] | None:
    """Grow each group over the candidate ends while every turn in it stays as generated; close a group
    at the first turn that does not (the turns up to it stay as generated past the previous end).

    Most candidate ends are cuts, so the first few are walked one by one, a cut confirmed when the next
    group's prompt does not extend this group up to its last turn (the oracle's criterion), read off the
    next group's text, which is needed anyway. An end is walked while walking has confirmed at least as
    many ends of its kind (`kinds[end]`) as it refuted: Kimi thinking rewrites only at user messages,
    Qwen3 also after a turn without reasoning. Past them the last good end is found by galloping then
    bisecting (a group that fails at one end fails at every later one: a rewritten turn stays
    rewritten): O(log) attempts per group, each no longer than twice the group. Every cut is checked
    with the oracle's criterion at the end; None when one fails or a group cannot be found.
    """
    tried: dict[tuple[int, int], _Rendered | int | None] = {}

    def located_at(first: int, last: int) -> _Rendered | int | None:
        if (first, last) not in tried:
            tried[first, last] = attempt(first, last)
        return tried[first, last]

    groups: list[_Rendered] = []
    walked: dict[Any, list[int]] = {}  # per kind of end: [confirmed, refuted] cuts so far
    start = 0
    while start < count:
        candidates = [end for end in ends if end >= start]
        good: tuple[int, _Rendered] | None = None  # (index in candidates, its group)
        bad: tuple[int, int] | None = None  # (index in candidates, the first turn not as generated there)
        index, step = 0, 1
        while True:
            located = located_at(start, candidates[index])
            if located is None:
                return None
            if not isinstance(located, _Rendered):
                bad = (index, located)
                break
            good = (index, located)
            if index == len(candidates) - 1:
                break
            end = candidates[index]
            tally = walked.setdefault(kinds[end] if kinds else None, [0, 0])
            if index < _WALKED_ENDS and tally[0] >= tally[1]:
                following = located_at(end + 1, candidates[index + 1])
                cut = isinstance(following, _Rendered) and not _continues(located, following)
                tally[0 if cut else 1] += 1
                if cut:
                    break
                index += 1
            else:
                index, step = min(index + step, len(candidates) - 1), step * 2
        while bad is not None and bad[0] - (good[0] if good else -1) > 1:
            middle = ((good[0] if good else -1) + bad[0]) // 2
            located = located_at(start, candidates[middle])
            if located is None:
                return None
            if isinstance(located, _Rendered):
                good = (middle, located)
            else:
                bad = (middle, located)
        best = None if good is None else (candidates[good[0]], good[1])
        if bad is not None and (best is None or bad[1] > best[0]):
            # The turns up to the first one not as generated stay so past the last good end: close there.
            closing = located_at(start, bad[1]) if bad[1] < candidates[bad[0]] else None
            if not isinstance(closing, _Rendered):
                return None
            best = (bad[1], closing)
        if best is None:
            return None
        groups.append(best[1])
        start = best[0] + 1
    if any(_continues(previous, following) for previous, following in itertools.pairwise(groups)):
        return None
    return groups


def _continues(previous: _Rendered, following: _Rendered) -> bool:
    """Whether `following`'s first prompt extends `previous` up to its last turn: no cut between them."""
    return following.text[: following.spans[0][0]].startswith(previous.text[: previous.spans[-1][1]])


def _history_turns(full: str, bodies: list[tuple[str, str, int]],
                   layout: TemplateLayout, cursor: int = 0) -> list[tuple[int, int]] | None:
    """Each turn in the full rendering (from `cursor` on), as the template shows it there: (its header's
    start, its end)."""
    turns = []
    for header, _, skip in bodies:
        context_header = _context_header(header)
        at = _find_nth(full, context_header, cursor, skip)
        if at < 0:
            return None
        cursor = _span_end(full, at + len(context_header), layout.end_of_turn, False)
        turns.append((at, cursor))
    return turns


class _Composer:
    """A split group's text without rendering the conversation up to it.

    A group's sample is a history rendering up to the end of an anchor turn, then what follows the
    anchor in a small rendering: the anchor's own small context (`_small_context`), the anchor and the
    messages up to the group's last turn, written as generated.
    Templates rewrite earlier turns when a user message follows them (Qwen3 keeps the reasoning of
    every turn since the last user message; Mistral moves the system prompt and tools to the last one)
    or when the turn is no longer last, so the history up to the anchor reads as the group's own
    rendering would show it, in one of two renderings:
    - the full rendering, up to the turn before the user message that opened the group's stretch
      (every turn before it has a user message after it in both), when that stretch is short or the last;
    - the rendering of the group's whole stretch (up to the turn before the next user message), up
      to the previous group's last turn, when the stretch is long (an agent's tool rounds): one render
      per long stretch instead of one per group.
    Both need the template to render a tool round the same whatever rounds follow it (probed per
    template: `TemplateLayout.reads_tool_rounds`); elsewhere the history comes from the full rendering
    up to the turn before the stretch's user message. Within a stretch of tool rounds, a group's prompt
    after the anchor is read off one rendering of the stretch up to its last turn's prompt (the history
    rendering itself where that is the stretch's, else one small rendering per stretch instead of one
    per group: `_read_after_anchor`).
    Checked: the anchor reads the same in the history and the small rendering (per group), a group
    that ends where its history rendering ends comes out as that rendering (per long stretch, and the
    last group as the full rendering), and the group before the last comes out as its prompt rendered
    whole (per conversation, by `_split_groups`).
    """

    def __init__(self, renderer: _Renderer, small: _Renderer, template_messages: list[dict], indices: list[int],
                 bodies: list[tuple[str, str, int]], layout: TemplateLayout, prompts: list[str], tails: list[str],
                 readable: list[bool], full: str, history: list[tuple[int, int]]):
        self.renderer, self.small, self.template_messages, self.indices = renderer, small, template_messages, indices
        self.bodies, self.layout, self.prompts, self.tails, self.readable = bodies, layout, prompts, tails, readable
        count = len(indices)
        # History renderings by the turn they end at: the full one, and the long stretches' (lazily).
        self.sources: dict[int, tuple[str, list[tuple[int, int]]] | None] = {count - 1: (full, history)}
        self.rendered: dict[int, str] = {}  # real renders of groups without history to share
        # Small renderings by (anchor, turn): the turn's prompt from the anchor's small context on.
        self.small_prompts: dict[tuple[int, int], str | None] = {}
        self.checked: set[tuple[int, int]] = set()  # groups (first, last turn) found equal to a real rendering
        self.users = [index for index, message in enumerate(template_messages) if message["role"] == "user"]
        self.stretch_end = list(range(count))  # each turn's last turn before the next user message
        for position in range(count - 2, -1, -1):
            if not any(message["role"] == "user" for message in template_messages[indices[position] + 1:
                                                                                    indices[position + 1]]):
                self.stretch_end[position] = self.stretch_end[position + 1]

    def turn_after_prompt(self, last: int) -> str:
        """The conversation up to turn `last`: its prompt rendered, the turn as generated after it (as
        `_Renderer.last` writes it; the turn's text does not depend on what precedes its small context)."""
        return self.renderer.prompt(self.template_messages[: self.indices[last]]) + self.bodies[last][1] + \
            self.tails[last]

    def _source(self, end: int) -> tuple[str, list[tuple[int, int]]] | None:
        if end not in self.sources:
            text = self.turn_after_prompt(end)
            turns = _history_turns(text, self.bodies[: end + 1], self.layout)
            self.sources[end] = None if turns is None else (text, turns)
        return self.sources[end]

    def _anchor(self, first: int) -> tuple[int, int] | None:
        """(the anchor turn, the turn its history rendering ends at) for a group starting at turn `first`."""
        start = self.indices[first]
        opened = [index for index in self.users if index < start]
        if first == 0 or not opened:
            return None
        count = len(self.indices)
        # Where the template renders a tool round the same whatever rounds follow (`reads_tool_rounds`),
        # the group's stretch up to the turn before it reads as in the stretch's own rendering.
        if self.users[-1] < start and self.layout.reads_tool_rounds:  # the last stretch: the full rendering's
            return first - 1, count - 1
        if start - opened[-1] > _SHORT_STRETCH and self.layout.reads_tool_rounds:
            return first - 1, self.stretch_end[first]
        anchors = [position for position in range(first) if self.indices[position] < opened[-1]]
        return (anchors[-1], count - 1) if anchors else None

    def attempt(self, first: int, last: int) -> _Rendered | int | None:
        anchored = self._anchor(first)
        if anchored is None:  # no history to share: rendered as the oracle renders it
            if last not in self.rendered:
                self.rendered[last] = self.turn_after_prompt(last)
            located = _locate_group(self.rendered[last], self.bodies, first, last, self.layout)
            if isinstance(located, _Rendered):
                located.history = self.sources[len(self.indices) - 1][0]
            return located
        anchor_position, source_end = anchored
        source = self._source(source_end)
        if source is None:
            return None
        history_text, history = source
        # The group's turns are found in the composed text from the end of the anchor turn on.
        cursor, context_from = history[anchor_position][1], anchor_position + 1
        if source_end == len(self.indices) - 1:
            # A group that spans user messages (Kimi thinking) takes the stretches before its last turn's
            # from the full rendering as well: in its last turn's prompt they precede a user message too.
            anchor_position = max(anchor_position, self._before_stretch(last))
        history_start, history_end = history[anchor_position]
        after_anchor = self._after_anchor(anchor_position, last, history_text[history_start:history_end], source_end)
        if after_anchor is None:
            return None
        text = history_text[:history_end] + after_anchor + self.bodies[last][1] + self.tails[last]
        if last == source_end:
            if text != history_text:
                return None
            self.checked.add((first, last))
        located = _locate_group(text, self.bodies, first, last, self.layout, cursor, context_from)
        if isinstance(located, _Rendered):
            located.history = history_text
        return located

    def _before_stretch(self, position: int) -> int:
        """The last turn before the user message that opens turn `position`'s stretch (-1: none)."""
        opened = max((user for user in self.users if user < self.indices[position]), default=-1)
        return max((before for before in range(position) if self.indices[before] < opened), default=-1)

    def _after_anchor(self, anchor_position: int, last: int, anchor_text: str, source_end: int) -> str | None:
        """Turn `last`'s prompt after the anchor turn, ending in the turn's header: read off its stretch's
        rendering where the template allows it, else rendered."""
        read = self._read_after_anchor(anchor_position, last, anchor_text, source_end)
        return read if read is not None else self._rendered_after_anchor(anchor_position, last, anchor_text)

    def _read_after_anchor(self, anchor_position: int, last: int, anchor_text: str, source_end: int) -> str | None:
        """Turn `last`'s prompt after the anchor, read off a rendering of the turns after it up to the last
        turn before the next user message (the stretch's end): the prompt of a turn is that rendering up to
        the turn's header, then the header (`_read_prompt`), since the turns after it in its stretch change
        nothing before it. The rendering is the history rendering itself where that ends at the stretch's
        end (the last stretch in the full rendering, a long stretch in its own), else the stretch end's
        prompt rendered small (one render per stretch instead of one per group). Only across tool rounds:
        every message from the turn to the stretch's end is an assistant turn with tool calls or a tool
        result, so a template that looks for the last message of some kind (Kimi thinking: the last
        assistant turn without tool calls) finds the same one in both. None elsewhere, where `last` ends
        its stretch (its own rendering is the stretch's) or where its header cannot be found."""
        anchor = self.template_messages[self.indices[anchor_position]]
        if anchor_position == last - 1 and self.readable[last] and \
                (self.layout.keeps_history or "reasoning_content" not in anchor):
            # No turn between the anchor and this one: what lies between (a user message, tool results)
            # reads as in the history rendering, where the anchor's history ends (the turn opens its
            # stretch, or its stretch's rendering is the history), and the turn's header as its small
            # context's prompt showed it. After an anchor with reasoning only where the template keeps
            # history (else the turn's prompt may show it where the history rendering does not: the small
            # rendering's anchor check says).
            text, turns = self._source(source_end)
            return text[turns[anchor_position][1]: turns[last][0]] + self.bodies[last][0]
        end = self.stretch_end[last]
        rounds = self.template_messages[self.indices[last]: self.indices[end]]
        if not self.layout.reads_tool_rounds or self.small.tools or last == end or \
                not all(message["role"] == "tool" or message.get("tool_calls") for message in rounds):
            return None
        if end == source_end:
            text, turns = self._source(source_end)
            start = turns[anchor_position][1]
        else:
            text = self._rendered_after_anchor(anchor_position, end, anchor_text)
            start = 0
        turns = None if text is None else \
            _history_turns(text, self.bodies[anchor_position + 1: last + 1], self.layout, start)
        return None if turns is None else text[start: turns[-1][0]] + self.bodies[last][0]

    def _rendered_after_anchor(self, anchor_position: int, last: int, anchor_text: str) -> str | None:
        """Turn `last`'s prompt after the anchor, from one small rendering: the anchor's small context, the
        anchor (with its reasoning: a template may show it there, as Kimi thinking does for a tool-call turn
        that a user message follows) and the messages up to the turn; None where the anchor does not read
        there as `anchor_text` (its history rendering) or the template cannot render it."""
        messages = self.template_messages
        anchor = self.indices[anchor_position]
        if (anchor_position, last) not in self.small_prompts:
            context = _small_context(messages, anchor)
            try:  # the prompt of the turn; the turn follows as generated (as `_Renderer.last` writes it)
                small = self.small.prompt(context + messages[anchor: self.indices[last]])
            except ChatTemplateError:
                small = None
            self.small_prompts[anchor_position, last] = small
        small = self.small_prompts[anchor_position, last]
        # The small context's prompt (rendered once per turn by _generated_bodies) ends in the anchor's
        # header: the anchor starts there in the small rendering too.
        header_at = len(self.prompts[anchor_position]) - len(self.bodies[anchor_position][0])
        if small is None or header_at < 0 or not small.startswith(anchor_text, header_at):
            return None
        return small[header_at + len(anchor_text):]


def _fallback(tokenizer, messages, tools, history, truncated, template_kwargs) -> ConversationSamples:
    result = tokenize_conversation_reference(tokenizer, messages, tools=tools, history=history, truncated=truncated,
                                             template_kwargs=template_kwargs)
    return ConversationSamples(result.samples, result.generated_tokens, result.trained_tokens, fallback=True,
                               boundary_merges=result.boundary_merges)


@dataclass
class _ShapeFacts:
    """Per small-context shape (its roles, calls and whether each has content): the header before the turn
    and the headers a scan skips (`_turn_header`), where its prompt reads off the turn's rendering
    (`_prompt_reading`), and whether the prompt is that rendering up to the header, then the header."""

    headers: dict[tuple, tuple[str, int]] = field(default_factory=dict)
    readings: dict[tuple, tuple[int, int] | None] = field(default_factory=dict)
    up_to_header: dict[tuple, bool] = field(default_factory=dict)
    probe_prompt: str | None = None  # the prompt of the probe user turn alone (every turn after a user turn)
    # Where a stretch's first prompt reads off the stretch's rendering (Mistral's system prompt), probed on
    # first use: `_system_insertion`.
    system_insertion: Any = _UNPROBED


def _shape_facts(renderer: _Renderer, layout: TemplateLayout) -> _ShapeFacts:
    tokenizer = renderer.tokenizer
    key = (layout, id(tokenizer), len(tokenizer), tokenizer.chat_template,
           json.dumps(renderer.kwargs, sort_keys=True, default=str), json.dumps(renderer.tools, sort_keys=True,
                                                                                 default=str))
    if key not in _SHAPE_CACHE and len(_SHAPE_CACHE) >= _SHAPE_CACHE_SIZE:
        del _SHAPE_CACHE[next(iter(_SHAPE_CACHE))]
    return _SHAPE_CACHE.setdefault(key, _ShapeFacts())


def _generated_bodies(renderer: _Renderer, template_messages: list[dict], indices: list[int], layout: TemplateLayout,
                      truncated: bool, prompts: list[str] | None = None, tails: list[str] | None = None,
                      readable: list[bool] | None = None) -> list[tuple[str, str, int]] | None:
    """Per assistant turn: (the header before it in any rendering, the turn as generated, how many
    headers a scan skips to reach it).

    Rendered in a small context: a probe user turn, plus the previous assistant turn and the tool
    results since, where the turn follows tools. None when the template does not extend the prompt.
    prompts, tails: receive each turn's small-context prompt (it ends in the turn's header) and the text
    after its span (the end-of-turn token of a truncated turn, a newline after it).
    readable: receives, per turn, whether its context's shape showed the prompt to be the turn's rendering
    up to its header, then the header.
    """
    bodies = []
    # What a context's shape tells, found on its first context and kept across conversations (_SHAPE_CACHE):
    # - the header and the headers to skip depend on the context's shape only (its roles and calls;
    #   message text cannot hold a control token);
    # - where the shape's first context's prompt was found to be the turn's rendering up to the turn's
    #   header (no generation prompt of its own, as in Qwen3, Kimi, Mistral): (the header's occurrences
    #   in the prompt, in the turn's rendering). The prompt of a later context of that shape is then read
    #   off the turn's rendering instead of rendered (one render per turn, not two), where the rendering
    #   holds the header as often as the shape's first did;
    # - whether that prompt is the turn's rendering up to the turn's header, then the header (whether or
    #   not the rendering goes on as the prompt does: DeepSeek closes the think block the prompt opens).
    facts = _shape_facts(renderer, layout)
    headers, readings, up_to_header = facts.headers, facts.readings, facts.up_to_header
    # Every turn after a user turn shares the probe context (the same in every conversation).
    probe = json.dumps([{"role": "user", "content": _PROBE_USER}], sort_keys=True)
    prompts_by_context: dict[str, str] = {} if facts.probe_prompt is None else {probe: facts.probe_prompt}
    for position, index in enumerate(indices):
        context = _small_context(template_messages, index)
        messages = context + [template_messages[index]]
        try:
            key = json.dumps(context, sort_keys=True, default=str)
            shape = tuple((message["role"], len(message.get("tool_calls") or []), bool(message.get("content")))
                          for message in context)
            rendered = None
            if key not in prompts_by_context and readings.get(shape) is not None:
                rendered = renderer.whole(messages)
                read = _read_prompt(rendered, headers[shape][0], readings[shape])
                if read is not None:
                    prompts_by_context[key] = read
            if key not in prompts_by_context:
                prompts_by_context[key] = renderer.prompt(context)
            prompt = prompts_by_context[key]
            if key == probe:
                facts.probe_prompt = prompt
            if shape not in headers:
                headers[shape] = _turn_header(renderer, context, prompt, layout)
            header, skip = headers[shape]
            if shape not in readings:
                rendered = renderer.whole(messages)
                readings[shape] = _prompt_reading(rendered, prompt, header, layout)
                context_header = _context_header(header)
                at = _find_nth(rendered, context_header, 0, prompt.count(context_header) - 1)
                up_to_header[shape] = at >= 0 and rendered[:at] + header == prompt
            turn = renderer.last(messages, prompt, rendered)
        except ChatTemplateError:
            return None  # the small context is not legal for this template: the oracle decides
        if not turn.startswith(prompt) or not prompt.endswith(header):
            return None
        end = _span_end(turn, len(prompt), layout.end_of_turn, truncated and position == len(indices) - 1)
        bodies.append((header, turn[len(prompt): end], skip))
        if prompts is not None and tails is not None:
            prompts.append(prompt)
            tails.append(turn[end:])
        if readable is not None:
            readable.append(up_to_header[shape])
    return bodies


def _prompt_reading(rendered: str, prompt: str, header: str, layout: TemplateLayout) -> tuple[int, int] | None:
    """(the context header's occurrences in `prompt`, in `rendered`) where `prompt` is `rendered` up to
    its last occurrence of the context header, then `header`: what `_read_prompt` needs; else None."""
    context_header = _context_header(header)
    if not _tokens_in(context_header, layout.control_tokens) or \
            prompt.rfind(context_header) != len(prompt) - len(header):
        return None
    reading = (prompt.count(context_header), rendered.count(context_header))
    return reading if _read_prompt(rendered, header, reading) == prompt else None


def _read_prompt(rendered: str, header: str, reading: tuple[int, int]) -> str | None:
    """A turn's prompt read off the turn's rendering: up to the context header's n-th occurrence, then
    the header; None where the rendering holds the context header another number of times, or does not
    extend what was read."""
    context_header = _context_header(header)
    before, total = reading
    if rendered.count(context_header) != total:
        return None
    at = _find_nth(rendered, context_header, 0, before - 1)
    prompt = rendered[:at] + header
    return prompt if at >= 0 and rendered.startswith(prompt) else None


def _turn_header(renderer: _Renderer, context: list[dict], prompt: str, layout: TemplateLayout) -> tuple[str, int]:
    """The header before an assistant turn that follows `context` (whose prompt is `prompt`), and how many
    of its occurrences among the context's tool results a scan skips."""
    without = renderer.whole(context)
    results_from = len(renderer.whole(context[:2])) if len(context) > 2 else 0
    # The header is what the generation prompt adds (`<|im_assistant|>assistant<|im_middle|>`), which
    # tells an assistant turn from any other; else the prompt's tail from its last control token.
    added = prompt[len(without):] if prompt.startswith(without) else ""
    header = added if _tokens_in(_context_header(added), layout.control_tokens) else _header(prompt, layout)
    # Where the header is a tool result's closing (DeepSeek, Mistral), each result writes one: the
    # turn starts after the last, so a scan skips the ones before it.
    skip = max(prompt.count(_context_header(header), results_from) - 1, 0) if results_from else 0
    return header, skip


def _context_header(header: str) -> str:
    """The header of a turn in its history form: without the think block the generation prompt opens."""
    for opener in ("<think>\n", "<think>"):
        if header.endswith(opener) and len(header) > len(opener):
            return header[: -len(opener)]
    return header


def _header(prompt: str, layout: TemplateLayout) -> str:
    """The end of a prompt from its last control token: what precedes a turn's body in any rendering."""
    last = -1
    body = prompt
    for opener in ("<think>\n", "<think>"):
        if prompt.endswith(opener):
            body = prompt[: -len(opener)]
            break
    for token in layout.control_tokens:
        at = body.rfind(token)
        if at > last:
            last = at
    return prompt[last:] if last >= 0 else prompt[-16:]


def _locate_group(text: str, bodies: list[tuple[str, str, int]], first: int, last: int,
                  layout: TemplateLayout, cursor: int = 0, context_from: int = 0) -> _Rendered | int | None:
    """Spans of turns first..last (as generated) in `text` from `cursor` on; turns context_from..first-1
    before them are context, found by header.

    Returns the rendering with its spans, or the position of the first turn not found as generated
    (None when even the context turns cannot be followed).
    """
    for position in range(context_from, first):
        header = _context_header(bodies[position][0])
        at = _find_nth(text, header, cursor, bodies[position][2])
        if at < 0:
            return None
        start = at + len(header)
        cursor = _span_end(text, start, layout.end_of_turn, False)
    return _locate_turns(text, bodies, first, last, cursor)


def _locate_turns(text: str, bodies: list[tuple[str, str, int]], first: int, last: int,
                  cursor: int) -> _Rendered | int:
    """Spans of turns first..last as generated in `text` from `cursor` on, or the first turn not found."""
    rendered = _Rendered(text)
    for position in range(first, last + 1):
        header, body, _ = bodies[position]
        at = text.find(header + body, cursor)
        if at < 0:
            return position
        start = at + len(header)
        rendered.spans.append((start, start + len(body)))
        cursor = start + len(body)
    return rendered


def _find_nth(text: str, needle: str, start: int, skip: int) -> int:
    """Position of the (skip+1)-th occurrence of `needle` at or after `start`, or -1."""
    at = text.find(needle, start)
    for _ in range(skip):
        if at < 0:
            return -1
        at = text.find(needle, at + len(needle))
    return at


def _locate_visible(text: str, bodies: list[tuple[str, str, int]], layout: TemplateLayout,
                    truncated: bool) -> _Rendered | None:
    """Spans of every turn as `text` shows it: as generated where it is, else header to end-of-turn."""
    rendered = _Rendered(text)
    cursor = 0
    for position, (header, body, skip) in enumerate(bodies):
        context_header = _context_header(header)  # a history turn has no think opener before it
        at = text.find(header + body, cursor)
        next_header = _find_nth(text, context_header, cursor, skip)
        if at >= 0 and at == next_header:
            start, end = at + len(header), at + len(header) + len(body)
        elif next_header >= 0:
            start = next_header + len(context_header)
            end = _span_end(text, start, layout.end_of_turn, truncated and position == len(bodies) - 1)
        else:
            return None
        rendered.spans.append((start, end))
        cursor = end
    if truncated:
        rendered.text = text[: rendered.spans[-1][1]]
    return rendered


def mask_html(tokenizer: Any, sample: TokenizedConversation, max_tokens: int = 600) -> str:
    """A sample as HTML: trained tokens (loss_mask 1) highlighted, control tokens boxed."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    parts = []
    for token_id, mask in list(zip(sample.input_ids, sample.loss_mask))[:max_tokens]:
        text = html.escape(tokenizer.decode([token_id]))
        style = "background:#c6f6c6;" if mask else ""
        if token_id in special:
            style += "border:1px solid #888;"
        parts.append(f'<span style="{style}">{text}</span>' if style else text)
    more = "" if len(sample.input_ids) <= max_tokens else f"… ({len(sample.input_ids) - max_tokens} more tokens)"
    return ('<pre style="white-space:pre-wrap;font-size:11px">' + "".join(parts) + more + "</pre>")
