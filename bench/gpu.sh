#!/usr/bin/env bash
# The benchmarks on a CUDA GPU: `bash bench/gpu.sh [--hw NAME]` (NAME from rlloom.perf.hardware;
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

# generate.py, train_step.py and grpo_step.py have no --device flag: they build their models on
# the CPU and never move them (rlloom's single-process trainer has no device setting, and the
# TRL side is pinned to use_cpu), so here they measure the host CPU, as a baseline next to the
# GPU numbers below. --threads 0 is not accepted, so give them the machine's cores.
THREADS=$(nproc)
echo "== bench/generate.py (CPU, $THREADS threads)"
"$PY" bench/generate.py --threads "$THREADS"
echo "== bench/train_step.py (CPU, $THREADS threads)"
"$PY" bench/train_step.py --threads "$THREADS"
echo "== bench/grpo_step.py (CPU, $THREADS threads)"
if "$PY" -c "import trl" 2>/dev/null; then
    "$PY" bench/grpo_step.py --threads "$THREADS"
else
    echo "skipped: TRL is not installed (pip install -e '.[bench]')"
fi

echo "== bench/gpu_roofline.py (GPU)"
"$PY" bench/gpu_roofline.py "$@"
