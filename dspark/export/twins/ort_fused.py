"""The verifier with ONNX Runtime's fused CPU operators, for ONNX Runtime only (TensorRT keeps the portable graph).

Per decoder layer: SkipSimplifiedLayerNormalization (residual add + RMSNorm in one kernel), the q/k/v projections,
GroupQueryAttention (RoPE inside, the new K/V written straight into the caller's cache: `present.{l}.*` share the
memory of `past.{l}.*`), the output projection, SkipSimplifiedLayerNormalization, gate/up, SiLU, down. The portable
verifier's layer is ~90 nodes of reshapes, slices and elementwise RoPE; this one is ~12.

    tokens -> Gather(embed) --+--> [layer 0] --> ... --> [layer L-1] --> final norm --> LM head, acceptance
                              |                                                          (copied unchanged)
    one layer:  x, residual --> SkipSimplifiedLayerNorm --> q | k | v projections (MatMul / MatMulNBits)
                                    --> GroupQueryAttention (RoPE inside; past.{l}.* -> present.{l}.*, in place)
                                    --> o projection --> SkipSimplifiedLayerNorm --> gate | up --> SiLU * up --> down

The graph is built from the portable verifier's skeleton (no weight is read): every projection is copied as it
stands there (a MatMul by an fp32 weight, or MatMulNBits with the Q4_1 minimum term), found by the module name its
weight or node carries, so the fused graph uses the same weights, at the same offsets of the same data files. The
embedding lookup and everything after the final norm (LM head, in-graph acceptance) are copied unchanged, the
acceptance behind an If whose other branch decides a step of greedy requests by argmax (greedy_accept).

ONNX Runtime's CPU GroupQueryAttention takes several positions per request only at batch 1 (or with an empty
past), so the graph runs each request's attention on its own, in lanes (dspark.export.twins.fused_lanes): every other
kernel takes all the step's rows at once. A graph built with one lane (as before lanes existed) runs batch-1 steps,
one-position steps and prefills, and the runtime takes the portable verifier for the rest
(dspark.runtime.fused_verifier.FusedVerifier). A verifier with int8 activations gets this graph with its attention
written as MatMul / Softmax over the cache instead (dspark.export.twins.row_attention), which takes every step.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir

from dspark.errors import DSparkError
from dspark.export.quantize.nbits_graph import resolve
from dspark.export.twins.catalog import unfusable
from dspark.export.twins.fused_lanes import FLOAT, INT32, INT64, Lanes, lane_specs, rope_tables
from dspark.export.twins.fused_linears import ROLES, Linear, Projections, find_linears
from dspark.export.twins.graph_copy import GraphBuilder, GraphIndex, described
from dspark.export.twins.greedy_accept import greedy_or_copied

MS = "com.microsoft"
TAIL_OUTPUTS = ("accepted", "next_token", "logits")  # computed after the final norm (an older bundle: no logits)
LANES = 8  # requests a fused step takes at once (more run in groups of LANES)


def _norm_parts(g: GraphIndex, value: ir.Value) -> tuple[ir.Value, ir.Value] | None:
    """(gamma, div) when `value` = gamma * (x / Sqrt(ReduceMean(x^2) + eps)), an RMSNorm as exported; else None.
    Norms are found by this shape, not by name: the exporter stores equal weights once (a random model's norm
    weights are all ones), under the first name that had them."""
    node = value.producer()
    if node is None or node.op_type != "Mul":
        return None
    for gamma, other in ((node.inputs[0], node.inputs[1]), (node.inputs[1], node.inputs[0])):
        div = other.producer()
        while div is not None and div.op_type == "Cast":
            div = div.inputs[0].producer()
        if div is not None and div.op_type == "Div" and g.root(gamma).is_initializer():
            return gamma, div.outputs[0]
    return None


def _eps(g: GraphIndex, div: ir.Value) -> float:
    """epsilon of an RMSNorm: x / Sqrt(ReduceMean(x^2) + eps)."""
    sqrt = div.producer().inputs[1].producer()
    add = sqrt.inputs[0].producer()
    for i in add.inputs:
        c = g.constant(i)
        if c is not None:
            return float(c.reshape(-1)[0])
    raise DSparkError("fused verifier: cannot read the RMSNorm epsilon from the portable graph")


def _dims(g: GraphIndex, value: ir.Value) -> list[int]:
    """The shape of the initializer behind `value`."""
    return list(g.root(value).const_value.shape.numpy())


def _final_norm(g: GraphIndex, linears: dict[tuple[int, str], Linear], hidden: int) -> tuple[ir.Value, ...]:
    """(output, gamma, div) of the final norm: the one RMSNorm over the hidden size no projection reads."""
    inputs = {lin.x for lin in linears.values()}
    found = []
    for node in g.graph:
        parts = _norm_parts(g, node.outputs[0]) if node.op_type == "Mul" else None
        if parts and node.outputs[0] not in inputs and _dims(g, parts[0]) == [hidden]:
            found.append((node.outputs[0], *parts))
    if len(found) != 1:
        raise DSparkError(f"fused verifier: expected one final norm in the portable graph, found {len(found)}")
    return found[0]


def _head_norm_gamma(g: GraphIndex, start: ir.Value, head_dim: int) -> ir.Value:
    """Qwen3: the weight of the per-head RMSNorm applied to a q or k projection's output."""
    frontier, seen = [start], set()
    for _ in range(8):
        nxt = []
        for value in frontier:
            for node in g.consumers(value):
                parts = _norm_parts(g, node.outputs[0]) if node.op_type == "Mul" else None
                if parts and _dims(g, parts[0]) == [head_dim]:
                    return parts[0]
                if node not in seen:
                    seen.add(node)
                    nxt += [o for o in node.outputs if o.name]
        frontier = nxt
    raise DSparkError("fused verifier: cannot find a Qwen3 q/k norm in the portable graph")


def _inv_freq(g: GraphIndex) -> ir.Value:
    """RoPE's inverse frequencies: positions * inv_freq -> Concat(freqs, freqs) -> Cos."""
    cos = next((n for n in g.graph if n.op_type == "Cos"), None)
    cat = cos.inputs[0].producer() if cos is not None else None
    mul = cat.inputs[0].producer() if cat is not None else None
    for i in (mul.inputs if mul is not None and mul.op_type == "Mul" else ()):
        if g.root(i).is_initializer():
            return i
    raise DSparkError("fused verifier: cannot find RoPE's frequencies in the portable graph")


def _widened(g: GraphIndex, value: ir.Value) -> ir.Value:
    """The value as float32: the Cast a bf16/fp16 bundle applies right after (an embedding lookup's rows)."""
    for node in g.consumers(value):
        if node.op_type == "Cast" and node.attributes.get_int("to") == FLOAT:
            return node.outputs[0]
    return value


def _weight(b: GraphBuilder, value: ir.Value) -> ir.Value:
    """A constant of the portable graph (its pass-through chain copied), as float32."""
    new = b.copy(value, {}, "weights")
    root, chain = resolve(value)
    if root.const_value.dtype == FLOAT and not any(n.op_type == "Cast" for n in chain):
        return new
    return b.add("Cast", [new], to=FLOAT)[0]


def _layer_norm_gamma(g: GraphIndex, lin: Linear) -> ir.Value:
    parts = _norm_parts(g, lin.x)
    if parts is None:
        raise DSparkError("fused verifier: a layer's projections do not read an RMSNorm in the portable graph")
    return parts[0]


def fuse_verifier(model: ir.Model, target: dict, tap_ids: list[int], folder: Path | None = None,
                  lanes: int = LANES) -> ir.Model:
    """The fused twin of a portable verifier (a skeleton whose external data lives in `folder`): it refers to the
    portable graph's weights where it multiplies by them as they are, and holds new initializers only for
    concatenated MatMulNBits projections. lanes: requests whose attention a step runs one by one (1: the graph
    before lanes, batch-1 and one-position steps only)."""
    return _FusedVerifier(model, target, folder, lanes).build(tap_ids)


class _FusedVerifier:
    padded = True  # a batch-1 step's attention runs on two rows at least (_PadToTwo)

    def __init__(self, model: ir.Model, target: dict, folder: Path | None, lanes: int):
        self.model, self.g = model, GraphIndex(model)
        self.layers, self.kv_heads, self.hd = target["num_layers"], target["num_kv_heads"], target["head_dim"]
        if unfusable(target):
            raise DSparkError(unfusable(target))
        self.linears = find_linears(self.g)
        missing = [f"layer {i} {r}" for i in range(self.layers) for r in ROLES if (i, r) not in self.linears]
        if missing:
            raise DSparkError(f"the verifier's projections are not named by module ({missing[0]} not found; a graph "
                              f"quantized by dspark < 0.2 names them by node): re-export and quantize the bundle")
        self.norm_out, self.norm_gamma, norm_div = _final_norm(self.g, self.linears, target["hidden_size"])
        self.eps = _eps(self.g, norm_div)
        self.qk_norm = target.get("family") == "qwen3"
        # the portable verifier's outputs but its new K/V, in its order
        self.heads = [v.name for v in model.graph.outputs if v.name in (*TAIL_OUTPUTS, "taps")]
        self.tail = [name for name in self.heads if name != "taps"]
        self.b = GraphBuilder(self.g)
        self.lane_past, self.lane_present = lane_specs(lanes, self.layers, self.kv_heads, self.hd)
        for name, shape in self.lane_past:
            self.b.input(name, shape)
        with self.b.scope("pad"):
            self.rows = _PadToTwo(self.b) if self.padded else None
        self.proj = Projections(self.b, self.linears, folder)
        self.gqa = {"num_heads": self.linears[(0, "q_proj")].out_features // self.hd, "kv_num_heads": self.kv_heads,
                    "do_rotary": 1, "rotary_interleaved": 0, "scale": float(self.hd) ** -0.5}
        with self.b.scope("lanes"):
            self.lanes = Lanes(self.b, lanes, self.rows.positions, self.gqa) if lanes > 1 else None

    def build(self, tap_ids: list[int]) -> ir.Model:
        b, g = self.b, self.g
        embed = next((n for n in g.graph if n.op_type == "Gather" and n.inputs[1].name == "tokens"), None)
        if embed is None:
            raise DSparkError("fused verifier: the portable graph has no embedding lookup")
        x = b.copy(_widened(g, embed.outputs[0]), {}, "embed")
        with b.scope("positions"):
            self.attention_inputs = self._lengths_and_rope()
        taps = {-1: x} if -1 in tap_ids else {}
        residual, update = x, None
        for i in range(self.layers):
            layer_input, residual, update = self._layer(i, residual, update)
            if i - 1 in tap_ids:  # layer i - 1's output is what layer i's fused norm adds up
                taps[i - 1] = layer_input
        with b.scope("norm"):
            hidden = b.add("SkipSimplifiedLayerNormalization", [update, residual, _weight(b, self.norm_gamma)], 4,
                           MS, epsilon=self.eps)[0]
        tails = self._tail({self.norm_out: hidden})
        for o in self.tail:
            with b.scope("outputs"):
                b.add("Identity", [tails[o]], names=[o])
        tap_values = [taps[t] for t in tap_ids]
        with b.scope("outputs"):
            b.add("Concat" if len(tap_values) > 1 else "Identity", tap_values, names=["taps"],
                  **({"axis": -1} if len(tap_values) > 1 else {}))
        return self._model()

    def _tail(self, after_norm: dict) -> dict[str, ir.Value]:
        """The tail outputs, copied after the final norm (one copy of the LM head for all), the acceptance behind
        an If that takes a greedy step's argmax rule (dspark.export.twins.greedy_accept)."""
        b, values = self.b, self.g.values
        if set(self.tail) != set(TAIL_OUTPUTS):  # (an older bundle: no logits)
            return {o: b.copy(values[o], after_norm, "tail") for o in self.tail}
        logits = b.copy(values["logits"], after_norm, "tail")
        with b.scope("acceptance"):
            accepted, next_token = greedy_or_copied(b, logits, lambda: tuple(
                b.copy(values[o], after_norm, "tail") for o in ("accepted", "next_token")),
                (values["accepted"], values["next_token"]))
        return {"logits": logits, "accepted": accepted, "next_token": next_token}

    def _model(self) -> ir.Model:
        """The new graph: the portable verifier's inputs and lanes 1..'s caches; accepted, next_token, taps as the
        portable verifier has them, then every cache's present.*."""
        b, old = self.b, self.model
        outputs = [described(b.named[name], self.g.values[name]) for name in self.heads]
        presents = [(f"present.{i}.{kind}", ["batch", self.kv_heads, "present", self.hd])
                    for i in range(self.layers) for kind in ("key", "value")]
        for name, shape in presents + self.lane_present:
            value = b.named[name]
            value.type, value.shape = ir.TensorType(FLOAT), ir.Shape(shape)
            outputs.append(value)
        graph = ir.Graph(list(b.inputs.values()), outputs, nodes=b.nodes, initializers=list(b.inits.values()),
                         name="verifier_fused", opset_imports={**old.opset_imports, MS: 1})
        return ir.Model(graph, ir_version=old.ir_version)

    def _lengths_and_rope(self) -> tuple[ir.Value, ...]:
        """seqlens_k (each request's last position), total_sequence_length and the RoPE tables up to it, all
        counting the padding row (_PadToTwo)."""
        b, rows = self.b, self.rows
        inv_freq = _weight(b, _inv_freq(self.g))
        if self.lanes is not None:
            return self.lanes.lengths_and_rope(inv_freq)
        s_len = rows.positions
        one = b.const(np.array([1], np.int64), "one")
        past_len = b.add("ReduceSum", [b.input("past_mask"), one], keepdims=0)[0]
        longest_past = b.add("ReduceMax", [past_len], keepdims=1)[0]
        rows.decide(b.add("Add", [longest_past, s_len])[0])
        width = b.add("Add", [s_len, rows.pad])[0]  # the rows attention runs on
        last = b.add("Sub", [b.add("Add", [past_len, width])[0], one])[0]
        seqlens = b.add("Cast", [last], to=INT32)[0]
        total = b.add("Squeeze", [b.add("Add", [longest_past, width])[0]])[0]
        return seqlens, b.add("Cast", [total], to=INT32)[0], *rope_tables(b, total, inv_freq)

    def _layer(self, i: int, residual: ir.Value, update: ir.Value | None) -> tuple[ir.Value, ir.Value, ir.Value]:
        """Decoder layer i on the residual stream (plus the previous layer's update, added by the fused norm);
        returns (its input: the previous layer's output, the stream after its attention, its MLP's update)."""
        b, proj, eps = self.b, self.proj, self.eps
        with b.scope(f"layers.{i}"):
            with b.scope("input_norm"):
                gamma = _weight(b, _layer_norm_gamma(self.g, self.linears[(i, "q_proj")]))
                if update is None:
                    h = b.add("SimplifiedLayerNormalization", [residual, gamma], axis=-1, epsilon=eps)[0]
                else:
                    h, _, _, residual = b.add("SkipSimplifiedLayerNormalization", [update, residual, gamma], 4,
                                              MS, epsilon=eps)
            layer_input = residual
            qkv = None if self.qk_norm else proj.packed(i, ("q_proj", "k_proj", "v_proj"), h)
            if qkv is not None:  # GroupQueryAttention takes q, k and v packed in one tensor
                q, k, v = qkv, None, None
            else:
                q, k, v = proj(i, ("q_proj", "k_proj", "v_proj"), h)
                if self.qk_norm:
                    q, k = self._head_norm(q, i, "q_proj"), self._head_norm(k, i, "k_proj")
            with b.scope("attn"):
                attn = self._attention(i, q, k, v)
            o, = proj(i, ("o_proj",), attn)
            with b.scope("post_attention_norm"):
                gamma = _weight(b, _layer_norm_gamma(self.g, self.linears[(i, "gate_proj")]))
                h2, _, _, residual = b.add("SkipSimplifiedLayerNormalization", [o, residual, gamma], 4, MS,
                                           epsilon=eps)
            gate, up = proj(i, ("gate_proj", "up_proj"), h2)
            with b.scope("mlp"):
                act = b.add("Mul", [b.add("Mul", [gate, b.add("Sigmoid", [gate])[0]])[0], up])[0]
            return layer_input, residual, proj(i, ("down_proj",), act)[0]

    def _attention(self, i: int, q: ir.Value, k: ir.Value | None, v: ir.Value | None) -> ir.Value:
        """Layer i's attention of q/k/v [batch, positions, *] (k and v None when q packs the three)."""
        if self.lanes is not None:
            return self.lanes.attention(i, q, k, v)
        b = self.b
        q, k, v = (self.rows.padded(t) if t else None for t in (q, k, v))
        past = [b.input(f"past.{i}.key"), b.input(f"past.{i}.value")]
        attn = b.add("GroupQueryAttention", [q, k, v, *past, *self.attention_inputs], 3, MS,
                     names=[b.name("attn"), f"present.{i}.key", f"present.{i}.value"], **self.gqa)[0]
        return self.rows.cut(attn)

    def _head_norm(self, v: ir.Value, i: int, role: str) -> ir.Value:
        """Qwen3's per-head RMSNorm of q and k."""
        b, hd = self.b, self.hd
        with b.scope(role.replace("_proj", "_norm")):
            gamma = _weight(b, _head_norm_gamma(self.g, self.linears[(i, role)].y, hd))
            shaped = b.add("Reshape", [v, b.const(np.array([0, 0, -1, hd], np.int64), "heads")])[0]
            normed = b.add("SimplifiedLayerNormalization", [shaped, gamma], axis=-1, epsilon=self.eps)[0]
            return b.add("Reshape", [normed, b.const(np.array([0, 0, -1], np.int64), "flat")])[0]


class _PadToTwo:
    """A one-position step of one request computed like a row of a longer step.

    ONNX Runtime's CPU GroupQueryAttention computes a step of one position on another path than a step of several,
    and its output differs by a rounding (~1e-7) from that position's row in a longer step; from two positions on,
    a row is bit-identical whatever the step's length. With fp32 activations that stays a rounding; a verifier whose
    MatMulNBits quantize activations to int8 (accuracy_level 4) rounds it into a different int8 code, and the
    difference grows until greedy DSpark (steps of several positions) and autoregressive decoding (steps of one)
    part ways. So at batch 1 the attention runs on its q/k/v with the last row repeated and its output keeps the
    step's rows: every position is computed as in a step of at least two. The other kernels (MatMulNBits, MatMul,
    the normalizations) give a row the same result for any number of rows; they are not padded.

    The extra row's key and value go into the cache one position past the step (never valid: the next step writes
    there; a prefill's present.* hold it last, and the runtime keeps the prompt's), so the pad is left out where
    that position is past the cache (and, as ONNX Runtime's kernel refuses several positions of several requests,
    at batch > 1: see dspark.runtime.fused_verifier, which runs such bundles' steps request by request).
    """

    def __init__(self, b: GraphBuilder):
        self.b = b
        self.positions = b.add("Shape", [b.input("tokens")], start=1, end=2)[0]
        self.zero, self.one = b.const(np.array([0], np.int64), "zero"), b.const(np.array([1], np.int64), "one")
        self.pad: ir.Value | None = None  # [1]: 1 where the step is padded, else 0 (set by decide)

    def decide(self, total: ir.Value) -> None:
        """total: [1] the step's last position + 1 over the batch, without the pad."""
        with self.b.scope("pad"):
            self._decide(total)

    def _decide(self, total: ir.Value) -> None:
        b = self.b
        single = b.add("Equal", [b.add("Shape", [b.input("tokens")], start=0, end=1)[0], self.one])[0]
        # 0: a prefill, whose present.* ONNX Runtime sizes
        cache = b.add("Shape", [b.input("past.0.key")], start=2, end=3)[0]
        fits = b.add("Less", [total, cache])[0]
        prefill = b.add("Equal", [cache, self.zero])[0]
        room = b.add("Or", [fits, prefill])[0]
        self.pad = b.add("Cast", [b.add("And", [single, room])[0]], to=INT64)[0]
        self.last = b.add("Sub", [self.positions, self.one])[0]
        self.last_end = b.add("Add", [self.last, self.pad])[0]

    def padded(self, value: ir.Value) -> ir.Value:
        extra = self.b.add("Slice", [value, self.last, self.last_end, self.one])[0]  # axis 1: the positions
        return self.b.add("Concat", [value, extra], axis=1)[0]

    def cut(self, value: ir.Value) -> ir.Value:
        return self.b.add("Slice", [value, self.zero, self.positions, self.one])[0]
