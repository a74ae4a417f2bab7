"""Stage 6: acceptance analysis. `stage.run_analysis_stage(params, run_dir)` is the stage's one entry
(notebook 06).

Modules, by job:
- decoding: `speculative` (the reference greedy loop, chain and tree: propose, verify, accept, roll back),
  `tree` (SGLang's draft tree: grow, select, accept), `offline_estimate` (the draft scored along one sequence
  without decoding, beside the loop);
- accept length: `acceptance` (tau from agreement tables, per position, bootstrap intervals);
- evaluators: `checkpoints` (the sweep's training checkpoints: offline on held-out samples, the largest
  through the real loop), `evaluate` (one exported draft folder on a prompts file: `eaglekit evaluate`),
  `benchmark` (every checkpoint on prompts from outside the training data), `topology_sweep` (which chain or
  tree to serve);
- serving: `live_serving` (tau and tokens/s against SGLang and vLLM endpoints), `vllm_counters` (vLLM's
  /metrics counters);
- the answer: `break_even` (Leviathan speedup, break-even tau), `curves` (the curve families of tau against
  data size, fitted on every bootstrap replicate: the one fitting path), `scaling` (the local slope, whether a
  ceiling is identified), `forecast` (go / no-go at the planned sizes, analysis/answer.json), `answer`
  (scaling_summary.json, the headline metrics, the answer in words), `plots` (figures).

This package's `__init__` imports nothing: `eaglekit.training` imports `analysis.acceptance`, and the stage
and evaluators import `eaglekit.training`.
"""
