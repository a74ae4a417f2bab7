"""`eaglekit plan`: every shipped params file planned from params alone, the seed's figures checked against
DESIGN."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from eaglekit.config import load_params
from eaglekit.plan import format_plan, plan_run

PARAMS_DIR = Path(__file__).resolve().parents[1] / "params"
PARAMS_FILES = sorted(PARAMS_DIR.glob("*.yaml"))


@pytest.mark.parametrize("params_file", PARAMS_FILES, ids=lambda path: path.name)
def test_every_shipped_params_file_plans(params_file):
    plan = plan_run(load_params(params_file))
    text = format_plan(plan)
    for figure in (
        "KV cache",
        "capture storage per slice",
        "training memory per GPU",
        "GPU time",
        "forecast horizon",
    ):
        assert figure in text, f"{params_file.name}: no {figure!r} in the plan"
    assert {assumption.name for assumption in plan.assumptions} >= {
        "prompts",
        "tokens_per_sample",
        "answer_tokens",
    }
    assert all(assumption.source for assumption in plan.assumptions)
    sizes = load_params(params_file).training.data_sizes
    assert [row["size"] for row in plan.slices["bf16"] if row["size"] is not None] == sizes


def test_seed_plan_needs_no_weights_and_matches_design():
    """The seed's checkpoint folder is not on this machine: the plan comes from target.config alone."""
    params = load_params(PARAMS_DIR / "kimi_k25_big_run.yaml")
    assert not Path(params.target.model).exists()
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "eaglekit.cli",
            "plan",
            str(PARAMS_DIR / "kimi_k25_big_run.yaml"),
            "--json",
            "--tokens-per-sample",
            "8200",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr
    plan = json.loads(completed.stdout)
    assert plan["capacity"]["attention"] == "MLA"
    assert (
        plan["capacity"]["kv_bytes_per_token"] == 61 * 576 * 2
    )  # DESIGN: 70,272 B/token, not the naive 1.75 MB
    assert plan["target"]["stored_bytes_per_token"]["bf16"] == 4 * 7168 * 2 + 9  # features + id and mask
    first = plan["slices"]["bf16"][0]
    assert first["size"] == 5000 and first["samples"] == 5000 + params.training.heldout_size
    assert first["tokens"] == first["samples"] * 8200
    assert plan["horizon"]["full_data_size"] == 87_800
    assert {row["name"]: row["source"] for row in plan["assumptions"]}[
        "tokens_per_sample"
    ] == "--tokens-per-sample"
    short = plan["capacity"]["partitions"][0]
    assert short["recommended_concurrency"] <= short["sequences_that_fit"] < short["requested_concurrency"]
    assert plan["generation"]["gpus_per_server"] == 8 and plan["generation"]["gpu_hours"] > 0


@pytest.mark.parametrize(
    "endpoints", [[], [{"url": "http://gpu-node:30000/v1", "name": "sglang"}]], ids=["embedded", "external"]
)
def test_eaglekit_plan_and_stage_3_plan_the_same_kv_pool(monkeypatch, tmp_path, endpoints):
    """`eaglekit plan` reads the params file; stage 3 plans from the params the runner hands notebook 03, with
    the endpoints `serving_endpoints` yields (the embedded server's, named, when the file names none). Both
    must size the same pool: the embedded server's `kv_cache_tokens`, or an external server's GPU memory."""
    from eaglekit.config import params_from_sections
    from eaglekit.generation.plan import plan_generation
    from eaglekit.generation.server import EmbeddedServer, serving_endpoints
    from eaglekit.runner import notebook_parameters

    plan_settings = {"gpu_memory_gb": 80.0, "memory_fraction": 0.9, "weight_gb": 2.0}
    params = params_from_sections(
        {"server": {"kv_cache_tokens": 4096}, "endpoints": endpoints, "generation": {"plan": plan_settings}}
    )
    monkeypatch.setattr(EmbeddedServer, "start", lambda self: self)  # no process: only its endpoint is used
    monkeypatch.setattr(EmbeddedServer, "stop", lambda self: None)
    notebook = Path(__file__).resolve().parents[1] / "notebooks" / "03_generation.ipynb"
    with serving_endpoints(params) as served:
        handed = notebook_parameters(
            params,
            notebook,
            run_dir=str(tmp_path),
            endpoints=[endpoint.model_dump(mode="json") for endpoint in served],
        )
    assert bool(endpoints) != (handed["endpoints"][0]["name"] == "embedded")
    stage_params = params_from_sections({key: value for key, value in handed.items() if key != "run_dir"})
    prompts = tmp_path / "prep" / "ds" / "prompts.short.jsonl"
    prompts.parent.mkdir(parents=True)
    prompts.write_text(json.dumps({"id": "p0", "messages": [], "meta": {"prompt_tokens": 30}}) + "\n")
    staged = plan_generation(stage_params, [("ds", "short", prompts)])
    planned = plan_run(params).capacity
    assert planned["kv_pool_tokens"] == staged.kv_pool_tokens
    if endpoints:
        assert staged.kv_pool_tokens == int(80e9 * 0.9 - 2e9) // staged.kv_bytes_per_token_per_rank
        assert planned["kv_pool_source"].startswith("generation.plan: gpu_memory_gb")
    else:
        assert staged.kv_pool_tokens == 4096
        assert planned["kv_pool_source"] == "server.kv_cache_tokens (the embedded server)"
