"""`dspark doctor BUNDLE`: what this machine can do with a bundle, checked for real, and what it could not check.

On a machine with TensorRT and a GPU it builds or loads the engines, checks the plugin layer, compares engine
outputs with ONNX Runtime on the bundle's recorded inputs, and decodes greedily on both backends. Without them
it runs the ONNX Runtime checks and says exactly which checks it skipped and why.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

from dspark.bundle import Manifest


@dataclass
class Check:
    name: str
    status: str  # "ok", "fail", "skipped"
    detail: str


@dataclass
class DoctorReport:
    checks: list[Check] = field(default_factory=list)

    def add(self, name: str, status: str, detail: str) -> None:
        self.checks.append(Check(name, status, detail))

    @property
    def failed(self) -> bool:
        return any(c.status == "fail" for c in self.checks)

    def format(self) -> str:
        mark = {"ok": "ok  ", "fail": "FAIL", "skipped": "skip"}
        return "\n".join(f"[{mark[c.status]}] {c.name}: {c.detail}" for c in self.checks)


def _gpu() -> tuple[bool, str]:
    if importlib.util.find_spec("cuda") is None:
        return False, "cuda-python is not installed (pip install 'dspark[trt]')"
    try:
        from cuda.bindings import runtime as cudart

        err, count = cudart.cudaGetDeviceCount()
        if int(err) != 0 or count == 0:
            return False, f"no CUDA device ({err})"
        _, props = cudart.cudaGetDeviceProperties(0)
        name = props.name.decode() if isinstance(props.name, bytes) else str(props.name)
        return True, f"{name}, compute capability {props.major}.{props.minor}"
    except Exception as e:
        return False, f"CUDA runtime unusable: {type(e).__name__}: {e}"


def _tensorrt() -> tuple[bool, str]:
    try:
        import tensorrt as trt

        from dspark.trt.versions import TrtApi

        TrtApi.parse(trt.__version__)
        return True, f"TensorRT {trt.__version__}"
    except Exception as e:
        return False, f"TensorRT not usable ({type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''})"


def run_doctor(bundle: Path, build: bool = False, plugin: Path | None = None) -> DoctorReport:
    rep = DoctorReport()
    bundle = Path(bundle)
    man = Manifest.read(bundle)
    rep.add("bundle", "ok", f"format {man.format_version}, block {man.block_size}, graphs {', '.join(man.graphs)}")

    from dspark.export.check import check_bundle
    from dspark.export.trt_lint import lint_bundle

    findings = lint_bundle(bundle, man)
    rep.add("TensorRT operator lint", "ok" if not findings else "fail",
            "every node is in TensorRT 10's ONNX support" if not findings else f"{len(findings)} problem(s), "
            f"first: {findings[0].graph} {findings[0].op}: {findings[0].problem}")
    try:
        ort = check_bundle(bundle)
        rep.add("ONNX Runtime vs PyTorch reference", "ok" if ort.passed else "fail",
                f"{sum(r.passed for r in ort.rows)}/{len(ort.rows)} outputs within tolerance; greedy DSpark "
                f"{'equal' if ort.e2e['dspark']['passed'] else 'DIFFERS'}, AR "
                f"{'equal' if ort.e2e['ar']['passed'] else 'DIFFERS'}")
    except Exception as e:  # a bundle without check data still gets the GPU report
        rep.add("ONNX Runtime vs PyTorch reference", "skipped", str(e))

    has_gpu, gpu = _gpu()
    rep.add("GPU", "ok" if has_gpu else "skipped", gpu)
    has_trt, trt_info = _tensorrt()
    rep.add("TensorRT", "ok" if has_trt else "skipped", trt_info)

    plugin_path = plugin or (bundle / "engines" / "libdspark_trt_plugin.so")
    rep.add("plugin library", "ok" if Path(plugin_path).exists() else "skipped",
            str(plugin_path) if Path(plugin_path).exists() else
            "not built: cmake -S dspark/ops/trt_plugin -B build/plugin -DTENSORRT_ROOT=... && cmake --build build/plugin")
    engines = man.tensorrt
    if engines:
        stale = [g for g, e in engines.get("engines", {}).items() if e.get("onnx_sha256") != man.graphs[g].sha256]
        rep.add("engines", "fail" if stale else "ok",
                f"built with TensorRT {engines.get('tensorrt')} ({engines.get('precision')})"
                + (f"; stale for {', '.join(stale)} (ONNX changed since the build)" if stale else ""))
    else:
        rep.add("engines", "skipped", "none built yet (dspark-export build BUNDLE)")

    if not (has_gpu and has_trt):
        missing = [what for ok, what in ((has_gpu, "a CUDA GPU with cuda-python"), (has_trt, "TensorRT 10/11")) if not ok]
        for name in ("engine build with the plugin layer", "engine outputs vs ONNX Runtime (Polygraphy)",
                     "greedy token equality, tensorrt vs ONNX Runtime",
                     "greedy token equality, tensorrt+graphs vs ONNX Runtime", "TensorRT decode speed"):
            rep.add(name, "skipped", f"needs {' and '.join(missing)}")
        return rep
    if build or not engines:
        from dspark.trt.build import build_engines

        out = build_engines(bundle, plugin=plugin)
        rep.add("engine build with the plugin layer", "ok",
                f"plugin layers per graph: {out['plugin_layers']}")
    from dspark.trt.gpu_checks import compare_with_onnxruntime

    for name, status, detail in compare_with_onnxruntime(bundle):
        rep.add(name, status, detail)
    return rep
