"""`dspark-export build`: TensorRT engines for a bundle (TensorRT 10.x / 11.x Python API, import-guarded).

Steps per graph: (1) write a build copy of the ONNX model without the dspark function bodies, so the parser cannot
inline them and must create the registered plugin (onnx-tensorrt imports model-local functions before falling
back to plugins); (2) for TensorRT 11 and fp16/bf16, cast the matmuls first (networks are strongly typed);
(3) parse, then assert every dspark node became a plugin layer; (4) add the prefill/verify profiles, build,
serialize. Engines, the plugin library, the timing cache and a `tensorrt` manifest section go into the bundle.
"""
from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

from dspark.bundle import Manifest, sha256_file
from dspark.errors import DSparkError
from dspark.ops.kernels import archs_for, build_kernel
from dspark.trt.profiles import graph_profiles
from dspark.trt.versions import TrtApi

PLUGIN_LIB = "libdspark_trt_plugin.so"


def import_tensorrt():
    try:
        import tensorrt as trt  # noqa: F401
    except Exception as e:  # ImportError, or the stub package failing to fetch its libraries
        raise DSparkError(f"TensorRT is not usable here ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}); "
                          f"install TensorRT 10 or 11 for your CUDA version") from None
    return trt


def find_plugin_library(bundle: Path, explicit: Path | None = None) -> Path:
    for candidate in [explicit, bundle / "engines" / PLUGIN_LIB, os.environ.get("DSPARK_TRT_PLUGIN")]:
        if candidate and Path(candidate).exists():
            return Path(candidate)
    raise DSparkError(f"the dspark TensorRT plugin library is not built: cmake -S dspark/ops/trt_plugin -B build/plugin "
                      f"-DTENSORRT_ROOT=... && cmake --build build/plugin, then pass --plugin build/plugin/{PLUGIN_LIB}")


def build_copy(bundle: Path, spec_file: str, work: Path, precision: str, api: TrtApi) -> Path:
    """The ONNX file the parser reads: dspark function bodies removed, matmuls cast when strongly typed."""
    import onnx_ir as ir

    from dspark.export.passes import cast_matmuls
    from dspark.ops.confidence_truncate.onnx_function import DOMAIN

    model = ir.load(str(bundle / spec_file))
    for key in [k for k in model.functions if k[0] == DOMAIN]:
        del model.functions[key]
    if api.plan(precision)["cast_graph"]:
        cast_matmuls(model, precision)
    out = work / spec_file
    ir.save(model, str(out), external_data=f"{spec_file}.data")
    return out


def _network_flags(trt, api: TrtApi, precision: str) -> int:
    flags = 0
    for name in api.plan(precision)["network_flags"]:
        flags |= 1 << int(getattr(trt.NetworkDefinitionCreationFlag, name))
    return flags


def plugin_layer_count(trt, network) -> int:
    kinds = {getattr(trt.LayerType, n) for n in ("PLUGIN_V3", "PLUGIN_V2", "PLUGIN") if hasattr(trt.LayerType, n)}
    return sum(1 for i in range(network.num_layers) if network.get_layer(i).type in kinds)


def build_engines(bundle: Path, precision: str = "fp16", max_batch: int = 8, max_context: int = 2048,
                  version_compatible: bool = False, timing_cache: Path | None = None, plugin: Path | None = None,
                  work_dir: Path | None = None, workspace_gb: float = 4.0) -> dict:
    trt = import_tensorrt()
    bundle = Path(bundle)
    man = Manifest.read(bundle)
    if man.quantized:
        raise DSparkError(f"{', '.join(man.quantized)} of {bundle} hold 8-bit MatMulNBits weights (ONNX Runtime CPU "
                          f"only); TensorRT needs the graphs as exported: build from a bundle that was not quantized")
    api = TrtApi.parse(trt.__version__)
    plan = api.plan(precision)
    profiles = graph_profiles(man, max_batch, max_context)
    lib = find_plugin_library(bundle, plugin)
    logger = trt.Logger(trt.Logger.WARNING)
    trt.init_libnvinfer_plugins(logger, "")
    registry = trt.get_plugin_registry()
    registry.load_library(str(lib))
    engines_dir = bundle / "engines"
    engines_dir.mkdir(exist_ok=True)
    work = Path(work_dir or engines_dir / ".build")
    work.mkdir(parents=True, exist_ok=True)
    builder = trt.Builder(logger)
    cache_bytes = Path(timing_cache).read_bytes() if timing_cache and Path(timing_cache).exists() else b""
    report = {"tensorrt": trt.__version__, "precision": precision, "max_batch": max_batch,
              "max_context": max_context, "version_compatible": version_compatible, "plugin_layers": {},
              "engines": {}, "profiles": {}}
    for name, spec in man.graphs.items():
        t0 = time.perf_counter()
        network = builder.create_network(_network_flags(trt, api, precision))
        parser = trt.OnnxParser(network, logger)
        onnx_path = build_copy(bundle, spec.file, work, precision, api)
        if not parser.parse_from_file(str(onnx_path)):
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise DSparkError(f"TensorRT could not parse {spec.file}: {errors[:400]}")
        expected = _dspark_nodes(bundle / spec.file)
        found = plugin_layer_count(trt, network)
        if found < expected:
            raise DSparkError(f"{spec.file}: {expected} dspark node(s) but {found} plugin layer(s): the plugin was "
                              f"not used (is {lib} a dspark plugin build for this TensorRT?)")
        report["plugin_layers"][name] = found
        config = builder.create_builder_config()
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gb * (1 << 30)))
        for flag in plan["builder_flags"]:
            config.set_flag(getattr(trt.BuilderFlag, flag))
        if version_compatible:
            config.set_flag(trt.BuilderFlag.VERSION_COMPATIBLE)
        cache = config.create_timing_cache(cache_bytes)
        config.set_timing_cache(cache, ignore_mismatch=False)
        for prof in profiles[name]:
            p = builder.create_optimization_profile()
            for tensor, (lo, opt, hi) in prof.shapes.items():
                p.set_shape(tensor, lo, opt, hi)
            config.add_optimization_profile(p)
        serialized = builder.build_serialized_network(network, config)
        if serialized is None:
            raise DSparkError(f"TensorRT failed to build {name} (see the log above)")
        path = engines_dir / f"{name}.plan"
        path.write_bytes(bytes(serialized))
        cache_bytes = bytes(config.get_timing_cache().serialize())
        report["engines"][name] = {"file": f"engines/{name}.plan", "sha256": sha256_file(path),
                                   "onnx_sha256": spec.sha256, "build_s": round(time.perf_counter() - t0, 1)}
        report["profiles"][name] = [{"name": p.name, "shapes": {k: [list(x) for x in v] for k, v in p.shapes.items()}}
                                    for p in profiles[name]]
    shutil.copy2(lib, engines_dir / PLUGIN_LIB)
    (engines_dir / "timing.cache").write_bytes(cache_bytes)
    if timing_cache:
        Path(timing_cache).write_bytes(cache_bytes)
    report["plugin"] = {"library": f"engines/{PLUGIN_LIB}", "name": "ConfidenceTruncate", "version": "1",
                        "namespace": "dspark"}
    report["device"] = _device_info()
    try:  # the GPU runtime's kernels (cache appends); without nvcc here the runtime builds them on first use
        build_kernel(engines_dir, archs=archs_for(report["device"]))
    except DSparkError as e:
        print(f"note: runtime kernels not built ({e}); dspark will build them on first use", file=sys.stderr)
    man.tensorrt = report
    man.write(bundle)
    shutil.rmtree(work, ignore_errors=True)
    return report


def _dspark_nodes(path: Path) -> int:
    import onnx

    from dspark.ops.confidence_truncate.onnx_function import DOMAIN

    model = onnx.load(str(path), load_external_data=False)
    return sum(1 for n in model.graph.node if n.domain == DOMAIN)


def _device_info() -> dict:
    try:
        from cuda.bindings import runtime as cudart

        err, props = cudart.cudaGetDeviceProperties(0)
        err2, version = cudart.cudaRuntimeGetVersion()
        return {"name": props.name.decode() if isinstance(props.name, bytes) else str(props.name),
                "compute_capability": f"{props.major}.{props.minor}", "cuda_runtime": version}
    except Exception as e:  # cuda-python missing: the engines are still valid, only the record is thinner
        return {"unknown": f"{type(e).__name__}"}
