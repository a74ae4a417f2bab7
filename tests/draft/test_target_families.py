"""The draft package on every target family the kit handles: head weights by the layout's tensor names,
the draft's config from the decoder's text config (never a LlamaConfig of a DeepSeek/Kimi config),
explicit draft shapes, and exports written from the resolved text config."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from eaglekit.draft.export import (
    export_sglang,
    export_vllm,
    load_export,
    portable_verifier_reference,
    validate_export,
)
from eaglekit.draft.model import (
    DRAFT_SHAPES,
    DraftConfig,
    DraftShape,
    TargetTextConfig,
    build_draft_from_target,
    draft_shape,
    load_target_head_weights,
)
from eaglekit.target import target_layout
from support import TINY_FAMILIES, tiny_target_folder

FAMILIES = sorted(TINY_FAMILIES)


@pytest.fixture(scope="module")
def family_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("targets")
    return {family: tiny_target_folder(family, root / family) for family in FAMILIES}


def _raw_tensor(folder, name):
    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        return handle.get_tensor(name)


@pytest.mark.parametrize("family", FAMILIES)
def test_head_weights_come_from_the_layouts_tensor_names(family_folders, family):
    folder = family_folders[family]
    prefix = "language_model." if family == "kimi_k25" else ""  # written by hand: Kimi-K2.5's published names
    head = load_target_head_weights(folder)
    assert torch.equal(head.embed_tokens, _raw_tensor(folder, f"{prefix}model.embed_tokens.weight"))
    assert torch.equal(head.lm_head, _raw_tensor(folder, f"{prefix}lm_head.weight"))
    assert torch.equal(head.final_norm, _raw_tensor(folder, f"{prefix}model.norm.weight"))
    assert isinstance(head.config, TargetTextConfig)
    text = json.loads((folder / "config.json").read_text())
    text = text.get("text_config", text)
    assert (head.config.hidden_size, head.config.vocab_size, head.config.num_hidden_layers) == (
        text["hidden_size"],
        text["vocab_size"],
        text["num_hidden_layers"],
    )
    assert head.config.max_position_embeddings == text["max_position_embeddings"]
    assert head.config.rms_norm_eps == text["rms_norm_eps"]
    # A TargetLayout works as well as a folder, and gives the same tensors.
    assert torch.equal(load_target_head_weights(target_layout(folder)).embed_tokens, head.embed_tokens)


@pytest.mark.parametrize("family", ["deepseek_v3", "kimi_k25"])
def test_mla_targets_get_an_attention_head_dim_not_their_rope_dim(family_folders, family):
    head = load_target_head_weights(family_folders[family])
    assert (
        head.config.mla and head.config.head_dim is None
    )  # DeepseekV3Config.head_dim is qk_rope_head_dim (8 here)
    config = DraftConfig.from_target_config(head.config, draft_vocab_size=100)
    assert config.head_dim == 64 // 4 and config.num_attention_heads == 4 and config.num_key_value_heads == 4
    if family == "kimi_k25":
        assert head.config.architectures == (
            "KimiK25ForConditionalGeneration",
        )  # the wrapper's, what a server loads


def test_the_derived_shape_is_unchanged_for_existing_drafts(embedded_model_dir):
    head = load_target_head_weights(embedded_model_dir)  # SmolLM2: 9 heads, 3 KV heads, head_dim 64, MLP 1536
    config = DraftConfig.from_target_config(head.config, draft_vocab_size=32000)
    assert (
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
        config.intermediate_size,
    ) == (9, 3, 64, 1536)
    assert DraftConfig.from_target_config(head.config, 32000, shape="auto") == config


KIMI_K25_TEXT = {  # Kimi-K2.5's text_config fields the draft reads (moonshotai/Kimi-K2.5 config.json)
    "model_type": "kimi_k2",
    "hidden_size": 7168,
    "num_hidden_layers": 61,
    "vocab_size": 163840,
    "max_position_embeddings": 262144,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "intermediate_size": 18432,
    "rms_norm_eps": 1e-5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "rope_theta": 50000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 64.0,
        "original_max_position_embeddings": 4096,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    },
}


def test_kimi_public_draft_shape_preset():
    wrapper = {"architectures": ["KimiK25ForConditionalGeneration"], "text_config": KIMI_K25_TEXT}
    derived = DraftConfig.from_target_config(wrapper, draft_vocab_size=32000)
    assert derived.head_dim == 112  # 7168 / 64: what the kit gave this target before the preset
    public = DraftConfig.from_target_config(wrapper, draft_vocab_size=32000, shape="kimi_k25_public")
    # TorchSpec configs/draft_models/kimi_k25_eagle3.json, written out by hand.
    assert (
        public.hidden_size,
        public.num_attention_heads,
        public.head_dim,
        public.num_key_value_heads,
        public.intermediate_size,
    ) == (7168, 64, 128, 64, 12288)
    assert public.rope_parameters == {"rope_type": "default", "rope_theta": 1000000.0}
    assert public.capture_layer_indices == (2, 30, 58) and public.max_position_embeddings == 262144
    assert DRAFT_SHAPES["kimi_k25_public"] is draft_shape("kimi_k25_public")
    with pytest.raises(ValueError, match="kimi_k25_public"):
        draft_shape("kimi")


def test_an_explicit_shape_sizes_the_modules_and_the_export(family_folders, tmp_path):
    head = load_target_head_weights(family_folders["kimi_k25"])
    vocab = 200
    d2t = torch.zeros(vocab, dtype=torch.int64)
    t2d = torch.arange(head.config.vocab_size) < vocab
    shape = DraftShape(num_attention_heads=2, head_dim=48, num_key_value_heads=1, intermediate_size=96)
    draft = build_draft_from_target(head, d2t, t2d, shape=shape)
    assert draft.midlayer.self_attn.q_proj.weight.shape == (2 * 48, 2 * 64)
    assert draft.midlayer.self_attn.k_proj.weight.shape == (1 * 48, 2 * 64)
    assert draft.midlayer.self_attn.o_proj.weight.shape == (64, 96)
    assert draft.midlayer.mlp.gate_proj.weight.shape == (96, 64)
    folder = export_sglang(draft, target_layout(family_folders["kimi_k25"]), tmp_path / "sglang")
    config = json.loads((folder / "config.json").read_text())
    assert (
        config["num_attention_heads"],
        config["head_dim"],
        config["num_key_value_heads"],
        config["intermediate_size"],
    ) == (2, 48, 1, 96)
    assert validate_export(folder).head_dim == 48


@pytest.mark.parametrize("family", FAMILIES)
def test_exports_from_the_resolved_text_config(family_folders, family, tmp_path):
    folder = family_folders[family]
    layout = target_layout(folder)
    head = load_target_head_weights(layout)
    vocab = 256
    draft = build_draft_from_target(
        head, torch.arange(vocab) * 0, torch.arange(head.config.vocab_size) < vocab
    ).eval()
    sglang = export_sglang(draft, layout, tmp_path / "sglang")
    vllm = export_vllm(
        draft, layout, tmp_path / "vllm"
    )  # the verifier: the layout's folder, written portably
    text = layout.text_config
    for export in (sglang, vllm):
        raw = json.loads((export / "config.json").read_text())
        layer = raw.get("transformer_layer_config", raw)
        assert layer["model_type"] == "llama" and layer["hidden_size"] == text["hidden_size"]
        assert (
            layer["vocab_size"] == text["vocab_size"]
            and layer["max_position_embeddings"] == text["max_position_embeddings"]
        )
        assert layer["rms_norm_eps"] == text["rms_norm_eps"]
        validate_export(export, layout)
    raw = json.loads((vllm / "config.json").read_text())
    verifier = raw["speculators_config"]["verifier"]
    assert verifier["name_or_path"] == family and not verifier["name_or_path"].startswith("/")
    assert verifier["architectures"] == json.loads((folder / "config.json").read_text())["architectures"]
    with torch.no_grad():
        features = torch.randn(1, 6, 3 * text["hidden_size"])
        ids = torch.randint(0, text["vocab_size"], (1, 6))
        for export in (sglang, vllm):
            reloaded = load_export(export, head.embed_tokens if export == sglang else None)
            torch.testing.assert_close(
                reloaded(ids, features.bfloat16(), 2)[1].float(),
                load_export(sglang, head.embed_tokens)(ids, features.bfloat16(), 2)[1].float(),
            )


def test_portable_verifier_reference(tmp_path):
    assert portable_verifier_reference("moonshotai/Kimi-K2.5") == "moonshotai/Kimi-K2.5"
    snapshot = tmp_path / "hub" / "models--moonshotai--Kimi-K2.5" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    assert portable_verifier_reference(snapshot) == "moonshotai/Kimi-K2.5"
    named = tmp_path / "local-copy"
    named.mkdir()
    (named / "config.json").write_text(json.dumps({"_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct"}))
    assert portable_verifier_reference(named) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    plain = tmp_path / "smollm2-135m-instruct"
    plain.mkdir()
    (plain / "config.json").write_text(
        json.dumps({"_name_or_path": str(tmp_path / "elsewhere")})
    )  # absolute: never written
    assert portable_verifier_reference(plain) == "smollm2-135m-instruct"
    assert portable_verifier_reference(str(plain.resolve())) == "smollm2-135m-instruct"
