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
from dspark.extras import install_hint
from dspark.trt.buildable import BUILDABLE_HOW, not_buildable
from dspark.trt.cuda import cudart
from dspark.trt.versions import (
    FLAVORS,
    TrtApi,
    engines_runnable,
    import_tensorrt,
    resolve_flavor,
    runs_on,
)


@dataclass
class Check:
    name: str
    status: str  # "ok", "fail", "skipped", "note" (what this bundle is not made for, e.g. TensorRT for a CPU bundle)
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
        mark = {"ok": "ok  ", "fail": "FAIL", "skipped": "skip", "note": "note"}
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


def gpu_compute_capability() -> str | None:
    try:
        _, props = cudart.cudaGetDeviceProperties(0)
        return f"{props.major}.{props.minor}"
    except Exception:  # no cuda-python or no driver
        return None


def _tensorrt(flavor: str | None) -> tuple[bool, str]:
    """Whether the flavor (None: whichever is installed, TensorRT first) imports and is a supported version."""
    try:
        chosen = resolve_flavor(flavor)
        trt = import_tensorrt(chosen.name)
        TrtApi.parse(trt.__version__, chosen.name)
        return True, f"{chosen.module} {trt.__version__} (flavor {chosen.name})"
    except DSparkError as e:
        return False, str(e)
    except Exception as e:
        return False, f"TensorRT not usable ({type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''})"


GPU_CHECKS = ("engine outputs vs ONNX Runtime (Polygraphy)", "greedy token equality, tensorrt vs ONNX Runtime",
              "greedy token equality, tensorrt+graphs vs ONNX Runtime", "TensorRT decode speed")


def run_doctor(bundle: Path, build: bool = False, plugin: Path | None = None,
               flavor: str | None = None) -> DoctorReport:
    """Check `bundle` on this machine. A diagnostic never writes: engines are built into the bundle only with
    `build` (`dspark doctor --build`)."""
    report = DoctorReport()
    bundle = Path(bundle)
    manifest = Manifest.read(bundle)
    report.add("bundle", "ok", f"format {manifest.format_version}, block {manifest.block_size}, graphs "
               f"{', '.join(manifest.graphs)}")
    intact = _file_integrity(report, bundle, manifest)
    reason = not_buildable(manifest)
    if intact:
        _onnx_checks(report, bundle, manifest, lint=reason is None)
        _acceptance(report, bundle)
    else:  # nothing reads a graph or data file already found damaged
        for name in ("TensorRT operator lint",) * (reason is None) + ("ONNX Runtime vs PyTorch reference",
                                                                      ACCEPTANCE):
            report.add(name, "skipped", "the bundle's files are damaged (see above)")
    has_gpu, gpu = _gpu()
    report.add("GPU", "ok" if has_gpu else "skipped", gpu)
    flavor = flavor or manifest.tensorrt.get("flavor")
    has_trt, trt_info = _tensorrt(flavor)
    report.add("TensorRT", "ok" if has_trt else "skipped", trt_info)
    if reason:  # a CPU bundle: said once, not a failure
        report.add("TensorRT build", "note", f"this bundle is not buildable for TensorRT, because {reason}; "
                   f"{BUILDABLE_HOW}")
        return report
    if not intact:
        for name in ("engine build with the plugin layer",) * build + GPU_CHECKS:
            report.add(name, "skipped", "the bundle's files are damaged (see above)")
        return report
    if build:
        manifest = _build(report, bundle, manifest, plugin, flavor, has_gpu and has_trt, has_trt)
    _engine_files(report, bundle, manifest, plugin, build)
    runnable = _engines_run_here(report, manifest, gpu if has_gpu else None)
    if not (has_gpu and has_trt and runnable and manifest.tensorrt):
        missing = [what for ok, what in ((has_gpu, "a CUDA GPU with cuda-python"), (has_trt, "TensorRT"),
                                         (runnable, "a GPU the engines were built for"),
                                         (bool(manifest.tensorrt), "built engines")) if not ok]
        for name in GPU_CHECKS:
            report.add(name, "skipped", f"needs {' and '.join(missing)}")
        return report
    from dspark.trt.gpu_checks import compare_with_onnxruntime

    for name, status, detail in compare_with_onnxruntime(bundle):
        report.add(name, status, detail)
    return report


def _file_integrity(report: DoctorReport, bundle: Path, manifest: Manifest) -> bool:
    """Every graph and recorded data file hashed again (loading a bundle trusts the hashes of files it checked);
    False when one is damaged."""
    name = "files (sha256 of every graph and data file)"
    try:
        manifest.check_files(bundle, full=True)
    except DSparkError as e:
        report.add(name, "fail", str(e))
        return False
    unrecorded = [n for n in manifest.data_names() if (bundle / n).is_file() and n not in manifest.data_files]
    if unrecorded:
        report.add(name, "note", f"graphs ok; {', '.join(unrecorded)} has no size and sha256 in the manifest "
                   f"(written by an older dspark): re-export the bundle to have it checked")
    else:
        report.add(name, "ok", f"{len(manifest.graphs)} graphs, {len(manifest.data_files)} data files")
    return True


def _build(report: DoctorReport, bundle: Path, manifest: Manifest, plugin: Path | None, flavor: str | None,
           gpu_ready: bool, has_trt: bool) -> Manifest:
    """Build the engines where this machine can: TensorRT needs the GPU they are for, TensorRT for RTX no GPU."""
    name = "engine build with the plugin layer"
    if not has_trt or not (gpu_ready or resolve_flavor(flavor).name == "rtx"):
        report.add(name, "skipped", "needs TensorRT and a GPU, or TensorRT for RTX (pip install tensorrt-rtx-cu13)")
        return manifest
    from dspark.trt.build import build_engines

    out = build_engines(bundle, plugin=plugin, flavor=flavor, max_context=min(2048, manifest.max_context),
                        kernels=gpu_ready)
    report.add(name, "ok", f"{out['flavor']} {out['tensorrt']}, {out['plugin']['implementation']} plugin, plugin "
               f"layers per graph: {out['plugin_layers']}")
    return Manifest.read(bundle)


def _onnx_checks(report: DoctorReport, bundle: Path, manifest: Manifest, lint: bool) -> None:
    """The checks that need no GPU: the TensorRT operator lint (for a bundle TensorRT can build) and ONNX Runtime vs
    the PyTorch reference. Either is skipped, naming what to install, where the export extra is missing."""
    if lint:
        try:
            from dspark.export.check.trt_lint import lint_bundle

            findings = lint_bundle(bundle, manifest)
            report.add("TensorRT operator lint", "ok" if not findings else "fail",
                       "every node is in TensorRT 10's ONNX support" if not findings else f"{len(findings)} "
                       f"problem(s), first: {findings[0].graph} {findings[0].op}: {findings[0].problem}")
        except ModuleNotFoundError as e:
            report.add("TensorRT operator lint", "skipped", install_hint(e) or str(e))
    try:
        from dspark.export.check.parity import check_bundle

        ort = check_bundle(bundle)
        report.add("ONNX Runtime vs PyTorch reference", "ok" if ort.passed else "fail",
                   f"{sum(row.passed for row in ort.rows)}/{len(ort.rows)} outputs within tolerance; greedy DSpark "
                   f"{'equal' if ort.e2e['dspark']['passed'] else 'DIFFERS'}, AR "
                   f"{'equal' if ort.e2e['ar']['passed'] else 'DIFFERS'}")
    except Exception as e:  # a bundle without check data, or an install without torch, still gets the GPU report
        report.add("ONNX Runtime vs PyTorch reference", "skipped", install_hint(e) or str(e))


ACCEPTANCE = "drafter acceptance (collapse alarm)"


def _acceptance(report: DoctorReport, bundle: Path) -> None:
    """What `dspark-export check` judges the drafter's acceptance by (dspark.acceptance), measured again."""
    from dspark.acceptance import check_acceptance

    verdict = check_acceptance(bundle)
    status = {"ok": "ok", "collapse": "fail"}.get(verdict.status, "note")
    report.add(ACCEPTANCE, status, verdict.line)


def _engine_files(report: DoctorReport, bundle: Path, manifest: Manifest, plugin: Path | None, build: bool) -> None:
    """The plugin and the engines the manifest records (stale when their ONNX changed since the build)."""
    section = manifest.tensorrt
    recorded = section.get("plugin", {})
    if plugin or recorded.get("library"):
        plugin_path = Path(plugin or Manifest.path(bundle, recorded["library"]))
        report.add("plugin library", "ok" if plugin_path.exists() else "fail",
                   f"C++ {plugin_path}" if plugin_path.exists() else f"{plugin_path} is missing")
    elif recorded:
        report.add("plugin library", "ok", f"Python registration ({recorded.get('module', 'dspark.trt.plugin')}), "
                   f"no library needed")
    if not section:
        report.add("engines", "skipped", "none built yet (`dspark doctor --build BUNDLE` or `dspark-export build "
                   "BUNDLE` builds them into the bundle)" if not build else "none built")
        return
    stale = [graph for graph, engine in section.get("engines", {}).items()
             if engine.get("onnx_sha256") != manifest.graphs[graph].sha256]
    flavor = FLAVORS.get(section.get("flavor", "tensorrt"), FLAVORS["tensorrt"])
    targets = f", targets {', '.join(section['targets'])}" if section.get("targets") else ""
    report.add("engines", "fail" if stale else "ok",
               f"flavor {flavor.name}: built with {flavor.module} {section.get('tensorrt')} "
               f"({section.get('precision')}{targets}); they run on {runs_on(flavor, section.get('targets', []))}"
               + (f"; stale for {', '.join(stale)} (ONNX changed since the build)" if stale else ""))


def _engines_run_here(report: DoctorReport, manifest: Manifest, gpu: str | None) -> bool:
    """Whether this machine's GPU is one the recorded engines run on (True when none are recorded yet)."""
    section = manifest.tensorrt
    if not section.get("engines"):
        return True
    verdict = engines_runnable(section, gpu_compute_capability() if gpu else None)
    report.add("engines run on this machine", "ok" if verdict.ok else "skipped", verdict.reason)
    return verdict.ok
