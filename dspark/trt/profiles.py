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
    for t in spec.inputs:
        lo, opt, hi = [], [], []
        for d in t.shape:
            if isinstance(d, int):
                lo.append(d), opt.append(d), hi.append(d)
            elif d in axes:
                a, b, c = axes[d]
                lo.append(a), opt.append(b), hi.append(c)
            else:
                raise DSparkError(f"{spec.file}: input {t.name} has dynamic axis {d!r} no profile covers")
        shapes[t.name] = (tuple(lo), tuple(opt), tuple(hi))
    return shapes


def graph_profiles(man: Manifest, max_batch: int, max_context: int, opt_batch: int | None = None) -> dict[str, list[Profile]]:
    if max_batch < 1 or max_context < 2:
        raise DSparkError("max_batch must be >= 1 and max_context >= 2")
    if max_context > man.max_context:
        raise DSparkError(f"--max-context {max_context} exceeds the bundle's max context {man.max_context}")
    bk = man.block_size
    ob = opt_batch or max(1, min(max_batch, 8))
    cap = (max_context, max_context, max_context)
    batch = (1, ob, max_batch)
    sps_len = max_batch * (bk + 1)
    verifier = man.graphs["verifier"]
    prefill = _resolve(verifier, {"batch": batch, "seq": (1, min(128, max_context), max_context),
                                  "capacity": cap, "rows": (1, 1, 1), "draft_rows": (1, 1, bk)})
    verify = _resolve(verifier, {"batch": batch, "seq": (1, bk + 1, bk + 1), "capacity": cap,
                                 "rows": (1, bk + 1, bk + 1), "draft_rows": (1, bk, bk)})
    draft = _resolve(man.graphs["draft"], {"batch": batch, "ctx": (1, bk + 1, max_context), "capacity": cap})
    heads = _resolve(man.graphs["heads"], {"batch": batch, "sps": (1, sps_len, sps_len)})
    return {"verifier": [Profile("prefill", prefill), Profile("verify", verify)],
            "draft": [Profile("step", draft)], "heads": [Profile("step", heads)]}


def pad_capacity(spec: GraphSpec, feeds: dict, capacity: int) -> dict:
    """Zero-pad every cache input (and its 0/1 mask) along the capacity axis to the engines' fixed capacity.

    Padded positions are masked out, so the outputs are those of the unpadded call; this lets inputs recorded on
    ONNX Runtime (any capacity) be replayed on engines whose caches are bound at --max-context.
    """
    out = dict(feeds)
    for t in spec.inputs:
        if "capacity" not in t.shape or t.name not in feeds:
            continue
        arr = np.asarray(feeds[t.name])
        axis = t.shape.index("capacity")
        if arr.shape[axis] > capacity:
            raise DSparkError(f"{t.name} holds {arr.shape[axis]} positions, the engines {capacity}")
        widths = [(0, 0)] * arr.ndim
        widths[axis] = (0, capacity - arr.shape[axis])
        out[t.name] = np.pad(arr, widths)
    return out
