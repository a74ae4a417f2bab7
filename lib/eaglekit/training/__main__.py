"""python -m eaglekit.training (what torchrun launches for several processes): an alias of
`eaglekit train`."""

import sys

from eaglekit.cli import main

raise SystemExit(main(["train", *sys.argv[1:]]))
