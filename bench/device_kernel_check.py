"""dspark::ConfidenceTruncate's CUDA kernel on the real device (part 1 of bench/device_check.sh).

Builds libdspark_kernels.so with nvcc, launches the kernel through its C entry point (ctypes, raw cupy device
pointers) on random batches in all three modes and both layouts, compares verify_len and verify_mask with the
numpy reference bit for bit, and times one launch per mode at batch 8, 64 and 256 (CUDA events over 200 launches,
replayed from a CUDA graph and issued eagerly; rank_only is top-K with a zero budget: the candidate ranking alone).
Writes device_kernel.json (or device_kernel_memcheck.json with --no-timing, the run under compute-sanitizer).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dspark.ops.confidence_truncate import reference as ref  # noqa: E402
from dspark.ops.kernels import build_kernel  # noqa: E402


class Kernel:
    """The C entry point with cupy arrays in, verify_len / verify_mask as cupy arrays out."""

    def __init__(self, lib_path: Path):
        import cupy as cp

        self.cp = cp
        self.lib = ctypes.CDLL(str(lib_path))
        self.lib.dspark_confidence_truncate.restype = ctypes.c_int

    def args(self, survival, threshold, sps, budget, active, mode: int, layout: int) -> tuple:
        cp = self.cp
        b, bk = survival.shape
        dev = [cp.asarray(np.ascontiguousarray(x)) for x in (
            survival.astype(np.float32), threshold.astype(np.float32), sps.astype(np.float32),
            np.asarray(budget, np.int64).reshape(1), np.asarray(active).astype(np.uint8),
            np.array([mode], np.int64), np.array([layout], np.int64))]
        out = (cp.zeros(b, cp.int64), cp.zeros((b, bk), cp.uint8))
        return dev, out, len(sps)

    def launch(self, dev, out, n_sps: int, stream: int = 0) -> int:
        p = lambda a: ctypes.c_void_p(a.data.ptr)  # noqa: E731
        b, bk = out[1].shape
        return self.lib.dspark_confidence_truncate(p(dev[0]), p(dev[1]), p(dev[2]), ctypes.c_int(n_sps), p(dev[3]),
                                                   p(dev[4]), p(dev[5]), p(dev[6]), ctypes.c_int(b),
                                                   ctypes.c_int(bk), p(out[0]), p(out[1]), ctypes.c_void_p(stream))


def random_case(rng, max_batch: int):
    b, bk, n = int(rng.integers(1, max_batch + 1)), int(rng.integers(1, 9)), int(rng.integers(1, 600))
    surv = np.cumprod(rng.random((b, bk)) ** 0.4, axis=1).astype(np.float32)
    if rng.random() < 0.25:  # ties
        surv = np.round(surv, 1).astype(np.float32)
    thr = rng.random(b).astype(np.float32)
    sps = (rng.random(n) * 100 + 1).astype(np.float32)
    budget = np.array([rng.integers(0, b * bk + 2)], np.int64)
    active = rng.random(b) < 0.8
    return surv, thr, sps, budget, active


def agreement(kernel: Kernel, rng, trials: int) -> dict:
    cp = kernel.cp
    cases = mismatches = failed = 0
    for t in range(trials):
        case = random_case(rng, 256 if t % 10 == 9 else 64)
        for mode in (ref.STATIC, ref.SCHEDULE, ref.TOPK):
            for layout in (ref.FLAT, ref.PADDED):
                dev, out, n = kernel.args(*case, mode, layout)
                rc = kernel.launch(dev, out, n)
                cp.cuda.runtime.deviceSynchronize()
                want_len, want_mask = ref.confidence_truncate(*case, mode, layout)
                cases += 1
                failed += rc != 0
                mismatches += rc != 0 or not np.array_equal(cp.asnumpy(out[0]), want_len) or \
                    not np.array_equal(cp.asnumpy(out[1]).astype(bool), want_mask)
    return {"cases": cases, "mismatches": int(mismatches), "launch_errors": int(failed)}


def timing(kernel: Kernel, rng, launches: int = 200) -> dict:
    """Microseconds a launch, two ways: `graph` replays `launches` launches captured in one CUDA graph (the kernel's
    own time, as a captured decode step sees it); `eager` issues them one by one from Python (bound by the host's
    ctypes call at small batches)."""
    cp = kernel.cp
    result: dict[str, dict] = {"graph": {}, "eager": {}}
    stream = cp.cuda.Stream(non_blocking=True)
    for b in (8, 64, 256):
        bk = 7
        surv = np.cumprod(rng.random((b, bk)), axis=1).astype(np.float32)
        case = (surv, rng.random(b).astype(np.float32), (rng.random(b * 8) * 100 + 1).astype(np.float32),
                np.array([b * 3]), np.ones(b, bool))
        for mode, name in ((ref.STATIC, "static"), (ref.SCHEDULE, "schedule"), (ref.TOPK, "topk"),
                           (ref.TOPK, "rank_only")):  # top-K with a zero budget: the ranking without the walk
            dev, out, n = kernel.args(*case[:3], np.array([0 if name == "rank_only" else b * 3]), case[4], mode,
                                      ref.PADDED)
            if kernel.launch(dev, out, n, stream.ptr) != 0:
                raise SystemExit(f"launch failed at batch {b}, mode {name}")
            stream.begin_capture()
            for _ in range(launches):
                kernel.launch(dev, out, n, stream.ptr)
            graph = stream.end_capture()
            for how in ("graph", "eager"):
                start, end = cp.cuda.Event(), cp.cuda.Event()
                for timed in (False, True):  # a warm-up pass, then the timed one
                    start.record(stream)
                    if how == "graph":
                        graph.launch(stream)
                    else:
                        for _ in range(launches):
                            kernel.launch(dev, out, n, stream.ptr)
                    end.record(stream)
                    end.synchronize()
                result[how][f"batch{b}_{name}_us"] = round(cp.cuda.get_elapsed_time(start, end) * 1000 / launches, 2)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--trials", type=int, default=400, help="Random batches (each in 3 modes x 2 layouts).")
    ap.add_argument("--no-timing", action="store_true", help="Agreement only (for the compute-sanitizer run).")
    args = ap.parse_args()
    t0 = time.time()
    lib = build_kernel(Path("/tmp/dspark-kernel"), archs=("80", "90"))
    result = {"build_s": round(time.time() - t0, 1)}
    kernel = Kernel(lib)
    if args.no_timing:  # plain cudaMalloc per array, so memcheck sees each buffer's bounds (not the pool's)
        kernel.cp.cuda.set_allocator(None)
    props = kernel.cp.cuda.runtime.getDeviceProperties(0)
    result["device"] = props["name"].decode()
    result["compute_capability"] = f"{props['major']}.{props['minor']}"
    rng = np.random.default_rng(0)
    result.update(agreement(kernel, rng, args.trials))
    if not args.no_timing:
        result["timing"] = timing(kernel, rng)
    args.out.mkdir(parents=True, exist_ok=True)
    name = "device_kernel_memcheck.json" if args.no_timing else "device_kernel.json"
    (args.out / name).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    sys.exit(1 if result["mismatches"] else 0)


if __name__ == "__main__":
    main()
