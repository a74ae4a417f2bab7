"""The training loop: training-time test of one EAGLE-3 draft, best checkpoint by held-out simulated tau.

One loop in a fixed order, nanoGPT style: learning rate (a pure function of the step), this rank's
micro-batches, the TTT step (teacher, eligible rows, loss, backward), clip, optimizer step, log, and
at an interval the held-out evaluation and checkpoint. How long a draft trains is the schedule's
(`TrainSettings.schedule`: eaglekit.training.stopping for until_converged):
- "until_converged" (default): until held-out tau stops improving, then an anneal; `max_steps` a cap.
- "equal_steps": every size trains `max_steps` steps (larger sizes see each sample fewer times).
- "equal_epochs": every size trains `num_epochs` passes, so larger sizes also get more steps: the
  curve then mixes data with compute.

Progress lines (step/total, loss, tokens/s, held-out tau, ETA) go to this module's logger (under
`eaglekit`) every `log_interval_s`.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from eaglekit.draft.head_loss import chunked_ttt_loss
from eaglekit.draft.model import Eagle3DraftModel
from eaglekit.io import AppendLog, format_duration
from eaglekit.training.batch import add_feature_noise, collate, device_autocast, eligible_rows
from eaglekit.training.checkpoint import (BEST_CHECKPOINT, LAST_CHECKPOINT, PREVIOUS_CHECKPOINT, find_resume_point, prepare_resume,
                                          resume_from, save_checkpoint)
from eaglekit.training.distributed import (
    Distributed, full_state_dicts, gradient_sync, local_device, rank_packs, setup_distributed, wrap_model)
from eaglekit.training.finite import all_finite, check_step
from eaglekit.training.heldout import heldout_batches, per_position_agreement, sample_lengths, simulated_accept_length
from eaglekit.training.metrics import METRICS_FILE
from eaglekit.training.prefetch import Prefetcher, SerializedSamples
from eaglekit.training.schedule import step_learning_rate
from eaglekit.training.settings import TrainSettings
from eaglekit.training.split import sample_index_at
from eaglekit.training.stopping import TrainProgress, anneal_note, record_evaluation
from eaglekit.training.teacher import TargetArgmaxCache, Teacher

logger = logging.getLogger(__name__)


@dataclass
class TrainResult:
    output_dir: Path
    steps: int
    best_step: int
    best_accept_length: float
    best_checkpoint: Path
    last_checkpoint: Path
    metrics_path: Path
    samples_seen: int = 0
    step_cap: int = 0  # total steps (equal_*) or the cap (until_converged)
    # "converged" (patience ran out), "step_cap", or None (stop_at_step: resumable)
    stopped: str | None = None
    # the last evaluation whose smoothed tau beat the previous reference by min_improvement
    improved_step: int = 0
    # the step this call resumed from (0: trained from the start): steps - resumed_step ran here
    resumed_step: int = 0

    @property
    def converged(self) -> bool:
        """Held-out tau had stopped improving when training ended (never true for a capped run)."""
        return self.stopped == "converged"


@dataclass
class StepLoss:
    """One optimizer step's loss over all ranks: loss (the weighted TTT loss), stats (k, 4) float64 on the
    host (summed CE, counted rows, correct top-1, eligible rows per TTT step), tokens (real tokens),
    non_finite_batches (micro-batches, over all ranks, whose features hold a NaN or inf)."""

    loss: float
    stats: torch.Tensor
    tokens: int
    non_finite_batches: int = 0


@dataclass
class Run:
    """What one `train_draft` call holds fixed while it trains."""

    model: Eagle3DraftModel
    wrapped: torch.nn.Module
    optimizer: torch.optim.Optimizer
    teacher: Teacher
    settings: TrainSettings
    device: torch.device
    distributed: Distributed
    total_steps: int
    output_dir: Path
    log: AppendLog | None
    # what the steps read from: a non-finite feature's error names its shard
    train_samples: Sequence[dict] = ()

    @property
    def label(self) -> str:
        return f"training {self.output_dir.name}"


def rank_samples_at(samples_seen: int, train_samples: Sequence[dict], settings: TrainSettings,
                    distributed: Distributed) -> list[list[dict]]:
    """This rank's micro-batches of the global batch that starts at data position `samples_seen`:
    micro-batch m of rank r takes slot m * world + r."""
    training = settings.training
    positions = range(samples_seen, samples_seen + settings.global_batch(distributed.world_size))
    indices = [sample_index_at(position, len(train_samples), settings.seed) for position in positions]
    size = training.micro_batch_size
    slots = [micro * distributed.world_size + distributed.rank for micro in range(training.grad_accumulation_steps)]
    return [[train_samples[index] for index in indices[slot * size : (slot + 1) * size]] for slot in slots]


def ttt_step(run: Run, rank_samples: list[list[dict]]) -> StepLoss:
    """Forward and backward of one optimizer step's micro-batches: teacher, eligible rows and TTT loss.

    The loss of TTT step i is normalized by its eligible rows over all micro-batches and ranks (counted
    before any forward), so accumulation and DDP give one big batch's gradient. Gradients accumulate in
    the model; the caller clips and steps.
    """
    training, device, world_size = run.settings.training, run.device, run.distributed.world_size
    if training.pack_tokens is None:
        micro_batches = [collate(samples, training.max_length) for samples in rank_samples]
        teacher_samples: list[list[dict] | None] = list(rank_samples)
    else:  # the same samples, packed: the same loss, no padding rows
        micro_batches = rank_packs([sample for samples in rank_samples for sample in samples], training, device)
        teacher_samples = [None] * len(micro_batches)
    eligible = [eligible_rows(batch, training.ttt_steps) for batch in micro_batches]  # each (k, B, T)
    counts = torch.stack([rows.sum(dim=(1, 2)) for rows in eligible]).sum(0).to(device, torch.float32)  # (k,)
    if training.parallel != "none":
        dist.all_reduce(counts)
    # Stats stay on the device until the step is done: no host sync inside the micro-batch loop.
    stats = torch.zeros(training.ttt_steps, 4, dtype=torch.float64, device=device)
    loss_total = torch.zeros((), dtype=torch.float64, device=device)
    non_finite = torch.zeros((), dtype=torch.float64, device=device)
    for micro, (batch, rows, samples) in enumerate(zip(micro_batches, eligible, teacher_samples)):
        lengths = batch.lengths.tolist()  # host ints: the teacher skips padding without a device sync
        # rows stay on the host: the loss picks its rows there (eaglekit.draft.head_loss)
        batch = batch.to(device)
        # A NaN feature would turn the loss, then every weight, into NaN: counted here, read with the loss
        # (`finite.check_step`).
        non_finite += (~all_finite(batch.aux_hidden_states, batch.final_hidden_states)).double()
        targets = run.teacher.signals(batch.final_hidden_states, lengths, training.distill, samples, training.max_length)
        # The teacher reads the clean final states; only the features the draft reads get noise.
        features = add_feature_noise(batch.aux_hidden_states, training.feature_noise)  # (B, T, 3H)
        with gradient_sync(run.wrapped, training.parallel, micro == len(micro_batches) - 1), device_autocast(device):
            step_states = run.wrapped(batch.input_ids, features, training.ttt_steps, batch.position_ids, batch.document_ids,
                                      return_normed_states=True)  # k x (B, T, H)
            loss, micro_stats = chunked_ttt_loss(run.model, step_states, targets, rows, counts, training.step_weight)
            # DDP/FSDP average gradients over ranks; the loss is already a global mean, so undo it.
            (loss * world_size).backward()
        stats += micro_stats
        loss_total += loss.detach()
    if training.parallel != "none":
        totals = torch.cat([stats.flatten(), loss_total.view(1), non_finite.view(1)])
        dist.all_reduce(totals)
        stats, loss_total, non_finite = totals[:-2].view_as(stats), totals[-2], totals[-1]
    tokens = sum(int(batch.lengths.sum()) for batch in micro_batches) * world_size
    # the step's one host sync, for the log line
    loss_value, non_finite_batches = torch.stack([loss_total, non_finite]).tolist()
    return StepLoss(loss_value, stats.cpu(), tokens, int(non_finite_batches))


def evaluate_and_checkpoint(run: Run, progress: TrainProgress, heldout_samples: Sequence[dict],
                            eval_batches: Sequence[Sequence[int]]) -> TrainProgress:
    """Held-out tau at progress.step, the stopping rule's update, last.pt (and best.pt at a new best).
    Every rank evaluates (FSDP's forward is collective); rank 0 logs and writes."""
    settings = run.settings
    chain_steps = settings.eval_chain_steps or settings.training.ttt_steps
    agreements = per_position_agreement(run.model, run.teacher.target_lm_head, heldout_samples, chain_steps, settings.training.max_length,
                                        settings.training.micro_batch_size, run.device, target_cache=run.teacher.cache,
                                        batches=eval_batches)
    heldout = simulated_accept_length(agreements, chain_steps)
    tau = heldout["simulated_accept_length"]
    progress = record_evaluation(progress, tau, settings.training, run.total_steps)
    if run.log is not None:
        run.log.append({"split": "heldout", "step": progress.step, "samples_seen": progress.samples_seen, **heldout,
                        "smoothed_accept_length": progress.smoothed_accept_length, "best_accept_length": progress.best_accept_length,
                        "improved_step": progress.improved_step, "stopped": progress.stopped})
        run.log.flush()
        logger.info("%s: step %d/%d held-out tau %.4f, mean of last %d %.4f (best %.4f at step %d, last improvement at step %d)%s",
                    run.label, progress.step, run.total_steps, tau, len(progress.recent_accept_lengths), progress.smoothed_accept_length,
                    progress.best_accept_length, progress.best_step, progress.improved_step,
                    f": stopped, {progress.stopped}" if progress.stopped else anneal_note(progress, settings.training, run.total_steps))
    model_state, optimizer_state = full_state_dicts(run.model, run.optimizer, settings.training.parallel)
    if run.distributed.is_main:
        if progress.best_step == progress.step:
            save_checkpoint(run.output_dir / BEST_CHECKPOINT, model_state, optimizer_state, progress.to_dict(), settings, run.model)
        # The last.pt before this one is kept as last.prev.pt: a resume falls back to it if this one turns out
        # torn.
        save_checkpoint(run.output_dir / LAST_CHECKPOINT, model_state, optimizer_state, progress.to_dict(), settings, run.model,
                        previous=run.output_dir / PREVIOUS_CHECKPOINT)
    if settings.training.parallel != "none":
        dist.barrier()
    return progress


def _train_line(progress: TrainProgress, learning_rate: float, gradient_norm: float, step: StepLoss, seconds: float) -> dict[str, Any]:
    stats = step.stats
    return {"split": "train", "step": progress.step, "samples_seen": progress.samples_seen, "lr": learning_rate,
            "loss": step.loss, "grad_norm": gradient_norm,
            "loss_by_position": [float(s[0] / s[1]) if s[1] else None for s in stats],
            "accuracy_by_position": [float(s[2] / s[3]) if s[3] else None for s in stats],
            "counted_rows_by_position": [int(s[1]) for s in stats], "seconds": seconds}


def _log_progress(run: Run, progress: TrainProgress, loss: float, tokens_seen: int, steps_done: int, elapsed: float) -> None:
    # Rates over the whole run so far (this process), not the last interval: a stall shows.
    remaining = (run.total_steps - progress.step) * elapsed / max(1, steps_done)
    logger.info("%s: step %d/%d, loss %.4f, %.0f tok/s, %.2f steps/s, held-out tau %.4f (best), ETA %s%s",
                run.label, progress.step, run.total_steps, loss, tokens_seen / max(elapsed, 1e-9), steps_done / max(elapsed, 1e-9),
                progress.best_accept_length, format_duration(remaining),
                " at most (stops earlier once converged)" if run.settings.training.schedule == "until_converged" else "")


def train_draft(
    model: Eagle3DraftModel,
    target_lm_head: torch.Tensor,
    train_samples: Sequence[dict],
    heldout_samples: Sequence[dict],
    output_dir: str | Path,
    settings: TrainSettings,
    resume: bool = True,
    target_cache: TargetArgmaxCache | bool = True,
) -> TrainResult:
    """Train `model` with training-time test; keep the checkpoint with the best held-out simulated tau.

    target_lm_head (V, H): the target's output embedding (the teacher). Writes to `output_dir`:
    metrics.jsonl (one "train" line per step, one "heldout" line per evaluation), last.pt (resume),
    best.pt (best held-out simulated accept length, not lowest loss), last.prev.pt (the last.pt before).
    Resumes from last.pt if present (`checkpoint.find_resume_point`: a torn one falls back to last.prev.pt,
    or to step 0, saying so). A NaN or inf in a batch's features, a step's loss or its gradient norm stops
    training with the sample and its shard named (`finite.check_step`), before the optimizer steps.
    Under torchrun with parallel="ddp"/"fsdp" every rank calls this with the same arguments.
    target_cache: True, a `TargetArgmaxCache` for this call; a cache, shared (`train_size_sweep` passes one
    to all sizes); False, the reference path that recomputes the full-vocab argmax at every use (the
    same results to float tolerance, tests/training/test_training.py).
    """
    training, output_dir = settings.training, Path(output_dir)
    device = torch.device(local_device(training.device))  # one GPU per torchrun process
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    distributed = setup_distributed(training.parallel, device)
    if len(train_samples) == 0 or len(heldout_samples) == 0:
        raise ValueError(f"need training and held-out samples, got {len(train_samples)} and {len(heldout_samples)}")
    last_path, metrics_path = output_dir / LAST_CHECKPOINT, output_dir / METRICS_FILE
    if (last_path.exists() or (output_dir / PREVIOUS_CHECKPOINT).exists()) and not resume:
        raise FileExistsError(f"{last_path} exists: pass resume=True to continue that run, or choose a new output_dir")

    torch.manual_seed(settings.seed)
    model.to(device)
    model.attention_backend = training.attention
    teacher = Teacher.for_draft(model.draft_to_target_ids(), model.t2d, target_lm_head, device, target_cache)
    wrapped = wrap_model(model, training.parallel, device, settings.activation_checkpointing)
    trainable = [parameter for parameter in wrapped.parameters() if parameter.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=training.learning_rate, betas=(settings.beta1, settings.beta2),
                                  weight_decay=training.weight_decay)
    point = find_resume_point(output_dir)
    if training.parallel != "none":
        dist.barrier()  # every rank has read the folder before rank 0 changes it
    if distributed.is_main:
        prepare_resume(point, output_dir, metrics_path)
    resumed = point.path is not None
    progress = (resume_from(point.path, model, optimizer, settings, metrics_path if distributed.is_main else None, point.checkpoint)
                if resumed else TrainProgress())
    resumed_step = progress.step
    point.checkpoint = None  # a whole checkpoint (GBs for a large target's draft) is not held while training
    run = Run(model, wrapped, optimizer, teacher, settings, device, distributed,
              settings.resolved_max_steps(len(train_samples), distributed.world_size), output_dir,
              AppendLog(metrics_path) if distributed.is_main else None, train_samples)
    # The held-out set never changes: its length-sorted batches are planned once (tokens only, no features).
    eval_batches = heldout_batches(sample_lengths(heldout_samples, training.max_length), training.micro_batch_size)

    # The next steps' samples are read in a background thread while this step trains (prefetch_steps
    # ahead; 0 reads in the step). Both threads read one capture, so its reads take one lock.
    global_batch = settings.global_batch(distributed.world_size)
    if settings.prefetch_steps:
        lock = threading.Lock()
        train_samples, heldout_samples = SerializedSamples(train_samples, lock), SerializedSamples(heldout_samples, lock)
    read_step = lambda position: rank_samples_at(position, train_samples, settings, distributed)
    with Prefetcher(read_step, itertools.count(progress.samples_seen, global_batch), settings.prefetch_steps) as upcoming:
        progress = _train_steps(run, progress, upcoming, trainable, resumed, heldout_samples, eval_batches)
    if run.log is not None:
        run.log.close()
    return TrainResult(output_dir, progress.step, progress.best_step, progress.best_accept_length, output_dir / BEST_CHECKPOINT, last_path,
                       metrics_path, samples_seen=progress.samples_seen, step_cap=run.total_steps, stopped=progress.stopped,
                       improved_step=progress.improved_step, resumed_step=resumed_step)


def _train_steps(run: Run, progress: TrainProgress, upcoming: Prefetcher, trainable: list[torch.nn.Parameter], resumed: bool,
                 heldout_samples: Sequence[dict], eval_batches: Sequence[Sequence[int]]) -> TrainProgress:
    """The loop proper, in nanoGPT's order; `upcoming` yields each step's micro-batches in data order."""
    settings, training, optimizer = run.settings, run.settings.training, run.optimizer
    global_batch = settings.global_batch(run.distributed.world_size)
    if not resumed:
        # the curve starts at the initialized draft
        progress = evaluate_and_checkpoint(run, progress, heldout_samples, eval_batches)
    started = last_logged = time.perf_counter()
    first_step, tokens_seen = progress.step, 0
    while progress.stopped is None and progress.step < run.total_steps:
        learning_rate = step_learning_rate(progress.step, training, progress.decay_start, run.total_steps)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate
        rank_samples = next(upcoming)
        step = ttt_step(run, rank_samples)
        gradient_norm = float(torch.nn.utils.clip_grad_norm_(trainable, training.grad_clip))
        check_step(progress.step + 1, step.loss, gradient_norm, step.non_finite_batches, rank_samples, run.train_samples)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        progress.step += 1
        progress.samples_seen += global_batch
        tokens_seen += step.tokens

        now = time.perf_counter()
        if run.log is not None:
            run.log.append(_train_line(progress, learning_rate, gradient_norm, step, now - started))
            if now - last_logged >= training.log_interval_s or progress.step == run.total_steps:
                _log_progress(run, progress, step.loss, tokens_seen, progress.step - first_step, now - started)
                last_logged = now
        if progress.step % training.eval_interval == 0 or progress.step == run.total_steps:
            progress = evaluate_and_checkpoint(run, progress, heldout_samples, eval_batches)
            if settings.stop_at_step is not None and progress.step >= settings.stop_at_step:
                break
    return progress
