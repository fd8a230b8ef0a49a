#!/usr/bin/env bash
# Before a lease of the GPU machine (the `device` tool), here: fetch into .whl/ the wheels
# of rlloom's dependencies that the machine's image lacks (its package list:
# /work/.library/device/KINDS.md; it has torch, transformers, safetensors, rich, pyyaml,
# numpy, pyarrow, but not these), for its Python 3.12. The run then carries .whl
# (`carry: [".whl"]`) and bench/device_check.sh installs them.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl \
    pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
    math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 \
    datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
du -sh .whl
