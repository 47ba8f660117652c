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


class LeadingKV:
    """The first n slots of a HostKV as the graphs read them (views: no copy); writes go to the whole cache."""

    def __init__(self, whole: HostKV, n: int):
        self.whole = whole
        self.feeds = {name: whole.buffer[i, j, :n] for name, i, j in whole.names}
        self.lengths = whole.lengths[:n]
        self._mask = whole.past_mask()[:n]

    def past_mask(self) -> np.ndarray:
        return self._mask

    def __getattr__(self, name):  # write, commit, check_room, room, capacity: slot indices are the whole's
        return getattr(self.whole, name)


class LeadingRows:
    """The first n slots of a HostRows (its row buffer may grow, so rows are read through the whole)."""

    def __init__(self, whole: HostRows, n: int):
        self.whole, self.n = whole, n
        self.count = whole.count[:n]

    def put(self, slot: int, taps, row: int, count: int, append: bool = False) -> None:
        self.whole.put(slot, taps, row, count, append)

    def feed(self) -> np.ndarray:
        return np.ascontiguousarray(self.whole.rows[:self.n, :max(int(self.count.max()), 1)])


def move_kv(kv: HostKV, src: int, dst: int) -> None:
    """Move slot src's valid cache prefix to slot dst (free); src is left empty."""
    length = int(kv.lengths[src])
    kv.buffer[:, :, dst, :, :length] = kv.buffer[:, :, src, :, :length]
    kv.commit(dst, 0)
    kv.commit(dst, length)
    kv.commit(src, 0)


def move_rows(rows: HostRows, src: int, dst: int) -> None:
    count = int(rows.count[src])
    rows.rows[dst, :count] = rows.rows[src, :count]
    rows.count[dst], rows.count[src] = count, 0
