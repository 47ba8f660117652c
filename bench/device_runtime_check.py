"""The GPU runtime's machinery on the real device (part 2 of bench/device_check.sh): writes device_runtime.json.

1. The row-scatter kernel through dspark.trt.cuda.CudaRuntime (cuda-python allocations, pinned staging, async
   copies) against the numpy reference, and the same launch captured into a CUDA graph and replayed.
2. Copy/compute overlap: pinned, double-buffered uploads on the copy stream while the compute stream runs matmuls
   (cupy on our stream), events between them; the fraction of copy time hidden behind compute.
3. The streaming backend end to end on a tiny bundle (given with --bundle): caches, appends, bound buffers and
   pinned I/O on the device, the graphs themselves on ONNX Runtime CPU (no TensorRT here); greedy and sampled
   tokens must equal the ONNX Runtime backend's.
--emulate runs 1 and 3 on tests/gpu_emulator.py instead of a GPU (a CPU smoke test of this script).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def scatter_check(cuda, rng, trials: int = 60) -> dict:
    """Random append tables, as the runtime issues them: split into waves of disjoint destinations and queued
    through Device.flush (one index upload per flush; several flushes back to back, no sync between), against the
    in-order reference. Also counts how often a single unsplit launch differs (rows written twice race)."""
    from dspark.ops.scatter_rows.reference import scatter_rows
    from dspark.trt.stream import Device, Staging, _Appends

    dev = Device(cuda)
    bad = unsplit_bad = overlapping = 0
    for _ in range(trials):
        p, bs, h, ts, bd, td, w = (int(rng.integers(1, k)) for k in (5, 5, 4, 9, 6, 40, 70))
        src = rng.standard_normal((p, bs, h, ts, w)).astype(np.float32)
        dst = rng.standard_normal((p, bd, h, td, w)).astype(np.float32)
        tables = []
        for _ in range(int(rng.integers(1, 4))):  # flushes in a row
            n = int(rng.integers(1, bs + 1))
            tables.append(np.stack([rng.integers(0, bs, n), rng.integers(0, bd, n), rng.integers(-2, td, n),
                                    rng.integers(0, ts + 1, n)]).astype(np.int64))
        s_ptr, d_ptr, i_ptr = dev.alloc(src.nbytes), dev.alloc(dst.nbytes), dev.alloc(tables[0].nbytes)
        stage = Staging(dev)
        for ptr, arr in ((s_ptr, src), (d_ptr, dst), (i_ptr, tables[0])):
            host_ptr, view = stage.view(0, arr.shape, arr.dtype)
            view[...] = arr
            cuda.copy(ptr, host_ptr, arr.nbytes, dev.compute)
            cuda.sync_stream(dev.compute)
        # 1. the first table as one launch, as the runtime issued it before waves
        n = tables[0].shape[1]
        cuda.scatter_rows(s_ptr, d_ptr, p, bs, h, ts, bd, td, w, i_ptr, n, int(tables[0][3].max()), dev.compute)
        got = np.empty_like(dst)
        cuda.copy(got.ctypes.data, d_ptr, got.nbytes, dev.compute)
        cuda.sync_stream(dev.compute)
        want = dst.copy()
        scatter_rows(src, want, *tables[0])
        unsplit_bad += not np.array_equal(got, want)
        # 2. every table through the runtime's queue
        cuda.copy(d_ptr, dst.ctypes.data, dst.nbytes, dev.compute)
        cuda.sync_stream(dev.compute)
        appends = _Appends(dev.lease(stage), d_ptr, p, bd, h, td, w)
        source = dev.tensor(s_ptr, (p, 1, bs, h, ts, w))  # a K/V-shaped view: batch rows at 2, rows at 4
        want = dst.copy()
        for table in tables:
            rows = [r for e in table.T for r in ((int(e[1]), k) for k in range(max(e[2], 0), e[2] + min(e[3], ts)))
                    if 0 <= r[1] < td]
            overlapping += len(rows) != len(set(rows))
            for s, d, at, count in table.T:
                appends.add(source, int(s), int(d), int(at), int(count))
            dev.flush()
            scatter_rows(src, want, *table)
        cuda.copy(got.ctypes.data, d_ptr, got.nbytes, dev.compute)
        cuda.sync_stream(dev.compute)
        bad += not np.array_equal(got, want)
        for ptr in (s_ptr, d_ptr, i_ptr):
            dev.free(ptr)
    # a captured launch replays with fresh contents at the same addresses
    src = rng.standard_normal((1, 2, 1, 4, 8)).astype(np.float32)
    s_ptr, d_ptr, i_ptr = dev.alloc(src.nbytes), dev.alloc(src.nbytes, zero=True), dev.alloc(4 * 8)
    table = np.array([[1], [0], [0], [4]], dtype=np.int64)
    cuda.copy(i_ptr, table.ctypes.data, table.nbytes, dev.compute)
    exe = cuda.capture(dev.compute, lambda: cuda.scatter_rows(s_ptr, d_ptr, 1, 2, 1, 4, 2, 4, 8, i_ptr, 1, 4,
                                                              dev.compute))
    replay_ok = True
    for k in range(3):
        fresh = src + k
        cuda.copy(s_ptr, fresh.ctypes.data, fresh.nbytes, dev.compute)
        cuda.replay(exe, dev.compute)
        got = np.empty_like(src)
        cuda.copy(got.ctypes.data, d_ptr, got.nbytes, dev.compute)
        cuda.sync_stream(dev.compute)
        replay_ok &= bool(np.array_equal(got[:, 0], fresh[:, 1]))
    return {"scatter_trials": trials, "scatter_mismatches": int(bad), "tables_writing_a_row_twice": overlapping,
            "unsplit_launch_mismatches": int(unsplit_bad), "graph_replay_ok": replay_ok}


def overlap_check(cuda, megabytes: int = 64, steps: int = 20) -> dict:
    """Ping-pong: upload slot i % 2 on the copy stream while the compute stream works on slot (i - 1) % 2."""
    import cupy as cp

    from dspark.trt.stream import Device

    dev = Device(cuda)
    nbytes = megabytes << 20
    pinned = [cuda.host_alloc(nbytes) for _ in range(2)]
    device = [dev.alloc(nbytes) for _ in range(2)]
    uploaded = [cuda.event() for _ in range(2)]
    consumed = [cuda.event() for _ in range(2)]
    compute = cp.cuda.ExternalStream(dev.compute)
    with compute:
        a = cp.random.standard_normal((4096, 4096), dtype=cp.float32)

    def work():
        with compute:
            for _ in range(2):
                a @ a

    def timed(fn) -> float:
        cuda.sync_stream(dev.copy), cuda.sync_stream(dev.compute)
        t0 = time.perf_counter()
        fn()
        cuda.sync_stream(dev.copy), cuda.sync_stream(dev.compute)
        return time.perf_counter() - t0

    def copies():
        for i in range(steps):
            cuda.copy(device[i % 2], pinned[i % 2][0], nbytes, dev.copy)

    def computes():
        for _ in range(steps):
            work()

    def both():
        for i in range(steps):
            s = i % 2
            cuda.wait(dev.copy, consumed[s])  # slot s is free once the compute that read it is done
            cuda.copy(device[s], pinned[s][0], nbytes, dev.copy)
            cuda.record(uploaded[s], dev.copy)
            cuda.wait(dev.compute, uploaded[s])
            work()
            cuda.record(consumed[s], dev.compute)

    for fn in (copies, computes, both):  # warm-up
        timed(fn)
    t_copy = float(np.median([timed(copies) for _ in range(3)]))
    t_comp = float(np.median([timed(computes) for _ in range(3)]))
    t_both = float(np.median([timed(both) for _ in range(3)]))
    hidden = (t_copy + t_comp - t_both) / t_copy
    return {"copy_s": t_copy, "compute_s": t_comp, "pingpong_s": t_both, "copy_GBps": steps * nbytes / t_copy / 1e9,
            "hidden_fraction": max(0.0, min(1.0, hidden))}


def backend_check(cuda, bundle: Path, emulate: bool) -> dict:
    from gpu_emulator import device_ort_backend, emulated_backend

    from dspark.bundle import Manifest
    from dspark.runtime.decoder import Decoder
    from dspark.runtime.ort_backend import OrtBackend

    prompts = [[1, 4, 2, 0, 3], [5, 2], [5, 1, 1, 3, 0, 0, 2, 4], [3], [0, 4, 4, 1]]
    man = Manifest.read(bundle)
    out = {}
    for temperature in (0.0, 1.0):
        runs = []
        for kind in ("onnxruntime", "device"):
            if kind == "onnxruntime":
                backend, m = OrtBackend(bundle, man), man
            elif emulate:
                backend, m = emulated_backend(bundle, max_batch=3, max_context=96)
            else:
                backend, m = device_ort_backend(cuda, bundle, max_batch=3, max_context=96)
            dec = Decoder(backend, m, prompts, 24, temperature=temperature, seed=4, batch_size=3)
            for _ in dec:
                pass
            runs.append([r.token_ids for r in dec.results])
        out[f"tokens_equal_T{temperature:g}"] = runs[0] == runs[1]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--bundle", type=Path, help="A tiny bundle (tests/tiny.py) for the end-to-end check.")
    ap.add_argument("--emulate", action="store_true", help="No GPU: run on tests/gpu_emulator.py.")
    args = ap.parse_args()
    from dspark.ops.kernels import build_kernel

    rng = np.random.default_rng(0)
    if args.emulate:
        from gpu_emulator import EmulatedCuda

        cuda = EmulatedCuda()
    else:
        from dspark.trt.cuda import CudaRuntime

        cuda = CudaRuntime(build_kernel(Path("/tmp/dspark-kernel"), archs=("90",)))
    result = {"emulated": args.emulate, **scatter_check(cuda, rng)}
    if not args.emulate:
        result["overlap"] = overlap_check(cuda)
    if args.bundle:
        result.update(backend_check(cuda, args.bundle, args.emulate))
    args.out.mkdir(parents=True, exist_ok=True)
    name = "device_runtime_emulated.json" if args.emulate else "device_runtime.json"
    (args.out / name).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    ok = result["scatter_mismatches"] == 0 and result["graph_replay_ok"] and all(
        v for k, v in result.items() if k.startswith("tokens_equal"))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
