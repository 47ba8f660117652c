"""The TensorRT package: importing it (an optional dependency) and which Python API a build uses (pure logic,
tested against version strings without TensorRT).

TensorRT 10: networks are explicit-batch by default (the EXPLICIT_BATCH flag is deprecated), precision is chosen
with builder flags (FP16/BF16) on a weakly typed network, or the network is strongly typed.
TensorRT 11: networks are strongly typed (the precision comes from the ONNX tensor types), the FP16/BF16 builder
flags are gone, so fp16/bf16 engines are built from graphs whose tensors were cast beforehand.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

from dspark.errors import DSparkError
from dspark.lazy import optional_import

SUPPORTED_MAJORS = (10, 11)
PRECISIONS = ("fp32", "fp16", "bf16")
TENSORRT_HINT = "install TensorRT 10 or 11 for your CUDA version"


def import_tensorrt() -> ModuleType:
    """tensorrt, or one DSparkError line: also when the package is there but cannot load its libraries."""
    try:
        return optional_import("tensorrt", TENSORRT_HINT)
    except DSparkError:
        raise
    except Exception as e:  # e.g. the pip package failing to find or fetch libnvinfer
        first = str(e).splitlines()[0][:120] if str(e) else ""
        raise DSparkError(f"TensorRT is not usable here ({type(e).__name__}: {first}); {TENSORRT_HINT}") from None


@dataclass(frozen=True)
class TrtApi:
    major: int
    minor: int

    @classmethod
    def parse(cls, version: str) -> "TrtApi":
        try:
            major, minor = (int(x) for x in version.split(".")[:2])
        except ValueError:
            raise DSparkError(f"cannot read the TensorRT version {version!r}") from None
        if major not in SUPPORTED_MAJORS:
            raise DSparkError(f"TensorRT {version} is not supported (supported: 10.x, 11.x)")
        return cls(major, minor)

    @property
    def strongly_typed_only(self) -> bool:
        return self.major >= 11

    def plan(self, precision: str) -> dict:
        """What the builder must do for `precision`: network creation flags, builder flags, and whether the ONNX
        graph needs the cast pass first."""
        if precision not in PRECISIONS:
            raise DSparkError(f"unknown precision {precision!r} (choose from {', '.join(PRECISIONS)})")
        if self.strongly_typed_only:
            return {"network_flags": ["STRONGLY_TYPED"], "builder_flags": [], "cast_graph": precision != "fp32"}
        flags = {"fp16": ["FP16"], "bf16": ["BF16"], "fp32": []}[precision]
        return {"network_flags": [], "builder_flags": flags, "cast_graph": False}

    @property
    def plugin_api(self) -> str:
        return "IPluginV3"  # V2 plugins are deprecated in 10 and removed in 11
