"""The capture layers: which target layers' inputs an EAGLE-3 draft takes, and the hooks that keep them.

Layer ids are indices into transformers' `output_hidden_states` tuple (0 = embeddings, i = output
of layer i-1 = input of layer i), the convention SGLang's `[2, N//2, N-3]` uses. One function
(`resolve_capture_layer_ids`) turns a configured list (or None) into the checked ids every caller uses.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn


def default_capture_layer_ids(num_hidden_layers: int) -> list[int]:
    """SGLang's EAGLE-3 layers for an N-layer target: [2, N//2, N-3] (SmolLM2-135M, N=30: [2, 15, 27])."""
    return [2, num_hidden_layers // 2, num_hidden_layers - 3]


def validate_capture_layer_ids(layer_ids: Sequence[int], num_hidden_layers: int) -> list[int]:
    """Check layer ids against the target: three distinct `output_hidden_states` indices in [0, N-1].

    Index N is not allowed: in transformers it is the output after the final norm, not a residual
    stream entering a layer, and it is stored anyway as the final hidden state.
    """
    layer_ids = [int(layer_id) for layer_id in layer_ids]
    if len(layer_ids) != 3:
        raise ValueError(f"EAGLE-3 captures exactly 3 layers, got {layer_ids}; "
                         f"the default is {default_capture_layer_ids(num_hidden_layers)}")
    if len(set(layer_ids)) != 3:
        raise ValueError(f"capture layer ids must be distinct, got {layer_ids}")
    out_of_range = [layer_id for layer_id in layer_ids if not 0 <= layer_id < num_hidden_layers]
    if out_of_range:
        raise ValueError(
            f"capture layer ids {out_of_range} are outside [0, {num_hidden_layers - 1}] for a {num_hidden_layers}-layer target "
            f"(ids index output_hidden_states: i = the residual entering layer i); "
            f"the default is {default_capture_layer_ids(num_hidden_layers)}"
        )
    return layer_ids



def resolve_capture_layer_ids(layer_ids: Sequence[int] | None, num_hidden_layers: int) -> list[int]:
    """The checked capture layers of an N-layer target: `layer_ids` as configured, or EAGLE-3's
    defaults when None."""
    return validate_capture_layer_ids(layer_ids if layer_ids is not None else default_capture_layer_ids(num_hidden_layers),
                                      num_hidden_layers)


# Where a decoder stack sits under a loaded model: a *ForCausalLM's base model, or a multimodal
# wrapper's text model (`language_model`, `language_model.model`, `model.language_model`).
_DECODER_PATHS = ("language_model.model", "language_model", "model.language_model")


def base_model_of(model: nn.Module) -> nn.Module:
    """The decoder stack under a *ForCausalLM or a wrapper (or the model itself): has `layers`, returns
    `last_hidden_state`."""
    prefix = getattr(model, "base_model_prefix", "model") or "model"
    candidates = [getattr(model, prefix, None), *(_attribute_path(model, path) for path in _DECODER_PATHS), model]
    for candidate in candidates:
        if isinstance(candidate, nn.Module) and isinstance(getattr(candidate, "layers", None), nn.ModuleList):
            return candidate
    raise TypeError(
        f"{type(model).__name__} has no decoder `layers` list under `.{prefix}` nor under {list(_DECODER_PATHS)}; "
        "capture supports Llama-style decoders (Llama, Qwen, Mistral, DeepSeek, SmolLM) and wrappers holding one"
    )


def _attribute_path(model: nn.Module, path: str) -> Any:
    for name in path.split("."):
        model = getattr(model, name, None)
        if model is None:
            return None
    return model


class LayerInputCapture:
    """Forward pre-hooks that keep the hidden states entering chosen decoder layers.

    Use as a context manager around one forward; `captured[layer_id]` is (B, T, H) on that layer's device.
    """

    def __init__(self, base_model: nn.Module, layer_ids: Sequence[int]):
        self.base_model = base_model
        self.layer_ids = list(layer_ids)
        self.captured: dict[int, torch.Tensor] = {}
        self._handles: list[Any] = []

    def _hook_for(self, layer_id: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            self.captured[layer_id] = args[0] if args else kwargs["hidden_states"]
        return hook

    def __enter__(self) -> "LayerInputCapture":
        self.captured = {}
        for layer_id in self.layer_ids:
            layer = self.base_model.layers[layer_id]
            self._handles.append(layer.register_forward_pre_hook(self._hook_for(layer_id), with_kwargs=True))
        return self

    def __exit__(self, *exc_info: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
