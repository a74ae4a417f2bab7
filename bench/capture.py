"""Capture cost, side by side in one run on the embedded target (SmolLM2-135M):

1. throughput: hook capture (`capture_batches`: forward + hooks + packing + bf16 copy to CPU) against a
   plain no-grad forward of the same decoder over the same padded batches (goal >= 0.9x); the full
   CausalLM forward (with the vocab-wide lm_head capture skips) is shown for reference;
2. peak memory of one batch: hooks against `output_hidden_states=True` (then keeping the same three
   layers and the final state). Each approach runs in a fresh subprocess. On CUDA: peak allocated
   bytes. On CPU: the process's peak resident set (VmHWM) during the forward, reset just before it
   through /proc/self/clear_refs, minus the resident set at that point; torch's large CPU buffers are
   mmapped by the allocator and returned on free, so RSS follows live tensors (tracemalloc does not
   see torch's allocations, so it is not used);
3. bytes per stored token of real shards (`capture_to_shards`) against the planner's 4H x 2 formula.

    python bench/capture.py                      # a few hundred tokens; minutes on a busy shared 2-core CPU
    python bench/capture.py --samples 64 --min-length 256 --max-length 2048 --max-tokens-per-batch 8192 \
        --device cuda
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from eaglekit.generation.capacity import hidden_state_bytes_per_token
from eaglekit.capture import (
    TokenizedSample,
    base_model_of,
    capture_batch,
    capture_batches,
    capture_to_shards,
    default_capture_layer_ids,
    load_target,
    plan_batches,
)
from eaglekit.capture.shards import INDEX_FILE


# Shapes for random-weight stand-ins where the real checkpoint cannot travel (a GPU machine with no hub):
# throughput, memory and bytes per token depend on the shapes, not on the weights.
RANDOM_SHAPES = {
    "smollm2-135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
        rope_theta=100000.0,
    ),
    "llama-3.1-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=False,
        max_position_embeddings=131072,
        rope_theta=500000.0,
    ),
}


def build_model(arguments: argparse.Namespace) -> tuple[torch.nn.Module, str]:
    """The target (or a random-weight model of a named shape) in eval mode, and a description of it."""
    dtype = getattr(torch, arguments.dtype)
    if arguments.random_like is None:
        return load_target(arguments.model, device=arguments.device, dtype=dtype), str(arguments.model)
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(arguments.seed)
    with torch.device(arguments.device):
        model = AutoModelForCausalLM.from_config(
            LlamaConfig(**RANDOM_SHAPES[arguments.random_like]), dtype=dtype
        )
    model.eval()
    model.requires_grad_(False)
    return model, f"random weights shaped like {arguments.random_like}"


def make_samples(
    count: int, min_length: int, max_length: int, vocab_size: int, seed: int
) -> list[TokenizedSample]:
    generator = random.Random(seed)
    samples = []
    for number in range(count):
        length = generator.randint(min_length, max_length)
        input_ids = [generator.randrange(vocab_size) for _ in range(length)]
        loss_mask = [int(position >= length // 3) for position in range(length)]
        samples.append(
            TokenizedSample(f"bench-{number}", "bench", input_ids, loss_mask, "memory", number + 1, length)
        )
    return samples


def padded_inputs(samples: list[TokenizedSample], device: torch.device) -> dict[str, torch.Tensor]:
    """The same right-padded (B, T) tensors capture_batch builds."""
    padded_length = max(len(sample.input_ids) for sample in samples)
    input_ids = torch.zeros(len(samples), padded_length, dtype=torch.long)
    attention_mask = torch.zeros(len(samples), padded_length, dtype=torch.long)
    for row, sample in enumerate(samples):
        input_ids[row, : len(sample.input_ids)] = torch.tensor(sample.input_ids)
        attention_mask[row, : len(sample.input_ids)] = 1
    position_ids = torch.arange(padded_length).unsqueeze(0).expand(len(samples), -1)
    has_padding = bool((attention_mask == 0).any())
    return {
        "input_ids": input_ids.to(device),
        "attention_mask": attention_mask.to(device) if has_padding else None,
        "position_ids": position_ids.to(device),
    }


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_output_hidden_states(
    model: torch.nn.Module, samples: list[TokenizedSample], layer_ids: list[int]
) -> None:
    """The usual alternative: ask for every layer's output, keep three plus the final state."""
    base_model = base_model_of(model)
    inputs = padded_inputs(samples, base_model.get_input_embeddings().weight.device)
    with torch.inference_mode():
        outputs = base_model(**inputs, use_cache=False, output_hidden_states=True)
        aux = (
            torch.cat([outputs.hidden_states[layer_id] for layer_id in layer_ids], dim=-1)
            .to(torch.bfloat16)
            .cpu()
        )
        final = outputs.last_hidden_state.to(torch.bfloat16).cpu()
    del aux, final


def resident_bytes(field: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def memory_probe(arguments: argparse.Namespace) -> None:
    """Subprocess body: load, build the batch, reset the peak, run one approach, print the peak delta."""
    model, _ = build_model(arguments)
    samples = make_samples(
        arguments.samples, arguments.min_length, arguments.max_length, model.config.vocab_size, arguments.seed
    )
    batch = max(
        plan_batches([len(s.input_ids) for s in samples], arguments.max_tokens_per_batch),
        key=lambda positions: len(positions) * max(len(samples[p].input_ids) for p in positions),
    )
    batch_samples = [samples[position] for position in batch]
    layer_ids = default_capture_layer_ids(model.config.num_hidden_layers)
    # Warm-up on one short sample: the weights are mmapped from safetensors and only become resident
    # when first touched, which would otherwise count the whole model as "peak over the loaded model".
    capture_batch(model, [TokenizedSample("warm", "bench", [1, 2, 3], [1, 1, 1], "memory", 0, 3)], layer_ids)
    if arguments.device.startswith("cuda"):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")  # resets VmHWM to the current resident set
        before = resident_bytes("VmRSS")
    if arguments.memory_probe == "hooks":
        captured = capture_batch(model, batch_samples, layer_ids)
        del captured
    else:
        run_output_hidden_states(model, batch_samples, layer_ids)
    if arguments.device.startswith("cuda"):
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = resident_bytes("VmHWM") - before
    tokens = sum(len(sample.input_ids) for sample in batch_samples)
    padded = len(batch_samples) * max(len(sample.input_ids) for sample in batch_samples)
    print(json.dumps({"peak_bytes": peak, "tokens": tokens, "padded_tokens": padded}))


def measure_memory(arguments: argparse.Namespace, approach: str) -> dict:
    command = [sys.executable, __file__, "--memory-probe", approach, "--model", str(arguments.model)]
    if arguments.random_like:
        command += ["--random-like", arguments.random_like]
    for name in ("samples", "min_length", "max_length", "max_tokens_per_batch", "seed", "device", "dtype"):
        command += [f"--{name.replace('_', '-')}", str(getattr(arguments, name))]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"memory probe {approach} failed:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def print_storage_plan(params_path: str, tokens_per_sample: float) -> None:
    """Per-slice bytes of a params file's capture in training.data_sizes' order, bf16 beside fp8."""
    from eaglekit.capture.plan import planned_slice_bytes
    from eaglekit.capture.shards import stored_bytes_per_token
    from eaglekit.capture.stage import capture_length
    from eaglekit.config import load_params

    params = load_params(params_path)
    config = params.target.config or {}
    text = config.get("text_config", config)
    hidden, layers = int(text["hidden_size"]), int(text["num_hidden_layers"])
    sizes, heldout = params.training.data_sizes, params.training.heldout_size
    total = heldout + sizes[-1]
    tokens = min(tokens_per_sample, capture_length(params))
    print(
        f"{params_path}: {layers} layers, hidden {hidden}; capture.engine {params.capture.engine} "
        f"(TP{params.capture.tensor_parallel}, DP{params.capture.data_parallel}); "
        f"{total:,} samples x {tokens:,.0f} tokens (capture stops at {capture_length(params):,} = "
        "min(capture.max_seq_len, training.max_length))"
    )
    for dtype in ("bf16", "fp8"):
        print(
            f"  {dtype}: {stored_bytes_per_token(hidden, dtype):,} B/token "
            f"(features {stored_bytes_per_token(hidden, dtype) - 9:,} + id and mask 9)"
        )
        for row in planned_slice_bytes(sizes, heldout, total, tokens, hidden, dtype):
            label = f"size {row['size']:>7,}" if row["size"] is not None else "untrained   "
            print(
                f"    slice {label}: {row['samples']:>7,} samples {row['tokens'] / 1e6:>9,.1f} M tokens "
                f"{row['bytes'] / 1e12:7.2f} TB  (disk holds "
                f"{row['cumulative_bytes'] / 1e12:7.2f} TB once it is in)"
            )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2-135M)")
    parser.add_argument(
        "--random-like",
        choices=sorted(RANDOM_SHAPES),
        default=None,
        help="random weights of this shape instead of --model (for machines without the checkpoint)",
    )
    parser.add_argument("--samples", type=int, default=6)
    parser.add_argument("--min-length", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--max-tokens-per-batch", type=int, default=128)
    parser.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="timed passes per approach, interleaved; the median is reported",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    parser.add_argument("--memory-probe", choices=["hooks", "output_hidden_states"], help=argparse.SUPPRESS)
    parser.add_argument(
        "--storage-plan",
        metavar="PARAMS",
        help="print the per-slice bytes of a params file's run "
        "(bf16 and fp8, from --tokens-per-sample) and exit; e.g. params/kimi_k25_big_run.yaml",
    )
    parser.add_argument(
        "--tokens-per-sample",
        type=float,
        default=8192.0,
        help="mean captured tokens per sample for --storage-plan (the seed run: "
        "~720M tokens / 87,800 samples)",
    )
    arguments = parser.parse_args()
    if arguments.storage_plan:
        print_storage_plan(arguments.storage_plan, arguments.tokens_per_sample)
        return
    if arguments.dtype is None:
        arguments.dtype = "bfloat16" if arguments.device.startswith("cuda") else "float32"
    if arguments.model is None and arguments.random_like is None:
        from eaglekit.target import resolve_model

        arguments.model = resolve_model("embedded:smollm2-135m-instruct")
    if arguments.memory_probe:
        memory_probe(arguments)
        return

    model, description = build_model(arguments)
    hidden_size = model.config.hidden_size
    layer_ids = default_capture_layer_ids(model.config.num_hidden_layers)
    samples = make_samples(
        arguments.samples, arguments.min_length, arguments.max_length, model.config.vocab_size, arguments.seed
    )
    batches = [
        [samples[p] for p in batch]
        for batch in plan_batches([len(s.input_ids) for s in samples], arguments.max_tokens_per_batch)
    ]
    tokens = sum(len(sample.input_ids) for sample in samples)
    padded = sum(len(batch) * max(len(s.input_ids) for s in batch) for batch in batches)
    base_model = base_model_of(model)
    device = base_model.get_input_embeddings().weight.device
    print(
        f"model {description} ({model.config.num_hidden_layers} layers, H={hidden_size}), "
        f"{arguments.device} {arguments.dtype}, "
        f"torch threads {torch.get_num_threads()}, capture layers {layer_ids}"
    )
    print(
        f"{len(samples)} samples, {tokens} tokens in {len(batches)} batches ({padded} padded tokens, "
        f"budget {arguments.max_tokens_per_batch})"
    )

    def plain_decoder_forward() -> None:
        with torch.inference_mode():
            for batch in batches:
                base_model(**padded_inputs(batch, device), use_cache=False)

    def plain_causal_lm_forward() -> None:
        with torch.inference_mode():
            for batch in batches:
                model(**padded_inputs(batch, device), use_cache=False)

    def hook_capture() -> None:
        for _ in capture_batches(model, batches, layer_ids):
            pass

    approaches = {
        "plain decoder forward": plain_decoder_forward,
        "hook capture": hook_capture,
        "plain CausalLM forward (lm_head over vocab)": plain_causal_lm_forward,
    }
    hook_capture()  # warm-up: first-call allocations and lazy initialization
    seconds: dict[str, list[float]] = {name: [] for name in approaches}
    cpu_seconds: dict[str, list[float]] = {name: [] for name in approaches}
    for _ in range(arguments.repeats):
        for name, run in approaches.items():  # interleaved so a busy neighbour slows all approaches alike
            synchronize(arguments.device)
            started, cpu_started = time.perf_counter(), time.process_time()
            run()
            synchronize(arguments.device)
            seconds[name].append(time.perf_counter() - started)
            cpu_seconds[name].append(time.process_time() - cpu_started)
    median = {name: statistics.median(values) for name, values in seconds.items()}
    cpu_median = {name: statistics.median(values) for name, values in cpu_seconds.items()}
    for name, value in median.items():
        print(
            f"throughput {name:45s} {tokens / value:9.1f} tokens/s wall (median of {arguments.repeats}: "
            f"{value:.2f}s wall, {cpu_median[name]:.2f}s process CPU)"
        )
    plain, lm_head = "plain decoder forward", "plain CausalLM forward (lm_head over vocab)"
    # On a shared CPU, wall time depends on the neighbours; process CPU time counts this process's work only.
    print(
        "throughput ratio hook capture / plain decoder forward = "
        f"{median[plain] / median['hook capture']:.3f} wall, "
        f"{cpu_median[plain] / cpu_median['hook capture']:.3f} CPU time (goal >= 0.9)"
    )
    print(
        "throughput ratio hook capture / plain CausalLM forward = "
        f"{median[lm_head] / median['hook capture']:.3f} wall, "
        f"{cpu_median[lm_head] / cpu_median['hook capture']:.3f} CPU time"
    )

    memory = {approach: measure_memory(arguments, approach) for approach in ("hooks", "output_hidden_states")}
    how = (
        "peak CUDA allocated"
        if arguments.device.startswith("cuda")
        else "peak RSS (VmHWM after clear_refs) in a fresh process"
    )
    for approach, result in memory.items():
        print(
            f"memory {approach:22s} {result['peak_bytes'] / 2**20:8.1f} MiB over the loaded model, "
            f"one batch of {result['tokens']} tokens ({result['padded_tokens']} padded); {how}"
        )
    print(
        "memory ratio hooks / output_hidden_states = "
        f"{memory['hooks']['peak_bytes'] / max(memory['output_hidden_states']['peak_bytes'], 1):.3f}"
    )

    with tempfile.TemporaryDirectory() as folder:
        folder_path = Path(folder)
        data_path = folder_path / "tokenized_data.jsonl"
        with open(data_path, "w") as handle:
            for sample in samples:
                handle.write(
                    json.dumps(
                        {
                            "id": sample.id,
                            "input_ids": sample.input_ids,
                            "loss_mask": sample.loss_mask,
                            "source": "bench",
                            "meta": {},
                        }
                    )
                    + "\n"
                )
        started = time.perf_counter()
        report = capture_to_shards(
            model,
            {"bench": data_path},
            folder_path / "shards",
            model_name=description,
            max_seq_len=arguments.max_length,
            max_tokens_per_batch=arguments.max_tokens_per_batch,
            progress=False,
        )
        elapsed = time.perf_counter() - started
        shard_bytes = sum(
            path.stat().st_size for path in (folder_path / "shards").glob("shard-*.safetensors")
        )
        index_bytes = (folder_path / "shards" / INDEX_FILE).stat().st_size
    formula = hidden_state_bytes_per_token(hidden_size, dtype_bytes=2)
    print(
        f"end-to-end capture_to_shards: {report.captured_tokens / elapsed:.1f} tokens/s "
        f"({report.shards_written} shards, {elapsed:.2f}s)"
    )
    print(
        f"bytes per stored token: shards {shard_bytes / report.captured_tokens:.1f} B vs formula 4H x 2 = "
        f"{formula} B (ratio {shard_bytes / report.captured_tokens / formula:.4f}; +9 B/token int64 id and "
        "uint8 mask, + safetensors header); "
        f"index.json adds {index_bytes / report.captured_tokens:.1f} B/token"
    )


if __name__ == "__main__":
    main()
