"""The draft checkpoint's tensor table: DESIGN's exact names with their shapes, one table for export and
doctor.

SGLang loads `model.safetensors` by name and silently skips a name it does not know, leaving that
weight random (accept length near 1.0, no error). So the names are a contract, written once here:
`draft.export` writes and validates exactly these tensors, and `draft.doctor` checks a third-party
checkpoint against the same table. No torch import: the doctor reads configs without loading a model.

Shapes, with H the draft's hidden size (the target's, by contract), A = heads x head_dim, K = kv_heads x
head_dim, I the MLP width, V the target vocab and D the draft vocab:

    fc.weight                                  (H, 3 x target H)  the three captured layers -> H
    midlayer.self_attn.{q,k,v}_proj.weight     (A | K | K, 2H)    attention reads cat(embed, hidden)
    midlayer.self_attn.o_proj.weight           (H, A)
    midlayer.mlp.{gate,up}_proj.weight         (I, H)
    midlayer.mlp.down_proj.weight              (H, I)
    midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight, norm.weight   (H,)
    lm_head.weight                             (D, H)
    d2t                                        (D,) int64: target_id - draft_id
    t2d                                        (V,) bool: target ids in the draft vocab

Float weights carry the checkpoint's dtype (bf16, fp16 or fp32: the contract does not fix it), so
their dtype is None in the table; `d2t` and `t2d` have fixed dtypes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# name -> (shape, dtype name, None: the checkpoint's float dtype)
TensorTable = dict[str, tuple[tuple[int, ...], str | None]]
VOCAB_MAPS = ("d2t", "t2d")
# a speculators-format config (vLLM folder): `layers.0.*` names plus embed_tokens
SPECULATORS_MODEL_TYPE = "eagle3"
SGLANG_LAYER_PREFIX = "midlayer."
VLLM_LAYER_PREFIX = "layers.0."  # speculators' module name; vLLM and SGLang accept it too
EMBED_TOKENS = "embed_tokens.weight"


def is_speculators_config(draft_config: Mapping[str, Any]) -> bool:
    return draft_config.get("speculators_model_type") == SPECULATORS_MODEL_TYPE


def layer_fields(draft_config: Mapping[str, Any]) -> dict[str, Any]:
    """The draft layer's fields from either config format: a speculators config keeps them in
    `transformer_layer_config`, with draft_vocab_size / target_hidden_size at the top."""
    if not is_speculators_config(draft_config):
        return dict(draft_config)
    top = {key: draft_config[key] for key in ("draft_vocab_size", "target_hidden_size") if draft_config.get(key) is not None}
    return {**(draft_config.get("transformer_layer_config") or {}), **top}


def to_vllm_name(name: str) -> str:
    """`midlayer.x` -> `layers.0.x` (speculators' Eagle3 module names); other names unchanged."""
    return VLLM_LAYER_PREFIX + name[len(SGLANG_LAYER_PREFIX):] if name.startswith(SGLANG_LAYER_PREFIX) else name


def draft_tensor_table(*, hidden_size: int, num_attention_heads: int, num_key_value_heads: int, head_dim: int,
                       intermediate_size: int, vocab_size: int, draft_vocab_size: int,
                       target_hidden_size: int | None = None, speculators: bool = False) -> TensorTable:
    """Every tensor a draft checkpoint holds: name -> (shape, dtype name or None). Exactly DESIGN's names;
    `speculators`: speculators' names instead (`layers.0.*` for `midlayer.*`) and the target's
    `embed_tokens.weight` (V, H) beside them (a vLLM folder)."""
    hidden = hidden_size
    target_hidden = hidden if target_hidden_size is None else target_hidden_size
    attention_width, kv_width = num_attention_heads * head_dim, num_key_value_heads * head_dim
    table: TensorTable = {
        "fc.weight": ((hidden, 3 * target_hidden), None),
        "midlayer.self_attn.q_proj.weight": ((attention_width, 2 * hidden), None),
        "midlayer.self_attn.k_proj.weight": ((kv_width, 2 * hidden), None),
        "midlayer.self_attn.v_proj.weight": ((kv_width, 2 * hidden), None),
        "midlayer.self_attn.o_proj.weight": ((hidden, attention_width), None),
        "midlayer.mlp.gate_proj.weight": ((intermediate_size, hidden), None),
        "midlayer.mlp.up_proj.weight": ((intermediate_size, hidden), None),
        "midlayer.mlp.down_proj.weight": ((hidden, intermediate_size), None),
        "midlayer.input_layernorm.weight": ((hidden,), None),
        "midlayer.hidden_norm.weight": ((hidden,), None),
        "midlayer.post_attention_layernorm.weight": ((hidden,), None),
        "norm.weight": ((hidden,), None),
        "lm_head.weight": ((draft_vocab_size, hidden), None),
        "d2t": ((draft_vocab_size,), "int64"),
        "t2d": ((vocab_size,), "bool"),
    }
    if not speculators:
        return table
    return {**{to_vllm_name(name): value for name, value in table.items()}, EMBED_TOKENS: ((vocab_size, hidden), None)}


def tensor_table_from_config(draft_config: Mapping[str, Any]) -> TensorTable:
    """The table for a draft's config.json, with the defaults servers apply to missing keys.

    num_key_value_heads defaults to the heads, head_dim to hidden / heads, draft_vocab_size to the
    vocab (SGLang then takes the full target vocab), target_hidden_size to hidden_size.
    A speculators-format config (vLLM folder) gives speculators' names: `layers.0.*` for `midlayer.*`,
    and the target's `embed_tokens.weight` (V, H).
    Raises KeyError, TypeError or ValueError when a required key is missing or not a number.
    """
    speculators = is_speculators_config(draft_config)
    draft_config = layer_fields(draft_config)
    hidden = int(draft_config["hidden_size"])
    heads = int(draft_config["num_attention_heads"])
    vocab = int(draft_config["vocab_size"])
    return draft_tensor_table(
        hidden_size=hidden,
        target_hidden_size=int(draft_config.get("target_hidden_size", hidden)),
        num_attention_heads=heads,
        num_key_value_heads=int(draft_config.get("num_key_value_heads") or heads),
        head_dim=int(draft_config.get("head_dim") or hidden // heads),
        intermediate_size=int(draft_config["intermediate_size"]),
        vocab_size=vocab,
        draft_vocab_size=int(draft_config.get("draft_vocab_size") or vocab),
        speculators=speculators,
    )
