"""The vLLM export loads in speculators' own loader with every tensor used, and speculators' forward
equals the kit's on the same inputs.

speculators 0.9.0 runs in the venv of the real vLLM CPU build (`make vllm-env`, requirements-vllm.txt;
the `vllm_python` fixture builds it once and skips, with the install's reason, only where it cannot install).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eaglekit.draft.export import export_vllm, load_export
from eaglekit.draft.model import build_draft_from_target, load_target_head_weights, shift_left
from eaglekit.target import target_layout
from support import randomize_norms, tiny_target_folder

HERE = Path(__file__).parent
PROBE = HERE / "speculators_probe.py"


@pytest.fixture(scope="module")
def speculators_run(tmp_path_factory, vllm_python):
    """Export a tiny draft for vLLM, run speculators' loader and forward on it; return both sides."""
    python = str(vllm_python)
    root = tmp_path_factory.mktemp("speculators")
    # The verifier reference is the target folder's name: run speculators where that name resolves.
    target = tiny_target_folder("llama", root / "tiny-llama")
    head = load_target_head_weights(target)
    vocab = 256
    # Distinct capture layers: speculators refuses repeated ids (a 6-layer target's default is [2, 3, 3]).
    draft = build_draft_from_target(
        head,
        torch.zeros(vocab, dtype=torch.int64),
        torch.arange(head.config.vocab_size) < vocab,
        capture_layer_indices=(1, 3, 5),
        seed=3,
    )
    randomize_norms(draft)
    export = export_vllm(draft, target_layout(target), root / "export", dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    length, ttt_steps = (
        128,
        3,
    )  # one flex-attention block: speculators (default flex attention) crops its mask per step
    input_ids = torch.randint(0, vocab, (1, length), generator=generator)
    features = torch.randn(1, length, 3 * head.config.hidden_size, generator=generator)
    positions = torch.arange(length)[None]
    # speculators' step 0 embeds the tokens it is given; the kit's embeds input_ids shifted by one.
    save_file(
        {
            "input_ids": shift_left(input_ids, 1).contiguous(),
            "aux_hidden_states": features,
            "position_ids": positions.contiguous(),
            "ttt_steps": torch.tensor(ttt_steps),
        },
        str(root / "inputs.safetensors"),
    )
    result = subprocess.run(
        [python, str(PROBE), str(export), str(root / "inputs.safetensors"), str(root)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((root / "report.json").read_text())
    theirs = load_file(str(root / "logits.safetensors"))
    kit = load_export(export).eval()
    with torch.no_grad():
        ours = kit(input_ids, features, ttt_steps, position_ids=positions)
    return report, [theirs[f"step{index}"] for index in range(ttt_steps)], [step[0] for step in ours]


def test_speculators_loads_every_tensor_of_the_vllm_export(speculators_run):
    report, _, _ = speculators_run
    assert report["model_class"] == "Eagle3DraftModel"
    assert report["missing_from_file"] == []  # nothing left at its random (or NaN) initialization
    assert report["unexpected_in_file"] == []  # nothing in the file the module ignored
    assert (
        report["differing_from_file"] == []
    )  # the loader kept the file's values (the verifier did not overwrite them)
    assert report["nan_tensors"] == []
    assert report["norm_before_residual"] is False
    assert report["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]
    assert report["verifier"] == "tiny-llama"


def test_speculators_forward_equals_the_kits(speculators_run):
    _, theirs, ours = speculators_run
    for step, (their_logits, our_logits) in enumerate(zip(theirs, ours)):
        difference = (their_logits - our_logits).abs().max().item()
        print(f"TTT step {step}: max |speculators - kit| logits = {difference:.2e}")
        torch.testing.assert_close(their_logits, our_logits, atol=1e-4, rtol=1e-4)
