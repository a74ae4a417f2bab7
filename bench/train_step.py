"""Training-step throughput, side by side in one run: the kit's step against the naive recompute reference.

Three implementations of the same training step (teacher, TTT unroll, loss, backward) on the same
variable-length samples:

- naive recompute: right-padded batches; TTT step i reached by rerunning steps 0..i from the features
  (i+1 layer passes), what a trainer without the diagonal-attention trick does; full-vocab teacher
  logits and all (T x Vd) logits of every step materialized (eaglekit.training.ttt_loss).
- padded TTT (the kit before packing): padded batches, one layer pass per TTT step with the kept keys,
  the same full-logit loss.
- kit: samples packed into fixed `--pack-tokens` rows with a document mask (eaglekit.training.packing), the
  head and loss chunked over the rows that can count (eaglekit.draft.head_loss), teacher chunked.

All three must give the same loss (checked and printed). Per implementation it prints tokens/s over
real (non-padding) tokens, achieved model TFLOP/s (model FLOPs: fc once, one layer pass and the head
per TTT step, attention over each sample's own causal block; forward + backward = 3x forward) and
its share of the device's dense bf16 peak (CUDA; unknown for a CPU), the ratio to the naive
reference, and memory per token: on CUDA the peak allocated bytes of the step; on a CPU the bytes
autograd keeps for backward (distinct storages, measured with saved-tensor hooks).
Timings are the median of `--repeats` rounds after one warmup, with min-max spread; each round times
every implementation once, in turn, so load from other processes hits all of them alike.

    # CPU, SmolLM2-135M-shaped draft (1 thread on a shared machine)
    python bench/train_step.py --threads 1
    python bench/train_step.py --device cuda --preset llama8b --pack-tokens 4096 --samples 16 --skip-naive \
        --checkpointing
    # activation memory of a 16K-token pack at hidden 7168, with and without checkpointing
    python bench/train_step.py --memory-plan

--checkpointing adds a row: the kit's step with each TTT step recomputed in backward
(eaglekit.training.unroll), the same loss, less memory, about one more forward of the layer.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch

from eaglekit.draft.model import DraftConfig, Eagle3DraftModel, TrainingTimeTestKeyValues, shift_left
from eaglekit.draft.head_loss import chunked_ttt_loss
from eaglekit.training.packing import packed_micro_batches, padding_share
from eaglekit.training import Batch, collate, eligible_rows, target_signals, ttt_loss
from eaglekit.training.unroll import CheckpointedDraft

# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity) from vendor data sheets, matched on the device name.
PEAK_BF16_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
    "L4": 121.0,
    "A10G": 70.0,
    "RTX 4090": 165.0,
}

# Draft shapes: one layer of the target (hidden, intermediate, heads, KV heads, head_dim, target vocab).
PRESETS = {
    "smollm2": dict(hidden=576, intermediate=1536, heads=9, kv_heads=3, head_dim=64, vocab=49_152),
    "llama8b": dict(hidden=4096, intermediate=14_336, heads=32, kv_heads=8, head_dim=128, vocab=128_256),
}


def naive_unroll(model: Eagle3DraftModel, batch: Batch, ttt_steps: int) -> list[torch.Tensor]:
    """Step i's logits by rerunning steps 0..i from scratch: O(k^2) layer passes instead of O(k)."""
    logits = []
    for last in range(ttt_steps):
        key_values = TrainingTimeTestKeyValues(batch.document_ids, "eager")
        hidden = model.project_features(batch.aux_hidden_states)
        for step in range(last + 1):
            tokens = shift_left(batch.input_ids, 1 + step, document_ids=batch.document_ids)
            hidden = model.step(tokens, hidden, batch.position_ids + step, key_values)
        logits.append(model.logits(hidden))
    return logits


def padded_step(model, batch, eligible, counts, head, ttt_steps, naive: bool):
    targets = target_signals(
        batch.final_hidden_states, head, model.draft_to_target_ids(), model.t2d, chunk_rows=1 << 30
    )
    logits = (
        naive_unroll(model, batch, ttt_steps)
        if naive
        else model(batch.input_ids, batch.aux_hidden_states, ttt_steps)
    )
    return ttt_loss(
        logits, targets, eligible.to(batch.input_ids.device), counts, 0.8, model.draft_to_target_ids()
    )[0]


def packed_step(model, batch, eligible, counts, head, ttt_steps):
    targets = target_signals(
        batch.final_hidden_states,
        head,
        model.draft_to_target_ids(),
        model.t2d,
        lengths=batch.lengths.tolist(),
    )
    states = model(
        batch.input_ids,
        batch.aux_hidden_states,
        ttt_steps,
        batch.position_ids,
        batch.document_ids,
        return_normed_states=True,
    )
    return chunked_ttt_loss(model, states, targets, eligible, counts, 0.8)[0]


def checkpointed_step(model, batch, eligible, counts, head, ttt_steps):
    targets = target_signals(
        batch.final_hidden_states,
        head,
        model.draft_to_target_ids(),
        model.t2d,
        lengths=batch.lengths.tolist(),
    )
    states = CheckpointedDraft(model)(
        batch.input_ids,
        batch.aux_hidden_states,
        ttt_steps,
        batch.position_ids,
        batch.document_ids,
        return_normed_states=True,
    )
    return chunked_ttt_loss(model, states, targets, eligible, counts, 0.8)[0]


# The seed scenario's target (Kimi-K2.5's text config) for the memory figure.
KIMI_K25_TEXT = dict(
    hidden_size=7168,
    intermediate_size=18432,
    num_hidden_layers=61,
    num_attention_heads=64,
    num_key_value_heads=64,
    vocab_size=163840,
    max_position_embeddings=262144,
    rms_norm_eps=1e-6,
)


def print_memory_plan(pack_tokens: int = 16_384, ttt_steps: int = 7, gpu_memory_bytes: float = 141e9) -> None:
    """Training memory of one pack at hidden 7168 (Kimi-K2.5's draft), with and without
    activation checkpointing."""
    from eaglekit.training.memory import plan_training_memory

    print(
        "training memory, Kimi-K2.5-shaped draft (hidden 7168, 64 heads, draft vocab 32,000), "
        f"one {pack_tokens:,}-token pack, TTT {ttt_steps}, flex attention, bf16 activations, "
        f"one H200 ({gpu_memory_bytes / 1e9:.0f} GB, 90% usable), DDP:"
    )
    for checkpointing in (False, True):
        plan = plan_training_memory(
            {"text_config": KIMI_K25_TEXT},
            gpu_memory_bytes=gpu_memory_bytes,
            pack_tokens=pack_tokens,
            ttt_steps=ttt_steps,
            activation_checkpointing=checkpointing,
        )
        activations = plan.activation_bytes_per_token * pack_tokens
        print(
            f"  checkpointing {'on ' if checkpointing else 'off'}: activations {activations / 1e9:6.1f} GB "
            f"({plan.activation_bytes_per_token / 1e3:,.0f} KB/token), "
            f"teacher probs {plan.teacher_bytes_per_token * pack_tokens / 1e9:.1f} GB, model state + teacher "
            f"head {(plan.model_state_bytes + plan.teacher_head_bytes) / 1e9:.1f} GB, "
            f"total {plan.total_bytes / 1e9:.1f} GB ({'fits' if plan.fits else 'does not fit'}); "
            f"largest pack {plan.largest_pack_tokens:,} tokens"
        )


def make_samples(count: int, max_length: int, config: DraftConfig, seed: int) -> list[dict]:
    """Chat-like samples: lengths log-uniform in [max_length/8, max_length], the first 10-50%
    a prompt (loss_mask 0)."""
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for index in range(count):
        length = int(
            torch.exp(torch.empty(1).uniform_(0, 1, generator=generator) * torch.log(torch.tensor(8.0)))
            * max_length
            / 8
        )
        prompt = int(length * (0.1 + 0.4 * float(torch.rand(1, generator=generator))))
        loss_mask = torch.zeros(length, dtype=torch.int64)
        loss_mask[prompt:] = 1
        samples.append(
            {
                "id": f"bench-{index}",
                "input_ids": torch.randint(0, config.vocab_size, (length,), generator=generator),
                "loss_mask": loss_mask,
                "aux_hidden_states": torch.randn(length, 3 * config.hidden_size, generator=generator).to(
                    torch.bfloat16
                ),
                "final_hidden_states": torch.randn(length, config.hidden_size, generator=generator).to(
                    torch.bfloat16
                ),
            }
        )
    return samples


def model_flops(config: DraftConfig, lengths: list[int], counted_rows: int, ttt_steps: int) -> float:
    """Model FLOPs of one training step over samples of `lengths` (forward + backward = 3x forward).

    Per token and TTT step: q/k/v (2H inputs), o, SwiGLU MLP, attention over its own causal block
    plus one diagonal key per earlier step; fc once per token; the draft head on the rows that count
    (`counted_rows`, all steps); the teacher (full target vocab) once per token, forward only.
    """
    hidden, heads, kv_heads, head_dim = (
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
    )
    per_token_layer = (
        2 * hidden * heads * head_dim
        + 2 * 2 * hidden * kv_heads * head_dim
        + heads * head_dim * hidden
        + 3 * hidden * config.intermediate_size
    )
    tokens = sum(lengths)
    multiply_adds = tokens * 3 * hidden * hidden + counted_rows * hidden * config.draft_vocab_size
    for step in range(ttt_steps):
        attention_pairs = sum(length * (length + 1) / 2 for length in lengths) + step * tokens
        multiply_adds += tokens * per_token_layer + 2 * heads * head_dim * attention_pairs
    teacher = tokens * hidden * config.vocab_size
    return 3 * 2 * multiply_adds + 2 * teacher


@dataclass
class Measurement:
    seconds: list[float]
    loss: float
    saved_bytes: int
    peak_bytes: int | None


def saved_for_backward_bytes(run) -> tuple[torch.Tensor, int]:
    """Run `run()` (returns a loss) and count the distinct storages autograd keeps for backward."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = run()
    return loss, sum(storages.values())


class Variant:
    """One implementation on its micro-batches: one optimizer step's worth (forward + backward each)."""

    def __init__(self, step_fn, model, batches, head, ttt_steps: int, device: torch.device, bf16: bool):
        self.step_fn, self.model, self.head, self.ttt_steps, self.device = (
            step_fn,
            model,
            head,
            ttt_steps,
            device,
        )
        self.eligible = [eligible_rows(batch, ttt_steps) for batch in batches]
        self.counts = torch.stack([rows.sum(dim=(1, 2)) for rows in self.eligible]).sum(0).float().to(device)
        self.batches = [batch.to(device) for batch in batches]
        self.autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)
        self.result = Measurement([], 0.0, 0, None)

    def run(self, timed: bool) -> None:
        cuda = self.device.type == "cuda"
        self.model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            baseline = torch.cuda.memory_allocated()
        started = time.perf_counter()
        loss_total = 0.0
        for batch, rows in zip(self.batches, self.eligible):
            step = lambda batch=batch, rows=rows: self.step_fn(
                self.model, batch, rows, self.counts, self.head, self.ttt_steps
            )
            with self.autocast():
                if (
                    not timed and not cuda
                ):  # the CPU warmup also counts what autograd keeps (compiled kernels skip hooks)
                    loss, saved = saved_for_backward_bytes(step)
                    self.result.saved_bytes = max(self.result.saved_bytes, saved)
                else:
                    loss = step()
            loss.backward()
            loss_total += float(loss.detach())
        if cuda:
            torch.cuda.synchronize()
            self.result.peak_bytes = max(
                self.result.peak_bytes or 0, torch.cuda.max_memory_allocated() - baseline
            )
        if timed:
            self.result.seconds.append(time.perf_counter() - started)
        self.result.loss = loss_total


def measure_interleaved(variants: dict[str, Variant], repeats: int) -> dict[str, Measurement]:
    """A warmup each, then `repeats` rounds that time every variant once, in turn: on a shared machine a
    change of load then hits every variant alike instead of whichever ran during it."""
    for variant in variants.values():
        variant.run(timed=False)
    for _ in range(repeats):
        for variant in variants.values():
            variant.run(timed=True)
    return {name: variant.result for name, variant in variants.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="smollm2")
    parser.add_argument("--draft-vocab", type=int, default=32_000)
    parser.add_argument("--samples", type=int, default=8, help="samples per optimizer step")
    parser.add_argument(
        "--max-length", type=int, default=128, help="longest sample; lengths are log-uniform in [max/8, max]"
    )
    parser.add_argument("--pack-tokens", type=int, default=512, help="pack budget (>= --max-length)")
    parser.add_argument("--micro-batch", type=int, default=2, help="samples per padded micro-batch")
    parser.add_argument("--ttt-steps", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--skip-naive", action="store_true", help="skip the naive recompute reference (large GPU runs)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: torch's); 1 on a busy shared machine",
    )
    parser.add_argument(
        "--checkpointing", action="store_true", help="add the kit's step with activation checkpointing"
    )
    parser.add_argument(
        "--memory-plan", action="store_true", help="print the 16K-token, hidden-7168 memory figure and exit"
    )
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="dense bf16 peak to report against (default: the table)",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_plan:
        print_memory_plan()
        return

    device = torch.device(args.device)
    shape = PRESETS[args.preset]
    config = DraftConfig(
        hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        head_dim=shape["head_dim"],
        vocab_size=shape["vocab"],
        draft_vocab_size=args.draft_vocab,
        max_position_embeddings=131_072,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 500_000.0},
        target_num_hidden_layers=32,
        capture_layer_indices=(2, 16, 29),
    )
    torch.manual_seed(args.seed)
    model = Eagle3DraftModel(config)
    model.set_draft_vocab(
        torch.zeros(args.draft_vocab, dtype=torch.int64), torch.arange(config.vocab_size) < args.draft_vocab
    )
    model.to(device)
    head = (torch.randn(config.vocab_size, config.hidden_size) * config.hidden_size**-0.5).to(device)
    samples = make_samples(args.samples, args.max_length, config, args.seed)
    pack_tokens = args.pack_tokens
    padded = [
        collate(samples[start : start + args.micro_batch], args.max_length)
        for start in range(0, len(samples), args.micro_batch)
    ]
    packs = packed_micro_batches(samples, pack_tokens, args.max_length, fixed_length=device.type == "cuda")
    lengths = [min(len(sample["input_ids"]), args.max_length) for sample in samples]
    tokens = sum(lengths)
    counted = int(sum(eligible_rows(batch, args.ttt_steps).sum() for batch in packs))
    flops = model_flops(config, lengths, counted, args.ttt_steps)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = args.peak_tflops or next(
            (value for key, value in PEAK_BF16_TFLOPS.items() if key in name), None
        )
        where = f"{name}, bf16 autocast, fp32 master weights, dense bf16 peak {peak} TFLOP/s"
    else:
        peak, where = None, f"CPU, {torch.get_num_threads()} threads, fp32"
    print(
        f"device {device} ({where}); {args.preset}-shaped draft H={config.hidden_size} draft vocab "
        f"{args.draft_vocab:,} target vocab {config.vocab_size:,}; TTT steps {args.ttt_steps}"
    )
    print(
        f"one step = {len(samples)} samples, {tokens:,} tokens (lengths {min(lengths)}-{max(lengths)}); "
        f"padded: {len(padded)} micro-batches of {args.micro_batch}, {padding_share(padded):.0%} padding "
        f"rows; packed: {len(packs)} packs of {pack_tokens}, {padding_share(packs):.0%} pack-tail rows; "
        f"model {flops / 1e12:.3f} TFLOP/step"
    )

    # On CUDA every variant runs under bf16 autocast (fp32 master weights). On a CPU they run in fp32, as
    # the kit trains there; one extra row shows the kit under CPU bf16 autocast (not what training uses).
    cuda = device.type == "cuda"
    padded_ttt = lambda m, b, r, c, h, k: padded_step(m, b, r, c, h, k, naive=False)
    variants = {}
    if not args.skip_naive:
        naive = lambda m, b, r, c, h, k: padded_step(m, b, r, c, h, k, naive=True)
        variants["naive recompute (padded)"] = Variant(
            naive, model, padded, head, args.ttt_steps, device, cuda
        )
    variants["padded TTT (kit before)"] = Variant(
        padded_ttt, model, padded, head, args.ttt_steps, device, cuda
    )
    variants["kit: packed + chunked"] = Variant(packed_step, model, packs, head, args.ttt_steps, device, cuda)
    if args.checkpointing:
        variants["kit + act. checkpointing"] = Variant(
            checkpointed_step, model, packs, head, args.ttt_steps, device, cuda
        )
    if not cuda:
        variants["kit, CPU bf16 autocast"] = Variant(
            packed_step, model, packs, head, args.ttt_steps, device, True
        )
    results = measure_interleaved(variants, args.repeats)

    reference_name = next(iter(results))
    reference = statistics.median(results[reference_name].seconds)
    print(
        f"\n{'':28s} {'ms/step (min-max)':>24s} {'tokens/s':>10s} {'TFLOP/s':>8s} {'MFU':>14s} "
        f"{'vs ' + reference_name.split(' (')[0]:>18s} {'saved B/token':>14s} {'peak B/token':>13s}  loss"
    )
    for name, result in results.items():
        median = statistics.median(result.seconds)
        achieved = flops / median / 1e12
        mfu = f"{100 * achieved / peak:.1f}% of {peak:.0f}" if peak else "peak unknown"
        peak_per_token = (
            f"{result.peak_bytes / tokens:13,.0f}" if result.peak_bytes is not None else f"{'n/a (CPU)':>13s}"
        )
        saved_per_token = (
            f"{result.saved_bytes / tokens:14,.0f}" if result.saved_bytes else f"{'n/a (CUDA)':>14s}"
        )
        print(
            f"{name:28s} {median * 1e3:9.0f} "
            f"({min(result.seconds) * 1e3:.0f}-{max(result.seconds) * 1e3:.0f}) {tokens / median:10.1f} "
            f"{achieved:8.3f} {mfu:>14s} {reference / median:17.2f}x {saved_per_token} "
            f"{peak_per_token}  {result.loss:.6f}"
        )
    same_precision = [result.loss for name, result in results.items() if "CPU bf16" not in name]
    spread = max(same_precision) - min(same_precision)
    ok = spread <= 1e-4 * max(abs(value) for value in same_precision)
    print(f"\nsame loss across implementations: max |diff| = {spread:.2e} ({'ok' if ok else 'MISMATCH'})")
    if "kit, CPU bf16 autocast" in results:
        relative = abs(results["kit, CPU bf16 autocast"].loss - results["kit: packed + chunked"].loss) / abs(
            results["kit: packed + chunked"].loss
        )
        print(f"CPU bf16 autocast loss differs from fp32 by {relative:.1e} (relative)")


if __name__ == "__main__":
    main()
