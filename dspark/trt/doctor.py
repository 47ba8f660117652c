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
from dspark.errors import DSparkError
from dspark.export.check import check_bundle
from dspark.export.trt_lint import lint_bundle
from dspark.trt.build import build_engines
from dspark.trt.cuda import cudart
from dspark.trt.gpu_checks import compare_with_onnxruntime
from dspark.trt.versions import TrtApi, import_tensorrt


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
        return any(check.status == "fail" for check in self.checks)

    def format(self) -> str:
        mark = {"ok": "ok  ", "fail": "FAIL", "skipped": "skip"}
        return "\n".join(f"[{mark[check.status]}] {check.name}: {check.detail}" for check in self.checks)


def _gpu() -> tuple[bool, str]:
    if importlib.util.find_spec("cuda") is None:
        return False, "cuda-python is not installed (pip install 'dspark[trt]')"
    try:
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
        trt = import_tensorrt()
        TrtApi.parse(trt.__version__)
        return True, f"TensorRT {trt.__version__}"
    except DSparkError as e:
        return False, str(e)
    except Exception as e:
        return False, f"TensorRT not usable ({type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''})"


GPU_CHECKS = ("engine build with the plugin layer", "engine outputs vs ONNX Runtime (Polygraphy)",
              "greedy token equality, tensorrt vs ONNX Runtime",
              "greedy token equality, tensorrt+graphs vs ONNX Runtime", "TensorRT decode speed")


def run_doctor(bundle: Path, build: bool = False, plugin: Path | None = None) -> DoctorReport:
    report = DoctorReport()
    bundle = Path(bundle)
    manifest = Manifest.read(bundle)
    report.add("bundle", "ok", f"format {manifest.format_version}, block {manifest.block_size}, graphs "
               f"{', '.join(manifest.graphs)}")
    _onnx_checks(report, bundle, manifest)
    has_gpu, gpu = _gpu()
    report.add("GPU", "ok" if has_gpu else "skipped", gpu)
    has_trt, trt_info = _tensorrt()
    report.add("TensorRT", "ok" if has_trt else "skipped", trt_info)
    _engine_files(report, bundle, manifest, plugin)
    if not (has_gpu and has_trt):
        missing = [what for ok, what in ((has_gpu, "a CUDA GPU with cuda-python"), (has_trt, "TensorRT 10/11"))
                   if not ok]
        for name in GPU_CHECKS:
            report.add(name, "skipped", f"needs {' and '.join(missing)}")
        return report
    if build or not manifest.tensorrt:
        out = build_engines(bundle, plugin=plugin)
        report.add("engine build with the plugin layer", "ok", f"plugin layers per graph: {out['plugin_layers']}")
    for name, status, detail in compare_with_onnxruntime(bundle):
        report.add(name, status, detail)
    return report


def _onnx_checks(report: DoctorReport, bundle: Path, manifest: Manifest) -> None:
    """The checks that need no GPU: the TensorRT operator lint and ONNX Runtime vs the PyTorch reference."""
    findings = lint_bundle(bundle, manifest)
    report.add("TensorRT operator lint", "ok" if not findings else "fail",
               "every node is in TensorRT 10's ONNX support" if not findings else f"{len(findings)} problem(s), "
               f"first: {findings[0].graph} {findings[0].op}: {findings[0].problem}")
    try:
        ort = check_bundle(bundle)
        report.add("ONNX Runtime vs PyTorch reference", "ok" if ort.passed else "fail",
                   f"{sum(row.passed for row in ort.rows)}/{len(ort.rows)} outputs within tolerance; greedy DSpark "
                   f"{'equal' if ort.e2e['dspark']['passed'] else 'DIFFERS'}, AR "
                   f"{'equal' if ort.e2e['ar']['passed'] else 'DIFFERS'}")
    except Exception as e:  # a bundle without check data still gets the GPU report
        report.add("ONNX Runtime vs PyTorch reference", "skipped", str(e))


def _engine_files(report: DoctorReport, bundle: Path, manifest: Manifest, plugin: Path | None) -> None:
    """The plugin library and the engines the manifest records (stale when their ONNX changed since the build)."""
    plugin_path = Path(plugin or (bundle / "engines" / "libdspark_trt_plugin.so"))
    report.add("plugin library", "ok" if plugin_path.exists() else "skipped",
               str(plugin_path) if plugin_path.exists() else "not built: cmake -S dspark/ops/trt_plugin -B "
               "build/plugin -DTENSORRT_ROOT=... && cmake --build build/plugin")
    section = manifest.tensorrt
    if section:
        stale = [graph for graph, engine in section.get("engines", {}).items()
                 if engine.get("onnx_sha256") != manifest.graphs[graph].sha256]
        report.add("engines", "fail" if stale else "ok",
                   f"built with TensorRT {section.get('tensorrt')} ({section.get('precision')})"
                   + (f"; stale for {', '.join(stale)} (ONNX changed since the build)" if stale else ""))
    else:
        report.add("engines", "skipped", "none built yet (dspark-export build BUNDLE)")
