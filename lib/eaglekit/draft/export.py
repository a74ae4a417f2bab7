"""Export a trained draft so SGLang and vLLM load it, reload an export, and check it against its target.

SGLang folder (DESIGN "Draft checkpoint"): config.json with architectures ["LlamaForCausalLMEagle3"]
and model.safetensors holding exactly the names below. SGLang skips tensor names it does not know, so
a typo means random weights and an accept length near 1.0 with no error: `validate_export` checks
every name, shape and dtype.

Capture-layer ids are written per server, because the two read the same key differently:
- SGLang (`set_eagle3_layers_to_capture`) captures before layer `id + 1`, so config id = index - 1,
  where index is the position in transformers' output_hidden_states tuple (SmolLM2: [1, 14, 26]).
- vLLM (`_get_eagle3_aux_layers_from_config`) uses the ids as given and captures before layer `id`,
  so config id = index (SmolLM2: [2, 15, 27]). Loading the SGLang folder in vLLM would shift the
  features by one layer; use the vLLM folder there.

vLLM folder: the same model.safetensors (vLLM maps `midlayer.` to `layers.0.`, loads `d2t` as
`draft_id_to_target_id`, skips `t2d`) and a speculators-format config.json (`speculators_model_type`
"eagle3", `transformer_layer_config`, `speculators_config`). vLLM's speculators reader defaults
`norm_before_residual` to True, which is not how this draft (or SGLang) computes the layer, so it is
written explicitly as False.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import LlamaConfig

from eaglekit.draft.model import DraftConfig, Eagle3DraftModel
from eaglekit.draft.tensors import VOCAB_MAPS, draft_tensor_table
from eaglekit.io import InputError, atomic_write, write_json

SGLANG_ARCHITECTURE = "LlamaForCausalLMEagle3"
VLLM_SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
_FIXED_DTYPES = {"int64": torch.int64, "bool": torch.bool}  # the vocab maps' dtypes in the tensor table


class DraftTargetMismatch(ValueError):
    """The draft's config contradicts its target; exporting it would serve garbage silently."""


def expected_tensors(config: DraftConfig, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor an export holds: name -> (shape, dtype). `draft.tensors`' table, float weights in `dtype`."""
    table = draft_tensor_table(hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
                               num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim,
                               intermediate_size=config.intermediate_size, vocab_size=config.vocab_size,
                               draft_vocab_size=config.draft_vocab_size)
    return {name: (shape, dtype if dtype_name is None else _FIXED_DTYPES[dtype_name]) for name, (shape, dtype_name) in table.items()}


def _as_llama_config(target_config: LlamaConfig | dict) -> LlamaConfig:
    return target_config if isinstance(target_config, LlamaConfig) else LlamaConfig(**target_config)


def check_against_target(model: Eagle3DraftModel, target_config: LlamaConfig | dict) -> None:
    """Raise DraftTargetMismatch naming every contradiction between the draft and its target."""
    target = _as_llama_config(target_config)
    config = model.config
    problems = []
    if config.hidden_size != target.hidden_size:
        problems.append(f"hidden_size {config.hidden_size} != target {target.hidden_size}")
    if config.vocab_size != target.vocab_size:
        problems.append(f"vocab_size {config.vocab_size} != target {target.vocab_size}")
    if config.max_position_embeddings < target.max_position_embeddings:
        problems.append(f"max_position_embeddings {config.max_position_embeddings} < target's {target.max_position_embeddings} "
                        "(long prompts would get positions the draft never saw)")
    if config.target_num_hidden_layers != target.num_hidden_layers:
        problems.append(f"trained on features of a {config.target_num_hidden_layers}-layer target, this target has {target.num_hidden_layers}")
    bad_indices = [index for index in config.capture_layer_indices if not 1 <= index <= target.num_hidden_layers - 1]
    if len(config.capture_layer_indices) != 3 or bad_indices:
        problems.append(f"capture_layer_indices {list(config.capture_layer_indices)} must be 3 layer inputs in [1, {target.num_hidden_layers - 1}]")
    if config.draft_vocab_size > config.vocab_size:
        problems.append(f"draft_vocab_size {config.draft_vocab_size} > vocab_size {config.vocab_size}")
    draft_to_target = model.draft_to_target_ids().cpu()
    if draft_to_target.numel() and (int(draft_to_target.min()) < 0 or int(draft_to_target.max()) >= config.vocab_size):
        problems.append("d2t maps draft ids outside the target vocab")
    elif draft_to_target.unique().numel() != draft_to_target.numel():
        problems.append("d2t maps two draft ids to one target token (was set_draft_vocab called?)")
    elif not bool(model.t2d.cpu()[draft_to_target].all()) or int(model.t2d.sum()) != config.draft_vocab_size:
        problems.append("t2d disagrees with d2t")
    if problems:
        raise DraftTargetMismatch("draft does not fit its target: " + "; ".join(problems))


def _export_tensors(model: Eagle3DraftModel, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    state = model.trainable_state_dict()
    tensors = {name: state[name].detach().to("cpu", dtype).contiguous() for name in expected_tensors(model.config, dtype) if name not in VOCAB_MAPS}
    tensors["d2t"] = model.d2t.detach().cpu().to(torch.int64).contiguous()
    tensors["t2d"] = model.t2d.detach().cpu().to(torch.bool).contiguous()
    return tensors


def _rope_legacy_keys(config: DraftConfig) -> dict:
    """rope_theta + rope_scaling, the keys SGLang/vLLM (transformers 4.x configs) read; transformers 5 converts them."""
    parameters = dict(config.rope_parameters)
    rope_theta = parameters.pop("rope_theta")
    rope_scaling = None if parameters.get("rope_type", "default") == "default" else parameters
    return {"rope_theta": rope_theta, "rope_scaling": rope_scaling}


def _llama_layer_config(config: DraftConfig, target: LlamaConfig, dtype: torch.dtype) -> dict:
    return {
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": config.hidden_act,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        **_rope_legacy_keys(config),
        "vocab_size": config.vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
        "tie_word_embeddings": False,  # SGLang would use embed_tokens as lm_head if True
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": target.bos_token_id,
        "eos_token_id": target.eos_token_id,
        "torch_dtype": _DTYPE_NAMES[dtype],
    }


def sglang_config(model: Eagle3DraftModel, target_config: LlamaConfig | dict, dtype: torch.dtype = torch.bfloat16) -> dict:
    """config.json for SGLang (`--speculative-algorithm EAGLE3`)."""
    config, target = model.config, _as_llama_config(target_config)
    return {
        "architectures": [SGLANG_ARCHITECTURE],
        **_llama_layer_config(config, target, dtype),
        "target_hidden_size": target.hidden_size,
        "eagle_config": {
            # SGLang captures before layer id + 1: write output_hidden_states index - 1.
            "eagle_aux_hidden_state_layer_ids": [index - 1 for index in config.capture_layer_indices],
            "use_aux_hidden_state": True,
        },
    }


def vllm_config(
    model: Eagle3DraftModel,
    target_config: LlamaConfig | dict,
    verifier_name_or_path: str,
    speculative_tokens: int = 3,
    dtype: torch.dtype = torch.bfloat16,
) -> dict:
    """Speculators-format config.json for vLLM (`--speculative-config '{"model": DIR, ...}'`)."""
    config, target = model.config, _as_llama_config(target_config)
    return {
        "architectures": [VLLM_SPECULATORS_ARCHITECTURE],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": _llama_layer_config(config, target, dtype),
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": target.hidden_size,
        "norm_before_residual": False,  # vLLM's speculators reader defaults to True; this draft is False
        # vLLM captures before layer id: the output_hidden_states index itself.
        "eagle_aux_hidden_state_layer_ids": list(config.capture_layer_indices),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_name_or_path, "architectures": list(target.architectures or ["LlamaForCausalLM"])},
        },
        "torch_dtype": _DTYPE_NAMES[dtype],
    }


def _write_folder(output_dir: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    output_dir.mkdir(parents=True, exist_ok=True)
    with atomic_write(output_dir / WEIGHTS_FILE, "wb") as handle:
        handle.write(_safetensors_bytes(tensors))
    write_json(output_dir / CONFIG_FILE, config)
    return output_dir


def _safetensors_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save

    return save(tensors, metadata={"format": "pt"})


def export_sglang(model: Eagle3DraftModel, target_config: LlamaConfig | dict, output_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the SGLang-loadable folder (config.json + model.safetensors); refuses a mismatched draft."""
    check_against_target(model, target_config)
    folder = _write_folder(Path(output_dir), sglang_config(model, target_config, dtype), _export_tensors(model, dtype))
    validate_export(folder, target_config)
    return folder


def export_vllm(
    model: Eagle3DraftModel,
    target_config: LlamaConfig | dict,
    output_dir: str | Path,
    verifier_name_or_path: str,
    speculative_tokens: int = 3,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Write the vLLM-loadable folder (speculators config.json + the same model.safetensors)."""
    check_against_target(model, target_config)
    config = vllm_config(model, target_config, verifier_name_or_path, speculative_tokens, dtype)
    folder = _write_folder(Path(output_dir), config, _export_tensors(model, dtype))
    validate_export(folder, target_config)
    return folder


def read_export_config(folder: str | Path) -> DraftConfig:
    """DraftConfig from either export's config.json (SGLang or vLLM speculators format)."""
    path = Path(folder) / CONFIG_FILE
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: not an export folder (no config.json)") from None
    except json.JSONDecodeError as error:
        raise InputError(path, error.lineno, None, f"malformed JSON: {error.msg}") from None
    if raw.get("speculators_model_type") == "eagle3":
        layer, capture = raw["transformer_layer_config"], list(raw["eagle_aux_hidden_state_layer_ids"])
        if raw.get("norm_before_residual", True):
            raise InputError(path, None, "norm_before_residual", "this draft computes the residual from h itself; True would change the layer")
    elif raw.get("architectures") == [SGLANG_ARCHITECTURE]:
        layer = raw
        try:
            capture = [layer_id + 1 for layer_id in raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
        except KeyError:
            raise InputError(path, None, "eagle_config.eagle_aux_hidden_state_layer_ids", "missing: which target layers feed the draft?") from None
    else:
        raise InputError(path, None, "architectures", f"{raw.get('architectures')!r} is neither an SGLang EAGLE-3 nor a speculators eagle3 config")
    for key in ("hidden_size", "vocab_size", "draft_vocab_size", "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
        if key not in layer:
            raise InputError(path, None, key, "missing")
    if layer.get("num_hidden_layers") != 1:
        raise InputError(path, None, "num_hidden_layers", f"{layer.get('num_hidden_layers')} but an EAGLE-3 draft here has 1")
    if layer.get("tie_word_embeddings", True):
        raise InputError(path, None, "tie_word_embeddings", "must be false, or SGLang uses embed_tokens as the draft lm_head")
    rope_parameters = {"rope_type": "default", **(layer.get("rope_scaling") or {}), "rope_theta": layer["rope_theta"]}
    return DraftConfig(
        hidden_size=layer["hidden_size"], intermediate_size=layer["intermediate_size"], num_attention_heads=layer["num_attention_heads"],
        num_key_value_heads=layer["num_key_value_heads"], head_dim=layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"],
        vocab_size=layer["vocab_size"], draft_vocab_size=layer["draft_vocab_size"], max_position_embeddings=layer["max_position_embeddings"],
        rms_norm_eps=layer["rms_norm_eps"], rope_parameters=rope_parameters, hidden_act=layer.get("hidden_act", "silu"),
        target_num_hidden_layers=0, capture_layer_indices=tuple(capture),  # type: ignore[arg-type]
    )


def validate_export(folder: str | Path, target_config: LlamaConfig | dict | None = None) -> DraftConfig:
    """Check an export: every expected tensor present with its shape and dtype, nothing else, config sane.

    With `target_config`, also check the config against the target. Returns the export's DraftConfig.
    """
    folder = Path(folder)
    config = read_export_config(folder)
    raw = json.loads((folder / CONFIG_FILE).read_text())
    dtype_name = raw.get("torch_dtype") or raw.get("transformer_layer_config", {}).get("torch_dtype", "bfloat16")
    dtype = {name: value for value, name in _DTYPE_NAMES.items()}[dtype_name]
    expected = expected_tensors(config, dtype)
    weights = folder / WEIGHTS_FILE
    with safe_open(str(weights), framework="pt") as handle:
        names = set(handle.keys())
        problems = [f"missing {name}" for name in sorted(set(expected) - names)]
        problems += [f"unexpected {name} (SGLang would skip it silently)" for name in sorted(names - set(expected))]
        for name in sorted(set(expected) & names):
            tensor = handle.get_tensor(name)
            shape, tensor_dtype = expected[name]
            if tuple(tensor.shape) != shape or tensor.dtype != tensor_dtype:
                problems.append(f"{name}: {tuple(tensor.shape)} {tensor.dtype}, expected {shape} {tensor_dtype}")
    if problems:
        raise InputError(weights, None, None, "; ".join(problems))
    if target_config is not None:
        target = _as_llama_config(target_config)
        mismatched = [f"{key} {getattr(config, key)} != target {getattr(target, key)}" for key in ("hidden_size", "vocab_size") if getattr(config, key) != getattr(target, key)]
        if config.max_position_embeddings < target.max_position_embeddings:
            mismatched.append(f"max_position_embeddings {config.max_position_embeddings} < target's {target.max_position_embeddings}")
        if mismatched:
            raise DraftTargetMismatch(f"{folder}: " + "; ".join(mismatched))
    return config


def load_export(folder: str | Path, target_embed_tokens: torch.Tensor, target_num_hidden_layers: int = 0) -> Eagle3DraftModel:
    """Rebuild the kit's draft from an export (either format) plus the target's embedding table (V, H)."""
    folder = Path(folder)
    config = validate_export(folder)
    if target_num_hidden_layers:
        config = DraftConfig(**{**config.__dict__, "target_num_hidden_layers": target_num_hidden_layers})
    model = Eagle3DraftModel(config)
    with safe_open(str(folder / WEIGHTS_FILE), framework="pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    cast_weights(model, tensors["fc.weight"].dtype)
    dtype = tensors["fc.weight"].dtype
    model.load_state_dict({**tensors, "embed_tokens.weight": target_embed_tokens.to(dtype)}, strict=True)
    return model


def cast_weights(model: Eagle3DraftModel, dtype: torch.dtype) -> Eagle3DraftModel:
    """Cast parameters only: RoPE frequencies stay float32 (module.to(dtype) would round them too)."""
    for parameter in model.parameters():
        parameter.data = parameter.data.to(dtype)
    return model
