"""Data sources: a source as params (`SourceSpec`) and its adapted, validated records (`iter_source`).

A source is a local file or folder (`eaglekit.data.readers`), a packaged dataset
(`eaglekit.data.packaged`) or a hub dataset; each raw record goes through its format's adapter
(`eaglekit.data.adapters`) into the kit's conversation schema (DESIGN.md). Every source failure is
a located reject, never a failed stage under `bad_input: skip`: an unreadable file, a torn tail, an
adapter that trips over an unexpected record shape.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Literal

from eaglekit.data.adapters import (
    ADAPTERS,
    normalize_messages,
    structure_tool_calls,
    validate_messages,
)
from eaglekit.io import InputError
from eaglekit.data.packaged import PACKAGED, packaged_files
from eaglekit.data.readers import (
    DATA_FILE_SUFFIXES,
    RawItem,
    RecordLocation,
    iter_document_record,
    iter_file_records,
    iter_hub_records,
)

DataClass = Literal["A", "B"]
MultiTurnPolicy = Literal["first_user", "last_user"]


@dataclass(frozen=True)
class SourceRecord:
    """One adapted record: schema messages and meta, with where it came from."""

    location: RecordLocation
    messages: list[dict]
    meta: dict


@dataclass(frozen=True)
class Reject:
    """A record that could not be read or adapted; `error` names file, line and field."""

    error: InputError
    record: int | None = None  # 1-based record number where known (one-line JSON files have one line)

    def as_record(self) -> dict:
        return {**self.error.as_record(), "record": self.record}

    @property
    def reason_kind(self) -> str:
        """The reason without details, for counting: the text before the first ':', '(' or quote."""
        return re.split(r"[:(']", self.error.reason, maxsplit=1)[0].strip()


# ---------------------------------------------------------------------------------------------
# Source specs and iteration


@dataclass(frozen=True)
class SourceSpec:
    """One data source as plain params. Exactly one of `path`, `package`, `hf_id`."""

    name: str  # becomes `source` in every record and the output folder name
    format: str | None = None  # adapter name (ADAPTERS); packaged datasets bring their own
    path: str | None = None  # local .jsonl / .jsonl.gz / .ndjson / .json / .parquet file, or a folder of them
    package: str | None = None  # packaged offline dataset (PACKAGED or LLAMAFACTORY_FILES)
    hf_id: str | None = None  # Hugging Face dataset id (needs `datasets` and the hub)
    hf_split: str = "train"
    hf_subset: str | None = None
    data_class: DataClass = "B"  # A: already target-generated, tokenized; B: prompts to regenerate
    # class B: answer the first user turn, or the last with context
    multi_turn: MultiTurnPolicy = "first_user"
    limit: int | None = None  # stop after this many records read (None: all)

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.name):
            raise ValueError(f"source name {self.name!r}: use letters, digits, '_', '-', '.' (it names a folder)")
        located = [k for k in ("path", "package", "hf_id") if getattr(self, k)]
        if len(located) != 1:
            raise ValueError(f"source {self.name!r}: give exactly one of path, package, hf_id (got {located or 'none'})")
        if self.package is None and self.format is None:
            raise ValueError(f"source {self.name!r}: `format` is required; one of {sorted(ADAPTERS)}")
        if self.format is not None and self.format not in ADAPTERS:
            raise ValueError(f"source {self.name!r}: unknown format {self.format!r}; one of {sorted(ADAPTERS)}")
        if self.data_class not in ("A", "B"):
            raise ValueError(f"source {self.name!r}: data_class must be 'A' or 'B', got {self.data_class!r}")
        if self.multi_turn not in ("first_user", "last_user"):
            raise ValueError(f"source {self.name!r}: multi_turn must be 'first_user' or 'last_user'")
        if self.limit is not None and (not isinstance(self.limit, int) or self.limit < 1):
            raise ValueError(f"source {self.name!r}: limit must be a positive integer or null")

    @classmethod
    def from_params(cls, params: dict) -> "SourceSpec":
        """Build from a params mapping; unknown keys fail with the key named."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(params) - known)
        if unknown:
            raise ValueError(f"source {params.get('name', '?')!r}: unknown keys {unknown}; known: {sorted(known)}")
        return cls(**params)


def _raw_items(spec: SourceSpec) -> tuple[Iterator[RawItem], str]:
    if spec.hf_id:
        return iter_hub_records(spec.hf_id, spec.hf_split, spec.hf_subset), spec.format or ""
    if spec.package:
        files, format_name = packaged_files(spec.package)
        format_name = spec.format or format_name
        if spec.package in PACKAGED and PACKAGED[spec.package].one_record_per_file:
            documents = (item for index, path in enumerate(files, start=1) for item in iter_document_record(path, index))
            return documents, format_name
    else:
        path = Path(spec.path).expanduser()
        if path.is_dir():
            files = sorted(p for p in path.iterdir() if p.name.lower().endswith(DATA_FILE_SUFFIXES))
            if not files:
                raise FileNotFoundError(f"source {spec.name!r}: folder {path} holds no {'/'.join(DATA_FILE_SUFFIXES)} files")
        else:
            files = [path]
        format_name = spec.format or ""

    return itertools.chain.from_iterable(iter_file_records(file_path) for file_path in files), format_name


def iter_source(spec: SourceSpec) -> Iterator[SourceRecord | Reject]:
    """Adapted, validated records of one source, in file order, streaming; bad ones as `Reject`."""
    items, format_name = _raw_items(spec)
    adapter = ADAPTERS[format_name]
    read = 0
    for item in items:
        if spec.limit is not None and read >= spec.limit:
            return
        read += 1
        if isinstance(item, InputError):
            yield Reject(item)
            continue
        location, record = item
        try:
            adapted = adapter(record, location)
            messages = structure_tool_calls(adapted.messages)
            validate_messages(messages, location)
        except InputError as error:
            yield Reject(error, location.record)
            continue
        except Exception as error:  # an adapter tripping over a shape it does not expect: this record only
            yield Reject(InputError(location.path, location.line, None,
                                    f"unexpected record shape for format {format_name!r} "
                                    f"({type(error).__name__}: {error})"), location.record)
            continue
        meta = {**adapted.meta, "file": location.path, "line": location.line, "record": location.record}
        yield SourceRecord(location, normalize_messages(messages), meta)


def prompt_messages(messages: list[dict], policy: MultiTurnPolicy) -> tuple[list[dict], dict | None]:
    """Class B: the prompt to regenerate and the record's own answer to it (or None).

    first_user: system turns and the first user turn. last_user: everything up to and including the
    last user turn (earlier turns kept as context).
    """
    user_indices = [i for i, m in enumerate(messages) if m["role"] == "user"]
    cut = user_indices[0] if policy == "first_user" else user_indices[-1]
    prompt = messages[: cut + 1]
    if policy == "first_user":
        prompt = [m for m in prompt if m["role"] in ("system", "user")]
    answer = messages[cut + 1] if cut + 1 < len(messages) and messages[cut + 1]["role"] == "assistant" else None
    return prompt, answer
