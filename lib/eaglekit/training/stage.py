"""Stage 5 as one library call, in one process or under torchrun, and the launcher that starts torchrun.

`run_training_stage(params, run_dir)` does what notebook 05 computes, without the plots: reads the
capture (offline shards or online), picks the draft vocab from the largest training subset, trains
one draft per data size (`train_size_sweep`), and `training.noise_seeds` more drafts at the small sizes
(`TrainingParams.noise_seed_sizes`: the same samples, seeds run.seed + 1, ...; stage 6 measures training noise
from them), exports the largest size's best draft for SGLang and vLLM, trains the ablation pair when
configured, and writes `training/sweep.json` (a
`sweep_record.SweepRecord`, what stage 6 loads) and the stage's metrics events. Every rank runs it; training
is data parallel (`training.parallel`: ddp, or fsdp on GPUs); rank 0 alone writes exports, metrics and
sweep.json.

    torchrun --nproc-per-node 8 -m eaglekit.training --params P --run-id R           # the whole sweep
    torchrun --nproc-per-node 8 -m eaglekit.training --params P --run-id R --sizes 5000   # one size

Every draft picks its best checkpoint and stops on the selection side of the held-out set
(`split.split_selection`, training.selection_share); sweep.json's `scored` is the other side, the only
samples stage 6 scores. Each size (and each extra seed's size) resumes from its `last.pt`, so rerunning
the same command after a kill continues every loss curve where its last checkpoint left it (a torn last.pt:
from last.prev.pt, or from step 0, with a warning naming the file; a torn best.pt: restored or that size
retrained, eaglekit.training.checkpoint). sweep.json lists only best checkpoints that loaded back at their
best step, with their size and sha256. `--sizes` trains those sizes only (the split and the draft vocab are
those of the whole sweep) and writes no sweep.json; a later run without `--sizes` finds them trained and only
evaluates the rest.

`launch_training_stage(params, run_dir)` starts that command as a subprocess (what
notebook 05 does when `training.nproc_per_node > 1`), hands each output line to a callback as it
arrives (the `eaglekit.training` progress lines), and returns the SweepRecord it wrote. Interrupting
the caller (Ctrl-C, a stopped kernel) stops the whole torchrun process group; the next launch resumes.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
from collections import Counter, deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from eaglekit.capture import CapturedSamples, load_target, open_captured_samples, read_capture_plan
from eaglekit.capture.inputs import capture_length
from eaglekit.config import Params, dump_params
from eaglekit.run_folder import Metrics, stage_dir, tokenized_data_files
from eaglekit.training.checkpoint import load_checkpoint, load_draft_weights
from eaglekit.training.distributed import launched_world, local_device
from eaglekit.training.loop import train_draft
from eaglekit.training.record import SWEEP_FILE, DraftEntry, DraftVocabRecord, SweepRecord
from eaglekit.training.settings import TrainSettings
from eaglekit.training.order import sweep_split
from eaglekit.training.split import IndexedSubset, nested_subsets, read_conversation_keys, split_selection
from eaglekit.training.sweep import SweepProgress, result_row, train_size_sweep
from eaglekit.training.teacher import TargetArgmaxCache
from eaglekit.topology import Topology

LAUNCH_PARAMS_FILE = "launch_params.yaml"


def run_training_stage(params: Params, run_dir: str | os.PathLike, sizes: Sequence[int] | None = None) -> SweepRecord | None:
    """Stage 5 without plots: the data-size sweep, exports, ablation and `training/sweep.json`.

    sizes: train only these sizes of `training.data_sizes` (no exports, no ablation, no sweep.json).
    Returns the sweep record it saved (rank 0; None on other ranks and with `sizes`).
    """
    from eaglekit.draft.model import load_target_head_weights
    from eaglekit.target import resolve_model, target_layout

    out = Path(run_dir)
    capture_dir, training_dir = stage_dir(out, "capture"), stage_dir(out, "training")
    capture_plan = read_capture_plan(capture_dir)  # fails before any model loads when stage 4 has not run
    selected = list(params.training.data_sizes) if sizes is None else sorted(int(size) for size in sizes)
    unknown = sorted(set(selected) - set(params.training.data_sizes))
    if unknown:
        raise ValueError(f"--sizes {unknown} are not in training.data_sizes {params.training.data_sizes}: the split and the draft "
                         "vocab come from the whole sweep, so train one of its sizes")
    model_dir = resolve_model(params.target.model, revision=params.target.revision)
    layout = target_layout(model_dir, trust_remote_code=params.target.trust_remote_code)
    # head tensors by the layout's names (Kimi-K2.5: language_model.*)
    target_weights = load_target_head_weights(layout)
    settings = TrainSettings.from_params(params)
    is_main = launched_world()[0] == 0
    metrics = Metrics(out, "training") if is_main else None
    inputs = _sweep_inputs(params, out, capture_dir, model_dir, settings)
    vocab, coverage = _draft_vocab(params, inputs, layout.vocab_size)
    if metrics is not None:
        metrics.log(event="draft_vocab", size=vocab.size, coverage=vocab.coverage, counted_tokens=vocab.counted_tokens)

    # the chain train_draft scores held-out tau with
    evaluated = Topology.chain(settings.eval_chain_steps or settings.ttt_steps)
    build_model = draft_builder(params, target_weights, vocab, inputs.capture_layer_ids)
    ablation_pairs = _ablation_pairs(params, capture_dir, inputs.keys) if sizes is None else None
    progress = _sweep_progress(params, settings, selected, ablation_pairs)
    # One target argmax per sample for the sweep and the ablation: they share the held-out set, and the
    # regenerated-answers draft trains on samples of the sweep (keys are content digests, so the original
    # answers, which share ids with them, get their own).
    target_cache = TargetArgmaxCache(target_weights.lm_head)
    sweep_options = dict(datasets=inputs.datasets, target_cache=target_cache, split=(inputs.selection, inputs.train_order),
                         progress=progress)
    sweep_rows = train_size_sweep(build_model, target_weights.lm_head, inputs.samples, selected, params.training.heldout_size,
                                  training_dir, settings, **sweep_options)
    # Training noise: the small sizes again with other seeds (init and data order), same samples, same
    # selection.
    seed_rows: list[tuple[int, dict]] = []
    for noise_seed, seed_sizes in _noise_seed_sizes(params, selected):
        rows = train_size_sweep(lambda seed=noise_seed: build_model(seed), target_weights.lm_head, inputs.samples, seed_sizes,
                                params.training.heldout_size, training_dir / f"seed-{noise_seed}",
                                dataclasses.replace(settings, seed=noise_seed), label=f", seed {noise_seed}", **sweep_options)
        seed_rows += [(noise_seed, row) for row in rows]
    if metrics is not None:
        for row in sweep_rows:
            metrics.log(event="sweep_size", **{key: value for key, value in row.items() if key != "samples_by_dataset"})
        for noise_seed, row in seed_rows:
            metrics.log(event="noise_seed", noise_seed=noise_seed,
                        **{key: value for key, value in row.items() if key != "samples_by_dataset"})
    if sizes is not None:
        if metrics is not None:
            metrics.close()
        return None

    ablation = [] if ablation_pairs is None else _train_ablation(ablation_pairs, inputs, build_model, target_weights.lm_head, settings,
                                                                 training_dir, target_cache, evaluated, progress, out, metrics)
    if not is_main:
        return None
    largest = max(sweep_rows, key=lambda row: row["size"])
    export = _export_largest(build_model, largest, layout, model_dir, training_dir, params.training.speculative_tokens)
    sweep = SweepRecord(
        runs=[DraftEntry.from_sweep_row(row, evaluated, out) for row in sweep_rows],
        noise_seeds=[DraftEntry.from_sweep_row(row, evaluated, out, noise_seed=noise_seed) for noise_seed, row in seed_rows],
        ablation=ablation,
        heldout=[inputs.keys[index] for index in inputs.heldout],
        selection=[inputs.keys[index] for index in inputs.selection],
        topology=evaluated,
        draft_vocab=DraftVocabRecord(size=vocab.size, coverage=vocab.coverage, counted_tokens=vocab.counted_tokens,
                                     coverage_curve=coverage),
        capture_dir=str(capture_dir.relative_to(out)), capture_mode=capture_plan.mode, capture_layer_ids=list(inputs.capture_layer_ids),
        split_seed=params.run.seed,
        export={name: str(Path(folder).relative_to(out)) for name, folder in export.items()},
    )
    sweep.save(training_dir / SWEEP_FILE)
    metrics.close()
    return sweep


@dataclasses.dataclass
class SweepInputs:
    """What every draft of the sweep reads: the captured samples and their place in prep's planned order."""

    samples: CapturedSamples
    keys: list
    datasets: list[str]
    capture_layer_ids: list[int]
    heldout: list[int]  # every sample no draft trains on
    selection: list[int]  # the side of it that picks and stops each draft (stage 6 scores the other side)
    train_order: list[int]


def _sweep_inputs(params: Params, out: Path, capture_dir: Path, model_dir: Path, settings: TrainSettings) -> SweepInputs:
    # Shards or the target recomputing features online, as stage 4 planned: one interface
    # (capture.CapturedSamples).
    data_files = tokenized_data_files(out)
    samples = open_captured_samples(capture_dir, data_files,
                                    lambda: load_target(model_dir, device=local_device(settings.device),
                                                        dtype=getattr(torch, params.target.dtype)),
                                    capture_layer_ids=params.target.capture_layers, max_seq_len=capture_length(params))
    keys = samples.keys
    # split samples of one conversation stay on one side
    conversations = read_conversation_keys(data_files, keys)
    # prep's planned order (prep/order.json) when there is one: each sample keeps the place prep gave it.
    heldout, train_order = sweep_split(out, keys, params.training.heldout_size, params.run.seed, conversations)
    # Checkpoints are picked on one side of the held-out set and scored (stage 6) on the other only.
    selection_positions, _ = split_selection([keys[index] for index in heldout], params.training.selection_share,
                                             params.run.seed, [conversations[index] for index in heldout])
    return SweepInputs(samples, keys, [dataset for dataset, _ in keys], list(samples.capture_layer_ids), list(heldout),
                       [heldout[position] for position in selection_positions], list(train_order))


def _draft_vocab(params: Params, inputs: SweepInputs, vocab_size: int):
    """The draft vocab: the most frequent generated tokens of the largest subset of the whole sweep; and its
    coverage curve ([[vocab size, share of generated tokens]])."""
    from eaglekit.draft.vocab import count_generated_tokens, coverage_curve

    largest_subset = nested_subsets(inputs.train_order, params.training.data_sizes)[max(params.training.data_sizes)]
    token_counts = count_generated_tokens((inputs.samples.tokens(index) for index in largest_subset), vocab_size)
    vocab = draft_vocab(params, token_counts, vocab_size)
    grid = sorted({2**power for power in range(6, 17) if 2**power < vocab_size} | {vocab.size, vocab_size})
    return vocab, [[size, share] for size, share in coverage_curve(token_counts, grid).items()]


def draft_vocab(params: Params, token_counts: torch.Tensor, vocab_size: int):
    """The `training.draft_vocab_size` most frequent tokens of `token_counts` (unset: the default size for a
    target vocab of `vocab_size`): stage 5's rule, and the staged run's."""
    from eaglekit.draft.vocab import default_draft_vocab_size, select_draft_vocab

    return select_draft_vocab(token_counts, params.training.draft_vocab_size or default_draft_vocab_size(vocab_size))


def draft_builder(params: Params, head, vocab, capture_layer_ids: Sequence[int]) -> Callable[..., Any]:
    """Builds an untrained draft on the target's `head` weights, `vocab` and capture layers, by seed
    (default run.seed) and training.draft_shape: stage 5's drafts, and the staged run's."""
    from eaglekit.draft.model import build_draft_from_target

    return lambda seed=params.run.seed: build_draft_from_target(head, vocab.d2t, vocab.t2d, tuple(capture_layer_ids), seed=seed,
                                                                shape=params.training.draft_shape)


def _noise_seed_sizes(params: Params, selected: Sequence[int]) -> list[tuple[int, list[int]]]:
    """(seed, sizes) of the extra-seed drafts: seeds run.seed + 1, ..., each at the selected small sizes."""
    seed_sizes = [size for size in params.training.noise_seed_sizes() if size in selected]
    seeds = range(params.run.seed + 1, params.run.seed + 1 + params.training.noise_seeds)
    return [(seed, seed_sizes) for seed in seeds] if seed_sizes else []


@dataclasses.dataclass
class AblationPairs:
    """The ablation's input: the captured original answers, and (original answer's index, regenerated sample's
    index) of every prompt captured both ways."""

    original: Any  # capture.shards.ShardDataset of capture/original
    pairs: list[tuple[int, int]]


def _ablation_pairs(params: Params, capture_dir: Path, keys: list) -> AblationPairs | None:
    """The prompts captured both ways; None: no ablation."""
    original_dir = capture_dir / "original"
    if not params.analysis.ablation or not (original_dir / "index.json").exists():
        return None
    from eaglekit.capture.shards import ShardDataset

    original = ShardDataset(original_dir)
    position_of_key = {key: index for index, key in enumerate(keys)}
    return AblationPairs(original, [(index, position_of_key[key]) for index, key in enumerate(original.keys) if key in position_of_key])


def _sweep_progress(params: Params, settings: TrainSettings, selected: Sequence[int],
                    ablation_pairs: AblationPairs | None) -> SweepProgress:
    """Every draft stage 5 trains, in order, with its step cap: the log's 'draft i of n' and the sweep's time
    left."""
    world = launched_world()[1]
    drafts = [(f"size {size}", settings.resolved_max_steps(size, world)) for size in selected]
    drafts += [(f"size {size}, seed {seed}", settings.resolved_max_steps(size, world))
               for seed, sizes in _noise_seed_sizes(params, selected) for size in sizes]
    if ablation_pairs is not None:
        drafts += [(f"ablation: {variant}", settings.resolved_max_steps(len(ablation_pairs.pairs), world)) for variant in ABLATION_VARIANTS]
    return SweepProgress(drafts, params.training.schedule == "until_converged")


ABLATION_VARIANTS = ("original answers", "regenerated answers")


def _train_ablation(ablation_pairs: AblationPairs, inputs: SweepInputs, build_model, lm_head, settings: TrainSettings, training_dir: Path,
                    target_cache, evaluated: Topology, progress: SweepProgress, out: Path, metrics: Metrics | None) -> list[DraftEntry]:
    """The ablation pair: one draft on the datasets' own answers, one on the target's, over the same
    prompts."""
    original, pairs = ablation_pairs.original, ablation_pairs.pairs
    samples_by_dataset = dict(Counter(inputs.keys[position][0] for _, position in pairs))
    variants = {"original answers": IndexedSubset(original, [o for o, _ in pairs]),
                "regenerated answers": IndexedSubset(inputs.samples, [r for _, r in pairs])}
    entries = []
    for variant in ABLATION_VARIANTS:
        progress.start(f"ablation: {variant}")
        result = train_draft(build_model(), lm_head, variants[variant], IndexedSubset(inputs.samples, inputs.selection),
                             training_dir / "ablation" / variant.split()[0], settings, target_cache=target_cache)
        progress.finish(result)
        row = result_row(result, samples_by_dataset, settings, len(inputs.selection))
        entries.append(DraftEntry.from_sweep_row(row, evaluated, out, variant=variant))
        if metrics is not None:
            metrics.log(event="ablation", **entries[-1].to_dict())
    return entries


def _export_largest(build_model, largest: dict, layout, model_dir: Path, training_dir: Path, speculative_tokens: int) -> dict[str, Path]:
    """The largest size's best draft exported for SGLang and vLLM, each export validated (by the export):
    {engine: folder}."""
    from eaglekit.draft.export import export_sglang, export_vllm

    draft = build_model()
    load_draft_weights(draft, load_checkpoint(largest["best_checkpoint"]))
    # export reads the decoder's text config from the layout, also inside a multimodal wrapper
    return {
        "sglang": export_sglang(draft, layout, training_dir / "export" / "sglang"),
        "vllm": export_vllm(draft, layout, training_dir / "export" / "vllm", verifier_name_or_path=str(model_dir),
                            speculative_tokens=speculative_tokens),
    }


# ---------------------------------------------------------------------------------------------------
# torchrun: the command, and a launcher that streams it
# ---------------------------------------------------------------------------------------------------
def torchrun_command(params_path: str | os.PathLike, run_dir: str | os.PathLike, nproc_per_node: int) -> list[str]:
    """`torchrun --standalone --nproc-per-node N -m eaglekit.training --params P --run-dir D`."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc_per_node}",
            "-m", "eaglekit.training", "--params", str(params_path), "--run-dir", str(run_dir)]


class TrainingLaunchError(RuntimeError):
    """torchrun exited non-zero: the message carries its exit code and last output lines."""


def launch_training_stage(
    params: Params,
    run_dir: str | os.PathLike,
    on_line: Callable[[str], None] = print,
) -> SweepRecord:
    """Run stage 5 under torchrun (`training.nproc_per_node` processes) in a subprocess, streaming its output
    lines to `on_line`. The params schema refuses several processes with `training.parallel: none`.

    Writes the resolved params next to the results (training/launch_params.yaml) for the subprocess.
    Returns the sweep.json record it wrote. If this call is interrupted (an
    exception in `on_line`, Ctrl-C), the whole torchrun process group is stopped before re-raising.
    """
    run_dir = Path(run_dir)
    nproc_per_node = params.training.nproc_per_node
    params_path = stage_dir(run_dir, "training") / LAUNCH_PARAMS_FILE
    params_path.write_text(dump_params(params), encoding="utf-8")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default too; stated so it does not warn
    process = subprocess.Popen(torchrun_command(params_path, run_dir, nproc_per_node), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, bufsize=1, env=env, start_new_session=True)
    tail: deque[str] = deque(maxlen=40)
    try:
        for line in process.stdout:
            tail.append(line.rstrip("\n"))
            on_line(line.rstrip("\n"))
        code = process.wait()
    except BaseException:
        _stop_group(process)
        raise
    if code != 0:
        raise TrainingLaunchError(f"torchrun exited with code {code}; last lines:\n" + "\n".join(tail) +
                                  f"\nrerun to resume: {' '.join(torchrun_command(params_path, run_dir, nproc_per_node))}")
    return SweepRecord.load(stage_dir(run_dir, "training") / SWEEP_FILE)


def _stop_group(process: subprocess.Popen) -> None:
    """SIGTERM to torchrun's process group (it forwards to the workers), then SIGKILL after 30 s."""
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    except ProcessLookupError:
        pass
