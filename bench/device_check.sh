#!/usr/bin/env bash
# One short script for a task that has the GPU device (about 2 minutes; the issue allows 6):
#  1. bench/device_kernel_check.py: builds the CUDA kernels with nvcc (sm_80, sm_90), checks dspark::ConfidenceTruncate
#     against the numpy reference on random batches in every mode and layout, and times it -> device_kernel.json;
#     then the same check on fewer batches under compute-sanitizer's memcheck (out-of-bounds and misaligned accesses
#     the output comparison cannot see) -> device_kernel_memcheck.json + memcheck.log.
#  2. bench/device_runtime_check.py: the GPU runtime's cuda-python machinery for real (row-scatter kernel, CUDA-graph
#     replay, pinned double-buffered copy/compute overlap) and, given a tiny bundle, the TensorRT backend end to end
#     -> device_runtime.json. Make the tiny bundle on a CPU machine first (the device needs no torch export):
#       python -c "import sys; sys.path.insert(0, 'tests'); from support.tiny import tiny_bundle; \
#                  tiny_bundle('build/tiny/bundle', family='llama', vocab=6, layers=2, block_size=3, seed=11)"
#     and pass it: bench/device_check.sh build/tiny/bundle
# Writes to ${OUT:-bench/results}; exits non-zero if any part fails, after running them all.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-bench/results}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv,noheader || true
status=0
python3 bench/device_kernel_check.py --out "$out" || status=1
if command -v compute-sanitizer >/dev/null; then
  timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 --log-file "$out/memcheck.log" \
    python3 bench/device_kernel_check.py --out "$out" --trials 20 --no-timing || status=1
  tail -n 3 "$out/memcheck.log" || true
else
  echo "compute-sanitizer not found: memcheck skipped"
fi
python3 bench/device_runtime_check.py --out "$out" ${1:+--bundle "$1"} || status=1
exit $status
