"""Prompt prep and survey: ids, dedup, class split, partitions, rejects, fail policy, atomic outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

import eaglekit.data.prep as prep
from eaglekit.chat import prompt_token_count, tokenize_conversation
from eaglekit.io import InputError
from eaglekit.data.prep import content_hash, conversation_id, prepare_sources
from eaglekit.data.sources import SourceSpec
from eaglekit.data.survey import plot_survey, save_survey, survey_sources

DATA = Path(__file__).resolve().parents[1] / "fixtures" / "data"


@pytest.fixture(scope="module")
def tokenizer(embedded_model_dir):
    return AutoTokenizer.from_pretrained(embedded_model_dir)


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


SPECS = [
    SourceSpec(name="chat_a", format="sharegpt", path=str(DATA / "sharegpt.jsonl"), data_class="A"),
    SourceSpec(name="tools_b", format="openai", path=str(DATA / "openai.jsonl"), multi_turn="last_user"),
    SourceSpec(name="alpaca_b", format="alpaca", path=str(DATA / "alpaca.json")),
    SourceSpec(name="bad_b", format="sharegpt", path=str(DATA / "bad.jsonl")),
]


def test_prep_writes_contract_files_with_stable_ids_dedup_and_partitions(tokenizer, tmp_path):
    out = tmp_path / "prep"
    summary = prepare_sources(SPECS, tokenizer, out, context_length=256, long_prompt_threshold=40)
    table = summary.table().set_index("source")
    # Class A: one duplicate (sg1-dup) inside the source, three tokenized conversations.
    assert table.loc["chat_a", "duplicates"] == 1 and table.loc["chat_a", "kept"] == 3
    tokenized = read_lines(out / "chat_a" / "tokenized_data.jsonl")
    assert set(tokenized[0]) == {"id", "input_ids", "loss_mask", "source", "meta"}
    first_messages = [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6"},
    ]
    assert tokenized[0]["id"] == conversation_id("chat_a", content_hash(first_messages))
    expected = tokenize_conversation(tokenizer, first_messages).samples[0]
    assert tokenized[0]["input_ids"] == expected.input_ids and tokenized[0]["loss_mask"] == expected.loss_mask
    # Class B, first_user: record 3 keeps its system prompt and first user turn, so it does not
    # duplicate record 2 (same first question, different system prompt).
    prompts = {
        p: read_lines(f)
        for p in ("short", "long")
        for f in [out / "alpaca_b" / f"prompts.{p}.jsonl"]
        if f.exists()
    }
    all_prompts = [r for rows in prompts.values() for r in rows]
    assert len(all_prompts) == 3
    for record in all_prompts:
        assert record["messages"][-1]["role"] == "user"
        measured = prompt_token_count(tokenizer, record["messages"])
        assert record["meta"]["prompt_tokens"] == measured
        assert record["meta"]["partition"] == ("short" if measured <= 40 else "long")
    # last_user keeps earlier turns as context and ends on the last user turn.
    tools = [
        r
        for p in ("short", "long")
        if (out / "tools_b" / f"prompts.{p}.jsonl").exists()
        for r in read_lines(out / "tools_b" / f"prompts.{p}.jsonl")
    ]
    assert [m["role"] for m in tools[0]["messages"]] == ["system", "user"]
    assert table.loc["alpaca_b", "short"] + table.loc["alpaca_b", "long"] == 3
    assert json.loads((out / "summary.json").read_text())["long_prompt_threshold"] == 40
    # Re-running gives the same ids (stable: source + content hash, not line numbers).
    again = tmp_path / "again"
    prepare_sources(list(reversed(SPECS)), tokenizer, again, context_length=256, long_prompt_threshold=40)
    assert [r["id"] for r in read_lines(again / "chat_a" / "tokenized_data.jsonl")] == [
        r["id"] for r in tokenized
    ]


def test_skip_policy_lists_every_bad_case_with_file_line_and_reason(tokenizer, tmp_path):
    out = tmp_path / "prep"
    summary = prepare_sources(SPECS[3:], tokenizer, out, context_length=256, long_prompt_threshold=40)
    rejects = read_lines(out / "rejects.jsonl")
    by_line = {r["line"]: r for r in rejects}
    assert sorted(by_line) == [2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert all(r["file"] == str(DATA / "bad.jsonl") and r["source"] == "bad_b" for r in rejects)
    assert by_line[10]["reason"].startswith("longer than the context")
    reasons = summary.rejects_by_reason().set_index("reason")["count"].to_dict()
    assert reasons["longer than the context"] == 1 and reasons["malformed JSON"] == 1
    assert summary.table().iloc[0]["kept"] == 1


def test_fail_policy_stops_at_the_first_bad_record_and_writes_nothing(tokenizer, tmp_path):
    out = tmp_path / "prep"
    with pytest.raises(InputError) as raised:
        prepare_sources(SPECS, tokenizer, out, context_length=256, long_prompt_threshold=40, bad_input="fail")
    assert raised.value.path == str(DATA / "bad.jsonl") and raised.value.line == 2
    assert "bad.jsonl:2" in str(raised.value)
    assert not out.exists() and not list(tmp_path.iterdir())


def test_fail_policy_names_the_field(tokenizer, tmp_path):
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps({"conversations": [{"from": "human", "value": 3}]}) + "\n")
    spec = SourceSpec(name="one", format="sharegpt", path=str(path))
    with pytest.raises(InputError, match=r"one.jsonl:1: field 'conversations\[0\].value'"):
        prepare_sources(
            [spec],
            tokenizer,
            tmp_path / "out",
            context_length=256,
            long_prompt_threshold=40,
            bad_input="fail",
        )


def test_interrupted_prep_keeps_the_previous_output_whole(tokenizer, tmp_path, monkeypatch):
    out = tmp_path / "prep"
    prepare_sources(SPECS[:1], tokenizer, out, context_length=256, long_prompt_threshold=40)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    calls = {"n": 0}
    real = prep.tokenize_conversation

    def crash_on_second(tokenizer_, messages, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(tokenizer_, messages, **kwargs)

    monkeypatch.setattr(prep, "tokenize_conversation", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        prepare_sources(SPECS, tokenizer, out, context_length=256, long_prompt_threshold=40)
    after = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert after == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prep"]  # no staging folder left behind


def test_cross_source_duplicates_counted_on_the_later_source(tokenizer, tmp_path):
    specs = [
        SourceSpec(name="first", format="sharegpt", path=str(DATA / "sharegpt.jsonl")),
        SourceSpec(name="second", format="sharegpt", path=str(DATA / "sharegpt.jsonl")),
    ]
    table = (
        prepare_sources(specs, tokenizer, tmp_path / "p", context_length=512, long_prompt_threshold=1000)
        .table()
        .set_index("source")
    )
    assert table.loc["first", "duplicates"] == 1  # sg1-dup repeats sg1's first user turn
    assert table.loc["second", "duplicates"] == 4 and table.loc["second", "kept"] == 0


def test_survey_statistics_plots_and_saved_tables(tokenizer, tmp_path):
    result = survey_sources(SPECS, tokenizer, context_length=256, long_prompt_threshold=40)
    summary = result.summary.set_index("source")
    assert summary.loc["chat_a", "rows_read"] == 4 and summary.loc["chat_a", "duplicates"] == 1
    assert summary.loc["bad_b", "rejected"] == 8  # line 10 is only over the context, not malformed
    assert summary.loc["bad_b", "over_context_share"] == 0.5  # 1 of its 2 readable conversations
    assert summary.loc["alpaca_b", "short"] + summary.loc["alpaca_b", "long"] == 3
    chat = result.lengths[result.lengths.source == "chat_a"]
    assert list(chat.turns) == [4, 3, 4]  # sg2 has a system turn
    assert summary.loc["chat_a", "prompt_tokens_max"] == chat.prompt_tokens.max()
    assert set(result.rejects.reason) >= {
        "malformed JSON",
        "not UTF-8",
        "unknown role",
        "two user turns in a row",
        "no user turn",
        "missing field",
        "wrong type",
        "empty content",
    }
    figures = plot_survey(result, tmp_path / "figures")
    assert all(p.stat().st_size > 1000 for p in figures)
    saved = save_survey(result, tmp_path)
    assert all(p.exists() for p in saved)


def test_prep_killed_mid_run_leaves_no_staging_folder_after_the_next_run(
    tokenizer, tmp_path, embedded_model_dir
):
    """kill -9 during prep leaves its staging folder; the next prep removes it (its process is dead)."""
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "prep"
    script = f"""
import time
import eaglekit.data.prep as prep
from transformers import AutoTokenizer
from eaglekit.data.sources import SourceSpec
real = prep.tokenize_conversation
def slow(*args, **kwargs):
    time.sleep(30)
    return real(*args, **kwargs)
prep.tokenize_conversation = slow
spec = SourceSpec(name="chat_a", format="sharegpt", path={str(DATA / "sharegpt.jsonl")!r}, data_class="A")
prep.prepare_sources([spec], AutoTokenizer.from_pretrained({str(embedded_model_dir)!r}), {str(out)!r},
                     context_length=256, long_prompt_threshold=40)
"""
    process = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".prep.staging-*")) and time.monotonic() < deadline:
        time.sleep(0.1)
    staged = list(tmp_path.glob(".prep.staging-*"))
    process.send_signal(signal.SIGKILL)
    process.wait(10)
    assert staged and all(path.exists() for path in staged)  # what kill -9 leaves behind
    prepare_sources(SPECS[:1], tokenizer, out, context_length=256, long_prompt_threshold=40)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["prep"]
    assert json.loads((out / "summary.json").read_text())["sources"][0]["kept"] == 3


def test_a_conversation_the_template_cannot_render_is_a_located_reject_not_a_failed_stage(
    tmp_path, embedded_model_dir
):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from support import fixture_tokenizer

    gemma = fixture_tokenizer(embedded_model_dir, "gemma")  # refuses system prompts
    path = tmp_path / "a.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"},
            ]
        },
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    spec = SourceSpec(name="a", format="openai", path=str(path), data_class="A")
    summary = prepare_sources([spec], gemma, tmp_path / "prep", context_length=256, long_prompt_threshold=40)
    assert summary.table().iloc[0]["kept"] == 1 and summary.table().iloc[0]["template"] == "gemma"
    rejects = read_lines(tmp_path / "prep" / "rejects.jsonl")
    assert [(r["file"], r["line"], r["record"]) for r in rejects] == [(str(path), 2, 2)]
    assert "System role not supported" in rejects[0]["reason"]
    with pytest.raises(InputError, match=r"a.jsonl:2: field 'messages': chat template"):
        prepare_sources(
            [spec], gemma, tmp_path / "prep2", context_length=256, long_prompt_threshold=40, bad_input="fail"
        )


@pytest.mark.parametrize("template", ["qwen3", "kimi_k2_thinking"])
def test_class_a_with_reasoning_and_tool_calls_on_a_thinking_template_split_and_counted(
    tmp_path, embedded_model_dir, template
):
    """Issue 12's done-when: DeepSWE-like class A on Qwen3 and Kimi thinking templates, nothing
    silently dropped."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from support import fixture_tokenizer

    qwen3 = fixture_tokenizer(embedded_model_dir, template)
    record = {
        "tools": [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}],
        "messages": [
            {"role": "user", "content": "Fix the test."},
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": "Run it first.",
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "bash", "arguments": '{"cmd": "pytest"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "1 failed"},
            {"role": "assistant", "content": "Fixed.", "reasoning_content": "Patch the loop."},
            {"role": "user", "content": "Thanks"},
            {"role": "assistant", "content": "Welcome.", "reasoning_content": "Be polite."},
        ],
    }
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps(record) + "\n")
    spec = SourceSpec(name="swe", format="openai", path=str(path), data_class="A")
    for history, samples in (("split", 2), ("visible", 1)):
        out = tmp_path / history
        summary = prepare_sources(
            [spec], qwen3, out, context_length=1024, long_prompt_threshold=40, history=history
        )
        written = read_lines(out / "swe" / "tokenized_data.jsonl")
        assert len(written) == samples
        if samples > 1:
            assert {r["meta"]["conversation_id"] for r in written} == {written[0]["id"].rsplit(".", 1)[0]}
        text = "".join(
            qwen3.decode([t for t, m in zip(r["input_ids"], r["loss_mask"]) if m]) for r in written
        )
        assert ("Run it first." in text and "Patch the loop." in text) == (history == "split")
        assert (
            '"name": "bash"' if template == "qwen3" else '{"cmd": "pytest"}'
        ) in text and "Be polite." in text
        counts = json.loads((out / "summary.json").read_text())["sources"][0]
        assert (counts["trained_tokens"] == counts["generated_tokens"]) == (history == "split")
        assert summary.table().iloc[0]["split"] == (history == "split")


def test_a_dataset_answer_the_template_cannot_render_keeps_its_prompt_and_is_listed(
    tmp_path, embedded_model_dir
):
    """The ablation's original answers fail per record too: DeepSeek-V3.1 (thinking off) has no
    place for reasoning."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from support import fixture_tokenizer

    v31 = fixture_tokenizer(embedded_model_dir, "deepseek_v31")
    path = tmp_path / "ps.jsonl"
    path.write_text(
        json.dumps({"problem": "2+2?", "solution": "<think>two and two</think>4"})
        + "\n"
        + json.dumps({"problem": "3+3?", "solution": "6"})
        + "\n"
    )
    spec = SourceSpec(name="ps", format="problem_solution", path=str(path))
    summary = prepare_sources([spec], v31, tmp_path / "prep", context_length=256, long_prompt_threshold=40)
    assert summary.table().iloc[0]["kept"] == 2 and summary.sources[0].original_rejected == 1
    assert len(read_lines(tmp_path / "prep" / "ps" / "original_tokenized_data.jsonl")) == 1
    rejects = read_lines(tmp_path / "prep" / "rejects.jsonl")
    assert [(r["line"], r["reason"].split(":")[0]) for r in rejects] == [
        (1, "chat template (dataset answer, prompt kept)")
    ]
    with pytest.raises(InputError, match="ps.jsonl:1: .*dataset answer"):
        prepare_sources(
            [spec], v31, tmp_path / "prep2", context_length=256, long_prompt_threshold=40, bad_input="fail"
        )


def test_a_turn_the_template_leaves_undefined_is_listed_and_counted_while_the_others_train(
    tmp_path, embedded_model_dir
):
    """MiniMax-M2 opens `<think>` in its generation prompt: an answer without reasoning is undefined there.
    The conversation is kept, its other turns train, and the undefined turn is counted and listed with
    file, line, field."""
    from support import fixture_tokenizer

    minimax = fixture_tokenizer(embedded_model_dir, "minimax_m2")
    record = {
        "messages": [
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4.", "reasoning_content": "Two plus two."},
            {"role": "user", "content": "And 3+3?"},
            {"role": "assistant", "content": "6."},
            {"role": "user", "content": "And 4+4?"},
            {"role": "assistant", "content": "8.", "reasoning_content": "Four plus four."},
        ]
    }
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps(record) + "\n")
    spec = SourceSpec(name="mm", format="openai", path=str(path), data_class="A")
    summary = prepare_sources(
        [spec], minimax, tmp_path / "prep", context_length=1024, long_prompt_threshold=40
    )
    row = summary.table().iloc[0]
    assert (row["kept"], row["rejected"], row["rejected turns"]) == (1, 0, 1)
    rejects = read_lines(tmp_path / "prep" / "rejects.jsonl")
    assert [(r["file"], r["line"], r["field"]) for r in rejects] == [(str(path), 1, "messages[3]")]
    written = read_lines(tmp_path / "prep" / "mm" / "tokenized_data.jsonl")
    trained = "".join(
        minimax.decode([t for t, m in zip(r["input_ids"], r["loss_mask"]) if m]) for r in written
    )
    assert "Two plus two." in trained and "Four plus four." in trained and "6." not in trained
