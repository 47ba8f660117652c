#!/usr/bin/env bash
# One short script for a task that has the GPU device (< 6 minutes):
#  1. builds the dspark::ConfidenceTruncate kernel with nvcc, checks it against the numpy reference on random
#     batches (cupy device memory, launched through ctypes) and times it -> device_check.json;
#  2. bench/device_runtime_check.py: the GPU runtime's cuda-python machinery for real (row-scatter kernel, CUDA-graph
#     replay, pinned double-buffered copy/compute overlap) and, given a tiny bundle, the streaming backend end to end
#     -> device_runtime.json. Make the tiny bundle on a CPU machine first (the device needs no torch export):
#       python -c "import sys; sys.path.insert(0, 'tests'); from tiny import tiny_bundle; \
#                  tiny_bundle('build/tiny/bundle', family='llama', vocab=6, layers=2, block_size=3, seed=11)"
#     and pass it: bench/device_check.sh build/tiny/bundle
# Writes to ${OUT:-bench/results}.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-bench/results}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader || true
status=0
python3 - "$out" <<'PY' || status=1
import ctypes, json, sys, time
from pathlib import Path

import numpy as np

sys.path.insert(0, ".")
from dspark.plugins import truncate_ref as ref
from dspark.plugins.build import build_kernel

out = Path(sys.argv[1])
t0 = time.time()
lib_path = build_kernel(Path("/tmp/dspark-kernel"), archs=("80", "90"))
build_s = time.time() - t0
lib = ctypes.CDLL(str(lib_path))
import cupy as cp  # device buffers; the launch goes through our C entry point with raw pointers

ptr = lambda a: ctypes.c_void_p(a.data.ptr)  # noqa: E731
lib.dspark_confidence_truncate.restype = ctypes.c_int
rng = np.random.default_rng(0)
mismatches, cases = 0, 0
for trial in range(400):
    b, bk, n = int(rng.integers(1, 65)), int(rng.integers(1, 9)), int(rng.integers(1, 600))
    surv = np.cumprod(rng.random((b, bk)) ** 0.4, axis=1).astype(np.float32)
    if trial % 4 == 0:
        surv = np.round(surv, 1).astype(np.float32)
    thr = rng.random(b).astype(np.float32)
    sps = (rng.random(n) * 100 + 1).astype(np.float32)
    budget = np.array([rng.integers(0, b * bk + 2)], np.int64)
    active = rng.random(b) < 0.8
    for mode in (0, 1, 2):
        for layout in (0, 1):
            d = [cp.asarray(x) for x in (surv, thr, sps, budget, active.astype(np.uint8),
                                         np.array([mode], np.int64), np.array([layout], np.int64))]
            vlen = cp.zeros(b, cp.int64)
            vmask = cp.zeros((b, bk), cp.uint8)
            rc = lib.dspark_confidence_truncate(ptr(d[0]), ptr(d[1]), ptr(d[2]), ctypes.c_int(n), ptr(d[3]), ptr(d[4]),
                                                ptr(d[5]), ptr(d[6]), ctypes.c_int(b), ctypes.c_int(bk), ptr(vlen),
                                                ptr(vmask), ctypes.c_void_p(0))
            cp.cuda.runtime.deviceSynchronize()
            want_len, want_mask = ref.confidence_truncate(surv, thr, sps, budget, active, mode, layout)
            cases += 1
            if rc != 0 or not np.array_equal(cp.asnumpy(vlen), want_len) or \
                    not np.array_equal(cp.asnumpy(vmask).astype(bool), want_mask):
                mismatches += 1
timing = {}
for b in (8, 64, 256):
    bk = 7
    surv = cp.asarray(np.cumprod(rng.random((b, bk)), axis=1).astype(np.float32))
    args = [cp.asarray(x) for x in (rng.random(b).astype(np.float32), (rng.random(b * 8) * 100 + 1).astype(np.float32),
                                    np.array([b * 3], np.int64), np.ones(b, np.uint8))]
    vlen, vmask = cp.zeros(b, cp.int64), cp.zeros((b, bk), cp.uint8)
    for mode in (0, 1, 2):
        mode_d, layout_d = cp.asarray(np.array([mode], np.int64)), cp.asarray(np.array([1], np.int64))
        call = lambda: lib.dspark_confidence_truncate(ptr(surv), ptr(args[0]), ptr(args[1]), ctypes.c_int(b * 8),  # noqa: E731
                                                      ptr(args[2]), ptr(args[3]), ptr(mode_d), ptr(layout_d),
                                                      ctypes.c_int(b), ctypes.c_int(bk), ptr(vlen), ptr(vmask),
                                                      ctypes.c_void_p(0))
        for _ in range(10):
            call()
        cp.cuda.runtime.deviceSynchronize()
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        for _ in range(200):
            call()
        end.record()
        end.synchronize()
        timing[f"batch{b}_mode{mode}_us"] = cp.cuda.get_elapsed_time(start, end) * 1000 / 200
result = {"build_s": build_s, "cases": cases, "mismatches": mismatches, "timing": timing,
          "device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode()}
(out / "device_check.json").write_text(json.dumps(result, indent=2))
print(json.dumps(result, indent=2))
sys.exit(1 if mismatches else 0)
PY
python3 bench/device_runtime_check.py --out "$out" ${1:+--bundle "$1"} || status=1
exit $status
