"""training/sweep.json as one type: what stage 5 saves, stage 6 loads unchanged; a malformed file fails on
load with the file and the field named; an unversioned file from an earlier run still reads."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

from eaglekit.io import InputError
from eaglekit.training.checkpoint import file_digest
from eaglekit.training.record import (
    RECORD_VERSION,
    DraftEntry,
    SweepRecord,
)
from support import CHAIN, entry, record  # noqa: E402  (shared test helpers, tests/support.py)


def test_saved_record_loads_equal_and_every_entry_carries_its_topology(tmp_path):
    path = record().save(tmp_path / "training" / "sweep.json")
    written = json.loads(path.read_text())
    assert written["version"] == RECORD_VERSION and written["sizes"] == [20, 40]
    assert written["topology"] == CHAIN.to_dict()
    assert all(item["topology"] == CHAIN.to_dict() for item in written["runs"] + written["ablation"])
    loaded = SweepRecord.load_run(tmp_path)
    assert loaded == record()
    assert loaded.largest.size == 40 and loaded.still_improving() == {40.0: 0.02}
    assert loaded.checkpoints(tmp_path, verify=False) == {
        20: tmp_path / "training/size-0000020/best.pt",
        40: tmp_path / "training/size-0000040/best.pt",
    }
    assert [entry.variant for entry in loaded.ablation] == ["original answers", "regenerated answers"]
    assert "STILL IMPROVING" in loaded.convergence_lines()[1] and "converged" in loaded.convergence_lines()[0]
    assert list(loaded.table().index) == [20, 40]


def test_json_integers_read_as_floats_where_the_field_is_a_float(tmp_path):
    written = record().to_dict()
    written["runs"][0]["best_accept_length"] = 1
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(written))
    assert SweepRecord.load(path).runs[0].best_accept_length == 1.0


_DELETE = object()


def _set(record: dict, where: str, value) -> None:
    """Set (or delete) the field at a path such as `runs[1].best_checkpoint`."""
    *parents, last = where.replace("[", ".").replace("]", "").split(".")
    for part in parents:
        record = record[int(part)] if part.isdigit() else record[part]
    if value is _DELETE:
        del record[last]
    else:
        record[int(last) if last.isdigit() else last] = value


@pytest.mark.parametrize(
    ("where", "value", "message"),
    [
        ("runs[1].best_checkpoint", 3, "expected str, got 3"),
        ("runs[0].size", _DELETE, "missing"),
        ("runs[0].size", True, "expected int, got True"),
        ("runs[1].converged", "yes", "expected bool, got 'yes'"),
        ("runs[1].recent_gain", "0.1", "expected float or null"),
        ("ablation[1].topology", _DELETE, "missing"),
        ("ablation[0].variant", None, "expected str, got None"),
        (
            "topology",
            {"topology": "chain", "steps": 3, "top_k": 2, "draft_tokens": 6},
            "says 'chain' but top_k 2",
        ),
        ("heldout[0]", ["alpha"], "expected 2 strings"),
        ("draft_vocab.coverage", "high", "expected float"),
        ("export", ["sglang"], "expected dict"),
        ("export.sglang", 5, "expected str, got 5"),
        ("capture_layer_ids[1]", "15", "expected int, got '15'"),
        ("version", 3, "this eaglekit reads version 2"),
    ],
)
def test_a_malformed_file_names_the_file_and_the_field(tmp_path, where, value, message):
    written = record().to_dict()
    _set(written, where, value)
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(written))
    with pytest.raises(InputError) as raised:
        SweepRecord.load(path)
    assert str(raised.value).startswith(f"{path}: field '{where}':"), str(raised.value)
    assert message in str(raised.value) and "rerun stage 5" in str(raised.value)


def test_not_json_and_missing_file_say_what_to_do(tmp_path):
    path = tmp_path / "sweep.json"
    path.write_text('{"version": 1,\n "runs": [')
    with pytest.raises(InputError, match=rf"{path}:2: .*not JSON.*rerun stage 5"):
        SweepRecord.load(path)
    with pytest.raises(FileNotFoundError, match="run stage 5"):
        SweepRecord.load_run(tmp_path / "elsewhere")


def unversioned() -> dict:
    """A sweep.json as stage 5 wrote it before the record had a version (the shape of the demo runs'
    files)."""
    new = record().to_dict()
    runs = [
        {key: value for key, value in item.items() if key not in ("variant", "topology")}
        for item in new["runs"]
    ]
    return {
        "sizes": [20, 40],
        "runs": runs,
        "heldout": new["heldout"],
        "topology": {"kind": "chain", "draft_steps": 3, "top_k": 1},
        "draft_vocab": {"size": 300, "coverage": 0.97, "counted_tokens": 1234},
        "capture_dir": "capture",
        "capture_mode": "offline",
        "capture_layer_ids": [1, 2, 3],
        "split_seed": 0,
        "export": new["export"],
        "ablation": [],
    }


def test_an_unversioned_sweep_from_an_earlier_run_still_reads(tmp_path):
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(unversioned()))
    loaded = SweepRecord.load(path)
    assert loaded.topology == CHAIN and all(item.topology == CHAIN for item in loaded.runs)
    assert [item.variant for item in loaded.runs] == ["20 samples", "40 samples"]
    assert loaded.runs == record().runs and loaded.draft_vocab.coverage_curve == []

    # Its ablation rows carried only six fields: not enough for an entry, so the user is told to rerun.
    old = copy.deepcopy(unversioned())
    old["ablation"] = [
        {
            "variant": "original answers",
            "size": 16,
            "best_step": 8,
            "best_accept_length": 1.2,
            "best_checkpoint": "training/ablation/original/best.pt",
            "metrics_path": "training/ablation/original/metrics.jsonl",
        }
    ]
    path.write_text(json.dumps(old))
    with pytest.raises(InputError, match=r"field 'ablation\[0\].samples_by_dataset': missing; rerun stage 5"):
        SweepRecord.load(path)
    old["topology"] = {"kind": "tree", "draft_steps": 3}
    path.write_text(json.dumps(old))
    with pytest.raises(InputError, match="field 'topology'.*not a chain record"):
        SweepRecord.load(path)


def test_entry_from_a_sweep_row_makes_paths_relative(tmp_path):
    row = {key: value for key, value in entry(20).to_dict().items() if key not in ("variant", "topology")}
    row.update(
        best_checkpoint=str(tmp_path / "training/size-0000020/best.pt"),
        metrics_path=str(tmp_path / "training/size-0000020/metrics.jsonl"),
    )
    (tmp_path / "training/size-0000020").mkdir(parents=True)
    torch.save(
        {"progress": {"step": row["best_step"]}}, row["best_checkpoint"]
    )  # the entry lists only a checkpoint that loads
    digest = file_digest(row["best_checkpoint"])
    assert DraftEntry.from_sweep_row(row, CHAIN, tmp_path) == dataclasses.replace(
        entry(20), checkpoint_bytes=digest.bytes, checkpoint_sha256=digest.sha256
    )
    with pytest.raises(ValueError):
        DraftEntry.from_sweep_row(dict(row, best_checkpoint="/elsewhere/best.pt"), CHAIN, tmp_path)


def test_a_version_1_record_still_reads_and_says_its_checkpoints_were_picked_on_the_scored_samples(tmp_path):
    """A version-1 sweep.json has no `selection` and no `noise_seeds`: it loads, with neither, flagged
    optimistic."""
    written = {
        key: value
        for key, value in record().to_dict().items()
        if key not in ("selection", "scored", "noise_seeds")
    } | {"version": 1}
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(written))
    loaded = SweepRecord.load(path)
    assert loaded.runs == record().runs and loaded.heldout == loaded.scored == record().heldout
    assert loaded.selection == [] and loaded.picked_on_scored and loaded.seed_checkpoints(tmp_path) == {}


def seeded_record(tmp_path):
    """record() with a selection split and one extra-seed draft at size 20, its best.pt a real file on
    disk."""
    best = tmp_path / "training/seed-1/size-0000020/best.pt"
    best.parent.mkdir(parents=True)
    torch.save({"progress": {"step": 8}}, best)
    digest = file_digest(best)
    extra = dataclasses.replace(
        entry(20),
        variant="20 samples, seed 1",
        best_checkpoint="training/seed-1/size-0000020/best.pt",
        metrics_path="training/seed-1/size-0000020/metrics.jsonl",
        noise_seed=1,
        checkpoint_bytes=digest.bytes,
        checkpoint_sha256=digest.sha256,
    )
    heldout = [("alpha", "a-1"), ("beta", "b-2"), ("alpha", "a-7"), ("beta", "b-9")]
    return dataclasses.replace(
        record(), heldout=heldout, selection=[("alpha", "a-7"), ("beta", "b-2")], noise_seeds=[extra]
    ), best


def test_the_extra_seed_drafts_and_the_selection_split_round_trip_and_their_checkpoints_are_verified(
    tmp_path,
):
    sweep, best = seeded_record(tmp_path)
    path = sweep.save(tmp_path / "training" / "sweep.json")
    written = json.loads(path.read_text())
    assert written["selection"] == [["alpha", "a-7"], ["beta", "b-2"]] and written["scored"] == [
        ["alpha", "a-1"],
        ["beta", "b-9"],
    ]
    assert written["noise_seeds"][0]["noise_seed"] == 1
    loaded = SweepRecord.load_run(tmp_path)
    assert loaded == sweep and not loaded.picked_on_scored
    assert loaded.seed_checkpoints(tmp_path) == {20: [best]}
    assert list(loaded.table().index) == [20, 40]  # the extra seeds are not sizes of the curve
    assert loaded.seed_table()[["data size", "seed", "difference"]].values.tolist() == [[20, 1, 0.0]]
    with open(best, "r+b") as handle:
        handle.truncate(best.stat().st_size // 2)
    with pytest.raises(ValueError, match=f"{best}: torn checkpoint"):
        loaded.seed_checkpoints(tmp_path)


@pytest.mark.parametrize(
    ("where", "value", "message"),
    [
        ("selection[0]", ["alpha", "a-9"], "1 selection samples are not held out (first ['alpha', 'a-9'])"),
        ("scored", [["alpha", "a-1"], ["beta", "b-2"]], "not the 2 held-out samples outside `selection`"),
        ("noise_seeds[0].noise_seed", None, "needs its noise_seed"),
        ("noise_seeds[0].size", 30, "a size of `runs` [20, 40]"),
        ("selection", _DELETE, "missing"),
    ],
)
def test_a_selection_that_overlaps_the_scored_set_or_a_stray_seed_is_refused_naming_the_field(
    tmp_path, where, value, message
):
    written = seeded_record(tmp_path)[0].to_dict()
    _set(written, where, value)
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(written))
    with pytest.raises(InputError) as raised:
        SweepRecord.load(path)
    assert str(raised.value).startswith(f"{path}: field '{where.split('[')[0]}") and message in str(
        raised.value
    ), str(raised.value)
