"""The TensorRT half of `dspark doctor` (runs only where TensorRT and a GPU exist)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from dspark.bundle import Manifest


def compare_with_onnxruntime(bundle: Path, man: Manifest | None = None, engines: dict | None = None,
                             cuda=None) -> list[tuple[str, str, str]]:
    """Engine outputs vs ONNX Runtime on the bundle's recorded inputs (padded to the engines' cache capacity),
    greedy decoding with the streaming GPU backend (eager and CUDA graphs) vs ONNX Runtime, speed.

    `engines` and `cuda` default to the bundle's TensorRT engines and cuda-python (the tests pass stand-ins)."""
    from dspark.export.check import CAPTURE, CHECK_DIR, _compare
    from dspark.runtime import Runtime
    from dspark.runtime.ort_backend import OrtBackend
    from dspark.trt.profiles import pad_capacity
    from dspark.trt.stream import StreamingBackend, load_trt_engines

    bundle = Path(bundle)
    man = man or Manifest.read(bundle)
    engines = engines or load_trt_engines(bundle, man)  # the plugin library and the engines, loaded once
    gpu = StreamingBackend(bundle, man, engines=engines, cuda=cuda)
    ort_backend = OrtBackend(bundle, man)
    capacity = int(man.tensorrt["max_context"])
    out, rows = [], []
    for name, count in CAPTURE.items():
        for i in range(count):
            path = bundle / CHECK_DIR / f"{name}_{i}_inputs.npz"
            if not path.exists():
                continue
            feeds = pad_capacity(man.graphs[name], dict(np.load(path)), capacity)
            got = {k: v.numpy() for k, v in getattr(gpu, name).run(feeds).items()}
            want = {k: v.numpy() for k, v in getattr(ort_backend, name).run(feeds).items()}
            rows += _compare(name, f"call {i}", got, want)
    bad = [f"{r.graph}.{r.output} (max abs err {r.max_abs_err:.3g})" for r in rows if not r.passed]
    out.append(("engine outputs vs ONNX Runtime (Polygraphy)", "fail" if bad else "ok",
                f"{len(rows) - len(bad)}/{len(rows)} within tolerance" + (f"; off: {', '.join(bad[:4])}" if bad else "")))

    expected = json.loads((bundle / CHECK_DIR / "expected.json").read_text())
    prompt, n = expected["prompt_ids"], expected["max_new_tokens"]
    runs = {}
    graphs = StreamingBackend(bundle, man, engines=engines, cuda=cuda, cuda_graphs=True)
    for label, backend in (("onnxruntime", ort_backend), ("tensorrt", gpu), ("tensorrt+graphs", graphs)):
        rt = Runtime(bundle, backend=backend)
        rt.generate([prompt], max_new_tokens=4)  # warm-up: allocations, profiles, graph capture
        t0 = time.perf_counter()
        res = rt.generate([prompt], max_new_tokens=n)[0]
        runs[label] = (res.token_ids, len(res.token_ids) / (time.perf_counter() - t0))
    for label in ("tensorrt", "tensorrt+graphs"):
        same = runs[label][0] == runs["onnxruntime"][0]
        out.append((f"greedy token equality, {label} vs ONNX Runtime", "ok" if same else "fail",
                    f"{len(runs[label][0])} tokens {'identical' if same else 'DIFFER'}"))
    out.append(("TensorRT decode speed", "ok", f"{runs['tensorrt'][1]:.1f} tok/s eager, {runs['tensorrt+graphs'][1]:.1f} "
                f"tok/s with CUDA graphs (streaming backend, batch 1) vs ONNX Runtime {runs['onnxruntime'][1]:.1f}"))
    return out
