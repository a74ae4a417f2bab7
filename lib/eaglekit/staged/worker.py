"""The staged run: stages 4-6 on each finished slice while stage 3 is still answering, the forecast after each
size.

`StagedWorker(params, run_dir, generation).run()` takes the sizes of `training.data_sizes` smallest first. For
each it waits until its slice is settled (`slices.settled_prefix`), tokenizes the slice's answers as stage 3
will (`slices.write_staged_data`), captures them into `staged/capture/` (resuming by sample, so each slice
adds only its new samples), trains the size by the default rule into `staged/training/size-<N>/` (resumable
from its last.pt), picking its checkpoint on the selection side of the held-out set and scoring every staged
size on the other side (stage 5's and stage 6's cut, `split.split_selection`), and rewrites
`analysis/answer.json` with the forecast (`forecast.forecast`), appending it to `staged/forecasts.jsonl`.

What differs from the full stages 4-6, on purpose:
- the draft vocab is counted over the first staged size's training samples and kept for every size (stage 5
  counts it over the largest subset, which does not exist yet);
- the break-even is the user's serving timings (params.analysis) when given, else this target's own loop timed
  once with the first staged draft (staged/break_even.json; stage 6 times it again with the largest draft);
- a slice is taken only once settled as stage 5 will see it (an error an earlier session left is retried
  first), and every recorded size is matched with stage 5's slice again before it is reused: a difference is
  reported and the size staged again (`slices.slice_mismatch`);
- each verdict is made at (1 - confidence) / looks, looks counting every staged forecast and stage 6's
  (`analysis.stage.run_looks`);
- training runs in this one process (no torchrun), and capture writes shards (no online mode).
Once generation has ended, no new size starts: the size in progress finishes, and stages 4-6 then run over all
the data as in any run, writing the final answer.

The runner (`eaglekit run --staged`) starts this as `python -m eaglekit.staged` beside stage 3's kernel,
under the run folder's one lock, and tells it that generation ended by closing a pipe.
"""

from __future__ import annotations

import datetime as dt
import functools
import logging
import os
import select
import time
from pathlib import Path

import torch

from eaglekit.config import Params
from eaglekit.io import AppendLog, atomic_write, read_json, write_json
from eaglekit.staged.slices import (FORECASTS_FILE, STAGED_DIR, START_OVER, SliceEntry, StagedRecord, check_order, class_a_keys,
                                    keys_sha256, next_session, now, order_sha256, planned_prompt_count, read_settled, settled_prefix,
                                    sizes_to_stage, slice_for, slice_mismatch, write_staged_data)
from eaglekit.training.order import read_training_order

logger = logging.getLogger(__name__)

POLL_S = 5.0  # how often the worker looks at stage 3's logs while a slice is not settled
VOCAB_COUNTS_FILE = "draft_vocab_counts.pt"
BREAK_EVEN_FILE = "break_even.json"  # the embedded loop's break-even, measured once on the first staged draft


def cpu_threads_split() -> tuple[int, int] | None:
    """(worker, embedded server) CPU threads of a staged run on a machine without a GPU, None with one.

    The worker then trains on the cores the embedded server answers on. Each at full width, they slowed each
    other about tenfold on 2 cores (generation from 0.56 to 0.03 requests/s: every parallel region waits for a
    thread the other process has descheduled); half the cores each keeps both going."""
    if torch.cuda.is_available():
        return None
    cores = os.cpu_count() or 2
    return max(1, cores // 2), max(1, cores - cores // 2)


class GenerationSignal:
    """Whether stage 3 is still running, as a pipe the runner holds open: EOF (closed, or the runner died)
    means ended. Without a pipe (`fd` None) `running` is the given constant, for a direct call on a finished
    generation."""

    def __init__(self, fd: int | None = None, running: bool = False):
        self.fd = fd
        self._running = running if fd is None else True

    def running(self) -> bool:
        self.wait(0.0)
        return self._running

    def wait(self, seconds: float) -> None:
        """Sleep up to `seconds`, waking early when generation ends."""
        if self.fd is None or not self._running:
            if self._running and seconds:
                time.sleep(seconds)
            return
        readable, _, _ = select.select([self.fd], [], [], seconds)
        if readable and os.read(self.fd, 4096) == b"":
            self._running = False


class StagedWorker:
    def __init__(self, params: Params, run_dir: str | os.PathLike, generation: GenerationSignal, poll_s: float = POLL_S):
        self.params = params
        self.run_dir = Path(run_dir)
        self.generation = generation
        self.poll_s = poll_s
        self.staged_dir = self.run_dir / STAGED_DIR
        # (layout, feature source, engine or None, capture layer ids), loaded at the first slice
        self._target = None
        self._agreements: dict[int, dict] = {}  # size -> held-out agreements, scored once per draft

    # ---- the loop ---------------------------------------------------------------------------------
    def run(self) -> list[int]:
        """Stage every size it can while generation runs; returns the sizes trained by this call.

        Every size, recorded or not, is first matched with the slice stage 5 would train it on now
        (`_wait_for_slice`): a recorded size whose samples differ (a failed prompt was answered since) is
        reported and set aside, and the size is staged again; a new size starts only while generation runs."""
        params = self.params
        order = read_training_order(self.run_dir, params.training.heldout_size, params.run.seed)
        if order is None:
            logger.warning("staged run: no prep/order.json for this seed and held-out size, so no slice has a fixed place; "
                           "stages 4-6 run after generation")
            return []
        record = StagedRecord.load(self.run_dir, params.run.seed, params.training.heldout_size)
        check_order(record, order, self.run_dir)
        record.order_sha256 = order_sha256(order)
        if (split := cpu_threads_split()) is not None:
            torch.set_num_threads(split[0])
            logger.info("staged run: no GPU, so the worker trains on %d of %d CPU threads and leaves the rest to generation",
                        split[0], os.cpu_count() or 0)
        class_a = class_a_keys(self.run_dir)
        planned_prompts = planned_prompt_count(order, class_a)
        # Stage 3 retries the errors of earlier sessions (generation.retry_errors): only this session's are
        # final.
        first_session = next_session(self.run_dir) if params.generation.retry_errors else None
        trained = []
        try:
            for size in sizes_to_stage(params.training.data_sizes):
                entry = record.slices.get(size)
                found = self._wait_for_slice(size, order, class_a, first_session, record, new=entry is None)
                if found is None:
                    break
                train, answered = found
                if entry is not None and (problem := slice_mismatch(entry, train, order)) is not None:
                    self._set_aside(entry, record, problem)
                    entry = None
                    if not self.generation.running():
                        logger.info("staged run: generation has ended; size %d and larger are left to stages 4-6", size)
                        break
                if entry is None:
                    entry = self._record_slice(size, train, answered, record, planned_prompts)
                elif entry.status == "done":
                    continue
                else:
                    logger.info("staged size %d: resuming its training on the %d samples recorded in staged/slices.json",
                                size, len(entry.train))
                self._stage_size(entry, record, planned_prompts)
                trained.append(size)
        finally:
            self._close()
        return trained

    def _wait_for_slice(self, size: int, order, class_a, first_session: int | None, record: StagedRecord,
                        new: bool) -> tuple[list, int] | None:
        """(the slice stage 5 would train `size` on, prompts answered) once it is settled; None when
        generation ended before a new size's slice was, or when every sample is settled and too few can
        train."""
        while True:
            # read before the logs: once ended, the logs hold every answer
            running = self.generation.running()
            if new and not running:
                logger.info("staged run: generation has ended; size %d and larger are left to stages 4-6", size)
                return None
            # An ended generation retries nothing more until a resume, so then every error is a hole stage 5
            # skips.
            settled = read_settled(self.run_dir, class_a, first_session if running else None)
            prefix = settled_prefix(order, settled)
            if prefix.heldout is not None and len(prefix.train) >= size:
                keys = set(prefix.heldout) | set(prefix.train) | set(record.heldout)
                keys.update(key for item in record.slices.values() for key in item.train)
                _, samples = write_staged_data(self.run_dir, keys, self.params, self._tokenizer)
                self._check_heldout(record, [key for key in prefix.heldout if key in samples])
                train = slice_for(size, prefix, samples)
                if train is not None:
                    return train, len(settled.answered)
                if prefix.complete:
                    logger.warning("staged size %d: every planned sample is settled and only %d can train; not staged", size,
                                   len([key for key in prefix.train if key in samples]))
                    return None
            if not running:
                logger.warning("staged size %d: generation has ended before its slice could be settled; left to stages 4-6", size)
                return None
            self.generation.wait(self.poll_s)

    def _check_heldout(self, record: StagedRecord, heldout: list) -> None:
        """The held-out set is fixed at the first size; if stage 5's would now differ, every staged score is
        on another set."""
        if not record.heldout:
            record.heldout = heldout
        elif record.heldout != heldout:
            raise RuntimeError(f"staged run: the held-out set stage 5 will score on differs from the one the staged sizes were scored on "
                               f"({len(heldout)} vs {len(record.heldout)} samples; a held-out prompt that had failed was answered since): "
                               f"{START_OVER}")

    def _record_slice(self, size: int, train: list, answered: int, record: StagedRecord, planned_prompts: int) -> SliceEntry:
        entry = SliceEntry(size=size, train=train, train_sha256=keys_sha256(train), started=now(), answered_at_start=answered)
        record.slices[size] = entry
        record.save(self.run_dir)  # before training: a resume trains this size on these samples
        logger.info("staged size %d: its slice is answered (%d of %d prompts answered so far); training it while generation runs",
                    size, answered, planned_prompts)
        return entry

    def _set_aside(self, entry: SliceEntry, record: StagedRecord, problem: str) -> None:
        """Report a recorded size whose samples are not stage 5's, move its training folder aside, and forget
        it."""
        folder = self.staged_dir / "training" / f"size-{entry.size:07d}"
        aside = folder.with_name(f"{folder.name}.set-aside-{dt.datetime.now():%Y%m%d-%H%M%S}")
        if folder.exists():
            folder.rename(aside)
        record.set_aside.append({"size": entry.size, "problem": problem, "train_sha256": entry.train_sha256, "at": now(),
                                 "folder": str(aside.relative_to(self.run_dir))})
        del record.slices[entry.size]
        self._agreements.pop(entry.size, None)
        record.save(self.run_dir)
        logger.warning("staged size %d: %s; its draft is set aside (%s) and not forecast from, and the size is staged again on "
                       "stage 5's samples", entry.size, problem, aside.relative_to(self.run_dir))

    def _stage_size(self, entry: SliceEntry, record: StagedRecord, planned_prompts: int) -> None:
        from eaglekit.capture.shards import ShardDataset
        from eaglekit.capture.run import capture_samples
        from eaglekit.draft.vocab import count_generated_tokens
        from eaglekit.training.settings import TrainSettings
        from eaglekit.training.split import read_conversation_keys, split_selection
        from eaglekit.training.stage import draft_builder, draft_vocab
        from eaglekit.training.sweep import train_size_sweep

        params = self.params
        started = time.perf_counter()
        keys = set(record.heldout) | {key for item in record.slices.values() for key in item.train}
        files, samples = write_staged_data(self.run_dir, keys, params, self._tokenizer)
        if lost := [key for key in entry.train if key not in samples]:
            raise RuntimeError(f"staged size {entry.size}: {len(lost)} recorded samples no longer tokenize (first {lost[0]}); "
                               "generation/ changed under staged/slices.json")
        layout, source, capture_layer_ids = self._load_target()
        report = capture_samples(params, source, files, self.staged_dir / "capture", capture_layer_ids, progress=False)
        logger.info("staged capture: %d samples in staged/capture (%d new, %d tokens) in %.1fs", report.samples,
                    report.captured_samples, report.captured_tokens, report.seconds)
        captured = ShardDataset(self.staged_dir / "capture")
        position = {tuple(key): index for index, key in enumerate(captured.keys)}
        # Stage 5's cut of the held-out set (split_selection depends on the keys, not their order):
        # checkpoints are picked on the selection side and the forecast scores the other side, as stage 6
        # does.
        selection, scored = split_selection(record.heldout, params.training.selection_share, params.run.seed,
                                            read_conversation_keys(files, record.heldout))
        selection_indices = [position[tuple(record.heldout[index])] for index in selection]
        scored_indices = [position[tuple(record.heldout[index])] for index in scored]
        train_indices = [position[key] for key in entry.train]

        head = self._head
        counts_path = self.staged_dir / VOCAB_COUNTS_FILE
        if record.vocab_counted_over is None or not counts_path.exists():
            counts = count_generated_tokens((captured.tokens(index) for index in train_indices), layout.vocab_size)
            with atomic_write(counts_path, "wb", encoding=None) as handle:
                torch.save(counts, handle)
            record.vocab_counted_over = entry.size
            record.save(self.run_dir)
            logger.info("staged run: the draft vocab is counted over size %d's training samples and kept for every staged size",
                        entry.size)
        vocab = draft_vocab(params, torch.load(counts_path), layout.vocab_size)
        build_model, settings = draft_builder(params, head, vocab, capture_layer_ids), TrainSettings.from_params(params)
        (row,) = train_size_sweep(build_model, head.lm_head, captured, [entry.size], params.training.heldout_size,
                                  self.staged_dir / "training", settings, datasets=[dataset for dataset, _ in captured.keys],
                                  split=(selection_indices, train_indices))
        entry.status, entry.finished = "done", now()
        entry.result = dict(row)
        record.save(self.run_dir)
        self._forecast(record, captured, scored_indices, planned_prompts, time.perf_counter() - started)

    # ---- stage 6's part: score every staged size, rewrite the answer ------------------------------
    def _forecast(self, record: StagedRecord, captured, heldout_indices: list[int], planned_prompts: int, seconds: float) -> None:
        from eaglekit.analysis.acceptance import sweep_acceptance
        from eaglekit.analysis.answer import break_even_cases, lower_bound_sizes, serving_case
        from eaglekit.analysis.checkpoints import offline_agreements_by_size
        from eaglekit.analysis.forecast import ANSWER_FILE
        from eaglekit.analysis.stage import scaling_and_forecast
        from eaglekit.run_folder import stage_dir

        params, settings, training = self.params, self.params.analysis, self.params.training
        steps = settings.chain_steps
        done = record.done_sizes()
        heldout = [captured[index] for index in heldout_indices]
        new = {size: Path(record.slices[size].result["best_checkpoint"]) for size in done if size not in self._agreements}
        self._agreements.update(offline_agreements_by_size(new, self._head.embed_tokens, self._head.lm_head, heldout, steps,
                                                           training.max_length))
        acceptance = sweep_acceptance({size: self._agreements[size] for size in done}, steps, settings.bootstrap_resamples,
                                      settings.confidence, params.run.seed)
        serving = serving_case(settings)  # the user's timings; without them, this target's own loop
        cases = break_even_cases(serving, None if serving is not None else self._embedded_break_even(record, heldout))
        if not cases:
            logger.warning("staged forecast after sizes %s: no break-even (no serving timings in params.analysis and no local target "
                           "to time the loop on); stage 6 measures it", done)
            return
        lower_bounds = lower_bound_sizes([record.slices[size].result for size in done], training)
        scaling, answer = scaling_and_forecast(params, self.run_dir, acceptance, cases, next(iter(cases.values())), lower_bounds)
        answer.save(stage_dir(self.run_dir, "analysis") / ANSWER_FILE)
        answered = len(read_settled(self.run_dir, frozenset()).answered)
        running = self.generation.running()
        measured = {float(size): round(float(tau), 4) for size, tau in zip(scaling.overall["data_size"], scaling.overall["tau_pooled"])}
        with AppendLog(self.staged_dir / FORECASTS_FILE) as log:
            log.append({"updated": answer.updated, "sizes": answer.sizes, "tau": measured, "verdict": answer.verdict, "line": answer.line,
                        "break_even_case": answer.primary, "break_even": cases[answer.primary], "lower_bound_sizes": sorted(lower_bounds),
                        "generation_running": running, "answered": answered, "planned_prompts": planned_prompts,
                        "seconds": round(seconds, 1)})
        logger.info("staged forecast after sizes %s (generation %s, %d of %d prompts answered; break-even %.3f, %s): %s",
                    ", ".join(f"{size:g}" for size in answer.sizes), "still running" if running else "ended", answered,
                    planned_prompts, cases[answer.primary], answer.primary, answer.line)

    def _embedded_break_even(self, record: StagedRecord, heldout: list[dict]):
        """This target's own break-even, from the real loop with the smallest staged draft on held-out prompts
        (the cycle's cost hardly depends on the draft's quality), measured once and kept in
        staged/break_even.json. None when the target runs in an engine (no local model to time). Timed while
        generation shares the machine: greedy and speculative alternate, so the load hits both alike."""
        from eaglekit.analysis.break_even import BreakEven
        from eaglekit.analysis.checkpoints import load_draft_checkpoint
        from eaglekit.analysis.stage import timed_loop

        path = self.staged_dir / BREAK_EVEN_FILE
        if path.exists():
            saved = read_json(path, "delete it to measure the break-even again")
            return BreakEven(**{**saved, "assumptions": tuple(saved["assumptions"])})
        _, source, _ = self._load_target()
        if self._target[2] is not None:
            return None
        smallest = record.done_sizes()[0]
        draft = load_draft_checkpoint(Path(record.slices[smallest].result["best_checkpoint"]), self._head.embed_tokens)
        prompts, _, case = timed_loop(self.params, source, draft, heldout, [int(self._tokenizer.eos_token_id)])
        write_json(path, case.to_dict())
        logger.info("staged run: this target's break-even tau %.3f, from the real loop with the %d-sample draft on %d held-out prompts "
                    "(staged/%s; stage 6 measures it again with the largest draft)", case.break_even_accept_length, smallest,
                    len(prompts), BREAK_EVEN_FILE)
        return case

    # ---- the target, loaded once for every slice --------------------------------------------------
    @functools.cached_property
    def _tokenizer(self):
        from eaglekit.target import load_tokenizer

        return load_tokenizer(self.params.target)

    def _load_target(self):
        if self._target is None:
            from eaglekit.capture.layers import resolve_capture_layer_ids
            from eaglekit.capture.stage import capture_length, load_feature_source
            from eaglekit.target import resolve_model, target_layout

            params = self.params
            layout = target_layout(resolve_model(params.target.model, revision=params.target.revision),
                                   trust_remote_code=params.target.trust_remote_code)
            layer_ids = resolve_capture_layer_ids(params.target.capture_layers or None, layout.num_hidden_layers)
            model, engine = load_feature_source(params, layout, layer_ids, capture_length(params), self.staged_dir / "capture")
            self._target = (layout, engine or model, engine, layer_ids)
        layout, source, _, layer_ids = self._target
        return layout, source, layer_ids

    @functools.cached_property
    def _head(self):
        from eaglekit.draft.model import load_target_head_weights

        return load_target_head_weights(self._load_target()[0])

    def _close(self) -> None:
        if self._target is not None and self._target[2] is not None:
            self._target[2].close()


def staged_summary(run_dir: str | os.PathLike) -> dict:
    """What the staged run did, for the runner's state.json: the sizes staged and the last forecast's
    verdict."""
    from eaglekit.staged.slices import read_forecast_history

    path = StagedRecord.path(run_dir)
    record = read_json(path, START_OVER) if path.exists() else {"slices": []}
    history = read_forecast_history(run_dir)
    return {"sizes_done": [entry["size"] for entry in record["slices"] if entry["status"] == "done"],
            "forecasts": len(history), "verdict": history[-1]["verdict"] if history else None}

