#!/usr/bin/env bash
# One prepared GPU check for one H100/H200 (under 10 minutes): every `gpu`-marked test, then the
# training-step benchmark at 4K packs for a Llama-3.1-8B-shaped draft (hidden 4096, 32 heads, 8 KV heads,
# intermediate 14336, vocab 128256, draft vocab 32000, bf16 autocast) with and without activation
# checkpointing, printing achieved TFLOP/s and the share of dense bf16 peak. The peak used is 989 TFLOP/s
# (H100/H200 SXM dense bf16, no sparsity; override with PEAK_TFLOPS=...). Then the 16K-token,
# hidden-7168 memory figure. Each section prints its own figures; the script stops at the first failure.
#
#   bash bench/gpu_check.sh                  # from the repository root; PYTHON=... to pick the interpreter
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
PEAK_TFLOPS="${PEAK_TFLOPS:-989}"

if ! "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check: no CUDA device visible to $PYTHON (torch.cuda.is_available() is False):" \
         "run this on a GPU machine with a CUDA build of torch; nothing was run" >&2
    exit 2
fi
"$PYTHON" -c 'import torch; print("device:", torch.cuda.get_device_name(0), "| torch", torch.__version__, "| CUDA", torch.version.cuda)'
nvidia-smi --query-gpu=name,memory.total,utilization.gpu --format=csv,noheader 2>/dev/null || true

echo "== 1. gpu-marked tests (pytest -m gpu) =="
timeout 300 "$PYTHON" -m pytest -q -m gpu tests -p no:cacheprovider

echo "== 1b. SGLang capture against the transformers hooks (needs sglang==0.5.23 installed; skips without it) =="
timeout 300 "$PYTHON" -m pytest -q -s -m gpu tests/capture/test_sglang_capture.py -p no:cacheprovider || echo "gpu_check: SGLang capture test failed or SGLang is absent (pip install sglang==0.5.23)"

echo "== 2. training step, Llama-3.1-8B-shaped draft, 4K packs, bf16, peak ${PEAK_TFLOPS} TFLOP/s =="
timeout 240 "$PYTHON" bench/train_step.py --device cuda --preset llama8b --draft-vocab 32000 --pack-tokens 4096 --max-length 4096 \
    --samples 16 --skip-naive --checkpointing --repeats 3 --peak-tflops "$PEAK_TFLOPS"

echo "== 3. training memory plan, 16K-token pack at hidden 7168 (dry run, no GPU memory used) =="
timeout 60 "$PYTHON" bench/train_step.py --memory-plan
echo "gpu_check: done"
