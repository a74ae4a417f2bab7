"""Which sizes can train while generation runs, and the record that keeps what each staged size trained on."""

import json
import os

import pytest

from eaglekit.io import InputError
from eaglekit.staged.slices import (
    Prefix,
    Settled,
    SliceEntry,
    StagedRecord,
    planned_prompt_count,
    read_settled,
    settled_prefix,
    slice_for,
)
from eaglekit.training.order import TrainingOrder

HELDOUT = (("d", "h0"), ("d", "h1"))
TRAIN = tuple(("d", f"t{index}") for index in range(6))
ORDER = TrainingOrder(seed=0, heldout_size=2, heldout=HELDOUT, train=TRAIN)


def settled(answered=(), failed=(), class_a=()):
    return Settled(class_a=frozenset(class_a), answered=frozenset(answered), failed=frozenset(failed))


def test_no_size_is_scored_until_every_heldout_sample_is_settled():
    prefix = settled_prefix(ORDER, settled(answered=[HELDOUT[0], *TRAIN]))
    assert prefix.heldout is None and not prefix.complete
    assert prefix.train == list(TRAIN)  # the training prefix is known; scoring waits on the held-out set


def test_a_failed_sample_is_a_hole_and_the_prefix_stops_at_the_first_unsettled_one():
    state = settled(answered=[*HELDOUT, TRAIN[0], TRAIN[2], TRAIN[4], TRAIN[5]], failed=[TRAIN[1]])
    prefix = settled_prefix(ORDER, state)
    # t1 failed for good: t2 takes its place; t3 is still being answered, so nothing after it has a place yet
    assert prefix.train == [TRAIN[0], TRAIN[2]] and not prefix.complete
    assert prefix.heldout == list(HELDOUT)


def test_a_failed_heldout_sample_leaves_the_set_smaller_and_class_a_needs_no_answer():
    prefix = settled_prefix(ORDER, settled(answered=TRAIN, failed=[HELDOUT[1]], class_a=[HELDOUT[0]]))
    assert prefix.heldout == [HELDOUT[0]] and prefix.train == list(TRAIN) and prefix.complete


def test_the_settled_prefix_equals_the_full_runs_split_once_everything_is_settled():
    # the oracle: TrainingOrder.split over the samples that exist at the end, which stage 5 uses
    state = settled(answered=[*HELDOUT, *TRAIN[:3], *TRAIN[4:]], failed=[TRAIN[3]])
    prefix = settled_prefix(ORDER, state)
    final_keys = [*HELDOUT, *TRAIN[:3], *TRAIN[4:]]
    heldout_indices, train_indices = ORDER.split(final_keys)
    assert prefix.complete
    assert prefix.train == [final_keys[index] for index in train_indices]
    assert prefix.heldout == [final_keys[index] for index in heldout_indices]


def test_slice_for_takes_the_first_samples_that_tokenized_and_waits_when_there_are_too_few():
    prefix = Prefix(heldout=list(HELDOUT), train=list(TRAIN[:4]), complete=False)
    dropped = {TRAIN[1]}  # answered, but dropped by a quality filter when tokenized
    samples = set(TRAIN) - dropped
    assert slice_for(3, prefix, samples) == [TRAIN[0], TRAIN[2], TRAIN[3]]
    assert slice_for(4, prefix, samples) is None


def test_read_settled_skips_a_torn_last_line_and_a_retried_answer_wins_over_its_error(tmp_path):
    generation = tmp_path / "generation"
    generation.mkdir()
    answer = lambda key: (
        json.dumps({"dataset": key[0], "id": key[1], "partition": "short", "content": "x"}) + "\n"
    )
    (generation / "generations.jsonl").write_text(
        answer(TRAIN[0]) + answer(TRAIN[1]) + answer(TRAIN[2])[:-9]
    )  # torn mid-write
    (generation / "errors.jsonl").write_text(
        json.dumps({"dataset": "d", "id": "t1", "error": "timeout"})
        + "\n"
        + json.dumps({"dataset": "d", "id": "t3", "error": "HTTP 400"})
        + "\n"
    )
    state = read_settled(tmp_path, frozenset())
    assert state.answered == {TRAIN[0], TRAIN[1]}
    assert state.failed == {TRAIN[3]}
    assert not state.settled(TRAIN[2])  # its line is still being written


def test_planned_prompts_leave_out_class_a():
    assert planned_prompt_count(ORDER, {HELDOUT[0], TRAIN[0]}) == 6


def test_the_record_round_trips_and_keeps_what_each_size_trained_on(tmp_path):
    record = StagedRecord(seed=3, heldout_size=2, heldout=list(HELDOUT), vocab_counted_over=2)
    record.slices[2] = SliceEntry(size=2, train=list(TRAIN[:2]), status="done", result={"best_tau": 1.2})
    record.slices[4] = SliceEntry(size=4, train=[TRAIN[0], TRAIN[2], TRAIN[3], TRAIN[4]])
    record.save(tmp_path)
    loaded = StagedRecord.load(tmp_path, seed=3, heldout_size=2)
    assert loaded == record
    assert loaded.done_sizes() == [2]
    assert StagedRecord.load(tmp_path / "elsewhere", seed=3, heldout_size=2) == StagedRecord(3, 2)


@pytest.mark.parametrize(("seed", "heldout_size", "field"), [(4, 2, "seed"), (3, 5, "heldout_size")])
def test_the_record_refuses_another_split_naming_file_and_field(tmp_path, seed, heldout_size, field):
    StagedRecord(seed=3, heldout_size=2, heldout=list(HELDOUT)).save(tmp_path)
    with pytest.raises(InputError) as error:
        StagedRecord.load(tmp_path, seed=seed, heldout_size=heldout_size)
    assert "slices.json" in str(error.value) and field in str(error.value)


def test_a_malformed_record_names_the_entry(tmp_path):
    path = StagedRecord.path(tmp_path)
    path.parent.mkdir()
    path.write_text(
        json.dumps({"seed": 0, "heldout_size": 2, "slices": [{"size": 2, "train": []}, {"train": []}]})
    )
    with pytest.raises(InputError, match=r"slices\[1\]"):
        StagedRecord.load(tmp_path, seed=0, heldout_size=2)
    path.write_text('{"seed": 0,')
    with pytest.raises(InputError, match="slices.json"):
        StagedRecord.load(tmp_path, seed=0, heldout_size=2)


# ---- the slice is stage 5's: errors stage 3 retries, the recorded ids, prep's order ------------------


def write_logs(run_dir, answered=(), errors=()):
    """generations.jsonl with `answered` keys; errors.jsonl with (key, session) pairs."""
    generation = run_dir / "generation"
    generation.mkdir(parents=True, exist_ok=True)
    (generation / "generations.jsonl").write_text(
        "".join(
            json.dumps({"dataset": key[0], "id": key[1], "partition": "short", "session": 1, "content": "x"})
            + "\n"
            for key in answered
        )
    )
    (generation / "errors.jsonl").write_text(
        "".join(
            json.dumps({"dataset": key[0], "id": key[1], "session": session, "error": "timeout"}) + "\n"
            for key, session in errors
        )
    )


def test_an_error_an_earlier_session_left_is_not_settled_while_this_session_retries_it(tmp_path):
    """Stage 3 retries every error of an earlier session (generation.retry_errors): the staged slice once took
    such an error as final, so it trained on other samples than stage 5 when the retry answered."""
    write_logs(tmp_path, answered=[*HELDOUT, TRAIN[0], TRAIN[2]], errors=[(TRAIN[1], 1), (TRAIN[3], 2)])
    state = read_settled(tmp_path, frozenset(), first_session=2)
    assert state.failed == {TRAIN[3]} and not state.settled(TRAIN[1])  # session 1's error: retried now
    assert settled_prefix(ORDER, state).train == [TRAIN[0]]  # waits at t1 instead of skipping it
    assert read_settled(tmp_path, frozenset(), first_session=None).failed == {
        TRAIN[1],
        TRAIN[3],
    }  # generation ended


def test_next_session_is_the_session_stage_3_writes_next(tmp_path):
    from eaglekit.staged.slices import next_session

    assert next_session(tmp_path) == 1
    (tmp_path / "generation").mkdir()
    (tmp_path / "generation" / "sessions.jsonl").write_text('{"session": 1}\n{"session": 2}\n')
    assert next_session(tmp_path) == 3


def test_a_recorded_slice_is_checked_against_prep_order_and_the_slice_the_answers_give_now():
    from eaglekit.staged.slices import slice_mismatch

    recorded = SliceEntry(size=2, train=[TRAIN[0], TRAIN[2]])  # t1 had failed when it was recorded
    assert slice_mismatch(recorded, [TRAIN[0], TRAIN[2]], ORDER) is None
    problem = slice_mismatch(recorded, [TRAIN[0], TRAIN[1]], ORDER)  # t1 was answered since
    assert (
        "stage 5 would train size 2 on other samples" in problem
        and "('d', 't2')" in problem
        and "('d', 't1')" in problem
    )
    assert "not in prep/order.json" in slice_mismatch(
        SliceEntry(size=2, train=[TRAIN[0], HELDOUT[0]]), [], ORDER
    )
    assert "not in prep/order.json's training order" in slice_mismatch(
        SliceEntry(size=2, train=[TRAIN[2], TRAIN[0]]), [], ORDER
    )


def test_the_record_keeps_the_hash_of_its_ids_and_of_prep_order(tmp_path):
    from eaglekit.staged.slices import check_order, keys_sha256, order_sha256

    record = StagedRecord(seed=3, heldout_size=2, heldout=list(HELDOUT), order_sha256=order_sha256(ORDER))
    record.slices[2] = SliceEntry(
        size=2, train=list(TRAIN[:2]), train_sha256=keys_sha256(TRAIN[:2]), status="done"
    )
    record.save(tmp_path)
    assert StagedRecord.load(tmp_path, seed=3, heldout_size=2) == record
    check_order(record, ORDER, tmp_path)
    replanned = TrainingOrder(seed=0, heldout_size=2, heldout=HELDOUT, train=TRAIN[::-1])
    with pytest.raises(InputError, match="another prep/order.json"):
        check_order(record, replanned, tmp_path)
    saved = json.loads(StagedRecord.path(tmp_path).read_text())
    saved["slices"][0]["train"] = [list(TRAIN[0]), list(TRAIN[3])]  # edited after it was staged
    StagedRecord.path(tmp_path).write_text(json.dumps(saved))
    with pytest.raises(InputError, match=r"slices\[0\]\.train.*train_sha256"):
        StagedRecord.load(tmp_path, seed=3, heldout_size=2)


def test_a_torn_record_names_the_file_its_line_and_the_fix(tmp_path):
    StagedRecord(seed=3, heldout_size=2, heldout=list(HELDOUT)).save(tmp_path)
    path = StagedRecord.path(tmp_path)
    os.truncate(path, path.stat().st_size // 2)  # a write cut off mid-file
    with pytest.raises(
        InputError, match=rf"{path}:\d+: not JSON .*; move staged/ aside to start the staged run over"
    ):
        StagedRecord.load(tmp_path, seed=3, heldout_size=2)
