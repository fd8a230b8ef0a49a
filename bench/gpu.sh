#!/usr/bin/env bash
# The benchmarks on a CUDA GPU: `bash bench/gpu.sh [--hw NAME]` (NAME from rlloom.perf.model.hardware;
# default: picked from the device name). A machine without a GPU gets a message and exit 0, so
# the script is safe to call anywhere; CI does not run it.
set -euo pipefail

cd "$(dirname "$0")/.."
PY=${PYTHON:-python}

if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "no GPU: nvidia-smi not found; nothing to run"
    exit 0
fi
# A driver without a usable device, or a CPU-only torch build, still means nothing to measure.
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "no GPU: torch.cuda.is_available() is False (torch $("$PY" -c \
        'import torch; print(torch.__version__)')); nothing to run"
    exit 0
fi

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

# The side-by-side benchmarks on the GPU in bf16, the built-in model's shape and a wider one
# (--big: hidden 512, 4 layers), since the tiny one only measures kernel-launch overhead there.
echo "== bench/generate.py (GPU)"
"$PY" bench/generate.py --device cuda --big
echo "== bench/train_step.py (GPU)"
"$PY" bench/train_step.py --device cuda --big
echo "== bench/grpo_step.py (GPU, fp32 both sides)"
if "$PY" -c "import trl" 2>/dev/null; then
    "$PY" bench/grpo_step.py --device cuda
else
    echo "skipped: TRL is not installed (pip install -e '.[bench]')"
fi

echo "== bench/gpu_roofline.py (GPU)"
"$PY" bench/gpu_roofline.py "$@"
