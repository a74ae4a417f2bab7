"""Run inside the venv of the real vLLM CPU build, which has speculators==0.9.0 (requirements-vllm.txt), never
the kit's.

    python speculators_probe.py EXPORT_DIR INPUTS.safetensors OUT_DIR

Loads the kit's vLLM export with speculators' own loader (`SpeculatorModel.from_pretrained`, which
resolves the verifier reference from the working directory or the hub), then writes OUT_DIR/report.json
(model class, config flags, key sets: file vs module, tensors the loader left different from the file)
and OUT_DIR/logits.safetensors (speculators' draft logits per TTT step on the given inputs).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from speculators import SpeculatorModel

# Tensors speculators' module holds that a checkpoint never carries: the loss-only verifier head/norm.
LOSS_ONLY = {"verifier_lm_head.weight", "verifier_norm.weight"}


def main(export_dir: str, inputs_path: str, out_dir: str) -> None:
    out = Path(out_dir)
    model = SpeculatorModel.from_pretrained(export_dir).eval()
    file_tensors = load_file(str(Path(export_dir) / "model.safetensors"))
    state = model.state_dict()
    differing = [
        name
        for name, tensor in file_tensors.items()
        if name in state and not torch.equal(state[name].to(tensor.dtype), tensor)
    ]
    nan_tensors = [
        name
        for name, tensor in state.items()
        if name not in LOSS_ONLY and tensor.is_floating_point() and tensor.isnan().any()
    ]
    report = {
        "model_class": type(model).__name__,
        "norm_before_residual": bool(model.config.norm_before_residual),
        "eagle_aux_hidden_state_layer_ids": list(model.config.eagle_aux_hidden_state_layer_ids or []),
        "verifier": model.config.speculators_config.verifier.name_or_path,
        "missing_from_file": sorted(set(state) - set(file_tensors) - LOSS_ONLY),
        "unexpected_in_file": sorted(set(file_tensors) - set(state)),
        "differing_from_file": differing,
        "nan_tensors": nan_tensors,
    }
    inputs = load_file(inputs_path)
    logits: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(
        lambda module, args, output: logits.append(output.detach().float())
    )
    with torch.no_grad():
        model.float()(
            hidden_states=inputs["aux_hidden_states"].float(),
            input_ids=inputs["input_ids"],
            document_ids=torch.zeros_like(inputs["input_ids"]),
            position_ids=inputs["position_ids"],
            ttt_steps=int(inputs["ttt_steps"]),
        )
    hook.remove()
    save_file(
        {f"step{index}": step[0].contiguous() for index, step in enumerate(logits)},
        str(out / "logits.safetensors"),
    )
    (out / "report.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:4])
