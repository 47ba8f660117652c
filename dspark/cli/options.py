"""Command-line options that several commands share."""
from __future__ import annotations

import click

from dspark.errors import DSparkError

WEIGHTS_OPTION = click.option(
    "--weights", default="auto", show_default=True, type=click.Choice(["auto", "packed", "mapped"]),
    help="ONNX Runtime: packed = fp32 copies of the weights at load (fastest); mapped = used from the bundle file at "
         "their stored precision (for bundles whose fp32 copy does not fit in memory; slower steps); auto = packed "
         "when it fits.")


def ort_weights(backend: str, weights: str) -> str | None:
    """--weights for the runtime: ONNX Runtime's mode, nothing for other backends (TensorRT engines carry their
    weights inside); a mode asked of another backend is refused rather than ignored."""
    if backend == "onnxruntime":
        return weights
    if weights != "auto":
        raise DSparkError(f"--weights {weights} applies to ONNX Runtime only: {backend} engines hold their own weights")
    return None
