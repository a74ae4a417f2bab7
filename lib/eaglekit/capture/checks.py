"""Checks and summaries of a finished capture: captured samples against their source lines, feature norms,
and the subset writer the ablation's original answers are captured from."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from eaglekit.io import read_jsonl, write_jsonl


def check_captured_samples(
    captured: Sequence[dict], data_files: Mapping[str, str | os.PathLike], hidden_size: int, num_aux_layers: int = 3
) -> list[dict[str, Any]]:
    """Compare captured samples with their source lines: ids and loss mask equal (up to truncation),
    feature shapes (T, 3H)/(T, H), bf16, finite. Returns one row per sample; raises on any mismatch."""
    wanted = {(str(sample["dataset"]), str(sample["id"])) for sample in captured}
    source = {(dataset, record["id"]): (record["input_ids"], record["loss_mask"])
              for dataset, path in data_files.items() for _, record in read_jsonl(Path(path))
              if isinstance(record, dict) and (dataset, record.get("id")) in wanted}
    rows = []
    for sample in captured:
        key = (str(sample["dataset"]), str(sample["id"]))
        if key not in source:
            raise ValueError(f"captured sample {key} is not in the tokenized files {dict(data_files)}")
        input_ids, loss_mask = source[key]
        length = int(sample["input_ids"].shape[0])
        aux, final = sample["aux_hidden_states"], sample["final_hidden_states"]
        problems = []
        if sample["input_ids"].tolist() != input_ids[:length]:
            problems.append("input_ids differ from the tokenized file")
        if sample["loss_mask"].tolist() != loss_mask[:length]:
            problems.append("loss_mask differs from the tokenized file")
        if tuple(aux.shape) != (length, num_aux_layers * hidden_size) or tuple(final.shape) != (length, hidden_size):
            problems.append(f"shapes {tuple(aux.shape)}, {tuple(final.shape)} != "
                            f"({length}, {num_aux_layers * hidden_size}), ({length}, {hidden_size})")
        if aux.dtype != torch.bfloat16 or final.dtype != torch.bfloat16:
            problems.append(f"dtypes {aux.dtype}, {final.dtype} are not bfloat16")
        if not (torch.isfinite(aux.float()).all() and torch.isfinite(final.float()).all()):
            problems.append("non-finite features")
        if problems:
            raise ValueError(f"captured sample {key}: " + "; ".join(problems))
        rows.append({
            "dataset": key[0], "id": key[1], "tokens": length, "source_tokens": len(input_ids),
            "loss_tokens": int(sample["loss_mask"].sum()), "aux_shape": tuple(aux.shape), "final_shape": tuple(final.shape),
            "dtype": str(aux.dtype).removeprefix("torch."),
        })
    return rows


def feature_norms(captured: Iterable[dict], capture_layer_ids: Sequence[int]) -> dict[str, torch.Tensor]:
    """Per-token L2 norms of each captured layer's feature and of the final state, over `captured`.

    aux (T, 3H) splits into one (T, H) block per capture layer, in capture_layer_ids order.
    Returns {"layer <i>": (sum T,) float32, ..., "final": (sum T,)}.
    """
    norms: dict[str, list[torch.Tensor]] = {f"layer {layer_id}": [] for layer_id in capture_layer_ids}
    norms["final"] = []
    for sample in captured:
        blocks = sample["aux_hidden_states"].float().chunk(len(capture_layer_ids), dim=-1)  # 3 x (T, H)
        for layer_id, block in zip(capture_layer_ids, blocks):
            norms[f"layer {layer_id}"].append(block.norm(dim=-1))
        norms["final"].append(sample["final_hidden_states"].float().norm(dim=-1))
    return {name: torch.cat(parts) if parts else torch.zeros(0) for name, parts in norms.items()}


def write_sample_subset(
    data_files: Mapping[str, str | os.PathLike], keep: set[tuple[str, str]], output_dir: str | os.PathLike
) -> dict[str, Path]:
    """Copy the lines of `data_files` whose (dataset, id) is in `keep` to
    output_dir/<dataset>/tokenized_data.jsonl.

    For a chosen subset: the ablation's original answers, a staged size's class-A samples.
    Returns the new data files.
    """
    output_dir = Path(output_dir)
    written: dict[str, Path] = {}
    for dataset, path in data_files.items():
        lines = [record for _, record in read_jsonl(Path(path)) if isinstance(record, dict) and (dataset, record.get("id")) in keep]
        if not lines:
            continue
        target = output_dir / dataset / "tokenized_data.jsonl"
        target.parent.mkdir(parents=True, exist_ok=True)
        write_jsonl(target, lines)
        written[dataset] = target
    return written
