"""Stage 3: regenerate class-B prompts through the target's endpoints, resumable over days.

The engine keeps each partition's concurrency full: a new request starts the moment one finishes
(never waves that wait for their slowest member), partitions run in the order given (default short,
then long), and requests go to the least busy healthy endpoint (`eaglekit.generation.client`).

Files in output_dir, all append-only JSONL (torn last line repaired on open):
- generations.jsonl: one record per finished prompt (truncated ones included, flagged). Its small
  fields come first and `content` after them, so readers that need no text (resume, counters, the
  notebook's tables) parse only the head of each line: memory and time do not grow with the answers.
- errors.jsonl: prompts whose last attempt failed for good (a 400/413/422, or transient failures past
  the attempt limit), with the server's message and the history of earlier failed sessions. A
  retried prompt that fails again is appended with its whole history; the file is compacted to one
  line per still-failing prompt at the start and end of every session.
- metrics.jsonl: one line per log interval (cumulative counts, rates, in flight, ETA), `final` last.
- sessions.jsonl: one line per session (start time, what it had to do).
- endpoints.json: what each endpoint's probe found.

Resume is by stable (dataset, id), never by line count: outputs arrive out of order. A record is
written once, when its answer is complete; a kill at any moment loses at most the answers not yet
written (they are requested again), so the final file holds every prompt exactly once. Errored
prompts are retried once per session (`retry_errors`); nothing finished is requested again.

What stops a run: Ctrl-C or SIGTERM (in-flight requests get `shutdown_grace_s`, then are abandoned
and requested again on resume; SIGTERM exits 143), and an endpoint refusing the API key (401/403:
`EndpointAuthError`, raised at once; no prompt is marked failed by it).

Modules, in dependency order: `settings` (the retry backoff, the settings a resume keeps), `prompts` (the
prompts files as requests), `quality` (answer flags), `errors` (what an HTTP status or a fault means for the
run), `client` (endpoints, probing, routing), `logs` (readers of the files above, counters, the progress
line), `engine` (the async engine), `run` (`generate`, the blocking entry point), `server` (the embedded
server), `capacity` and `plan` (the capacity plan before launch), `tokenized` (`build_tokenized_data`:
generations into `tokenized_data.jsonl` per dataset, the DESIGN contract), and `stage`
(`run_generation_stage(params, run_dir)`, what notebook 03 computes; imported from
`eaglekit.generation.stage`).
"""

from eaglekit.generation.engine import GenerationEngine
from eaglekit.generation.logs import (
    GenerationLog, finished_keys, generation_table, read_generations, summarize_generations)
from eaglekit.generation.prompts import PromptSource
from eaglekit.generation.quality import has_repetition_loop, quality_flags
from eaglekit.generation.run import generate, run_engine
