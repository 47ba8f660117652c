"""The fused verifier's attention for a step of several requests: one batch-1 GroupQueryAttention per request.

ONNX Runtime's CPU GroupQueryAttention refuses several positions per request at batch > 1 once a past is given, and
computes a one-position step on another path than a longer one. So the fused graph runs every other kernel on all
the step's rows at once (MatMulNBits, MatMul and the normalizations give a row the same result whatever rows are
beside it) and its attention per request, in "lanes": lane 0 reads `past.{l}.*` (request 0's cache, [1, ...]) and
writes `present.{l}.*`; lane r > 0 reads `lane{r}.past.{l}.*` and writes `lane{r}.present.{l}.*`, inside nested Ifs
that run it only when the step has more than r requests (a lane past the batch is fed a dummy cache).

    q, k, v [B rows] --> Slice row 0 --> GroupQueryAttention(past.{l}.*)          --> Concat --> o projection
                     +-> If B > 1:    Slice row 1 --> GQA(lane1.past.{l}.*)        --/   (all B rows)
                                      +-> If B > 2: Slice row 2 --> GQA(lane2...)  --/
                                                    ...  (nested, up to `lanes` requests)

Each lane is exactly a batch-1 step of the fused graph: the same kernel call on the same rows, padded to two
positions in the same cases (ort_fused._PadToTwo), with RoPE tables whose rows are the same values. So a request's
tokens do not depend on the requests beside it, and a batch of several requests reads the weights once per step
instead of once per request (dspark.runtime.fused_verifier.FusedVerifier feeds the lanes).
"""
from __future__ import annotations

import numpy as np
import onnx_ir as ir

from dspark.bundle import GraphSpec, TensorSpec
from dspark.export.graphs import past_names
from dspark.export.twins.graph_copy import GraphBuilder
from dspark.runtime.fused_verifier import lane_name

MS = "com.microsoft"
FLOAT, INT32, INT64 = ir.DataType.FLOAT, ir.DataType.INT32, ir.DataType.INT64


class _LaneLengths:
    """seqlens_k, total_sequence_length and the padding of one lane, as a batch-1 step computes them."""

    def __init__(self, b: GraphBuilder, lane: int, past_len: ir.Value, positions: ir.Value, last: ir.Value,
                 ones: dict[str, ir.Value]):
        one, zero = ones["one"], ones["zero"]
        cache = b.add("Shape", [b.input(lane_name(lane, "past.0.key"))], start=2, end=3)[0]  # 0: a prefill
        ends = b.add("Add", [b.add("Slice", [past_len, ones[f"lane{lane}"], ones[f"lane{lane + 1}"]])[0], positions])[0]
        room = b.add("Or", [b.add("Less", [ends, cache])[0], b.add("Equal", [cache, zero])[0]])[0]
        self.pad = b.add("Cast", [room], to=INT64)[0]  # the lane's single request always pads if it can
        total = b.add("Add", [ends, self.pad])[0]
        self.seqlens = b.add("Cast", [b.add("Sub", [total, one])[0]], to=INT32)[0]
        self.total = b.add("Cast", [b.add("Squeeze", [total])[0]], to=INT32)[0]
        self.last_end = b.add("Add", [last, self.pad])[0]


class Lanes:
    """Builds the per-request attention of the fused graph (see the module's docstring)."""

    def __init__(self, b: GraphBuilder, count: int, positions: ir.Value, heads: dict):
        """positions: [1] the step's positions per request; heads: GroupQueryAttention's attributes. The caches
        of lanes 1.. are inputs of the builder already (lane_specs)."""
        self.b, self.count, self.positions, self.heads = b, count, positions, heads
        self.ones = {"one": b.const(np.array([1], np.int64), "one"), "zero": b.const(np.array([0], np.int64), "zero")}
        for r in range(count + 1):
            self.ones[f"lane{r}"] = b.const(np.array([r], np.int64), f"lane{r}")
        self.last = b.add("Sub", [positions, self.ones["one"]])[0]

    def lengths_and_rope(self, inv_freq: ir.Value) -> tuple[ir.Value, ir.Value]:
        """Each lane's lengths, and RoPE tables covering every lane's positions (the rows of a table are the same
        values whatever its length). Returns (cos, sin)."""
        b, ones = self.b, self.ones
        past_len = b.add("ReduceSum", [b.input("past_mask"), ones["one"]], keepdims=0)[0]  # [batch]
        batch = b.add("Shape", [b.input("tokens")], start=0, end=1)[0]
        longest = b.add("ReduceMax", [b.add("Concat", [past_len, ones["zero"]], axis=0)[0]], keepdims=1)[0]
        lanes_len = b.add("Concat", [past_len, b.const(np.zeros(self.count, np.int64), "idle_lanes")], axis=0)[0]
        self.lengths, self.active = [], []
        for r in range(self.count):
            with b.scope(f"lane{r}"):
                self.lengths.append(_LaneLengths(b, r, lanes_len, self.positions, self.last, ones))
        for r in range(self.count):
            with b.scope(f"lane{r}"):
                self.active.append(b.add("Squeeze", [b.add("Less", [ones[f"lane{r}"], batch])[0]])[0])
        end = b.add("Squeeze", [b.add("Add", [b.add("Add", [longest, self.positions])[0], ones["one"]])[0]])[0]
        self.rope = rope_tables(b, end, inv_freq)
        return self.rope

    def attention(self, layer: int, q: ir.Value, k: ir.Value | None, v: ir.Value | None) -> ir.Value:
        """The attention output [batch, positions, heads * head_dim] of layer `layer` for q/k/v [batch, positions,
        *] (k and v None when q packs all three)."""
        lane0 = self._lane(0, layer, q, k, v, (f"present.{layer}.key", f"present.{layer}.value"))
        if self.count == 1:
            return lane0
        names = [self.b.name("lanes_attn"), *self._presents(1, layer)]
        return self.b.add("Concat", [lane0, self._nested(1, layer, (q, k, v), lane0, names)], axis=0)[0]

    def _presents(self, first: int, layer: int) -> list[str]:
        return [lane_name(r, f"present.{layer}.{kind}") for r in range(first, self.count) for kind in ("key", "value")]

    def _lane(self, r: int, layer: int, q: ir.Value, k: ir.Value | None, v: ir.Value | None,
              presents: tuple[str, str] | list[str]) -> ir.Value:
        with self.b.scope(f"lane{r}"):
            return self._lane_attention(r, layer, q, k, v, presents)

    def _lane_attention(self, r: int, layer: int, q: ir.Value, k: ir.Value | None, v: ir.Value | None,
                        presents: tuple[str, str] | list[str]) -> ir.Value:
        b, ones, lengths = self.b, self.ones, self.lengths[r]
        rows = [b.add("Slice", [t, ones[f"lane{r}"], ones[f"lane{r + 1}"], ones["zero"]])[0] if t else None
                for t in (q, k, v)]
        padded = [b.add("Concat", [t, b.add("Slice", [t, self.last, lengths.last_end, ones["one"]])[0]], axis=1)[0]
                  if t else None for t in rows]
        inputs = [*padded, b.input(lane_name(r, f"past.{layer}.key")), b.input(lane_name(r, f"past.{layer}.value")),
                  lengths.seqlens, lengths.total, *self.rope]
        out = b.add("GroupQueryAttention", inputs, 3, MS, names=[b.name("attn"), *presents], **self.heads)[0]
        return b.add("Slice", [out, ones["zero"], self.positions, ones["one"]])[0]

    def _nested(self, r: int, layer: int, qkv: tuple, lane0: ir.Value, names: list[str]) -> ir.Value:
        """Lanes r.. inside one If, run when the step has more than r requests: lane r's attention, then lanes
        r+1.. in an If of their own (a step of few requests pays one If per layer, not one per lane). Else one
        empty tensor for every output. names: the If's outputs (the attention of lanes r.., then their
        presents)."""
        b = self.b
        inner = [f"{p}/lanes{r}" for p in self._presents(r, layer)]
        outer, b.nodes = b.nodes, []
        out = self._lane(r, layer, *qkv, inner[:2])
        if r + 1 < self.count:
            rest = self._nested(r + 1, layer, qkv, lane0, [b.name("lanes_attn"), *inner[2:]])
            with b.scope(f"lanes{r}"):
                out = b.add("Concat", [out, rest], axis=0)[0]
        then_nodes, b.nodes = b.nodes, []
        with b.scope(f"lanes{r}"):
            empty = b.add("Slice", [lane0, self.ones["zero"], self.ones["zero"], self.ones["zero"]])[0]
            idle = b.add("Identity", [empty])[0]  # every idle lane's presents (never read)
        else_nodes, b.nodes = b.nodes, outer
        then_graph = ir.Graph([], _floats(out, *[b.named[n] for n in inner]), nodes=then_nodes,
                              name=f"lanes{r}_layer{layer}_then")
        else_graph = ir.Graph([], _floats(empty, *[idle] * len(inner)), nodes=else_nodes,
                              name=f"lanes{r}_layer{layer}_else")
        with b.scope(f"lanes{r}"):
            b.add("If", [self.active[r]], names=names, then_branch=then_graph, else_branch=else_graph)
        return b.named[names[0]]


def rope_tables(b: GraphBuilder, end: ir.Value, inv_freq: ir.Value) -> tuple[ir.Value, ir.Value]:
    """RoPE's cos and sin tables [end, head_dim / 2] for positions 0..end-1 (end: an int64 scalar)."""
    with b.scope("rope"):
        return _rope_tables(b, end, inv_freq)


def _rope_tables(b: GraphBuilder, end: ir.Value, inv_freq: ir.Value) -> tuple[ir.Value, ir.Value]:
    steps = b.add("Range", [b.const(np.array(0, np.int64), "zero"), end, b.const(np.array(1, np.int64), "step")])[0]
    pos_f = b.add("Unsqueeze", [b.add("Cast", [steps], to=FLOAT)[0], b.const(np.array([1], np.int64), "one")])[0]
    freqs = b.add("Mul", [pos_f, inv_freq])[0]
    return b.add("Cos", [freqs])[0], b.add("Sin", [freqs])[0]


def lane_specs(count: int, layers: int, kv_heads: int, hd: int) -> list[list[tuple[str, list]]]:
    """(name, shape) of the caches lanes 1.. read, and of those they write."""
    def specs(kind: str) -> list[tuple[str, list]]:
        return [(lane_name(r, f"{kind}.{i}.{part}"), [1, kv_heads, f"lane{r}_{kind}", hd])
                for r in range(1, count) for i in range(layers) for part in ("key", "value")]
    return [specs("past"), specs("present")]


def _floats(*values: ir.Value) -> list[ir.Value]:
    """The values as a subgraph's outputs: float tensors of any shape."""
    for value in values:
        value.type = ir.TensorType(FLOAT)
    return list(values)


def fused_spec(portable: GraphSpec, file: str, layers: int, kv_heads: int, hd: int, lanes: int = 1) -> GraphSpec:
    """The manifest entry: the portable verifier's inputs and lanes 1..'s caches; its outputs but the caches'
    present.* (and the lanes') for new_kv."""
    outputs = [t for t in portable.outputs if t.name != "new_kv"]
    outputs += [TensorSpec(name.replace("past", "present", 1), "float32", ["batch", kv_heads, "present", hd])
                for name in past_names("past", layers)]
    as_specs = [[TensorSpec(name, "float32", shape) for name, shape in specs]
                for specs in lane_specs(lanes, layers, kv_heads, hd)]
    return GraphSpec(file=file, inputs=list(portable.inputs) + as_specs[0], outputs=outputs + as_specs[1])
