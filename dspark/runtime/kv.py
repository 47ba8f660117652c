"""The host twins of the decode state (ONNX Runtime backend): a KV cache graphs read in place and the target features
the draft has not consumed yet. The device twins are dspark.trt.state.DeviceKV and DeviceRows."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from dspark.errors import DSparkError
from dspark.kv_layout import KVGroup
from dspark.runtime.backend import CacheLengths


class _InCache:
    """The new K/V of a step whose graph wrote them into the cache itself (the fused verifier): nothing to copy."""

    def numpy(self) -> "_InCache":
        return self


IN_CACHE = _InCache()


class HostKV(CacheLengths):
    """buffer [L, 2, B, Hkv, capacity, hd]; lengths[b] = valid prefix of request b. A target whose layers differ in
    KV geometry (dspark.kv_layout: `groups`) has one such buffer per group in `buffers` (`buffer` is the one of a
    uniform cache).

    Appending writes the new entries in place (O(new)); rollback is a length change (O(1)). Graphs take each
    layer's keys and values as separate inputs, which are contiguous views of its group's buffer, and a [B, capacity]
    0/1 mask of the valid prefixes, so nothing is copied per step.
    """

    def __init__(self, layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int, what: str = "KV",
                 prefix: str = "past", groups: Sequence[KVGroup] | None = None):
        groups = list(groups or [KVGroup(kv_heads, head_dim, tuple(range(layers)))])
        layers = sum(len(g.layers) for g in groups)
        super().__init__(layers, batch, capacity, what, prefix)
        self.groups = groups
        self.buffers = [np.zeros((len(g.layers), 2, batch, g.num_kv_heads, capacity, g.head_dim), dtype=np.float32)
                        for g in groups]
        self.place = {layer: (gi, j) for gi, g in enumerate(groups) for j, layer in enumerate(g.layers)}
        self.feeds = {name: self.layer(i)[j] for name, i, j in self.names}

    @property
    def buffer(self) -> np.ndarray:
        """The one buffer of a uniform cache."""
        if len(self.buffers) != 1:
            raise DSparkError(f"this {self.what} cache has {len(self.buffers)} KV groups, not one buffer")
        return self.buffers[0]

    def layer(self, i: int) -> np.ndarray:
        """Layer i's [2, B, Hkv, capacity, hd] (a view)."""
        g, j = self.place[i]
        return self.buffers[g][j]

    def reserve(self) -> None:
        """Touch every page of the buffers: numpy's zeros are only mapped, and the first write into each page of a
        slot's region faults it in (a prompt's K/V written into a slot never used before took 16-360 ms on this
        VM, stalling the whole batch); after this, those writes cost what later ones do."""
        for buffer in self.buffers:
            buffer.fill(0.0)

    def prefill_feeds(self, n: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """Past K/V and mask for a prefill of n requests: nothing is valid yet, so a 1-position dummy cache."""
        empty = [np.zeros((n, g.num_kv_heads, 1, g.head_dim), dtype=np.float32) for g in self.groups]
        return {name: empty[self.place[i][0]] for name, i, _ in self.names}, np.zeros((n, 1), dtype=np.int64)

    def past_mask(self) -> np.ndarray:
        return self._mask

    def write(self, new, row: int, count: int, slot: int | None = None) -> None:
        """Store the first `count` entries of row `row` of new K/V [L, 2, B, Hkv, T, hd] (a sequence of them, one
        per group, for a grouped cache) after the valid prefix of `slot` (default: the same index) without
        committing them."""
        if new is IN_CACHE:
            return
        slot = row if slot is None else slot
        at = int(self.lengths[slot])
        for buffer, part in zip(self.buffers, [new] if isinstance(new, np.ndarray) else new):
            buffer[:, :, slot, :, at:at + count] = part[:, :, row, :, :count]


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
        self.feeds = {name: whole.feeds[name][:n] for name, _, _ in whole.names}
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


def move_kv(kv: HostKV, src: int, dst: int, keep: bool = False) -> None:
    """Move slot src's valid cache prefix to slot dst (free); src is left empty (keep: as it was, a copy)."""
    length = int(kv.lengths[src])
    for buffer in kv.buffers:
        buffer[:, :, dst, :, :length] = buffer[:, :, src, :, :length]
    kv.commit(dst, 0)
    kv.commit(dst, length)
    if not keep:
        kv.commit(src, 0)


def move_rows(rows: HostRows, src: int, dst: int, keep: bool = False) -> None:
    count = int(rows.count[src])
    rows.rows[dst, :count] = rows.rows[src, :count]
    rows.count[dst] = count
    if not keep:
        rows.count[src] = 0
