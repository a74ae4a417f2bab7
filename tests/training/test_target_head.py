"""Stage 5 reads any target through its TargetLayout: the head tensors by the layout's names (a Kimi-K2.5
wrapper keeps them under `language_model.`), vocab / hidden / layers from the decoder's text config,
and a whole stage 5 (sweep, export, sweep.json) runs on tiny DeepSeek-V3 and Kimi-K2.5-shaped targets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from eaglekit.capture import capture_to_shards
from eaglekit.config import load_params
from eaglekit.draft.model import build_draft_from_target
from eaglekit.io import write_json
from eaglekit.target import target_layout
from eaglekit.training.record import SweepRecord
from eaglekit.training.stage import read_target_head, run_training_stage
from support import tiny_target_folder

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("family", ["llama", "deepseek_v3", "kimi_k25"])
def test_head_tensors_are_the_text_models_own(family, tmp_path):
    layout = target_layout(tiny_target_folder(family, tmp_path / family))
    head = read_target_head(layout)
    text_model = layout.load_text_model(dtype=torch.float32)
    assert head.config.hidden_size == layout.hidden_size and head.config.vocab_size == layout.vocab_size
    assert head.config.num_hidden_layers == layout.num_hidden_layers
    torch.testing.assert_close(head.embed_tokens, text_model.get_input_embeddings().weight.detach(), rtol=0, atol=0)
    torch.testing.assert_close(head.lm_head, text_model.get_output_embeddings().weight.detach(), rtol=0, atol=0)
    torch.testing.assert_close(head.final_norm, text_model.model.norm.weight.detach(), rtol=0, atol=0)
    draft_vocab = 16
    draft = build_draft_from_target(head, torch.zeros(draft_vocab, dtype=torch.int64), torch.arange(layout.vocab_size) < draft_vocab)
    assert draft.config.hidden_size == layout.hidden_size and draft.config.vocab_size == layout.vocab_size
    assert draft.config.target_num_hidden_layers == layout.num_hidden_layers


def test_wrapper_config_is_the_text_config(tmp_path):
    """The Kimi wrapper's top-level config has no hidden_size: reading it (as AutoConfig of the folder did) is wrong."""
    layout = target_layout(tiny_target_folder("kimi_k25", tmp_path / "kimi"))
    assert layout.is_wrapper and "hidden_size" not in layout.config
    assert read_target_head(layout).config.hidden_size == layout.text_config["hidden_size"]


@pytest.mark.parametrize("family", ["deepseek_v3", "kimi_k25"])
def test_stage5_on_moe_mla_targets(family, tmp_path):
    target_dir = tiny_target_folder(family, tmp_path / "target")
    layout = target_layout(target_dir)
    model = layout.load_text_model(dtype=torch.float32).eval()
    run_dir = tmp_path / "run"
    generator = torch.Generator().manual_seed(0)
    files = {}
    for dataset in ("alpha", "beta"):
        folder = run_dir / "prep" / dataset
        folder.mkdir(parents=True)
        files[dataset] = folder / "tokenized_data.jsonl"
        with open(files[dataset], "w") as handle:
            for index in range(6):
                length = int(torch.randint(12, 24, (1,), generator=generator))
                input_ids = torch.randint(0, 400, (length,), generator=generator).tolist()  # a vocab prefix: the draft vocab stays small
                loss_mask = [0] * 4 + [1] * (length - 4)
                handle.write(json.dumps({"id": f"{dataset}-{index}", "input_ids": input_ids, "loss_mask": loss_mask,
                                         "source": dataset, "meta": {}}) + "\n")
    capture_to_shards(model, files, run_dir / "capture", model_name=str(target_dir), capture_layer_ids=[1, 2, 3], max_seq_len=32,
                      progress=False)
    write_json(run_dir / "capture" / "plan.json", {"mode": "offline"})
    params_path = tmp_path / "params.yaml"
    params_path.write_text(yaml.safe_dump({
        "run": {"name": "layout", "outputs_dir": str(tmp_path)}, "target": {"model": str(target_dir), "capture_layers": [1, 2, 3]},
        "training": {"data_sizes": [4, 8], "heldout_size": 4, "ttt_steps": 2, "speculative_tokens": 2, "draft_vocab_size": 64,
                     "learning_rate": 3.0e-3, "min_learning_rate": 3.0e-4, "warmup_steps": 1, "schedule": "equal_steps", "max_steps": 2,
                     "micro_batch_size": 1, "grad_accumulation_steps": 2, "eval_interval": 2, "max_length": 32, "log_interval_s": 60},
        "analysis": {"chain_steps": 2, "ablation": False}}))
    sweep = run_training_stage(load_params(params_path), run_dir)
    assert sweep == SweepRecord.load_run(run_dir) and sweep.sizes == [4, 8]
    assert sweep.draft_vocab.size == 64 and sweep.capture_layer_ids == [1, 2, 3]
    exported = json.loads((run_dir / sweep.export["sglang"] / "config.json").read_text())
    assert exported["hidden_size"] == layout.hidden_size and exported["vocab_size"] == layout.vocab_size
    assert exported["draft_vocab_size"] == 64
