"""The staged run (`eaglekit run ... --staged`): stages 4-6 on each finished slice while stage 3 answers, and
the go / no-go forecast rewritten after each size (`worker.StagedWorker`); which slices are settled and what
each staged size trained on (`slices`)."""

from eaglekit.staged.slices import (FORECASTS_FILE, SLICES_FILE, STAGED_DIR, Prefix, Settled, SliceEntry, StagedRecord,
                                    read_forecast_history, settled_prefix, slice_for)
