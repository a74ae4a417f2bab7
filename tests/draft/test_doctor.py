"""Preflight findings on small safetensors checkpoints and a real SGLang-shaped server on 127.0.0.1."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from fixtures.serving import replay_server as replay
from eaglekit.cli import main
from eaglekit.draft.tensors import tensor_table_from_config
from eaglekit.draft.doctor import (
    check_accept_length,
    findings_frame,
    preflight_table,
    run_doctor,
)


# A 30-layer target (SmolLM2's depth) with tiny widths: default capture [2, 15, 27] -> ids [1, 14, 26].
TARGET = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 16,
    "num_hidden_layers": 30,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 64,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
}
DRAFT = {
    "architectures": ["LlamaForCausalLMEagle3"],
    "hidden_size": 16,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 4,
    "intermediate_size": 32,
    "vocab_size": 64,
    "draft_vocab_size": 8,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14, 26]},
}


def _tensors(config: dict) -> dict[str, torch.Tensor]:
    tensors = {}
    for name, (shape, dtype) in tensor_table_from_config(config).items():
        tensors[name] = torch.zeros(shape, dtype=torch.bfloat16)
    draft_to_target = torch.tensor([0, 1, 2, 3, 10, 20, 30, 63])
    tensors["d2t"] = draft_to_target - torch.arange(8)
    t2d = torch.zeros(64, dtype=torch.bool)
    t2d[draft_to_target] = True
    tensors["t2d"] = t2d
    return tensors


def _write(folder: Path, config: dict, tensors: dict[str, torch.Tensor] | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors if tensors is not None else _tensors(DRAFT), str(folder / "model.safetensors"))
    target = folder.parent / "target_config.json"
    target.write_text(json.dumps(TARGET))
    return folder


def _errors(findings) -> dict[str, str]:
    return {
        finding.check: finding.message + " || " + finding.fix
        for finding in findings
        if finding.level == "error"
    }


def test_a_good_draft_passes(tmp_path):
    draft = _write(tmp_path / "draft", DRAFT)
    findings = run_doctor(tmp_path / "target_config.json", draft)
    assert _errors(findings) == {}
    frame = findings_frame(findings)
    assert set(frame["check"]) >= {
        "architectures",
        "hidden_size",
        "vocab_size",
        "max_position_embeddings",
        "tie_word_embeddings",
        "capture_layers",
        "tensor_names",
        "tensor_shapes",
        "vocab_maps",
    }


@pytest.mark.parametrize(
    ("change", "check", "says"),
    [
        ({"architectures": ["LlamaForCausalLM"]}, "architectures", "LlamaForCausalLMEagle3"),
        ({"num_hidden_layers": 2}, "num_hidden_layers", "exactly one decoder layer"),
        ({"target_hidden_size": 32}, "hidden_size", "target hidden size 32"),
        ({"vocab_size": 32000}, "vocab_size", "32000 != target vocab_size 64"),
        ({"draft_vocab_size": None}, "draft_vocab_size", "loads lm_head from the target"),
        ({"max_position_embeddings": 2048}, "max_position_embeddings", '"max_position_embeddings": 8192'),
        ({"tie_word_embeddings": True}, "tie_word_embeddings", '"tie_word_embeddings": false'),
        (
            {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 15, 27]}},
            "capture_layers",
            "SGLang adds 1 to each",
        ),
        (
            {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14, 25]}},
            "capture_layers",
            "[1, 14, 26]",
        ),
    ],
)
def test_each_config_mistake_is_an_error_with_its_fix(tmp_path, change, check, says):
    config = {**copy.deepcopy(DRAFT), **change}
    findings = run_doctor(
        tmp_path / "target_config.json", _write(tmp_path / "draft", config, _tensors(DRAFT))
    )
    errors = _errors(findings)
    assert check in errors, errors
    assert says in errors[check]


def test_capture_layers_given_by_the_training_run(tmp_path):
    draft = _write(tmp_path / "draft", DRAFT)
    # Trained on [3, 15, 27] but the config makes SGLang capture [2, 15, 27].
    errors = _errors(run_doctor(tmp_path / "target_config.json", draft, capture_layers=[3, 15, 27]))
    assert '"eagle_aux_hidden_state_layer_ids": [2, 14, 26]' in errors["capture_layers"]
    # No ids in the config: SGLang's default [2, 15, 27] matches the default training layers.
    no_ids = {key: value for key, value in DRAFT.items() if key != "eagle_config"}
    assert _errors(run_doctor(tmp_path / "target_config.json", _write(tmp_path / "d2", no_ids))) == {}
    assert (
        "captures its default"
        in _errors(run_doctor(tmp_path / "target_config.json", tmp_path / "d2", capture_layers=[3, 15, 27]))[
            "capture_layers"
        ]
    )


def test_preflight_table_labels_the_folder_and_the_loop_rows(tmp_path):
    draft = _write(tmp_path / "draft", DRAFT)
    # Trained on [3, 15, 27] (SGLang would capture [2, 15, 27]) and a bypassed draft in the loop: both
    # surface, each under its label.
    table = preflight_table(
        tmp_path / "target_config.json", draft, "training/export/sglang", [3, 15, 27], 1.05
    )
    assert list(table.columns) == ["folder", "level", "check", "message", "fix"]
    folder_rows = table[table["folder"] == "training/export/sglang"]
    loop_rows = table[table["folder"] == "specdec loop"]
    assert len(folder_rows) + len(loop_rows) == len(table)
    assert folder_rows.set_index("check").loc["capture_layers", "level"] == "error"
    assert "accept_length" not in set(folder_rows["check"])
    assert loop_rows[["level", "check"]].values.tolist() == [["warning", "accept_length"]]
    assert "1.050" in loop_rows["message"].iloc[0]


def test_misnamed_tensors_are_named_with_a_rename(tmp_path):
    tensors = _tensors(DRAFT)
    tensors["layers.0.self_attn.q_proj.weight"] = tensors.pop("midlayer.self_attn.q_proj.weight")
    tensors["model.norm.weight"] = tensors.pop("norm.weight")
    errors = _errors(run_doctor(tmp_path / "target_config.json", _write(tmp_path / "draft", DRAFT, tensors)))
    assert (
        "midlayer.self_attn.q_proj.weight" in errors["tensor_names"]
        and "norm.weight" in errors["tensor_names"]
    )
    assert (
        "rename layers.0.self_attn.q_proj.weight to midlayer.self_attn.q_proj.weight"
        in errors["tensor_names"]
    )
    assert "rename model.norm.weight to norm.weight" in errors["tensor_names"]


def test_wrong_shapes_dtypes_and_vocab_maps(tmp_path):
    tensors = _tensors(DRAFT)
    tensors["midlayer.self_attn.q_proj.weight"] = torch.zeros(16, 16)  # took H inputs, not 2H
    tensors["d2t"] = tensors["d2t"].to(torch.int32)
    errors = _errors(run_doctor(tmp_path / "target_config.json", _write(tmp_path / "draft", DRAFT, tensors)))
    assert "q_proj.weight (16, 16) (expected (16, 32))" in errors["tensor_shapes"]
    assert "d2t dtype int32 (expected int64)" in errors["tensor_shapes"]

    tensors = _tensors(DRAFT)
    tensors["t2d"][5] = True  # marks a target id no draft id maps to
    errors = _errors(run_doctor(tmp_path / "target_config.json", _write(tmp_path / "d2", DRAFT, tensors)))
    assert "t2d marks 9 target ids" in errors["vocab_maps"]


def test_exported_embedding_is_a_warning(tmp_path):
    tensors = {**_tensors(DRAFT), "embed_tokens.weight": torch.zeros(64, 16)}
    findings = run_doctor(tmp_path / "target_config.json", _write(tmp_path / "draft", DRAFT, tensors))
    assert _errors(findings) == {}
    assert any(f.level == "warning" and "embed_tokens" in f.message for f in findings)


def test_endpoint_running_eagle_instead_of_eagle3(tmp_path):
    info = replay.load("sglang_server_info_eagle3.json")
    with replay.serve(
        replay.sglang_app(speculative=True, server_info={**info, "speculative_algorithm": "EAGLE"})
    ) as url:
        findings = run_doctor(TARGET, endpoint=url + "/v1")
    assert "--speculative-algorithm EAGLE3" in _errors(findings)["speculative_algorithm"]

    bypassed = {**info, "internal_states": [{"avg_spec_accept_length": 1.02}]}
    with replay.serve(
        replay.sglang_app(speculative=True, server_info=bypassed, new_server_info_route=True)
    ) as url:
        findings = run_doctor(TARGET, endpoint=url)
    assert _errors(findings) == {}
    assert any(f.level == "warning" and f.check == "accept_length" and "1.020" in f.message for f in findings)

    errors = _errors(run_doctor(TARGET, endpoint="http://127.0.0.1:9"))
    assert "cannot read SGLang server info" in errors["endpoint"]


def test_measured_accept_length_below_1_1_warns():
    assert check_accept_length(1.05)[0].level == "warning"
    assert check_accept_length(2.1)[0].level == "ok"
    assert check_accept_length(0.9)[0].level == "error"


def test_cli(tmp_path, capsys):
    draft = _write(tmp_path / "draft", {**DRAFT, "tie_word_embeddings": True})
    assert (
        main(["doctor", "--draft", str(draft), "--target-config", str(tmp_path / "target_config.json")]) == 1
    )
    output = capsys.readouterr().out
    assert (
        "ERROR" in output
        and "tie_word_embeddings" in output
        and 'fix: set "tie_word_embeddings": false' in output
    )
    good = _write(tmp_path / "good", DRAFT)
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "eaglekit.cli",
            "doctor",
            "--draft",
            str(good),
            "--target-config",
            str(tmp_path / "target_config.json"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "0 error(s)" in completed.stdout


PARAMS_FILES = sorted((Path(__file__).resolve().parents[2] / "params").glob("*.yaml"))


@pytest.mark.parametrize("params_file", PARAMS_FILES, ids=lambda path: path.name)
def test_doctor_reads_every_shipped_params_file(params_file, capsys):
    """`--target-config params/X.yaml` reads the target the params plan for (target.config, or the model
    folder)."""
    assert main(["doctor", "--target-config", str(params_file), "--accept-length", "2.1"]) == 0
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and "0 error(s)" in captured.out


def test_planned_eagle_flag_is_an_error_offline(capsys):
    """The seed's mistake, caught from the planned flags with no server and no draft: EAGLE instead of
    EAGLE3."""
    kimi = str(next(path for path in PARAMS_FILES if path.name == "kimi_k25_big_run.yaml"))
    planned = "--speculative-algorithm EAGLE --speculative-num-steps 3 --speculative-eagle-topk 1"
    assert main(["doctor", "--target-config", kimi, "--sglang-args", planned]) == 1
    output = capsys.readouterr().out
    assert "ERROR" in output and "runs EAGLE, not EAGLE3" in output and "planned launch" in output
    assert (
        main(["doctor", "--target-config", kimi, "--sglang-args", planned.replace("EAGLE ", "EAGLE3 ")]) == 0
    )
    assert main(["doctor", "--target-config", kimi, "--sglang-args", "--tp 8"]) == 1  # no speculation at all
    assert "without speculative decoding" in capsys.readouterr().out


def test_unreadable_target_config_names_the_file_and_line(tmp_path, capsys):
    broken = tmp_path / "config.json"
    broken.write_text('{"hidden_size": 16,\n  "num_hidden_layers": }\n')
    assert main(["doctor", "--target-config", str(broken), "--accept-length", "2.1"]) == 2
    error = capsys.readouterr().err
    assert str(broken) in error and "line 2" in error and "Traceback" not in error
    hub_only = tmp_path / "hub.yaml"
    hub_only.write_text("target:\n  model: org/some-model\n")
    assert main(["doctor", "--target-config", str(hub_only), "--accept-length", "2.1"]) == 2
    assert "target.config" in capsys.readouterr().err


def test_a_torn_or_non_utf8_config_names_the_file_and_where(tmp_path, capsys):
    """A torn config.json, and one that is not UTF-8 (a bare UnicodeDecodeError traceback before), exit 2
    naming the file."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TARGET, indent=2))
    os.truncate(config, config.stat().st_size // 2)
    assert main(["doctor", "--target-config", str(config), "--accept-length", "2.1"]) == 2
    error = capsys.readouterr().err
    assert f"{config}: line " in error and "not JSON" in error and "Traceback" not in error
    config.write_bytes(b'{"hidden_size": 16, "name": "\xff"}')
    assert main(["doctor", "--target-config", str(config), "--accept-length", "2.1"]) == 2
    error = capsys.readouterr().err
    assert f"{config}: not UTF-8" in error and "pass a model folder" in error and "Traceback" not in error
