"""The seed's target shapes end to end on CPU: tiny DeepSeek-V3 (MoE + MLA) and a Kimi-K2.5-shaped wrapper
(`language_model.*`, `text_config`) through stage 4 (capture), stage 5 (training, export)
and `eaglekit evaluate`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from eaglekit.capture.shards import ShardDataset
from eaglekit.capture.stage import run_capture_stage
from eaglekit.config import load_params
from eaglekit.target import target_layout
from eaglekit.training.stage import run_training_stage
from support import tiny_target_folder


def _tokenized(run_dir, tokenizer_dir, count: int = 6):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    for dataset in ("alpha", "beta"):
        folder = run_dir / "prep" / dataset
        folder.mkdir(parents=True)
        with open(folder / "tokenized_data.jsonl", "w") as handle:
            for index in range(count):
                prompt = tokenizer(f"Question {index} about {dataset}: what is {index} plus {index}?")[
                    "input_ids"
                ]
                answer = tokenizer(f" It is {2 * index}, since {index} and {index} make {2 * index}.")[
                    "input_ids"
                ]
                handle.write(
                    json.dumps(
                        {
                            "id": f"{dataset}-{index}",
                            "input_ids": prompt + answer,
                            "loss_mask": [0] * len(prompt) + [1] * len(answer),
                            "source": dataset,
                            "meta": {},
                        }
                    )
                    + "\n"
                )


@pytest.mark.parametrize("family", ["deepseek_v3", "kimi_k25"])
def test_capture_training_export_and_evaluate(family, embedded_model_dir, tmp_path):
    target_dir = tiny_target_folder(family, tmp_path / "target", tokenizer_dir=embedded_model_dir)
    layout = target_layout(target_dir)
    run_dir = tmp_path / "run"
    _tokenized(run_dir, embedded_model_dir)
    params_path = tmp_path / "params.yaml"
    params_path.write_text(
        yaml.safe_dump(
            {
                "run": {"name": family, "outputs_dir": str(tmp_path)},
                "target": {"model": str(target_dir), "capture_layers": [1, 2, 3]},
                "capture": {"mode": "offline", "max_seq_len": 4096, "max_tokens_per_batch": 4096},
                "training": {
                    "data_sizes": [4, 8],
                    "heldout_size": 4,
                    "ttt_steps": 2,
                    "speculative_tokens": 2,
                    "draft_vocab_size": 64,
                    "learning_rate": 3.0e-3,
                    "min_learning_rate": 3.0e-4,
                    "warmup_steps": 1,
                    "schedule": "equal_steps",
                    "max_steps": 2,
                    "micro_batch_size": 1,
                    "grad_accumulation_steps": 2,
                    "eval_interval": 2,
                    "max_length": 24,
                    "log_interval_s": 60,
                },
                "analysis": {"chain_steps": 2, "ablation": False},
            }
        )
    )
    params = load_params(params_path)

    captured = run_capture_stage(params, run_dir)
    assert (
        captured.hidden_size == layout.hidden_size and captured.num_hidden_layers == layout.num_hidden_layers
    )
    assert (
        captured.report.captured_samples == 12 and captured.checks
    )  # read back and compared with the source lines
    shards = ShardDataset(run_dir / "capture")
    assert (
        max(len(shards.tokens(position)["input_ids"]) for position in range(len(shards))) <= 24
    )  # stops at training.max_length
    assert shards[0]["aux_hidden_states"].shape[-1] == 3 * layout.hidden_size

    sweep = run_training_stage(params, run_dir)
    assert sweep.sizes == [4, 8]
    export = run_dir / sweep.export["sglang"]
    assert json.loads((export / "config.json").read_text())["hidden_size"] == layout.hidden_size

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": f"What is {n} plus {n}?"}]}) + "\n"
            for n in (1, 2)
        )
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "eaglekit.cli",
            "evaluate",
            "--target",
            str(target_dir),
            "--draft",
            str(export),
            "--prompts",
            str(prompts),
            "--topology",
            "chain:2",
            "--max-new-tokens",
            "8",
            "--resamples",
            "50",
            "--json",
            str(tmp_path / "evaluate.json"),
            "--threads",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "evaluate.json").is_file()
