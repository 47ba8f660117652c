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
embedding lookup and everything after the final norm (LM head, in-graph acceptance) are copied unchanged.

ONNX Runtime's CPU GroupQueryAttention takes several positions per request only at batch 1 (or with an empty
past), so the graph runs each request's attention on its own, in lanes (dspark.export.twins.fused_lanes): every other
kernel takes all the step's rows at once. A graph built with one lane (as before lanes existed) runs batch-1 steps,
one-position steps and prefills, and the runtime takes the portable verifier for the rest
(dspark.runtime.fused_verifier.FusedVerifier).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from dspark.bundle import GraphSpec, Manifest, TensorSpec, sha256_file
from dspark.errors import DSparkError
from dspark.export.graphs import past_names
from dspark.export.quantize.nbits_graph import resolve
from dspark.export.twins.catalog import unfusable
from dspark.export.twins.fused_lanes import Lanes, lane_inputs, rope_tables
from dspark.export.twins.fused_linears import ROLES, Linear, Projections, find_linears
from dspark.export.twins.graph_copy import GraphBuilder, GraphIndex, load_skeleton
from dspark.files import normal_mode

MS = "com.microsoft"
SPS_KEYS = ("sps_table", "sps_measurements", "sps_context", "sps_backend")  # a verifier's measured step costs
TAIL_OUTPUTS = ("accepted", "next_token")
LANES = 8  # requests a fused step takes at once (more run in groups of LANES)


def _norm_parts(g: GraphIndex, value: str) -> tuple[str, str] | None:
    """(gamma, div) when `value` = gamma * (x / Sqrt(ReduceMean(x^2) + eps)), an RMSNorm as exported; else None.
    Norms are found by this shape, not by name: the exporter stores equal weights once (a random model's norm
    weights are all ones), under the first name that had them."""
    node = g.producer.get(value)
    if node is None or node.op_type != "Mul":
        return None
    for gamma, other in ((node.input[0], node.input[1]), (node.input[1], node.input[0])):
        div = g.producer.get(other)
        while div is not None and div.op_type == "Cast":
            div = g.producer.get(div.input[0])
        if div is not None and div.op_type == "Div" and g.root(gamma) in g.inits:
            return gamma, div.output[0]
    return None


def _eps(g: GraphIndex, div: str) -> float:
    """epsilon of an RMSNorm: x / Sqrt(ReduceMean(x^2) + eps)."""
    sqrt = g.producer[g.producer[div].input[1]]
    add = g.producer[sqrt.input[0]]
    for i in add.input:
        c = g.constant(i)
        if c is not None:
            return float(c.reshape(-1)[0])
    raise DSparkError("fused verifier: cannot read the RMSNorm epsilon from the portable graph")


def _final_norm(g: GraphIndex, linears: dict[tuple[int, str], Linear], hidden: int) -> tuple[str, str, str]:
    """(output, gamma, div) of the final norm: the one RMSNorm over the hidden size no projection reads."""
    inputs = {lin.x for lin in linears.values()}
    found = []
    for node in g.model.graph.node:
        parts = _norm_parts(g, node.output[0]) if node.op_type == "Mul" else None
        if parts and node.output[0] not in inputs and list(g.inits[g.root(parts[0])].dims) == [hidden]:
            found.append((node.output[0], *parts))
    if len(found) != 1:
        raise DSparkError(f"fused verifier: expected one final norm in the portable graph, found {len(found)}")
    return found[0]


def _head_norm_gamma(g: GraphIndex, start: str, head_dim: int) -> str:
    """Qwen3: the weight of the per-head RMSNorm applied to a q or k projection's output."""
    frontier, seen = [start], set()
    for _ in range(8):
        nxt = []
        for value in frontier:
            for node in g.consumers.get(value, []):
                parts = _norm_parts(g, node.output[0]) if node.op_type == "Mul" else None
                if parts and list(g.inits[g.root(parts[0])].dims) == [head_dim]:
                    return parts[0]
                if node.name not in seen:
                    seen.add(node.name)
                    nxt += [o for o in node.output if o]
        frontier = nxt
    raise DSparkError("fused verifier: cannot find a Qwen3 q/k norm in the portable graph")


def _inv_freq(g: GraphIndex) -> str:
    """RoPE's inverse frequencies: positions * inv_freq -> Concat(freqs, freqs) -> Cos."""
    cos = next((n for n in g.model.graph.node if n.op_type == "Cos"), None)
    cat = g.producer.get(cos.input[0]) if cos is not None else None
    mul = g.producer.get(cat.input[0]) if cat is not None else None
    for i in (mul.input if mul is not None and mul.op_type == "Mul" else ()):
        if g.root(i) in g.inits:
            return i
    raise DSparkError("fused verifier: cannot find RoPE's frequencies in the portable graph")


def _widened(g: GraphIndex, value: str) -> str:
    """The value as float32: the Cast a bf16/fp16 bundle applies right after (an embedding lookup's rows)."""
    for node in g.consumers.get(value, []):
        if node.op_type == "Cast" and next(a.i for a in node.attribute if a.name == "to") == TensorProto.FLOAT:
            return node.output[0]
    return value


def _weight(b: GraphBuilder, value: str) -> str:
    """A constant of the portable graph (its pass-through chain copied), as float32."""
    new = b.copy(value, {}, "weights")
    root, chain = resolve(value, b.g.producer, b.g.inits)
    if b.g.inits[root].data_type == TensorProto.FLOAT and not any(n.op_type == "Cast" for n in chain):
        return new
    return b.add("Cast", [new], to=TensorProto.FLOAT)[0]


def _layer_norm_gamma(g: GraphIndex, lin: Linear) -> str:
    parts = _norm_parts(g, lin.x)
    if parts is None:
        raise DSparkError("fused verifier: a layer's projections do not read an RMSNorm in the portable graph")
    return parts[0]


def fuse_verifier(model: onnx.ModelProto, target: dict, tap_ids: list[int], folder: Path | None = None,
                  lanes: int = LANES) -> onnx.ModelProto:
    """The fused twin of a portable verifier (a skeleton whose external data lives in `folder`): it refers to the
    portable graph's weights where it multiplies by them as they are, and holds new initializers only for
    concatenated MatMulNBits projections. lanes: requests whose attention a step runs one by one (1: the graph
    before lanes, batch-1 and one-position steps only)."""
    return _FusedVerifier(model, target, folder, lanes).build(tap_ids)


class _FusedVerifier:
    def __init__(self, model: onnx.ModelProto, target: dict, folder: Path | None, lanes: int):
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
        self.b = GraphBuilder(self.g)
        self.rows = _PadToTwo(self.b)
        self.proj = Projections(self.b, self.linears, folder)
        self.lane_count = lanes
        self.gqa = {"num_heads": self.linears[(0, "q_proj")].out_features // self.hd, "kv_num_heads": self.kv_heads,
                    "do_rotary": 1, "rotary_interleaved": 0, "scale": float(self.hd) ** -0.5}
        self.lanes = Lanes(self.b, lanes, self.rows.positions, self.gqa) if lanes > 1 else None

    def build(self, tap_ids: list[int]) -> onnx.ModelProto:
        b = self.b
        embed = next((n for n in self.model.graph.node if n.op_type == "Gather" and n.input[1] == "tokens"), None)
        if embed is None:
            raise DSparkError("fused verifier: the portable graph has no embedding lookup")
        x = b.copy(_widened(self.g, embed.output[0]), {}, "embed")
        self.attention_inputs = self._lengths_and_rope()
        taps = {-1: x} if -1 in tap_ids else {}
        residual, update = x, None
        for i in range(self.layers):
            layer_input, residual, update = self._layer(i, residual, update)
            if i - 1 in tap_ids:  # layer i - 1's output is what layer i's fused norm adds up
                taps[i - 1] = layer_input
        hidden = b.add("SkipSimplifiedLayerNormalization", [update, residual, _weight(b, self.norm_gamma)], 4, MS,
                       epsilon=self.eps)[0]
        for o in TAIL_OUTPUTS:
            b.add("Identity", [b.copy(o, {self.norm_out: hidden}, "tail")], names=[o])
        tap_values = [taps[t] for t in tap_ids]
        b.add("Concat" if len(tap_values) > 1 else "Identity", tap_values, names=["taps"],
              **({"axis": -1} if len(tap_values) > 1 else {}))
        presents = [f"present.{i}.{kind}" for i in range(self.layers) for kind in ("key", "value")]
        lane_past, lane_present = lane_inputs(self.lane_count, self.layers, self.kv_heads, self.hd)
        return _model(self.model, b, presents, self.hd, self.kv_heads, lane_past, lane_present)

    def _lengths_and_rope(self) -> tuple[str, str, str, str]:
        """seqlens_k (each request's last position), total_sequence_length and the RoPE tables up to it, all
        counting the padding row (_PadToTwo)."""
        b, rows = self.b, self.rows
        inv_freq = _weight(b, _inv_freq(self.g))
        if self.lanes is not None:
            return self.lanes.lengths_and_rope(inv_freq)
        s_len = rows.positions
        one = b.const(np.array([1], np.int64), "one")
        past_len = b.add("ReduceSum", ["past_mask", one], keepdims=0)[0]
        longest_past = b.add("ReduceMax", [past_len], keepdims=1)[0]
        rows.decide(b.add("Add", [longest_past, s_len])[0])
        width = b.add("Add", [s_len, rows.pad])[0]  # the rows attention runs on
        last = b.add("Sub", [b.add("Add", [past_len, width])[0], one])[0]
        seqlens = b.add("Cast", [last], to=TensorProto.INT32)[0]
        total = b.add("Squeeze", [b.add("Add", [longest_past, width])[0]])[0]
        return seqlens, b.add("Cast", [total], to=TensorProto.INT32)[0], *rope_tables(b, total, inv_freq)

    def _layer(self, i: int, residual: str, update: str | None) -> tuple[str, str, str]:
        """Decoder layer i on the residual stream (plus the previous layer's update, added by the fused norm);
        returns (its input: the previous layer's output, the stream after its attention, its MLP's update)."""
        b, proj, eps = self.b, self.proj, self.eps
        gamma = _weight(b, _layer_norm_gamma(self.g, self.linears[(i, "q_proj")]))
        if update is None:
            h = b.add("SimplifiedLayerNormalization", [residual, gamma], axis=-1, epsilon=eps)[0]
        else:
            h, _, _, residual = b.add("SkipSimplifiedLayerNormalization", [update, residual, gamma], 4, MS,
                                      epsilon=eps)
        layer_input = residual
        qkv = None if self.qk_norm else proj.packed(i, ("q_proj", "k_proj", "v_proj"), h)
        if qkv is not None:  # GroupQueryAttention takes q, k and v packed in one tensor
            q, k, v = qkv, "", ""
        else:
            q, k, v = proj(i, ("q_proj", "k_proj", "v_proj"), h)
            if self.qk_norm:
                q, k = self._head_norm(q, i, "q_proj"), self._head_norm(k, i, "k_proj")
        attn = self._attention(i, q, k, v)
        o, = proj(i, ("o_proj",), attn)
        gamma = _weight(b, _layer_norm_gamma(self.g, self.linears[(i, "gate_proj")]))
        h2, _, _, residual = b.add("SkipSimplifiedLayerNormalization", [o, residual, gamma], 4, MS, epsilon=eps)
        gate, up = proj(i, ("gate_proj", "up_proj"), h2)
        act = b.add("Mul", [b.add("Mul", [gate, b.add("Sigmoid", [gate])[0]])[0], up])[0]
        return layer_input, residual, proj(i, ("down_proj",), act)[0]

    def _attention(self, i: int, q: str, k: str, v: str) -> str:
        """Layer i's attention of q/k/v [batch, positions, *] (k and v empty when q packs the three)."""
        if self.lanes is not None:
            return self.lanes.attention(i, q, k, v)
        b = self.b
        q, k, v = (self.rows.padded(t) if t else "" for t in (q, k, v))
        attn = b.add("GroupQueryAttention", [q, k, v, f"past.{i}.key", f"past.{i}.value", *self.attention_inputs],
                     3, MS, names=[b.name("attn"), f"present.{i}.key", f"present.{i}.value"], **self.gqa)[0]
        return self.rows.cut(attn)

    def _head_norm(self, v: str, i: int, role: str) -> str:
        """Qwen3's per-head RMSNorm of q and k."""
        b, hd = self.b, self.hd
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
        self.positions = b.add("Shape", ["tokens"], start=1, end=2)[0]
        self.zero, self.one = b.const(np.array([0], np.int64), "zero"), b.const(np.array([1], np.int64), "one")
        self.pad = ""  # [1]: 1 where the step is padded, else 0 (set by decide)

    def decide(self, total: str) -> None:
        """total: [1] the step's last position + 1 over the batch, without the pad."""
        b = self.b
        single = b.add("Equal", [b.add("Shape", ["tokens"], start=0, end=1)[0], self.one])[0]
        cache = b.add("Shape", ["past.0.key"], start=2, end=3)[0]  # 0: a prefill, whose present.* ONNX Runtime sizes
        fits = b.add("Less", [total, cache])[0]
        prefill = b.add("Equal", [cache, self.zero])[0]
        room = b.add("Or", [fits, prefill])[0]
        self.pad = b.add("Cast", [b.add("And", [single, room])[0]], to=TensorProto.INT64)[0]
        self.last = b.add("Sub", [self.positions, self.one])[0]
        self.last_end = b.add("Add", [self.last, self.pad])[0]

    def padded(self, value: str) -> str:
        extra = self.b.add("Slice", [value, self.last, self.last_end, self.one])[0]  # axis 1: the positions
        return self.b.add("Concat", [value, extra], axis=1)[0]

    def cut(self, value: str) -> str:
        return self.b.add("Slice", [value, self.zero, self.positions, self.one])[0]


def _model(old: onnx.ModelProto, b: GraphBuilder, presents: list[str], hd: int, kv_heads: int, lane_past: list,
           lane_present: list) -> onnx.ModelProto:
    outputs = {o.name: o for o in old.graph.output}
    new_outputs = [outputs[name] for name in (*TAIL_OUTPUTS, "taps")]
    for name in presents:
        new_outputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", kv_heads, "present", hd]))
    graph = helper.make_graph(b.nodes, "verifier_fused", [*old.graph.input, *lane_past], new_outputs + lane_present,
                              initializer=list(b.inits.values()))
    opsets = {o.domain: o.version for o in old.opset_import}
    opsets[MS] = 1
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()])
    model.ir_version = old.ir_version
    return model


def default_lanes(manifest: Manifest) -> int:
    """LANES for a verifier whose activations are quantized, else 1. With int8 activations each request's
    attention must run as in a batch-1 step (_PadToTwo): without lanes, one step per request, each reading all the
    weights. With fp32 activations the graph without lanes already runs one-position steps of several requests in
    one GroupQueryAttention, which lanes (one call per request, two rows each) would slow down
    (bench/fused_lanes.py)."""
    return LANES if manifest.quantized_activations("verifier") else 1


def fused_spec(portable: GraphSpec, file: str, layers: int, kv_heads: int, hd: int, lanes: int = 1) -> GraphSpec:
    """The manifest entry: the portable verifier's inputs and lanes 1..'s caches; its outputs but the caches'
    present.* (and the lanes') for new_kv."""
    outputs = [t for t in portable.outputs if t.name != "new_kv"]
    outputs += [TensorSpec(name.replace("past", "present", 1), "float32", ["batch", kv_heads, "present", hd])
                for name in past_names("past", layers)]
    lane_past, lane_present = lane_inputs(lanes, layers, kv_heads, hd)
    as_specs = [[TensorSpec(v.name, "float32", [d.dim_value or d.dim_param for d in v.type.tensor_type.shape.dim])
                 for v in infos] for infos in (lane_past, lane_present)]
    return GraphSpec(file=file, inputs=list(portable.inputs) + as_specs[0], outputs=outputs + as_specs[1])


FUSED_FILE = "verifier_fused.onnx"


def add_fused_verifier(folder: Path, manifest: Manifest, lanes: int | None = None) -> GraphSpec:
    """Write the fused twin of folder's verifier next to it (sharing its data files) and enter it in `manifest`
    (the caller writes the manifest). The verifier is read as a skeleton: no weight is loaded.

    lanes: default_lanes()."""
    spec = manifest.graphs["verifier"]
    path = Manifest.path(folder, spec.file)
    portable = load_skeleton(path)
    if lanes is None:
        lanes = default_lanes(manifest)
    t = manifest.target
    model = fuse_verifier(portable, t, list(manifest.draft["target_layer_ids"]), path.parent, lanes)
    for name in (FUSED_FILE, f"{FUSED_FILE}.data"):
        (folder / name).unlink(missing_ok=True)  # may be a hard link into another copy of the bundle
    onnx.save(model, str(folder / FUSED_FILE), save_as_external_data=True, all_tensors_to_one_file=True,
              location=f"{FUSED_FILE}.data", size_threshold=1024)  # only its new (concatenated) weights
    for name in (FUSED_FILE, f"{FUSED_FILE}.data"):
        if (folder / name).exists():
            normal_mode(folder / name)
    fused = fused_spec(spec, FUSED_FILE, t["num_layers"], t["num_kv_heads"], t["head_dim"], lanes)
    fused.sha256 = sha256_file(folder / FUSED_FILE)
    manifest.graphs["verifier_fused"] = fused
    return fused


def forget_step_costs(manifest: Manifest) -> None:
    """Drop the SPS table: the verifier steps it measured are not the ones the bundle takes any more."""
    for key in SPS_KEYS:
        manifest.calibration.pop(key, None)
