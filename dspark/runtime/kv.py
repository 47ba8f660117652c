"""Fixed-capacity KV cache owned by the host: graphs read it in place and return only new entries."""
from __future__ import annotations

import numpy as np

from dspark.errors import DSparkError


class KVCache:
    """buffer [L, 2, B, Hkv, capacity, hd]; lengths[b] = valid prefix of request b.

    Appending writes the new entries in place (O(new)); rollback is a length change (O(1)). Graphs take each
    layer's keys and values as separate inputs, which are contiguous views of the one buffer, and a [B, capacity]
    0/1 mask of the valid prefixes, so nothing is copied per step.
    """

    def __init__(self, layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int, what: str = "KV",
                 prefix: str = "past"):
        self.buffer = np.zeros((layers, 2, batch, kv_heads, capacity, head_dim), dtype=np.float32)
        self.lengths = np.zeros(batch, dtype=np.int64)
        self._mask = np.zeros((batch, capacity), dtype=np.int64)
        self.capacity = capacity
        self.what = what
        self.names = [(f"{prefix}.{i}.{kind}", i, j) for i in range(layers) for j, kind in enumerate(("key", "value"))]
        self.feeds = {name: self.buffer[i, j] for name, i, j in self.names}

    def slot_feeds(self, slot: int) -> dict[str, np.ndarray]:
        """Batch-1 views of one slot (contiguous, so a prefill call binds them in place too)."""
        return {name: self.buffer[i, j, slot:slot + 1] for name, i, j in self.names}

    def past_mask(self) -> np.ndarray:
        return self._mask

    def check_room(self, b: int, count: int) -> None:
        if self.lengths[b] + count > self.capacity:
            raise DSparkError(f"context overflow: request {b} needs {int(self.lengths[b]) + count} {self.what} "
                              f"positions, the session holds {self.capacity}; shorten the prompt or max_new_tokens")

    def write(self, new: np.ndarray, row: int, count: int, slot: int | None = None) -> None:
        """Store the first `count` entries of row `row` of new K/V [L, 2, B, Hkv, T, hd] after the valid prefix
        of `slot` (default: the same index) without committing them."""
        slot = row if slot is None else slot
        at = int(self.lengths[slot])
        self.buffer[:, :, slot, :, at:at + count] = new[:, :, row, :, :count]

    def commit(self, b: int, length: int) -> None:
        """Set request b's valid length: growing commits written entries, shrinking rolls back."""
        old = int(self.lengths[b])
        if length > old:
            self._mask[b, old:length] = 1
        else:
            self._mask[b, length:old] = 0
        self.lengths[b] = length
