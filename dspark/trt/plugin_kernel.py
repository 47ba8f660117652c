"""The runtime half of the Python ConfidenceTruncate plugin: the kernel of dspark/ops/confidence_truncate.cu,
compiled with nvcc to a cubin for the GPU at hand (cached), loaded and launched through cuda-python's driver API
on the stream TensorRT gives `enqueue`. Launch configuration and argument checks are those of the C host entry
point `dspark_confidence_truncate` that the C++ plugin calls, so both plugins launch the kernel the same way.
Imported only on the first enqueue (a GPU); compiling and finding the kernel work without one.
"""
from __future__ import annotations

import ctypes
import hashlib
import re
import shutil
import subprocess
from pathlib import Path

from dspark.errors import DSparkError
from dspark.lazy import LazyModule
from dspark.resolve import cache_dir

SOURCE = Path(__file__).resolve().parents[1] / "ops" / "confidence_truncate.cu"
KERNEL = "confidence_truncate_kernel"
SMEM_LIMIT = 48 * 1024
MAX_THREADS = 1024
# the kernel's parameters in order (a test reads the signature in the .cu source and compares)
PARAMS = (("survival", ctypes.c_void_p), ("threshold", ctypes.c_void_p), ("sps", ctypes.c_void_p),
          ("n_sps", ctypes.c_int), ("budget", ctypes.c_void_p), ("active", ctypes.c_void_p),
          ("mode_ptr", ctypes.c_void_p), ("layout_ptr", ctypes.c_void_p), ("batch", ctypes.c_int),
          ("block", ctypes.c_int), ("verify_len", ctypes.c_void_p), ("verify_mask", ctypes.c_void_p))

driver = LazyModule("cuda.bindings.driver", "the Python plugin's runtime needs cuda-python: pip install cuda-python")


def sort_size(candidates: int) -> int:
    size = 1
    while size < candidates:
        size <<= 1
    return size


def launch_config(batch: int, block: int) -> tuple[int, int]:
    """(threads, shared memory bytes) of the one thread block that does the whole batch."""
    width = sort_size(batch * block)
    smem = width * 8 + batch * 4  # survival (f32) + index (i32) per slot, a length (i32) per request
    threads = min(max(width // 2, 128), MAX_THREADS)
    return threads, smem


def compile_cubin(arch: str, out_dir: Path | None = None, nvcc: str | None = None) -> Path:
    """confidence_truncate.cu as a cubin for sm_<arch>, cached by source digest and architecture."""
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    out = Path(out_dir or cache_dir() / "kernels") / f"confidence_truncate-{digest}-sm_{arch}.cubin"
    if out.exists():
        return out
    nvcc = nvcc or shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not shutil.which(nvcc):
        raise DSparkError("nvcc not found: the Python plugin compiles its kernel on first use (install the CUDA "
                          "toolkit), or build with the C++ plugin (--plugin)")
    out.parent.mkdir(parents=True, exist_ok=True)
    staged = out.with_suffix(".tmp")
    cmd = [nvcc, "-std=c++17", "-O2", "-cubin", f"-arch=sm_{arch}", f"-I{SOURCE.parent}", str(SOURCE), "-o",
           str(staged)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        lines = result.stderr.strip().splitlines()
        raise DSparkError(f"nvcc failed on {SOURCE.name}: {lines[-1] if lines else result.returncode}")
    staged.replace(out)
    return out


def kernel_symbol(cubin: bytes) -> str:
    """The mangled name of the kernel in a cubin (it sits in an anonymous namespace)."""
    names = sorted(set(re.findall(rb"(_Z\w*" + KERNEL.encode() + rb"\w*)\x00", cubin)))
    if len(names) != 1:
        raise DSparkError(f"expected one {KERNEL} in the cubin, found {len(names)}")
    return names[0].decode()


def _check(result):
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise DSparkError(f"CUDA driver call failed: {err}")
    return rest[0] if len(rest) == 1 else rest


class ConfidenceTruncateKernel:
    """The kernel loaded into the current CUDA context (the one TensorRT runs the engine in)."""

    def __init__(self, cubin: Path):
        image = cubin.read_bytes()
        self.module = _check(driver.cuModuleLoadData(image))
        self.function = _check(driver.cuModuleGetFunction(self.module, kernel_symbol(image).encode()))

    @classmethod
    def for_current_device(cls) -> ConfidenceTruncateKernel:
        device = _check(driver.cuCtxGetDevice())
        attribute = driver.CUdevice_attribute
        major = _check(driver.cuDeviceGetAttribute(attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device))
        minor = _check(driver.cuDeviceGetAttribute(attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device))
        return cls(compile_cubin(f"{major}{minor}"))

    def launch(self, inputs: list[int], outputs: list[int], batch: int, block: int, n_sps: int, stream: int) -> None:
        if batch <= 0 or block <= 0 or n_sps <= 0:
            raise DSparkError(f"ConfidenceTruncate: bad sizes batch {batch}, block {block}, sps {n_sps}")
        threads, smem = launch_config(batch, block)
        if smem > SMEM_LIMIT:
            raise DSparkError(f"ConfidenceTruncate: batch {batch} x block {block} exceeds one thread block")
        survival, threshold, sps, budget, active, mode, layout = inputs
        values = (survival, threshold, sps, n_sps, budget, active, mode, layout, batch, block, *outputs)
        args = (values, tuple(kind for _, kind in PARAMS))
        _check(driver.cuLaunchKernel(self.function, 1, 1, 1, threads, 1, 1, smem, stream, args, 0))
