"""Stage 4: run the target over tokenized data and capture the EAGLE-3 features.

Per token the draft needs the residual stream entering three target layers (concatenated to 3H)
and the target's final hidden state (H), taken by forward pre-hooks: no other layer's output is
kept and the full-vocabulary lm_head is never run.

Modules, in dependency order:
- `layers`: the capture layer ids (`default_capture_layer_ids`, `resolve_capture_layer_ids`) and the hooks.
- `inputs`: `tokenized_data.jsonl` read, validated and truncated (`read_tokenized_samples`).
- `forward`: the hooked forward over length-sorted batches (`load_target`, `plan_batches`, `capture_batches`).
- `shards`: the shard files, their index and `ShardDataset`.
- `plan`: bytes vs free disk, offline or online (`plan_capture_storage`, `read_capture_plan`).
- `run`: offline capture to shards, resumable and data parallel (`capture_to_shards`; `capture_samples` under
  the params' capture settings; the command is `eaglekit capture`, alias `python -m eaglekit.capture`).
- `online`: the same features on the fly (`OnlineCaptureSamples`), and a finished
  capture in either mode behind one interface (`open_captured_samples`, `CapturedSamples`).
- `checks`: captured samples against their source lines, feature norms, sample subsets.
- `stage`: `run_capture_stage(params, run_dir)`, what notebook 04 computes (imported from
  `eaglekit.capture.stage`).
"""

from eaglekit.capture.checks import check_captured_samples, feature_norms, write_sample_subset
from eaglekit.capture.forward import as_training_sample, capture_batch, capture_batches, load_target, plan_batches
from eaglekit.capture.inputs import DatasetStats, TokenizedSample, read_tokenized_samples
from eaglekit.capture.layers import (
    LayerInputCapture,
    base_model_of,
    default_capture_layer_ids,
    resolve_capture_layer_ids,
    validate_capture_layer_ids,
)
from eaglekit.capture.online import CapturedSamples, OnlineCaptureSamples, open_captured_samples
from eaglekit.capture.plan import PLAN_FILE, InsufficientDiskError, StoragePlan, check_disk_space, plan_capture_storage, read_capture_plan
from eaglekit.capture.run import DEFAULT_MAX_SHARD_BYTES, CaptureReport, capture_to_shards
