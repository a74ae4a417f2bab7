"""Doctor on real exports: the target read through target_layout (a Kimi-K2.5-shaped wrapper folder), the
vLLM / speculators folder's own checks (norm_before_residual, vLLM's top-level capture ids, its tensor
names), and the settings SGLang 0.5.23 refuses with a reduced-vocab draft."""

from __future__ import annotations

import json

import pytest
import torch

from fixtures.serving import replay_server as replay
from eaglekit.draft.doctor import parse_sglang_args, run_doctor
from eaglekit.draft.export import export_sglang, export_vllm
from eaglekit.draft.model import build_draft_from_target, load_target_head_weights
from eaglekit.target import target_layout
from support import tiny_target_folder


def _errors(findings) -> dict[str, str]:
    return {
        finding.check: finding.message + " || " + finding.fix
        for finding in findings
        if finding.level == "error"
    }


@pytest.fixture(scope="module")
def kimi_exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("kimi")
    target = tiny_target_folder("kimi_k25", root / "kimi-k25-tiny")
    layout = target_layout(target)
    head = load_target_head_weights(layout)
    vocab = 256  # a reduced draft vocab, as every kit draft has
    draft = build_draft_from_target(
        head, torch.zeros(vocab, dtype=torch.int64), torch.arange(head.config.vocab_size) < vocab
    )
    return target, export_sglang(draft, layout, root / "sglang"), export_vllm(draft, layout, root / "vllm")


def test_the_wrapper_folder_is_read_through_its_text_config(kimi_exports):
    target, sglang, vllm = kimi_exports
    assert "text_config" in json.loads((target / "config.json").read_text())  # the wrapper's own config.json
    for export in (sglang, vllm):
        findings = run_doctor(target, draft_dir=export)
        assert _errors(findings) == {}, export
        checks = {finding.check for finding in findings if finding.level == "ok"}
        assert {
            "hidden_size",
            "vocab_size",
            "max_position_embeddings",
            "tensor_names",
            "tensor_shapes",
            "vllm_capture_layers",
        } <= checks


def test_a_reduced_vocab_draft_warns_about_rejection_sampling(kimi_exports):
    target, sglang, _ = kimi_exports
    warnings = [
        f
        for f in run_doctor(target, draft_dir=sglang)
        if f.level == "warning" and f.check == "rejection_sampling"
    ]
    assert len(warnings) == 1 and "--speculative-use-rejection-sampling" in warnings[0].message
    planned = run_doctor(
        target,
        draft_dir=sglang,
        sglang_args="--speculative-algorithm EAGLE3 --speculative-use-rejection-sampling "
        "--speculative-eagle-topk 4",
    )
    errors = [f.message for f in planned if f.level == "error" and f.check == "rejection_sampling"]
    assert any("share one vocab" in message or "reduced draft vocab" in message for message in errors)
    assert any("topk 4" in message for message in errors)
    plain = run_doctor(target, draft_dir=sglang, sglang_args=["--speculative-algorithm", "EAGLE3"])
    assert [f.level for f in plain if f.check == "rejection_sampling"] == ["ok"]
    assert parse_sglang_args("--a --b=2 --c 3") == {"a": True, "b": "2", "c": "3"}


def test_a_live_server_with_rejection_sampling_is_an_error(kimi_exports):
    target, sglang, _ = kimi_exports
    info = {**replay.load("sglang_server_info_eagle3.json"), "speculative_use_rejection_sampling": True}
    with replay.serve(replay.sglang_app(speculative=True, server_info=info)) as url:
        findings = run_doctor(target, draft_dir=sglang, endpoint=url)
    assert "reduced draft vocab" in _errors(findings)["rejection_sampling"]


def _rewrite(folder, tmp_path, name, change):
    copy = tmp_path / name
    copy.mkdir()
    (copy / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    config = json.loads((folder / "config.json").read_text())
    change(config)
    (copy / "config.json").write_text(json.dumps(config))
    return copy


def test_speculators_folder_problems(kimi_exports, tmp_path):
    target, sglang, vllm = kimi_exports
    no_flag = _rewrite(vllm, tmp_path, "no_flag", lambda config: config.pop("norm_before_residual"))
    assert "vLLM reads it as true" in _errors(run_doctor(target, draft_dir=no_flag))["norm_before_residual"]
    sglang_ids = _rewrite(
        vllm, tmp_path, "sglang_ids", lambda config: config.update(eagle_aux_hidden_state_layer_ids=[1, 2, 2])
    )
    assert (
        "SGLang's layer-output ids"
        in _errors(run_doctor(target, draft_dir=sglang_ids))["vllm_capture_layers"]
    )
    # A vLLM folder with SGLang's tensor names: speculators would leave the layer random.
    midlayer = _rewrite(vllm, tmp_path, "midlayer", lambda config: None)
    (midlayer / "model.safetensors").write_bytes((sglang / "model.safetensors").read_bytes())
    names = [
        f.message + " || " + f.fix
        for f in run_doctor(target, draft_dir=midlayer)
        if f.level == "error" and f.check == "tensor_names"
    ]
    assert any(
        "missing" in text and "layers.0.self_attn.q_proj.weight" in text and "speculators" in text
        for text in names
    )
    assert any("rename midlayer.hidden_norm.weight to layers.0.hidden_norm.weight" in text for text in names)
    # The SGLang folder's top-level ids are vLLM's: a wrong value there is caught too.
    shifted = _rewrite(
        sglang, tmp_path, "shifted", lambda config: config.update(eagle_aux_hidden_state_layer_ids=[3, 4, 4])
    )
    assert "vllm_capture_layers" in _errors(run_doctor(target, draft_dir=shifted))
