"""Stage 6's reading of stage 5: the held-out samples a sweep names, every draft's offline agreement, and the
ablation variants scored and drawn from the sweep record alone."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from eaglekit.analysis.acceptance import acceptance_tables
from eaglekit.analysis.checkpoints import (
    evaluate_speculative_loop,
    heldout_prompts,
    heldout_samples,
    offline_agreements_by_size,
    score_ablation,
)
from eaglekit.draft.model import build_draft_from_target, load_target_head_weights
from eaglekit.analysis.plots import plot_ablation
from eaglekit.training import TrainSettings, save_checkpoint
from eaglekit.draft.vocab import count_generated_tokens, select_draft_vocab
from support import samples_from_target, tiny_target
from support import record

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Captured:
    """The part of capture.CapturedSamples stage 6 reads: keys and items."""

    def __init__(self, samples: list[dict]):
        self.samples = samples
        self.keys = [(sample["dataset"], sample["id"]) for sample in samples]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, position: int) -> dict:
        return self.samples[position]


def test_heldout_samples_come_in_the_sweeps_order_and_a_missing_one_is_named():
    samples = [
        {"dataset": dataset, "id": f"{dataset}-{index}"}
        for dataset in ("alpha", "beta")
        for index in range(3)
    ]
    sweep = dataclasses.replace(record(), heldout=[("beta", "beta-2"), ("alpha", "alpha-0")])
    assert [sample["id"] for sample in heldout_samples(sweep, Captured(samples))] == ["beta-2", "alpha-0"]
    with pytest.raises(ValueError, match=r"1 held-out samples .* \[\('alpha', 'alpha-9'\)\].*rerun stage 5"):
        heldout_samples(
            dataclasses.replace(sweep, heldout=[("alpha", "alpha-9"), ("beta", "beta-0")]), Captured(samples)
        )


def test_ablation_variants_are_scored_from_the_record_and_drawn(tmp_path):
    target = tiny_target()
    target.save_pretrained(tmp_path / "target")
    head = load_target_head_weights(tmp_path / "target")
    samples = samples_from_target(target, 6, seed=3)
    vocab = select_draft_vocab(count_generated_tokens(samples, target.config.vocab_size), 200)
    base = record()
    ablation = [
        dataclasses.replace(entry, best_checkpoint=f"training/ablation/{entry.variant.split()[0]}/best.pt")
        for entry in base.ablation
    ]
    for seed, entry in enumerate(ablation):  # a different draft per variant
        draft = build_draft_from_target(head, vocab.d2t, vocab.t2d, seed=seed)
        path = tmp_path / "run" / entry.best_checkpoint
        path.parent.mkdir(parents=True, exist_ok=True)
        save_checkpoint(
            path, draft.state_dict(), {}, {"step": entry.best_step}, TrainSettings(), draft
        )  # the step sweep.json names
    sweep = dataclasses.replace(base, ablation=ablation)

    table = score_ablation(
        sweep,
        tmp_path / "run",
        head.embed_tokens,
        head.lm_head,
        samples,
        steps=2,
        max_length=64,
        num_resamples=20,
    )
    assert set(table["variant"]) == {"original answers", "regenerated answers"} and set(
        table["data_size"]
    ) == {16}
    by_size = offline_agreements_by_size(
        {1: tmp_path / "run" / ablation[0].best_checkpoint},
        head.embed_tokens,
        head.lm_head,
        samples,
        steps=2,
        max_length=64,
    )
    expected, _ = acceptance_tables(by_size[1], 2, 20)
    original = table[table["variant"] == "original answers"].reset_index(drop=True)
    np.testing.assert_allclose(original["tau_pooled"], expected["tau_pooled"])
    figure = plot_ablation(table)
    assert [patch.get_height() for patch in figure.axes[0].patches] == pytest.approx(
        table[table["dataset"] == "all"]["tau_pooled"].tolist()
    )

    assert (
        score_ablation(
            dataclasses.replace(sweep, ablation=[]),
            tmp_path / "run",
            head.embed_tokens,
            head.lm_head,
            samples,
            steps=2,
        )
        is None
    )


def test_loop_table_names_each_prompt_and_a_lossy_loop_is_refused(tmp_path):
    target = tiny_target()
    target.save_pretrained(tmp_path / "target")
    head = load_target_head_weights(tmp_path / "target")
    samples = samples_from_target(target, 4, seed=5)
    vocab = select_draft_vocab(count_generated_tokens(samples, target.config.vocab_size), 200)
    draft = build_draft_from_target(head, vocab.d2t, vocab.t2d, capture_layer_indices=(1, 3, 5), seed=1)
    prompts = heldout_prompts(samples, 3, max_prompt_tokens=64)
    report = evaluate_speculative_loop(
        target, draft, [prompt["input_ids"] for prompt in prompts], 2, 5, warmup=False
    )
    report.require_lossless()  # the real loop is lossless
    table = report.per_prompt_table(prompts)
    assert table["id"].tolist() == [prompt["id"] for prompt in prompts]
    assert table["dataset"].tolist() == [prompt["dataset"] for prompt in prompts]
    assert table["prompt_tokens"].tolist() == [len(prompt["input_ids"]) for prompt in prompts]
    assert table["output_tokens"].tolist() == [len(result.output_ids) for result in report.speculative]
    with pytest.raises(ValueError, match="2 prompts given for a loop over 3"):
        report.per_prompt_table(prompts[:2])
    # One output differs from greedy (as a broken KV rollback would make it): refused, naming the prompt.
    lossy = dataclasses.replace(
        report,
        summary={**report.summary, "outputs_equal": False},
        per_prompt=[{**row, "outputs_equal": row["prompt"] != 1} for row in report.per_prompt],
    )
    with pytest.raises(RuntimeError, match=r"differs from plain greedy decoding on prompts \[1\]"):
        lossy.require_lossless()


def test_a_checkpoint_with_nan_weights_is_refused_before_any_tau(tmp_path):
    """What a run that trained on a NaN feature saved before the guard: loading it for scoring names the
    file."""
    from eaglekit.analysis.checkpoints import load_draft_checkpoint

    target = tiny_target()
    target.save_pretrained(tmp_path / "target")
    head = load_target_head_weights(tmp_path / "target")
    vocab = select_draft_vocab(
        count_generated_tokens(samples_from_target(target, 3, seed=3), target.config.vocab_size), 200
    )
    draft = build_draft_from_target(head, vocab.d2t, vocab.t2d)
    state = {name: tensor.clone() for name, tensor in draft.state_dict().items()}
    state["fc.weight"][0, 0] = float("nan")
    save_checkpoint(tmp_path / "best.pt", state, {}, {"step": 4}, TrainSettings(), draft)
    with pytest.raises(
        RuntimeError, match=rf"{tmp_path / 'best.pt'}: the draft's weights \['fc.weight'\] hold NaN"
    ):
        load_draft_checkpoint(tmp_path / "best.pt", head.embed_tokens)
