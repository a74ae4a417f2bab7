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

Both configs also carry vLLM's top-level `eagle_aux_hidden_state_layer_ids` (vLLM reads only that key,
`eagle3_utils.get_eagle3_aux_layers_from_config`; SGLang reads only `eagle_config`'s), so either
folder captures the trained layers on either server.

vLLM / speculators folder (speculators 0.9.0 `Eagle3DraftModel`, vLLM `llama_eagle3.py`): a
speculators-format config.json (`speculators_model_type` "eagle3", `transformer_layer_config`,
`speculators_config`) and model.safetensors with the decoder layer as `layers.0.*` -- speculators'
own module names; its `from_pretrained` is not strict and would leave `midlayer.*` weights random --
plus `embed_tokens.weight`, the target's table: speculators without a verifier keeps its embedding
at NaN otherwise, and vLLM shares the target's table when the two are equal. vLLM's speculators
reader defaults `norm_before_residual` to True (speculators' own default is False); this draft keeps
residual = h, so False is written explicitly.

The verifier reference (`speculators_config.verifier.name_or_path`, which `vllm serve EXPORT` and
speculators load the target from) is portable, never this machine's absolute path: the target's hub
id where known (the spec, a hub-cache snapshot path `models--org--name`, or the config's
`_name_or_path`), else the target folder's name, which both resolve as a folder of that name in
their working directory or as a hub id (`portable_verifier_reference`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save

from eaglekit.draft.config import DraftConfig, TargetConfigLike, TargetTextConfig
from eaglekit.draft.model import Eagle3DraftModel
from eaglekit.draft.tensors import (EMBED_TOKENS, SGLANG_LAYER_PREFIX, VLLM_LAYER_PREFIX, VOCAB_MAPS, draft_tensor_table,
                                    to_vllm_name)
from eaglekit.io import InputError, atomic_write, write_json

SGLANG_ARCHITECTURE = "LlamaForCausalLMEagle3"
VLLM_SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
_FIXED_DTYPES = {"int64": torch.int64, "bool": torch.bool}  # the vocab maps' dtypes in the tensor table


class DraftTargetMismatch(ValueError):
    """The draft's config contradicts its target; exporting it would serve garbage silently."""


def expected_tensors(config: DraftConfig, dtype: torch.dtype, layout: str = "sglang") -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor an export holds: name -> (shape, dtype). `draft.tensors`' table, float weights in `dtype`.

    layout "sglang": DESIGN's names (`midlayer.*`, no embedding); "vllm": the layer as `layers.0.*` and
    the target's `embed_tokens.weight` (V, H) beside it (speculators' module names).
    """
    if layout not in ("sglang", "vllm"):
        raise ValueError(f"export layout {layout!r}: use 'sglang' or 'vllm'")
    table = draft_tensor_table(hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
                               num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim,
                               intermediate_size=config.intermediate_size, vocab_size=config.vocab_size,
                               draft_vocab_size=config.draft_vocab_size, speculators=layout == "vllm")
    return {name: (shape, dtype if dtype_name is None else _FIXED_DTYPES[dtype_name]) for name, (shape, dtype_name) in table.items()}


def to_kit_name(name: str) -> str:
    """`layers.0.x` -> `midlayer.x`: a vLLM export's names as the kit's module holds them."""
    return SGLANG_LAYER_PREFIX + name[len(VLLM_LAYER_PREFIX):] if name.startswith(VLLM_LAYER_PREFIX) else name


def _target_mismatches(config: DraftConfig, target: TargetTextConfig, positions_note: str = "") -> list[str]:
    """Where the draft config contradicts its target in hidden_size, vocab_size or (too short)
    max_position_embeddings, one phrase each; `positions_note` follows the last."""
    problems = [f"{key} {getattr(config, key)} != target {getattr(target, key)}" for key in ("hidden_size", "vocab_size")
                if getattr(config, key) != getattr(target, key)]
    if config.max_position_embeddings < target.max_position_embeddings:
        problems.append(f"max_position_embeddings {config.max_position_embeddings} < target's {target.max_position_embeddings}"
                        + positions_note)
    return problems


def check_against_target(model: Eagle3DraftModel, target_config: TargetConfigLike) -> None:
    """Raise DraftTargetMismatch naming every contradiction between the draft and its target.

    target_config: the target's text config in any form TargetTextConfig.of takes (a TargetLayout, a
    config dict, a wrapper's whole config.json, a transformers config)."""
    target = TargetTextConfig.of(target_config)
    config = model.config
    problems = _target_mismatches(config, target, " (long prompts would get positions the draft never saw)")
    if config.target_num_hidden_layers != target.num_hidden_layers:
        problems.append(f"trained on features of a {config.target_num_hidden_layers}-layer target, "
                        f"this target has {target.num_hidden_layers}")
    bad_indices = [index for index in config.capture_layer_indices if not 1 <= index <= target.num_hidden_layers - 1]
    if len(config.capture_layer_indices) != 3 or bad_indices:
        problems.append(f"capture_layer_indices {list(config.capture_layer_indices)} must be 3 layer inputs in "
                        f"[1, {target.num_hidden_layers - 1}]")
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


def _export_tensors(model: Eagle3DraftModel, dtype: torch.dtype, layout: str = "sglang") -> dict[str, torch.Tensor]:
    state = model.trainable_state_dict()
    tensors = {name: state[name].detach().to("cpu", dtype).contiguous() for name in expected_tensors(model.config, dtype)
               if name not in VOCAB_MAPS}
    tensors["d2t"] = model.d2t.detach().cpu().to(torch.int64).contiguous()
    tensors["t2d"] = model.t2d.detach().cpu().to(torch.bool).contiguous()
    if layout == "vllm":
        tensors = {to_vllm_name(name): tensor for name, tensor in tensors.items()}
        tensors[EMBED_TOKENS] = model.embed_tokens.weight.detach().to("cpu", dtype).contiguous()
    return tensors


def _rope_legacy_keys(config: DraftConfig) -> dict:
    """rope_theta + rope_scaling, the keys SGLang/vLLM (transformers 4.x configs) read; transformers 5
    converts them."""
    parameters = dict(config.rope_parameters)
    rope_theta = parameters.pop("rope_theta")
    rope_scaling = None if parameters.get("rope_type", "default") == "default" else parameters
    return {"rope_theta": rope_theta, "rope_scaling": rope_scaling}


def _llama_layer_config(config: DraftConfig, target: TargetTextConfig, dtype: torch.dtype) -> dict:
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


def sglang_config(model: Eagle3DraftModel, target_config: TargetConfigLike, dtype: torch.dtype = torch.bfloat16) -> dict:
    """config.json for SGLang (`--speculative-algorithm EAGLE3`), from the target's resolved text config."""
    config, target = model.config, TargetTextConfig.of(target_config)
    return {
        "architectures": [SGLANG_ARCHITECTURE],
        **_llama_layer_config(config, target, dtype),
        "target_hidden_size": target.hidden_size,
        "eagle_config": {
            # SGLang captures before layer id + 1: write output_hidden_states index - 1.
            "eagle_aux_hidden_state_layer_ids": [index - 1 for index in config.capture_layer_indices],
            "use_aux_hidden_state": True,
        },
        # vLLM reads only this top-level key and captures before layer id: the index itself.
        "eagle_aux_hidden_state_layer_ids": list(config.capture_layer_indices),
    }


def portable_verifier_reference(target: str | os.PathLike) -> str:
    """A reference to the target that works on another machine (never an absolute local path).

    A hub id (`org/name`) is kept; a hub-cache snapshot folder (`.../models--org--name/snapshots/REV`)
    gives `org/name`; a local folder whose config.json `_name_or_path` is a hub id gives that id;
    any other local folder gives its name (`smollm2-135m-instruct`), which vLLM and speculators
    resolve as a folder of that name in their working directory, or as a hub id.
    """
    text = os.fspath(target)
    hub_id = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
    path = Path(text).expanduser()
    if hub_id.match(text) and not path.exists():
        return text
    for part in reversed(path.parts):
        match = re.match(r"^models--([^-].*?)--(.+)$", part)
        if match:
            return f"{match.group(1)}/{match.group(2)}"
    named = _config_json_or_empty(path).get("_name_or_path") or ""
    if hub_id.match(named) and not Path(named).is_absolute():
        return named
    return path.resolve().name if path.exists() else path.name


def _config_json_or_empty(folder: Path) -> dict:
    """The folder's config.json, or {} where it has none that reads as JSON (a hub id is not a folder)."""
    try:
        return json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def vllm_config(
    model: Eagle3DraftModel,
    target_config: TargetConfigLike,
    verifier_name_or_path: str | os.PathLike | None = None,
    speculative_tokens: int = 3,
    dtype: torch.dtype = torch.bfloat16,
) -> dict:
    """Speculators-format config.json for vLLM (`--speculative-config '{"model": DIR, ...}'`).

    verifier_name_or_path: the target as a hub id or a local folder (written as its portable
    reference); default the TargetLayout's folder when `target_config` is one.
    """
    config, target = model.config, TargetTextConfig.of(target_config)
    if verifier_name_or_path is None:
        verifier_name_or_path = getattr(target_config, "folder", None)
        if verifier_name_or_path is None:
            raise ValueError("vllm_config: name the target (verifier_name_or_path: a hub id or the target folder)")
    reference = portable_verifier_reference(verifier_name_or_path)
    # the verifier's top-level architectures: the target config's, else its folder's config.json
    architectures = list(target.architectures) or list(_config_json_or_empty(Path(verifier_name_or_path)).get("architectures") or [])
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
            "verifier": {"name_or_path": reference, "architectures": architectures},
        },
        "torch_dtype": _DTYPE_NAMES[dtype],
    }


def _export(model: Eagle3DraftModel, target_config: TargetConfigLike, output_dir: str | Path, config: Callable[[], dict],
            dtype: torch.dtype, layout: str) -> Path:
    """Refuse a draft that contradicts its target, or whose weights hold NaN or inf (a server would run it
    without an error); then write weights, then `config()` (each atomic; stale temp files of a killed export
    go with the next write, `io.atomic_write`), and validate the folder."""
    # training imports draft: imported here, not at the top
    from eaglekit.training.finite import require_finite_draft

    output_dir = Path(output_dir)
    check_against_target(model, target_config)
    require_finite_draft(model, f"export to {output_dir}")
    config, tensors = config(), _export_tensors(model, dtype, layout)
    with atomic_write(output_dir / WEIGHTS_FILE, "wb") as handle:
        handle.write(save(tensors, metadata={"format": "pt"}))
    write_json(output_dir / CONFIG_FILE, config)
    validate_export(output_dir, target_config)
    return output_dir


def export_sglang(model: Eagle3DraftModel, target_config: TargetConfigLike, output_dir: str | Path,
                  dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the SGLang-loadable folder (config.json + model.safetensors); refuses a mismatched or non-finite
    draft."""
    return _export(model, target_config, output_dir, lambda: sglang_config(model, target_config, dtype), dtype, "sglang")


def export_vllm(
    model: Eagle3DraftModel,
    target_config: TargetConfigLike,
    output_dir: str | Path,
    verifier_name_or_path: str | os.PathLike | None = None,
    speculative_tokens: int = 3,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Write the vLLM / speculators folder (speculators config.json; `layers.0.*` names plus the target's
    embed_tokens). verifier_name_or_path: see vllm_config (written as a portable reference). Refuses a
    mismatched or non-finite draft."""
    return _export(model, target_config, output_dir,
                   lambda: vllm_config(model, target_config, verifier_name_or_path, speculative_tokens, dtype), dtype, "vllm")


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
            raise InputError(path, None, "norm_before_residual",
                             "this draft computes the residual from h itself; True would change the layer")
    elif raw.get("architectures") == [SGLANG_ARCHITECTURE]:
        layer = raw
        try:
            capture = [layer_id + 1 for layer_id in raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
        except KeyError:
            raise InputError(path, None, "eagle_config.eagle_aux_hidden_state_layer_ids",
                             "missing: which target layers feed the draft?") from None
    else:
        raise InputError(path, None, "architectures",
                         f"{raw.get('architectures')!r} is neither an SGLang EAGLE-3 nor a speculators eagle3 config")
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
        num_key_value_heads=layer["num_key_value_heads"],
        head_dim=layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"], vocab_size=layer["vocab_size"],
        draft_vocab_size=layer["draft_vocab_size"], max_position_embeddings=layer["max_position_embeddings"],
        rms_norm_eps=layer["rms_norm_eps"], rope_parameters=rope_parameters, hidden_act=layer.get("hidden_act", "silu"),
        target_num_hidden_layers=0, capture_layer_indices=tuple(capture),  # type: ignore[arg-type]
    )


def validate_export(folder: str | Path, target_config: TargetConfigLike | None = None) -> DraftConfig:
    """Check an export: every expected tensor present with its shape and dtype, nothing else, config sane.

    With `target_config`, also check the config against the target. Returns the export's DraftConfig.
    """
    folder = Path(folder)
    config = read_export_config(folder)
    raw = json.loads((folder / CONFIG_FILE).read_text())
    dtype_name = raw.get("torch_dtype") or raw.get("transformer_layer_config", {}).get("torch_dtype", "bfloat16")
    dtype = {name: value for value, name in _DTYPE_NAMES.items()}[dtype_name]
    # A speculators-format export has vLLM's layout (`layers.0.*`, embed_tokens).
    expected = expected_tensors(config, dtype, "vllm" if raw.get("speculators_model_type") == "eagle3" else "sglang")
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
    mismatched = [] if target_config is None else _target_mismatches(config, TargetTextConfig.of(target_config))
    if mismatched:
        raise DraftTargetMismatch(f"{folder}: " + "; ".join(mismatched))
    return config


def load_export(folder: str | Path, target_embed_tokens: torch.Tensor | None = None, target_num_hidden_layers: int = 0) -> Eagle3DraftModel:
    """Rebuild the kit's draft from an export (either format) plus the target's embedding table (V, H).

    A vLLM export carries the embedding itself; `target_embed_tokens`, when given, replaces it (an
    SGLang export needs it)."""
    folder = Path(folder)
    config = validate_export(folder)
    if target_num_hidden_layers:
        config = DraftConfig(**{**config.__dict__, "target_num_hidden_layers": target_num_hidden_layers})
    model = Eagle3DraftModel(config)
    with safe_open(str(folder / WEIGHTS_FILE), framework="pt") as handle:
        tensors = {to_kit_name(name): handle.get_tensor(name) for name in handle.keys()}
    dtype = tensors["fc.weight"].dtype
    cast_weights(model, dtype)
    if target_embed_tokens is not None:
        tensors[EMBED_TOKENS] = target_embed_tokens.to(dtype)
    elif EMBED_TOKENS not in tensors:
        raise ValueError(f"{folder}: an SGLang export holds no embed_tokens; pass the target's table (target_embed_tokens)")
    model.load_state_dict(tensors, strict=True)
    return model


def cast_weights(model: Eagle3DraftModel, dtype: torch.dtype) -> Eagle3DraftModel:
    """Cast parameters only: RoPE frequencies stay float32 (module.to(dtype) would round them too)."""
    for parameter in model.parameters():
        parameter.data = parameter.data.to(dtype)
    return model
