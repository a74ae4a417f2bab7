"""How a generation run behaves: per-partition concurrency and budget, and the retry policy, built from params."""

from __future__ import annotations

import random
from dataclasses import dataclass

from eaglekit.config import GenerationParams, PartitionParams


@dataclass(frozen=True)
class PartitionSettings:
    """How one partition runs: requests in flight per endpoint, and the completion budget."""

    name: str
    concurrency: int
    max_tokens: int

    @classmethod
    def from_params(cls, partition: PartitionParams) -> PartitionSettings:
        """One partition of params `generation.partitions`."""
        return cls(partition.name, partition.concurrency, partition.max_tokens)


@dataclass(frozen=True)
class RetryPolicy:
    """Transient failures retry with full-jitter exponential backoff: uniform(0, min(max, base x 2^(n-1))).

    No defaults here: they live in `config.GenerationParams` (`DEFAULT_RETRY` is built from them)."""

    max_attempts: int
    backoff_base_s: float
    backoff_max_s: float

    @classmethod
    def from_params(cls, generation: GenerationParams) -> RetryPolicy:
        """The retry settings of params `generation` (max_attempts, backoff_base_s, backoff_max_s)."""
        return cls(generation.max_attempts, generation.backoff_base_s, generation.backoff_max_s)

    def backoff_seconds(self, attempt: int, rng: random.Random) -> float:
        return rng.uniform(0.0, min(self.backoff_max_s, self.backoff_base_s * 2 ** (attempt - 1)))


DEFAULT_RETRY = RetryPolicy.from_params(GenerationParams())
