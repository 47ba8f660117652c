"""ONNX Runtime's own graphs of a bundle: twins of portable graphs built with what only ONNX Runtime runs.

  verifier_fused  the verifier with fused CPU operators (dspark.export.twins.ort_fused)
  heads_greedy    the draft heads of all-greedy rounds, without the sampling machinery
                  (dspark.export.twins.greedy_heads)

Each is rewritten from its portable graph, shares its weights, and is optional: a bundle without one runs its
portable graph. `dspark-export onnx` adds them, `dspark-export fuse` adds them to an older bundle, and quantizing a
portable graph rebuilds its twin.
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Callable

from dspark.bundle import Manifest
from dspark.errors import DSparkError
from dspark.export.twins.catalog import LABELS, POSSIBLE, missing_twins, possible_twins, unfusable
from dspark.export.twins.greedy_heads import add_greedy_heads
from dspark.export.twins.fused_bundle import add_fused_verifier, forget_step_costs
from dspark.files import atomic_folder, linked_copy

# twin: (the portable graph it is built from, whether this bundle can have it, builder)
TWINS: dict[str, tuple[str, Callable[[Manifest], bool], Callable[[Path, Manifest], object]]] = {
    "verifier_fused": ("verifier", POSSIBLE["verifier_fused"], add_fused_verifier),
    "heads_greedy": ("heads", POSSIBLE["heads_greedy"], add_greedy_heads),
}


def add_twins(folder: Path, manifest: Manifest, names=tuple(TWINS), strict: bool = False) -> dict[str, str | None]:
    """Build each twin in `names` into `folder` and enter it in `manifest` (the caller writes the manifest). Returns
    {twin: None when built, else why not}. Not strict: a twin this bundle cannot have is passed over and one whose
    build fails is left out with a warning; strict: the first failure raises. A new fused verifier drops the SPS
    table: it timed other verifier steps."""
    done: dict[str, str | None] = {}
    for name in names:
        _, possible, build = TWINS[name]
        if not strict and not possible(manifest):
            continue
        try:
            build(folder, manifest)
            done[name] = None
        except DSparkError as e:  # the portable graph serves every backend: the bundle stays valid
            manifest.graphs.pop(name, None)
            if strict:
                raise
            warnings.warn(f"no {LABELS[name]} in this bundle: {e}", stacklevel=2)
            done[name] = str(e)
    if "verifier_fused" in done and done["verifier_fused"] is None:
        forget_step_costs(manifest)
    return done


def rebuild_twins(folder: Path, manifest: Manifest, changed: list[str]) -> None:
    """After the portable graphs in `changed` were rewritten (quantized): rebuild the twins made from them."""
    add_twins(folder, manifest, [name for name, (source, _, _) in TWINS.items()
                                 if source in changed and name in manifest.graphs], strict=True)


def fuse_bundle(bundle: Path, names: list[str] | None = None) -> dict[str, str | None]:
    """`dspark-export fuse`: build ONNX Runtime's twins for BUNDLE in a linked copy that replaces it in one step;
    {twin: None when built, else why not}. names None: the twins it lacks and can have (and, for those it cannot
    have, why not; an error when it can have none); named twins are (re)built and must all build. The bundle is
    left unchanged on any error."""
    bundle = Path(bundle)
    manifest = Manifest.read_checked(bundle)
    skipped = {}
    if names is None:
        skipped = {n: _why_not(n, manifest) for n in TWINS if n not in possible_twins(manifest)}
        if len(skipped) == len(TWINS):
            raise DSparkError("; ".join(skipped.values()))
        names = missing_twins(manifest)
    if names:
        with atomic_folder(bundle) as staging:
            linked_copy(bundle, staging)
            done = add_twins(staging, manifest, names, strict=True)
            manifest.write(staging)
    else:
        done = {}
    return {**done, **skipped}


def _why_not(name: str, manifest: Manifest) -> str:
    why = unfusable(manifest.target) if name == "verifier_fused" else None
    return f"no {LABELS[name]}" + (f": {why}" if why else "")
