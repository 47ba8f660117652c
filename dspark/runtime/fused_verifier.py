"""The verifier of a bundle with a fused twin (dspark.export.twins.ort_fused) on ONNX Runtime: which graph takes which
step, and the new K/V of a step that wrote them into the cache itself."""
from __future__ import annotations

from typing import Callable, Protocol

import numpy as np

from dspark.runtime.backend import ON_DEMAND, STEP_OUTPUTS
from dspark.runtime.kv import IN_CACHE


ATTENTION_KEY = "dspark.attention"  # a fused graph's metadata: "rows" (dspark.export.twins.row_attention)


class Graph(Protocol):
    outputs: list[str]
    inputs: list[str]
    metadata: dict[str, str]

    def run(self, feeds: dict, into: dict[str, np.ndarray] | None = None, fetch: list[str] | None = None,
            binding=None) -> dict: ...

    def binding(self, feeds: dict): ...


def lane_name(lane: int, name: str) -> str:
    """A fused graph's cache input or output for the request in `lane` (dspark.export.twins.fused_lanes): lane 0 uses
    the portable verifier's names."""
    return name if lane == 0 else f"lane{lane}.{name}"


def lane_count(inputs: list[str]) -> int:
    """Requests a fused graph with these inputs takes in one step (1: a graph built before lanes)."""
    return 1 + sum(1 for name in inputs if name.startswith("lane") and name.endswith(".past.0.key"))


class FusedVerifier:
    """The verifier as the fused graph (dspark.export.twins.ort_fused) where ONNX Runtime's GroupQueryAttention takes
    the step, else the portable graph; callers see the portable verifier's outputs.

    - prefill (no valid past in any row): the fused graph on an empty past; its present.* are the new K/V.
    - one request, or one position per request: the fused graph writes the new K/V straight into the cache
      (present.* bound to the memory of past.*), and new_kv is IN_CACHE.
    - several positions of several requests: the portable graph (GroupQueryAttention refuses that on CPU).

    A graph with row attention (dspark.export.twins.row_attention) takes every step of any batch itself, writing
    the new K/V in place, each request's rows computed as in its batch-1 steps. A fused graph with lanes
    (dspark.export.twins.fused_lanes) takes every step of up to `lanes` requests itself, each
    request's cache bound in place to its lane (more requests run in groups); the rules above and below are for a
    graph built before lanes.

    With `alone` (a verifier whose activations are quantized), a step of several requests runs as one fused step
    per request instead: the fused graph computes a batch-1 step's rows as in a step of two or more positions
    (ort_fused._PadToTwo), which makes a request's tokens the same whatever the step, but it can do that only at
    batch 1; and a rounding apart between two kernels becomes different int8 codes. Slower at batch > 1 (each
    request's step reads the weights again), exact.
    """

    def __init__(self, fused: Graph, portable: Callable[[], Graph], alone: bool = False):
        """portable: what loads the portable graph when a step first needs it (a batch-1 session never does, and
        each ONNX Runtime session holds its own copy of the weights it prepacks)."""
        self.fused, self._load_portable, self._portable = fused, portable, None
        self.layers = sum(1 for name in fused.outputs if name.startswith("present.")) // 2
        self.caches = [(f"past.{i}.{kind}", f"present.{i}.{kind}") for i in range(self.layers)
                       for kind in ("key", "value")]
        self.steps = {"prefill": 0, "fused": 0, "portable": 0}
        self.lanes = lane_count(fused.inputs)
        self.rows = fused.metadata.get(ATTENTION_KEY) == "rows"
        self.alone = alone and not self.rows
        self._idle: dict[tuple[int, ...], tuple] = {}  # (dummy cache, binding), see _idle_lanes

    @property
    def portable(self) -> Graph:
        if self._portable is None:
            self._portable = self._load_portable()
        return self._portable

    def run(self, feeds: dict, fetch: list[str] | None = None) -> dict:
        """Every step gives accepted, next_token, taps and new_kv; `fetch` may add outputs given only on demand (the
        logits)."""
        batch, positions = feeds["tokens"].shape
        wanted = (*STEP_OUTPUTS, *(name for name in fetch or () if name in ON_DEMAND))
        if self.rows:
            return self._rows_step(feeds, batch, wanted)
        if self.lanes > 1:
            if batch > self.lanes:
                return self._in_groups(feeds, batch, self.lanes, wanted)
            return self._lanes_step(feeds, batch, wanted)
        if self.alone and batch > 1:
            return self._in_groups(feeds, batch, 1, wanted)
        if not np.any(feeds["past_mask"]):
            self.steps["prefill"] += 1
            return self._prefill(feeds, feeds[self.caches[0][0]], batch, wanted)
        if (batch == 1 or positions == 1) and all(_writable(feeds[past]) for past, _ in self.caches):
            self.steps["fused"] += 1
            out = self.fused.run(feeds, {present: feeds[past] for past, present in self.caches}, list(wanted))
            return {**{name: out[name] for name in wanted}, "new_kv": IN_CACHE}
        self.steps["portable"] += 1
        return self.portable.run(feeds, fetch=[*wanted, "new_kv"])

    def run_gathered(self, feeds: dict) -> dict:
        """run(), with the new K/V also returned as an array where they went into the cache, and every output the
        fused graph has (for comparisons)."""
        out = self.run(feeds, [o for o in self.fused.outputs if o in ON_DEMAND])
        if out["new_kv"] is IN_CACHE:
            out["new_kv"] = self._written(feeds, feeds)
        return out

    def _written(self, feeds: dict, caches: dict) -> "_HostArray":
        """The K/V a step of `feeds` wrote into `caches` (past name -> array) after each request's valid prefix."""
        positions = feeds["tokens"].shape[1]
        lengths = np.asarray(feeds["past_mask"]).sum(axis=1)
        new = [np.stack([caches[past][b, :, n:n + positions] for b, n in enumerate(lengths)])
               for past, _ in self.caches]
        return _HostArray(np.array(new).reshape(self.layers, 2, *new[0].shape))

    def _lanes_step(self, feeds: dict, batch: int, wanted: tuple[str, ...]) -> dict:
        """A step of up to `lanes` requests: request b's cache is bound to lane b, in place when it can be."""
        prefill = not np.any(feeds["past_mask"])
        if prefill:
            feeds = {**feeds, "past_mask": np.zeros((batch, 0), dtype=np.int64)}
        caches = {past: feeds[past] for past, _ in self.caches}
        in_place = prefill or all(_writable(a) for a in caches.values())
        if not in_place:  # (a comparison's arrays) a copy takes the new K/V, returned as arrays
            caches = {past: np.array(a, dtype=np.float32, order="C") for past, a in caches.items()}
        shape = caches[self.caches[0][0]].shape
        empty = np.zeros((1, shape[1], 0, shape[3]), dtype=np.float32)  # a prefill's past
        lane_feeds, into, fetch = dict(feeds), {}, list(wanted)
        for past, present in self.caches:
            for lane in range(batch):
                if prefill:
                    lane_feeds[lane_name(lane, past)] = empty
                    fetch.append(lane_name(lane, present))
                else:
                    lane_feeds[lane_name(lane, past)] = into[lane_name(lane, present)] = caches[past][lane:lane + 1]
        out = self.fused.run(lane_feeds, into, fetch, self._idle_lanes(batch, shape))
        self.steps["prefill" if prefill else "fused"] += 1
        result = {name: out[name] for name in wanted}
        if not prefill:
            return {**result, "new_kv": IN_CACHE if in_place else self._written(feeds, caches)}
        positions = feeds["tokens"].shape[1]  # present.* hold the lane's padding row last
        new = [np.concatenate([out[lane_name(lane, present)].numpy()[:, :, :positions] for lane in range(batch)])
               for _, present in self.caches]
        return {**result, "new_kv": _HostArray(np.array(new).reshape(self.layers, 2, *new[0].shape))}

    def _rows_step(self, feeds: dict, batch: int, wanted: tuple[str, ...]) -> dict:
        """A step of a row-attention graph: in place, but a prefill."""
        if not np.any(feeds["past_mask"]):  # its K/V scattered into an empty cache as wide as the prompts
            self.steps["prefill"] += 1
            return self._prefill(feeds, feeds[self.caches[0][0]], batch, wanted, feeds["tokens"].shape[1])
        self.steps["fused"] += 1
        caches = {past: feeds[past] for past, _ in self.caches}
        in_place = all(_writable(a) for a in caches.values())
        if not in_place:  # (a comparison's arrays) a copy takes the new K/V, returned as arrays
            caches = {past: np.array(a, dtype=np.float32, order="C") for past, a in caches.items()}
        out = self.fused.run({**feeds, **caches}, {present: caches[past] for past, present in self.caches},
                             list(wanted))
        new_kv = IN_CACHE if in_place else self._written(feeds, caches)
        return {**{name: out[name] for name in wanted}, "new_kv": new_kv}

    def _idle_lanes(self, batch: int, shape: tuple[int, ...]):
        """A binding of the fused graph with the lanes past `batch` bound to one dummy cache (their attention does
        not run), made once per batch size: the step binds the rest."""
        key = (batch, shape[1], shape[3])
        if key not in self._idle:
            dummy = np.zeros((1, shape[1], 1, shape[3]), dtype=np.float32)
            self._idle[key] = (dummy, self.fused.binding({lane_name(lane, past): dummy for past, _ in self.caches
                                                          for lane in range(batch, self.lanes)}))
        return self._idle[key][1]

    def _in_groups(self, feeds: dict, batch: int, size: int, wanted: tuple[str, ...]) -> dict:
        outs = [self.run({name: value[b:b + size] for name, value in feeds.items()}, list(wanted))
                for b in range(0, batch, size)]
        merged = {name: _HostArray(np.concatenate([o[name].numpy() for o in outs])) for name in wanted}
        if all(o["new_kv"] is IN_CACHE for o in outs):
            return {**merged, "new_kv": IN_CACHE}
        new_kv = np.concatenate([o["new_kv"].numpy() for o in outs], axis=2)  # [L, 2, B, Hkv, positions, hd]
        return {**merged, "new_kv": _HostArray(new_kv)}

    def _prefill(self, feeds: dict, past: np.ndarray, batch: int, wanted: tuple[str, ...], width: int = 0) -> dict:
        """A step on an empty past `width` columns wide; present.* hold the new K/V."""
        empty = np.zeros((batch, past.shape[1], width, past.shape[3]), dtype=np.float32)
        feeds = {**feeds, "past_mask": np.zeros((batch, 0), dtype=np.int64), **{p: empty for p, _ in self.caches}}
        out = self.fused.run(feeds, fetch=[*wanted, *(present for _, present in self.caches)])
        positions = feeds["tokens"].shape[1]  # present.* also hold the padding row of a batch-1 prefill (ort_fused)
        new = np.stack([out[present].numpy()[:, :, :positions] for _, present in self.caches])
        new_kv = new.reshape(self.layers, 2, *new.shape[1:])
        return {**{name: out[name] for name in wanted}, "new_kv": _HostArray(new_kv)}


class _HostArray:
    """A host array as a graph output (an OrtValue made from numpy would not keep the array alive)."""

    def __init__(self, array: np.ndarray):
        self.array = array

    def numpy(self) -> np.ndarray:
        return self.array


def _writable(a) -> bool:
    return isinstance(a, np.ndarray) and a.flags.c_contiguous and a.flags.writeable
