"""eaglekit: will more training data make an EAGLE-3 draft model fast enough? Measure it.

Modules, one concern each (import what you need; nothing heavy is imported here):
io (atomic files, JSONL), config (validated params), models (target resolution),
server (the embedded OpenAI-compatible server), runs (run folders, environment record),
runner and cli (papermill pipeline).
"""

__version__ = "0.1.0"
