"""Params: one YAML per scenario -> a frozen, validated `Params` object.

Flow (one way): `params/<scenario>.yaml` -> runner -> papermill parameters (one per section) ->
`params_from_sections(...)` in each notebook's validation cell. Unknown keys and wrong types fail
loudly with the key path, the file and, for YAML files, the line.

Secrets are never params: an endpoint names the environment variable that holds its API key
(`api_key_env`), so keys never reach papermill parameters or `outputs/`.

Relative paths inside params are relative to the repository root.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from eaglekit.paths import REPO_ROOT


class ParamsError(ValueError):
    """Invalid params: names the file, the key path and (for YAML) the line."""


class Section(BaseModel):
    # strict: "3" is not an int and "1e-4" is not a float (PyYAML reads 1e-4 as a string: write 1.0e-4).
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class RunParams(Section):
    name: str = "interactive"  # names the run folder: outputs/<timestamp>-<name>
    seed: int = 0  # one seed for sampling, splits and training
    outputs_dir: str = "outputs"  # where run folders go (relative to the repository root)


class TargetParams(Section):
    model: str = "embedded:smollm2-135m-instruct"  # embedded:<name>, a local folder, or a hub id
    revision: str | None = None  # hub revision, for hub ids only
    trust_remote_code: bool = False  # run code shipped with a hub model: only for models you trust
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # bfloat16 on GPU
    context_length: int | None = Field(default=None, gt=0)  # None: the model's max_position_embeddings
    capture_layers: list[int] | None = None  # None: EAGLE-3's [2, N//2, N-3]
    config: dict[str, Any] | None = None  # a config.json as a dict, for planning a model not on disk


class ServerParams(Section):
    embedded: bool = True  # start the kit's server (transformers serve) when `endpoints` is empty
    startup_timeout_s: float = Field(default=300.0, gt=0)
    continuous_batching: bool = True  # measured: ~6x throughput at concurrency 16 on 2 cores
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # KV-cache capacity in tokens (>= concurrency x (prompt + max_tokens)). Bounded on purpose:
    # unbounded, the server claims most of the machine's free memory.
    kv_cache_tokens: int = Field(default=32768, gt=0)


class EndpointParams(Section):
    url: str  # OpenAI-compatible base URL, e.g. http://10.0.0.5:30000/v1
    name: str | None = None  # label in logs and records; default: the URL
    model: str | None = None  # served model name; None: the first one /v1/models lists
    api_key_env: str | None = None  # NAME of the environment variable holding the key (never the key)
    concurrency: int | None = Field(default=None, gt=0)  # cap for this endpoint; None: the partition's

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        if not url.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return url.rstrip("/")

    def api_key(self) -> str:
        """The key from the environment at call time; never stored."""
        if self.api_key_env is None:
            return "EMPTY"
        key = os.environ.get(self.api_key_env)
        if not key:
            raise ParamsError(f"endpoint {self.label}: environment variable {self.api_key_env} is not set")
        return key

    @property
    def label(self) -> str:
        return self.name or self.url


class Params(Section):
    run: RunParams = RunParams()
    target: TargetParams = TargetParams()
    server: ServerParams = ServerParams()
    endpoints: list[EndpointParams] = []  # empty: the embedded server (when server.embedded)

    @classmethod
    def section_names(cls) -> list[str]:
        return list(cls.model_fields)

    def sections(self) -> dict[str, Any]:
        """Plain JSON-able dict per section: what the runner passes to papermill."""
        return self.model_dump(mode="json")


def _yaml_lines(text: str) -> dict[tuple, int]:
    """Map each key path in a YAML document to its 1-based line, for error messages."""
    lines: dict[tuple, int] = {}

    def walk(node: yaml.Node, path: tuple) -> None:
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                child = path + (key_node.value,)
                lines[child] = key_node.start_mark.line + 1
                walk(value_node, child)
        elif isinstance(node, yaml.SequenceNode):
            for index, item in enumerate(node.value):
                lines[path + (index,)] = item.start_mark.line + 1
                walk(item, path + (index,))

    try:
        root = yaml.compose(text)
    except yaml.YAMLError:
        return lines
    if root is not None:
        walk(root, ())
    return lines


def _format_errors(error: ValidationError, origin: str, lines: dict[tuple, int]) -> str:
    messages = []
    for item in error.errors():
        location = tuple(item["loc"])
        key = ".".join(str(part) for part in location) or "(top level)"
        line = next((lines[location[:n]] for n in range(len(location), 0, -1) if location[:n] in lines), None)
        where = f"{origin}:{line}" if line else origin
        if item["type"] == "extra_forbidden":
            messages.append(f"{where}: unknown key {key!r}")
        else:
            messages.append(f"{where}: key {key!r}: {item['msg']} (got {item.get('input')!r})")
    return "invalid params:\n  " + "\n  ".join(messages)


def params_from_sections(sections: dict[str, Any], origin: str = "notebook parameters", lines: dict | None = None) -> Params:
    """Validate a dict of sections; `None` or `{}` for a section means its defaults."""
    cleaned = {name: value for name, value in sections.items() if value not in (None, {})}
    try:
        return Params.model_validate(cleaned)
    except ValidationError as error:
        raise ParamsError(_format_errors(error, origin, lines or {})) from None


def load_params(path: str | os.PathLike) -> Params:
    """Read and validate a params YAML file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ParamsError(f"params file {path} not found (scenarios live in {REPO_ROOT / 'params'})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        # The context mark is where the broken construct began, usually the line to fix.
        mark = getattr(error, "context_mark", None) or getattr(error, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ParamsError(f"{where}: not valid YAML: {getattr(error, 'problem', error)}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ParamsError(f"{path}: the top level must be a mapping of sections ({', '.join(Params.section_names())})")
    return params_from_sections(data, origin=str(path), lines=_yaml_lines(text))


def repo_path(path: str | os.PathLike) -> Path:
    """A params path made absolute: relative paths are relative to the repository root."""
    path = Path(path).expanduser()
    return path if path.is_absolute() else REPO_ROOT / path


def dump_params(params: Params) -> str:
    return yaml.safe_dump(params.sections(), sort_keys=False, allow_unicode=True)
