"""The draft's configuration: the target's text config as the draft needs it (`TargetTextConfig`, from a
plain config, a multimodal wrapper's `text_config` or a live transformers config), the draft's explicit
shape with named presets (`DraftShape`, `DRAFT_SHAPES`), and `DraftConfig`, what the model, checkpoints
and exports are built from."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Union

from transformers import LlamaConfig

if TYPE_CHECKING:
    from eaglekit.target import TargetLayout

# Every form a target's config reaches the draft in: see TargetTextConfig.of.
TargetConfigLike = Union["TargetTextConfig", "TargetLayout", Mapping[str, Any], Any]


@dataclass(frozen=True)
class TargetTextConfig:
    """What the draft needs to know of its target's text decoder, read from the decoder's own config.

    Built from the text config (a multimodal wrapper's `text_config`), never by forcing a non-Llama
    config through LlamaConfig: `head_dim` of an MLA decoder (DeepSeek-V3, Kimi-K2) is its RoPE
    part (qk_rope_head_dim), not an attention width a Llama layer could use, so it is left None.
    `architectures` are the checkpoint's top-level ones (what a server loads as the verifier).
    """

    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    max_position_embeddings: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    rms_norm_eps: float
    rope_parameters: dict
    head_dim: int | None = None
    hidden_act: str = "silu"
    model_type: str = "llama"
    architectures: tuple[str, ...] = ()
    bos_token_id: int | list[int] | None = None
    eos_token_id: int | list[int] | None = None
    mla: bool = False

    @classmethod
    def from_text_config(cls, text_config: Mapping[str, Any], architectures: Sequence[str] | None = None) -> "TargetTextConfig":
        """From a decoder's config.json fields (a plain causal LM's config or a wrapper's `text_config`)."""
        def required(key: str):
            if text_config.get(key) is None:
                raise ValueError(f"target text config has no {key!r}; pass the decoder's config (a wrapper's text_config)")
            return text_config[key]

        heads = int(required("num_attention_heads"))
        mla = bool(text_config.get("kv_lora_rank"))
        head_dim = None if mla else text_config.get("head_dim")
        return cls(
            hidden_size=int(required("hidden_size")), num_hidden_layers=int(required("num_hidden_layers")),
            vocab_size=int(required("vocab_size")), max_position_embeddings=int(required("max_position_embeddings")),
            num_attention_heads=heads, num_key_value_heads=int(text_config.get("num_key_value_heads") or heads),
            intermediate_size=int(required("intermediate_size")), rms_norm_eps=float(text_config.get("rms_norm_eps", 1e-6)),
            rope_parameters=rope_parameters_of(text_config), head_dim=int(head_dim) if head_dim else None,
            hidden_act=str(text_config.get("hidden_act", "silu")), model_type=str(text_config.get("model_type", "llama")),
            architectures=tuple(architectures if architectures is not None else text_config.get("architectures") or ()),
            bos_token_id=text_config.get("bos_token_id"), eos_token_id=text_config.get("eos_token_id"), mla=mla,
        )

    @classmethod
    def of(cls, target: "TargetConfigLike") -> "TargetTextConfig":
        """Accept every form a caller holds: this type, a TargetLayout, a transformers config, or a config
        dict (a wrapper's whole config.json is reduced to its text_config, keeping the wrapper's
        architectures)."""
        if isinstance(target, cls):
            return target
        # eaglekit.target.TargetLayout
        if hasattr(target, "text_config") and hasattr(target, "prefix") and hasattr(target, "config"):
            return cls.from_text_config(target.text_config, target.config.get("architectures") or ())
        if hasattr(target, "to_dict"):  # a transformers PretrainedConfig
            target = target.to_dict()
        if not isinstance(target, Mapping):
            raise TypeError(f"target config {type(target).__name__}: pass a TargetLayout, a config dict or a transformers config")
        if isinstance(target.get("text_config"), Mapping):
            return cls.from_text_config(target["text_config"], target.get("architectures") or ())
        return cls.from_text_config(target)


def rope_parameters_of(text_config: Mapping[str, Any]) -> dict:
    """RoPE settings as transformers 5's `rope_parameters` (rope_type, rope_theta, scaling keys), from either
    that key or the older `rope_theta` + `rope_scaling` pair."""
    if isinstance(text_config.get("rope_parameters"), Mapping):
        parameters = dict(text_config["rope_parameters"])
    else:
        scaling = dict(text_config.get("rope_scaling") or {})
        if "type" in scaling and "rope_type" not in scaling:
            scaling["rope_type"] = scaling.pop("type")
        parameters = {**scaling, "rope_theta": text_config.get("rope_theta", 10000.0)}
    parameters.setdefault("rope_type", "default")
    parameters["rope_theta"] = float(parameters.get("rope_theta") or 10000.0)
    return parameters


@dataclass(frozen=True)
class DraftShape:
    """The draft layer's widths where they need not follow the target; None = derived from the target.

    Derived (as the kit always did): the target's heads and KV heads, its head_dim (hidden / heads
    when the config has none, or when the target uses MLA), its MLP width and its RoPE settings.
    """

    num_attention_heads: int | None = None
    head_dim: int | None = None
    num_key_value_heads: int | None = None
    intermediate_size: int | None = None
    rope_parameters: dict | None = None


# Named shapes (`training.draft_shape` in params picks one; "auto" derives everything from the target).
# kimi_k25_public: the published EAGLE-3 draft for Kimi-K2.5, TorchSpec's
# configs/draft_models/kimi_k25_eagle3.json (torchspec-project/TorchSpec @ 4643a096): hidden 7168,
# 64 heads x head_dim 128 (attention width 8192, o_proj 8192 -> 7168), 64 KV heads, intermediate 12288,
# rope_theta 1e6 without rope_scaling, rms_norm_eps 1e-6, max_position_embeddings 262144. Derived
# from Kimi's text config the draft would get head_dim 7168 / 64 = 112, the target's 18432-wide MLP
# and its YaRN rope (whose mscale SGLang's and transformers' Llama YaRN apply differently).
DRAFT_SHAPES: dict[str, DraftShape] = {
    "auto": DraftShape(),
    "kimi_k25_public": DraftShape(num_attention_heads=64, head_dim=128, num_key_value_heads=64, intermediate_size=12288,
                                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
}


def draft_shape(name: str) -> DraftShape:
    """The named draft shape ("auto": every field derived from the target); the error lists the names."""
    if name not in DRAFT_SHAPES:
        raise ValueError(f"draft shape {name!r} is not one of {sorted(DRAFT_SHAPES)}")
    return DRAFT_SHAPES[name]


@dataclass(frozen=True)
class DraftConfig:
    """Shapes of one EAGLE-3 draft. `vocab_size` is the target's; logits cover `draft_vocab_size`."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    hidden_act: str = "silu"
    target_num_hidden_layers: int = 0
    # Indices into the target's output_hidden_states tuple (0 = embeddings), see
    # capture.default_capture_layer_ids.
    capture_layer_indices: tuple[int, int, int] = (2, 0, 0)

    @classmethod
    def from_target_config(
        cls,
        target_config: "TargetConfigLike",
        draft_vocab_size: int,
        capture_layer_indices: tuple[int, int, int] | None = None,
        shape: DraftShape | str | None = None,
    ) -> "DraftConfig":
        """A one-layer draft for this target: hidden size, vocab, positions and norm eps from the target's
        text config; heads, head_dim, KV heads, MLP width and RoPE from `shape` (a DraftShape or a name
        in DRAFT_SHAPES) where it sets them, else derived from the target."""
        target = TargetTextConfig.of(target_config)
        shape = draft_shape(shape) if isinstance(shape, str) else (shape or DraftShape())
        # the one definition of EAGLE-3's default layers
        from eaglekit.capture import default_capture_layer_ids

        num_layers = target.num_hidden_layers
        indices = tuple(capture_layer_indices) if capture_layer_indices is not None else tuple(default_capture_layer_ids(num_layers))
        heads = shape.num_attention_heads or target.num_attention_heads
        # a shape that sets the heads sets the KV heads with them (MHA unless stated)
        kv_heads = shape.num_key_value_heads or (heads if shape.num_attention_heads else target.num_key_value_heads)
        head_dim = shape.head_dim or (target.head_dim if not shape.num_attention_heads else None) or target.hidden_size // heads
        if heads % kv_heads:
            raise ValueError(f"draft shape: {heads} attention heads are not a multiple of {kv_heads} KV heads")
        return cls(
            hidden_size=target.hidden_size,
            intermediate_size=shape.intermediate_size or target.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=target.vocab_size,
            draft_vocab_size=draft_vocab_size,
            max_position_embeddings=target.max_position_embeddings,
            rms_norm_eps=target.rms_norm_eps,
            rope_parameters=dict(shape.rope_parameters or target.rope_parameters),
            hidden_act=target.hidden_act,
            target_num_hidden_layers=num_layers,
            capture_layer_indices=indices,  # type: ignore[arg-type]
        )

    def to_llama_config(self) -> LlamaConfig:
        """The draft as a one-layer LlamaConfig (RoPE tables come from transformers, every rope type)."""
        return LlamaConfig(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=1,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            vocab_size=self.vocab_size,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters=dict(self.rope_parameters),
            hidden_act=self.hidden_act,
            tie_word_embeddings=False,
        )

    def to_dict(self) -> dict:
        record = asdict(self)
        record["capture_layer_indices"] = list(self.capture_layer_indices)
        return record

    @classmethod
    def from_dict(cls, record: dict) -> "DraftConfig":
        record = dict(record)
        record["capture_layer_indices"] = tuple(record["capture_layer_indices"])
        return cls(**record)
