"""Recipe levers of issue 14: distillation target (soft vs argmax) and feature noise. Each test fails if
the lever is ignored (the soft teacher used anyway, the noise never added, or added to the teacher)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from eaglekit.config import Params
from eaglekit.training import TrainSettings, add_feature_noise, target_signals, train_draft, ttt_loss
from eaglekit.draft.vocab import count_generated_tokens
from support import samples_from_target, target_head, tiny_draft, tiny_target

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SETTINGS = TrainSettings(
    ttt_steps=2,
    learning_rate=3e-3,
    min_learning_rate=3e-4,
    warmup_steps=0,
    schedule="equal_steps",
    max_steps=2,
    micro_batch_size=2,
    grad_accumulation_steps=1,
    eval_interval=2,
    max_length=64,
)


@pytest.fixture(scope="module")
def world():
    target = tiny_target()
    samples = samples_from_target(target, 6, seed=5)
    return target, samples[:4], samples[4:]


def teacher(world, distill: str):
    target, train, _ = world
    draft = tiny_draft(
        target, train, draft_vocab_size=40
    )  # small vocab: some target argmaxes fall outside it
    final = torch.stack([sample["final_hidden_states"][:12] for sample in train])  # (B, T, H)
    signals = target_signals(
        final, target.lm_head.weight.detach(), draft.draft_to_target_ids(), draft.t2d, distill=distill
    )
    return draft, signals


def test_argmax_teacher_is_one_hot_at_the_targets_greedy_token(world):
    draft, signals = teacher(world, "argmax")
    _, soft = teacher(world, "soft")
    assert signals.in_draft.any() and not signals.in_draft.all()  # both kinds of rows are exercised
    draft_to_target = draft.draft_to_target_ids()
    # Where the target's greedy token is draftable, the teacher puts all its mass on exactly that token.
    counted = signals.in_draft
    assert torch.equal(signals.probs[counted].sum(-1), torch.ones(int(counted.sum())))
    assert torch.equal(draft_to_target[signals.probs[counted].argmax(-1)], signals.argmax[counted])
    assert torch.equal(signals.argmax, soft.argmax) and torch.equal(signals.in_draft, soft.in_draft)
    assert not torch.allclose(signals.probs[counted], soft.probs[counted])


def test_argmax_loss_equals_cross_entropy_on_the_greedy_labels(world):
    draft, signals = teacher(world, "argmax")
    batch, length = signals.argmax.shape
    generator = torch.Generator().manual_seed(0)
    step_logits = [
        torch.randn(batch, length, draft.lm_head.weight.shape[0], generator=generator) for _ in range(2)
    ]
    eligible = torch.ones(2, batch, length, dtype=torch.bool)
    counts = torch.tensor([50.0, 40.0])
    loss, _ = ttt_loss(step_logits, signals, eligible, counts, 0.8, draft.draft_to_target_ids())
    # Independent oracle: draft index of the target's greedy token, plain cross-entropy, same weighting.
    draft_to_target = draft.draft_to_target_ids()
    target_to_draft = torch.full((world[0].config.vocab_size,), -1)
    target_to_draft[draft_to_target] = torch.arange(len(draft_to_target))
    expected = torch.zeros(())
    for step, logits in enumerate(step_logits):
        labels = signals.argmax[:, 1 + step :]
        keep = signals.in_draft[:, 1 + step :]
        cross_entropy = F.cross_entropy(
            logits[:, : length - 1 - step][keep], target_to_draft[labels[keep]], reduction="sum"
        )
        expected = expected + 0.8**step * cross_entropy / counts[step]
    torch.testing.assert_close(loss, expected)
    _, soft = teacher(world, "soft")
    soft_loss, _ = ttt_loss(step_logits, soft, eligible, counts, 0.8, draft_to_target)
    assert not torch.isclose(soft_loss, loss)


def test_feature_noise_has_the_stated_scale_and_zero_is_the_identity():
    generator = torch.Generator().manual_seed(0)
    features = (
        torch.randn(4, 300, 96, generator=generator) * torch.linspace(0.1, 30.0, 300)[None, :, None]
    )  # token scales differ
    assert add_feature_noise(features, 0.0) is features
    torch.manual_seed(1)
    noisy = add_feature_noise(features, 0.2)
    noise = noisy - features
    rms = features.pow(2).mean(-1, keepdim=True).sqrt()
    relative = noise / rms  # uniform on [-sqrt(3) 0.2, sqrt(3) 0.2] for every token
    assert relative.abs().max() <= math.sqrt(3) * 0.2 + 1e-5
    assert abs(float(relative.std()) - 0.2) < 0.005 and abs(float(relative.mean())) < 0.005
    torch.manual_seed(1)
    assert torch.equal(add_feature_noise(features, 0.2), noisy)  # the seeded RNG decides the noise
    assert add_feature_noise(features.bfloat16(), 0.2).dtype == torch.bfloat16


def first_train_loss(world, tmp_path, **changes) -> float:
    target, train, heldout = world
    settings = TrainSettings(**{**SETTINGS.__dict__, **changes})
    result = train_draft(
        tiny_draft(target, train), target.lm_head.weight.detach(), train, heldout, tmp_path, settings
    )
    records = [json.loads(line) for line in result.metrics_path.read_text().splitlines()]
    return next(record["loss"] for record in records if record["split"] == "train")


def test_training_uses_the_levers(world, tmp_path):
    """The first step's loss is computed from the (noised) features and the chosen teacher: a lever
    that training ignores leaves it unchanged; the same seed gives the same noise."""
    plain = first_train_loss(world, tmp_path / "plain")
    noisy = first_train_loss(world, tmp_path / "noisy", feature_noise=0.5)
    assert noisy != pytest.approx(plain, rel=1e-6)
    assert first_train_loss(world, tmp_path / "noisy-again", feature_noise=0.5) == noisy
    assert first_train_loss(world, tmp_path / "argmax", distill="argmax") != pytest.approx(plain, rel=1e-6)


def test_levers_come_from_params_and_are_checked():
    params = Params.model_validate({"training": {"feature_noise": 0.1, "distill": "argmax"}})
    settings = TrainSettings.from_params(params)
    assert (settings.feature_noise, settings.distill) == (0.1, "argmax")
    defaults = TrainSettings.from_params(Params())
    assert (defaults.feature_noise, defaults.distill) == (0.0, "soft")
    with pytest.raises(ValueError, match="distill"):
        TrainSettings(distill="hard")
    with pytest.raises(ValueError, match="feature_noise"):
        TrainSettings(feature_noise=-0.1)


def test_ablation_variants_combine_levers_left_to_right(world):
    """bench/recipe_ablation.py: "a+b" applies both levers' settings and vocab changes; an unknown part is
    named."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from recipe_ablation import variant_draft, variant_settings

    base = TrainSettings(learning_rate=3e-4, min_learning_rate=1e-5, smoothing_evaluations=1)
    combined = variant_settings("vocab_double+anneal_120+smoothing_2", base)
    assert (combined.decay_steps, combined.smoothing_evaluations, combined.learning_rate) == (120, 2, 3e-4)
    assert variant_settings("lr_x3+anneal_60", base).learning_rate == pytest.approx(9e-4)
    assert variant_settings("baseline", base) == base
    target, train, _ = world
    counts = count_generated_tokens(train, target.config.vocab_size)
    _, vocab = variant_draft("vocab_double+anneal_120", target_head(target), counts, 16, seed=0)
    _, twice_halved = variant_draft("vocab_half+vocab_half", target_head(target), counts, 16, seed=0)
    assert (vocab.size, twice_halved.size) == (32, 4)
    with pytest.raises(SystemExit, match="'anneal_7'"):
        variant_settings("vocab_double+anneal_7", base)
