"""The held-out set cut in two (`split_selection`): one side picks and stops each draft, the other alone is
scored. Disjoint, covering, dataset-stratified, conversations whole, and a function of the held-out keys and
the seed only (stage 5 lists them in capture order, the staged worker in prep's planned order)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from eaglekit.training.split import split_selection


def heldout_keys() -> tuple[list[tuple[str, str]], list[str]]:
    """20 alpha samples (conversations of 1-3 turns) and 10 beta samples, with their conversation keys."""
    keys, conversations = [], []
    for number in range(12):
        for turn in range(1 + number % 3 if number < 8 else 1):
            keys.append(("alpha", f"a{number}.{turn}"))
            conversations.append(f"a{number}")
    keys = keys[:20]
    conversations = conversations[:20]
    keys += [("beta", f"b{number}") for number in range(10)]
    conversations += [f"b{number}" for number in range(10)]
    return keys, conversations


def test_the_two_sides_are_disjoint_cover_the_set_and_keep_datasets_and_conversations():
    keys, conversations = heldout_keys()
    selection, scored = split_selection(keys, 0.5, seed=3, conversations=conversations)
    assert set(selection).isdisjoint(scored) and sorted(selection + scored) == list(range(len(keys)))
    assert abs(len(selection) - 15) <= 2  # half, give or take a last conversation's extra turns
    by_side = {
        name: Counter(keys[position][0] for position in side)
        for name, side in (("selection", selection), ("scored", scored))
    }
    assert all(by_side[side]["beta"] >= 4 for side in by_side), (
        by_side
    )  # stratified: beta (a third) on both sides
    side_of = {}
    for position in selection + scored:
        side = position in selection
        assert side_of.setdefault(conversations[position], side) == side, (
            f"conversation {conversations[position]} on both sides"
        )


def test_the_split_depends_on_the_keys_and_the_seed_never_on_their_order():
    keys, conversations = heldout_keys()
    selection, scored = split_selection(keys, 0.5, 3, conversations)
    shuffled = list(range(len(keys)))
    random.Random(1).shuffle(shuffled)
    again, rest = split_selection([keys[i] for i in shuffled], 0.5, 3, [conversations[i] for i in shuffled])
    assert sorted(keys[shuffled[p]] for p in again) == sorted(keys[p] for p in selection)
    assert sorted(keys[shuffled[p]] for p in rest) == sorted(keys[p] for p in scored)
    assert split_selection(keys, 0.5, 3, conversations) == (selection, scored)  # a resume gets the same cut
    assert split_selection(keys, 0.5, 4, conversations) != (selection, scored)


def test_a_last_conversation_never_takes_every_sample_and_one_conversation_cannot_be_cut():
    # Two conversations, of 1 and 3 samples: whichever comes first, one is left to score.
    keys = [("alpha", "x"), ("alpha", "y.0"), ("alpha", "y.1"), ("alpha", "y.2")]
    for seed in range(6):
        selection, scored = split_selection(keys, 0.5, seed, ["x", "y", "y", "y"])
        assert selection and scored and set(selection).isdisjoint(scored)
    with pytest.raises(ValueError, match="1 conversation.*raise training.heldout_size"):
        split_selection(keys[1:], 0.5, 0, ["y", "y", "y"])
