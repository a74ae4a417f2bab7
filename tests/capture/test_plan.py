"""Stage 4's storage plan as notebook 04 prints it: bytes in the unit they fill, from a demo's kilobytes to a
big run's terabytes."""

import json

import pytest

from eaglekit.capture.plan import (
    PLAN_FILE,
    format_bytes,
    format_slice_plan,
    nested_capture_slices,
    plan_capture_storage,
    read_capture_plan,
)
from eaglekit.io import InputError, write_json


def test_bytes_read_in_the_unit_they_fill():
    assert [
        format_bytes(count)
        for count in (0, 812, 999.6, 1_000, 3_210_000, 57_353 * 8_192 * 100, 41.7e12, 1_234e12)
    ] == ["0 B", "812 B", "1.00 KB", "1.00 KB", "3.21 MB", "47.0 GB", "41.7 TB", "1,234 TB"]
    with pytest.raises(ValueError, match="byte count"):
        format_bytes(-1)


def test_a_small_capture_plan_never_prints_zero_terabytes(tmp_path):
    path = tmp_path / "tokenized_data.jsonl"
    with open(path, "w") as handle:
        for index in range(20):
            handle.write(
                json.dumps(
                    {"id": f"s-{index}", "input_ids": [1] * (3 + index), "loss_mask": [1] * (3 + index)}
                )
                + "\n"
            )
    files = {"alpha": path}
    slices = nested_capture_slices(files, 100, 16, [4, 8, 12], heldout_size=3, seed=0)
    plan = plan_capture_storage(
        files, 64, 100, 16, tmp_path / "out", slices=slices
    )  # hidden 64: kilobytes, as a demo's are
    for text in (
        format_slice_plan(plan),
        format_slice_plan(plan_capture_storage(files, 64, 100, 16, tmp_path / "out")),
    ):
        assert "0.000 TB" not in text and " TB" not in text and "KB" in text, text
    first = plan.slices[0]
    assert (
        f"{format_bytes(first['bytes']):>9} (cumulative {format_bytes(first['cumulative_bytes'])}, bf16)"
        in format_slice_plan(plan)
    )


def test_a_missing_or_torn_plan_says_to_run_stage_4(tmp_path):
    with pytest.raises(FileNotFoundError, match=rf"{tmp_path / PLAN_FILE} not found: run stage 4"):
        read_capture_plan(tmp_path)
    write_json(tmp_path / PLAN_FILE, {"mode": "offline", "tokens": 10})
    assert read_capture_plan(tmp_path).mode == "offline"
    (tmp_path / PLAN_FILE).write_text('{\n  "mode": "offl')
    with pytest.raises(InputError, match=rf"{tmp_path / PLAN_FILE}:2: not JSON .*; rerun stage 4"):
        read_capture_plan(tmp_path)
