"""How a bundle's target KV cache is laid out: groups of layers that share a KV geometry (torch-free).

A Llama/Qwen3 target's layers are uniform: one [L, 2, B, Hkv, capacity, hd] cache, and the manifest's target
section names num_kv_heads / head_dim. A Gemma-4 target mixes sliding-window layers (8 KV heads x 256 in
gemma-4-12B-it) with full layers (1 x 512): the manifest's target section then also has `kv_groups`, one entry per
geometry in the order of the layers that first use it,

    {"kind": "sliding_attention", "num_kv_heads": 8, "head_dim": 256, "layers": [0, 1, 2, 3, 4, 6, ...]}

(`kind` is the layers' layer type, "mixed" if they differ), and the runtime keeps one [len(layers), 2, B, Hkv,
capacity, hd] buffer per group; layer l is entry layers.index(l) of its group. The graphs still take one
past.{l}.key / .value input per layer (that layer's slice of its group's buffer); the verifier gives the new K/V
as one output per group: `new_kv` for a uniform target, new_kv.{g} otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from dspark.schema import Fields

NEW_KV = "new_kv"


@dataclass(frozen=True)
class KVGroup:
    num_kv_heads: int
    head_dim: int
    layers: tuple[int, ...]
    kind: str = ""

    def bytes_per_position(self, itemsize: int = 4) -> int:
        """K and V of every layer of the group, one position of one request."""
        return 2 * len(self.layers) * self.num_kv_heads * self.head_dim * itemsize

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
                "layers": list(self.layers)}


def group_layers(geometry: Sequence[tuple[int, int]], kinds: Sequence[str] = ()) -> list[KVGroup]:
    """geometry: (kv_heads, head_dim) per layer; layers of equal geometry share a group, in first-seen order (as
    dspark.models.layer_kv.LayerKV groups them)."""
    order = list(dict.fromkeys(geometry))
    groups = []
    for heads, dim in order:
        layers = tuple(i for i, g in enumerate(geometry) if g == (heads, dim))
        found = {kinds[i] for i in layers} if kinds else set()
        kind = found.pop() if len(found) == 1 else ("mixed" if found else "")
        groups.append(KVGroup(heads, dim, layers, kind))
    return groups


def kv_groups(section: dict[str, Any]) -> list[KVGroup]:
    """The groups of a manifest's target (or draft) section: its kv_groups, else one group of every layer."""
    raw = section.get("kv_groups")
    if not raw:
        return [KVGroup(int(section["num_kv_heads"]), int(section["head_dim"]), tuple(range(section["num_layers"])))]
    return [KVGroup(int(g["num_kv_heads"]), int(g["head_dim"]), tuple(g["layers"]), g.get("kind", "")) for g in raw]


def layer_geometry(section: dict[str, Any]) -> list[tuple[int, int]]:
    """(kv_heads, head_dim) of every layer."""
    out: dict[int, tuple[int, int]] = {}
    for g in kv_groups(section):
        out.update({layer: (g.num_kv_heads, g.head_dim) for layer in g.layers})
    return [out[i] for i in range(len(out))]


def kv_output_names(section: dict[str, Any]) -> list[str]:
    """The verifier outputs that carry the new K/V, one per group."""
    return [NEW_KV] if not section.get("kv_groups") else [f"{NEW_KV}.{g}" for g in range(len(section["kv_groups"]))]


def bytes_per_position(section: dict[str, Any], itemsize: int = 4) -> int:
    return sum(g.bytes_per_position(itemsize) for g in kv_groups(section))


def validate_kv_groups(section: Fields, num_layers: int) -> None:
    """A section's kv_groups (absent: uniform): every layer in exactly one group, in increasing order in it, and
    no two groups of one geometry."""
    if not section.has("kv_groups"):
        return
    raw = section.get("kv_groups")
    if not isinstance(raw, list) or not raw:
        section.fail("kv_groups", f"must be a non-empty list of layer groups, not {raw!r:.60}")
    seen: list[int] = []
    shapes = set()
    for i, g in enumerate(raw):
        group = Fields(g, f"{section.where}.kv_groups[{i}]")
        shapes.add((group.integer("num_kv_heads", 1), group.integer("head_dim", 1)))
        group.string("kind", default="")
        layers = group.int_list("layers", 0, num_layers - 1)
        if not layers or layers != sorted(set(layers)):
            group.fail("layers", f"must list increasing layer ids, not {layers}")
        seen += layers
    if sorted(seen) != list(range(num_layers)):
        section.fail("kv_groups", f"must hold every layer 0..{num_layers - 1} once, not {sorted(seen)}")
    if len(shapes) != len(raw):
        section.fail("kv_groups", "has two groups of one geometry (num_kv_heads, head_dim)")
