"""SGLang 0.5.23's in-process model runner as a capture engine: on a GPU, its features equal the hooks'."""

from __future__ import annotations

import json
import os

import pytest
import torch

from eaglekit.capture.sglang_capture import SGLANG_VERSION, SglangCapture, main, sglang_layer_ids


def test_layer_ids_follow_sglangs_plus_one_convention():
    assert sglang_layer_ids([2, 15, 27]) == [1, 14, 26]  # SGLang captures the input of layer id + 1
    assert SGLANG_VERSION == "0.5.23"


def test_main_captures_under_the_params_capture_settings(tmp_path, monkeypatch, caplog):
    """main's wiring on CPU: SGLang's runner (CUDA only) stands in for a tiny transformers target, which
    serves the same FeatureSource interface; main then captures the run's prep samples into capture/ under
    params.capture: batch and shard budgets, feature dtype, and the progress lines' log_interval_s."""
    import logging

    import yaml
    from transformers import LlamaConfig, LlamaForCausalLM

    from eaglekit.capture.shards import CONFIG_FILE, ShardDataset

    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )
    torch.manual_seed(0)
    target = LlamaForCausalLM(config).eval()
    target.save_pretrained(tmp_path / "target")
    started = []
    monkeypatch.setattr(SglangCapture, "start", lambda *arguments: started.append(arguments) or target)
    prep = tmp_path / "run" / "prep" / "alpha"
    prep.mkdir(parents=True)
    with open(prep / "tokenized_data.jsonl", "w") as handle:
        for index in range(12):
            ids = [(index * 7 + position) % 128 for position in range(5 + index)]
            handle.write(
                json.dumps({"id": f"s-{index}", "input_ids": ids, "loss_mask": [1] * len(ids)}) + "\n"
            )
    capture = {
        "max_seq_len": 12,
        "max_tokens_per_batch": 32,
        "max_shard_mb": 1,
        "feature_dtype": "fp8",
        "log_interval_s": 1e-9,
    }
    params = {
        "run": {"name": "sglang-main"},
        "target": {"model": str(tmp_path / "target")},
        "capture": capture,
    }
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    caplog.set_level(logging.INFO, logger="eaglekit.capture")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert main(["--params", str(tmp_path / "params.yaml"), "--run-dir", str(tmp_path / "run")]) == 0

    assert [arguments[1:4] for arguments in started] == [([2, 4, 5], 1, 0)]
    capture_dir = tmp_path / "run" / "capture"
    written = json.loads((capture_dir / CONFIG_FILE).read_text())
    assert {
        key: written[key] for key in ("max_seq_len", "max_tokens_per_batch", "max_shard_bytes", "dtype")
    } == {
        "max_seq_len": 12,
        "max_tokens_per_batch": 32,
        "max_shard_bytes": 2**20,
        "dtype": "float8_e4m3fn",
    }
    samples = list(ShardDataset(capture_dir))
    assert [sample["id"] for sample in samples] == [f"s-{index}" for index in range(12)]
    assert max(len(sample["input_ids"]) for sample in samples) == 12
    progress = [record for record in caplog.records if record.getMessage().startswith("progress capture")]
    assert len(progress) >= 3  # one per batch: at the default 60 s interval there would be none


@pytest.mark.gpu
def test_sglang_features_equal_the_hook_capture(embedded_model_dir, tmp_path):
    """One TP rank (TP1) on the embedded SmolLM2 in bf16: SGLang's aux and final features
    against the hooks'."""
    pytest.importorskip("sglang")
    from eaglekit.capture.forward import load_target
    from eaglekit.capture.inputs import read_tokenized_samples
    from eaglekit.capture.sglang_capture import SglangCapture
    from eaglekit.capture.forward import capture_batch

    path = tmp_path / "tokenized_data.jsonl"
    generator = torch.Generator().manual_seed(0)
    with open(path, "w") as handle:
        for index in range(4):
            ids = torch.randint(
                100, 40000, (int(torch.randint(16, 64, (1,), generator=generator)),), generator=generator
            ).tolist()
            handle.write(
                json.dumps({"id": f"s-{index}", "input_ids": ids, "loss_mask": [1] * len(ids)}) + "\n"
            )
    samples, _ = read_tokenized_samples({"alpha": path}, 49152, 128)
    layer_ids = [2, 15, 27]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    source = SglangCapture.start(
        str(embedded_model_dir),
        layer_ids,
        1,
        0,
        0,
        "bfloat16",
        False,
        nccl_port=29611,
        mem_fraction_static=0.3,
    )
    (captured,) = source.capture_batches([samples], layer_ids)
    target = load_target(embedded_model_dir, device="cuda", dtype=torch.bfloat16)
    expected = capture_batch(target, samples, layer_ids)
    for got, want in zip(captured, expected, strict=True):
        aux_error = float((got.aux_hidden_states.float() - want.aux_hidden_states.float()).abs().max())
        final_error = float((got.final_hidden_states.float() - want.final_hidden_states.float()).abs().max())
        scale = float(want.aux_hidden_states.float().abs().max())
        print(
            f"bf16 max |SGLang - hooks|: aux {aux_error:.3e} (max |value| {scale:.1f}), "
            f"final {final_error:.3e}"
        )
        torch.testing.assert_close(
            got.aux_hidden_states.float(), want.aux_hidden_states.float(), rtol=3e-2, atol=0.25
        )
        torch.testing.assert_close(
            got.final_hidden_states.float(), want.final_hidden_states.float(), rtol=3e-2, atol=0.1
        )
