"""The training order fixed from prep's ids, before any answer exists: `prep/order.json`.

Stage 5's split (`split.split_heldout`) is a function of the samples' (dataset, id, conversation) in
capture order. Prep knows all of them before generation: class A's tokenized samples and class B's
prompts, in the order stage 3 and stage 4 will write and read them (datasets by name, class A first;
prompt files by name; lines in file order). So prep plans the held-out set and the training order once,
and every later stage reads the same plan:
- stage 3 requests prompts in that order (held-out first, then training order, within each partition),
  so the samples the first data sizes need are answered first;
- stages 4 and 5 split the captured samples by it (`TrainingOrder.split`): a planned sample that never
  became a training sample (failed for good, dropped, rejected) leaves its place empty and every other
  sample keeps its place, so a size's subset does not change when a later answer fails.
When every planned sample is captured, the split equals `split_heldout` over the captured samples
(tests/training/test_order.py checks it against that oracle).
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from eaglekit.io import InputError, read_json, read_jsonl, write_json
from eaglekit.run_folder import ORDER_FILE, order_path
from eaglekit.training.split import conversation_key, split_heldout

logger = logging.getLogger(__name__)

Key = tuple[str, str]  # (dataset, sample id)
REPLAN = "run prep again (or delete the file to split the captured samples)"


@dataclass(frozen=True)
class TrainingOrder:
    """The held-out samples and the training order, as (dataset, id) keys, for one seed and held-out size."""

    seed: int
    heldout_size: int
    heldout: tuple[Key, ...]
    train: tuple[Key, ...]

    def priority(self) -> list[Key]:
        """The order to generate in: the held-out set, then the training order."""
        return [*self.heldout, *self.train]

    def split(self, keys: Sequence[Key], source: str = ORDER_FILE) -> tuple[list[int], list[int]]:
        """(held-out indices, training order) over `keys` (captured samples, capture order), as
        `split_heldout` returns them.

        Raises when a key is not in the plan: the data changed after prep planned the order."""
        position = {tuple(key): index for index, key in enumerate(keys)}
        planned = set(self.heldout) | set(self.train)
        unplanned = [key for key in position if key not in planned]
        if unplanned:
            raise ValueError(f"{source}: {len(unplanned)} captured samples are not in the planned order (first: {unplanned[0]}): "
                             f"the data changed after prep planned it; {REPLAN}")
        heldout = sorted(position[key] for key in self.heldout if key in position)
        train = [position[key] for key in self.train if key in position]
        if not heldout or not train:
            raise ValueError(f"{source}: {len(heldout)} held-out and {len(train)} training samples were captured: "
                             "both sides need samples")
        return heldout, train

    def to_dict(self) -> dict:
        return {"seed": self.seed, "heldout_size": self.heldout_size, "heldout": [list(key) for key in self.heldout],
                "train": [list(key) for key in self.train]}

    @classmethod
    def load(cls, path: str | os.PathLike) -> TrainingOrder:
        record = read_json(path, REPLAN)
        for field, kind in (("seed", int), ("heldout_size", int), ("heldout", list), ("train", list)):
            if not isinstance(record.get(field) if isinstance(record, dict) else None, kind):
                raise InputError(path, None, field, f"missing or not a {kind.__name__}")
        keys = {}
        for field in ("heldout", "train"):
            for number, key in enumerate(record[field]):
                if not (isinstance(key, list) and len(key) == 2 and all(isinstance(part, str) for part in key)):
                    raise InputError(path, None, f"{field}[{number}]", f"expected [dataset, id], got {key!r}")
            keys[field] = tuple(tuple(key) for key in record[field])
        return cls(record["seed"], record["heldout_size"], keys["heldout"], keys["train"])


def planned_samples(prep_dir: str | os.PathLike) -> list[tuple[str, str, str]]:
    """(dataset, id, conversation key) of every sample the run can train on, in the order stage 4 reads them:
    class A's tokenized samples (datasets by name), then class B's prompts (datasets by name, files by
    name)."""
    prep_dir = Path(prep_dir)
    samples: list[tuple[str, str, str]] = []
    seen: set[Key] = set()

    def add(dataset: str, record: dict) -> None:
        key = (dataset, str(record.get("id")))
        if key not in seen:  # a repeated prompt id is answered once (the engine keeps the first)
            seen.add(key)
            samples.append((*key, conversation_key(key[1], record.get("meta"))))

    for pattern in ("*/tokenized_data.jsonl", "*/prompts.*.jsonl"):
        # paths sort by their parts: datasets by name, then files by name
        for path in sorted(prep_dir.glob(pattern)):
            for _, record in read_jsonl(path):
                add(path.parent.name, record)
    return samples


def plan_training_order(prep_dir: str | os.PathLike, heldout_size: int, seed: int) -> TrainingOrder:
    """Stage 5's split over every sample prep wrote (`planned_samples`)."""
    samples = planned_samples(prep_dir)
    heldout, train = split_heldout([dataset for dataset, _, _ in samples], heldout_size, seed,
                                   [conversation for _, _, conversation in samples])
    keys = [(dataset, sample_id) for dataset, sample_id, _ in samples]
    return TrainingOrder(seed, heldout_size, tuple(keys[index] for index in heldout), tuple(keys[index] for index in train))


def write_training_order(prep_dir: str | os.PathLike, heldout_size: int, seed: int) -> TrainingOrder | None:
    """Prep's last step: plan the order and write `prep/order.json`; None (and a warning) when it cannot be
    planned (fewer samples than the held-out set needs), in which case stage 5 splits what was captured."""
    try:
        order = plan_training_order(prep_dir, heldout_size, seed)
    except ValueError as error:
        logger.warning("no training order planned (%s): stage 5 will split the captured samples", error)
        (Path(prep_dir) / ORDER_FILE).unlink(missing_ok=True)
        return None
    write_json(Path(prep_dir) / ORDER_FILE, order.to_dict())
    return order


def read_training_order(run_dir: str | os.PathLike, heldout_size: int, seed: int) -> TrainingOrder | None:
    """`prep/order.json` when it was planned for this seed and held-out size; None when absent (a run folder
    from before the plan existed) or planned for other values (a warning says so; the captured samples are
    split)."""
    path = order_path(run_dir)
    if not path.exists():
        return None
    order = TrainingOrder.load(path)
    if (order.seed, order.heldout_size) != (seed, heldout_size):
        logger.warning("%s was planned for seed %d and heldout_size %d, not %d and %d: splitting the captured samples instead",
                       path, order.seed, order.heldout_size, seed, heldout_size)
        return None
    return order


def sweep_split(run_dir: str | os.PathLike, keys: Sequence[Key], heldout_size: int, seed: int,
                conversations: Sequence[str] | None = None) -> tuple[list[int], list[int]]:
    """(held-out indices, training order) over the captured `keys`: by `prep/order.json` when prep planned it
    for this seed and held-out size, else `split_heldout` over the captured samples."""
    order = read_training_order(run_dir, heldout_size, seed)
    if order is None:
        return split_heldout([dataset for dataset, _ in keys], heldout_size, seed, conversations)
    return order.split(keys, str(order_path(run_dir)))


def requests_before_each_size(order: TrainingOrder, partition_of: dict[Key, str], sizes: Sequence[int]) -> list[dict]:
    """For each data size, how far into each partition's requests (in the planned order) generation must get
    before that size's samples and the held-out set are all answered: {"size", "<partition>": (needed,
    total)}.

    partition_of: the partition of every class-B prompt (class-A samples need no answer). A planned sample is
    counted as needed whether or not its answer will succeed: a failed one is skipped, and the next in the
    order takes its place, so the real point can be a few requests later."""
    rank = {key: position for position, key in enumerate(order.priority())}
    totals = Counter(partition_of.values())  # partitions in first-seen order
    request_order = {partition: sorted((key for key in partition_of if partition_of[key] == partition),
                                       key=lambda key: rank.get(key, len(rank)))
                     for partition in totals}
    place = {key: position + 1 for keys in request_order.values() for position, key in enumerate(keys)}
    rows = []
    for size in sorted(sizes):
        needed = [*order.heldout, *order.train[:size]]
        row: dict = {"size": int(size)}
        for partition in totals:
            row[partition] = (max((place[key] for key in needed if partition_of.get(key) == partition), default=0), totals[partition])
        rows.append(row)
    return rows
