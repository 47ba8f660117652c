"""The TensorRT half of `dspark doctor` (runs only where TensorRT and a GPU exist)."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from dspark.bundle import Manifest


def compare_with_onnxruntime(bundle: Path) -> list[tuple[str, str, str]]:
    """Engine outputs vs ONNX Runtime on the bundle's recorded inputs, greedy decoding on both backends, speed."""
    from dspark.export.check import CAPTURE, CHECK_DIR, _compare
    from dspark.runtime.decoder import Decoder
    from dspark.runtime.ort_backend import OrtBackend
    from dspark.trt.engine import TrtBackend

    bundle = Path(bundle)
    man = Manifest.read(bundle)
    trt_backend, ort_backend = TrtBackend(bundle, man), OrtBackend(bundle, man)
    out = []
    rows = []
    for name, count in CAPTURE.items():
        for i in range(count):
            path = bundle / CHECK_DIR / f"{name}_{i}_inputs.npz"
            if not path.exists():
                continue
            feeds = dict(np.load(path))
            got = {k: v.numpy() for k, v in getattr(trt_backend, name).run(feeds).items()}
            want = {k: v.numpy() for k, v in getattr(ort_backend, name).run(feeds).items()}
            rows += _compare(name, f"call {i}", got, want)
    bad = [f"{r.graph}.{r.output} (max abs err {r.max_abs_err:.3g})" for r in rows if not r.passed]
    out.append(("engine outputs vs ONNX Runtime (Polygraphy)", "fail" if bad else "ok",
                f"{len(rows) - len(bad)}/{len(rows)} within tolerance" + (f"; off: {', '.join(bad[:4])}" if bad else "")))
    import json

    expected = json.loads((bundle / CHECK_DIR / "expected.json").read_text())
    prompt, n = expected["prompt_ids"], expected["max_new_tokens"]
    tokens = {}
    for label, backend in (("tensorrt", trt_backend), ("onnxruntime", ort_backend)):
        dec = Decoder(backend, man, [prompt], n)
        t0 = time.perf_counter()
        for _ in dec:
            pass
        tokens[label] = (dec.results[0].token_ids, len(dec.results[0].token_ids) / (time.perf_counter() - t0))
    same = tokens["tensorrt"][0] == tokens["onnxruntime"][0]
    out.append(("greedy token equality, TensorRT vs ONNX Runtime", "ok" if same else "fail",
                f"{len(tokens['tensorrt'][0])} tokens {'identical' if same else 'DIFFER'}"))
    out.append(("TensorRT decode speed", "ok", f"{tokens['tensorrt'][1]:.1f} tok/s (doctor executor, batch 1) vs "
                f"ONNX Runtime {tokens['onnxruntime'][1]:.1f} tok/s"))
    return out
