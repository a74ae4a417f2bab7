"""Training throughput of the kit's TTT step against a naive unroll that recomputes earlier steps.

The kit's step keeps every TTT step's keys (TrainingTimeTestKeyValues), so step i costs one layer pass.
The naive version reaches step i by rerunning steps 0..i from the features each time (i+1 layer passes),
which is what a trainer without the diagonal-attention trick does. Both compute the same loss; the
script checks that before timing.

Dimensions default to the embedded target's (SmolLM2-135M: H=576, 9 heads, 3 KV heads, vocab 49,152,
draft vocab 32,000) with random weights. On CUDA (`--device cuda`) it runs under bf16 autocast and
prints achieved TFLOP/s against the device's dense bf16 peak.

    python bench/train_step.py                       # CPU, short
    python bench/train_step.py --device cuda --seq-len 2048 --batch 4
"""

from __future__ import annotations

import argparse
import time

import torch

from eaglekit.draft import DraftConfig, Eagle3DraftModel, TrainingTimeTestKeyValues, shift_left
from eaglekit.training import TargetSignals, ttt_loss

# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity) from vendor data sheets, matched on the device name.
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10G": 70.0, "RTX 4090": 165.0}


def naive_unroll(model: Eagle3DraftModel, input_ids: torch.Tensor, aux: torch.Tensor, ttt_steps: int) -> list[torch.Tensor]:
    """Step i's logits by rerunning steps 0..i from scratch: O(k^2) layer passes instead of O(k)."""
    batch, length = input_ids.shape
    positions = torch.arange(length, device=input_ids.device).expand(batch, length)
    logits = []
    for last in range(ttt_steps):
        key_values = TrainingTimeTestKeyValues()
        hidden = model.project_features(aux)
        for step in range(last + 1):
            hidden = model.step(shift_left(input_ids, 1 + step), hidden, positions + step, key_values)
        logits.append(model.logits(hidden))
    return logits


def make_inputs(config: DraftConfig, batch: int, length: int, ttt_steps: int, device: torch.device):
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, config.vocab_size, (batch, length), generator=generator).to(device)
    aux = torch.randn(batch, length, 3 * config.hidden_size, generator=generator).to(device, torch.bfloat16)
    probs = torch.softmax(torch.randn(batch, length, config.draft_vocab_size, generator=generator), -1).to(device)
    argmax = torch.randint(0, config.draft_vocab_size, (batch, length), generator=generator).to(device)
    targets = TargetSignals(probs=probs, argmax=argmax, in_draft=torch.ones(batch, length, dtype=torch.bool, device=device))
    eligible = torch.ones(ttt_steps, batch, length, dtype=torch.bool, device=device)
    return input_ids, aux, targets, eligible


def time_step(unroll, model, inputs, ttt_steps: int, repeats: int, device: torch.device) -> tuple[float, float]:
    """Seconds per training step (forward + backward), best of `repeats` after one warmup; and the loss."""
    input_ids, aux, targets, eligible = inputs
    counts = eligible.sum(dim=(1, 2)).float()
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    best, loss_value = float("inf"), 0.0
    for attempt in range(repeats + 1):
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        with autocast:
            logits = unroll(model, input_ids, aux, ttt_steps)
            loss, _ = ttt_loss(logits, targets, eligible, counts, 0.8, model.draft_to_target_ids())
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - started
        loss_value = float(loss.detach())
        if attempt > 0:  # the first run warms allocators and kernels
            best = min(best, elapsed)
    return best, loss_value


def training_flops(config: DraftConfig, batch: int, length: int, ttt_steps: int) -> float:
    """FLOPs of one kit TTT training step (forward + backward = 3x forward matmul FLOPs)."""
    hidden, heads, kv_heads, head_dim = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    per_token_layer = 2 * hidden * heads * head_dim + 2 * 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden + 3 * hidden * config.intermediate_size
    per_token_head = hidden * config.draft_vocab_size
    tokens = batch * length
    multiply_adds = tokens * 3 * hidden * hidden  # fc, once
    for step in range(ttt_steps):
        attention = heads * head_dim * 2 * (length / 2 + step)  # causal block (average T/2 keys) + step diagonals
        multiply_adds += tokens * (per_token_layer + per_token_head + attention)
    return 3 * 2 * multiply_adds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--ttt-steps", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--vocab", type=int, default=49_152)
    parser.add_argument("--draft-vocab", type=int, default=32_000)
    parser.add_argument("--skip-naive", action="store_true", help="time only the kit's step (large GPU runs)")
    args = parser.parse_args()

    device = torch.device(args.device)
    config = DraftConfig(hidden_size=args.hidden, intermediate_size=args.intermediate, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads, vocab_size=args.vocab,
                         draft_vocab_size=args.draft_vocab, max_position_embeddings=8192, rms_norm_eps=1e-5,
                         rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, target_num_hidden_layers=30,
                         capture_layer_indices=(2, 15, 27))
    torch.manual_seed(0)
    model = Eagle3DraftModel(config)
    model.set_draft_vocab(torch.zeros(args.draft_vocab, dtype=torch.int64), torch.arange(args.vocab) < args.draft_vocab)
    model.to(device)
    inputs = make_inputs(config, args.batch, args.seq_len, args.ttt_steps, device)
    tokens = args.batch * args.seq_len
    print(f"device={device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else f'{torch.get_num_threads()} CPU threads'}) "
          f"H={args.hidden} vocab={args.vocab} draft_vocab={args.draft_vocab} batch={args.batch} seq_len={args.seq_len} ttt_steps={args.ttt_steps}")

    kit_seconds, kit_loss = time_step(lambda m, i, a, k: m(i, a, k), model, inputs, args.ttt_steps, args.repeats, device)
    print(f"kit   TTT step : {kit_seconds * 1e3:9.1f} ms  {tokens / kit_seconds:10.1f} tokens/s  loss {kit_loss:.6f}")
    if not args.skip_naive:
        naive_seconds, naive_loss = time_step(naive_unroll, model, inputs, args.ttt_steps, args.repeats, device)
        print(f"naive recompute: {naive_seconds * 1e3:9.1f} ms  {tokens / naive_seconds:10.1f} tokens/s  loss {naive_loss:.6f}")
        print(f"speedup kit / naive: {naive_seconds / kit_seconds:.2f}x  (same loss: |diff| = {abs(kit_loss - naive_loss):.2e})")
    if device.type == "cuda":
        achieved = training_flops(config, args.batch, args.seq_len, args.ttt_steps) / kit_seconds / 1e12
        name = torch.cuda.get_device_name(device)
        peak = next((value for key, value in PEAK_BF16_TFLOPS.items() if key in name), None)
        share = f"{100 * achieved / peak:.1f}% of {peak:.0f} TFLOP/s dense bf16 peak" if peak else "peak unknown for this device"
        print(f"kit TTT step achieved {achieved:.1f} TFLOP/s ({share})")


if __name__ == "__main__":
    main()
