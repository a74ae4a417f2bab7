"""Which data sizes can train while stage 3 is still answering, and the record of what each staged size trained on.

A staged run trains the sizes of `training.data_sizes` on the prefixes of prep's planned order
(`prep/order.json`) as their answers arrive. The rule is the full run's (`TrainingOrder.split`): a
planned sample that never becomes a training sample (failed for good, dropped by quality, rejected by
the template) leaves a hole and the next sample in the order takes its place. So a sample's place is
decided only when every sample before it is settled (answered, or in errors.jsonl): size N can train once
the held-out set is settled and the settled prefix of the training order holds N samples that tokenize.

`staged/slices.json` (`StagedRecord`) keeps, per size, the exact samples it trained on, written before
training starts, and the draft vocab the first size fixed. A later `--resume` that answers a prompt which
had failed would move every later sample by one place in a fresh split: the record keeps the sizes
already trained on what they were trained on.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from eaglekit.generation.logs import ERRORS_FILE, GENERATIONS_FILE, finished_keys
from eaglekit.generation.prompts import PromptSource
from eaglekit.io import InputError, read_jsonl, write_json, write_jsonl
from eaglekit.training.order import Key, TrainingOrder

STAGED_DIR = "staged"
SLICES_FILE = "slices.json"
FORECASTS_FILE = "forecasts.jsonl"  # one line per forecast the staged run wrote: the answer as it was, size by size


def now() -> str:
    return dt.datetime.now().astimezone().isoformat(timespec="seconds")


# ---- what stage 3 has settled ------------------------------------------------------------------

@dataclass(frozen=True)
class Settled:
    """The state of every planned sample at one moment: class A (no answer needed), answered, failed for good."""

    class_a: frozenset[Key]
    answered: frozenset[Key]
    failed: frozenset[Key]

    def available(self, key: Key) -> bool:
        return key in self.class_a or key in self.answered

    def settled(self, key: Key) -> bool:
        return self.available(key) or key in self.failed


def class_a_keys(run_dir: str | os.PathLike) -> frozenset[Key]:
    """(dataset, id) of prep's class-A samples: they train as prep tokenized them, without an answer."""
    return frozenset((path.parent.name, str(record.get("id")))
                     for path in sorted((Path(run_dir) / "prep").glob("*/tokenized_data.jsonl")) for _, record in read_jsonl(path))


def read_settled(run_dir: str | os.PathLike, class_a: frozenset[Key]) -> Settled:
    """What stage 3's logs say now. Both files are append-only; a torn last line (a write in progress) is skipped.
    An answer read after an error record of the same prompt wins (the prompt was retried)."""
    generation_dir = Path(run_dir) / "generation"
    answered = frozenset(finished_keys(generation_dir / GENERATIONS_FILE))
    failed = frozenset(finished_keys(generation_dir / ERRORS_FILE)) - answered
    return Settled(class_a=class_a, answered=answered, failed=failed)


@dataclass(frozen=True)
class Prefix:
    """The held-out set and the settled training prefix, samples that can train (answered or class A) only."""

    heldout: list[Key] | None  # None while a held-out sample is unsettled: no size can be scored yet
    train: list[Key]  # training order, holes skipped, up to the first unsettled sample
    complete: bool  # every planned sample is settled: the prefix is the whole training set


def settled_prefix(order: TrainingOrder, settled: Settled) -> Prefix:
    heldout = [key for key in order.heldout if settled.available(key)] if all(settled.settled(key) for key in order.heldout) else None
    train: list[Key] = []
    complete = True
    for key in order.train:
        if not settled.settled(key):
            complete = False
            break
        if settled.available(key):
            train.append(key)
    return Prefix(heldout=heldout, train=train, complete=complete and heldout is not None)


# ---- the staged training data --------------------------------------------------------------------

def write_staged_data(run_dir: str | os.PathLike, keys: Collection[Key], params, tokenizer) -> tuple[dict[str, Path], set[Key]]:
    """`staged/tokenized/<dataset>/tokenized_data.jsonl` for `keys`: class A filtered from prep's files, class B
    tokenized from the answers exactly as stage 3 will tokenize them (`build_tokenized_data`, the same filters).

    Returns ({dataset: file}, the keys that became samples: an answer dropped or rejected is not among them).
    Each call rewrites the files for the keys given (the staged runner passes a growing set), atomically."""
    from eaglekit.generation.tokenized import build_tokenized_data
    from eaglekit.run_folder import prompt_files

    run_dir = Path(run_dir)
    wanted = set(keys)
    tokenized_dir = run_dir / STAGED_DIR / "tokenized"
    files: dict[str, Path] = {}
    for path in sorted((run_dir / "prep").glob("*/tokenized_data.jsonl")):
        dataset = path.parent.name
        records = [record for _, record in read_jsonl(path) if (dataset, str(record.get("id"))) in wanted]
        if records:
            files[dataset] = tokenized_dir / dataset / "tokenized_data.jsonl"
            write_jsonl(files[dataset], records)
    sources = []
    for dataset, partition, path in prompt_files(run_dir):
        records = [record for _, record in read_jsonl(path) if (dataset, str(record.get("id"))) in wanted]
        if records:
            subset = run_dir / STAGED_DIR / "prompts" / dataset / path.name
            write_jsonl(subset, records)
            sources.append(PromptSource(dataset, partition, subset))
    if sources:
        settings = params.generation
        summary = build_tokenized_data(run_dir / "generation", sources, tokenized_dir, tokenizer=tokenizer,
                                       truncated_policy=settings.truncated_policy, drop_flags=settings.drop_flags,
                                       use_token_ids=settings.use_token_ids, bad_input=settings.bad_answer,
                                       max_usage_disagreement=settings.max_usage_disagreement,
                                       template_kwargs=params.prep.chat_template_kwargs)
        files.update({dataset: path for dataset, path in summary.files.items() if summary.written[dataset]})
    samples = {(dataset, str(record.get("id"))) for dataset, path in files.items() for _, record in read_jsonl(path)}
    return files, samples


# ---- staged/slices.json --------------------------------------------------------------------------

@dataclass
class SliceEntry:
    """One staged size: the samples it trained on (recorded before training starts) and how it ended."""

    size: int
    train: list[Key]
    status: str = "training"  # "training" (started; a resume continues it) or "done"
    started: str = ""
    finished: str = ""
    answered_at_start: int = 0  # stage 3's answers when this size started, of `planned_prompts`
    result: dict = field(default_factory=dict)  # the sweep row: steps, best tau, checkpoint, ...


@dataclass
class StagedRecord:
    """`staged/slices.json`: the held-out set and draft vocab fixed at the first size, and every staged size."""

    seed: int
    heldout_size: int
    heldout: list[Key] = field(default_factory=list)
    vocab_counted_over: int | None = None  # the size whose training samples the draft vocab was counted over
    slices: dict[int, SliceEntry] = field(default_factory=dict)

    @staticmethod
    def path(run_dir: str | os.PathLike) -> Path:
        return Path(run_dir) / STAGED_DIR / SLICES_FILE

    def done_sizes(self) -> list[int]:
        return sorted(size for size, entry in self.slices.items() if entry.status == "done")

    def save(self, run_dir: str | os.PathLike) -> None:
        record = {"seed": self.seed, "heldout_size": self.heldout_size, "heldout": [list(key) for key in self.heldout],
                  "vocab_counted_over": self.vocab_counted_over,
                  "slices": [{**asdict(entry), "train": [list(key) for key in entry.train]} for _, entry in sorted(self.slices.items())]}
        write_json(self.path(run_dir), record)

    @classmethod
    def load(cls, run_dir: str | os.PathLike, seed: int, heldout_size: int) -> StagedRecord:
        """The record of this run folder, or a fresh one. Refuses one made for another seed or held-out size."""
        path = cls.path(run_dir)
        if not path.exists():
            return cls(seed, heldout_size)
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as error:
            raise InputError(path, error.lineno, None, f"not JSON: {error.msg}") from None
        for name, expected in (("seed", seed), ("heldout_size", heldout_size)):
            if record.get(name) != expected:
                raise InputError(path, None, name, f"{record.get(name)!r}, but the params say {expected}: the staged sizes were "
                                 "trained on another split; move staged/ aside to start the staged run over")
        slices: dict[int, SliceEntry] = {}
        for number, entry in enumerate(record.get("slices", [])):
            try:
                slices[int(entry["size"])] = SliceEntry(**{**entry, "train": [tuple(key) for key in entry["train"]]})
            except (KeyError, TypeError, ValueError) as error:
                raise InputError(path, None, f"slices[{number}]", f"malformed staged size: {error}") from None
        return cls(seed, heldout_size, [tuple(key) for key in record.get("heldout", [])], record.get("vocab_counted_over"), slices)


def slice_for(size: int, prefix: Prefix, samples: set[Key]) -> list[Key] | None:
    """The first `size` training samples of the settled prefix that became samples; None when there are fewer."""
    train = [key for key in prefix.train if key in samples]
    return train[:size] if len(train) >= size else None


def read_forecast_history(run_dir: str | os.PathLike) -> list[dict]:
    """staged/forecasts.jsonl: the forecast after each staged size, oldest first ([] for a run that was not staged)."""
    path = Path(run_dir) / STAGED_DIR / FORECASTS_FILE
    return [record for _, record in read_jsonl(path)] if path.exists() else []


def planned_prompt_count(order: TrainingOrder, class_a: Collection[Key]) -> int:
    """Prompts stage 3 answers for the planned order (class-A samples need none)."""
    return sum(key not in class_a for key in (*order.heldout, *order.train))


def sizes_to_stage(sizes: Sequence[int]) -> list[int]:
    return sorted({int(size) for size in sizes})
