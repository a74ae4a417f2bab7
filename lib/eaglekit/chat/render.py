"""Rendering marked template messages through the tokenizer's chat template: a prompt (with the generation
prompt), a conversation as history, and a conversation's last assistant turn written as the target
generated it (`Renderer.last`), where needed after the turn's smallest context (`small_context`)."""

from __future__ import annotations

from typing import Any

from eaglekit.chat.messages import fold_reasoning
from eaglekit.chat.template import PROBE_USER, ChatTemplateError, NotPrefixStableError, TemplateLayout


def render_template(tokenizer: Any, messages: list[dict], add_generation_prompt: bool, tools: list | None,
                    template_kwargs: dict) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             tools=tools or None, **template_kwargs)
    except ChatTemplateError:
        raise
    except Exception as error:  # jinja's TemplateError, raise_exception(), a TypeError inside the template
        raise ChatTemplateError(f"the chat template cannot render this conversation: {type(error).__name__}: "
                                f"{error}") from None


def _strip_private(messages: list[dict]) -> list[dict]:
    return [{key: value for key, value in message.items() if key != "_reasoning"} for message in messages]


class Renderer:
    """Renders marked template messages for one tokenizer, layout, tool list and template kwargs."""

    def __init__(self, tokenizer: Any, layout: TemplateLayout, tools: list | None, template_kwargs: dict):
        self.tokenizer, self.layout, self.tools, self.kwargs = tokenizer, layout, tools, template_kwargs

    def prompt(self, messages: list[dict]) -> str:
        return render_template(self.tokenizer, _strip_private(messages), True, self.tools, self.kwargs)

    def whole(self, messages: list[dict]) -> str:
        """messages rendered as history, without a generation prompt."""
        return render_template(self.tokenizer, _strip_private(messages), False, self.tools, self.kwargs)

    def last(self, messages: list[dict], prompt: str | None = None, rendered: str | None = None) -> str:
        """messages ending in an assistant turn, that turn written as the target generated it.

        Where the next message's role token closes a turn (GLM-4.6), that token ends it: the model
        generated it to stop (`TemplateLayout.closer`).

        Where the template's rendering of the turn does not extend its prompt (Mistral drops the system
        prompt once the conversation ends in an assistant turn; DeepSeek-R1 renders a tool call after
        tool output under another header), the turn as the template writes it in a small context is
        appended to the prompt the server actually sent. rendered: `messages` already rendered (no
        generation prompt), where the caller has it.
        """
        return self._as_generated(messages, prompt, rendered) + self.layout.closer(messages[-1])

    def _as_generated(self, messages: list[dict], prompt: str | None, rendered: str | None) -> str:
        prompt = self.prompt(messages[:-1]) if prompt is None else prompt
        try:
            turn = self._last(messages, prompt, rendered)
            if turn.startswith(prompt):
                return turn
        except NotPrefixStableError:
            pass
        context = small_context(messages, len(messages) - 1)
        if context == messages[:-1]:  # already the smallest context: nothing else to try
            raise NotPrefixStableError("the chat template's rendering of this turn does not extend its prompt")
        small_prompt = self.prompt(context)
        small = self._last(context + [messages[-1]], small_prompt)
        if small.startswith(small_prompt):
            return prompt + small[len(small_prompt):]
        turn = _after_whitespace_change(small, small_prompt, self.layout.control_tokens)
        if turn is None:
            raise NotPrefixStableError("the chat template's rendering of this turn does not extend its prompt, "
                                       "even in a two-message conversation")
        return prompt + turn

    def _last(self, messages: list[dict], prompt: str, rendered: str | None = None) -> str:
        full = self.whole(messages) if rendered is None else rendered
        if self.layout.reasoning != "splice":
            return full
        reasoning = messages[-1].get("_reasoning", "")
        if full.startswith(prompt):
            rest = full[len(prompt):]
            if not reasoning or f"<think>{reasoning}" in rest or f"<think>\n{reasoning}" in rest:
                return full
            opened = prompt.endswith(("<think>", "<think>\n"))
            if opened and rest.startswith(reasoning):
                # written inside the block the prompt opened (Kimi-K2.5)
                return full
            # The prompt opens the think block and the template closes it blank (Kimi-K2.5's history form
            # "<think></think>", which extends the prompt's "<think>"): the model wrote its reasoning there.
            for blank in ("</think>", "\n</think>"):
                if opened and rest.startswith(blank):
                    return prompt + reasoning + rest
            # The template blanks the turn's think block (Kimi thinking on a final answer): fill it.
            for empty, filled in (("<think></think>", f"<think>{reasoning}</think>"),
                                  ("<think>\n\n</think>\n\n", f"<think>\n{reasoning}\n</think>\n\n")):
                if rest.startswith(empty):
                    return prompt + filled + rest[len(empty):]
            if prompt.endswith("</think>"):
                raise ChatTemplateError("this turn has reasoning but the template's generation prompt closes the "
                                        "think block (thinking off): set the template's thinking flag in "
                                        "prep.chat_template_kwargs")
            # No think block and none opened by the prompt (DeepSeek-R1 after tool
            # output): the model wrote it.
            return prompt + fold_reasoning(reasoning, "") + rest
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


def _after_whitespace_change(rendered: str, prompt: str, control_tokens: tuple[str, ...]) -> str | None:
    """The turn in `rendered` (a turn's rendering that does not extend its prompt) where the two differ
    before the turn only in whitespace (Hermes-3 tool_use closes the last tool result with
    `</tool_response><|im_end|>`, and with `</tool_response>\n<|im_end|>` once a turn follows): what
    follows the prompt's generation prompt (from its last control token) at the same place in the
    rendering. None where anything but whitespace differs."""
    at = max((prompt.rfind(token) for token in control_tokens), default=-1)
    if at < 0:
        return None
    header = prompt[at:]
    found = rendered.rfind(header)
    if found < 0 or "".join(rendered[:found].split()) != "".join(prompt[:at].split()):
        return None
    return rendered[found + len(header):]


def small_context(template_messages: list[dict], index: int) -> list[dict]:
    """The least context that renders turn `index` as in the conversation: a probe user turn, plus the
    previous assistant turn (without reasoning) and the tool results since, where the turn follows tools."""
    probe = {"role": "user", "content": PROBE_USER}
    caller = index - 1
    while caller >= 0 and template_messages[caller]["role"] == "tool":
        caller -= 1
    if caller < index - 1:
        keep_from = caller if caller >= 0 and template_messages[caller]["role"] == "assistant" else caller + 1
        # Without their reasoning, so no template rewrites the context (Kimi blanks it once a
        # final answer follows).
        return [probe, *({key: value for key, value in message.items() if key not in ("reasoning_content", "_reasoning")}
                         for message in template_messages[keep_from:index])]
    return [probe]
