"""`TrainSettings`: one draft's training run, as the params' training section plus the few fields params do
not set.

The recipe, the schedule and the batch shape are `config.TrainingParams` fields, declared, defaulted and
validated there once; `TrainSettings` holds that section (`training`) and reads as it
(`settings.learning_rate` is `settings.training.learning_rate`). Its own fields are the ones no params
file sets: the AdamW betas, the held-out chain length, the seed and the interruption step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from eaglekit.config import TrainingParams
from eaglekit.training.schedule import anneal_length

# The TrainingParams fields one draft's training reads. A checkpoint saves them (flat, beside the own fields)
# and a resumed run must match them; the other params fields (data_sizes, heldout_size, draft_vocab_size,
# nproc_per_node, speculative_tokens) shape the stage, not one draft, so they are not saved.
DRAFT_FIELDS = (
    "ttt_steps", "step_weight", "feature_noise", "distill", "learning_rate", "min_learning_rate", "warmup_steps", "schedule",
    "max_steps", "num_epochs", "patience", "min_improvement", "smoothing_evaluations", "decay_steps", "decay_fraction",
    "micro_batch_size", "grad_accumulation_steps", "grad_clip", "weight_decay", "max_length", "pack_tokens", "attention",
    "eval_interval", "device", "parallel", "log_interval_s", "prefetch_steps", "activation_checkpointing",
)


@dataclass(frozen=True, init=False)
class TrainSettings:
    """Hyperparameters of one draft training run: `training` (the params section) plus the own fields.

    Build it from a run's params with `TrainSettings.from_params(params)`. Library callers may also name
    TrainingParams fields as keywords, `TrainSettings(learning_rate=3e-3, max_steps=6)`: they replace
    those of `training` (default `TrainingParams()`) and are validated there, so `dataclasses.replace`
    works on either kind of field. A call naming ttt_steps but not speculative_tokens serves no deeper
    than it trains (speculative_tokens <= ttt_steps is TrainingParams' rule).
    """

    training: TrainingParams
    beta1: float = 0.9
    beta2: float = 0.95
    eval_chain_steps: int | None = None  # chain length of the simulated accept length; None = ttt_steps
    seed: int = 0
    stop_at_step: int | None = None  # stop early after this step's checkpoint (interruptions, tests)

    def __init__(self, training: TrainingParams | None = None, *, beta1: float = 0.9, beta2: float = 0.95,
                 eval_chain_steps: int | None = None, seed: int = 0, stop_at_step: int | None = None, **changes: Any):
        training = TrainingParams() if training is None else training
        if changes:
            if changes.get("ttt_steps") is not None and "speculative_tokens" not in changes:
                changes["speculative_tokens"] = min(training.speculative_tokens, changes["ttt_steps"])
            try:
                training = TrainingParams.model_validate({**training.model_dump(), **changes})
            except ValidationError as error:
                raise ValueError(settings_error(error)) from None
        for name, value in (("training", training), ("beta1", beta1), ("beta2", beta2), ("eval_chain_steps", eval_chain_steps),
                            ("seed", seed), ("stop_at_step", stop_at_step)):
            object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:
        # Called only for names that are not own fields: the params section's fields read through.
        if name != "training" and name in TrainingParams.model_fields:
            return getattr(self.training, name)
        raise AttributeError(f"{type(self).__name__} has no field {name!r}")

    @classmethod
    def from_params(cls, params: Any) -> "TrainSettings":
        """Settings of a run's drafts from validated `Params`: the training section, analysis.chain_steps
        for the held-out chain, run.seed."""
        return cls(params.training, eval_chain_steps=params.analysis.chain_steps, seed=params.run.seed)

    def to_dict(self) -> dict[str, Any]:
        """The flat form a checkpoint saves (plain values only, so it loads with weights_only=True)."""
        return {**{name: getattr(self.training, name) for name in DRAFT_FIELDS}, "beta1": self.beta1, "beta2": self.beta2,
                "eval_chain_steps": self.eval_chain_steps, "seed": self.seed, "stop_at_step": self.stop_at_step}

    def anneal_steps(self, decay_start: int) -> int:
        """until_converged's anneal length for a draft that converged at step `decay_start`
        (`anneal_length`)."""
        return anneal_length(self.training.decay_steps, self.training.decay_fraction, decay_start)

    def global_batch(self, world_size: int) -> int:
        """Samples one optimizer step reads over all ranks."""
        return self.training.micro_batch_size * self.training.grad_accumulation_steps * world_size

    def resolved_max_steps(self, num_samples: int, world_size: int) -> int:
        """Total steps (equal_steps, equal_epochs) or the step cap (until_converged)."""
        if self.training.schedule != "equal_epochs":
            return self.training.max_steps
        return max(1, math.ceil(self.training.num_epochs * num_samples / self.global_batch(world_size)))


def settings_error(error: ValidationError) -> str:
    """A TrainingParams validation error in keyword terms: `schedule='forever': use one of ...`,
    `patience must be > 0, got 0`; a rule across fields keeps its own message."""
    lines = []
    for item in error.errors():
        name = ".".join(str(part) for part in item["loc"])
        kind, value = item["type"], item.get("input")
        if kind == "literal_error":
            lines.append(f"{name}={value!r}: use one of {item['ctx']['expected']}")
        elif kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal", "finite_number"):
            lines.append(f"{name} must be {_bounds(name)}, got {value!r}")
        elif kind == "value_error":
            lines.append(str(item["ctx"]["error"]))
        elif kind == "extra_forbidden":
            lines.append(f"{name}: not a TrainingParams field nor one of TrainSettings' own")
        else:
            lines.append(f"{name}={value!r}: {item['msg']}")
    return "; ".join(lines)


def _bounds(name: str) -> str:
    """The numeric constraints TrainingParams declares for a field, e.g. ">= 0 and finite"."""
    parts = []
    for constraint in TrainingParams.model_fields[name].metadata:
        for attribute, symbol in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
            if getattr(constraint, attribute, None) is not None:
                parts.append(f"{symbol} {getattr(constraint, attribute)}")
        if getattr(constraint, "allow_inf_nan", None) is False:
            parts.append("finite")
    return " and ".join(parts) or "valid"
