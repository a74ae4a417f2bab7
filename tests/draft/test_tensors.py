"""The one tensor table: export and doctor read the same names and shapes."""

import torch

from eaglekit.draft.export import expected_tensors as export_tensors
from eaglekit.draft.model import DraftConfig
from eaglekit.draft.tensors import tensor_table_from_config


def test_export_and_doctor_agree_on_every_name_and_shape():
    config = DraftConfig(
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=300,
        draft_vocab_size=50,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        target_num_hidden_layers=8,
        capture_layer_indices=(2, 4, 5),
    )
    exported = export_tensors(config, torch.bfloat16)
    checked = tensor_table_from_config(
        {
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "vocab_size": 300,
            "draft_vocab_size": 50,
        }
    )
    assert {name: shape for name, (shape, _) in exported.items()} == {
        name: shape for name, (shape, _) in checked.items()
    }
    assert (
        exported["d2t"][1] == torch.int64
        and exported["t2d"][1] == torch.bool
        and exported["fc.weight"][1] == torch.bfloat16
    )
    assert checked["d2t"][1] == "int64" and checked["t2d"][1] == "bool" and checked["fc.weight"][1] is None


def test_missing_keys_take_the_servers_defaults():
    table = tensor_table_from_config(
        {"hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 96, "vocab_size": 300}
    )
    assert table["midlayer.self_attn.k_proj.weight"][0] == (
        64,
        128,
    )  # kv heads = heads, head_dim = hidden / heads
    assert table["lm_head.weight"][0] == (300, 64)  # no draft_vocab_size: the full vocab
