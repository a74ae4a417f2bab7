"""Data order and the held-out split: stratified orders, conversations kept whole, nested subsets, epochs.

The same seed gives the same held-out set for every data size, and each larger training subset contains
every smaller one, so the scaling curve's points differ only by data. A sample's place in training is a
function of its global data position (`sample_index_at`), which is all a checkpoint needs to resume the
exact sample order.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from eaglekit.io import read_jsonl


def stratified_order(datasets: Sequence[str], seed: int, weights: Sequence[int] | None = None) -> list[int]:
    """A permutation of item indices whose every prefix holds each dataset in proportion (within one item).

    Each dataset is shuffled; an item gets key (samples before it + its weight / 2) / the dataset's samples
    (weights: samples per item, 1 each by default, so the r-th gets (r + 0.5) / n_dataset); sorting by key
    interleaves datasets evenly, so prefixes are stratified and nested by construction.
    """
    generator = np.random.default_rng(seed)
    weights = [1] * len(datasets) if weights is None else list(weights)
    keys: list[tuple[float, float, int]] = []
    for name in sorted(set(datasets)):
        members = np.array([index for index, dataset in enumerate(datasets) if dataset == name])
        generator.shuffle(members)
        total, before = sum(weights[index] for index in members), 0
        for index in members:
            keys.append(((before + weights[index] / 2) / total, float(generator.random()), int(index)))
            before += weights[index]
    return [index for _, _, index in sorted(keys)]


def conversation_key(sample_id: str, meta: Any) -> str:
    """The conversation a sample belongs to: `meta.conversation_id`, else the sample's own id.

    A template that rewrites history (Qwen3, Kimi thinking, DeepSeek-R1) splits one conversation into
    samples `<id>.0`, `<id>.1`, ... that share `meta.conversation_id` (eaglekit.data.prep).
    """
    conversation = meta.get("conversation_id") if isinstance(meta, dict) else None
    return conversation if isinstance(conversation, str) and conversation else sample_id


def read_conversation_keys(data_files: dict[str, str | os.PathLike], keys: Sequence[tuple[str, str]]) -> list[str]:
    """`conversation_key` of each (dataset, id) in `keys`, read from the meta of the tokenized files
    (dataset -> tokenized_data.jsonl) the samples were captured from; the shards keep no meta."""
    wanted, found = set(keys), {}
    for dataset, path in data_files.items():
        for _, record in read_jsonl(path):
            if isinstance(record, dict) and (dataset, record.get("id")) in wanted:
                found[(dataset, record["id"])] = conversation_key(record["id"], record.get("meta"))
    missing = [key for key in keys if key not in found]
    if missing:
        raise ValueError(f"{len(missing)} captured samples are not in the tokenized files {sorted(map(str, data_files.values()))} "
                         f"(first: {missing[0]}): the capture is older than its data; capture again")
    return [found[key] for key in keys]


def split_heldout(
    datasets: Sequence[str], heldout_size: int, seed: int, conversations: Sequence[str] | None = None
) -> tuple[list[int], list[int]]:
    """(held-out indices, training order), stratified by dataset, each conversation wholly on one side.

    conversations: one key per sample (`conversation_key`; None: every sample is its own). The samples of
    one conversation in one dataset are held out or trained together, so no turn of a held-out
    conversation trains the draft (its history would leak into the held-out tau). Conversations are
    taken in a stratified order (weighted by their samples) until `heldout_size` samples are held out;
    the last one may add up to its size - 1 more. The training order keeps a conversation's samples
    adjacent, in index order. Without split conversations this is the first `heldout_size` of
    `stratified_order(datasets, seed)`. The same seed gives the same held-out set for every data size.
    """
    if not 0 < heldout_size < len(datasets):
        raise ValueError(f"heldout_size {heldout_size} must be between 1 and {len(datasets) - 1} (there are {len(datasets)} samples)")
    if conversations is not None and len(conversations) != len(datasets):
        raise ValueError(f"conversations names {len(conversations)} samples but there are {len(datasets)}")
    members: dict[tuple[str, str], list[int]] = {}
    for index, name in enumerate(datasets):
        members.setdefault((name, str(index) if conversations is None else conversations[index]), []).append(index)
    # ordered by first sample, so singletons reproduce stratified_order(datasets)
    groups = list(members.values())
    order = stratified_order([datasets[group[0]] for group in groups], seed, [len(group) for group in groups])
    heldout: list[int] = []
    taken = 0
    while len(heldout) < heldout_size:
        heldout += groups[order[taken]]
        taken += 1
    train_order = [index for position in order[taken:] for index in groups[position]]
    if not train_order:
        raise ValueError(f"heldout_size {heldout_size} holds out every conversation ({len(groups)}): lower it")
    return sorted(heldout), train_order


def split_selection(
    heldout_keys: Sequence[tuple[str, str]], share: float, seed: int, conversations: Sequence[str] | None = None
) -> tuple[list[int], list[int]]:
    """(selection positions, scored positions) in `heldout_keys`: the held-out set cut in two, both sorted.

    The selection side picks each draft's best checkpoint and stops its training; stage 6 scores on the
    other side only, so no score is taken on the samples that chose what is scored (that is optimistic).
    `split_heldout`'s rule over the held-out samples: dataset-stratified, each conversation (one key per
    sample) wholly on one side, about round(share x n) samples selecting (at least 1, at most n - 1, more
    by a last conversation's size - 1). The keys are sorted before splitting, so the split depends on
    the held-out set and the seed, never on the order a caller lists them in: stage 5 (capture order) and
    the staged worker (prep's planned order) get the same split.
    """
    keys = [tuple(key) for key in heldout_keys]
    if conversations is not None and len(conversations) != len(keys):
        raise ValueError(f"conversations names {len(conversations)} samples but there are {len(keys)} held-out samples")
    if len(set(keys)) != len(keys):
        raise ValueError(f"the held-out keys repeat a sample ({len(keys) - len(set(keys))} repeats)")
    order = sorted(range(len(keys)), key=lambda position: keys[position])
    groups = {(keys[position][0], keys[position][1] if conversations is None else conversations[position]) for position in order}
    if len(groups) < 2:
        raise ValueError(f"the {len(keys)} held-out samples are {len(groups)} conversation(s): picking checkpoints on some and scoring "
                         "on others needs at least 2; raise training.heldout_size")
    datasets = [keys[position][0] for position in order]
    sorted_conversations = None if conversations is None else [conversations[position] for position in order]
    # A last conversation can take every sample left: then ask for fewer (1 always leaves a conversation to
    # score).
    for count in range(min(max(round(share * len(keys)), 1), len(keys) - 1), 0, -1):
        try:
            selection, scored = split_heldout(datasets, count, seed, sorted_conversations)
        except ValueError:
            continue
        return sorted(order[index] for index in selection), sorted(order[index] for index in scored)
    raise AssertionError("unreachable: a selection of one conversation leaves another to score")


def nested_subsets(train_order: Sequence[int], sizes: Sequence[int]) -> dict[int, list[int]]:
    """Prefixes of a stratified training order: each larger subset contains every smaller one.

    `train_order` (from `split_heldout`) holds no held-out sample and keeps each conversation's samples
    adjacent, so a subset holds whole conversations except at most its last one, cut after its earlier
    turns: sizes stay exact sample counts (the x axis of the scaling curve).
    """
    too_big = [size for size in sizes if not 0 < size <= len(train_order)]
    if too_big:
        raise ValueError(f"data sizes {too_big} exceed the {len(train_order)} training samples (after the held-out split); lower them")
    return {int(size): list(train_order[:size]) for size in sorted(sizes)}


def ablation_sample_keys(
    main_keys: Sequence[tuple[str, str]], original_keys: Sequence[tuple[str, str]], heldout_size: int, largest_size: int, seed: int,
    conversations: Sequence[str] | None = None, heldout_indices: Sequence[int] | None = None,
) -> list[tuple[str, str]]:
    """The (dataset, id) samples of the ablation draft: original answers, never a held-out prompt.

    main_keys: the sweep's samples in capture-index order (the order `train_size_sweep` splits), with
    their `conversations` (`read_conversation_keys`), the same the sweep splits by;
    original_keys: class-B samples with the datasets' own answers (same ids as their regenerated twins).
    Takes a dataset-stratified prefix of min(largest_size, candidates) so the ablation matches the
    largest regenerated draft's size whenever enough original answers exist. `heldout_indices`: the sweep's
    held-out positions in main_keys when already split (`order.sweep_split`), else split here.
    """
    if heldout_indices is None:
        heldout_indices, _ = split_heldout([dataset for dataset, _ in main_keys], heldout_size, seed, conversations)
    heldout = {tuple(main_keys[index]) for index in heldout_indices}
    candidates = [tuple(key) for key in original_keys if tuple(key) not in heldout]
    if not candidates:
        raise ValueError("no original answers outside the held-out set: the ablation needs class-B datasets with their own answers")
    order = stratified_order([dataset for dataset, _ in candidates], seed)
    return [candidates[index] for index in order[: min(largest_size, len(candidates))]]


def token_reader(samples: Sequence[dict]) -> Callable[[int], dict]:
    """samples.tokens (a sample without its features) where the samples offer it, else the whole sample."""
    return getattr(samples, "tokens", None) or samples.__getitem__


class IndexedSubset(Sequence):
    """A view of `samples` at `indices` (no copy; shard readers stay lazy)."""

    def __init__(self, samples: Sequence[dict], indices: Sequence[int]):
        self.samples, self.indices = samples, list(indices)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, position: int) -> dict:  # type: ignore[override]
        return self.samples[self.indices[position]]

    def tokens(self, position: int) -> dict:
        """The sample without its features where the underlying samples can read so (`sample_lengths`)."""
        return token_reader(self.samples)(self.indices[position])


def sample_index_at(position: int, num_samples: int, seed: int) -> int:
    """The sample at global data position `position`: epoch e = position // N reads permutation e.

    The data position is all a checkpoint needs to resume the exact sample order.
    """
    epoch, offset = divmod(position, num_samples)
    return int(_epoch_permutation(num_samples, seed, epoch)[offset])


@functools.lru_cache(maxsize=2)
def _epoch_permutation(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_samples, generator=generator)
