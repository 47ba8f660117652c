"""The GPU backend of dspark.runtime: TensorRT engines driven through cuda-python, with device-resident state.

Same interface as the ONNX Runtime backend (three graphs with `run(feeds) -> outputs`, consumed by
dspark.runtime.decoder.Decoder), but only small tensors cross the bus:

- The target and draft KV caches, the draft's pending target features, the draft hidden states and the draft
  probabilities stay on the device. New K/V entries and features are appended after each request's valid prefix
  by one row-scatter kernel launch per cache per step (scatter_rows.cu); rollback is a length change.
- Device buffers are allocated once per tensor (grown only when a larger shape arrives, i.e. during prefill) and
  bound with set_tensor_address only when an address changes, so in steady state nothing is re-bound.
- Inputs the host writes (token ids, lengths, noise, ...) are staged in pinned, double-buffered host memory and
  uploaded on a copy stream; the engines run on a compute stream that waits for the upload's event; outputs the
  host reads (accepted counts, next tokens, draft tokens, verification lengths, survival) come back to pinned
  memory on the copy stream after the compute event. Other outputs are returned as DeviceTensor handles that the
  next graph binds by address (`.numpy()` downloads one on demand).
- Optionally (`cuda_graphs=True`) each engine launch is captured into a CUDA graph per (profile, shapes,
  addresses) the second time that key is seen and replayed afterwards.

The caches are bound at the engines' fixed capacity (the build's --max-context), so every step has static cache
shapes. The draft's feature input keeps a fixed width (block size + 1 rows, grown when the draft gate lets rows pile
up) with per-slot counts, so its shape is static too.
"""
from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dspark.bundle import Manifest
from dspark.errors import DSparkError
from dspark.runtime.backend import CacheLengths
from dspark.trt.buffers import HOST_VISIBLE

# outputs the decode loop reads every step: downloaded to pinned memory after each run
HOST_OUTPUTS = {graph: outs for graph, (_, outs) in HOST_VISIBLE.items()}
MAX_GRAPHS = 64  # captured CUDA graphs kept per engine


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
        self.pending: list = []  # device states with cache appends not yet issued (flushed before any engine runs)
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
        self._index_dev: tuple[int, int] = (0, 0)
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
        at = 0
        for _, _, wave in launches:  # each launch reads its own [4, n] block: source row, destination row, offset, count
            block = table[at:at + 4 * len(wave)].reshape(4, len(wave))
            for k, entry in enumerate(wave):
                block[:, k] = entry[1:]
            at += 4 * len(wave)
        ptr, size = self._index_dev
        if table.nbytes > size:
            if ptr:
                self.free(ptr)
            size = max(table.nbytes, 256)
            ptr = self.alloc(size)
            self._index_dev = (ptr, size)
        self.cuda.copy(ptr, host_ptr, table.nbytes, self.compute)
        self.cuda.record(self._index_uploaded[parity], self.compute)
        at = 0
        for appends, src, wave in launches:
            appends.launch(src, wave, ptr + 8 * at)
            at += 4 * len(wave)


def _release_all(cuda, sizes: dict, pinned: dict, handles: dict) -> None:
    """A collected Device frees what it still holds (not at interpreter exit: the driver reclaims it then)."""
    for stream in handles["stream"]:
        cuda.sync_stream(stream)
    for exe in handles["graph"]:
        cuda.destroy_graph(exe)
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
        self.pinned[:] = [b for b in self.pinned if b[0] != ptr]
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


class StreamGraph:
    """One engine: bound-once device buffers, pinned double-buffered host I/O, optional CUDA-graph replay."""

    def __init__(self, device: Device, engine, name: str, verify_positions: int | None = None,
                 cuda_graphs: bool = False):
        self.device, self.cuda, self.name = device, device.cuda, name
        self.engine = engine
        self.context = engine.context()
        io = engine.io()
        self.inputs = [n for n, is_input, _ in io if is_input]
        self.outputs = [n for n, is_input, _ in io if not is_input]
        self.dtypes = {n: np.dtype(dt) for n, _, dt in io}
        self.host_outputs = HOST_OUTPUTS.get(name, set())
        self.verify_positions = verify_positions
        self.cuda_graphs = cuda_graphs
        self.buffers: dict[str, tuple[int, int]] = {}  # tensor -> (device pointer, bytes)
        self.staging: dict[str, Staging] = {}
        self.bound: dict[str, int] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.profile = -1
        self.calls = 0
        self.uploaded, self.computed, self.downloaded = (device.event() for _ in range(3))
        self.graphs: dict[tuple, int | None] = {}  # capture key -> instantiated graph (None: seen once)

    def _buffer(self, name: str, nbytes: int) -> int:
        ptr, size = self.buffers.get(name, (0, 0))
        if nbytes > size:  # grows during prefill; steady-state decode shapes fit after the first rounds
            if ptr:
                self.device.free(ptr)
            ptr = self.device.alloc(nbytes)
            self.buffers[name] = (ptr, nbytes)
        return ptr

    def _bind(self, name: str, ptr: int) -> None:
        if self.bound.get(name) != ptr:
            if not self.context.set_tensor_address(name, ptr):
                raise DSparkError(f"{self.name} engine: cannot bind {name}")
            self.bound[name] = ptr

    def _shape(self, name: str, shape: tuple[int, ...]) -> None:
        if self.shapes.get(name) != shape:
            if not self.context.set_input_shape(name, shape):
                raise DSparkError(f"{self.name} engine: input {name} shape {shape} is outside its optimization "
                                  f"profile (rebuild with a larger --max-batch / --max-context)")
            self.shapes[name] = shape

    def _pick_profile(self, feeds: dict) -> None:
        profile = 0
        if self.engine.num_profiles > 1 and "tokens" in feeds:
            profile = 1 if np.shape(feeds["tokens"])[1] <= (self.verify_positions or 0) else 0
        if profile != self.profile:
            self.context.set_optimization_profile_async(profile, self.device.compute)
            self.profile, self.shapes, self.bound = profile, {}, {}

    def run(self, feeds: dict) -> dict:
        cuda, dev = self.cuda, self.device
        dev.flush()
        self._pick_profile(feeds)
        parity = self.calls % 2
        self.calls += 1
        cuda.wait(dev.copy, self.computed)  # the previous call of this engine has read its input buffers
        for name in self.inputs:
            value = feeds[name]
            if isinstance(value, DeviceTensor):
                if np.dtype(value.dtype) != self.dtypes[name]:
                    raise DSparkError(f"{self.name}.{name}: device tensor of {value.dtype}, engine wants "
                                      f"{self.dtypes[name]}")
                self._shape(name, tuple(value.shape))
                self._bind(name, value.ptr)
                continue
            arr = np.asarray(value.numpy() if hasattr(value, "numpy") and not isinstance(value, np.ndarray)
                             else value)
            host_ptr, stage = self.staging.setdefault(name, Staging(dev)).view(parity, arr.shape, self.dtypes[name])
            stage[...] = arr
            ptr = self._buffer(name, stage.nbytes)
            cuda.copy(ptr, host_ptr, stage.nbytes, dev.copy)
            self._shape(name, arr.shape)
            self._bind(name, ptr)
        cuda.record(self.uploaded, dev.copy)
        cuda.wait(dev.compute, self.uploaded)
        shapes = {}
        for name in self.outputs:
            shapes[name] = tuple(int(d) for d in self.context.get_tensor_shape(name))
            self._bind(name, self._buffer(name, int(np.prod(shapes[name])) * self.dtypes[name].itemsize))
        self._execute()
        cuda.record(self.computed, dev.compute)
        cuda.wait(dev.copy, self.computed)
        results, pulls = {}, []
        for name in self.outputs:
            if name in self.host_outputs:
                host_ptr, stage = self.staging.setdefault(name, Staging(dev)).view(parity, shapes[name],
                                                                                   self.dtypes[name])
                cuda.copy(host_ptr, self.bound[name], stage.nbytes, dev.copy)
                pulls.append((name, stage))
            else:
                results[name] = dev.tensor(self.bound[name], shapes[name], self.dtypes[name])
        if pulls:
            cuda.record(self.downloaded, dev.copy)
            cuda.sync_event(self.downloaded)
            for name, stage in pulls:
                results[name] = HostArray(stage.copy())
        return results

    def _execute(self) -> None:
        launch = self._launch
        if self.cuda_graphs:
            key = (self.profile, tuple(sorted(self.shapes.items())), tuple(sorted(self.bound.items())))
            if key in self.graphs:
                if self.graphs[key] is None:  # second sighting: capture (the first ran eagerly, as TRT requires)
                    self.graphs[key] = self.cuda.capture(self.device.compute, launch)
                    self.device.handles["graph"].append(self.graphs[key])
                self.cuda.replay(self.graphs[key], self.device.compute)
                return
            if len(self.graphs) >= MAX_GRAPHS:  # addresses keep changing (new shapes): start the cache over
                self._drop_graphs()
            self.graphs[key] = None
        launch()

    def _drop_graphs(self) -> None:
        self.cuda.sync_stream(self.device.compute)
        for exe in self.graphs.values():
            if exe is not None:
                self.cuda.destroy_graph(exe)
                self.device.handles["graph"].remove(exe)
        self.graphs.clear()

    def _launch(self) -> None:
        if not self.context.execute_async_v3(self.device.compute):
            raise DSparkError(f"TensorRT execution of the {self.name} engine failed")


def disjoint_waves(entries: list) -> list[list]:
    """Split (src, src_row, dst_row, at, count) appends into launches whose destination rows do not overlap.

    One launch writes its rows in no defined order, so two entries that write the same destination row must go in
    successive launches, in queue order (the later one wins, as in dspark.ops.scatter_rows.reference). Usually one wave."""
    waves: list[list] = []
    placed: list[tuple[int, int, int, int]] = []  # (dst_row, first, end, wave)
    for entry in entries:
        _, _, d, at, count = entry
        lo, hi = max(at, 0), at + count
        wave = 0
        if hi > lo:  # an empty entry writes nothing and conflicts with nothing
            wave = 1 + max((w for pd, plo, phi, w in placed if pd == d and plo < hi and lo < phi), default=-1)
            placed.append((d, lo, hi, wave))
        if wave == len(waves):
            waves.append([])
        waves[wave].append(entry)
    return waves


class _Appends:
    """Queued row-scatter launches into one destination, issued by Device.flush before the next engine runs."""

    def __init__(self, memory: Lease, dst: int, planes: int, batch: int, heads: int, rows: int, width: int):
        self.device, self.dst = memory.device, dst
        self.planes, self.batch, self.heads, self.rows, self.width = planes, batch, heads, rows, width
        self.queue: list[tuple[DeviceTensor, int, int, int, int]] = []

    def add(self, src: DeviceTensor, src_row: int, dst_row: int, at: int, count: int) -> None:
        if not self.queue:
            self.device.pending.append(self)
        self.queue.append((src, src_row, dst_row, at, count))

    def launches(self) -> list[tuple["_Appends", DeviceTensor, list]]:
        """Empties the queue: (self, source, entries) per source tensor and wave of disjoint destinations."""
        groups: dict[int, list] = {}
        for entry in self.queue:
            groups.setdefault(entry[0].ptr, []).append(entry)
        self.queue = []
        return [(self, entries[0][0], wave) for entries in groups.values() for wave in disjoint_waves(entries)]

    def launch(self, src: DeviceTensor, wave: list, index: int) -> None:
        # K/V [L, 2, B, Hkv, T, hd] or features [B, T, F]: (batch rows, rows per batch row)
        src_batch, src_rows = (src.shape[2], src.shape[4]) if len(src.shape) == 6 else src.shape[:2]
        self.device.cuda.scatter_rows(src.ptr, self.dst, self.planes, src_batch, self.heads, src_rows, self.batch,
                                      self.rows, self.width, index, len(wave), max(e[4] for e in wave),
                                      self.device.compute)


class DeviceKV(CacheLengths):
    """Device twin of dspark.runtime.kv.HostKV: [L, 2, B, Hkv, capacity, hd] on the device, lengths and the mask
    on the host (the mask is uploaded when a commit changed it)."""

    holder = "the engines hold"
    hint = " (or rebuild with a larger --max-context)"

    def __init__(self, device: Device, layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int,
                 what: str = "KV", prefix: str = "past"):
        super().__init__(layers, batch, capacity, what, prefix)
        self.device, memory = device, device.lease(self)
        self.shape = (layers, 2, batch, kv_heads, capacity, head_dim)
        self.ptr = memory.alloc(int(np.prod(self.shape)) * 4, zero=True)
        plane = batch * kv_heads * capacity * head_dim * 4
        self._feeds = {name: device.tensor(self.ptr + (2 * i + j) * plane, (batch, kv_heads, capacity, head_dim))
                       for name, i, j in self.names}
        self._mask_dev = device.tensor(memory.alloc(self._mask.nbytes, zero=True), (batch, capacity), np.int64)
        self._mask_stage = Staging(memory)
        self._mask_dirty = False
        self._uploads = 0
        self._empty = 0  # device pointer of the zero cache + mask prefills bind
        self.memory = memory
        self.appends = _Appends(memory, self.ptr, 2 * layers, batch, kv_heads, capacity, head_dim)

    @property
    def feeds(self) -> dict[str, DeviceTensor]:
        return self._feeds

    def past_mask(self) -> DeviceTensor:
        if self._mask_dirty:
            host_ptr, stage = self._mask_stage.view(self._uploads % 2, self._mask.shape, np.int64)
            self._uploads += 1
            stage[...] = self._mask
            self.device.cuda.copy(self._mask_dev.ptr, host_ptr, stage.nbytes, self.device.compute)
            self._mask_dirty = False
        return self._mask_dev

    def prefill_feeds(self, n: int) -> tuple[dict[str, DeviceTensor], DeviceTensor]:
        """An all-zero cache at the engines' fixed capacity, shared by every layer input, and a zero mask."""
        _, _, batch, heads, cap, hd = self.shape
        if not self._empty:
            self._empty = self.memory.alloc(batch * heads * cap * hd * 4 + batch * cap * 8, zero=True)
        kv = self.device.tensor(self._empty, (n, heads, cap, hd))
        mask = self.device.tensor(self._empty + batch * heads * cap * hd * 4, (n, cap), np.int64)
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
        self.appends = _Appends(self.memory, self.ptr, 1, batch, 1, width, features)

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
        grown = _Appends(self.memory, new_ptr, 1, self.batch, 1, width, self.features)
        for slot in range(self.batch):
            if self.count[slot]:
                grown.add(old, slot, slot, 0, int(self.count[slot]))
        self.device.flush()
        self.memory.give_back(self.ptr)
        self.ptr, self.width = new_ptr, width
        self.appends = _Appends(self.memory, self.ptr, 1, self.batch, 1, width, self.features)

    def feed(self) -> DeviceTensor:
        return self.device.tensor(self.ptr, (self.batch, self.width, self.features))


class TrtEngine:
    """A deserialized TensorRT engine behind the small interface StreamGraph uses."""

    def __init__(self, path: Path, runtime):
        import tensorrt as trt

        self.trt = trt
        self.engine = runtime.deserialize_cuda_engine(Path(path).read_bytes())
        if self.engine is None:
            raise DSparkError(f"cannot load {path} with TensorRT {trt.__version__} (built by another version?)")
        self.num_profiles = self.engine.num_optimization_profiles

    def io(self) -> list[tuple[str, bool, np.dtype]]:
        trt, e = self.trt, self.engine
        names = [e.get_tensor_name(i) for i in range(e.num_io_tensors)]
        return [(n, e.get_tensor_mode(n) == trt.TensorIOMode.INPUT, np.dtype(trt.nptype(e.get_tensor_dtype(n))))
                for n in names]

    def context(self):
        return self.engine.create_execution_context()


def load_trt_engines(folder: Path, manifest: Manifest) -> dict[str, TrtEngine]:
    from dspark.trt.build import import_tensorrt

    trt = import_tensorrt()
    section = manifest.tensorrt
    trt.get_plugin_registry().load_library(str(Path(folder) / section["plugin"]["library"]))
    runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
    return {name: TrtEngine(Path(folder) / spec["file"], runtime) for name, spec in section["engines"].items()}


class StreamingBackend:
    """TensorRT engines of a bundle with device-resident decode state; plugs into Decoder like OrtBackend.

    `engines` and `cuda` default to the bundle's TensorRT engines and the cuda-python runtime; anything with the
    same small interface can stand in (the tests drive this class through an in-process emulation of both).
    """

    kind = "tensorrt"
    device_resident = True

    def __init__(self, folder: Path, manifest: Manifest, engines: dict | None = None, cuda=None,
                 cuda_graphs: bool = False):
        section = manifest.tensorrt
        if not section:
            raise DSparkError(f"{folder} has no engines: run dspark-export build {folder}")
        engines = engines or load_trt_engines(Path(folder), manifest)  # first: says so when TensorRT is missing
        if cuda is None:
            from dspark.trt.cuda import CudaRuntime

            cuda = CudaRuntime(_kernel_library(Path(folder), section))
        self.folder, self.manifest, self.engines, self.cuda_graphs = Path(folder), manifest, engines, cuda_graphs
        self.device = Device(cuda)
        self.fixed_capacity = int(section["max_context"])
        self.max_batch = int(section["max_batch"])
        self.block_size = manifest.block_size
        self.verifier = StreamGraph(self.device, engines["verifier"], "verifier", manifest.block_size + 1, cuda_graphs)
        self.draft = StreamGraph(self.device, engines["draft"], "draft", cuda_graphs=cuda_graphs)
        self.heads = StreamGraph(self.device, engines["heads"], "heads", cuda_graphs=cuda_graphs)
        self._siblings: list[StreamingBackend] = []

    def lanes(self, n: int) -> list["StreamingBackend"]:
        """This backend and n - 1 siblings on the same engines and CUDA context, each with its own streams,
        execution contexts and buffers: one per micro-batch of dspark.runtime.pingpong, so one lane's copies and
        host work overlap another's engines. Siblings are kept for the next call (and its captured graphs)."""
        while len(self._siblings) < n - 1:
            self._siblings.append(StreamingBackend(self.folder, self.manifest, engines=self.engines,
                                                   cuda=self.device.cuda, cuda_graphs=self.cuda_graphs))
        return [self, *self._siblings[:n - 1]]

    def kv_cache(self, layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int, what: str = "KV",
                 prefix: str = "past") -> DeviceKV:
        return DeviceKV(self.device, layers, batch, kv_heads, capacity, head_dim, what, prefix)

    def context_rows(self, batch: int, features: int) -> DeviceRows:
        return DeviceRows(self.device, batch, features, self.block_size + 1)

    def zeros(self, shape: tuple[int, ...], dtype=np.float32) -> DeviceTensor:
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        zeros = self.device.tensor(0, shape, dtype)
        zeros.ptr = self.device.lease(zeros).alloc(nbytes, zero=True)
        return zeros


def _kernel_library(folder: Path, section: dict) -> Path:
    """The runtime kernels ship with the engines (dspark-export build); else they are built once with nvcc."""
    from dspark.ops.kernels import LIBRARY, archs_for, build_kernel
    from dspark.resolve import cache_dir

    shipped = folder / "engines" / LIBRARY
    if shipped.exists():
        return shipped
    archs = archs_for(section.get("device", {}))
    return build_kernel(cache_dir() / "kernels" / "-".join(archs), archs=archs)
