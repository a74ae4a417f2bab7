"""python -m eaglekit.capture (what torchrun launches for data-parallel capture): an alias of
`eaglekit capture`."""

import sys

from eaglekit.cli import main

raise SystemExit(main(["capture", *sys.argv[1:]]))
