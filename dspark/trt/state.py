"""Device-resident decode state of the TensorRT backend: the KV caches and the draft's pending target features.

Device twins of dspark.runtime.kv.HostKV and HostRows. New K/V entries and features are appended after each
request's valid prefix by one row-scatter kernel launch per cache per step (dspark/ops/scatter_rows.cu), queued
here and issued by Device.flush before the next engine runs; rollback is a length change. The caches are bound at
the engines' fixed capacity (the build's --max-context) and the draft's feature input keeps a fixed width (block
size + 1 rows, grown when the draft gate lets rows pile up) with per-slot counts, so every step has static shapes.
"""
from __future__ import annotations

import numpy as np

from dspark.runtime.backend import CacheLengths
from dspark.trt.memory import Device, DeviceTensor, Lease, Staging

# a queued append: (source tensor, source batch row, destination batch row, first destination row, row count)
Append = tuple[DeviceTensor, int, int, int, int]


def disjoint_waves(entries: list) -> list[list]:
    """Split (src, src_row, dst_row, at, count) appends into launches whose destination rows do not overlap.

    One launch writes its rows in no defined order, so two entries that write the same destination row must go in
    successive launches, in queue order (the later one wins, as in dspark.ops.scatter_rows.reference). Usually one
    wave."""
    waves: list[list] = []
    placed: list[tuple[int, int, int, int]] = []  # (dst_row, first, end, wave)
    for entry in entries:
        _, _, dst_row, at, count = entry
        first, end = max(at, 0), at + count
        wave = 0
        if end > first:  # an empty entry writes nothing and conflicts with nothing
            wave = 1 + max((w for row, lo, hi, w in placed if row == dst_row and lo < end and first < hi), default=-1)
            placed.append((dst_row, first, end, wave))
        if wave == len(waves):
            waves.append([])
        waves[wave].append(entry)
    return waves


class AppendQueue:
    """Queued row-scatter launches into one destination, issued by Device.flush before the next engine runs."""

    def __init__(self, memory: Lease, dst: int, planes: int, batch: int, heads: int, rows: int, width: int):
        self.device, self.dst = memory.device, dst
        self.planes, self.batch, self.heads, self.rows, self.width = planes, batch, heads, rows, width
        self.queue: list[Append] = []

    def add(self, src: DeviceTensor, src_row: int, dst_row: int, at: int, count: int) -> None:
        if not self.queue:
            self.device.pending.append(self)
        self.queue.append((src, src_row, dst_row, at, count))

    def launches(self) -> list[tuple["AppendQueue", DeviceTensor, list[Append]]]:
        """Empties the queue: (self, source, entries) per source tensor and wave of disjoint destinations."""
        groups: dict[int, list[Append]] = {}
        for entry in self.queue:
            groups.setdefault(entry[0].ptr, []).append(entry)
        self.queue = []
        return [(self, entries[0][0], wave) for entries in groups.values() for wave in disjoint_waves(entries)]

    def launch(self, src: DeviceTensor, wave: list[Append], index: int) -> None:
        # K/V [L, 2, B, Hkv, T, hd] or features [B, T, F]: (batch rows, rows per batch row)
        src_batch, src_rows = (src.shape[2], src.shape[4]) if len(src.shape) == 6 else src.shape[:2]
        self.device.cuda.scatter_rows(src.ptr, self.dst, self.planes, src_batch, self.heads, src_rows, self.batch,
                                      self.rows, self.width, index, len(wave), max(entry[4] for entry in wave),
                                      self.device.compute)


class DeviceKV(CacheLengths):
    """Device twin of dspark.runtime.kv.HostKV: [L, 2, B, Hkv, capacity, hd] on the device, lengths and the mask
    on the host (the mask is uploaded when a commit changed it)."""

    holder = "the engines hold"
    hint = " (or rebuild with a larger --max-context)"

    def __init__(self, device: Device, layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int,
                 what: str = "KV", prefix: str = "past"):
        super().__init__(layers, batch, capacity, what, prefix)
        self.device, self.memory = device, device.lease(self)
        self.shape = (layers, 2, batch, kv_heads, capacity, head_dim)
        self.ptr = self.memory.alloc(int(np.prod(self.shape)) * 4, zero=True)
        plane = batch * kv_heads * capacity * head_dim * 4
        self._feeds = {name: device.tensor(self.ptr + (2 * i + j) * plane, (batch, kv_heads, capacity, head_dim))
                       for name, i, j in self.names}
        self._mask_device = device.tensor(self.memory.alloc(self._mask.nbytes, zero=True), (batch, capacity),
                                          np.int64)
        self._mask_stage = Staging(self.memory)
        self._mask_dirty = False
        self._uploads = 0
        self._empty = 0  # device pointer of the zero cache + mask prefills bind
        self.appends = AppendQueue(self.memory, self.ptr, 2 * layers, batch, kv_heads, capacity, head_dim)

    @property
    def feeds(self) -> dict[str, DeviceTensor]:
        return self._feeds

    def past_mask(self) -> DeviceTensor:
        if self._mask_dirty:
            host_ptr, stage = self._mask_stage.view(self._uploads % 2, self._mask.shape, np.int64)
            self._uploads += 1
            stage[...] = self._mask
            self.device.cuda.copy(self._mask_device.ptr, host_ptr, stage.nbytes, self.device.compute)
            self._mask_dirty = False
        return self._mask_device

    def prefill_feeds(self, n: int) -> tuple[dict[str, DeviceTensor], DeviceTensor]:
        """An all-zero cache at the engines' fixed capacity, shared by every layer input, and a zero mask."""
        _, _, batch, heads, capacity, head_dim = self.shape
        cache_bytes = batch * heads * capacity * head_dim * 4
        if not self._empty:
            self._empty = self.memory.alloc(cache_bytes + batch * capacity * 8, zero=True)
        kv = self.device.tensor(self._empty, (n, heads, capacity, head_dim))
        mask = self.device.tensor(self._empty + cache_bytes, (n, capacity), np.int64)
        return {name: kv for name, _, _ in self.names}, mask

    def write(self, new: DeviceTensor, row: int, count: int, slot: int | None = None) -> None:
        """Queue entries [0, count) of batch row `row` of new K/V [L, 2, B', Hkv, T, hd] after slot's prefix."""
        slot = row if slot is None else slot
        self.appends.add(new, row, slot, int(self.lengths[slot]), count)

    def commit(self, b: int, length: int) -> None:
        self._mask_dirty |= length != int(self.lengths[b])
        super().commit(b, length)


class DeviceRows:
    """Device twin of dspark.runtime.kv.HostRows, at a fixed width (the draft input's shape stays static)."""

    def __init__(self, device: Device, batch: int, features: int, width: int):
        self.device, self.batch, self.features, self.width = device, batch, features, width
        self.memory = device.lease(self)
        self.ptr = self.memory.alloc(batch * width * features * 4, zero=True)
        self.count = np.zeros(batch, dtype=np.int64)
        self.appends = self._queue(self.ptr, width)

    def _queue(self, ptr: int, width: int) -> AppendQueue:
        return AppendQueue(self.memory, ptr, 1, self.batch, 1, width, self.features)

    def put(self, slot: int, taps: DeviceTensor, row: int, count: int, append: bool = False) -> None:
        at = int(self.count[slot]) if append else 0
        if at + count > self.width:
            self._grow(at + count)
        self.appends.add(taps, row, slot, at, count)
        self.count[slot] = at + count

    def _grow(self, need: int) -> None:
        """More rows than the width (the draft gate skipped rounds): copy the held rows into a wider buffer."""
        self.device.flush()
        width = max(need, 2 * self.width)
        old = self.feed()
        new_ptr = self.memory.alloc(self.batch * width * self.features * 4, zero=True)
        grown = self._queue(new_ptr, width)
        for slot in range(self.batch):
            if self.count[slot]:
                grown.add(old, slot, slot, 0, int(self.count[slot]))
        self.device.flush()
        self.memory.give_back(self.ptr)
        self.ptr, self.width = new_ptr, width
        self.appends = self._queue(self.ptr, width)

    def feed(self) -> DeviceTensor:
        return self.device.tensor(self.ptr, (self.batch, self.width, self.features))
