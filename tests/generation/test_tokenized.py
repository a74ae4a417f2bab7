"""build_tokenized_data: generations -> tokenized_data.jsonl, per-record rejects, the usage check, truncation.

Generation records are written directly (the fields the engine writes) where no server is needed;
the raw-token-id tests run the engine against the fault endpoint, and one slow test against the real
embedded server checks the kit's rendering against the server's own usage counts.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fault_endpoint import FaultEndpoint, FaultOptions  # noqa: E402
from support import write_prompts  # noqa: E402  (prompts as stage 2 writes them)
from support import fixture_tokenizer  # noqa: E402

from eaglekit.chat import prompt_token_count, tokenize_conversation  # noqa: E402
from eaglekit.generation.client import EndpointSpec  # noqa: E402
from eaglekit.config import GenerationParams, PartitionParams  # noqa: E402
from eaglekit.generation import PromptSource, generate, read_generations  # noqa: E402
from eaglekit.io import InputError, read_jsonl  # noqa: E402
from eaglekit.generation.tokenized import (  # noqa: E402
    TRUNCATION_BOUNDARY_TOKENS,
    UsageMismatchError,
    build_tokenized_data,
    check_first_answers,
)


FAST = dict(
    retry=GenerationParams(max_attempts=4, backoff_base_s=0.01, backoff_max_s=0.05),
    log_interval_s=0.2,
    flush_interval_s=0.05,
    health_interval_s=0.05,
    progress_bar=False,
    probe_wait_s=10.0,
)


@pytest.fixture(scope="module")
def tokenizer(embedded_model_dir):
    return AutoTokenizer.from_pretrained(embedded_model_dir)


def write_answers(output: Path, prompts: Path, answers: dict[str, dict], dataset: str = "ds") -> None:
    """generations.jsonl as the engine writes it: one record per answered prompt."""
    output.mkdir(parents=True, exist_ok=True)
    with open(output / "generations.jsonl", "w") as handle:
        for _, conversation in read_jsonl(prompts):
            answer = answers.get(conversation["id"])
            if answer is None:
                continue
            record = {
                "dataset": dataset,
                "id": conversation["id"],
                "partition": "short",
                "endpoint": "e",
                "attempts": 1,
                "latency_s": 0.1,
                "prompt_tokens": None,
                "completion_tokens": None,
                "finish_reason": "stop",
                "truncated": False,
                "flags": [],
                "finished_at": 0.0,
                "content": "",
                "reasoning": None,
                "prompt_token_ids": None,
                "token_ids": None,
                **answer,
            }
            handle.write(json.dumps(record) + "\n")


def conversation_file(path: Path, conversations: list[list[dict]]) -> Path:
    with open(path, "w") as handle:
        for index, messages in enumerate(conversations):
            handle.write(
                json.dumps({"id": f"p{index}", "source": "test", "messages": messages, "meta": {}}) + "\n"
            )
    return path


def masked(tokenizer, sample: dict) -> str:
    return tokenizer.decode([t for t, m in zip(sample["input_ids"], sample["loss_mask"]) if m])


# -------------------------------------------------------------------------------------------------
# From the server's raw token ids (fault endpoint)


@pytest.mark.parametrize("dialect", ["vllm", "sglang", None])
def test_raw_token_ids_first_else_a_tokenizer_is_required(tmp_path, dialect):
    prompts = write_prompts(tmp_path / "prompts.jsonl", ["hello", "think only #fault:think"])
    with FaultEndpoint(FaultOptions(token_ids=dialect, reasoning_field="reasoning")) as endpoint:
        generate(
            [PromptSource("ds", "short", prompts)],
            [EndpointSpec(endpoint.base_url)],
            tmp_path / "out",
            [PartitionParams(name="short", concurrency=2, max_tokens=16)],
            **FAST,
        )
    record = read_generations(tmp_path / "out")[("ds", "p0")]
    if dialect:
        tokenized = build_tokenized_data(
            tmp_path / "out", [PromptSource("ds", "short", prompts)], tmp_path / "tok"
        )
        sample = next(iter(read_jsonl(tokenized.files["ds"])))[1]
        assert sample["input_ids"] == record["prompt_token_ids"] + record["token_ids"]
        assert sample["loss_mask"] == [0] * len(record["prompt_token_ids"]) + [1] * len(record["token_ids"])
        assert sample["meta"]["token_source"] == "target" and sample["meta"]["n"] == 0
        assert tokenized.from_token_ids == 2 and tokenized.compared == 0
        # The fault server's usage counts characters, as its token ids do: every record checked, none off.
        assert tokenized.usage_checked == {"ds": 2} and tokenized.usage_disagreements == {"ds": 0}
    else:
        with pytest.raises(ValueError, match="pass the target's tokenizer"):
            build_tokenized_data(tmp_path / "out", [PromptSource("ds", "short", prompts)], tmp_path / "tok")


def test_truncated_and_flag_policies_when_building_training_data(tmp_path):
    prompts = write_prompts(
        tmp_path / "prompts.jsonl", ["fine", "cut #fault:length", "looping #fault:loop", "bad #fault:400"]
    )
    source = [PromptSource("ds", "short", prompts)]
    with FaultEndpoint(FaultOptions(token_ids="sglang")) as endpoint:
        generate(
            source,
            [EndpointSpec(endpoint.base_url)],
            tmp_path / "out",
            [PartitionParams(name="short", concurrency=2, max_tokens=16)],
            **FAST,
        )
    keep = build_tokenized_data(tmp_path / "out", source, tmp_path / "keep")
    assert keep.written == {"ds": 3} and keep.missing == {"ds": 1}
    samples = {record["id"]: record for _, record in read_jsonl(keep.files["ds"])}
    assert samples["p1"]["meta"]["truncated"] and "repetition_loop" in samples["p2"]["meta"]["flags"]
    drop = build_tokenized_data(
        tmp_path / "out", source, tmp_path / "drop", truncated_policy="drop", drop_flags=["repetition_loop"]
    )
    assert drop.written == {"ds": 1} and drop.dropped == {"ds": {"truncated": 1, "repetition_loop": 1}}
    with pytest.raises(ValueError, match="truncated_policy"):
        build_tokenized_data(tmp_path / "out", source, tmp_path / "x", truncated_policy="retry")


# -------------------------------------------------------------------------------------------------
# By the chat template


def test_prompt_quoting_chatml_is_tokenized_as_text_not_a_failed_stage(tmp_path, tokenizer):
    """Issue 13: a prompt quoting `<|im_start|>assistant` passed prep, then failed every build."""
    quote = "What does <|im_start|>assistant mean in a ChatML transcript?"
    prompts = conversation_file(tmp_path / "prompts.jsonl", [[{"role": "user", "content": quote}]])
    write_answers(tmp_path / "out", prompts, {"p0": {"content": "It opens an assistant turn."}})
    tokenized = build_tokenized_data(
        tmp_path / "out", [PromptSource("ds", "short", prompts)], tmp_path / "tok", tokenizer=tokenizer
    )
    sample = next(iter(read_jsonl(tokenized.files["ds"])))[1]
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert sample["input_ids"].count(im_start) == 3  # system, user and assistant headers: not the quote
    assert quote in tokenizer.decode(sample["input_ids"])
    assert masked(tokenizer, sample) == "It opens an assistant turn.<|im_end|>"


def test_truncated_answer_gets_no_end_of_turn_token(tmp_path, tokenizer):
    prompts = conversation_file(tmp_path / "prompts.jsonl", [[{"role": "user", "content": "Count to ten."}]])
    content = "one two three four five six seven eight"
    write_answers(
        tmp_path / "out", prompts, {"p0": {"content": content, "finish_reason": "length", "truncated": True}}
    )
    tokenized = build_tokenized_data(
        tmp_path / "out", [PromptSource("ds", "short", prompts)], tmp_path / "tok", tokenizer=tokenizer
    )
    sample = next(iter(read_jsonl(tokenized.files["ds"])))[1]
    # The sample ends at the answer's last token; the tokens at the cut (re-tokenized text) carry no loss.
    assert tokenizer.decode(sample["input_ids"]).endswith(content)
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") != sample["input_ids"][-1]
    assert sample["loss_mask"][-TRUNCATION_BOUNDARY_TOKENS:] == [0] * TRUNCATION_BOUNDARY_TOKENS
    assert masked(tokenizer, sample) == "one two three four"


def test_an_answer_the_template_cannot_render_is_rejected_with_dataset_id_file_line(
    tmp_path, embedded_model_dir
):
    gemma = fixture_tokenizer(embedded_model_dir, "gemma")  # Gemma's template refuses a system prompt
    prompts = conversation_file(
        tmp_path / "prompts.jsonl",
        [
            [{"role": "user", "content": "Hi"}],
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
            [{"role": "user", "content": "Bye"}],
        ],
    )
    write_answers(tmp_path / "out", prompts, {f"p{i}": {"content": f"answer {i}"} for i in range(3)})
    source = [PromptSource("ds", "short", prompts)]
    summary = build_tokenized_data(tmp_path / "out", source, tmp_path / "tok", tokenizer=gemma)
    assert summary.written == {"ds": 2} and summary.rejected == {"ds": {"chat template": 1}}
    rejects = [record for _, record in read_jsonl(tmp_path / "tok" / "rejects.jsonl")]
    assert len(rejects) == 1
    assert rejects[0]["dataset"] == "ds" and rejects[0]["id"] == "p1"
    assert rejects[0]["file"] == str(prompts) and rejects[0]["line"] == 2
    assert "System role not supported" in rejects[0]["reason"]
    with pytest.raises(InputError, match=r"prompts.jsonl:2: .*ds/p1: chat template"):
        build_tokenized_data(tmp_path / "out", source, tmp_path / "tok2", tokenizer=gemma, bad_input="fail")


def test_token_counts_are_checked_against_the_servers_usage(tmp_path, tokenizer):
    """A server without the kit's default system prompt (llama.cpp's ChatML) counts fewer prompt tokens."""
    conversations = [[{"role": "user", "content": f"Question {i}?"}] for i in range(4)]
    prompts = conversation_file(tmp_path / "prompts.jsonl", conversations)
    answers = {}
    for index, messages in enumerate(conversations):
        kit_prompt = prompt_token_count(tokenizer, messages)
        answer = {"role": "assistant", "content": f"Answer {index}."}
        completion = sum(tokenize_conversation(tokenizer, [*messages, answer]).samples[0].loss_mask)
        # Records 0 and 1 agree with the kit (the completion with and without the end-of-turn token);
        # records 2 and 3 come from a server whose template has no default system prompt.
        prompt_tokens = kit_prompt if index < 2 else kit_prompt - 17
        answers[f"p{index}"] = {
            "content": answer["content"],
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion - (index == 1),
        }
    write_answers(tmp_path / "out", prompts, answers)
    source = [PromptSource("ds", "short", prompts)]
    records = [record for _, record in read_jsonl(tmp_path / "out" / "generations.jsonl")]
    by_id = {record["id"]: record for _, record in read_jsonl(prompts)}
    # While generating: the first answers' mismatch stops the run, naming the records and both counts.
    with pytest.raises(UsageMismatchError, match=r"ds: 2 of 4 the first answers .* prompt \d+ vs server \d+"):
        check_first_answers("ds", records, by_id, tokenizer, max_usage_disagreement=0.01)
    assert check_first_answers("ds", records[:2], by_id, tokenizer, max_usage_disagreement=0.01) == 2
    # At the end of a finished generation: no error; the two records are left out, each named with both
    # counts.
    summary = build_tokenized_data(tmp_path / "out", source, tmp_path / "tok", tokenizer=tokenizer)
    assert summary.usage_checked == {"ds": 4} and summary.usage_disagreements == {"ds": 2}
    assert summary.written == {"ds": 2} and summary.rejected == {"ds": {"usage": 2}}
    assert summary.usage_table() == [{"dataset": "ds", "checked": 4, "disagree": 2, "rejected": 2}]
    rejects = {record["id"]: record for _, record in read_jsonl(tmp_path / "tok" / "rejects.jsonl")}
    assert (
        sorted(rejects) == ["p2", "p3"]
        and "vs server" in rejects["p2"]["reason"]
        and rejects["p2"]["line"] == 3
    )


def test_a_truncated_answer_re_tokenized_from_text_is_its_cut_not_a_disagreement(tmp_path, tokenizer):
    """A server without raw ids cuts an answer at max_tokens and returns the text of those tokens; encoding
    the text again merges or splits tokens at the cut (a word or a UTF-8 character cut in two). That is the
    cut, not a server that saw another prompt: the run completes, and the tokens at the cut never train the
    draft."""
    full = (
        "Voilà: the café's crème brûlée 🎉🎉 costs 12€, naïvely reckoned; supercalifragilistic words and "
        "日本語のテキスト split badly at any cut."
    )
    answer_ids = tokenizer.encode(full, add_special_tokens=False)
    messages = [{"role": "user", "content": "Describe the menu."}]
    prompts = conversation_file(tmp_path / "prompts.jsonl", [messages] * len(answer_ids[4:]))
    answers, shifted = {}, 0
    for index, cut in enumerate(range(4, len(answer_ids))):
        text = tokenizer.decode(answer_ids[:cut])  # what the server returns for `cut` generated tokens
        shifted += len(tokenizer.encode(text, add_special_tokens=False)) != cut
        answers[f"p{index}"] = {
            "content": text,
            "finish_reason": "length",
            "truncated": True,
            "prompt_tokens": prompt_token_count(tokenizer, messages),
            "completion_tokens": cut,
        }
    assert shifted >= 3, "no cut changed the token count: the test would not test the boundary"
    write_answers(tmp_path / "out", prompts, answers)
    summary = build_tokenized_data(
        tmp_path / "out",
        [PromptSource("ds", "short", prompts)],
        tmp_path / "tok",
        tokenizer=tokenizer,
        max_usage_disagreement=0.01,
    )
    assert summary.usage_disagreements == {"ds": 0} and summary.written == {"ds": len(answers)}
    for _, sample in read_jsonl(summary.files["ds"]):
        cut = int(sample["id"][1:]) + 4
        generated = [token for token, mask in zip(sample["input_ids"], sample["loss_mask"]) if mask]
        assert len(generated) <= cut  # the tokens at the cut masked
        assert generated == answer_ids[: len(generated)], "a trained token the target did not generate there"


def test_a_systematic_mismatch_stops_generation_after_the_first_answers(tmp_path, tokenizer):
    """The fault endpoint counts characters, not the target's tokens (a server whose tokenizer is not the
    kit's): the stage's check on the first answers stops the run there, long before the last prompt."""
    prompts = write_prompts(tmp_path / "prompts.jsonl", [f"question {index}" for index in range(120)])
    conversations = {record["id"]: record for _, record in read_jsonl(prompts)}

    def check(dataset, records):
        check_first_answers(dataset, records, conversations, tokenizer, max_usage_disagreement=0.01)

    with FaultEndpoint(FaultOptions()) as endpoint:
        with pytest.raises(UsageMismatchError, match=r"ds: \d+ of 32 the first answers .*generation stopped"):
            generate(
                [PromptSource("ds", "short", prompts)],
                [EndpointSpec(endpoint.base_url)],
                tmp_path / "out",
                [PartitionParams(name="short", concurrency=2, max_tokens=16)],
                first_answers_check=check,
                **FAST,
            )
    answered = len(read_generations(tmp_path / "out"))
    assert 32 <= answered < 60, answered  # stopped after the first answers, the answers kept


def test_reasoning_and_tool_calls_from_the_record_placed_by_the_template(tmp_path, embedded_model_dir):
    qwen3 = fixture_tokenizer(embedded_model_dir, "qwen3")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps(
            {
                "id": "p0",
                "source": "t",
                "meta": {"tools": tools},
                "messages": [{"role": "user", "content": "Weather in Paris?"}],
            }
        )
        + "\n"
    )
    write_answers(
        tmp_path / "out",
        prompts,
        {
            "p0": {
                "content": "",
                "reasoning": "I should call the tool.",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            }
        },
    )
    tokenized = build_tokenized_data(
        tmp_path / "out", [PromptSource("ds", "short", prompts)], tmp_path / "tok", tokenizer=qwen3
    )
    sample = next(iter(read_jsonl(tokenized.files["ds"])))[1]
    assert masked(qwen3, sample) == (
        '<think>\nI should call the tool.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
        '"arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
    )
    assert "# Tools" in qwen3.decode(sample["input_ids"])  # the tool definitions reached the template


# -------------------------------------------------------------------------------------------------
# The real embedded server


@pytest.mark.slow
def test_embedded_server_answers_tokenized_and_checked_against_its_usage(
    tmp_path, embedded_server, tokenizer
):
    prompts = write_prompts(tmp_path / "prompts.jsonl", ["What is 2+2?", "Name a colour.", "Say hi."])
    source = [PromptSource("tiny", "short", prompts)]
    generate(
        source,
        [EndpointSpec(embedded_server.base_url, model=embedded_server.model_name)],
        tmp_path / "out",
        [PartitionParams(name="short", concurrency=3, max_tokens=8)],
        temperature=0.0,
        **FAST,
    )
    records = read_generations(tmp_path / "out")
    tokenized = build_tokenized_data(
        tmp_path / "out", source, tmp_path / "tok", tokenizer=tokenizer, max_usage_disagreement=1.0
    )
    assert tokenized.written == {"tiny": 3} and tokenized.from_chat_template == 3
    for _, sample in read_jsonl(tokenized.files["tiny"]):
        record = records[("tiny", sample["id"])]
        generated = [token for token, mask in zip(sample["input_ids"], sample["loss_mask"]) if mask]
        answer_ids = tokenizer.encode(record["content"], add_special_tokens=False)
        if record[
            "truncated"
        ]:  # no end-of-turn token the model never produced; the tokens at the cut carry no loss
            assert generated == answer_ids[: max(0, len(answer_ids) - TRUNCATION_BOUNDARY_TOKENS)]
        else:
            assert generated[: len(answer_ids)] == answer_ids
    checked = tokenized.usage_checked["tiny"]
    print(
        f"embedded server usage check: {checked} checked, {tokenized.usage_disagreements['tiny']} disagree",
        tokenized.usage_examples,
    )


def test_raw_token_ids_stand_when_the_template_cannot_render_the_conversation(tmp_path, embedded_model_dir):
    gemma = fixture_tokenizer(embedded_model_dir, "gemma")
    prompts = conversation_file(
        tmp_path / "prompts.jsonl",
        [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]],
    )
    write_answers(
        tmp_path / "out",
        prompts,
        {
            "p0": {
                "content": "Hi",
                "prompt_token_ids": [1, 2, 3],
                "token_ids": [4, 5],
                "prompt_tokens": 3,
                "completion_tokens": 2,
            }
        },
    )
    summary = build_tokenized_data(
        tmp_path / "out",
        [PromptSource("ds", "short", prompts)],
        tmp_path / "tok",
        tokenizer=gemma,
        bad_input="fail",
    )
    sample = next(iter(read_jsonl(summary.files["ds"])))[1]
    assert (
        sample["input_ids"] == [1, 2, 3, 4, 5]
        and summary.compared == 0
        and summary.usage_disagreements == {"ds": 0}
    )


def test_a_multi_turn_prompt_trains_only_the_regenerated_answer(tmp_path, tokenizer):
    """With `multi_turn: last_user` the prompt holds the dataset's earlier answers: context, never trained."""
    history = [
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "DATASET-ANSWER Paris"},
        {"role": "user", "content": "And Germany?"},
    ]
    prompts = conversation_file(tmp_path / "prompts.jsonl", [history])
    write_answers(tmp_path / "out", prompts, {"p0": {"content": "Berlin."}})
    tokenized = build_tokenized_data(
        tmp_path / "out", [PromptSource("ds", "short", prompts)], tmp_path / "tok", tokenizer=tokenizer
    )
    sample = next(iter(read_jsonl(tokenized.files["ds"])))[1]
    assert masked(tokenizer, sample) == "Berlin.<|im_end|>"
    assert (
        sample["input_ids"][: prompt_token_count(tokenizer, history)]
        == tokenizer(
            tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        )["input_ids"]
    )
