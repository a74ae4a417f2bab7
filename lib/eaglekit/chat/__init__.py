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
(`split._Composer`): a history rendering up to an anchor turn (the full rendering, or for a long stretch of
tool rounds the stretch's own), then the rest rendered in a small context, or read off a rendering
already made where probes of the template say it reads the same there (one small rendering per stretch
of tool rounds; the history rendering for a turn right after its anchor); group ends are confirmed
with the oracle's own criterion on the composed texts; samples reuse the tokens of the sample before
them or of the history rendering, whichever they share more text with (for tokenizers that split
text at control tokens first, as byte-level BPE does). Each conversation gets real checks (the last sample is
the full rendering, the one before it its prompt rendered whole); where a check or a search fails, each sample
is rendered whole. A template that moves text it wrote earlier (Mistral: the tools before the last user
message, the system prompt inside it while it is the last message) changes earlier turns' context where no
span shows it: there every turn's prompt is composed (`injected.injected_groups`: the history before its last
user message from the full rendering, the rest from one small rendering per stretch, with the system
prompt and tools) and samples are cut with the oracle's own criterion on the composed texts, checked
against the last turn's prompt and the sample before the last rendered whole. Where a check fails, or
two user messages are equal (Mistral finds the last one by equality), the conversation goes to the
oracle, counted in `ConversationSamples.fallback`. tests/chat/test_templates.py
checks both paths agree token for token, sample for sample, on every published template in
tests/fixtures/chat_templates; bench/tokenize_mask.py measures the speed ratio.

End of turn: the template's end-of-turn token closes each trained turn. A template that writes none
(GLM-4.6) closes a turn with the next message's role token, which the model generates as its stop token
(`<|user|>` after an answer, `<|observation|>` after tool calls; `TemplateLayout.next_turn_closes`): that
token is the turn's trained end, appended where the turn is the conversation's last. A turn that has no
definition as generated (its rendering does not extend its prompt even in its smallest context: MiniMax-M2
without reasoning after its `<think>` prompt) is not trained and is listed in
`ConversationSamples.rejected_turns`; the conversation's other turns are. A template that renders only with
tool definitions (Hermes-3 tool_use) is probed with the conversation's tools. A system message after a turn
goes to the oracle where the probe says it changes earlier prompts (DeepSeek-V3.1 gathers system messages
at the beginning: `TemplateLayout.stable_with_late_system`).

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
blank `<think></think>` is filled, Kimi-K2.5's history `<think></think>` after a prompt that opens
`<think>` gets the reasoning inside that block, and after a generation prompt that opens `<think>`
(DeepSeek-R1, V3.1 with `thinking`) the turn is written as generated: `{reasoning}\\n</think>\\n\\n` (or
`{reasoning}</think>`), then the rest of the turn as the template writes it.

Tool calls stay structured (OpenAI shape: `tool_calls` of `{"id", "type": "function", "function":
{"name", "arguments"}}`, `tool_call_id` on tool results) and are rendered only by the template, with
`tools=` the record's tool definitions. Arguments go to the template as an object, or as a JSON string
for templates that concatenate them (DeepSeek), probed once. A template with no tool-call syntax
(SmolLM2, Phi-3.5, Gemma) gets the calls as Hermes `<tool_call>` text in the content, so they are
trained rather than silently dropped.

Modules, in dependency order: `template` (errors, probe words, `TemplateLayout`, string search helpers),
`messages` (kit schema -> template messages, control tokens marked), `render` (a rendering, a
turn as generated), `layout` (the template probe), `tokens` (tokens and loss mask of a rendering),
`prompts` (a prompt's text and tokens, a class-B answer), `reference` (the oracle), `turns` (each turn
as generated, from a small rendering, and finding those turns in a rendering), `injected` and
`split` (the split samples of templates that move or rewrite earlier text), `fast` (the fast path).
"""

from eaglekit.chat.fast import tokenize_conversation
from eaglekit.chat.layout import template_family, template_layout
from eaglekit.chat.messages import format_tool_call, normalize_tools
from eaglekit.chat.prompts import prompt_token_count, prompt_token_ids, render_conversation, tokenize_answer
from eaglekit.chat.reference import tokenize_conversation_reference
from eaglekit.chat.template import (
    HISTORY_POLICIES,
    ChatTemplateError,
    HistoryPolicy,
    NotPrefixStableError,
    TemplateLayout,
)
from eaglekit.chat.tokens import ConversationSamples, TokenizedConversation, mask_html
