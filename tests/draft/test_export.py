"""Exports SGLang and vLLM load: every tensor name, shape, dtype; config keys; reload == original;
refusal of drafts that contradict their target."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eaglekit.draft.model import DraftConfig, build_draft_from_target, load_target_head_weights
from eaglekit.draft.export import (
    DraftTargetMismatch,
    cast_weights,
    export_sglang,
    export_vllm,
    load_export,
    validate_export,
)
from eaglekit.io import InputError
from eaglekit.draft.vocab import select_draft_vocab
from killed_writer import kill_mid_write
from support import randomize_norms, samples_from_target, tiny_draft, tiny_target

# DESIGN "Draft checkpoint": the exact tensor set, written out by hand (not derived from the code under test).
H, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, VOCAB, DRAFT_VOCAB = 64, 4, 2, 16, 128, 300, 200
EXPECTED = {
    "fc.weight": (H, 3 * H),
    "midlayer.self_attn.q_proj.weight": (HEADS * HEAD_DIM, 2 * H),
    "midlayer.self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, 2 * H),
    "midlayer.self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, 2 * H),
    "midlayer.self_attn.o_proj.weight": (H, HEADS * HEAD_DIM),
    "midlayer.mlp.gate_proj.weight": (INTERMEDIATE, H),
    "midlayer.mlp.up_proj.weight": (INTERMEDIATE, H),
    "midlayer.mlp.down_proj.weight": (H, INTERMEDIATE),
    "midlayer.input_layernorm.weight": (H,),
    "midlayer.hidden_norm.weight": (H,),
    "midlayer.post_attention_layernorm.weight": (H,),
    "norm.weight": (H,),
    "lm_head.weight": (DRAFT_VOCAB, H),
    "d2t": (DRAFT_VOCAB,),
    "t2d": (VOCAB,),
}
# The vLLM / speculators folder: speculators' module names (`layers.0.*`) and the target's embedding
# (speculators without a verifier would run on its NaN-initialized table otherwise).
EXPECTED_VLLM = {
    ("layers.0." + name[len("midlayer.") :] if name.startswith("midlayer.") else name): shape
    for name, shape in EXPECTED.items()
}
EXPECTED_VLLM["embed_tokens.weight"] = (VOCAB, H)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def trained():
    target = tiny_target()
    samples = samples_from_target(target, 3, seed=5)
    model = tiny_draft(target, samples)
    randomize_norms(model)
    return target, samples, model


def read_tensors(path):
    with safe_open(str(path), framework="pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}


def test_sglang_export_names_shapes_dtypes_and_config(trained, tmp_path):
    target, _, model = trained
    folder = export_sglang(model, target.config, tmp_path / "sglang")
    tensors = read_tensors(folder / "model.safetensors")
    assert set(tensors) == set(EXPECTED)
    for name, shape in EXPECTED.items():
        assert tuple(tensors[name].shape) == shape, name
        expected_dtype = {"d2t": torch.int64, "t2d": torch.bool}.get(name, torch.bfloat16)
        assert tensors[name].dtype == expected_dtype, name
    assert torch.equal(torch.arange(DRAFT_VOCAB) + tensors["d2t"], model.draft_to_target_ids())
    assert int(tensors["t2d"].sum()) == DRAFT_VOCAB
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["num_hidden_layers"] == 1 and config["tie_word_embeddings"] is False
    assert (config["hidden_size"], config["vocab_size"], config["draft_vocab_size"]) == (
        H,
        VOCAB,
        DRAFT_VOCAB,
    )
    assert config["max_position_embeddings"] >= target.config.max_position_embeddings
    # The tiny target has 6 layers: captures are the inputs of layers [2, 3, 3]; SGLang adds 1 to each id.
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 2]
    # vLLM reads only the top-level key, as layer inputs: the same folder captures the same layers there.
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 3, 3]


def test_vllm_export_speculators_config(trained, tmp_path):
    target, _, model = trained
    folder = export_vllm(
        model, target.config, tmp_path / "vllm", verifier_name_or_path="tiny-target", speculative_tokens=3
    )
    tensors = read_tensors(folder / "model.safetensors")
    assert {name: tuple(tensor.shape) for name, tensor in tensors.items()} == EXPECTED_VLLM
    assert torch.equal(
        tensors["embed_tokens.weight"], target.model.embed_tokens.weight.detach().to(torch.bfloat16)
    )
    config = json.loads((folder / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["norm_before_residual"] is False  # vLLM's reader would default it to True
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 3, 3]  # vLLM uses ids as layer inputs
    assert config["draft_vocab_size"] == DRAFT_VOCAB and config["target_hidden_size"] == H
    layer = config["transformer_layer_config"]
    assert (
        layer["num_hidden_layers"] == 1
        and layer["vocab_size"] == VOCAB
        and layer["tie_word_embeddings"] is False
    )
    method = config["speculators_config"]["proposal_methods"][0]
    assert (
        method["speculative_tokens"] == 3
        and config["speculators_config"]["verifier"]["name_or_path"] == "tiny-target"
    )


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_reload_gives_identical_outputs(trained, tmp_path, kind):
    target, samples, model = trained
    if kind == "sglang":
        folder = export_sglang(model, target.config, tmp_path / kind)
    else:
        folder = export_vllm(model, target.config, tmp_path / kind, verifier_name_or_path="tiny-target")
    reloaded = load_export(folder, target.model.embed_tokens.weight.detach())
    assert reloaded.config.capture_layer_indices == model.config.capture_layer_indices
    original = cast_weights(copy.deepcopy(model), torch.bfloat16)
    sample = samples[0]
    with torch.no_grad():
        expected = original(sample["input_ids"][None], sample["aux_hidden_states"][None], 3)
        actual = reloaded(sample["input_ids"][None], sample["aux_hidden_states"][None], 3)
    for expected_step, actual_step in zip(expected, actual):
        assert torch.equal(expected_step, actual_step)
    assert torch.equal(reloaded.d2t, model.d2t) and torch.equal(reloaded.t2d, model.t2d)


def test_float32_export_reloads_bit_exact(trained, tmp_path):
    target, samples, model = trained
    reloaded = load_export(
        export_sglang(model, target.config, tmp_path, dtype=torch.float32),
        target.model.embed_tokens.weight.detach(),
    )
    sample = samples[1]
    with torch.no_grad():
        assert torch.equal(
            model(sample["input_ids"][None], sample["aux_hidden_states"][None], 2)[1],
            reloaded(sample["input_ids"][None], sample["aux_hidden_states"][None], 2)[1],
        )


def test_refuses_draft_that_contradicts_target(trained, tmp_path):
    target, _, model = trained
    wider = target.config.to_dict() | {"hidden_size": 128}
    with pytest.raises(DraftTargetMismatch, match="hidden_size 64 != target 128"):
        export_sglang(model, wider, tmp_path / "a")
    longer = target.config.to_dict() | {"max_position_embeddings": 4096}
    with pytest.raises(DraftTargetMismatch, match="max_position_embeddings 512 < target's 4096"):
        export_sglang(model, longer, tmp_path / "b")
    bigger_vocab = target.config.to_dict() | {"vocab_size": 301}
    with pytest.raises(DraftTargetMismatch, match="vocab_size"):
        export_vllm(model, bigger_vocab, tmp_path / "c", verifier_name_or_path="x")
    deeper = target.config.to_dict() | {"num_hidden_layers": 30}
    with pytest.raises(DraftTargetMismatch, match="6-layer target"):
        export_sglang(model, deeper, tmp_path / "d")
    unmapped = copy.deepcopy(model)
    unmapped.d2t.zero_()  # every draft id -> its own id: t2d no longer agrees
    with pytest.raises(DraftTargetMismatch, match="t2d disagrees"):
        export_sglang(unmapped, target.config, tmp_path / "e")
    assert not (tmp_path / "a").exists()


def test_refuses_a_draft_with_nan_weights(trained, tmp_path):
    """A server runs a NaN draft without an error; its argmax is draft id 0 everywhere."""
    target, _, model = trained
    broken = copy.deepcopy(model)
    with torch.no_grad():
        broken.midlayer.mlp.down_proj.weight[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match=r"midlayer\.mlp\.down_proj\.weight.*NaN or inf"):
        export_vllm(broken, target.config, tmp_path / "vllm", verifier_name_or_path="tiny-target")
    assert not (tmp_path / "vllm" / "model.safetensors").exists()


def test_an_export_killed_mid_write_leaves_no_temp_file_once_it_runs_again(trained, tmp_path):
    """kill -9 of a real process writing the export's model.safetensors (48 MiB in), then the export again:
    no `.model.safetensors.*.tmp` is left beside the model, and the model is whole."""
    target, samples, model = trained
    folder = tmp_path / "export" / "vllm"
    folder.mkdir(parents=True)
    kill_mid_write(folder / "model.safetensors", 48)
    export_vllm(model, target.config, folder, verifier_name_or_path="tiny-target")
    assert sorted(path.name for path in folder.iterdir()) == ["config.json", "model.safetensors"]
    reloaded = load_export(folder)
    with torch.no_grad():
        expected = cast_weights(copy.deepcopy(model), torch.bfloat16)(
            samples[0]["input_ids"][None], samples[0]["aux_hidden_states"][None], 2
        )
        actual = reloaded(samples[0]["input_ids"][None], samples[0]["aux_hidden_states"][None], 2)
    assert all(torch.equal(one, two) for one, two in zip(expected, actual))


def test_validate_catches_misnamed_and_misshaped_tensors(trained, tmp_path):
    target, _, model = trained
    folder = export_sglang(model, target.config, tmp_path)
    tensors = read_tensors(folder / "model.safetensors")
    tensors["midlayer.self_attn.qkv_proj.weight"] = tensors.pop("midlayer.self_attn.q_proj.weight")
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(
        InputError,
        match="missing midlayer.self_attn.q_proj.weight.*unexpected midlayer.self_attn.qkv_proj.weight",
    ):
        validate_export(folder)
    tensors = read_tensors(tmp_path / "model.safetensors")
    tensors["midlayer.self_attn.q_proj.weight"] = tensors.pop("midlayer.self_attn.qkv_proj.weight")
    tensors["d2t"] = tensors["d2t"].to(torch.int32)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(InputError, match="d2t.*torch.int32"):
        validate_export(folder)
    config = json.loads((folder / "config.json").read_text()) | {"tie_word_embeddings": True}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match="tie_word_embeddings"):
        validate_export(folder)


def test_real_model_export_shapes(embedded_model_dir, tmp_path):
    """The embedded SmolLM2 target: 576 wide, tied embeddings, 49,152 vocab, draft vocab 32,000."""
    weights = load_target_head_weights(embedded_model_dir)
    counts = torch.zeros(weights.config.vocab_size, dtype=torch.int64)
    counts[:40_000] = torch.arange(40_000, 0, -1)
    vocab = select_draft_vocab(counts, 32_000)
    model = build_draft_from_target(weights, vocab.d2t, vocab.t2d)
    folder = export_sglang(model, weights.config, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    assert config["tie_word_embeddings"] is False  # SmolLM2 ties; the draft must not
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]
    assert config["max_position_embeddings"] >= weights.config.max_position_embeddings
    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        assert handle.get_slice("fc.weight").get_shape() == [576, 1728]
        assert handle.get_slice("midlayer.self_attn.q_proj.weight").get_shape() == [576, 1152]
        assert handle.get_slice("midlayer.self_attn.k_proj.weight").get_shape() == [192, 1152]
        assert handle.get_slice("lm_head.weight").get_shape() == [32_000, 576]
        assert handle.get_slice("t2d").get_shape() == [49_152]
        assert "embed_tokens.weight" not in set(handle.keys())
    assert isinstance(validate_export(folder, weights.config), DraftConfig)
