"""The verifier of a bundle with a fused twin (dspark.export.ort_fused) on ONNX Runtime: which graph takes which
step, and the new K/V of a step that wrote them into the cache itself."""
from __future__ import annotations

from typing import Callable, Protocol

import numpy as np

from dspark.runtime.kv import IN_CACHE


class Graph(Protocol):
    outputs: list[str]

    def run(self, feeds: dict, into: dict[str, np.ndarray] | None = None) -> dict: ...


class FusedVerifier:
    """The verifier as the fused graph (dspark.export.ort_fused) where ONNX Runtime's GroupQueryAttention takes
    the step, else the portable graph; callers see the portable verifier's outputs.

    - prefill (no valid past in any row): the fused graph on an empty past; its present.* are the new K/V.
    - one request, or one position per request: the fused graph writes the new K/V straight into the cache
      (present.* bound to the memory of past.*), and new_kv is IN_CACHE.
    - several positions of several requests: the portable graph (GroupQueryAttention refuses that on CPU).

    With `alone` (a verifier whose activations are quantized), a step of several requests runs as one fused step
    per request instead: the fused graph computes a batch-1 step's rows as in a step of two or more positions
    (ort_fused._PadToTwo), which makes a request's tokens the same whatever the step, but it can do that only at
    batch 1; and a rounding apart between two kernels becomes different int8 codes. Slower at batch > 1 (each
    request's step reads the weights again), exact.
    """

    def __init__(self, fused: Graph, portable: Callable[[], Graph], alone: bool = False):
        """portable: what loads the portable graph when a step first needs it (a batch-1 session never does, and
        each ONNX Runtime session holds its own copy of the weights it prepacks)."""
        self.fused, self._load_portable, self._portable, self.alone = fused, portable, None, alone
        self.layers = sum(1 for name in fused.outputs if name.startswith("present.")) // 2
        self.caches = [(f"past.{i}.{kind}", f"present.{i}.{kind}") for i in range(self.layers)
                       for kind in ("key", "value")]
        self.steps = {"prefill": 0, "fused": 0, "portable": 0}

    @property
    def portable(self) -> Graph:
        if self._portable is None:
            self._portable = self._load_portable()
        return self._portable

    def run(self, feeds: dict) -> dict:
        batch, positions = feeds["tokens"].shape
        if self.alone and batch > 1:
            return self._each_request(feeds, batch)
        if not np.any(feeds["past_mask"]):
            self.steps["prefill"] += 1
            return self._prefill(feeds, feeds[self.caches[0][0]], batch)
        if (batch == 1 or positions == 1) and all(_writable(feeds[past]) for past, _ in self.caches):
            self.steps["fused"] += 1
            out = self.fused.run(feeds, {present: feeds[past] for past, present in self.caches})
            return {"accepted": out["accepted"], "next_token": out["next_token"], "taps": out["taps"],
                    "new_kv": IN_CACHE}
        self.steps["portable"] += 1
        return self.portable.run(feeds)

    def run_gathered(self, feeds: dict) -> dict:
        """run(), with the new K/V also returned as an array where they went into the cache (for comparisons)."""
        out = self.run(feeds)
        if out["new_kv"] is IN_CACHE:
            positions = feeds["tokens"].shape[1]
            lengths = np.asarray(feeds["past_mask"]).sum(axis=1)
            new = [np.stack([feeds[past][b, :, n:n + positions] for b, n in enumerate(lengths)])
                   for past, _ in self.caches]
            out["new_kv"] = _HostArray(np.array(new).reshape(self.layers, 2, *new[0].shape))
        return out

    def _each_request(self, feeds: dict, batch: int) -> dict:
        outs = [self.run({name: value[b:b + 1] for name, value in feeds.items()}) for b in range(batch)]
        merged = {name: _HostArray(np.concatenate([o[name].numpy() for o in outs]))
                  for name in ("accepted", "next_token", "taps")}
        if all(o["new_kv"] is IN_CACHE for o in outs):
            return {**merged, "new_kv": IN_CACHE}
        new_kv = np.concatenate([o["new_kv"].numpy() for o in outs], axis=2)  # [L, 2, B, Hkv, positions, hd]
        return {**merged, "new_kv": _HostArray(new_kv)}

    def _prefill(self, feeds: dict, past: np.ndarray, batch: int) -> dict:
        empty = np.zeros((batch, past.shape[1], 0, past.shape[3]), dtype=np.float32)
        feeds = {**feeds, "past_mask": np.zeros((batch, 0), dtype=np.int64), **{p: empty for p, _ in self.caches}}
        out = self.fused.run(feeds)
        positions = feeds["tokens"].shape[1]  # present.* also hold the padding row of a batch-1 prefill (ort_fused)
        new = np.stack([out[present].numpy()[:, :, :positions] for _, present in self.caches])
        new_kv = new.reshape(self.layers, 2, *new.shape[1:])
        return {"accepted": out["accepted"], "next_token": out["next_token"], "taps": out["taps"],
                "new_kv": _HostArray(new_kv)}


class _HostArray:
    """A host array as a graph output (an OrtValue made from numpy would not keep the array alive)."""

    def __init__(self, array: np.ndarray):
        self.array = array

    def numpy(self) -> np.ndarray:
        return self.array


def _writable(a) -> bool:
    return isinstance(a, np.ndarray) and a.flags.c_contiguous and a.flags.writeable
