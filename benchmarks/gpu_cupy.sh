#!/usr/bin/env bash
# GPU host: CuPy kernels compiled by a fresh process A run in a fresh process B from one shared
# file:// store, with 0 NVRTC kernel compiles in B; both times to first result printed.
# Usage (from the repository root): OUT=/some/dir bash benchmarks/gpu_cupy.sh
# Writes $OUT/cupy_gpu.json and $OUT/cupy_gpu.log; exits 0 on PASS. Needs cupy (14.2), numpy, a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
timeout 170 "$PY" tests/gpu/cupy_node.py --drive "$OUT" 2>&1 | tee "$OUT/cupy_gpu.log"
exit "${PIPESTATUS[0]}"
