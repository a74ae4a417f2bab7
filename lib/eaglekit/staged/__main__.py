"""`python -m eaglekit.staged --params P --run-dir D [--generation-fd N]`: the staged worker, as the runner starts it.

The runner passes the run folder's lock (inherited, so this process is a writer under the same lock, never a
second one) and the read end of a pipe it closes when stage 3 ends. Run by hand on a run folder whose generation
has ended, it stages nothing new: it only finishes a size a stopped worker left in training.
"""

from __future__ import annotations

import argparse
import logging
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eaglekit.staged", description=__doc__)
    parser.add_argument("--params", required=True, help="the run folder's params.yaml")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--generation-fd", type=int, help="a pipe that reaches EOF when stage 3 ends (the runner's)")
    args = parser.parse_args(argv)

    from eaglekit.config import load_params
    from eaglekit.runner import attach_stage_logging
    from eaglekit.staged.worker import GenerationSignal, StagedWorker

    attach_stage_logging()  # run.log and the runner's stderr, tagged [staged]
    try:
        params = load_params(args.params)
        StagedWorker(params, args.run_dir, GenerationSignal(args.generation_fd)).run()
    except KeyboardInterrupt:
        logging.getLogger("eaglekit.staged").warning("staged worker stopped; a resume continues the size it was on")
        return 130
    except Exception:
        logging.getLogger("eaglekit.staged").exception("staged worker failed")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
