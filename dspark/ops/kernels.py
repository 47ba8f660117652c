"""Build the CUDA kernels (dspark::ConfidenceTruncate, the runtime's row scatter) into one shared library with nvcc
(no TensorRT needed)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from dspark.errors import DSparkError

SOURCES = Path(__file__).resolve().parent
KERNELS = ("confidence_truncate.cu", "scatter_rows.cu")
LIBRARY = "libdspark_kernels.so"


def archs_for(device: dict) -> tuple[str, ...]:
    """nvcc architectures for a device record of `dspark-export build` (sm_80 + sm_90 when it has none)."""
    arch = str(device.get("compute_capability", "")).replace(".", "")
    return (arch,) if arch.isdigit() else ("80", "90")


def build_kernel(out_dir: Path, archs: tuple[str, ...] = ("80", "90"), nvcc: str | None = None) -> Path:
    nvcc = nvcc or shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not Path(nvcc).exists() and not shutil.which(nvcc):
        raise DSparkError("nvcc not found: install the CUDA toolkit or put nvcc on PATH")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    lib = out_dir / LIBRARY
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    cmd = [nvcc, "-std=c++17", "-O2", "-Xcompiler", "-fPIC", "-shared", *gencode, f"-I{SOURCES}",
           *(str(SOURCES / k) for k in KERNELS), "-o", str(lib)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise DSparkError(f"nvcc failed: {res.stderr.strip().splitlines()[-1] if res.stderr.strip() else res.returncode}")
    return lib
