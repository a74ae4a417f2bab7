"""Capture: hook features equal output_hidden_states, padding is harmless, resume and torchrun
match one clean run."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eaglekit.capture import (
    InsufficientDiskError,
    TokenizedSample,
    base_model_of,
    capture_batch,
    capture_to_shards,
    check_disk_space,
    default_capture_layer_ids,
    load_target,
    plan_batches,
    read_tokenized_samples,
    validate_capture_layer_ids,
)
from eaglekit.io import InputError
from eaglekit.capture.shards import INDEX_FILE, ShardDataset, rank_index_name

TINY_VOCAB = 128
TINY_LAYERS = 8  # default capture layers [2, 4, 5]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A random 8-layer Llama saved as a transformers folder: fast, and loaded the same way
    as a real target."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=TINY_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=TINY_VOCAB,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model_dir = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(model_dir)
    return model_dir


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    return load_target(tiny_model_dir, device="cpu", dtype=torch.float32)


def write_tokenized(path: Path, count: int, seed: int, max_length: int = 50) -> Path:
    generator = random.Random(seed)
    with open(path, "w") as handle:
        for number in range(count):
            length = generator.randint(1, max_length)
            handle.write(
                json.dumps(
                    {
                        "id": f"{path.stem}-{number}",
                        "input_ids": [generator.randrange(TINY_VOCAB) for _ in range(length)],
                        "loss_mask": [generator.randint(0, 1) for _ in range(length)],
                        "source": path.stem,
                        "meta": {},
                    }
                )
                + "\n"
            )
    return path


@pytest.fixture(scope="module")
def data_files(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("tokenized")
    return {
        "alpha": write_tokenized(folder / "alpha.jsonl", 30, seed=1),
        "beta": write_tokenized(folder / "beta.jsonl", 20, seed=2),
    }


RUN_SETTINGS = dict(
    model_name="tiny", max_seq_len=40, max_tokens_per_batch=160, max_shard_bytes=12_000, progress=False
)


def read_all(output_dir: Path) -> list[dict]:
    return list(ShardDataset(output_dir))


@pytest.fixture(scope="module")
def clean_run(tiny_model, data_files, tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("clean")
    report = capture_to_shards(tiny_model, data_files, output_dir, **RUN_SETTINGS)
    return output_dir, report


def test_hook_features_equal_output_hidden_states_on_the_embedded_model(embedded_model_dir):
    model = load_target(embedded_model_dir, device="cpu", dtype=torch.float32)
    layer_ids = default_capture_layer_ids(model.config.num_hidden_layers)
    assert layer_ids == [2, 15, 27]  # SmolLM2-135M, 30 layers
    input_ids = [1, 9690, 198, 2683, 314, 253, 5356, 30, 2, 198, 1, 4093, 198, 19556, 17, 2]
    sample = TokenizedSample("s", "d", input_ids, [0] * 8 + [1] * 8, "memory", 1, len(input_ids))
    (captured,) = capture_batch(model, [sample], layer_ids)

    with torch.inference_mode():
        outputs = model(torch.tensor([input_ids]), output_hidden_states=True)
    hidden_states = outputs.hidden_states
    expected_aux = torch.cat([hidden_states[layer_id][0] for layer_id in layer_ids], dim=-1).to(
        torch.bfloat16
    )
    assert captured.aux_hidden_states.shape == (len(input_ids), 3 * 576)
    torch.testing.assert_close(captured.aux_hidden_states, expected_aux, rtol=0, atol=0)
    # The final state is what lm_head consumes: applying the target's lm_head to it gives its logits.
    final = captured.final_hidden_states
    assert final.shape == (len(input_ids), 576)
    torch.testing.assert_close(final, hidden_states[-1][0].to(torch.bfloat16), rtol=0, atol=0)
    logits_from_final = model.lm_head(final.float())
    assert (logits_from_final.argmax(-1) == outputs.logits[0].argmax(-1)).float().mean() > 0.9
    torch.testing.assert_close(logits_from_final, outputs.logits[0], rtol=0.02, atol=0.3)


def test_padded_batch_equals_each_sample_alone(tiny_model):
    generator = random.Random(7)
    lengths = [37, 5, 1, 22, 36]
    samples = [
        TokenizedSample(
            f"s{n}",
            "d",
            [generator.randrange(TINY_VOCAB) for _ in range(length)],
            [1] * length,
            "memory",
            n,
            length,
        )
        for n, length in enumerate(lengths)
    ]
    layer_ids = default_capture_layer_ids(TINY_LAYERS)
    batched = capture_batch(tiny_model, samples, layer_ids)
    for sample, in_batch in zip(samples, batched, strict=True):
        (alone,) = capture_batch(tiny_model, [sample], layer_ids)
        assert in_batch.aux_hidden_states.shape == (len(sample.input_ids), 3 * 32)
        torch.testing.assert_close(in_batch.aux_hidden_states, alone.aux_hidden_states)  # bf16 tolerances
        torch.testing.assert_close(in_batch.final_hidden_states, alone.final_hidden_states)
        assert in_batch.input_ids.tolist() == sample.input_ids


def test_plan_batches_respects_the_token_budget_and_sorts_by_length():
    lengths = [random.Random(3).randint(1, 100) for _ in range(200)]
    batches = plan_batches(lengths, max_tokens_per_batch=400)
    assert sorted(position for batch in batches for position in batch) == list(range(200))
    for batch in batches:
        assert len(batch) * max(lengths[position] for position in batch) <= 400
        assert [lengths[p] for p in batch] == sorted((lengths[p] for p in batch), reverse=True)
    padded = sum(len(batch) * max(lengths[p] for p in batch) for batch in batches)
    assert padded < 1.1 * sum(lengths)  # length-sorted buckets keep padding small
    assert plan_batches([500, 3], max_tokens_per_batch=100) == [[0], [1]]  # too long: a batch of its own


def test_clean_run_stores_every_sample_with_its_tokens_and_counts_truncation(clean_run, data_files):
    output_dir, report = clean_run
    samples, stats = read_tokenized_samples(data_files, TINY_VOCAB, max_seq_len=40)
    items = read_all(output_dir)
    assert [(item["dataset"], item["id"]) for item in items] == [sample.key for sample in samples]
    for sample, item in zip(samples, items, strict=True):
        assert item["input_ids"].tolist() == sample.input_ids
        assert item["loss_mask"].tolist() == sample.loss_mask
        assert item["aux_hidden_states"].shape == (len(sample.input_ids), 96)
    index = json.loads((output_dir / INDEX_FILE).read_text())
    assert index["capture_layer_ids"] == [2, 4, 5] and index["hidden_size"] == 32 and index["model"] == "tiny"
    assert "final norm" in index["final_hidden_states"]
    truncated = sum(dataset_stats.truncated_samples for dataset_stats in stats.values())
    assert truncated > 0 and report.truncated_samples == truncated == index["truncated_samples"]
    assert report.truncated_tokens == sum(
        sample.original_length - len(sample.input_ids) for sample in samples
    )
    assert report.shards_written > 3 and report.captured_samples == 50


def capture_killed_after(tiny_model, data_files, out_dir: Path, forwards: int, monkeypatch) -> None:
    """A capture run into out_dir that dies (KeyboardInterrupt) at its forward number `forwards` + 1."""
    base_model = base_model_of(tiny_model)
    real_forward = base_model.forward
    calls = {"count": 0}

    def forward_then_die(*args, **kwargs):
        calls["count"] += 1
        if calls["count"] > forwards:
            raise KeyboardInterrupt("simulated kill")
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(base_model, "forward", forward_then_die)
    with pytest.raises(KeyboardInterrupt):
        capture_to_shards(tiny_model, data_files, out_dir, **RUN_SETTINGS)
    monkeypatch.undo()


def test_run_interrupted_midway_and_resumed_writes_the_same_shards(
    tiny_model, data_files, clean_run, tmp_path, monkeypatch
):
    clean_dir, _ = clean_run
    capture_killed_after(tiny_model, data_files, tmp_path, forwards=6, monkeypatch=monkeypatch)
    assert not (tmp_path / INDEX_FILE).exists()
    indexed = (tmp_path / rank_index_name(0)).read_text().splitlines()
    assert 0 < len(indexed) < 50
    # What a kill -9 can leave besides: a torn index line and a temp shard never renamed.
    with open(tmp_path / rank_index_name(0), "a") as handle:
        handle.write('{"id": "alpha-3", "dataset": "al')
    (tmp_path / ".shard-r00-00099.safetensors.abc.tmp").write_bytes(b"partial")

    report = capture_to_shards(tiny_model, data_files, tmp_path, **RUN_SETTINGS)
    assert report.resumed_samples == len(indexed)
    assert report.captured_samples == 50 - len(indexed)
    assert not list(tmp_path.glob(".*.tmp"))
    clean_shards = sorted(path.name for path in clean_dir.glob("shard-*.safetensors"))
    assert sorted(path.name for path in tmp_path.glob("shard-*.safetensors")) == clean_shards
    for name in clean_shards:
        assert (tmp_path / name).read_bytes() == (clean_dir / name).read_bytes(), name
    clean_index = json.loads((clean_dir / INDEX_FILE).read_text())
    resumed_index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert resumed_index["samples"] == clean_index["samples"]


def test_resume_with_other_settings_is_refused(tiny_model, data_files, clean_run):
    clean_dir, _ = clean_run
    settings = {**RUN_SETTINGS, "max_seq_len": 30}
    with pytest.raises(ValueError, match="max_seq_len: folder has 40, this run 30"):
        capture_to_shards(tiny_model, data_files, clean_dir, **settings)


def test_two_process_torchrun_matches_one_process(tiny_model_dir, data_files, clean_run, tmp_path):
    clean_dir, _ = clean_run
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "eaglekit.capture",
        "--model",
        str(tiny_model_dir),
        "--model-name",
        "tiny",
        *[argument for name, path in data_files.items() for argument in ("--data", f"{name}={path}")],
        "--output-dir",
        str(tmp_path),
        "--max-seq-len",
        "40",
        "--max-tokens-per-batch",
        "160",
        "--max-shard-mb",
        str(12_000 / 2**20),
        "--device",
        "cpu",
        "--no-progress",
    ]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, env=environment)
    assert result.returncode == 0, result.stderr[-3000:]
    assert list(tmp_path.glob("shard-r00-*")) and list(tmp_path.glob("shard-r01-*")), (
        "both ranks must write shards"
    )
    two_process, one_process = read_all(tmp_path), read_all(clean_dir)
    assert [item["id"] for item in two_process] == [item["id"] for item in one_process]
    for left, right in zip(two_process, one_process, strict=True):
        assert torch.equal(left["input_ids"], right["input_ids"]) and torch.equal(
            left["loss_mask"], right["loss_mask"]
        )
        torch.testing.assert_close(left["aux_hidden_states"], right["aux_hidden_states"])
        torch.testing.assert_close(left["final_hidden_states"], right["final_hidden_states"])


@pytest.mark.parametrize(
    ("record", "field", "reason"),
    [
        (
            {"id": "bad-token", "input_ids": [1, 2, TINY_VOCAB], "loss_mask": [0, 1, 1]},
            "input_ids",
            f"token {TINY_VOCAB} at position 2",
        ),
        (
            {"id": "bad-token", "input_ids": [1, -4], "loss_mask": [0, 1]},
            "input_ids",
            "token -4 at position 1",
        ),
        (
            {"id": "short-mask", "input_ids": [1, 2, 3], "loss_mask": [0, 1]},
            "loss_mask",
            "length 2 != input_ids length 3",
        ),
        ({"id": "empty", "input_ids": [], "loss_mask": []}, "input_ids", "empty sample"),
        ({"id": "bad-mask", "input_ids": [1, 2], "loss_mask": [0, 2]}, "loss_mask", "value 2 at position 1"),
        ({"input_ids": [1], "loss_mask": [1]}, "id", "missing"),
    ],
)
def test_bad_inputs_name_the_sample_file_and_line(tmp_path, record, field, reason):
    path = tmp_path / "tokenized_data.jsonl"
    good = {"id": "fine", "input_ids": [1, 2], "loss_mask": [0, 1], "source": "x", "meta": {}}
    path.write_text(json.dumps(good) + "\n" + json.dumps({"source": "x", "meta": {}, **record}) + "\n")
    with pytest.raises(InputError) as caught:
        read_tokenized_samples({"x": path}, TINY_VOCAB, max_seq_len=100)
    error = caught.value
    assert (error.path, error.line, error.field) == (str(path), 2, field)
    assert reason in str(error)
    if "id" in record:
        assert repr(record["id"]) in str(error)


def test_duplicate_ids_are_refused(tmp_path):
    path = tmp_path / "tokenized_data.jsonl"
    line = json.dumps({"id": "same", "input_ids": [1], "loss_mask": [1]})
    path.write_text(line + "\n" + line + "\n")
    with pytest.raises(InputError, match="'same' already appears at line 1"):
        read_tokenized_samples({"x": path}, TINY_VOCAB, max_seq_len=100)


def test_disk_check_refuses_with_the_numbers(tmp_path):
    with pytest.raises(
        InsufficientDiskError, match=r"needs 1,000,000,000,000,000,000 bytes .* only [\d,]+ bytes"
    ):
        check_disk_space(tmp_path, 10**18)
    assert check_disk_space(tmp_path, 1) > 1


def test_capture_layers_are_validated_against_the_layer_count():
    assert default_capture_layer_ids(61) == [2, 30, 58] and default_capture_layer_ids(32) == [2, 16, 29]
    assert validate_capture_layer_ids([1, 3, 7], 8) == [1, 3, 7]
    with pytest.raises(ValueError, match=r"outside \[0, 7\]"):
        validate_capture_layer_ids([2, 4, 8], 8)
    with pytest.raises(ValueError, match="exactly 3"):
        validate_capture_layer_ids([2, 4], 8)
    with pytest.raises(ValueError, match="distinct"):
        validate_capture_layer_ids([2, 3, 3], 6)


def test_shard_tensors_are_bf16_and_bounded(clean_run):
    clean_dir, _ = clean_run
    for path in clean_dir.glob("shard-*.safetensors"):
        tensors = load_file(path)
        assert tensors["aux_hidden_states"].dtype == tensors["final_hidden_states"].dtype == torch.bfloat16
        assert (
            sum(tensor.nbytes for tensor in tensors.values()) <= 12_000 or tensors["input_ids"].numel() == 40
        )


def test_storage_plan_counts_truncated_tokens_and_picks_the_mode(tiny_model, data_files, clean_run, tmp_path):
    from eaglekit.capture import plan_capture_storage
    from eaglekit.capture.shards import stored_bytes_per_token

    _, report = clean_run
    plan = plan_capture_storage(data_files, 32, TINY_VOCAB, RUN_SETTINGS["max_seq_len"], tmp_path)
    assert (plan.tokens, plan.samples) == (report.tokens, report.samples)
    assert plan.planned_bytes == report.tokens * stored_bytes_per_token(32) and plan.mode == "offline"
    assert plan_capture_storage(data_files, 32, TINY_VOCAB, 40, tmp_path, mode="online").mode == "online"
    huge = 10**12  # a hidden size whose shards cannot fit any disk here
    assert plan_capture_storage(data_files, huge, TINY_VOCAB, 40, tmp_path).mode == "online"
    with pytest.raises(InsufficientDiskError, match="bytes"):
        plan_capture_storage(data_files, huge, TINY_VOCAB, 40, tmp_path, mode="offline")


def test_sample_check_accepts_the_shards_and_names_a_mismatch(clean_run, data_files):
    from eaglekit.capture import check_captured_samples, feature_norms

    output_dir, _ = clean_run
    samples = read_all(output_dir)[:5]
    rows = check_captured_samples(samples, data_files, 32)
    assert [row["id"] for row in rows] == [sample["id"] for sample in samples]
    norms = feature_norms(samples, [2, 4, 5])
    assert list(norms) == ["layer 2", "layer 4", "layer 5", "final"]
    assert all(
        values.shape == (sum(len(sample["input_ids"]) for sample in samples),) for values in norms.values()
    )
    broken = dict(samples[0], loss_mask=1 - samples[0]["loss_mask"])
    with pytest.raises(ValueError, match=f"{samples[0]['id']}.*loss_mask differs"):
        check_captured_samples([broken], data_files, 32)


def test_online_samples_by_index_equal_the_shards(tiny_model, data_files, clean_run, tmp_path):
    from eaglekit.capture import OnlineCaptureSamples, write_sample_subset

    output_dir, _ = clean_run
    stored = {(sample["dataset"], sample["id"]): sample for sample in read_all(output_dir)}
    keep = {("alpha", "alpha-3"), ("beta", "beta-7")}
    subset = write_sample_subset(data_files, keep, tmp_path)
    online = OnlineCaptureSamples(tiny_model, subset, max_seq_len=RUN_SETTINGS["max_seq_len"])
    assert {(sample["dataset"], sample["id"]) for sample in (online[0], online[1])} == keep and len(
        online
    ) == 2
    for position in range(2):
        sample = online[position]
        reference = stored[(sample["dataset"], sample["id"])]
        assert torch.equal(sample["input_ids"], reference["input_ids"])
        torch.testing.assert_close(
            sample["aux_hidden_states"].float(), reference["aux_hidden_states"].float(), atol=2e-2, rtol=2e-2
        )


def test_offline_and_online_samples_share_one_interface(tiny_model, data_files, clean_run, tmp_path):
    """open_captured_samples picks the mode stage 4 planned; shards and online samples answer keys, tokens and
    items alike, and offline never loads the target."""
    import shutil

    from eaglekit.capture import CapturedSamples, OnlineCaptureSamples, open_captured_samples
    from eaglekit.io import InputError, write_json
    from eaglekit.capture.shards import ShardDataset

    output_dir, _ = clean_run
    offline_dir, online_dir = tmp_path / "offline", tmp_path / "online"
    shutil.copytree(output_dir, offline_dir)
    online_dir.mkdir()
    write_json(offline_dir / "plan.json", {"mode": "offline"})
    write_json(online_dir / "plan.json", {"mode": "online"})

    def never() -> torch.nn.Module:
        raise AssertionError("offline samples must not load the target")

    offline = open_captured_samples(offline_dir, data_files, never)
    online = open_captured_samples(
        online_dir, data_files, lambda: tiny_model, max_seq_len=RUN_SETTINGS["max_seq_len"]
    )
    assert isinstance(offline, ShardDataset) and isinstance(online, OnlineCaptureSamples)
    assert isinstance(offline, CapturedSamples) and isinstance(online, CapturedSamples)
    assert sorted(offline.keys) == sorted(online.keys) and len(offline.keys) == 50
    assert offline.capture_layer_ids == online.capture_layer_ids
    online_position = {key: position for position, key in enumerate(online.keys)}
    for position in (0, 17, 49):
        key = offline.keys[position]
        stored, computed = offline.tokens(position), online.tokens(online_position[key])
        assert (stored["dataset"], stored["id"]) == key == (computed["dataset"], computed["id"])
        assert torch.equal(stored["input_ids"], computed["input_ids"]) and torch.equal(
            stored["loss_mask"], computed["loss_mask"]
        )
        assert torch.equal(stored["input_ids"], offline[position]["input_ids"])
    item = online[online_position[offline.keys[3]]]
    torch.testing.assert_close(
        item["aux_hidden_states"].float(), offline[3]["aux_hidden_states"].float(), atol=2e-2, rtol=2e-2
    )
    # The loaded target itself serves as well as a loader: the very model, the same features.
    given = open_captured_samples(online_dir, data_files, tiny_model, max_seq_len=RUN_SETTINGS["max_seq_len"])
    assert given.model is tiny_model and given.keys == online.keys
    assert torch.equal(
        given[online_position[offline.keys[3]]]["aux_hidden_states"], item["aux_hidden_states"]
    )

    write_json(online_dir / "plan.json", {"mode": "auto"})
    with pytest.raises(InputError, match=r"plan.json: field 'mode': expected 'offline' or 'online'"):
        open_captured_samples(online_dir, data_files, never)
    with pytest.raises(FileNotFoundError, match="run stage 4"):
        open_captured_samples(tmp_path / "nothing", data_files, never)


def test_resume_verifies_shards_and_captures_a_truncated_ones_samples_again(
    tiny_model, data_files, clean_run, tmp_path, monkeypatch
):
    clean_dir, _ = clean_run
    capture_killed_after(tiny_model, data_files, tmp_path, forwards=8, monkeypatch=monkeypatch)
    indexed = [json.loads(line) for line in (tmp_path / rank_index_name(0)).read_text().splitlines()]
    shards = sorted({record["shard"] for record in indexed})
    assert len(shards) >= 2
    broken = tmp_path / shards[0]
    with open(broken, "r+b") as handle:  # the shard is cut short after it was indexed
        handle.truncate(broken.stat().st_size // 2)
    in_broken = sum(record["shard"] == shards[0] for record in indexed)

    report = capture_to_shards(tiny_model, data_files, tmp_path, **RUN_SETTINGS)
    assert report.resumed_samples == len(indexed) - in_broken
    assert report.captured_samples == 50 - len(indexed) + in_broken
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert shards[0] not in index["shards"]
    resumed, clean = read_all(tmp_path), read_all(clean_dir)
    assert [(item["dataset"], item["id"]) for item in resumed] == [
        (item["dataset"], item["id"]) for item in clean
    ]
    for got, want in zip(resumed, clean, strict=True):
        for name in ("input_ids", "loss_mask", "aux_hidden_states", "final_hidden_states"):
            assert torch.equal(got[name], want[name]), (got["id"], name)


def test_capture_logs_progress_lines_and_a_final_line(tiny_model, data_files, tmp_path, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="eaglekit.capture")
    report = capture_to_shards(tiny_model, data_files, tmp_path, **{**RUN_SETTINGS, "log_interval_s": 1e-9})
    lines = [record.getMessage() for record in caplog.records if record.name == "eaglekit.capture.run"]
    progress = [line for line in lines if line.startswith("progress capture")]
    final = [line for line in lines if line.startswith("final capture")]
    assert len(progress) >= 3 and len(final) == 1
    total_tokens = sum(dataset["tokens"] for dataset in report.datasets.values())
    for line in progress + final:
        assert "/50 |" in line and f"/{total_tokens:,} |" in line and "tok/s" in line and "ETA" in line
    assert f"samples 50/50 | tokens {total_tokens:,}/{total_tokens:,}" in final[0] and "ETA 0 s" in final[0]
    done = [int(line.split("samples ")[1].split("/")[0]) for line in progress]
    assert done == sorted(done) and done[0] < 50
