"""A KV cache for targets whose layers differ in KV geometry (Gemma-4: sliding layers [Hkv 8, hd 256], full
layers [Hkv 1, hd 512] in gemma-4-12B-it).

One tensor [L_g, 2, B, Hkv_g, capacity, hd_g] per group of layers that share (Hkv, hd), and each layer's place in
its group. `cache[l]` is layer l's [2, B, Hkv, capacity, hd] (a view), as it is for the uniform [L, 2, B, Hkv,
capacity, hd] tensor of a Llama/Qwen3 target, so the layer loop reads both the same way.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


class LayerKV:
    def __init__(self, groups: Sequence[torch.Tensor], place: Sequence[tuple[int, int]]):
        self.groups = list(groups)
        self.place = list(place)  # layer -> (group, index in the group)

    @classmethod
    def zeros(cls, geometry: Sequence[tuple[int, int]], batch: int, capacity: int, dtype: torch.dtype) -> "LayerKV":
        """geometry: (kv_heads, head_dim) per layer; layers with equal geometry share a group, in first-seen order."""
        kinds = list(dict.fromkeys(geometry))
        place = [(kinds.index(g), sum(1 for h in geometry[:i] if h == g)) for i, g in enumerate(geometry)]
        groups = [torch.zeros(geometry.count(k), 2, batch, k[0], capacity, k[1], dtype=dtype) for k in kinds]
        return cls(groups, place)

    @classmethod
    def stack(cls, per_layer: Sequence[torch.Tensor], like: "LayerKV | None" = None,
              geometry: Sequence[tuple[int, int]] | None = None) -> "LayerKV":
        """Per-layer [2, B, Hkv, T, hd] tensors grouped as `like` (or by `geometry`) groups them."""
        if like is None:
            like = cls.zeros(geometry, 0, 0, per_layer[0].dtype)
        rows: list[list[torch.Tensor]] = [[] for _ in like.groups]
        for layer, (g, _) in enumerate(like.place):
            rows[g].append(per_layer[layer])
        return cls([torch.stack(r) for r in rows], like.place)

    def __getitem__(self, layer: int) -> torch.Tensor:
        g, j = self.place[layer]
        return self.groups[g][j]

    def __len__(self) -> int:
        return len(self.place)

    @property
    def capacity(self) -> int:
        return self.groups[0].shape[-2]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.groups)


def kv_groups(cache) -> list[torch.Tensor]:
    """The [L_g, 2, B, Hkv, capacity, hd] tensors of a cache: a LayerKV's groups, or a uniform cache itself."""
    return cache.groups if isinstance(cache, LayerKV) else [cache]
