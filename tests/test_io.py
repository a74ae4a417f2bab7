"""eaglekit.io's torn-line promises, held to real torn files: a writer killed with SIGKILL mid-record, a
file cut at every byte of its last record, a torn line left in the middle by a writer that did not repair;
read_json against a JSON document cut at every byte; and parse_json_text's "JSON parsed, anything else as
it is"."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from eaglekit.io import (
    AppendLog,
    InputError,
    parse_json_text,
    read_json,
    read_jsonl,
    repair_torn_tail,
    write_json,
)

# Appends records to the AppendLog at argv[1] until killed: each record's line is exactly the same length
# (the index is zero-padded), so a file size says how many whole records it holds and how much is torn. It
# numbers on from the whole lines it finds after AppendLog's repair and prints that count. With report_each
# it prints each index once `append` returns and waits for a line on stdin before the next record.
APPENDER = """
import sys
from eaglekit.io import AppendLog
path, pad, report_each = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
with AppendLog(path) as log:
    with open(path, "rb") as handle:
        start = sum(1 for _ in handle)
    print(log.repaired_bytes, start, flush=True)
    for index in range(start, 10**9):
        log.append({"index": f"{index:09d}", "pad": "x" * pad, "text": "é✓🦅"})
        if report_each:
            print(index, flush=True)
            sys.stdin.readline()
"""


def _line(index: int, pad: int) -> bytes:
    record = {"index": f"{index:09d}", "pad": "x" * pad, "text": "é✓🦅"}
    return (json.dumps(record, ensure_ascii=False) + "\n").encode()


def _start_appender(path, pad: int, report_each: bool) -> tuple[subprocess.Popen, int, int]:
    """A real process appending to `path`; returns it, the bytes its AppendLog repaired and where it
    numbers from."""
    child = subprocess.Popen(
        [sys.executable, "-c", APPENDER, str(path), str(pad), "1" if report_each else "0"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    first = child.stdout.readline().split()
    if len(first) != 2:
        child.kill()
        raise RuntimeError(f"the appender did not start (exit code {child.wait()})")
    return child, int(first[0]), int(first[1])


def _kill(child: subprocess.Popen) -> None:
    child.send_signal(signal.SIGKILL)
    child.wait()
    child.stdin.close()
    child.stdout.close()


def _indices(path) -> list[int]:
    return [int(record["index"]) for _, record in read_jsonl(path)]


def _assert_whole_after_reopen(path, pad: int, whole: int, torn: int) -> None:
    """Reopening repairs exactly the torn bytes, keeps records 0..whole-1, and appends on a line of its
    own."""
    with AppendLog(path) as log:
        assert log.repaired_bytes == torn
        assert path.stat().st_size == whole * len(_line(0, pad))
        log.append({"index": f"{whole:09d}", "pad": "", "text": "after"})
    assert _indices(path) == list(range(whole + 1))
    assert path.read_bytes().endswith(b'"text": "after"}\n')


def test_a_writer_killed_mid_record_leaves_a_tail_the_next_open_cuts_and_nothing_whole_is_lost(tmp_path):
    """Big records (256 KiB) take a write() long enough to kill inside: the parent watches the file size
    and sends SIGKILL while it is between record boundaries, so every round tears a record for real."""
    path, pad = tmp_path / "log.jsonl", 256 << 10
    line_length = len(_line(0, pad))
    torn_rounds, torn, whole = 0, 0, 0
    for _ in range(6):
        child, repaired, start = _start_appender(path, pad, report_each=False)
        # The previous kill's torn bytes were cut on open, and the count of whole lines goes on from there.
        assert (repaired, start) == (torn, whole)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            seen = path.stat().st_size
            # At least two more whole records, then a size mid-record: a write is under way.
            if seen >= (whole + 2) * line_length and seen % line_length:
                break
        _kill(child)
        size = path.stat().st_size
        assert size >= seen  # what was in the file before the kill is still there
        whole, torn = divmod(size, line_length)
        torn_rounds += torn > 0
    assert torn_rounds >= 3, "the kills did not tear a record: the test saw no torn file"
    assert whole >= 12
    _assert_whole_after_reopen(path, pad, whole, torn)


def test_every_record_an_append_returned_from_survives_a_kill(tmp_path):
    """Small records in lockstep: killed while it waits after its 301st `append` returned, the writer has
    all 301 in the file (each written through to the kernel, not left in a buffer until the next fsync
    every 64), in order, none twice, nothing torn."""
    path, pad = tmp_path / "log.jsonl", 100
    child, _, _ = _start_appender(path, pad, report_each=True)
    for index in range(301):
        assert int(child.stdout.readline()) == index
        if index < 300:
            child.stdin.write("\n")
            child.stdin.flush()
    _kill(child)
    assert path.stat().st_size == 301 * len(_line(0, pad))
    _assert_whole_after_reopen(path, pad, 301, 0)


def _whole_and_last(tmp_path):
    path = tmp_path / "log.jsonl"
    whole = _line(0, 3) + _line(1, 3)
    return path, whole, _line(2, 3)  # the last record holds 2-, 3- and 4-byte UTF-8 characters


def test_repair_cuts_a_last_record_torn_at_any_byte_and_only_it(tmp_path):
    path, whole, last = _whole_and_last(tmp_path)
    for cut in range(len(last) + 1):
        path.write_bytes(whole + last[:cut])
        removed = 0 if cut in (0, len(last)) else cut  # at 0 and at the full line the file ends in "\n"
        assert repair_torn_tail(path) == removed, cut
        assert path.read_bytes() == (whole + last if cut == len(last) else whole), cut
        assert repair_torn_tail(path) == 0  # a repaired file needs no second repair


def test_an_append_log_opened_on_a_record_torn_at_any_byte_reports_the_cut_and_appends_whole_lines(tmp_path):
    path, whole, last = _whole_and_last(tmp_path)
    for cut in range(1, len(last)):
        path.write_bytes(whole + last[:cut])
        with AppendLog(path) as log:
            assert log.repaired_bytes == cut
            log.append({"index": "000000009", "text": "next"})
        assert _indices(path) == [0, 1, 9], cut


def test_a_last_line_without_its_newline_is_cut_even_when_it_parses(tmp_path):
    """The newline, not the JSON, marks a record whole: a complete object whose "\\n" never reached the file
    is a torn write (the next append would glue onto it)."""
    path, whole, last = _whole_and_last(tmp_path)
    path.write_bytes(whole + last[:-1])
    json.loads(last[:-1])  # the torn line is valid JSON
    assert repair_torn_tail(path) == len(last) - 1
    assert path.read_bytes() == whole


def test_a_file_that_is_one_torn_line_is_emptied(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_bytes(b'{"index": 0, "te')
    assert repair_torn_tail(path) == 16
    assert path.read_bytes() == b""


@pytest.mark.parametrize("content", [b"", b"\n", b"\n\n", b'{"a": 1}\n', b'{"a": 1}\n\n'])
def test_a_file_that_ends_in_a_newline_or_is_empty_is_left_alone(tmp_path, content):
    path = tmp_path / "log.jsonl"
    path.write_bytes(content)
    assert repair_torn_tail(path) == 0
    assert path.read_bytes() == content


def test_a_missing_file_is_not_created_and_an_append_log_creates_it_and_its_folder(tmp_path):
    path = tmp_path / "new" / "folder" / "log.jsonl"
    assert repair_torn_tail(path) == 0
    assert not path.parent.exists()
    with AppendLog(path) as log:
        assert log.repaired_bytes == 0
        log.append({"a": 1})
    assert path.read_bytes() == b'{"a": 1}\n'


@pytest.mark.parametrize("tail_length", [65535, 65536, 65537, 3 * 65536 + 5])
def test_a_torn_tail_longer_than_a_read_block_is_cut_back_to_the_last_newline(tmp_path, tail_length):
    """The repair walks back in 64 KiB blocks: a tail of one block, around it and of several, behind a head
    that itself spans blocks (so the newline is found at an offset in a block that is not the file's
    start)."""
    path = tmp_path / "log.jsonl"
    head = b"".join(_line(index, 1000) for index in range(150))  # about 150 KB of whole records
    path.write_bytes(head + b"y" * tail_length)
    assert repair_torn_tail(path) == tail_length
    assert path.read_bytes() == head


@pytest.mark.parametrize("length", [65536, 65537, 2 * 65536 + 1])
def test_a_file_without_any_newline_longer_than_a_block_is_emptied(tmp_path, length):
    path = tmp_path / "log.jsonl"
    path.write_bytes(b"z" * length)
    assert repair_torn_tail(path) == length
    assert path.read_bytes() == b""


def test_an_append_log_writes_each_record_through_before_close(tmp_path):
    path = tmp_path / "log.jsonl"
    with AppendLog(path, sync_every=1000) as log:
        for index in range(3):
            log.append({"index": index, "text": "é✓🦅"})
            assert _indices(path) == list(range(index + 1))  # readable now, by another reader
    log.close()  # a second close is harmless
    assert path.read_text(encoding="utf-8").count("é✓🦅") == 3


def _torn_in_the_middle(path) -> None:
    """What the kit's repair prevents: a writer torn by a kill, then one that appended without repairing,
    gluing its record onto the fragment (line 3)."""
    with AppendLog(path) as log:
        for index in range(3):
            log.append({"index": index})
    with open(path, "rb+") as handle:
        handle.truncate(path.stat().st_size - 5)  # the third record, torn
    with open(path, "a", encoding="utf-8") as handle:
        handle.write('{"index": 3}\n{"index": 4}\n')


def test_a_torn_line_in_the_middle_is_not_repaired_but_reported_with_file_and_line(tmp_path):
    """repair_torn_tail only cuts a last line with no newline; a torn line further up is a reader's error,
    named by file and 1-based line, after the records above it were read."""
    path = tmp_path / "log.jsonl"
    _torn_in_the_middle(path)
    before = path.read_bytes()
    assert repair_torn_tail(path) == 0
    with AppendLog(path) as log:
        assert log.repaired_bytes == 0
    assert path.read_bytes() == before
    records = read_jsonl(path)
    assert [next(records)[0], next(records)[0]] == [1, 2]
    with pytest.raises(InputError) as raised:
        next(records)
    assert (raised.value.path, raised.value.line, raised.value.field) == (str(path), 3, None)
    assert str(raised.value).startswith(f"{path}:3: malformed JSON")


def test_a_middle_line_torn_inside_a_utf8_character_is_reported_at_its_line(tmp_path):
    path = tmp_path / "log.jsonl"
    torn = "🦅".encode()[:2]
    path.write_bytes(b'{"a": 1}\n\n{"a": "' + torn + b'\n{"a": 3}\n')
    assert repair_torn_tail(path) == 0
    with pytest.raises(InputError, match=r"log\.jsonl:3: not UTF-8 \(invalid continuation byte at byte 7\)"):
        list(read_jsonl(path))


FIX = "rerun the stage that wrote it"


def test_read_json_gives_back_what_write_json_wrote(tmp_path):
    document = {"runs": [{"size": 20, "text": "é✓🦅"}, {"size": 40, "text": None}], "version": 2}
    write_json(tmp_path / "record.json", document)
    assert read_json(tmp_path / "record.json", FIX) == document


def test_a_json_file_torn_at_any_byte_names_the_file_its_line_and_what_to_do(tmp_path):
    """write_json's document (indented, non-ASCII), truncated on disk at every byte before its closing
    brace, as a writer that did not write atomically leaves it: cuts inside a multi-byte character are
    not UTF-8, every other cut is not JSON, each located in the file."""
    path = tmp_path / "record.json"
    write_json(path, {"runs": [{"size": 20, "text": "é✓🦅"}, {"size": 40, "text": None}], "version": 2})
    whole = path.read_bytes()
    kinds = []
    for cut in range(len(whole) - len(b"}\n")):
        path.write_bytes(whole)
        os.truncate(path, cut)
        with pytest.raises(InputError) as raised:
            read_json(path, FIX)
        error = raised.value
        assert (error.path, error.field) == (str(path), None) and str(error).endswith(f"; {FIX}"), str(error)
        if error.line is None:
            assert str(error).startswith(f"{path}: not UTF-8 ("), str(error)
        else:
            assert 1 <= error.line <= whole[:cut].count(b"\n") + 1, str(error)
            assert re.match(
                rf"{re.escape(str(path))}:{error.line}: not JSON \(.*: column \d+\); ", str(error)
            )
        kinds.append(error.reason.split(" (")[0])
    assert set(kinds) == {"not JSON", "not UTF-8"}


def test_read_json_of_a_missing_file_says_what_to_do_when_told(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nowhere\.json not found: run stage 4 first"):
        read_json(tmp_path / "nowhere.json", FIX, missing="run stage 4 first")
    with pytest.raises(FileNotFoundError, match="No such file"):
        read_json(tmp_path / "nowhere.json", FIX)


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ('{"city": "Zürich", "n": [1, 2.5, null]}', {"city": "Zürich", "n": [1, 2.5, None]}),
        ("[]", []),
        ('"plain"', "plain"),
        ('"{\\"a\\": 1}"', '{"a": 1}'),  # JSON inside a JSON string: parsed once, not twice
        (" 7 ", 7),
        ("true", True),
        ("null", None),
    ],
)
def test_parse_json_text_parses_a_string_that_holds_json(text, parsed):
    assert parse_json_text(text) == parsed


@pytest.mark.parametrize("text", ["", "   ", "get_weather", "{'a': 1}", '{"a": 1', '{"a": 1} extra', "[1,]"])
def test_parse_json_text_gives_back_a_string_that_is_not_json_as_it_is(text):
    assert parse_json_text(text) is text


@pytest.mark.parametrize(
    "value", [{"a": 1}, [1, "2"], None, 3, 2.5, True, b'{"a": 1}', bytearray(b"[1]")], ids=repr
)
def test_parse_json_text_gives_back_anything_not_a_string_as_it_is(value):
    """Bytes too: json.loads would parse them, but only a str is taken for JSON text."""
    assert parse_json_text(value) is value


@pytest.mark.parametrize("text", ["1" * 5000, "[" * 100_000])
def test_parse_json_text_gives_back_a_string_json_loads_cannot_take(text):
    """json.loads raises ValueError past 4300 digits and RecursionError on deep nesting: such text is not
    JSON the kit can use, so it comes back as it is, like any other non-JSON string."""
    assert parse_json_text(text) is text
