#!/usr/bin/env bash
# Issue 16's GPU checks in one run on the lent GPU machine (the `device` tool), logs under
# $OUT: the CUDA tests (tests/device: model parity in fp32 and bf16, generation log-probs,
# a checkpoint round trip, a GRPO run), bench/rehearsal_check.py (a training step's rehearsed
# peak beside torch.cuda.max_memory_allocated) and bench/gpu.sh (decode and training throughput,
# HBM roofline and MFU, GRPO step against TRL where TRL is there).
#   here, first:  bash bench/device_wheels.sh
#   then:         run(command="bash bench/device_check.sh", carry=[".whl"], timeout_s=540)
# Here, without a GPU, `RLLOOM_TEST_DEVICE=cpu bash bench/device_check.sh` runs the tests on
# the CPU (gpu.sh then says there is no GPU and exits 0).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
PY=${PYTHON:-python3}
if [ -d .whl ] && command -v nvidia-smi >/dev/null; then  # the wheels are for the GPU image
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi > "$OUT/nvidia_smi.txt" 2>&1
"$PY" -m pytest -q -p no:cacheprovider tests/device 2>&1 | tee "$OUT/device_tests.log"
# issue 53: the rehearsal's peak beside torch.cuda.max_memory_allocated on the same step
"$PY" bench/rehearsal_check.py 2>&1 | tee "$OUT/rehearsal_check.log"
PYTHON=$PY bash bench/gpu.sh 2>&1 | tee "$OUT/gpu_bench.log"
echo "logs in $OUT"
