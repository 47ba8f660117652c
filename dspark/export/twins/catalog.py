"""Which of ONNX Runtime's twin graphs (dspark.export.twins.ort_graphs) a bundle can have and which it lacks, read
from its manifest alone: no onnx import, so a torch-free runtime install can ask without the export extra."""
from __future__ import annotations

from dspark.bundle import Manifest

LABELS = {"verifier_fused": "fused verifier", "heads_greedy": "greedy heads graph"}


def unfusable(target: dict) -> str | None:
    """Why ONNX Runtime's CPU GroupQueryAttention cannot take this target, or None when it can."""
    if target.get("kv_groups"):
        return (f"ONNX Runtime's GroupQueryAttention cannot express this {target['family']} target's proportional "
                f"RoPE and per-layer KV geometry; the portable verifier serves it")
    if target["head_dim"] % 16:
        return (f"ONNX Runtime's GroupQueryAttention on CPU needs a head_dim that is a multiple of 16 (this "
                f"target's is {target['head_dim']}); the portable verifier serves it")
    return None


def fusable(manifest: Manifest) -> bool:
    return unfusable(manifest.target) is None


POSSIBLE = {"verifier_fused": fusable, "heads_greedy": lambda manifest: True}


def possible_twins(manifest: Manifest) -> list[str]:
    return [name for name, possible in POSSIBLE.items() if possible(manifest)]


def missing_twins(manifest: Manifest) -> list[str]:
    return [name for name in possible_twins(manifest) if name not in manifest.graphs]
