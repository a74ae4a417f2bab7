"""Stage 5: training-time-test training of the EAGLE-3 draft, held-out simulated accept length, data-size
sweep.

Modules, in dependency order: settings (`TrainSettings`: the params' training section plus its own
fields), schedule (the learning rate, pure), stopping (the progress and the stopping rule, pure), batch
and packing (what the draft reads), teacher (the target's distribution over the draft vocab), loss (the
reference TTT loss; the chunked one is eaglekit.draft.head_loss), heldout (simulated tau), split
(held-out split, nested subsets, data order), finite (NaN/inf guards on features, loss and drafts),
distributed, metrics, checkpoint (save, load, resume_from, torn-file fallback), loop (`train_draft`), sweep
(`train_size_sweep`), record (`sweep.json`), memory (what a GPU holds), stage (`run_training_stage`, and
`python -m eaglekit.training`).

This package re-exports the public names of those modules (stage's aside: it reads the capture stage).
"""

from eaglekit.training.batch import Batch, add_feature_noise, collate, device_autocast, eligible_rows, to_device
from eaglekit.training.checkpoint import (BEST_CHECKPOINT, LAST_CHECKPOINT, PREVIOUS_CHECKPOINT, CheckpointDigest, ResumePoint,
                                          TornCheckpointError, anneals_a_converged_run, check_resumable, find_resume_point,
                                          load_checkpoint, load_draft_weights, resume_from, save_checkpoint, verify_checkpoint)
from eaglekit.training.finite import NonFiniteError, require_finite_draft
from eaglekit.training.distributed import Distributed, full_state_dicts, gradient_sync, rank_packs, setup_distributed, wrap_model
from eaglekit.training.heldout import (SampleAgreement, heldout_batches, per_position_agreement, sample_lengths,
                                       simulated_accept_length)
from eaglekit.training.loop import StepLoss, TrainResult, evaluate_and_checkpoint, rank_samples_at, train_draft, ttt_step
from eaglekit.training.loss import ttt_loss
from eaglekit.training.metrics import METRICS_FILE, iterate_metrics, recent_gain, truncate_metrics
from eaglekit.training.schedule import anneal_length, decay_window, learning_rate_at, step_learning_rate
from eaglekit.training.settings import DRAFT_FIELDS, TrainSettings
from eaglekit.training.split import (IndexedSubset, ablation_sample_keys, conversation_key, nested_subsets, read_conversation_keys,
                                     sample_index_at, split_heldout, stratified_order, token_reader)
from eaglekit.training.stopping import TrainProgress, anneal_note, plateaued, record_evaluation, should_stop
from eaglekit.training.sweep import train_size_sweep
from eaglekit.training.teacher import DISTILL_TARGETS, TargetArgmaxCache, TargetSignals, Teacher, target_signals
