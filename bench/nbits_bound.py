"""Is ONNX Runtime's MatMulNBits step bound by compute or by memory bandwidth on this machine?

The AR step of a GGUF-block verifier runs at ~2.7-3.5x its bandwidth floor (weight bytes per token / measured copy
bandwidth). This isolates the matmuls: one graph holding only SmolLM2-135M's per-token weight matmuls as
MatMulNBits (30 layers x q, k, v, o, gate, up, down at 4 bits, block 32, uint8 zero points; the LM head at 8 bits),
random weights, one row, run back to back with 1 and 2 threads and the layers' accuracy_level 0 (fp32 activations)
or 4 (int8 activations; the 8-bit head runs at 4 in both, as in a GGUF-block bundle), configurations taking turns,
medians. Against them, what ONNX Runtime itself streams with 1 and 2 threads: a ReduceSum over 100 MB of fp32.
Bandwidth-bound kernels read their bytes near that streaming rate; compute-bound ones read well below it.

  python bench/nbits_bound.py [--reps 30] [--out bench/results/nbits_bound]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from common import bandwidth_gb_s, machine, write_json

D, FF, KV, LAYERS, VOCAB, BLOCK = 576, 1536, 192, 30, 49152, 32


def _nbits(name: str, x: str, k: int, n: int, bits: int, acc: int, rng, inits: list) -> tuple:
    from onnx import helper, numpy_helper

    blocks = k // BLOCK
    blob = BLOCK * bits // 8
    packed = rng.integers(0, 256, size=(n, blocks, blob), dtype=np.uint8)
    scales = (rng.random(n * blocks, dtype=np.float32) * 0.01 + 1e-3).astype(np.float32)
    zp = rng.integers(0, 256, size=(n * ((blocks * bits + 7) // 8),), dtype=np.uint8)
    names = [f"{name}.w", f"{name}.s", f"{name}.z"]
    for nm, arr in zip(names, (packed, scales, zp)):
        inits.append(numpy_helper.from_array(arr, nm))
    node = helper.make_node("MatMulNBits", [x, *names], [name], domain="com.microsoft", K=k, N=n, bits=bits,
                            block_size=BLOCK, accuracy_level=acc)
    return node, packed.nbytes + scales.nbytes + zp.nbytes


def build(path: Path, acc: int, seed: int = 0) -> int:
    """The matmul-only graph at accuracy_level `acc`; returns the weight bytes one row reads."""
    import onnx
    from onnx import TensorProto, helper

    rng = np.random.default_rng(seed)
    nodes, inits, outputs, total = [], [], [], 0
    x = "x"
    for layer in range(LAYERS):
        p = f"l{layer}"
        for name, src, k, n in (("q", x, D, D), ("k", x, D, KV), ("v", x, D, KV), ("o", f"{p}.q", D, D),
                                ("g", x, D, FF), ("u", x, D, FF)):
            node, size = _nbits(f"{p}.{name}", src, k, n, 4, acc, rng, inits)
            nodes.append(node)
            total += size
        nodes.append(helper.make_node("Mul", [f"{p}.g", f"{p}.u"], [f"{p}.gu"]))
        node, size = _nbits(f"{p}.d", f"{p}.gu", FF, D, 4, acc, rng, inits)
        nodes += [node, helper.make_node("Add", [f"{p}.o", f"{p}.d"], [f"{p}.od"]),
                  helper.make_node("Add", [x, f"{p}.od"], [f"{p}.x"])]
        total += size
        outputs += [f"{p}.k", f"{p}.v"]
        x = f"{p}.x"
    node, size = _nbits("logits", x, D, VOCAB, 8, 4, rng, inits)
    nodes.append(node)
    total += size
    outs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in ["logits", *outputs]]
    graph = helper.make_graph(nodes, "nbits_bound", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, D])],
                              outs, initializer=inits)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    onnx.save(model, str(path), save_as_external_data=True, location=path.name + ".data")
    return total


def build_stream(path: Path) -> None:
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("ReduceSum", ["w"], ["s"], keepdims=0)], "stream",
                              [helper.make_tensor_value_info("w", TensorProto.FLOAT, [None])],
                              [helper.make_tensor_value_info("s", TensorProto.FLOAT, [])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


def session(path: Path, threads: int):
    """With the runtime's own session options (no spinning threads, as the verifier runs)."""
    import onnxruntime as ort

    from dspark.runtime.ort_backend import session_options

    return ort.InferenceSession(str(path), session_options(threads), providers=["CPUExecutionProvider"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--inner", type=int, default=5, help="Steps per timed repetition")
    ap.add_argument("--out", default="bench/results/nbits_bound")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="nbits_bound_"))
    x = np.random.default_rng(1).standard_normal((1, D)).astype(np.float32)
    configs, sizes, feeds = {}, {}, {}
    build_stream(work / "stream.onnx")
    stream = np.random.default_rng(2).random(25_000_000, dtype=np.float32)  # 100 MB
    sizes["stream"] = stream.nbytes
    for threads in (1, 2):
        configs[f"stream-t{threads}"] = (session(work / "stream.onnx", threads), "stream", threads)
    feeds["stream"] = {"w": stream}
    for acc in (0, 4):
        feeds[acc] = {"x": x}
        sizes[acc] = build(work / f"acc{acc}.onnx", acc)
        for threads in (1, 2):
            sess = session(work / f"acc{acc}.onnx", threads)
            for _ in range(5):
                sess.run(None, feeds[acc])
            configs[f"acc{acc}-t{threads}"] = (sess, acc, threads)
    bandwidth = bandwidth_gb_s()
    times = {name: [] for name in configs}
    for _ in range(args.reps):  # configurations take turns
        for name, (sess, kind, _) in configs.items():
            t0 = time.perf_counter()
            for _ in range(args.inner):
                sess.run(None, feeds[kind])
            times[name].append((time.perf_counter() - t0) / args.inner)
    rows = {}
    for name, (_, acc, threads) in configs.items():
        ms = float(np.median(times[name])) * 1e3
        floor_ms = sizes[acc] / (bandwidth * 1e9) * 1e3
        rows[name] = {"accuracy_level": None if acc == "stream" else acc, "threads": threads, "ms_median": ms,
                      "weight_bytes": sizes[acc], "read_gb_s": sizes[acc] / (ms / 1e3) / 1e9, "floor_ms": floor_ms,
                      "over_floor": ms / floor_ms}
    for kind in ("stream", "acc0", "acc4"):
        one, two = rows[f"{kind}-t1"], rows[f"{kind}-t2"]
        two["speedup_over_1_thread"] = one["ms_median"] / two["ms_median"]
        for r in (one, two):
            if kind != "stream":
                r["of_ort_streaming"] = r["read_gb_s"] / rows[f"stream-t{r['threads']}"]["read_gb_s"]
    print(f"weights read per row: {sizes[0] / 1e6:.1f} MB; copy bandwidth {bandwidth:.1f} GB/s")
    print(f"{'config':10s} {'ms':>7s} {'GB/s read':>10s} {'x floor':>8s} {'of streaming':>12s} {'2 thr / 1':>9s}")
    for name, r in rows.items():
        print(f"{name:10s} {r['ms_median']:7.2f} {r['read_gb_s']:10.1f} {r['over_floor']:8.2f} "
              f"{r.get('of_ort_streaming', 1.0):12.2f} {r.get('speedup_over_1_thread', float('nan')):9.2f}")
    write_json(args.out + ".json", {"machine": machine(), "bandwidth_gb_s": bandwidth, "reps": args.reps,
                                    "inner": args.inner, "layers": LAYERS, "configs": rows})


if __name__ == "__main__":
    main()
