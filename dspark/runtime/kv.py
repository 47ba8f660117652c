"""The host twins of the decode state (ONNX Runtime backend): a KV cache graphs read in place and the target features
the draft has not consumed yet. The device twins are dspark.trt.state.DeviceKV and DeviceRows."""
from __future__ import annotations

import numpy as np

from dspark.runtime.backend import CacheLengths


class _InCache:
    """The new K/V of a step whose graph wrote them into the cache itself (the fused verifier): nothing to copy."""

    def numpy(self) -> "_InCache":
        return self


IN_CACHE = _InCache()


class HostKV(CacheLengths):
    """buffer [L, 2, B, Hkv, capacity, hd]; lengths[b] = valid prefix of request b.

    Appending writes the new entries in place (O(new)); rollback is a length change (O(1)). Graphs take each
    layer's keys and values as separate inputs, which are contiguous views of the one buffer, and a [B, capacity]
    0/1 mask of the valid prefixes, so nothing is copied per step.
    """

    def __init__(self, layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int, what: str = "KV",
                 prefix: str = "past"):
        super().__init__(layers, batch, capacity, what, prefix)
        self.buffer = np.zeros((layers, 2, batch, kv_heads, capacity, head_dim), dtype=np.float32)
        self.feeds = {name: self.buffer[i, j] for name, i, j in self.names}

    def prefill_feeds(self, n: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """Past K/V and mask for a prefill of n requests: nothing is valid yet, so a 1-position dummy cache."""
        empty = np.zeros((n, self.buffer.shape[3], 1, self.buffer.shape[5]), dtype=np.float32)
        return {name: empty for name, _, _ in self.names}, np.zeros((n, 1), dtype=np.int64)

    def past_mask(self) -> np.ndarray:
        return self._mask

    def write(self, new: np.ndarray, row: int, count: int, slot: int | None = None) -> None:
        """Store the first `count` entries of row `row` of new K/V [L, 2, B, Hkv, T, hd] after the valid prefix
        of `slot` (default: the same index) without committing them."""
        if new is IN_CACHE:
            return
        slot = row if slot is None else slot
        at = int(self.lengths[slot])
        self.buffer[:, :, slot, :, at:at + count] = new[:, :, row, :, :count]


class HostRows:
    """Target features the draft has not consumed yet, per slot: [batch, width, features] + a count per slot.

    A prefill's features replace a slot's rows, a verifier step's are appended (several steps pile up while the
    draft gate skips rounds); the draft consumes them all.
    """

    def __init__(self, batch: int, features: int):
        self.rows = np.zeros((batch, 1, features), dtype=np.float32)
        self.count = np.zeros(batch, dtype=np.int64)

    def put(self, slot: int, taps: np.ndarray, row: int, count: int, append: bool = False) -> None:
        at = int(self.count[slot]) if append else 0
        if at + count > self.rows.shape[1]:  # doubling: rows piling up one per skipped round copy O(n) in all
            width = max(at + count, 2 * self.rows.shape[1])
            grown = np.zeros((self.rows.shape[0], width, self.rows.shape[2]), dtype=np.float32)
            grown[:, :self.rows.shape[1]] = self.rows
            self.rows = grown
        self.rows[slot, at:at + count] = taps[row, :count]
        self.count[slot] = at + count

    def feed(self) -> np.ndarray:
        return np.ascontiguousarray(self.rows[:, :max(int(self.count.max()), 1)])
