"""Which data sizes can train while stage 3 is still answering, and the record of what each staged size
trained on.

A staged run trains the sizes of `training.data_sizes` on the prefixes of prep's planned order
(`prep/order.json`) as their answers arrive. The rule is the full run's (`TrainingOrder.split`): a
planned sample that never becomes a training sample (failed for good, dropped by quality, rejected by
the template) leaves a hole and the next sample in the order takes its place. So a sample's place is
decided only when every sample before it is settled: answered, or failed in a way stage 5 also skips. Stage 3
retries on every session the errors earlier sessions left (`generation.retry_errors`, the default), so an
error is final only when this session recorded it (`read_settled`'s `first_session`); an older one is still
being answered. Size N can train once the held-out set is settled and the settled prefix of the training order
holds N samples that tokenize: then its slice is exactly the subset stage 5 trains N on, if no later session
answers one of its holes.

`staged/slices.json` (`StagedRecord`) keeps, per size, the exact samples it trained on (and their hash),
written before training starts, the hash of the prep/order.json they were taken from, and the draft vocab the
first size fixed. A later `--resume` that answers a prompt which had failed moves every later sample by one
place: the worker compares each recorded slice with the slice stage 5 would now train (`slice_mismatch`),
reports a difference and stages that size again.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import itertools
import json
import os
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from eaglekit.capture.checks import write_sample_subset
from eaglekit.generation.logs import ERRORS_FILE, GENERATIONS_FILE, SESSIONS_FILE, count_lines, finished_keys, iter_record_heads
from eaglekit.generation.prompts import PromptSource
from eaglekit.io import InputError, read_json, read_jsonl, write_json, write_jsonl
from eaglekit.run_folder import class_a_files, stage_path
from eaglekit.training.order import Key, TrainingOrder

STAGED_DIR = "staged"
SLICES_FILE = "slices.json"
START_OVER = "move staged/ aside to start the staged run over"  # the fix for a record this run cannot use
# one line per forecast the staged run wrote: the answer as it was, size by size
FORECASTS_FILE = "forecasts.jsonl"


def now() -> str:
    return dt.datetime.now().astimezone().isoformat(timespec="seconds")


# ---- what stage 3 has settled ------------------------------------------------------------------

@dataclass(frozen=True)
class Settled:
    """The state of every planned sample at one moment: class A (no answer needed), answered, failed for
    good."""

    class_a: frozenset[Key]
    answered: frozenset[Key]
    failed: frozenset[Key]

    def available(self, key: Key) -> bool:
        return key in self.class_a or key in self.answered

    def settled(self, key: Key) -> bool:
        return self.available(key) or key in self.failed


def class_a_keys(run_dir: str | os.PathLike) -> frozenset[Key]:
    """(dataset, id) of prep's class-A samples: they train as prep tokenized them, without an answer."""
    return frozenset((dataset, str(record.get("id"))) for dataset, path in class_a_files(run_dir).items() for _, record in read_jsonl(path))


def next_session(run_dir: str | os.PathLike) -> int:
    """The number stage 3 gives its next session (1 + the sessions recorded): read before stage 3 starts, it
    is the session this run's generation writes."""
    return 1 + count_lines(stage_path(run_dir, "generation") / SESSIONS_FILE)


def read_settled(run_dir: str | os.PathLike, class_a: frozenset[Key], first_session: int | None = None) -> Settled:
    """What stage 3's logs say now. Both files are append-only; a torn last line (a write in progress) is
    skipped. An answer read after an error record of the same prompt wins (the prompt was retried).

    first_session: the first session of the generation running now (`next_session` before it started); an
    error whose latest record is older is retried in this session, so it is not settled yet. None: every error
    is final (generation.retry_errors false, or a generation that has ended)."""
    generation_dir = stage_path(run_dir, "generation")
    answered = frozenset(finished_keys(generation_dir / GENERATIONS_FILE))
    latest_session = {(head["dataset"], head["id"]): int(head.get("session") or 0)
                      for _, _, head in iter_record_heads(generation_dir / ERRORS_FILE)}
    failed = frozenset(key for key, session in latest_session.items()
                       if key not in answered and (first_session is None or session >= first_session))
    return Settled(class_a=class_a, answered=answered, failed=failed)


@dataclass(frozen=True)
class Prefix:
    """The held-out set and the settled training prefix, samples that can train (answered or class A) only."""

    heldout: list[Key] | None  # None while a held-out sample is unsettled: no size can be scored yet
    train: list[Key]  # training order, holes skipped, up to the first unsettled sample
    complete: bool  # every planned sample is settled: the prefix is the whole training set


def settled_prefix(order: TrainingOrder, settled: Settled) -> Prefix:
    heldout = [key for key in order.heldout if settled.available(key)] if all(settled.settled(key) for key in order.heldout) else None
    settled_train = list(itertools.takewhile(settled.settled, order.train))
    train = [key for key in settled_train if settled.available(key)]
    return Prefix(heldout=heldout, train=train, complete=len(settled_train) == len(order.train) and heldout is not None)


# ---- the staged training data --------------------------------------------------------------------

def write_staged_data(run_dir: str | os.PathLike, keys: Collection[Key], params, tokenizer) -> tuple[dict[str, Path], set[Key]]:
    """`staged/tokenized/<dataset>/tokenized_data.jsonl` for `keys`: class A filtered from prep's files, class
    B tokenized from the answers exactly as stage 3 will tokenize them (`build_tokenized_data`, the same
    filters).

    Returns ({dataset: file}, the keys that became samples: an answer dropped or rejected is not among them).
    Each call rewrites the files for the keys given (the staged runner passes a growing set), atomically."""
    from eaglekit.generation.tokenized import build_tokenized_data
    from eaglekit.run_folder import prompt_files

    run_dir = Path(run_dir)
    wanted = set(keys)
    tokenized_dir = run_dir / STAGED_DIR / "tokenized"
    files = write_sample_subset(class_a_files(run_dir), wanted, tokenized_dir)
    sources = []
    for dataset, partition, path in prompt_files(run_dir):
        records = [record for _, record in read_jsonl(path) if (dataset, str(record.get("id"))) in wanted]
        if records:
            subset = run_dir / STAGED_DIR / "prompts" / dataset / path.name
            write_jsonl(subset, records)
            sources.append(PromptSource(dataset, partition, subset))
    if sources:
        settings = params.generation
        summary = build_tokenized_data(stage_path(run_dir, "generation"), sources, tokenized_dir, tokenizer=tokenizer,
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
    train_sha256: str = ""  # of `train`, as written: a record edited or torn since does not match it
    started: str = ""
    finished: str = ""
    answered_at_start: int = 0  # stage 3's answers when this size started, of `planned_prompts`
    result: dict = field(default_factory=dict)  # the sweep row: steps, best tau, checkpoint, ...


@dataclass
class StagedRecord:
    """`staged/slices.json`: the held-out set and draft vocab fixed at the first size, and every staged
    size."""

    seed: int
    heldout_size: int
    heldout: list[Key] = field(default_factory=list)
    vocab_counted_over: int | None = None  # the size whose training samples the draft vocab was counted over
    slices: dict[int, SliceEntry] = field(default_factory=dict)
    order_sha256: str = ""  # of the prep/order.json the slices were taken from
    # sizes whose recorded samples were not stage 5's: size, problem, folder
    set_aside: list[dict] = field(default_factory=list)

    @staticmethod
    def path(run_dir: str | os.PathLike) -> Path:
        return Path(run_dir) / STAGED_DIR / SLICES_FILE

    def done_sizes(self) -> list[int]:
        return sorted(size for size, entry in self.slices.items() if entry.status == "done")

    def save(self, run_dir: str | os.PathLike) -> None:
        record = {"seed": self.seed, "heldout_size": self.heldout_size, "heldout": [list(key) for key in self.heldout],
                  "vocab_counted_over": self.vocab_counted_over, "order_sha256": self.order_sha256, "set_aside": self.set_aside,
                  "slices": [{**asdict(entry), "train": [list(key) for key in entry.train]} for _, entry in sorted(self.slices.items())]}
        write_json(self.path(run_dir), record)

    @classmethod
    def load(cls, run_dir: str | os.PathLike, seed: int, heldout_size: int) -> StagedRecord:
        """The record of this run folder, or a fresh one. Refuses one made for another seed or held-out
        size."""
        path = cls.path(run_dir)
        if not path.exists():
            return cls(seed, heldout_size)
        record = read_json(path, START_OVER)
        for name, expected in (("seed", seed), ("heldout_size", heldout_size)):
            if record.get(name) != expected:
                raise InputError(path, None, name, f"{record.get(name)!r}, but the params say {expected}: the staged sizes were "
                                 f"trained on another split; {START_OVER}")
        slices: dict[int, SliceEntry] = {}
        for number, entry in enumerate(record.get("slices", [])):
            try:
                staged = SliceEntry(**{**entry, "train": [tuple(key) for key in entry["train"]]})
            except (KeyError, TypeError, ValueError) as error:
                raise InputError(path, None, f"slices[{number}]", f"malformed staged size: {error}") from None
            slices[staged.size] = staged
            if staged.train_sha256 and staged.train_sha256 != keys_sha256(staged.train):
                raise InputError(path, None, f"slices[{number}].train", "does not match its train_sha256: the record was changed "
                                 f"after the size was staged; {START_OVER}")
        return cls(seed, heldout_size, [tuple(key) for key in record.get("heldout", [])], record.get("vocab_counted_over"), slices,
                   record.get("order_sha256", ""), list(record.get("set_aside", [])))


def keys_sha256(keys: Sequence[Key]) -> str:
    """A hash of (dataset, id) keys in their order: what a slice or prep's order is, in a few bytes."""
    return hashlib.sha256(json.dumps([list(key) for key in keys]).encode("utf-8")).hexdigest()


def order_sha256(order: TrainingOrder) -> str:
    return keys_sha256([*order.heldout, ("--train--", ""), *order.train])


def check_order(record: StagedRecord, order: TrainingOrder, run_dir: str | os.PathLike) -> None:
    """Refuse a record whose slices were taken from another prep/order.json (prep ran again since)."""
    if record.order_sha256 and record.order_sha256 != order_sha256(order):
        raise InputError(StagedRecord.path(run_dir), None, "order_sha256", "the staged sizes were taken from another prep/order.json "
                         f"(prep ran again since): {START_OVER}")


def slice_mismatch(entry: SliceEntry, expected: Sequence[Key], order: TrainingOrder) -> str | None:
    """Why a recorded slice is not the subset stage 5 trains its size on, or None when it is.

    expected: the slice the settled logs give now (`slice_for`). Also checked against prep's order alone:
    every sample planned for training, none held out, in the planned order."""
    place = {key: index for index, key in enumerate(order.train)}
    unplanned = [key for key in entry.train if key not in place]
    if unplanned:
        return f"{len(unplanned)} of its samples are not in prep/order.json's training order (first {unplanned[0]})"
    if [place[key] for key in entry.train] != sorted(place[key] for key in entry.train):
        return "its samples are not in prep/order.json's training order"
    if list(entry.train) != list(expected):
        first = next((index for index, (a, b) in enumerate(zip(entry.train, expected)) if a != b), min(len(entry.train), len(expected)))
        return (f"stage 5 would train size {entry.size} on other samples: from place {first} on, the slice recorded "
                f"{entry.train[first] if first < len(entry.train) else 'nothing'} where the answers now give "
                f"{expected[first] if first < len(expected) else 'nothing'} (a prompt that had failed was answered since)")
    return None


def slice_for(size: int, prefix: Prefix, samples: set[Key]) -> list[Key] | None:
    """The first `size` training samples of the settled prefix that became samples; None when there are
    fewer."""
    train = [key for key in prefix.train if key in samples]
    return train[:size] if len(train) >= size else None


def read_forecast_history(run_dir: str | os.PathLike) -> list[dict]:
    """staged/forecasts.jsonl: the forecast after each staged size, oldest first ([] for a run that was not
    staged)."""
    path = Path(run_dir) / STAGED_DIR / FORECASTS_FILE
    return [record for _, record in read_jsonl(path)] if path.exists() else []


def planned_prompt_count(order: TrainingOrder, class_a: Collection[Key]) -> int:
    """Prompts stage 3 answers for the planned order (class-A samples need none)."""
    return sum(key not in class_a for key in (*order.heldout, *order.train))


def sizes_to_stage(sizes: Sequence[int]) -> list[int]:
    return sorted({int(size) for size in sizes})
