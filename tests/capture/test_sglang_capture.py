"""SGLang 0.5.23's in-process model runner as a capture engine: on a GPU, its features equal the hooks'."""

from __future__ import annotations

import json
import os

import pytest
import torch

from eaglekit.capture.sglang_capture import SGLANG_VERSION, sglang_layer_ids


def test_layer_ids_follow_sglangs_plus_one_convention():
    assert sglang_layer_ids([2, 15, 27]) == [1, 14, 26]  # SGLang captures the input of layer id + 1
    assert SGLANG_VERSION == "0.5.23"


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
