"""Planted acceptance collapses: a trained drafter's bundle made wrong the ways drafters are read wrong in the
field (what the collapse alarm, dspark.acceptance, must catch). Each keeps the bundle consistent with its
manifest (restamped), so nothing but the acceptance shows it."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from support.tiny import restamp

HEADS = ("heads.onnx", "heads_greedy.onnx")
LM_HEAD = "drafter.draft_lm_weight.T"  # the draft vocabulary's LM-head rows, as an fp32 bundle stores them


def _external(tensor) -> dict:
    return {e.key: e.value for e in tensor.external_data}


def set_initializers(bundle: Path, values: dict, graphs=HEADS) -> None:
    """Give the named initializers of `graphs` new values (same shape and dtype), whether stored in the graph or
    in an external data file (rewritten in place: a copy of a bundle must own its data files, not link them)."""
    bundle = Path(bundle)
    done = set()
    for graph in graphs:
        path = bundle / graph
        model = onnx.load(str(path), load_external_data=False)
        changed = False
        for init in model.graph.initializer:
            if init.name not in values:
                continue
            new = np.ascontiguousarray(values[init.name])
            assert list(new.shape) == list(init.dims), (init.name, new.shape, list(init.dims))
            assert new.dtype == onnx.helper.tensor_dtype_to_np_dtype(init.data_type), init.name
            ext = _external(init)
            if ext:
                data = bundle / ext["location"]
                if data.is_symlink() or data.stat().st_nlink > 1:  # own the bytes before writing them
                    raw = data.read_bytes()
                    data.unlink()
                    data.write_bytes(raw)
                with open(data, "r+b") as f:
                    f.seek(int(ext.get("offset", 0)))
                    f.write(new.tobytes())
            else:
                init.CopyFrom(numpy_helper.from_array(new, init.name))
                changed = True
            done.add(init.name)
        if changed:
            onnx.save(model, str(path))
    assert done == set(values), f"not found: {set(values) - done}"
    restamp(bundle)


def initializer(bundle: Path, name: str, graph: str = "heads.onnx") -> np.ndarray:
    model = onnx.load(str(Path(bundle) / graph), load_external_data=False)
    init = next(i for i in model.graph.initializer if i.name == name)
    ext = _external(init)
    dtype = onnx.helper.tensor_dtype_to_np_dtype(init.data_type)
    if not ext:
        return numpy_helper.to_array(init)
    with open(Path(bundle) / ext["location"], "rb") as f:
        f.seek(int(ext.get("offset", 0)))
        raw = f.read(int(ext["length"]))
    return np.frombuffer(raw, dtype=dtype).reshape(list(init.dims)).copy()


def _map_copies(bundle: Path, ids: np.ndarray) -> list[str]:
    """The initializers holding the draft vocabulary's ids (the exporter folds copies of the map into the graph)."""
    model = onnx.load(str(Path(bundle) / "heads.onnx"), load_external_data=False)
    return [i.name for i in model.graph.initializer if list(i.dims) == [len(ids)]
            and i.data_type == onnx.TensorProto.INT64 and np.array_equal(initializer(bundle, i.name), ids)]


def rank_ordered_map(bundle: Path, ranked: list[int]) -> None:
    """The same drafter with its draft vocabulary in frequency order, as EAGLE-3-style d2t maps hold it (dspark
    sorts it by id): the map, the LM head rows and the Markov rows permuted together, so decoding is unchanged."""
    ids = initializer(bundle, "drafter.draft_ids")
    rank = {t: i for i, t in enumerate(ranked)}
    order = np.argsort([rank.get(int(t), len(ranked) + int(t)) for t in ids], kind="stable")
    values = {name: ids[order] for name in _map_copies(bundle, ids)}
    values["drafter.draft_markov_w2"] = initializer(bundle, "drafter.draft_markov_w2")[order]
    values[LM_HEAD] = initializer(bundle, LM_HEAD)[:, order]  # stored transposed: [d, N]
    set_initializers(bundle, values)


def ignore_vocabulary_map(bundle: Path) -> None:
    """A reduced draft vocabulary's map dropped: the heads emit draft-vocabulary indices as if they were token ids."""
    ids = initializer(bundle, "drafter.draft_ids")
    set_initializers(bundle, {name: np.arange(len(ids), dtype=np.int64) for name in _map_copies(bundle, ids)})


def untrained_confidence_head(bundle: Path, seed: int = 0) -> None:
    """The confidence head as DeepSpec initialises it (normal 0.02 weights, zero bias), never trained."""
    rng = np.random.default_rng(seed)
    w = initializer(bundle, "drafter.confidence_head.proj.weight")
    set_initializers(bundle, {"drafter.confidence_head.proj.weight": (rng.standard_normal(w.shape) * 0.02)
                              .astype(np.float32),
                              "drafter.confidence_head.proj.bias": np.zeros(1, np.float32)})


def untrained_lm_head(bundle: Path, seed: int = 0) -> None:
    """The draft's LM head rows left at an initialisation (normal 0.02): a converter that did not find the
    shared matrix in the checkpoint and kept the module's own."""
    rng = np.random.default_rng(seed)
    w = initializer(bundle, LM_HEAD)
    set_initializers(bundle, {LM_HEAD: (rng.standard_normal(w.shape) * 0.02).astype(np.float32)})


class AnchorOffByOne:
    """Wraps a runtime's greedy heads so each block is the one a drafter anchored one position early would draft:
    its first draft is the anchor itself (what such a drafter predicts for the anchor's own position), then the
    true block shifted one position on. Greedy decoding only (the verifier takes no draft probabilities there)."""

    def __init__(self, rt):
        self.graph = rt.backend.heads_greedy
        assert self.graph is not None, "the bundle has no greedy heads"
        self.run = self.graph.run
        self.graph.run = self

    def __call__(self, feeds, *args, **kwargs):
        out = dict(self.run(feeds, *args, **kwargs))
        tokens = out["draft_tokens"].numpy() if hasattr(out["draft_tokens"], "numpy") else out["draft_tokens"]
        shifted = np.concatenate([np.asarray(feeds["anchor"]).reshape(-1, 1).astype(tokens.dtype), tokens[:, :-1]],
                                 axis=1)
        out["draft_tokens"] = _Host(shifted)
        return out


class _Host:
    """An array where the slot machine expects a graph output (it calls .numpy())."""

    def __init__(self, array: np.ndarray):
        self.array = array

    def numpy(self) -> np.ndarray:
        return self.array


class LateFeatures:
    """Wraps a runtime's draft graph so each position's target features arrive one position late (the features of
    a request's positions shifted by one, as a tap read off by one position would give them). Rows are taken as
    fixed slots, as in a decode whose requests all start together."""

    def __init__(self, rt):
        self.graph = rt.backend.draft
        self.run = self.graph.run
        self.last: dict[int, np.ndarray] = {}
        self.graph.run = self

    def __call__(self, feeds, *args, **kwargs):
        features = np.array(feeds["ctx_features"])
        late = features.copy()
        for row, count in enumerate(int(c) for c in np.asarray(feeds["ctx_count"])):
            if count == 0:
                continue
            late[row, 0] = self.last.get(row, np.zeros_like(features[row, 0]))
            late[row, 1:count] = features[row, :count - 1]
            self.last[row] = features[row, count - 1].copy()
        return self.run({**feeds, "ctx_features": late}, *args, **kwargs)
