"""python -m eaglekit.capture (or under torchrun): stage 4 capture; the same as `eaglekit capture`."""

from eaglekit.capture import main

raise SystemExit(main())
