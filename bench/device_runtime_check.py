"""The GPU runtime's machinery on the real device (part 2 of bench/device_check.sh): writes device_runtime.json.

1. The row-scatter kernel through dspark.trt.cuda.CudaRuntime (cuda-python allocations, pinned staging, async
   copies) against the numpy reference, and the same launch captured into a CUDA graph and replayed.
2. Copy/compute overlap: pinned, double-buffered uploads on the copy stream while the compute stream runs matmuls
   (cupy on our stream), events between them; the fraction of copy time hidden behind compute.
3. The TensorRT backend end to end on a tiny bundle (given with --bundle): caches, appends, bound buffers and
   pinned I/O on the device, the graphs themselves on ONNX Runtime CPU (no TensorRT here); greedy and sampled
   tokens must equal the ONNX Runtime backend's.
--emulate runs 1 and 3 on dspark.testing.gpu_emulator instead of a GPU (a CPU smoke test of this script).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the device machine runs this from a checkout, dspark not installed

from dspark.bundle import Manifest  # noqa: E402
from dspark.ops.kernels import build_kernel  # noqa: E402
from dspark.ops.scatter_rows.reference import scatter_rows  # noqa: E402
from dspark.runtime import DecodeOptions  # noqa: E402
from dspark.runtime.backend import create_backend  # noqa: E402
from dspark.runtime.decoder import Decoder  # noqa: E402
from dspark.testing.gpu_emulator import EmulatedCuda, device_ort_backend, emulated_backend  # noqa: E402
from dspark.trt.cuda import CudaRuntime  # noqa: E402
from dspark.trt.memory import Device, Staging  # noqa: E402
from dspark.trt.state import AppendQueue  # noqa: E402


def scatter_check(cuda, rng, trials: int = 60) -> dict:
    """Random append tables, as the runtime issues them: split into waves of disjoint destinations and queued
    through Device.flush (one index upload per flush; several flushes back to back, no sync between), against the
    in-order reference. Also counts how often a single unsplit launch differs (rows written twice race)."""
    device = Device(cuda)
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
        s_ptr, d_ptr, i_ptr = device.alloc(src.nbytes), device.alloc(dst.nbytes), device.alloc(tables[0].nbytes)
        stage = Staging(device)
        for ptr, array in ((s_ptr, src), (d_ptr, dst), (i_ptr, tables[0])):
            host_ptr, view = stage.view(0, array.shape, array.dtype)
            view[...] = array
            cuda.copy(ptr, host_ptr, array.nbytes, device.compute)
            cuda.sync_stream(device.compute)
        # 1. the first table as one launch, as the runtime issued it before waves
        n = tables[0].shape[1]
        cuda.scatter_rows(s_ptr, d_ptr, p, bs, h, ts, bd, td, w, i_ptr, n, int(tables[0][3].max()), device.compute)
        got = np.empty_like(dst)
        cuda.copy(got.ctypes.data, d_ptr, got.nbytes, device.compute)
        cuda.sync_stream(device.compute)
        want = dst.copy()
        scatter_rows(src, want, *tables[0])
        unsplit_bad += not np.array_equal(got, want)
        # 2. every table through the runtime's queue
        cuda.copy(d_ptr, dst.ctypes.data, dst.nbytes, device.compute)
        cuda.sync_stream(device.compute)
        appends = AppendQueue(device.lease(stage), d_ptr, p, bd, h, td, w)
        source = device.tensor(s_ptr, (p, 1, bs, h, ts, w))  # a K/V-shaped view: batch rows at 2, rows at 4
        want = dst.copy()
        for table in tables:
            rows = [r for e in table.T for r in ((int(e[1]), k) for k in range(max(e[2], 0), e[2] + min(e[3], ts)))
                    if 0 <= r[1] < td]
            overlapping += len(rows) != len(set(rows))
            for s, d, at, count in table.T:
                appends.add(source, int(s), int(d), int(at), int(count))
            device.flush()
            scatter_rows(src, want, *table)
        cuda.copy(got.ctypes.data, d_ptr, got.nbytes, device.compute)
        cuda.sync_stream(device.compute)
        bad += not np.array_equal(got, want)
        for ptr in (s_ptr, d_ptr, i_ptr):
            device.free(ptr)
    return {"scatter_trials": trials, "scatter_mismatches": int(bad), "tables_writing_a_row_twice": overlapping,
            "unsplit_launch_mismatches": int(unsplit_bad), "graph_replay_ok": replay_check(cuda, device, rng)}


def replay_check(cuda, device: Device, rng) -> bool:
    """A captured launch replays with fresh contents at the same addresses."""
    src = rng.standard_normal((1, 2, 1, 4, 8)).astype(np.float32)
    s_ptr, d_ptr, i_ptr = device.alloc(src.nbytes), device.alloc(src.nbytes, zero=True), device.alloc(4 * 8)
    table = np.array([[1], [0], [0], [4]], dtype=np.int64)
    cuda.copy(i_ptr, table.ctypes.data, table.nbytes, device.compute)
    graph = cuda.capture(device.compute, lambda: cuda.scatter_rows(s_ptr, d_ptr, 1, 2, 1, 4, 2, 4, 8, i_ptr, 1,
                                                                4, device.compute))
    replay_ok = True
    for k in range(3):
        fresh = src + k
        cuda.copy(s_ptr, fresh.ctypes.data, fresh.nbytes, device.compute)
        cuda.replay(graph, device.compute)
        got = np.empty_like(src)
        cuda.copy(got.ctypes.data, d_ptr, got.nbytes, device.compute)
        cuda.sync_stream(device.compute)
        replay_ok &= bool(np.array_equal(got[:, 0], fresh[:, 1]))
    return replay_ok


def overlap_check(cuda, megabytes: int = 64, steps: int = 20) -> dict:
    """Ping-pong: upload slot i % 2 on the copy stream while the compute stream works on slot (i - 1) % 2."""
    import cupy as cp  # only on the device machine

    device = Device(cuda)
    nbytes = megabytes << 20
    pinned = [cuda.host_alloc(nbytes) for _ in range(2)]
    buffers = [device.alloc(nbytes) for _ in range(2)]
    uploaded = [cuda.event() for _ in range(2)]
    consumed = [cuda.event() for _ in range(2)]
    compute = cp.cuda.ExternalStream(device.compute)
    with compute:
        a = cp.random.standard_normal((4096, 4096), dtype=cp.float32)

    def work():
        with compute:
            for _ in range(2):
                a @ a

    def timed(fn) -> float:
        cuda.sync_stream(device.copy), cuda.sync_stream(device.compute)
        t0 = time.perf_counter()
        fn()
        cuda.sync_stream(device.copy), cuda.sync_stream(device.compute)
        return time.perf_counter() - t0

    def copies():
        for i in range(steps):
            cuda.copy(buffers[i % 2], pinned[i % 2][0], nbytes, device.copy)

    def computes():
        for _ in range(steps):
            work()

    def both():
        for i in range(steps):
            s = i % 2
            cuda.wait(device.copy, consumed[s])  # slot s is free once the compute that read it is done
            cuda.copy(buffers[s], pinned[s][0], nbytes, device.copy)
            cuda.record(uploaded[s], device.copy)
            cuda.wait(device.compute, uploaded[s])
            work()
            cuda.record(consumed[s], device.compute)

    for fn in (copies, computes, both):  # warm-up
        timed(fn)
    t_copy = float(np.median([timed(copies) for _ in range(3)]))
    t_comp = float(np.median([timed(computes) for _ in range(3)]))
    t_both = float(np.median([timed(both) for _ in range(3)]))
    hidden = (t_copy + t_comp - t_both) / t_copy
    return {"copy_s": t_copy, "compute_s": t_comp, "pingpong_s": t_both, "copy_GBps": steps * nbytes / t_copy / 1e9,
            "hidden_fraction": max(0.0, min(1.0, hidden))}


def backend_check(cuda, bundle: Path, emulate: bool) -> dict:
    prompts = [[1, 4, 2, 0, 3], [5, 2], [5, 1, 1, 3, 0, 0, 2, 4], [3], [0, 4, 4, 1]]
    out = {}
    for temperature in (0.0, 1.0):
        options = DecodeOptions(max_tokens=24, temperature=temperature, seed=4, batch_size=3)
        runs = []
        for kind in ("onnxruntime", "device"):
            if kind == "onnxruntime":
                manifest = Manifest.read(bundle)
                backend = create_backend("onnxruntime", bundle, manifest)
            elif emulate:
                backend, manifest = emulated_backend(bundle, max_batch=3, max_context=96)
            else:
                backend, manifest = device_ort_backend(cuda, bundle, max_batch=3, max_context=96)
            decoder = Decoder(backend, manifest, prompts, options)
            for _ in decoder:
                pass
            runs.append([result.token_ids for result in decoder.results])
        out[f"tokens_equal_T{temperature:g}"] = runs[0] == runs[1]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--bundle", type=Path, help="A tiny bundle (tests/support/tiny.py) for the end-to-end check.")
    ap.add_argument("--emulate", action="store_true", help="No GPU: run on dspark.testing.gpu_emulator.")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    if args.emulate:
        cuda = EmulatedCuda()
    else:
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
