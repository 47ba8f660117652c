"""Whether TensorRT can build a bundle at all, read from its manifest alone (no TensorRT, onnx or torch import), so
`dspark doctor` can say so on any install."""
from __future__ import annotations

from dspark.bundle import Manifest

# how to get a bundle TensorRT can build, for the notes that say a bundle is not one
BUILDABLE_HOW = ("for one that is, export without `dspark-export quantize` (the demo's: `dspark demo --weights fp32`)")


def not_buildable(manifest: Manifest) -> str | None:
    """Why TensorRT cannot build this bundle's graphs, or None."""
    if manifest.quantized:
        return (f"{', '.join(manifest.quantized)} hold MatMulNBits weights (an ONNX Runtime CPU operator); "
                f"TensorRT needs the graphs as exported: build from a bundle that was not quantized")
    if manifest.target.get("kv_groups"):
        return (f"its {manifest.target['family']} target's layers differ in KV geometry "
                f"({len(manifest.target['kv_groups'])} KV groups) and the TensorRT backend keeps the target cache in "
                f"one buffer; ONNX Runtime runs it")
    return None
