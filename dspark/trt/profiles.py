"""TensorRT optimization profiles for a bundle's graphs (pure logic, no TensorRT import).

Caches are bound at a fixed capacity (= max_context) so a decode step has static cache shapes and can be captured
in a CUDA graph; the dynamic axes are the batch, the positions per step and the new context rows.
The verifier gets two profiles: `prefill` (up to max_context positions) and `verify` (1..Bk+1 positions), so
TensorRT tunes kernels for the shapes each phase really runs.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dspark.bundle import GraphSpec, Manifest
from dspark.errors import DSparkError


@dataclass(frozen=True)
class Profile:
    name: str
    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]  # input -> (min, opt, max)


def _resolve(spec: GraphSpec, axes: dict[str, tuple[int, int, int]]) -> dict:
    shapes = {}
    for tensor in spec.inputs:
        lo, opt, hi = [], [], []
        for dim in tensor.shape:
            if isinstance(dim, int):
                bounds = (dim, dim, dim)
            elif dim in axes:
                bounds = axes[dim]
            else:
                raise DSparkError(f"{spec.file}: input {tensor.name} has dynamic axis {dim!r} no profile covers")
            for values, bound in zip((lo, opt, hi), bounds):
                values.append(bound)
        shapes[tensor.name] = (tuple(lo), tuple(opt), tuple(hi))
    return shapes


def graph_profiles(manifest: Manifest, max_batch: int, max_context: int,
                   opt_batch: int | None = None) -> dict[str, list[Profile]]:
    if max_batch < 1 or max_context < 2:
        raise DSparkError("max_batch must be >= 1 and max_context >= 2")
    if max_context > manifest.max_context:
        raise DSparkError(f"--max-context {max_context} exceeds the bundle's max context {manifest.max_context}")
    block = manifest.block_size
    opt_batch = opt_batch or max(1, min(max_batch, 8))
    capacity = (max_context, max_context, max_context)
    batch = (1, opt_batch, max_batch)
    sps_len = max_batch * (block + 1)
    verifier = manifest.graphs["verifier"]
    prefill = _resolve(verifier, {"batch": batch, "seq": (1, min(128, max_context), max_context),
                                  "capacity": capacity, "rows": (1, 1, 1), "draft_rows": (1, 1, block)})
    verify = _resolve(verifier, {"batch": batch, "seq": (1, block + 1, block + 1), "capacity": capacity,
                                 "rows": (1, block + 1, block + 1), "draft_rows": (1, block, block)})
    draft = _resolve(manifest.graphs["draft"], {"batch": batch, "ctx": (1, block + 1, max_context),
                                                "capacity": capacity})
    heads = _resolve(manifest.graphs["heads"], {"batch": batch, "sps": (1, sps_len, sps_len)})
    return {"verifier": [Profile("prefill", prefill), Profile("verify", verify)],
            "draft": [Profile("step", draft)], "heads": [Profile("step", heads)]}


def pad_capacity(spec: GraphSpec, feeds: dict, capacity: int) -> dict:
    """Zero-pad every cache input (and its 0/1 mask) along the capacity axis to the engines' fixed capacity.

    Padded positions are masked out, so the outputs are those of the unpadded call; this lets inputs recorded on
    ONNX Runtime (any capacity) be replayed on engines whose caches are bound at --max-context.
    """
    out = dict(feeds)
    for tensor in spec.inputs:
        if "capacity" not in tensor.shape or tensor.name not in feeds:
            continue
        array = np.asarray(feeds[tensor.name])
        axis = tensor.shape.index("capacity")
        if array.shape[axis] > capacity:
            raise DSparkError(f"{tensor.name} holds {array.shape[axis]} positions, the engines {capacity}")
        widths = [(0, 0)] * array.ndim
        widths[axis] = (0, capacity - array.shape[axis])
        out[tensor.name] = np.pad(array, widths)
    return out
