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


WINDOW_STEP = 64  # the least step of the buffers' width (wider caches grow and shrink by an eighth)


def _columns(end: int, capacity: int) -> int:
    """The width a cache takes for entries up to `end`: rounded up to its step."""
    step = max(WINDOW_STEP, end // 8 // WINDOW_STEP * WINDOW_STEP)
    return min(capacity, max(WINDOW_STEP, -(-end // step) * step))


class HostKV(CacheLengths):
    """buffer [L, 2, B, Hkv, width, hd]; lengths[b] = valid prefix of request b. A target whose layers differ in
    KV geometry (dspark.kv_layout: `groups`) has one such buffer per group in `buffers` (`buffer` is the one of a
    uniform cache).

    Appending writes the new entries in place (O(new)); rollback is a length change (O(1)). Graphs take each
    layer's keys and values as separate inputs, which are contiguous views of its group's buffer, and a [B, width]
    0/1 mask of the valid prefixes, so nothing is copied per step.

    The buffers are `width` columns wide, not `capacity`: a step of WINDOW_STEP (an eighth of wider widths) above the
    longest valid prefix (fit, before each step). Attention that reads every column (the portable graph,
    dspark.export.twins.row_attention) then costs what the live requests need, not what the longest could. Each
    buffer is a view of the start of one allocation of `capacity` columns (made resident by reserve): a new width
    moves every (layer, slot, head) row of entries within it, O(valid entries), no allocation.
    """

    def __init__(self, layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int, what: str = "KV",
                 prefix: str = "past", groups: Sequence[KVGroup] | None = None):
        groups = list(groups or [KVGroup(kv_heads, head_dim, tuple(range(layers)))])
        layers = sum(len(g.layers) for g in groups)
        super().__init__(layers, batch, 0, what, prefix)
        self.capacity = capacity
        self.groups = groups
        self.place = {layer: (gi, j) for gi, g in enumerate(groups) for j, layer in enumerate(g.layers)}
        self._memory = [np.zeros(len(g.layers) * 2 * batch * g.num_kv_heads * capacity * g.head_dim, np.float32)
                        for g in groups]
        self.buffers: list[np.ndarray] = []
        self.version = 0  # counts re-layings (views of the buffers taken before one are stale)
        self._lay(min(capacity, WINDOW_STEP))

    @property
    def width(self) -> int:
        """Columns the buffers have now: the graphs attend over all of them."""
        return self._mask.shape[1]

    def fit(self, positions: int) -> None:
        """Size the buffers for a step writing `positions` entries after every slot's valid prefix: wide enough,
        and narrowed when the longest prefix needs at most half of them (a long request left)."""
        need = _columns(int(self.lengths.max()) + positions, self.capacity)
        if need > self.width or 2 * need <= self.width:
            self._lay(need)

    def commit(self, b: int, length: int) -> None:
        self._reach(length)
        super().commit(b, length)

    def _reach(self, end: int) -> None:
        """Widen the buffers to hold entries up to `end` (never narrower: entries written and not committed stay)."""
        if end > self.width:
            self._lay(_columns(end, self.capacity))

    def _lay(self, width: int) -> None:
        """Re-lay the buffers and the mask `width` columns wide, keeping what fits (every valid prefix does)."""
        old = self.width
        keep = min(width, old) if self.buffers else 0
        laid = []
        for g, memory in zip(self.groups, self._memory):
            size = g.head_dim  # floats per column
            rows = memory.size // (self.capacity * size)  # (layer, K|V, slot, head) rows
            # rows move up (wider) from the last, down (narrower) from the first: none is overwritten before it moves
            for r in (range(rows - 1, 0, -1) if width > old else range(1, rows)) if keep else ():
                memory[r * width * size:(r * width + keep) * size] = memory[r * old * size:(r * old + keep) * size]
            laid.append(memory[:rows * width * size].reshape(len(g.layers), 2, len(self.lengths), g.num_kv_heads,
                                                              width, size))
        mask = np.zeros((len(self.lengths), width), dtype=np.int64)
        mask[:, :keep] = self._mask[:, :keep]
        self.buffers, self._mask = laid, mask
        self.feeds = {name: self.layer(i)[j] for name, i, j in self.names}
        self.version += 1

    @property
    def buffer(self) -> np.ndarray:
        """The one buffer of a uniform cache."""
        if len(self.buffers) != 1:
            raise DSparkError(f"this {self.what} cache has {len(self.buffers)} KV groups, not one buffer")
        return self.buffers[0]

    def layer(self, i: int) -> np.ndarray:
        """Layer i's [2, B, Hkv, width, hd] (a view)."""
        g, j = self.place[i]
        return self.buffers[g][j]

    def reserve(self) -> None:
        """Touch every page of the buffers: numpy's zeros are only mapped, and the first write into each page of a
        slot's region faults it in (a prompt's K/V written into a slot never used before took 16-360 ms on this
        VM, stalling the whole batch); after this, those writes cost what later ones do. (Empties the cache.)"""
        for memory in self._memory:
            memory.fill(0.0)

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
        self._reach(at + count)
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
    """The first n slots of a HostKV as the graphs read them (views: no copy, taken again after the whole re-lays
    its buffers); writes go to the whole cache."""

    def __init__(self, whole: HostKV, n: int):
        self.whole, self.n = whole, n
        self.lengths = whole.lengths[:n]
        self._seen = -1  # the whole's version the views below are of

    @property
    def feeds(self) -> dict[str, np.ndarray]:
        self._views()
        return self._feeds

    def past_mask(self) -> np.ndarray:
        self._views()
        return self._mask

    def _views(self) -> None:
        whole = self.whole
        if self._seen != whole.version:
            self._feeds = {name: whole.feeds[name][:self.n] for name, _, _ in whole.names}
            self._mask = whole.past_mask()[:self.n]
            self._seen = whole.version

    def __getattr__(self, name):  # write, commit, fit, check_room, room, capacity: slot indices are the whole's
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
