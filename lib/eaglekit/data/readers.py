"""Record readers: stream the records of a data file, each with its location, bad input as a located error.

Reading is streaming everywhere: JSONL line by line (optionally .gz), JSON arrays and objects record by
record (so a file cut mid-record, like the packaged ShareGPT dump, still yields every complete record and
reports the torn tail), Parquet batch by batch, and hub datasets with `streaming=True`. Every record keeps
its file, line and record number, and bad input is yielded as a located `InputError` value so the
caller's policy (skip or fail) decides: a torn `.jsonl.gz` (the records before the tear are kept) and an
unreadable Parquet file are errors, never a failed stage. A UTF-8 byte-order mark at the start of a
file is skipped.
"""

from __future__ import annotations

import codecs
import gzip
import json
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaglekit.io import InputError


@dataclass(frozen=True)
class RecordLocation:
    path: str  # file path, or `hf://<id>/<split>` for hub datasets
    line: int  # 1-based line where the record starts (row number for Parquet and hub datasets)
    record: int  # 1-based record number within the file



# ---------------------------------------------------------------------------------------------
# Readers: each yields (location, object) pairs or InputError values


RawItem = tuple[RecordLocation, Any] | InputError
_CHUNK_CHARS = 1 << 20


def iter_jsonl_records(path: Path) -> Iterator[RawItem]:
    """JSONL (optionally .gz): one record per non-blank line; a bad line is yielded as an error and skipped.

    A compressed file cut short (or corrupt) yields its complete lines, then one error for the tear.
    """
    opener = gzip.open if path.suffix == ".gz" else open
    record = 0
    line_number = 0
    try:
        with opener(path, "rb") as handle:
            for line_number, raw in enumerate(handle, start=1):
                raw = raw.removeprefix(codecs.BOM_UTF8) if line_number == 1 else raw
                if not raw.strip():
                    continue
                record += 1
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as error:
                    yield InputError(path, line_number, None, f"not UTF-8 ({error.reason} at byte {error.start})")
                    continue
                try:
                    yield RecordLocation(str(path), line_number, record), json.loads(text)
                except json.JSONDecodeError as error:
                    yield InputError(path, line_number, None, f"malformed JSON: {error.msg} (column {error.colno})")
    except (EOFError, gzip.BadGzipFile, zlib.error, OSError) as error:
        yield InputError(path, line_number + 1, None, f"unreadable file (truncated or corrupt compressed data: "
                         f"{type(error).__name__}: {error}) after {record} records")


class _JsonStream:
    """A JSON text read in chunks of `_CHUNK_CHARS`: the text not yet consumed, the position
    in it and the line."""

    def __init__(self, handle):
        self.handle, self.decoder = handle, json.JSONDecoder()
        self.utf8 = codecs.getincrementaldecoder("utf-8")()
        self.buffer, self.position, self.line, self.eof = "", 0, 1, False

    def fill(self) -> None:
        chunk = self.handle.read(_CHUNK_CHARS)
        self.eof = not chunk
        # Drop consumed text so memory stays at about one chunk plus one record.
        self.buffer = self.buffer[self.position:] + self.utf8.decode(chunk, final=self.eof)
        self.position = 0

    def char(self) -> str:
        return self.buffer[self.position]

    def skip_whitespace(self) -> bool:
        """Advance past whitespace (counting lines); False at end of file."""
        while True:
            while self.position < len(self.buffer) and self.buffer[self.position] in " \t\r\n":
                self.line += self.buffer[self.position] == "\n"
                self.position += 1
            if self.position < len(self.buffer):
                return True
            if self.eof:
                return False
            self.fill()

    def decode_value(self) -> tuple[Any, bool]:
        """Decode one JSON value at the position; (value, True) or (error message, False)."""
        while True:
            try:
                value, end = self.decoder.raw_decode(self.buffer, self.position)
            except json.JSONDecodeError as error:
                # Cut by the chunk boundary (inside a string, a \\u escape or a value) vs really broken.
                incomplete = error.msg.startswith("Unterminated string") or error.pos >= len(self.buffer.rstrip()) - 6
                if incomplete and not self.eof:
                    self.fill()
                    continue
                return ("file ends mid-record (truncated JSON)" if incomplete else f"malformed JSON: {error.msg}"), False
            self.line += self.buffer.count("\n", self.position, end)
            self.position = end
            return value, True


def iter_json_records(path: Path) -> Iterator[RawItem]:
    """A JSON file holding an array of records, or an object of records (yields `{"_key": key, **value}`).

    Parsed record by record from 1 MiB chunks, never loading the file whole. A file that ends
    mid-record yields every complete record and then one "truncated" error for the torn tail. A
    malformed record in the middle ends the file (there is no way to resynchronize inside JSON).
    """
    with open(path, "rb") as handle:
        stream = _JsonStream(handle)
        try:
            yield from _json_records(path, stream)
        except UnicodeDecodeError as error:
            yield InputError(path, stream.line, None, f"not UTF-8 ({error.reason}) near line {stream.line}")


def _json_records(path: Path, stream: _JsonStream) -> Iterator[RawItem]:
    if stream.skip_whitespace() and stream.char() == "\ufeff":
        # a byte-order mark (Windows editors write one)
        stream.position += 1
    if not stream.skip_whitespace():
        yield InputError(path, 1, None, "empty file: expected a JSON array or object of records")
        return
    opening = stream.char()
    if opening not in "[{":
        yield InputError(path, stream.line, None, "expected a JSON array or object of records")
        return
    closing = "]" if opening == "[" else "}"
    stream.position += 1
    record = 0
    while True:
        torn = f"file ends mid-record (truncated JSON) after {record} complete records"
        if not stream.skip_whitespace():
            yield InputError(path, stream.line, None, torn)
            return
        if stream.char() == closing:
            return
        if record > 0:
            if stream.char() != ",":
                yield InputError(path, stream.line, None, f"malformed JSON: expected ',' after record {record}")
                return
            stream.position += 1
            if not stream.skip_whitespace():
                yield InputError(path, stream.line, None, torn)
                return
        start_line, key = stream.line, None
        if opening == "{":
            key, ok = stream.decode_value()
            if not ok or not isinstance(key, str) or not stream.skip_whitespace() or stream.char() != ":":
                yield InputError(path, start_line, None, f"malformed JSON object key after record {record}")
                return
            stream.position += 1
            stream.skip_whitespace()
        value, ok = stream.decode_value()
        if not ok:
            yield InputError(path, start_line, None, f"{value} in record {record + 1}; {record} complete records before it")
            return
        record += 1
        if key is not None:
            value = {"_key": key, **value} if isinstance(value, dict) else {"_key": key, "_value": value}
        yield RecordLocation(str(path), start_line, record), value


def iter_parquet_records(path: Path) -> Iterator[RawItem]:
    """Parquet rows as dicts, read in batches (never the whole table); an unreadable file or
    batch is an error."""
    import pyarrow as arrow
    import pyarrow.parquet as parquet

    row = 0
    try:
        for batch in parquet.ParquetFile(path).iter_batches(batch_size=1024):
            for record in batch.to_pylist():
                row += 1
                yield RecordLocation(str(path), row, row), record
    except (arrow.ArrowException, OSError) as error:
        yield InputError(path, row + 1 if row else None, None,
                         f"unreadable Parquet file ({type(error).__name__}: {error}) after {row} rows")


def iter_document_record(path: Path, record: int) -> Iterator[RawItem]:
    """A small .json file that is itself one record (ToolTalk stores one conversation per file)."""
    try:
        value = json.loads(path.read_bytes().removeprefix(codecs.BOM_UTF8).decode("utf-8"))
    except UnicodeDecodeError as error:
        yield InputError(path, None, None, f"not UTF-8 ({error.reason} at byte {error.start})")
        return
    except json.JSONDecodeError as error:
        yield InputError(path, error.lineno, None, f"malformed JSON: {error.msg} (column {error.colno})")
        return
    yield RecordLocation(str(path), 1, record), value


# The data files a source's `path` may name, and a folder of them holds: JSON lines, a JSON document, parquet.
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".ndjson")
DATA_FILE_SUFFIXES = (*JSONL_SUFFIXES, ".json", ".parquet")


def iter_file_records(path: Path) -> Iterator[RawItem]:
    """Dispatch on the file name: .jsonl / .jsonl.gz / .ndjson, .json (array or object of records), .parquet."""
    name = path.name.lower()
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} does not exist: check the source's `path`")
    if name.endswith(JSONL_SUFFIXES):
        return iter_jsonl_records(path)
    if name.endswith(".json"):
        return iter_json_records(path)
    if name.endswith(".parquet"):
        return iter_parquet_records(path)
    raise ValueError(f"{path}: unknown data file type; use {', '.join(DATA_FILE_SUFFIXES)}")


def iter_hub_records(hf_id: str, split: str, subset: str | None) -> Iterator[RawItem]:
    """Rows of a Hugging Face dataset, streamed (needs the `datasets` package and the hub)."""
    try:
        import datasets
    except ImportError:
        raise ImportError(
            f"source hf_id={hf_id!r} needs the `datasets` package: `pip install datasets` "
            "(and hub access), or download the data and point the source's `path` at the files"
        ) from None
    dataset = datasets.load_dataset(hf_id, subset, split=split, streaming=True)
    where = f"hf://{hf_id}/{subset + '/' if subset else ''}{split}"
    for row, record in enumerate(dataset, start=1):
        yield RecordLocation(where, row, row), record
