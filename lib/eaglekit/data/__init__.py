"""Stages 1 and 2: dataset sources, readers, format adapters, packaged data, the survey and prompt prep.

Each stage is one call in `eaglekit.data.stage`: `run_survey_stage(params, run_dir)` and
`run_prep_stage(params, run_dir)`.
"""
