"""`training/sweep.json`: what stage 5 trained and stage 6 scores, as one versioned type.

Stage 5 (`training_stage.run_training_stage`) builds a `SweepRecord` and saves it; notebooks 05 and 06,
`checkpoint_evaluation` and anything else that needs the drafts load it with `SweepRecord.load`. A file
that does not match the type fails on load with the file and the field named, never halfway through an
analysis.

    version            2 (RECORD_VERSION); an unversioned file from before is read as version 0
    runs               one DraftEntry per data size, ascending
    noise_seeds        one DraftEntry per extra-seed draft (`noise_seed` set): the same samples as its size's
                       run, another init and data order (training.noise_seeds); [] when none was trained
    ablation           one DraftEntry per ablation variant ("original answers", "regenerated answers"); []
                       when not trained
    heldout            [[dataset, id], ...]: the samples no draft trained on (in the capture, capture order),
                       cut in two by training.split.split_selection:
    selection          [[dataset, id], ...]: the held-out samples that picked every draft's best checkpoint
                       and stopped it
    scored             [[dataset, id], ...]: the rest of `heldout`, in its order: the only samples stage 6
                       scores on
    topology           Topology.to_dict() of the chain every held-out tau here was measured for
    draft_vocab        size, coverage, counted_tokens, coverage_curve [[vocab size, share covered], ...]
    capture_dir, capture_mode, capture_layer_ids, split_seed, export {"sglang": folder, "vllm": folder}

A version-1 file (before the selection split) reads with `selection` and `noise_seeds` empty and `scored`
all of `heldout`: its checkpoints were picked on the samples it scores (`picked_on_scored` says so; stage 6
warns, naming the file).

Paths are relative to the run folder (`SweepRecord.path`). Each entry records its best checkpoint's size
and sha256 (`checkpoint_bytes`, `checkpoint_sha256`; absent in older files), taken after the checkpoint
was loaded back whole at its best step: a torn best.pt is never listed. `SweepRecord.checkpoints` checks
each file against them before handing out its path, so stage 6 never scores a file cut short since.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import pandas as pd

from eaglekit.io import InputError, read_json, write_json
from eaglekit.run_folder import SWEEP_FILE, sweep_path
from eaglekit.topology import Topology
from eaglekit.training.checkpoint import CheckpointDigest, check_digest, verify_checkpoint

RECORD_VERSION = 2
RERUN = "rerun stage 5 (notebook 05, or eaglekit train --params P --run-dir D; trained sizes resume from their checkpoints)"
RETRAIN = ("rerun stage 5: the size resumes, finds its best.pt unreadable, and restores it or trains the size again "
           "(trained sizes resume from their checkpoints)")


@dataclass(frozen=True)
class DraftEntry:
    """One trained draft: a data size of the sweep, or an ablation variant. Paths relative to the run
    folder."""

    variant: str  # "20 samples" for a sweep size; "original answers" / "regenerated answers" for the ablation
    size: int  # training samples
    topology: Topology  # the chain its held-out tau was measured for
    best_step: int
    best_accept_length: float  # held-out simulated tau of the best checkpoint
    best_checkpoint: str
    metrics_path: str
    samples_by_dataset: dict[str, int]
    schedule: str
    steps: int  # steps trained
    step_cap: int
    samples_seen: int
    epochs: float
    converged: bool  # held-out tau stopped improving (False: stopped by the step cap, tau is a lower bound)
    stopped: str | None  # "converged", "step_cap" (None: stopped early on request)
    improved_step: int
    recent_gain: float | None  # best tau gained over the last `recent_evaluations` evaluations
    recent_window_steps: list[int] | None
    recent_evaluations: int
    # selection samples its best tau was measured on (a version-1 record: the scored held-out set)
    heldout_size: int
    # best_checkpoint's size and sha256 when the record was written (None: an older record)
    checkpoint_bytes: int | None = None
    checkpoint_sha256: str | None = None
    # an extra-seed draft's init and data-order seed; None: the sweep's own draft (run.seed)
    noise_seed: int | None = None

    @classmethod
    def from_sweep_row(cls, row: dict[str, Any], topology: Topology, run_dir: str | os.PathLike,
                       noise_seed: int | None = None, variant: str | None = None) -> DraftEntry:
        """From a `training.train_size_sweep` row (`sweep.result_row`); paths made relative to the run folder.
        `noise_seed`: the row is an extra-seed draft trained with that seed; `variant`: an ablation variant's
        name (default "<size> samples")."""
        known = {item.name for item in fields(cls)} - {"variant", "topology", "noise_seed"}
        values = {key: value for key, value in row.items() if key in known}
        values.update({key: str(Path(row[key]).relative_to(run_dir)) for key in ("best_checkpoint", "metrics_path")})
        # Its size and sha256 once it has loaded back whole at its best step: a torn one is never listed
        # (TornCheckpointError naming the file).
        digest = verify_checkpoint(row["best_checkpoint"], row["best_step"])
        values.update(checkpoint_bytes=digest.bytes, checkpoint_sha256=digest.sha256)
        variant = variant or (f"{row['size']} samples" + ("" if noise_seed is None else f", seed {noise_seed}"))
        return cls(variant=variant, topology=topology, noise_seed=noise_seed, **values)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"topology": self.topology.to_dict()}

    def verified_checkpoint(self, run_dir: str | os.PathLike) -> Path:
        """best_checkpoint as a path on this machine, checked first: the file sweep.json recorded (size,
        sha256), or for an older record one that loads at its best step. A torn one raises TornCheckpointError
        naming it."""
        path = Path(run_dir) / self.best_checkpoint
        if self.checkpoint_bytes is None or self.checkpoint_sha256 is None:
            verify_checkpoint(path, self.best_step)
        else:
            check_digest(path, CheckpointDigest(self.checkpoint_bytes, self.checkpoint_sha256), RETRAIN)
        return path


@dataclass(frozen=True)
class DraftVocabRecord:
    size: int
    coverage: float  # share of generated tokens the draft vocab covers
    counted_tokens: int
    coverage_curve: list[list[float]]  # [[vocab size, share covered], ...]: notebook 05's coverage figure


@dataclass(frozen=True)
class SweepRecord:
    runs: list[DraftEntry]
    heldout: list[tuple[str, str]]
    topology: Topology
    draft_vocab: DraftVocabRecord
    capture_dir: str
    capture_mode: str
    capture_layer_ids: list[int]
    split_seed: int
    export: dict[str, str]
    ablation: list[DraftEntry] = field(default_factory=list)
    # [] only in a version-1 record (picked on `heldout`)
    selection: list[tuple[str, str]] = field(default_factory=list)
    noise_seeds: list[DraftEntry] = field(default_factory=list)
    version: int = RECORD_VERSION

    # -- reading it -----------------------------------------------------------------------------------
    @property
    def sizes(self) -> list[int]:
        return [entry.size for entry in self.runs]

    @property
    def largest(self) -> DraftEntry:
        return max(self.runs, key=lambda entry: entry.size)

    @staticmethod
    def path(run_dir: str | os.PathLike, relative: str) -> Path:
        """A path the record holds (relative to the run folder) as a path on this machine."""
        return Path(run_dir) / relative

    def checkpoints(self, run_dir: str | os.PathLike, verify: bool = True) -> dict[int, Path]:
        """{data size: best checkpoint}, ascending, each checked against sweep.json
        (`DraftEntry.verified_checkpoint`) unless `verify` is False (paths only)."""
        return {entry.size: entry.verified_checkpoint(run_dir) if verify else self.path(run_dir, entry.best_checkpoint)
                for entry in self.runs}

    def seed_checkpoints(self, run_dir: str | os.PathLike, verify: bool = True) -> dict[int, list[Path]]:
        """{data size: [best checkpoint of each extra-seed draft]}, ascending, checked like `checkpoints`; {}
        when stage 5 trained none."""
        found: dict[int, list[Path]] = {}
        for entry in sorted(self.noise_seeds, key=lambda item: (item.size, item.noise_seed)):
            found.setdefault(entry.size, []).append(entry.verified_checkpoint(run_dir) if verify
                                                    else self.path(run_dir, entry.best_checkpoint))
        return found

    @property
    def scored(self) -> list[tuple[str, str]]:
        """The held-out samples stage 6 scores: `heldout` less `selection`, in `heldout`'s order."""
        selection = set(self.selection)
        return [key for key in self.heldout if key not in selection]

    @property
    def picked_on_scored(self) -> bool:
        """True for a record from before the selection split: its best checkpoints were picked on `heldout`,
        the samples they are scored on, so their scores are optimistic."""
        return not self.selection

    def still_improving(self) -> dict[float, float | None]:
        """{data size: recent gain} of the drafts stopped by the step cap: their tau is a lower bound."""
        return {float(entry.size): entry.recent_gain for entry in self.runs if not entry.converged}

    def table(self, ablation: bool = False) -> pd.DataFrame:
        """One row per data size (per ablation variant with `ablation`): training length, how it stopped, its
        best held-out tau, per-dataset training counts."""
        entries, index = (self.ablation, "variant") if ablation else (self.runs, "data size")
        return pd.DataFrame([{
            "variant": entry.variant, "data size": entry.size, "schedule": entry.schedule, "steps": entry.steps, "step cap": entry.step_cap,
            "samples seen": entry.samples_seen, "epochs": round(entry.epochs, 2), "best step": entry.best_step,
            f"held-out tau ({entry.topology.label})": round(entry.best_accept_length, 4), "converged": entry.converged,
            "stopped": entry.stopped, "recent gain": None if entry.recent_gain is None else round(entry.recent_gain, 4),
            "recent window (steps)": entry.recent_window_steps, "checkpoint": entry.best_checkpoint,
            **{f"train {name}": count for name, count in entry.samples_by_dataset.items()},
        } for entry in entries], columns=None if entries else ["variant", "data size"]).set_index(index)

    def seed_table(self) -> pd.DataFrame:
        """One row per extra-seed draft: its selection tau beside the sweep's own draft of that size (same
        samples, same selection split, another init and data order), and the difference: training noise, as
        measured here."""
        own = {entry.size: entry for entry in self.runs}
        return pd.DataFrame([{
            "data size": entry.size, "seed": entry.noise_seed, "steps": entry.steps, "best step": entry.best_step,
            "selection tau": round(entry.best_accept_length, 4), "sweep draft's tau": round(own[entry.size].best_accept_length, 4),
            "difference": round(entry.best_accept_length - own[entry.size].best_accept_length, 4), "checkpoint": entry.best_checkpoint,
        } for entry in sorted(self.noise_seeds, key=lambda item: (item.size, item.noise_seed))],
            columns=["data size", "seed", "steps", "best step", "selection tau", "sweep draft's tau", "difference", "checkpoint"])

    def convergence_lines(self) -> list[str]:
        """Per size, in words: converged, or still improving when the step cap stopped it (its tau a lower
        bound)."""
        lines = []
        for entry in self.runs:
            if entry.converged:
                lines.append(f"size {entry.size}: converged at step {entry.steps} (no gain since step {entry.improved_step}; "
                             f"best at step {entry.best_step})")
            else:
                gain = "" if entry.recent_gain is None else (f": best held-out tau rose {entry.recent_gain:+.4f} over its last "
                                                             f"{entry.recent_evaluations} evaluations (steps {entry.recent_window_steps})")
                lines.append(f"size {entry.size}: STILL IMPROVING when training stopped ({entry.stopped} at step {entry.steps}){gain}; "
                             "its tau is a lower bound")
        return lines

    # -- the file -------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "sizes": self.sizes, "runs": [entry.to_dict() for entry in self.runs],
                "noise_seeds": [entry.to_dict() for entry in self.noise_seeds], "ablation": [entry.to_dict() for entry in self.ablation],
                "heldout": [list(key) for key in self.heldout], "selection": [list(key) for key in self.selection],
                "scored": [list(key) for key in self.scored],
                "topology": self.topology.to_dict(), "draft_vocab": asdict(self.draft_vocab), "capture_dir": self.capture_dir,
                "capture_mode": self.capture_mode, "capture_layer_ids": list(self.capture_layer_ids), "split_seed": self.split_seed,
                "export": dict(self.export)}

    def save(self, path: str | os.PathLike) -> Path:
        """Written atomically (temp file, then rename): a reader never sees half a record."""
        write_json(path, self.to_dict())
        return Path(path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> SweepRecord:
        record = read_json(path, RERUN, missing="run stage 5 (training) into this run folder first")
        return cls.from_dict(record, path)

    @classmethod
    def load_run(cls, run_dir: str | os.PathLike) -> SweepRecord:
        """The record of a run folder: <run_dir>/training/sweep.json."""
        return cls.load(sweep_path(run_dir))

    @classmethod
    def from_dict(cls, record: Any, path: str | os.PathLike = SWEEP_FILE) -> SweepRecord:
        """Checks every field's type; an error names the file and the field (e.g.
        `runs[2].best_checkpoint`)."""
        read = _Reader(path)
        read.expect(record, dict, "the file")
        version = record.get("version", 0)
        if version == 0:
            record = _from_version_0(record, read)
        # before the selection split and the extra seeds: picked on the scored samples, no seeds
        if version in (0, 1):
            record = {"selection": [], "scored": record.get("heldout"), "noise_seeds": [], **record}
        elif version != RECORD_VERSION:
            raise InputError(path, None, "version", f"version {version!r}; this eaglekit reads version {RECORD_VERSION}: {RERUN}")
        topology = read.topology(record)
        vocab = read.field(record, "draft_vocab", dict)
        entries = {name: [read.entry(entry, f"{name}[{index}]") for index, entry in enumerate(read.field(record, name, list))]
                   for name in ("runs", "noise_seeds", "ablation")}
        keys = {name: [tuple(read.strings(pair, f"{name}[{index}]", 2)) for index, pair in enumerate(read.field(record, name, list))]
                for name in ("heldout", "selection", "scored")}
        if stray := [key for key in keys["selection"] if key not in set(keys["heldout"])]:
            raise read.fail("selection", f"{len(stray)} selection samples are not held out (first {list(stray[0])})")
        selection = set(keys["selection"])
        if keys["scored"] != [key for key in keys["heldout"] if key not in selection]:
            raise read.fail("scored", f"{len(keys['scored'])} samples, not the {len(keys['heldout']) - len(selection)} held-out samples "
                                      "outside `selection` in `heldout`'s order")
        sizes = {entry.size for entry in entries["runs"]}
        for index, entry in enumerate(entries["noise_seeds"]):
            if entry.noise_seed is None or entry.size not in sizes:
                raise read.fail(f"noise_seeds[{index}]", f"an extra-seed draft needs its noise_seed and a size of `runs` {sorted(sizes)}, "
                                                         f"got noise_seed {entry.noise_seed!r} at size {entry.size}")
        return cls(
            runs=entries["runs"], noise_seeds=entries["noise_seeds"], ablation=entries["ablation"],
            # `scored` is derived, and was checked to agree
            selection=keys["selection"], heldout=keys["heldout"],
            topology=topology,
            draft_vocab=DraftVocabRecord(**{name: read.field(vocab, name, kind, "draft_vocab.") for name, kind in
                                            (("size", int), ("coverage", float), ("counted_tokens", int), ("coverage_curve", list))}),
            capture_dir=read.field(record, "capture_dir", str), capture_mode=read.field(record, "capture_mode", str),
            capture_layer_ids=read.items(record, "capture_layer_ids", list, int), split_seed=read.field(record, "split_seed", int),
            export=read.items(record, "export", dict, str),
        )


def _from_version_0(record: dict, read: _Reader) -> dict:
    """Sweeps written before the record was versioned: the topology was {"kind", "draft_steps", "top_k"} and
    the entries carried none (every tau was the sweep's chain); the runs had no variant name; the earliest
    had no draft-vocab coverage curve (only notebook 05 draws it)."""
    old = read.field(record, "topology", dict)
    if old.get("kind") != "chain" or not isinstance(old.get("draft_steps"), int):
        raise InputError(read.path, None, "topology", f"{old!r} is not a chain record of an unversioned sweep.json; {RERUN}")
    topology = Topology.chain(old["draft_steps"]).to_dict()
    runs = [{"variant": f"{entry.get('size')} samples", "topology": topology, **entry} if isinstance(entry, dict) else entry
            for entry in read.field(record, "runs", list)]
    ablation = [{"topology": topology, **entry} if isinstance(entry, dict) else entry for entry in record.get("ablation") or []]
    vocab = read.field(record, "draft_vocab", dict)
    return {**record, "topology": topology, "runs": runs, "ablation": ablation, "draft_vocab": {"coverage_curve": [], **vocab}}


_ENTRY_TYPES: dict[str, tuple[type, ...]] = {
    "variant": (str,), "size": (int,), "best_step": (int,), "best_accept_length": (float,), "best_checkpoint": (str,),
    "metrics_path": (str,), "samples_by_dataset": (dict,), "schedule": (str,), "steps": (int,), "step_cap": (int,),
    "samples_seen": (int,), "epochs": (float,), "converged": (bool,), "stopped": (str, type(None)), "improved_step": (int,),
    "recent_gain": (float, type(None)), "recent_window_steps": (list, type(None)), "recent_evaluations": (int,), "heldout_size": (int,),
}
_OPTIONAL_ENTRY_TYPES: dict[str, tuple[type, ...]] = {"checkpoint_bytes": (int, type(None)), "checkpoint_sha256": (str, type(None)),
                                                       "noise_seed": (int, type(None))}


class _Reader:
    """Typed field access on the loaded JSON, every error naming the file and the field's path."""

    def __init__(self, path: str | os.PathLike):
        self.path = path

    def fail(self, where: str, reason: str) -> InputError:
        return InputError(self.path, None, where, f"{reason}; {RERUN}")

    def expect(self, value: Any, kinds: type | tuple[type, ...], where: str) -> Any:
        kinds = kinds if isinstance(kinds, tuple) else (kinds,)
        # JSON has one number type: an integral float is not an int, but an int is a valid float; a bool is
        # neither.
        accepted = kinds + ((int,) if float in kinds else ())
        if isinstance(value, bool) and bool not in kinds or not isinstance(value, accepted):
            names = " or ".join("null" if kind is type(None) else kind.__name__ for kind in kinds)
            raise self.fail(where, f"expected {names}, got {value!r}")
        return float(value) if float in kinds and not isinstance(value, float) and value is not None else value

    def field(self, record: dict, key: str, kinds: type | tuple[type, ...], prefix: str = "") -> Any:
        if key not in record:
            raise self.fail(prefix + key, "missing")
        return self.expect(record[key], kinds, prefix + key)

    def items(self, record: dict, key: str, container: type, kind: type) -> Any:
        """A list (or dict) field whose every element (value) must be of `kind`."""
        value = self.field(record, key, container)
        for name, item in (value.items() if isinstance(value, dict) else enumerate(value)):
            self.expect(item, kind, f"{key}.{name}" if isinstance(value, dict) else f"{key}[{name}]")
        return value

    def strings(self, value: Any, where: str, count: int) -> list[str]:
        if not isinstance(value, list) or len(value) != count or not all(isinstance(item, str) for item in value):
            raise self.fail(where, f"expected {count} strings, got {value!r}")
        return value

    def topology(self, record: dict, prefix: str = "") -> Topology:
        value = self.field(record, "topology", dict, prefix)
        try:
            return Topology.from_dict(value)
        except ValueError as error:
            raise self.fail(prefix + "topology", str(error)) from None

    def entry(self, record: Any, where: str) -> DraftEntry:
        self.expect(record, dict, where)
        values = {key: self.field(record, key, kinds, f"{where}.") for key, kinds in _ENTRY_TYPES.items()}
        # Written since checkpoints were verified; an older file has neither and its entries verify by
        # loading.
        values |= {key: self.expect(record[key], kinds, f"{where}.{key}") for key, kinds in _OPTIONAL_ENTRY_TYPES.items() if key in record}
        return DraftEntry(topology=self.topology(record, f"{where}."), **values)
