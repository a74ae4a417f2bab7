"""prep/order.json: the held-out set and training order fixed from prep's ids before any answer exists.

Checked against the oracle (stage 5's own `split_heldout` over the captured samples, in capture order,
built from the files the way stages 3 and 4 list them), with failed answers leaving holes, with data that
changed after the plan, with a malformed file, and through the generation engine's request order."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from eaglekit.config import PartitionParams
from eaglekit.generation import PromptSource, generate
from eaglekit.generation.client import EndpointSpec
from eaglekit.io import InputError
from eaglekit.run_folder import tokenized_data_files
from eaglekit.training.order import (
    plan_training_order,
    read_training_order,
    requests_before_each_size,
    sweep_split,
    write_training_order,
)
from eaglekit.training.split import nested_subsets, read_conversation_keys, split_heldout

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fault_endpoint import FaultEndpoint  # noqa: E402


def _write(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(record) + "\n" for record in records))


def make_prep(run_dir: Path) -> None:
    """Two class-A datasets (one with conversations split into samples <id>.0, <id>.1) and two class-B
    datasets with short and long prompts."""
    for dataset, count in (("zeta_a", 9), ("alpha_a", 6)):
        records = []
        for number in range(count):
            conversation = f"{dataset}-c{number // 2}" if dataset == "zeta_a" else None
            meta = {"conversation_id": conversation} if conversation else {}
            records.append(
                {
                    "id": f"{conversation}.{number % 2}" if conversation else f"{dataset}-{number}",
                    "input_ids": [1, 2, 3],
                    "loss_mask": [0, 1, 1],
                    "meta": meta,
                }
            )
        _write(run_dir / "prep" / dataset / "tokenized_data.jsonl", records)
    for dataset, (short, long) in (("mid_b", (7, 3)), ("beta_b", (5, 4))):
        for partition, count in (("short", short), ("long", long)):
            _write(
                run_dir / "prep" / dataset / f"prompts.{partition}.jsonl",
                [
                    {
                        "id": f"{dataset}-{partition}-{number}",
                        "messages": [{"role": "user", "content": f"q{number}"}],
                        "meta": {},
                    }
                    for number in range(count)
                ],
            )


def answer_all(run_dir: Path, failed: set[tuple[str, str]] = frozenset()) -> None:
    """What stage 3 writes: generation/tokenized/<dataset>/tokenized_data.jsonl, prompts in prompt-file order
    (the files sorted by name, as `run_folder.prompt_files` lists them), a failed prompt absent."""
    by_dataset: dict[str, list[dict]] = {}
    for path in sorted((run_dir / "prep").glob("*/prompts.*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if (path.parent.name, record["id"]) not in failed:
                by_dataset.setdefault(path.parent.name, []).append(
                    {
                        "id": record["id"],
                        "input_ids": [1, 2, 3, 4],
                        "loss_mask": [0, 0, 1, 1],
                        "meta": record["meta"],
                    }
                )
    for dataset, records in by_dataset.items():
        _write(run_dir / "generation" / "tokenized" / dataset / "tokenized_data.jsonl", records)


def captured_keys(run_dir: Path) -> list[tuple[str, str]]:
    """The capture's samples in capture order: `tokenized_data_files`' datasets, lines in file order."""
    return [
        (dataset, json.loads(line)["id"])
        for dataset, path in tokenized_data_files(run_dir).items()
        for line in path.read_text().splitlines()
    ]


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_the_planned_split_equals_stage_5s_split_of_the_captured_samples(tmp_path, seed):
    make_prep(tmp_path)
    order = write_training_order(tmp_path / "prep", heldout_size=8, seed=seed)
    answer_all(tmp_path)
    keys = captured_keys(tmp_path)
    conversations = read_conversation_keys(tokenized_data_files(tmp_path), keys)
    oracle = split_heldout([dataset for dataset, _ in keys], 8, seed, conversations)
    assert order.split(keys) == oracle
    assert sweep_split(tmp_path, keys, 8, seed, conversations) == oracle
    assert read_training_order(tmp_path, 8, seed) == order  # what prep wrote reads back equal


def test_a_failed_answer_leaves_a_hole_and_every_other_sample_keeps_its_place(tmp_path):
    make_prep(tmp_path)
    order = plan_training_order(tmp_path / "prep", heldout_size=8, seed=0)
    answer_all(tmp_path)
    full_keys = captured_keys(tmp_path)
    full_heldout, full_train = order.split(full_keys)
    # Fail an early class-B training prompt and a class-B held-out prompt.
    failed = {
        [key for key in order.train if key[0].endswith("_b")][1],
        next(key for key in order.heldout if key[0].endswith("_b")),
    }
    answer_all(tmp_path, failed)
    keys = captured_keys(tmp_path)
    heldout, train = order.split(keys)
    assert [keys[index] for index in heldout] == [
        key for key in (full_keys[index] for index in full_heldout) if key not in failed
    ]
    assert [keys[index] for index in train] == [
        key for key in (full_keys[index] for index in full_train) if key not in failed
    ]
    subsets = nested_subsets(train, [4, 8, 12])
    assert subsets[4] == subsets[8][:4] == subsets[12][:4]
    # A split of the captured samples alone would have moved samples between the sides or in the order.
    conversations = read_conversation_keys(tokenized_data_files(tmp_path), keys)
    assert (heldout, train) != split_heldout([dataset for dataset, _ in keys], 8, 0, conversations)


def test_data_that_changed_after_the_plan_is_refused_naming_the_file(tmp_path):
    make_prep(tmp_path)
    write_training_order(tmp_path / "prep", heldout_size=8, seed=0)
    answer_all(tmp_path)
    keys = captured_keys(tmp_path) + [("mid_b", "never-planned")]
    with pytest.raises(
        ValueError, match=r"prep/order.json: 1 captured samples are not in the planned order .*never-planned"
    ):
        sweep_split(tmp_path, keys, 8, 0)


def test_an_order_for_other_params_is_not_used_and_a_malformed_one_names_the_field(tmp_path, caplog):
    make_prep(tmp_path)
    write_training_order(tmp_path / "prep", heldout_size=8, seed=0)
    assert read_training_order(tmp_path, heldout_size=6, seed=0) is None
    assert "planned for seed 0 and heldout_size 8, not 0 and 6" in caplog.text
    path = tmp_path / "prep" / "order.json"
    record = json.loads(path.read_text())
    record["train"][3] = ["mid_b"]
    path.write_text(json.dumps(record))
    with pytest.raises(InputError, match=r"order.json.*train\[3\].*expected \[dataset, id\]"):
        read_training_order(tmp_path, 8, 0)
    path.write_text(json.dumps(record)[:-40])  # torn mid-record
    with pytest.raises(InputError, match=rf"{path}:1: not JSON .*; run prep again \(or delete the file"):
        read_training_order(tmp_path, 8, 0)
    # Too few samples for the held-out set: no plan (stage 5 will say what is wrong), and no stale file left.
    assert write_training_order(tmp_path / "prep", heldout_size=1000, seed=0) is None
    assert not path.exists()


def test_the_engine_requests_prompts_in_the_planned_order_within_each_partition(tmp_path):
    make_prep(tmp_path)
    order = plan_training_order(tmp_path / "prep", heldout_size=8, seed=3)
    sources = [
        PromptSource(path.parent.name, path.name.split(".")[1], path)
        for path in sorted((tmp_path / "prep").glob("*/prompts.*.jsonl"))
    ]
    partitions = [
        PartitionParams(name="short", concurrency=1, max_tokens=4),
        PartitionParams(name="long", concurrency=1, max_tokens=4),
    ]
    with FaultEndpoint() as endpoint:
        generate(
            sources,
            [EndpointSpec(endpoint.base_url)],
            tmp_path / "out",
            partitions,
            priority=order.priority(),
            log_interval_s=0.2,
            flush_interval_s=0.05,
            health_interval_s=0.05,
            progress_bar=False,
            probe_wait_s=10.0,
        )
    # One request at a time: generations.jsonl holds the answers in the order they were asked for.
    asked = [
        (record["dataset"], record["id"])
        for record in map(json.loads, (tmp_path / "out" / "generations.jsonl").read_text().splitlines())
    ]
    partition_of = {
        (source.dataset, json.loads(line)["id"]): source.partition
        for source in sources
        for line in source.path.read_text().splitlines()
    }
    rank = {key: position for position, key in enumerate(order.priority())}
    in_files = [
        [key for key in partition_of if partition_of[key] == partition] for partition in ("short", "long")
    ]
    assert asked == [key for keys in in_files for key in sorted(keys, key=rank.__getitem__)]
    assert asked != [key for keys in in_files for key in keys]  # the plan's order is not the files' order


def test_the_requests_each_size_waits_for_match_the_engines_real_request_order(tmp_path):
    make_prep(tmp_path)
    order = plan_training_order(tmp_path / "prep", heldout_size=8, seed=5)
    sources = [
        PromptSource(path.parent.name, path.name.split(".")[1], path)
        for path in sorted((tmp_path / "prep").glob("*/prompts.*.jsonl"))
    ]
    with FaultEndpoint() as endpoint:
        generate(
            sources,
            [EndpointSpec(endpoint.base_url)],
            tmp_path / "out",
            [
                PartitionParams(name="short", concurrency=1, max_tokens=4),
                PartitionParams(name="long", concurrency=1, max_tokens=4),
            ],
            priority=order.priority(),
            log_interval_s=0.2,
            flush_interval_s=0.05,
            health_interval_s=0.05,
            progress_bar=False,
        )
    asked = [
        (record["dataset"], record["id"], record["partition"])
        for record in map(json.loads, (tmp_path / "out" / "generations.jsonl").read_text().splitlines())
    ]
    partition_of = {(dataset, sample_id): partition for dataset, sample_id, partition in asked}
    rows = requests_before_each_size(order, partition_of, [2, 6, 11])
    for row in rows:
        needed = {*order.heldout, *order.train[: row["size"]]}
        for partition in ("short", "long"):
            in_partition = [(dataset, sample_id) for dataset, sample_id, part in asked if part == partition]
            # the fewest requests of this partition after which every needed prompt of it was answered
            answered_after = max(
                (in_partition.index(key) + 1 for key in needed if key in in_partition), default=0
            )
            assert row[partition] == (answered_after, len(in_partition))
    assert rows[0]["short"][0] < rows[-1]["short"][0] <= rows[-1]["short"][1]


def test_capture_slices_follow_the_planned_order_with_holes(tmp_path):
    from eaglekit.capture.plan import nested_capture_slices

    make_prep(tmp_path)
    order = plan_training_order(tmp_path / "prep", heldout_size=8, seed=2)
    failed = {[key for key in order.train if key[0].endswith("_b")][0]}
    answer_all(tmp_path, failed)
    parts = nested_capture_slices(tokenized_data_files(tmp_path), 10, 64, [3, 9], 8, 2, order=order)
    train = [key for key in order.train if key not in failed]
    in_capture_order = sorted(
        order.heldout, key=captured_keys(tmp_path).index
    )  # held-out indices come sorted
    assert [[tuple(key) for key in part["keys"]] for part in parts] == [
        [*in_capture_order, *train[:3]],
        train[3:9],
        train[9:],
    ]
