"""vLLM's speculative-decoding counters, read from its Prometheus text at `/metrics`.

vLLM exposes them server-wide (vllm/v1/spec_decode/metrics.py): `vllm:spec_decode_num_drafts_total`,
`vllm:spec_decode_num_draft_tokens_total`, `vllm:spec_decode_num_accepted_tokens_total` and
`vllm:spec_decode_num_accepted_tokens_per_pos_total` (label `position`), one series per engine. This module
only parses the text (no HTTP); `live_serving` reads it before and after a run and takes
tau = 1 + delta(accepted) / delta(drafts).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_SAMPLE_LINE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")
_LABEL = re.compile(r'(?P<key>[a-zA-Z_][a-zA-Z0-9_]*)="(?P<value>(?:[^"\\]|\\.)*)"')

VLLM_DRAFTS = "vllm:spec_decode_num_drafts_total"
VLLM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
VLLM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
VLLM_ACCEPTED_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


@dataclass(frozen=True)
class VllmSpecCounters:
    """vLLM's speculative-decoding counters summed over engines (and models)."""

    drafts: float
    draft_tokens: float
    accepted_tokens: float
    accepted_per_position: tuple[float, ...]  # index = draft position

    def minus(self, earlier: "VllmSpecCounters") -> "VllmSpecCounters":
        if len(self.accepted_per_position) != len(earlier.accepted_per_position):
            raise RuntimeError("the number of draft positions changed between reads: was the server restarted with another config?")
        return VllmSpecCounters(
            drafts=self.drafts - earlier.drafts,
            draft_tokens=self.draft_tokens - earlier.draft_tokens,
            accepted_tokens=self.accepted_tokens - earlier.accepted_tokens,
            accepted_per_position=tuple(a - b for a, b in zip(self.accepted_per_position, earlier.accepted_per_position)),
        )


def parse_vllm_spec_counters(metrics_text: str, source: str = "/metrics") -> VllmSpecCounters:
    """Sum the `*_total` spec-decode series of a Prometheus text exposition (never the `*_created` gauges)."""
    totals = {VLLM_DRAFTS: 0.0, VLLM_DRAFT_TOKENS: 0.0, VLLM_ACCEPTED: 0.0}
    seen: set[str] = set()
    per_position: dict[int, float] = {}
    for line in metrics_text.splitlines():
        # A comment line (# HELP, # TYPE) or a blank one matches no sample name.
        match = _SAMPLE_LINE.match(line)
        if match is None:
            continue
        name = match["name"]
        if name in totals:
            totals[name] += float(match["value"])
            seen.add(name)
        elif name == VLLM_ACCEPTED_PER_POSITION:
            labels = {label["key"]: label["value"] for label in _LABEL.finditer(match["labels"] or "")}
            position = int(labels["position"])
            per_position[position] = per_position.get(position, 0.0) + float(match["value"])
    missing = sorted(set(totals) - seen)
    if missing:
        raise RuntimeError(
            f"{source}: no {', '.join(missing)}: vLLM is not running speculative decoding (start it with "
            "--speculative-config '{\"method\": \"eagle3\", \"model\": DRAFT, \"num_speculative_tokens\": K}'), or it is "
            "a release without the V1 drafts counter"
        )
    return VllmSpecCounters(
        drafts=totals[VLLM_DRAFTS],
        draft_tokens=totals[VLLM_DRAFT_TOKENS],
        accepted_tokens=totals[VLLM_ACCEPTED],
        accepted_per_position=tuple(per_position[index] for index in sorted(per_position)),
    )
