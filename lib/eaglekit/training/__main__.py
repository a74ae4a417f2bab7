"""python -m eaglekit.training (or under torchrun): stage 5 from params; the same as `eaglekit train`."""

from eaglekit.training.stage import main

raise SystemExit(main())
