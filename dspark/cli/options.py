"""Command-line options that several commands share."""
from __future__ import annotations

import dataclasses

import click

from dspark.errors import DSparkError

WEIGHTS_OPTION = click.option(
    "--weights", default="auto", show_default=True, type=click.Choice(["auto", "packed", "mapped"]),
    help="ONNX Runtime: packed = fp32 copies of the weights at load (fastest); mapped = used from the bundle file at "
         "their stored precision (for bundles whose fp32 copy does not fit in memory; slower steps); auto = packed "
         "when it fits.")


def run_policy(policy: str, ar: bool, threshold: float | None, gate: bool):
    """`dspark run`'s --policy, or what its shorthands --ar / --threshold spell; --gate adds +gate."""
    from dspark.runtime import VerifyPolicy

    shorthand = [name for name, given in (("--ar", ar), ("--threshold", threshold is not None)) if given]
    if len(shorthand) > 1 or (shorthand and policy != "all"):
        raise DSparkError(f"{' and '.join(shorthand + (['--policy'] if policy != 'all' else []))} each name the "
                          f"policy: give one (--ar is --policy ar, --threshold T is --policy static:T)")
    if ar:
        chosen = VerifyPolicy("ar")
    elif threshold is not None:
        chosen = VerifyPolicy("all") if threshold == 0 else VerifyPolicy("static", threshold=threshold)
    else:
        chosen = VerifyPolicy.parse(policy)
    return dataclasses.replace(chosen, gate=True) if gate else chosen  # VerifyPolicy refuses ar with the gate


def ort_weights(backend: str, weights: str) -> str | None:
    """--weights for the runtime: ONNX Runtime's mode, nothing for other backends (TensorRT engines carry their
    weights inside); a mode asked of another backend is refused rather than ignored."""
    if backend == "onnxruntime":
        return weights
    if weights != "auto":
        raise DSparkError(f"--weights {weights} applies to ONNX Runtime only: {backend} engines hold their own weights")
    return None
