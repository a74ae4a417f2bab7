"""Preflight ("doctor"): catch the silent ways an EAGLE-3 draft ends up bypassed when served.

Each check returns findings (level, check, message, fix). Levels: "error" (the draft will not work
as trained: accept length near 1.0 with no error from the server), "warning" (suspicious), "ok".

What SGLang does that makes these failures silent (sglang python/sglang/srt/models/llama_eagle3.py,
models/llama.py, entrypoints/http_server.py):
- `load_weights` tries each checkpoint name as is and as `model.<name>`; a name matching no
  parameter is skipped without a message, leaving that weight random.
- `d2t` becomes the hot-token map (`d2t + arange`); `t2d` is ignored; `draft_vocab_size` missing
  means the lm_head is taken from the target over the full vocab.
- `tie_word_embeddings: true` makes the draft's lm_head its embed_tokens (SmolLM2 ties them).
- `fc` (3H -> H) runs only when the incoming hidden states are wider than the embeddings; with
  `--speculative-algorithm EAGLE` the target passes its final H-wide state, so `fc` is skipped.
- Capture layers: `eagle_config.eagle_aux_hidden_state_layer_ids` are layer-output ids; SGLang
  captures the residual stream entering layer id + 1, i.e. transformers `output_hidden_states`
  index id + 1. Without the key it captures indices [2, N//2, N-3]. A config holding the
  hidden-states indices themselves captures one layer too deep, silently.

What vLLM 0.32 and speculators 0.9.0 do with a speculators-format folder (vLLM
`transformers_utils/configs/speculators/algos.py`, `v1/worker/gpu/spec_decode/eagle/eagle3_utils.py`;
speculators `models/eagle3/core.py`, `models/utils.py`):
- `norm_before_residual` missing means True in vLLM and False in speculators: the same folder
  computes two different layers. The kit's draft is False (residual = h, as SGLang computes it).
- vLLM reads only the top-level `eagle_aux_hidden_state_layer_ids` (layer inputs, no +1) and falls
  back to [2, N//2, N-3]; speculators refuses repeated or out-of-range ids at load.
- speculators' `from_pretrained` is not strict: a tensor under another name stays random (or NaN).

Settings a server refuses with a draft (SGLang 0.5.23):
- `--speculative-use-rejection-sampling` with a reduced draft vocab (draft_vocab_size != vocab_size,
  every kit draft): `speculative/eagle_worker_v2.py` raises "--speculative-use-rejection-sampling
  requires the draft and target to share one vocab" at start-up; it also needs
  `--speculative-eagle-topk 1` (`arg_groups/speculative_hook.py`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from eaglekit.draft.tensors import is_speculators_config, layer_fields, tensor_table_from_config
from eaglekit.io import InputError, read_json

DRAFT_ARCHITECTURE = "LlamaForCausalLMEagle3"
BYPASS_ACCEPT_LENGTH = 1.1  # below this the draft is effectively never accepted
PARAMS_SUFFIXES = (".yaml", ".yml")  # --target-config names a params file: the target it plans for


@dataclass(frozen=True)
class Finding:
    level: str  # "error", "warning" or "ok"
    check: str
    message: str
    fix: str = ""


class DoctorInputError(ValueError):
    """An input the doctor cannot read (not JSON, a params file without a target config); names the file."""


def _ok(check: str, message: str) -> Finding:
    return Finding("ok", check, message)


def _error_or_ok(check: str, failed: bool, ok: str, message: str, fix: str) -> Finding:
    """An error finding (message, fix) when `failed`, else an ok finding saying `ok`."""
    return Finding("error", check, message, fix) if failed else _ok(check, ok)


def load_config(path: str | Path) -> dict:
    """A config.json (or a folder holding one), as written."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        return read_json(path, "pass a model folder, its config.json, or a params YAML (params/*.yaml)",
                         missing="pass the model folder or its config.json")
    except InputError as error:  # the doctor says "line N", as it always has
        line = "" if error.line is None else f" line {error.line}:"
        raise DoctorInputError(f"{error.path}:{line} {error.reason}") from None


def load_target_config(target: str | Path | Mapping[str, Any]) -> Mapping[str, Any]:
    """The target decoder's config: a model folder through `eaglekit.target.target_layout` (a multimodal
    wrapper gives its text_config); a bare config.json, or a folder holding only one, read as JSON."""
    if isinstance(target, Mapping):
        return target
    path = Path(target)
    if path.suffix in PARAMS_SUFFIXES:
        return target_config_from_params(path)
    if path.is_dir():
        from eaglekit.target import ModelResolutionError, target_layout

        try:
            return target_layout(path).text_config
        except ModelResolutionError:
            if not (path / "config.json").is_file():
                raise
    return load_config(path)


def target_config_from_params(path: Path) -> Mapping[str, Any]:
    """The target config a params file plans for: `target.config` (the planner's fields, for a model not on
    disk yet), else the config.json of `target.model` when that folder (or the embedded model) is here."""
    from eaglekit.config import load_params
    from eaglekit.target import ModelResolutionError, resolve_model, target_layout

    target = load_params(path).target
    if target.config:
        return target.config
    try:
        folder = resolve_model(target.model) if target.model.startswith(("embedded:", "/", ".", "~")) else None
    except ModelResolutionError as error:
        raise DoctorInputError(f"{path}: target.model: {error}; or give the target's fields under target.config") from None
    if folder is None:
        raise DoctorInputError(f"{path}: target.model {target.model!r} is a hub id and target.config is unset: give the "
                               "target's config.json fields under target.config (as params/kimi_k25_big_run.yaml does)")
    return target_layout(folder).text_config


def _text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    return config.get("text_config") or config


# ----------------------------------------------------------------------------- config


def check_draft_config(
    draft_config: Mapping[str, Any],
    target_config: Mapping[str, Any],
    capture_layers: Sequence[int] | None = None,
) -> list[Finding]:
    """Draft config.json against the target's config.

    capture_layers: the transformers output_hidden_states indices the draft was trained on
    (default DESIGN's [2, N//2, N-3] for an N-layer target).
    """
    target = _text_config(target_config)
    findings: list[Finding] = []
    speculators = is_speculators_config(draft_config)
    raw_config, draft_config = draft_config, layer_fields(draft_config)

    architectures = raw_config.get("architectures") or []
    ok = f"speculators eagle3 config ({architectures}): the vLLM / speculators folder" if speculators else DRAFT_ARCHITECTURE
    findings.append(_error_or_ok("architectures", not speculators and architectures != [DRAFT_ARCHITECTURE], ok,
                                 f"draft architectures is {architectures}; SGLang picks the EAGLE-3 model class from it",
                                 f'set "architectures": ["{DRAFT_ARCHITECTURE}"] in the draft config.json'))

    layers = draft_config.get("num_hidden_layers")
    findings.append(_error_or_ok("num_hidden_layers", layers != 1, "1", f"draft num_hidden_layers is {layers}; the kit's EAGLE-3 draft "
                                 "has exactly one decoder layer (midlayer)",
                                 'set "num_hidden_layers": 1 and export the single layer as midlayer.*'))

    target_hidden = target.get("hidden_size")
    # SGLang sizes fc from target_hidden_size when the draft declares one, else from hidden_size.
    draft_hidden = draft_config.get("target_hidden_size", draft_config.get("hidden_size"))
    findings.append(_error_or_ok("hidden_size", target_hidden is None or draft_hidden != target_hidden, str(target_hidden),
                                 f"draft expects target hidden size {draft_hidden}, target config says {target_hidden}",
                                 "train the draft against this target's hidden states (fc maps 3H -> H with the target's H)"))

    vocab, target_vocab = draft_config.get("vocab_size"), target.get("vocab_size")
    findings.append(_error_or_ok("vocab_size", vocab != target_vocab, str(vocab), f"draft vocab_size {vocab} != target vocab_size "
                                 f"{target_vocab}; d2t/t2d and the shared embedding index the target vocab",
                                 f'set "vocab_size": {target_vocab} (the target\'s) in the draft config and rebuild d2t/t2d for it'))

    draft_vocab = draft_config.get("draft_vocab_size")
    if draft_vocab is None:
        findings.append(Finding("error", "draft_vocab_size", "draft_vocab_size is missing: SGLang then loads lm_head from the target "
                                "over the full vocab, ignoring the trained head",
                                'set "draft_vocab_size" to the number of rows of lm_head.weight'))
    else:
        findings.append(_error_or_ok("draft_vocab_size", target_vocab is not None and draft_vocab > target_vocab, str(draft_vocab),
                                     f"draft_vocab_size {draft_vocab} exceeds the target vocab {target_vocab}",
                                     "choose the draft vocab from the target's tokens"))

    positions, target_positions = draft_config.get("max_position_embeddings"), target.get("max_position_embeddings")
    short = target_positions is not None and (positions is None or positions < target_positions)
    findings.append(_error_or_ok("max_position_embeddings", short, f"{positions} >= {target_positions}",
                                 f"draft max_position_embeddings {positions} < target's {target_positions}; long contexts get wrong "
                                 "RoPE and accept length collapses",
                                 f'set "max_position_embeddings": {target_positions} (at least the target\'s)'))

    findings.append(_error_or_ok("tie_word_embeddings", draft_config.get("tie_word_embeddings", False), "false", "tie_word_embeddings is "
                                 "true: SGLang then uses embed_tokens as the draft's lm_head and ignores lm_head.weight",
                                 'set "tie_word_embeddings": false in the draft config (the target may tie; the draft must not)'))

    if speculators:
        findings.extend(_check_norm_before_residual(raw_config))
    else:
        findings.extend(_check_capture_layers(raw_config, target, capture_layers, "SGLang"))
    if speculators or "eagle_aux_hidden_state_layer_ids" in raw_config:
        findings.extend(_check_capture_layers(raw_config, target, capture_layers, "vLLM"))
    findings.extend(check_serving_settings(raw_config, target))
    return findings


def _check_norm_before_residual(draft_config: Mapping[str, Any]) -> list[Finding]:
    value = draft_config.get("norm_before_residual")
    if value is None:
        return [Finding("error", "norm_before_residual", "norm_before_residual is missing: vLLM reads it as true, speculators as false, "
                        "so the two compute different layers from this folder",
                        'write "norm_before_residual": false (the kit\'s draft keeps residual = h, as SGLang does)')]
    if value:
        return [Finding("warning", "norm_before_residual",
                        "norm_before_residual is true: the residual is hidden_norm(h); the kit's drafts (and SGLang's layer) use h",
                        'write "norm_before_residual": false unless the draft was trained with the norm before the residual')]
    return [_ok("norm_before_residual", "false (residual = h), stated explicitly")]


def _check_capture_layers(draft_config: Mapping[str, Any], target: Mapping[str, Any], capture_layers: Sequence[int] | None,
                          server: str) -> list[Finding]:
    """The layers `server` captures from this config against those the draft was trained on. "SGLang" reads
    `eagle_config.eagle_aux_hidden_state_layer_ids`, layer-output ids, and captures index id + 1; "vLLM" reads
    the top-level key, layer inputs as given (no +1). Without the key, both capture [2, N//2, N-3]."""
    # the one definition; imported here so the doctor loads without torch
    from eaglekit.capture import default_capture_layer_ids

    sglang = server == "SGLang"
    check = "capture_layers" if sglang else "vllm_capture_layers"
    num_layers = target.get("num_hidden_layers")
    if num_layers is None:
        return [Finding("error", check, "target config has no num_hidden_layers", "pass the target's own config.json")]
    expected = list(capture_layers) if capture_layers is not None else default_capture_layer_ids(num_layers)
    if sglang and (len(expected) != 3 or any(not 1 <= index <= num_layers for index in expected)):
        return [Finding("error", check, f"training capture layers {expected} are not 3 hidden-states indices in [1, {num_layers}]",
                        "capture exactly three layers of the target (fc takes 3H)")]
    if sglang:
        ids, absent = (draft_config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"), "no"
        fix = f'set "eagle_config": {{"eagle_aux_hidden_state_layer_ids": {[index - 1 for index in expected]}}}'
    else:
        ids, absent = draft_config.get("eagle_aux_hidden_state_layer_ids"), "no top-level"
        fix = f'set "eagle_aux_hidden_state_layer_ids": {expected} at the top of config.json'
    if ids is None:
        served = default_capture_layer_ids(num_layers)
        if served == expected:
            return [_ok(check, f"no eagle_aux_hidden_state_layer_ids; {server}'s default {served} matches training")]
        return [Finding("error", check, f"{absent} eagle_aux_hidden_state_layer_ids: {server} captures its default {served}, "
                        f"but the draft was trained on {expected}", fix)]
    ids, findings = list(ids), []
    if sglang:
        served = [value + 1 for value in ids]  # SGLang: layers_to_capture = [id + 1 for id in layer_ids]
        ok = f"eagle_aux_hidden_state_layer_ids {ids} -> SGLang captures {served}, as trained"
        hint = " (the config holds the hidden-states indices themselves; SGLang adds 1 to each)" if ids == expected else ""
        fix += " (layer-output ids = hidden-states index - 1)"
    else:
        served, ok = ids, f"eagle_aux_hidden_state_layer_ids {ids}: vLLM captures them as trained"
        hint = " (SGLang's layer-output ids? vLLM takes the hidden-states indices themselves)" if [i + 1 for i in ids] == expected else ""
        if len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) > num_layers:
            findings.append(Finding("warning", check, f"eagle_aux_hidden_state_layer_ids {ids} repeat a layer or leave "
                                    f"[0, {num_layers}]: speculators' loader refuses them",
                                    f"capture three distinct layers of the {num_layers}-layer target"))
    if served == expected:
        return findings + [_ok(check, ok)]
    return findings + [Finding("error", check, f"eagle_aux_hidden_state_layer_ids {ids} make {server} capture {served}, "
                               f"but the draft was trained on {expected}{hint}", fix)]


def check_serving_settings(draft_config: Mapping[str, Any], target: Mapping[str, Any],
                           settings: Mapping[str, Any] | None = None) -> list[Finding]:
    """Server settings SGLang refuses with this draft. `settings`: the server's own (its server info) or a
    planned launch (`parse_sglang_args`); without them, a warning names what not to turn on."""
    fields = layer_fields(draft_config)
    vocab = fields.get("vocab_size") or target.get("vocab_size")
    draft_vocab = fields.get("draft_vocab_size") or vocab
    reduced = vocab is not None and draft_vocab != vocab
    findings: list[Finding] = []
    rejection = None if settings is None else bool(settings.get("speculative_use_rejection_sampling"))
    if rejection and reduced:
        findings.append(Finding("error", "rejection_sampling", "--speculative-use-rejection-sampling with a reduced draft vocab "
                                f"({draft_vocab} of {vocab}): SGLang 0.5.23 refuses to start (speculative/eagle_worker_v2.py: the "
                                "draft and target must share one vocab)",
                                "start SGLang without --speculative-use-rejection-sampling (or train a full-vocab draft)"))
    elif reduced and settings is None:
        findings.append(Finding("warning", "rejection_sampling", f"draft vocab {draft_vocab} < target vocab {vocab}: SGLang 0.5.23 refuses "
                                "--speculative-use-rejection-sampling with this draft",
                                "leave --speculative-use-rejection-sampling off when serving it"))
    elif settings is not None:
        findings.append(_ok("rejection_sampling", "off" if not rejection else "on, with a full-vocab draft"))
    if rejection and settings is not None and int(settings.get("speculative_eagle_topk") or 1) != 1:
        findings.append(Finding("error", "rejection_sampling", "--speculative-use-rejection-sampling with --speculative-eagle-topk "
                                f"{settings['speculative_eagle_topk']}: SGLang refuses it",
                                "use --speculative-eagle-topk 1 with rejection sampling"))
    return findings


def parse_sglang_args(arguments: Sequence[str] | str) -> dict[str, Any]:
    """A planned SGLang launch (`--speculative-algorithm EAGLE3 --speculative-use-rejection-sampling ...`) as
    the server-info keys the checks read (dashes to underscores; a flag without a value is True)."""
    import shlex

    tokens = shlex.split(arguments) if isinstance(arguments, str) else list(arguments)
    settings: dict[str, Any] = {}
    for index, token in enumerate(tokens):
        if not token.startswith("--"):
            continue
        key, _, value = token[2:].partition("=")
        if not value:
            following = tokens[index + 1] if index + 1 < len(tokens) else None
            value = following if following is not None and not following.startswith("--") else True
        settings[key.replace("-", "_")] = value
    return settings


# ----------------------------------------------------------------------------- weights


_DTYPE_NAMES = {"I64": "int64", "BOOL": "bool", "BF16": "bfloat16", "F16": "float16", "F32": "float32", "I32": "int32"}


def _rename_hint(name: str, known: set[str]) -> str:
    if name.startswith("model.") and name[len("model."):] in known:
        return f"rename {name} to {name[len('model.'):]}"
    layer = "layers.0." if any(known_name.startswith("layers.0.") for known_name in known) else "midlayer."
    for old in ("layers.0.", "model.layers.0.", "midlayers.0.", "midlayer."):
        if name.startswith(old) and old != layer:
            return f"rename {name} to {layer}{name[len(old):]}"
    return f"rename or drop {name}"


def check_draft_weights(weights_path: str | Path, draft_config: Mapping[str, Any]) -> list[Finding]:
    """Tensor names, shapes and dtypes of model.safetensors against DESIGN's contract; d2t/t2d consistency."""
    from safetensors import safe_open

    weights_path = Path(weights_path)
    if not weights_path.exists():
        return [Finding("error", "weights", f"{weights_path} does not exist",
                        "export the draft weights as model.safetensors beside config.json")]
    try:
        expected = tensor_table_from_config(draft_config)  # DESIGN's names, shapes and fixed dtypes
    except (KeyError, TypeError, ValueError) as error:
        return [Finding("error", "weights", f"cannot derive tensor shapes from the draft config: missing or bad {error}",
                        "write hidden_size, num_attention_heads, intermediate_size and vocab_size into config.json")]
    findings: list[Finding] = []
    loader = "speculators (and vLLM)" if is_speculators_config(draft_config) else "SGLang"
    with safe_open(str(weights_path), framework="pt") as handle:
        names = set(handle.keys())
        missing = sorted(set(expected) - names)
        unknown = sorted(names - set(expected) - ({"fc.bias"} if draft_config.get("bias") else set()))
        embed = ([name for name in unknown if name in ("embed_tokens.weight", "model.embed_tokens.weight")]
                 if not is_speculators_config(draft_config) else [])
        unknown = [name for name in unknown if name not in embed]
        if missing:
            findings.append(Finding("error", "tensor_names", f"missing tensors {missing}: {loader} leaves those weights random and "
                                    "accept length falls to about 1.0",
                                    "export every tensor under DESIGN's exact names"))
        if unknown:
            findings.append(Finding("error", "tensor_names", f"tensors {loader} would silently skip: {unknown}",
                                    "; ".join(_rename_hint(name, set(expected)) for name in unknown[:6])))
        if embed:
            findings.append(Finding("warning", "tensor_names", f"{embed} exported: the draft shares the target's frozen embed_tokens, "
                                    "which is not part of the checkpoint",
                                    "drop embed_tokens from the export"))
        if not missing and not unknown:
            findings.append(_ok("tensor_names", f"all {len(expected)} tensors present under DESIGN's names"))
        shape_errors = []
        for name, (shape, dtype) in expected.items():
            if name not in names:
                continue
            stored = handle.get_slice(name)
            actual_shape, actual_dtype = tuple(stored.get_shape()), _DTYPE_NAMES.get(stored.get_dtype(), stored.get_dtype())
            if actual_shape != shape:
                shape_errors.append(f"{name} {actual_shape} (expected {shape})")
            elif dtype is not None and actual_dtype != dtype:
                shape_errors.append(f"{name} dtype {actual_dtype} (expected {dtype})")
        if shape_errors:
            findings.append(Finding("error", "tensor_shapes", "wrong shapes or dtypes: " + "; ".join(shape_errors),
                                    "re-export from a draft built with this config (q/k/v take 2H inputs, fc takes 3H, lm_head has "
                                    "draft_vocab_size rows)"))
        elif not missing:
            findings.append(_ok("tensor_shapes", "shapes and dtypes match the config"))
        if "d2t" in names and "t2d" in names and not shape_errors:
            findings.extend(_check_vocab_maps(handle.get_tensor("d2t"), handle.get_tensor("t2d")))
    return findings


def _check_vocab_maps(d2t, t2d) -> list[Finding]:
    """d2t[i] = target_id - draft_id; t2d marks the target ids in the draft vocab: they must agree."""
    import torch

    target_ids = d2t + torch.arange(d2t.shape[0])  # what SGLang computes as hot_token_id
    if (target_ids < 0).any() or (target_ids >= t2d.shape[0]).any():
        return [Finding("error", "vocab_maps", "d2t maps draft ids outside the target vocab",
                        "rebuild d2t as target_id - draft_id for the chosen draft tokens")]
    if len(torch.unique(target_ids)) != len(target_ids):
        return [Finding("error", "vocab_maps", "d2t maps two draft ids to one target id",
                        "rebuild d2t from a list of distinct target tokens")]
    marked = torch.zeros_like(t2d)
    marked[target_ids] = True
    if not torch.equal(marked, t2d):
        return [Finding("error", "vocab_maps",
                        f"t2d marks {int(t2d.sum())} target ids but d2t maps to {len(target_ids)} (or different ones)",
                        "rebuild t2d from d2t: t2d[d2t + arange] = True")]
    return [_ok("vocab_maps", f"d2t and t2d agree on {len(target_ids)} draft tokens")]


# ----------------------------------------------------------------------------- endpoint and accept length


def check_speculative_algorithm(settings: Mapping[str, Any], who: str = "the server") -> list[Finding]:
    """The server's `speculative_algorithm` (its server info, or a planned launch through `parse_sglang_args`,
    `who` naming which): an EAGLE-3 draft needs EAGLE3; under EAGLE the draft is bypassed with no error."""
    algorithm = settings.get("speculative_algorithm")
    if not algorithm:
        return [Finding("error", "speculative_algorithm", f"{who} runs without speculative decoding",
                        "start SGLang with --speculative-algorithm EAGLE3 --speculative-draft-model-path DRAFT")]
    if str(algorithm).upper() == "EAGLE":
        return [Finding("error", "speculative_algorithm", f"{who} runs EAGLE, not EAGLE3: the target passes only its final hidden "
                        "state, fc is skipped and the EAGLE-3 draft is bypassed without any error",
                        "restart SGLang with --speculative-algorithm EAGLE3")]
    if str(algorithm).upper() != "EAGLE3":
        return [Finding("error", "speculative_algorithm", f"{who} runs {algorithm}, not EAGLE3",
                        "restart SGLang with --speculative-algorithm EAGLE3")]
    return [_ok("speculative_algorithm", f"EAGLE3 ({who})")]


def check_server_info(server_info: Mapping[str, Any], draft_dir: str | Path | None = None) -> list[Finding]:
    """SGLang server info: EAGLE3 algorithm, the served draft, and the server's own accept length."""
    findings = check_speculative_algorithm(server_info)
    served = server_info.get("speculative_draft_model_path")
    if draft_dir is not None and served and Path(str(served)).name != Path(draft_dir).name:
        findings.append(Finding("warning", "draft_model_path", f"the server serves draft {served}, not {draft_dir}",
                                "point --speculative-draft-model-path at the checked draft"))
    for rank, state in enumerate(server_info.get("internal_states") or []):
        if isinstance(state, Mapping) and state.get("avg_spec_accept_length") is not None:
            findings.extend(check_accept_length(float(state["avg_spec_accept_length"]), f"server avg_spec_accept_length (DP rank {rank})"))
    return findings


def check_accept_length(accept_length: float, source: str = "measured accept length") -> list[Finding]:
    """Warn when an accept length shows the draft being bypassed (< 1.1)."""
    if accept_length < 1.0:
        return [Finding("error", "accept_length", f"{source} {accept_length:.3f} is below 1, impossible under the bonus-token definition",
                        "check how it was computed: tokens emitted / verification steps")]
    if accept_length < BYPASS_ACCEPT_LENGTH:
        return [Finding("warning", "accept_length", f"{source} {accept_length:.3f} < {BYPASS_ACCEPT_LENGTH}: the draft is almost never "
                        "accepted (being bypassed)", "run the doctor on the draft folder and endpoint: EAGLE vs EAGLE3, tensor names, "
                        "capture layers, tie_word_embeddings")]
    return [_ok("accept_length", f"{source} {accept_length:.3f}")]


def run_doctor(
    target_config: str | Path | Mapping[str, Any],
    draft_dir: str | Path | None = None,
    endpoint: str | None = None,
    accept_length: float | None = None,
    capture_layers: Sequence[int] | None = None,
    timeout: float = 30.0,
    sglang_args: Sequence[str] | str | None = None,
) -> list[Finding]:
    """All checks that the given inputs allow; never raises for a failed check.

    target_config: the target's folder (read through target_layout: a multimodal wrapper's text_config),
    its config.json, or the dict. sglang_args: a planned SGLang launch line, checked for settings SGLang
    refuses with this draft (a live endpoint's own settings are checked too)."""
    target = _text_config(load_target_config(target_config))  # config.json read as JSON: no model code runs
    findings: list[Finding] = []
    draft_config = None
    if draft_dir is not None:
        draft_dir = Path(draft_dir)
        try:
            draft_config = load_config(draft_dir)
        except FileNotFoundError as error:  # a torn config.json raises DoctorInputError
            findings.append(Finding("error", "draft_config", str(error), "export config.json beside model.safetensors"))
        else:
            findings.extend(check_draft_config(draft_config, target, capture_layers))
            findings.extend(check_draft_weights(draft_dir / "model.safetensors", draft_config))
    if endpoint is not None:
        from eaglekit.analysis.live_serving import get_sglang_server_info

        try:
            info = get_sglang_server_info(endpoint, timeout)
        except (ConnectionError, RuntimeError) as error:
            findings.append(Finding("error", "endpoint", f"cannot read SGLang server info: {error}",
                                    "check the URL (server root or .../v1) and that it is an SGLang server"))
        else:
            findings.extend(check_server_info(info, draft_dir))
            if draft_config is not None:
                findings.extend(check_serving_settings(draft_config, target, info))
    if sglang_args is not None:  # a planned launch: checked offline, before any server runs
        planned = parse_sglang_args(sglang_args)
        findings.extend(check_speculative_algorithm(planned, who="the planned launch (--sglang-args)"))
        if draft_config is not None:
            findings.extend(check_serving_settings(draft_config, target, planned))
    # the actual settings were checked: drop the draft-only reminder
    if endpoint is not None or sglang_args is not None:
        findings = [finding for finding in findings if not (finding.check == "rejection_sampling" and finding.level == "warning")]
    if accept_length is not None:
        findings.extend(check_accept_length(accept_length))
    return findings


def findings_frame(findings: Sequence[Finding]) -> pd.DataFrame:
    return pd.DataFrame([asdict(finding) for finding in findings], columns=["level", "check", "message", "fix"])


def preflight_table(
    target_config: str | Path | Mapping[str, Any],
    draft_dir: str | Path,
    draft_label: str,
    capture_layers: Sequence[int] | None,
    accept_length: float,
) -> pd.DataFrame:
    """Stage 6's preflight as one table: the exported draft folder checked against the target (rows
    labelled `draft_label`), then the speculative loop's measured accept length (rows labelled "specdec
    loop"). Columns: folder, level, check, message, fix."""
    tables = [findings_frame(run_doctor(target_config, draft_dir=draft_dir, capture_layers=capture_layers)
                             ).assign(folder=draft_label),
              findings_frame(run_doctor(target_config, accept_length=accept_length)).assign(folder="specdec loop")]
    return pd.concat(tables, ignore_index=True)[["folder", "level", "check", "message", "fix"]]
