"""The backend interface of the decode loop: where a bundle's three graphs run and where decode state lives.

dspark.runtime.decoder.Decoder talks to a backend only through `Backend`; the ONNX Runtime backend
(dspark.runtime.ort_backend.OrtBackend, host numpy state) and the TensorRT backend (dspark.trt.backend.TrtBackend,
device-resident state) implement it. Backends are found by name: the ones shipped with dspark are declared as
`dspark.backends` entry points, and `register_backend` adds more at run time, so this package never imports a
backend's package (dspark.trt imports dspark.runtime, never the other way round).

The state twins (HostKV / DeviceKV for caches, HostRows / DeviceRows for target features the draft has not
consumed yet) share `CacheLengths`, the host-side bookkeeping of valid lengths and the mask the graphs read.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from importlib import import_module
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping, Protocol

import numpy as np

from dspark.errors import DSparkError

if TYPE_CHECKING:
    from dspark.bundle import Manifest
    from dspark.kv_layout import KVGroup

ENTRY_POINT_GROUP = "dspark.backends"
SAMPLING_INPUTS = ("temperature", "draft_noise")  # heads inputs only sampling reads (the greedy heads lack them)
SAMPLING_OUTPUTS = ("draft_probs",)  # heads outputs only sampling needs
STEP_OUTPUTS = ("accepted", "next_token", "taps")  # what every verifier step gives (then its new K/V)
# outputs given only when fetched, [B, rows, V] floats: the verifier's logits (the sampler's input), the sampler's
# processed distributions and their log-probabilities (logprobs)
ON_DEMAND = ("logits", "probs", "logprobs")


def available_memory() -> int | None:
    """Bytes of memory new allocations can take without swapping (Linux MemAvailable); None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class Tensor(Protocol):
    """A graph output: an onnxruntime.OrtValue, or a device tensor of a GPU backend. `.numpy()` gives host data."""

    def numpy(self) -> np.ndarray: ...


def host(x) -> np.ndarray:
    """A graph output (Tensor) or a host array, as a host array."""
    return x if isinstance(x, np.ndarray) else x.numpy()


class Graph(Protocol):
    """One of the bundle's graphs (verifier, draft, heads), loaded by a backend."""

    def run(self, feeds: Mapping[str, Any]) -> dict[str, Tensor]: ...


class CacheLengths:
    """The host-side bookkeeping of a KV cache, wherever its entries live: the valid length of each request, the
    [B, capacity] 0/1 mask of valid prefixes the graphs read, and the per-layer input names."""

    holder = "the session holds"  # who fixed the capacity, for the overflow message
    hint = ""

    def __init__(self, layers: int, batch: int, capacity: int, what: str, prefix: str):
        self.lengths = np.zeros(batch, dtype=np.int64)
        self._mask = np.zeros((batch, capacity), dtype=np.int64)
        self.capacity = capacity
        self.what = what
        self.names = [(f"{prefix}.{i}.{kind}", i, j) for i in range(layers) for j, kind in enumerate(("key", "value"))]

    def reserve(self) -> None:
        """Make the cache's memory the process's now, not on first use (a no-op where it already is)."""

    def room(self, b: int) -> int:
        """Positions slot b can still take."""
        return self.capacity - int(self.lengths[b])

    def check_room(self, b: int, count: int, request: int | None = None) -> None:
        if self.lengths[b] + count > self.capacity:
            who = f"request {b if request is None else request}"
            raise DSparkError(f"context overflow: {who} needs {int(self.lengths[b]) + count} {self.what} "
                              f"positions, {self.holder} {self.capacity}; shorten the prompt or max_tokens"
                              f"{self.hint}")

    def fit(self, positions: int) -> None:
        """Size the cache for a step of `positions` new entries per slot (a no-op where it is laid out at capacity)."""

    def commit(self, b: int, length: int) -> None:
        """Set request b's valid length: growing commits written entries, shrinking rolls back."""
        old = int(self.lengths[b])
        if length > old:
            self._mask[b, old:length] = 1
        else:
            self._mask[b, length:old] = 0
        self.lengths[b] = length


class KVState(Protocol):
    """A [L, 2, B, Hkv, capacity, hd] cache (or one per KV group) with CacheLengths' bookkeeping (HostKV,
    DeviceKV)."""

    lengths: np.ndarray
    capacity: int

    @property
    def feeds(self) -> Mapping[str, Any]: ...
    def prefill_feeds(self, n: int) -> tuple[dict[str, Any], Any]: ...
    def past_mask(self) -> Any: ...
    def write(self, new: Any, row: int, count: int, slot: int | None = None) -> None: ...
    def commit(self, b: int, length: int) -> None: ...
    def fit(self, positions: int) -> None: ...
    def check_room(self, b: int, count: int, request: int | None = None) -> None: ...


class RowsState(Protocol):
    """Target features the draft has not consumed yet, per slot, with a count per slot (HostRows, DeviceRows)."""

    count: np.ndarray

    def put(self, slot: int, taps: Any, row: int, count: int, append: bool = False) -> None: ...
    def feed(self) -> Any: ...


class Backend(ABC):
    """Runs a bundle's graphs and owns the memory of the decode state.

    `options` names the keyword options the constructor takes besides (folder, manifest); `create_backend`
    refuses any other option with one line instead of a TypeError.
    """

    kind: ClassVar[str]
    options: ClassVar[tuple[str, ...]] = ()
    device_resident: ClassVar[bool] = False  # graph outputs stay on a device (else they are host arrays)
    fixed_capacity: int | None = None  # engines built for one cache size; None: caches of any size
    max_batch: int | None = None
    verifier: Graph
    draft: Graph
    heads: Graph
    # the heads of rounds whose every live request is greedy, without the SAMPLING_INPUTS and SAMPLING_OUTPUTS (the
    # verifier then takes zero draft probabilities: dspark.export.twins.greedy_heads); None: `heads` takes every round
    heads_greedy: Graph | None = None
    # rounds in which a request sets sampling parameters (top_k, top_p, min_p, penalties, logit_bias): acceptance
    # again on the verifier's logits (`verifier.run(feeds, fetch=[..., "logits"])`), dspark.export.graphs.SamplerGraph;
    # None: this backend or bundle has none, and such requests are refused
    sampler: Graph | None = None
    logits: bool = False  # whether every verifier step can give its logits (logprobs are computed from them)

    @abstractmethod
    def kv_cache(self, layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int, what: str = "KV",
                 prefix: str = "past") -> KVState: ...

    def grouped_kv_cache(self, groups: "list[KVGroup]", batch: int, capacity: int, what: str = "KV",
                         prefix: str = "past") -> KVState:
        """A cache of layers grouped by KV geometry (dspark.kv_layout); one group is a kv_cache. A backend whose
        caches are one buffer refuses several."""
        if len(groups) == 1:
            g = groups[0]
            return self.kv_cache(len(g.layers), batch, g.num_kv_heads, capacity, g.head_dim, what, prefix)
        raise DSparkError(f"the {self.kind} backend keeps a {what} cache in one buffer, and this bundle's layers "
                          f"differ in KV geometry ({len(groups)} KV groups); run it on onnxruntime")

    @abstractmethod
    def context_rows(self, batch: int, features: int) -> RowsState: ...

    @abstractmethod
    def zeros(self, shape: tuple[int, ...], dtype=np.float32) -> Any:
        """A zero tensor graphs can take as an input (the 'no drafts' probabilities)."""

    def prepare(self, max_batch: int) -> None:
        """Load now what steps of up to `max_batch` requests would load on first use (a server warms up before it
        says it is ready, so no request pays for a load); the default has nothing to load."""

    def lanes(self, n: int) -> list["Backend"]:
        """n backends on the same loaded graphs, each with its own state, for micro-batches in ping-pong."""
        if n == 1:
            return [self]
        raise DSparkError(f"the {self.kind} backend has no lanes for ping-pong micro-batches")

    def close(self) -> None:
        """Release what the backend holds (graphs, memory); the default leaves it to the garbage collector."""


BackendFactory = Callable[..., Backend]
_registry: dict[str, BackendFactory] = {}
_BUILTIN = {"onnxruntime": "dspark.runtime.ort_backend:OrtBackend"}  # found even when dspark is not installed


def register_backend(name: str, factory: BackendFactory) -> None:
    """Make `factory(folder, manifest, **options)` available as Runtime(..., backend=name)."""
    _registry[name] = factory


def backend_names() -> list[str]:
    return sorted(set(_registry) | set(_BUILTIN) | {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})


def _factory(name: str) -> BackendFactory:
    if name not in _registry:
        found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
        if found:
            _registry[name] = found[0].load()
        elif name in _BUILTIN:
            module, _, attr = _BUILTIN[name].partition(":")
            _registry[name] = getattr(import_module(module), attr)
        else:
            raise DSparkError(f"unknown backend {name!r} (available: {', '.join(backend_names())})")
    return _registry[name]


def create_backend(name: str, folder: Path, manifest: "Manifest", **options) -> Backend:
    factory = _factory(name)
    known = getattr(factory, "options", ())
    unknown = sorted(k for k, v in options.items() if k not in known and v not in (None, False))
    if unknown:
        raise DSparkError(f"the {name} backend takes no {', '.join(unknown)} option"
                          f"{' (it takes ' + ', '.join(known) + ')' if known else ''}")
    return factory(folder, manifest, **{k: v for k, v in options.items() if k in known})
