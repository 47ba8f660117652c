"""The TensorRT half of `dspark doctor` (runs only where TensorRT and a GPU exist)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from dspark.bundle import Manifest, check_reference
from dspark.files import read_json
from dspark.export.check.parity import CAPTURE, CHECK_DIR, compare_outputs
from dspark.runtime import DecodeOptions, Runtime
from dspark.runtime.backend import Backend, create_backend
from dspark.trt.backend import TrtBackend
from dspark.trt.engine import load_trt_engines
from dspark.trt.profiles import pad_capacity

Row = tuple[str, str, str]  # (check, "ok" / "fail", detail)


def compare_with_onnxruntime(bundle: Path, manifest: Manifest | None = None, engines: dict | None = None,
                             cuda=None) -> list[Row]:
    """Engine outputs vs ONNX Runtime on the bundle's recorded inputs (padded to the engines' cache capacity),
    greedy decoding with the TensorRT backend (eager and CUDA graphs) vs ONNX Runtime, speed.

    `engines` and `cuda` default to the bundle's TensorRT engines and cuda-python (the tests pass stand-ins)."""
    bundle = Path(bundle)
    manifest = manifest or Manifest.read(bundle)
    engines = engines or load_trt_engines(bundle, manifest)  # the plugin library and the engines, loaded once
    eager = TrtBackend(bundle, manifest, engines=engines, cuda=cuda)
    reference = create_backend("onnxruntime", bundle, manifest)
    graphs = TrtBackend(bundle, manifest, engines=engines, cuda=cuda, cuda_graphs=True)
    return [engine_parity(bundle, manifest, eager, reference),
            *greedy_decoding(bundle, {"onnxruntime": reference, "tensorrt": eager, "tensorrt+graphs": graphs})]


def engine_parity(bundle: Path, manifest: Manifest, backend: Backend, reference: Backend) -> Row:
    """Every graph's outputs on both backends for each recorded input set, within the export check's tolerance."""
    capacity = int(manifest.tensorrt["max_context"])
    rows = []
    for name, count in CAPTURE.items():
        for i in range(count):
            path = bundle / CHECK_DIR / f"{name}_{i}_inputs.npz"
            if not path.exists():
                continue
            feeds = pad_capacity(manifest.graphs[name], dict(np.load(path)), capacity)
            got = {key: value.numpy() for key, value in getattr(backend, name).run(feeds).items()}
            want = {key: value.numpy() for key, value in getattr(reference, name).run(feeds).items()}
            rows += compare_outputs(name, f"call {i}", got, want)
    bad = [f"{row.graph}.{row.output} (max abs err {row.max_abs_err:.3g})" for row in rows if not row.passed]
    return ("engine outputs vs ONNX Runtime (Polygraphy)", "fail" if bad else "ok",
            f"{len(rows) - len(bad)}/{len(rows)} within tolerance" + (f"; off: {', '.join(bad[:4])}" if bad else ""))


def greedy_decoding(bundle: Path, backends: dict[str, Backend]) -> list[Row]:
    """The recorded greedy decode on each backend (after a warm-up: allocations, profiles, graph capture): tokens
    equal to ONNX Runtime's, and the speed."""
    check_reference(bundle)
    expected = read_json(bundle / CHECK_DIR / "expected.json")
    prompt, n = expected["prompt_ids"], expected["max_new_tokens"]
    runs = {}
    for label, backend in backends.items():
        runtime = Runtime(bundle, backend=backend)
        runtime.generate([prompt], DecodeOptions(max_tokens=4))
        start = time.perf_counter()
        result = runtime.generate([prompt], DecodeOptions(max_tokens=n))[0]
        runs[label] = (result.token_ids, len(result.token_ids) / (time.perf_counter() - start))
    out = []
    for label in ("tensorrt", "tensorrt+graphs"):
        same = runs[label][0] == runs["onnxruntime"][0]
        out.append((f"greedy token equality, {label} vs ONNX Runtime", "ok" if same else "fail",
                    f"{len(runs[label][0])} tokens {'identical' if same else 'DIFFER'}"))
    speed = {label: f"{tokens_per_s:.1f}" for label, (_, tokens_per_s) in runs.items()}
    out.append(("TensorRT decode speed", "ok", f"{speed['tensorrt']} tok/s eager, {speed['tensorrt+graphs']} tok/s "
                f"with CUDA graphs (TensorRT backend, batch 1) vs ONNX Runtime {speed['onnxruntime']}"))
    return out
