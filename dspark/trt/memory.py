"""Device and pinned host memory of the TensorRT backend: tensors, the per-backend pool, leases and staging.

Everything here goes through a `cuda` object with the small interface of dspark.trt.cuda.CudaRuntime (pointers and
stream/event handles are plain ints), so it runs unchanged on dspark.testing.gpu_emulator's stand-in.
"""
from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass

import numpy as np

from dspark.errors import DSparkError


@dataclass
class DeviceTensor:
    """A dense tensor in device memory. Valid until the graph that produced it runs again."""

    cuda: object
    ptr: int
    shape: tuple[int, ...]
    dtype: np.dtype
    stream: int
    base: object = None  # the tensor a view was taken of, kept alive with the view (it may own the memory)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize

    def __getitem__(self, key):
        """Only leading-axis prefixes (x[:n]): the contiguous first n rows."""
        if not (isinstance(key, slice) and key.start in (None, 0) and key.step in (None, 1)):
            raise TypeError("a DeviceTensor supports only x[:n]")
        n = min(self.shape[0], self.shape[0] if key.stop is None else key.stop)
        return DeviceTensor(self.cuda, self.ptr, (n, *self.shape[1:]), self.dtype, self.stream, self.base or self)

    def numpy(self) -> np.ndarray:
        out = np.empty(self.shape, dtype=self.dtype)
        self.cuda.copy(out.ctypes.data, self.ptr, out.nbytes, self.stream)
        self.cuda.sync_stream(self.stream)
        return out


class HostArray:
    """An output copied back to the host; `.numpy()` mirrors onnxruntime.OrtValue."""

    def __init__(self, array: np.ndarray):
        self.array = array

    def numpy(self) -> np.ndarray:
        return self.array


class Device:
    """The backend's CUDA resources: one compute stream, one copy stream, and every allocation it made.

    Memory is freed when the backend is collected. Decode state (caches, feature rows, zero tensors, their staging)
    is leased by the object that holds it (`lease(owner)`) and goes back to a pool when that object is collected;
    the next decode of the same shapes gets the same addresses back, so it allocates nothing, re-binds nothing and
    replays the CUDA graphs captured before. The pool serves exact sizes, so it holds at most about one decode's
    state per batch size seen; `trim()` frees it, and so does an allocation that would otherwise fail."""

    def __init__(self, cuda):
        self.cuda = cuda
        self.compute = cuda.stream()
        self.copy = cuda.stream()
        # dspark.trt.state.AppendQueue objects with appends not yet issued (flushed before any engine runs)
        self.pending: list = []
        self.sizes: dict[int, int] = {}  # device pointer -> bytes, for everything not yet freed (pooled included)
        self.pinned: dict[int, int] = {}  # the same for pinned host memory
        self.pool: dict[int, list[int]] = {}  # bytes -> released device blocks
        self.born: dict[int, int] = {}  # device pointer -> allocation sequence number
        self._births = itertools.count()
        self.pinned_pool: dict[int, list[tuple[int, np.ndarray]]] = {}
        self.handles: dict[str, list[int]] = {"stream": [self.compute, self.copy], "event": [], "graph": []}
        weakref.finalize(self, _release_all, cuda, self.sizes, self.pinned, self.handles).atexit = False
        # index tables of the appends: one upload per flush, pinned staging double-buffered by flush parity; a slot
        # is rewritten only once the upload that last read it has run (two flushes can follow with no sync between)
        self._index_stage = Staging(self)
        self._index_uploaded = [self.event(), self.event()]
        self._index_device: tuple[int, int] = (0, 0)  # (device pointer, bytes)
        self._flushes = 0

    def alloc(self, nbytes: int, zero: bool = False) -> int:
        nbytes = max(int(nbytes), 1)
        if self.pool.get(nbytes):  # the oldest block first: a decode that allocates in the order the last one did
            ptr = min(self.pool[nbytes], key=self.born.__getitem__)  # gets the same addresses back
            self.pool[nbytes].remove(ptr)
        else:
            try:
                ptr = self.cuda.malloc(nbytes)
            except DSparkError:  # out of memory: what the pool holds may make room
                if not self.trim():
                    raise
                ptr = self.cuda.malloc(nbytes)
            self.born[ptr] = next(self._births)
        self.sizes[ptr] = nbytes
        if zero:
            self.cuda.memset(ptr, nbytes, self.compute)
        return ptr

    def free(self, ptr: int) -> None:
        """Free now (a buffer that grew): waits for the work that may still read it."""
        self.cuda.sync_stream(self.compute)
        self.cuda.free(ptr)
        del self.sizes[ptr], self.born[ptr]

    def host_alloc(self, nbytes: int) -> tuple[int, np.ndarray]:
        nbytes = max(int(nbytes), 64)
        block = self.pinned_pool[nbytes].pop() if self.pinned_pool.get(nbytes) else self.cuda.host_alloc(nbytes)
        self.pinned[block[0]] = nbytes
        return block

    def host_free(self, ptr: int) -> None:
        self.cuda.sync_stream(self.copy)
        self.cuda.sync_stream(self.compute)
        self.cuda.host_free(ptr)
        del self.pinned[ptr]

    def event(self) -> int:
        self.handles["event"].append(self.cuda.event())
        return self.handles["event"][-1]

    def lease(self, owner) -> "Lease":
        return Lease(self, owner)

    def release(self, device_ptrs: list[int], pinned: list[tuple[int, np.ndarray]] = ()) -> None:
        """Back to the pool (the streams are drained first: the host may write a pinned block as soon as it is
        handed out again)."""
        if pinned:
            self.cuda.sync_stream(self.copy)
            self.cuda.sync_stream(self.compute)
        for ptr in device_ptrs:
            self.pool.setdefault(self.sizes[ptr], []).append(ptr)
        for block in pinned:
            self.pinned_pool.setdefault(self.pinned[block[0]], []).append(block)

    def trim(self) -> int:
        """Free the pooled device blocks; returns how many bytes that gave back."""
        freed = 0
        self.cuda.sync_stream(self.compute)
        pool, self.pool = self.pool, {}  # (a collected owner may release into the new one meanwhile)
        for ptrs in pool.values():
            for ptr in ptrs:
                self.cuda.free(ptr)
                freed += self.sizes.pop(ptr)
                del self.born[ptr]
        return freed

    def tensor(self, ptr: int, shape: tuple[int, ...], dtype=np.float32) -> DeviceTensor:
        """A view of device memory, ordered on the compute stream."""
        return DeviceTensor(self.cuda, ptr, tuple(shape), np.dtype(dtype), self.compute)

    def flush(self) -> None:
        """Issue every queued cache append on the compute stream, before an engine may overwrite its sources:
        one upload of all their index tables, then one row-scatter launch per (destination, source, wave)."""
        if not self.pending:
            return
        launches = [launch for appends in self.pending for launch in appends.launches()]
        self.pending = []
        total = sum(len(wave) for _, _, wave in launches)
        parity = self._flushes % 2
        self._flushes += 1
        self.cuda.sync_event(self._index_uploaded[parity])
        host_ptr, table = self._index_stage.view(parity, (4 * total,), np.int64)
        at = 0  # each launch reads its own [4, n] block: source row, destination row, offset, count
        for _, _, wave in launches:
            block = table[at:at + 4 * len(wave)].reshape(4, len(wave))
            for k, entry in enumerate(wave):
                block[:, k] = entry[1:]
            at += 4 * len(wave)
        ptr = self._index_buffer(table.nbytes)
        self.cuda.copy(ptr, host_ptr, table.nbytes, self.compute)
        self.cuda.record(self._index_uploaded[parity], self.compute)
        at = 0
        for appends, source, wave in launches:
            appends.launch(source, wave, ptr + 8 * at)
            at += 4 * len(wave)

    def _index_buffer(self, nbytes: int) -> int:
        """The device buffer of the index tables, grown to hold `nbytes`."""
        ptr, size = self._index_device
        if nbytes > size:
            if ptr:
                self.free(ptr)
            size = max(nbytes, 256)
            ptr = self.alloc(size)
            self._index_device = (ptr, size)
        return ptr


def _release_all(cuda, sizes: dict, pinned: dict, handles: dict) -> None:
    """A collected Device frees what it still holds (not at interpreter exit: the driver reclaims it then)."""
    for stream in handles["stream"]:
        cuda.sync_stream(stream)
    for graph in handles["graph"]:
        cuda.destroy_graph(graph)
    for ptr in list(sizes):
        cuda.free(ptr)
    for ptr in list(pinned):
        cuda.host_free(ptr)
    for event in handles["event"]:
        cuda.destroy_event(event)
    for stream in handles["stream"]:
        cuda.destroy_stream(stream)
    sizes.clear()
    pinned.clear()


class Lease:
    """Memory one object holds while it lives (same calls as Device); pooled again when the object is collected."""

    def __init__(self, device: Device, owner):
        self.device = device
        self.device_ptrs: list[int] = []
        self.pinned: list[tuple[int, np.ndarray]] = []
        weakref.finalize(owner, device.release, self.device_ptrs, self.pinned).atexit = False

    def alloc(self, nbytes: int, zero: bool = False) -> int:
        self.device_ptrs.append(self.device.alloc(nbytes, zero))
        return self.device_ptrs[-1]

    def give_back(self, ptr: int) -> None:
        """A block the owner outgrew goes back to the pool at once (work on the compute stream is ordered)."""
        self.device_ptrs.remove(ptr)
        self.device.release([ptr])

    def host_alloc(self, nbytes: int) -> tuple[int, np.ndarray]:
        self.pinned.append(self.device.host_alloc(nbytes))
        return self.pinned[-1]

    def host_free(self, ptr: int) -> None:
        self.pinned[:] = [block for block in self.pinned if block[0] != ptr]
        self.device.host_free(ptr)


class Staging:
    """Pinned host memory for one tensor the host writes or reads, double-buffered by call parity."""

    def __init__(self, memory: Device | Lease):
        self.memory = memory
        self.slots: list[tuple[int, np.ndarray] | None] = [None, None]

    def view(self, parity: int, shape: tuple[int, ...], dtype) -> tuple[int, np.ndarray]:
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        slot = self.slots[parity]
        if slot is None or slot[1].nbytes < nbytes:
            if slot is not None:
                self.memory.host_free(slot[0])
            slot = self.slots[parity] = self.memory.host_alloc(nbytes)
        return slot[0], slot[1][:nbytes].view(dtype).reshape(shape)
