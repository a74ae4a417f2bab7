"""Shards: bounded size, atomic writes, index logs that survive a torn tail, a reader that returns
what was written."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from eaglekit.generation.capacity import hidden_state_bytes_per_token
from eaglekit.io import InputError
from eaglekit.capture.shards import (
    CONFIG_FILE,
    CapturedSample,
    ShardDataset,
    ShardWriter,
    completed_sample_keys,
    rank_index_name,
    stored_bytes_per_token,
    write_config_once,
    write_merged_index,
)

HIDDEN_SIZE = 8


def make_sample(sample_id: str, length: int, seed: int, dataset: str = "d") -> CapturedSample:
    generator = torch.Generator().manual_seed(seed)
    return CapturedSample(
        id=sample_id,
        dataset=dataset,
        input_ids=torch.randint(0, 1000, (length,), generator=generator),
        loss_mask=torch.randint(0, 2, (length,), generator=generator).to(torch.uint8),
        aux_hidden_states=torch.randn(length, 3 * HIDDEN_SIZE, generator=generator).to(torch.bfloat16),
        final_hidden_states=torch.randn(length, HIDDEN_SIZE, generator=generator).to(torch.bfloat16),
        original_length=length + seed % 3,
    )


HEADER = {"model": "test", "capture_layer_ids": [2, 4, 5], "hidden_size": HIDDEN_SIZE}


def test_shards_stay_under_the_size_bound_and_read_back_exactly(tmp_path):
    samples = [make_sample(f"s{i}", length=5 + 3 * i, seed=i) for i in range(12)]
    max_shard_bytes = 3 * samples[-1].nbytes()
    writer = ShardWriter(tmp_path, rank=0, max_shard_bytes=max_shard_bytes)
    for sample in samples:
        writer.add(sample)
    writer.close()
    write_merged_index(tmp_path, HEADER, [(sample.dataset, sample.id) for sample in samples])

    shard_files = sorted(tmp_path.glob("shard-*.safetensors"))
    assert len(shard_files) == writer.shards_written > 1
    for path in shard_files:
        tensors = load_file(path)
        payload = sum(tensor.nbytes for tensor in tensors.values())
        assert payload <= max_shard_bytes
        assert tensors["aux_hidden_states"].dtype == torch.bfloat16
        assert tensors["final_hidden_states"].dtype == torch.bfloat16
    assert not list(tmp_path.glob(".*.tmp")), "temp files left behind"

    dataset = ShardDataset(tmp_path)
    assert len(dataset) == len(samples)
    for sample, item in zip(samples, dataset, strict=True):
        assert item["id"] == sample.id and item["dataset"] == sample.dataset
        assert item["input_ids"].dtype == torch.long and item["loss_mask"].dtype == torch.long
        assert torch.equal(item["input_ids"], sample.input_ids)
        assert torch.equal(item["loss_mask"], sample.loss_mask.to(torch.long))
        assert torch.equal(item["aux_hidden_states"], sample.aux_hidden_states)
        assert torch.equal(item["final_hidden_states"], sample.final_hidden_states)
    index = json.loads((tmp_path / "index.json").read_text())
    assert index["num_tokens"] == sum(sample.length for sample in samples)
    assert index["samples"][1]["original_length"] == samples[1].original_length


def test_a_sample_larger_than_the_bound_gets_its_own_shard(tmp_path):
    small, large = make_sample("small", 4, seed=1), make_sample("large", 40, seed=2)
    writer = ShardWriter(tmp_path, rank=0, max_shard_bytes=large.nbytes() // 2)
    writer.add(small)
    writer.add(large)
    writer.add(make_sample("after", 4, seed=3))
    writer.close()
    records = [json.loads(line) for line in (tmp_path / rank_index_name(0)).read_text().splitlines()]
    assert [(record["id"], record["shard_number"]) for record in records] == [
        ("small", 0),
        ("large", 1),
        ("after", 2),
    ]


def test_torn_index_tail_is_ignored_and_unflushed_samples_are_not_done(tmp_path):
    writer = ShardWriter(tmp_path, rank=3, max_shard_bytes=1)  # every sample flushes its own shard
    writer.add(make_sample("a", 5, seed=1))
    writer.add(make_sample("b", 5, seed=2))  # flushes "a"; "b" stays buffered
    writer.abandon()
    with open(tmp_path / rank_index_name(3), "a") as handle:
        handle.write('{"id": "torn", "dataset": "d", "sha')  # a write cut by kill -9
    assert completed_sample_keys(tmp_path) == {("d", "a")}
    # A new writer for the same rank continues after the last indexed shard.
    resumed = ShardWriter(tmp_path, rank=3, max_shard_bytes=1)
    assert resumed.next_shard_number == 1
    resumed.add(make_sample("b", 5, seed=2))
    resumed.close()
    assert completed_sample_keys(tmp_path) == {("d", "a"), ("d", "b")}


def test_merged_index_refuses_missing_samples(tmp_path):
    writer = ShardWriter(tmp_path, rank=0, max_shard_bytes=10**6)
    writer.add(make_sample("a", 5, seed=1))
    writer.close()
    with pytest.raises(RuntimeError, match="did not finish.*resume"):
        write_merged_index(tmp_path, HEADER, [("d", "a"), ("d", "never-captured")])


def test_reader_explains_an_unfinished_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="has not finished"):
        ShardDataset(tmp_path)


def test_a_torn_index_or_config_names_the_file_its_line_and_what_to_do(tmp_path):
    writer = ShardWriter(tmp_path, rank=0, max_shard_bytes=10**6)
    writer.add(make_sample("a", 5, seed=1))
    writer.close()
    index = write_merged_index(tmp_path, HEADER, [("d", "a")])
    os.truncate(index, index.stat().st_size // 2)
    with pytest.raises(
        InputError, match=rf"{index}:\d+: not JSON .*run the capture into {tmp_path} again to rewrite it"
    ):
        ShardDataset(tmp_path)
    write_config_once(tmp_path, {"model": "m", "max_seq_len": 2048})
    config = tmp_path / CONFIG_FILE
    os.truncate(config, config.stat().st_size - 3)
    with pytest.raises(InputError, match=rf"{config}:\d+: not JSON .*delete it to capture into this folder"):
        write_config_once(tmp_path, {"model": "m", "max_seq_len": 2048})


def test_config_mismatch_is_refused_with_the_difference(tmp_path):
    write_config_once(tmp_path, {"model": "m", "max_seq_len": 2048})
    write_config_once(tmp_path, {"model": "m", "max_seq_len": 2048})
    with pytest.raises(ValueError, match="max_seq_len: folder has 2048, this run 4096"):
        write_config_once(tmp_path, {"model": "m", "max_seq_len": 4096})


def test_stored_bytes_per_token_is_the_planner_formula_plus_ids_and_mask():
    assert hidden_state_bytes_per_token(576, dtype_bytes=2) == 4 * 576 * 2
    assert stored_bytes_per_token(576) == 4 * 576 * 2 + 9
    sample = make_sample("x", 7, seed=0)
    assert sample.nbytes() == 7 * stored_bytes_per_token(HIDDEN_SIZE)


def test_a_truncated_or_replaced_shard_is_not_done_and_reading_it_names_the_file(tmp_path):
    from safetensors.torch import save_file

    from eaglekit.capture.shards import CorruptShardError

    writer = ShardWriter(tmp_path, rank=0, max_shard_bytes=1)  # one shard per sample
    for number, name in enumerate("abc"):
        writer.add(make_sample(name, 6, seed=number))
    writer.close()
    write_merged_index(tmp_path, HEADER, [("d", name) for name in "abc"])
    first, second, _ = sorted(tmp_path.glob("shard-*.safetensors"))
    with open(first, "r+b") as handle:  # a copy or a full disk cut the file short
        handle.truncate(first.stat().st_size - 40)
    sample = make_sample("b", 3, seed=9)  # a shorter shard under the same name: fewer tokens than indexed
    save_file(
        {
            "aux_hidden_states": sample.aux_hidden_states,
            "final_hidden_states": sample.final_hidden_states,
            "input_ids": sample.input_ids,
            "loss_mask": sample.loss_mask,
        },
        second,
    )
    assert completed_sample_keys(tmp_path) == {("d", "c")}
    dataset = ShardDataset(tmp_path)
    with pytest.raises(CorruptShardError, match=f"shard {first}: cannot be read .*incomplete metadata"):
        dataset[0]
    assert dataset[2]["id"] == "c"


def test_fp8_features_round_trip_within_e4m3_precision(tmp_path):
    from eaglekit.capture.shards import (
        ShardDataset,
        ShardWriter,
        decode_fp8,
        encode_fp8,
        stored_bytes_per_token,
        write_merged_index,
    )

    generator = torch.Generator().manual_seed(0)
    hidden = 16
    # Per-layer magnitudes that differ by orders (as a deep layer's residual does): one scale
    # per token and layer.
    aux = torch.cat(
        [torch.randn(7, hidden, generator=generator) * scale for scale in (0.1, 10.0, 3000.0)], dim=-1
    )
    encoded, scale = encode_fp8(aux, 3)
    assert encoded.dtype == torch.float8_e4m3fn and scale.shape == (7, 3)
    decoded = decode_fp8(encoded, scale).float()
    block_max = (
        aux.reshape(7, 3, hidden).abs().amax(-1, keepdim=True).expand(7, 3, hidden).reshape(7, 3 * hidden)
    )
    # e4m3: 3 mantissa bits, so at most 2^-4 relative per entry, plus subnormal steps near zero
    # (2^-9 of the block max).
    assert ((decoded - aux).abs() <= aux.abs() / 16 + block_max * 2**-9 + block_max * 2**-8).all()
    assert (
        stored_bytes_per_token(7168, "fp8") == 4 * 7168 + 16 + 9 and stored_bytes_per_token(7168) == 57344 + 9
    )

    from eaglekit.capture.shards import CapturedSample

    writer = ShardWriter(tmp_path, 0, 1 << 20, feature_dtype="fp8")
    sample = CapturedSample(
        "s",
        "d",
        torch.arange(7),
        torch.ones(7, dtype=torch.uint8),
        aux.to(torch.bfloat16),
        aux[:, :hidden].to(torch.bfloat16),
        7,
    )
    writer.add(sample)
    writer.close()
    write_merged_index(tmp_path, {"hidden_size": hidden, "capture_layer_ids": [1, 2, 3]}, [("d", "s")])
    read = ShardDataset(tmp_path)[0]
    assert read["aux_hidden_states"].dtype == torch.bfloat16  # readers see bf16 whatever the shard holds
    assert torch.equal(
        read["aux_hidden_states"], decode_fp8(*encode_fp8(aux.to(torch.bfloat16), 3))
    )  # the writer encodes its bf16 input
    from safetensors import safe_open

    with safe_open(str(tmp_path / "shard-r00-00000.safetensors"), framework="pt") as handle:
        assert handle.get_slice("aux_hidden_states").get_dtype() == "F8_E4M3" and handle.get_slice(
            "aux_hidden_states_scale"
        ).get_shape() == [7, 3]


def test_slices_follow_training_split_and_report_bytes(tmp_path):
    import json as json_module

    from eaglekit.capture.plan import format_slice_plan, nested_capture_slices, plan_capture_storage
    from eaglekit.training.split import nested_subsets, split_heldout

    path = tmp_path / "tokenized_data.jsonl"
    with open(path, "w") as handle:
        for index in range(20):
            handle.write(
                json_module.dumps(
                    {"id": f"s-{index}", "input_ids": [1] * (3 + index), "loss_mask": [1] * (3 + index)}
                )
                + "\n"
            )
    files = {"alpha": path}
    slices = nested_capture_slices(files, 100, 16, [4, 8, 12], heldout_size=3, seed=0)
    assert [part["size"] for part in slices] == [4, 8, 12, None] and [part["samples"] for part in slices] == [
        7,
        4,
        4,
        5,
    ]
    heldout, order = split_heldout(["alpha"] * 20, 3, 0)
    subsets = nested_subsets(order, [4, 8, 12])
    first = {tuple(key) for key in slices[0]["keys"]}
    assert first == {
        ("alpha", f"s-{index}") for index in heldout + subsets[4]
    }  # size 4 can train on slice 0 alone
    plan = plan_capture_storage(files, 8, 100, 16, tmp_path / "out", feature_dtype="bf16", slices=slices)
    assert (
        sum(part["bytes"] for part in plan.slices)
        == plan.planned_bytes
        == plan.slices[-1]["cumulative_bytes"]
    )
    assert "size       4" in format_slice_plan(plan)
