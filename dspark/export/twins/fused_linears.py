"""The projections of a portable verifier and their copies in the fused one.

A projection is found by the module path its weight carries (an fp32 MatMul's initializer, a MatMulNBits's blocks:
dspark.export.quantize.bundle names them after the weight they replace). Projections that read the same activation
and are all MatMulNBits alike (q/k/v; gate/up) become one MatMulNBits over their concatenated blocks: one kernel
call and one Q4_1 minimum term instead of three or two. Other projections are copied as they stand.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx_ir as ir

from dspark.errors import DSparkError
from dspark.export.quantize.weight_stream import StoredWeights
from dspark.export.twins.graph_copy import GraphBuilder, GraphIndex

MS = "com.microsoft"
ROLES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_WEIGHT = re.compile(r"target\.layers\.(\d+)\.(?:self_attn|mlp)\.(" + "|".join(ROLES) + r")\.weight")
# an fp32 MatMul's weight as the exporter stores it: transposed (.T) and at the bundle's precision (.bf16, .fp16)
_STORED = re.compile(_WEIGHT.pattern + r"(?:\.T)?(?:\.(?:bf16|fp16))?")


@dataclass
class Linear:
    """One projection in the portable graph: y_old = f(x_old) by the nodes between them."""
    x: ir.Value
    y: ir.Value
    out_features: int
    node: ir.Node  # the MatMul or MatMulNBits
    mins: ir.Value | None = None  # MatMulNBits with a Q4_1 minimum term: its [K/block, N] initializer


def _out_features(g: GraphIndex, node: ir.Node) -> int:
    if node.op_type == "MatMulNBits":
        return node.attributes.get_int("N")
    value, transposed = node.inputs[1], False
    while not value.is_initializer():
        p = value.producer()
        transposed ^= p.op_type == "Transpose"
        value = p.inputs[0]
    dims = list(value.const_value.shape.numpy())
    return dims[0] if transposed else dims[-1]


def find_linears(g: GraphIndex) -> dict[tuple[int, str], Linear]:
    """(layer, role) -> the projection, named by its weight's module path (a MatMul's weight initializer, or a
    MatMulNBits's blocks, named after the weight they replaced; a node name saying it, as older bundles have)."""
    found: dict[tuple[int, str], Linear] = {}
    for node in g.graph:
        if node.op_type == "MatMul" and node.domain in ("", "ai.onnx"):
            m = _STORED.fullmatch(g.root(node.inputs[1]).name)  # (not a Q4_1 minimum term's MatMul)
        elif node.op_type == "MatMulNBits":
            m = _WEIGHT.search(node.name or "") or _WEIGHT.search(node.inputs[1].name)
        else:
            continue
        if m is None:
            continue
        y, mins = node.outputs[0], _minimum_term(g, node.outputs[0])
        if mins is not None:  # Q4_1: the minimum term (block sums @ mins) is part of the projection
            y = g.consumers(y)[0].outputs[0]
        found[(int(m.group(1)), m.group(2))] = Linear(node.inputs[0], y, _out_features(g, node), node, mins)
    return found


def _scope(roles: tuple[str, ...]) -> str:
    """q_proj; q_proj, k_proj, v_proj -> qkv_proj; gate_proj, up_proj -> gate_up_proj"""
    stems = [r.removesuffix("_proj") for r in roles]
    return ("" if all(len(s) == 1 for s in stems) else "_").join(stems) + "_proj"


def _minimum_term(g: GraphIndex, y: ir.Value) -> ir.Value | None:
    """The [K/block, N] initializer of the Q4_1 minimum term added to a MatMulNBits output y (Add(y, MatMul(block
    sums, <key>.nbits.mins)), as quantize writes it), or None."""
    readers = g.consumers(y)
    if len(readers) != 1 or readers[0].op_type != "Add":
        return None
    term = next((i for i in readers[0].inputs if i is not y), None)
    term = term.producer() if term is not None else None
    if term is None or term.op_type != "MatMul" or not g.root(term.inputs[1]).name.endswith(".nbits.mins"):
        return None
    return g.root(term.inputs[1])


def _attrs(node: ir.Node) -> dict:
    return {name: attr.value for name, attr in node.attributes.items()}


class Projections:
    """Emits projections into a GraphBuilder: copies of the portable graph's, or concatenated MatMulNBits."""

    def __init__(self, b: GraphBuilder, linears: dict[tuple[int, str], Linear], folder: Path | None):
        self.b, self.linears, self.folder = b, linears, folder
        self.block_sums: dict[tuple[ir.Value, int, int], ir.Value] = {}

    def __call__(self, layer: int, roles: tuple[str, ...], x: ir.Value) -> list[ir.Value]:
        """The outputs of `roles` of `layer` on the new activation x (one value per role)."""
        parts = [self.linears[(layer, r)] for r in roles]
        joined = self.packed(layer, roles, x) if len(parts) > 1 else None
        if joined is not None:
            with self.b.scope(_scope(roles)):
                sizes = self.b.const(np.array([p.out_features for p in parts], np.int64), "split")
                return self.b.add("Split", [joined, sizes], len(parts), axis=-1)
        return [self._one(p, role, x) for p, role in zip(parts, roles)]

    def _one(self, p: Linear, role: str, x: ir.Value) -> ir.Value:
        if p.node.op_type != "MatMulNBits":
            return self.b.copy(p.y, {p.x: x}, x.name)  # one tag per activation: shared sub-results
        with self.b.scope(role):
            return self._nbits([p], x)

    def packed(self, layer: int, roles: tuple[str, ...], x: ir.Value) -> ir.Value | None:
        """The roles' outputs as one concatenated value when they can be one MatMulNBits, else None."""
        parts = [self.linears[(layer, r)] for r in roles]
        if not self._concatenable(parts):
            return None
        with self.b.scope(_scope(roles)):
            return self._nbits(parts, x)

    @staticmethod
    def _concatenable(parts: list[Linear]) -> bool:
        """MatMulNBits alike but for N (and for zero points or a minimum term, which a part without gets as its
        defaults: Q4_0 next to Q4_1 layers)."""
        if any(p.node.op_type != "MatMulNBits" or p.node.domain != MS or len(p.node.inputs) > 4 for p in parts):
            return False  # (a g_idx or bias input does not concatenate along N like the blocks)
        first = _attrs(parts[0].node) | {"N": 0}
        return all(_attrs(p.node) | {"N": 0} == first for p in parts)

    def _nbits(self, parts: list[Linear], x: ir.Value) -> ir.Value:
        b, first = self.b, parts[0].node
        attrs = _attrs(first)
        if len(parts) == 1:
            inputs = [x] + [b.copy(i, {}, "weights") for i in first.inputs[1:]]
            mins = parts[0].mins and b.copy(parts[0].mins, {}, "weights")
        else:
            inputs = [x, self._joined(parts, 1, "nbits.B"), self._joined(parts, 2, "nbits.scales")]
            if any(len(p.node.inputs) > 3 and p.node.inputs[3] is not None for p in parts):
                inputs.append(self._joined(parts, 3, "nbits.zero_points"))
            mins = self._joined_mins(parts) if any(p.mins for p in parts) else None
            attrs["N"] = sum(p.out_features for p in parts)
        y = b.add("MatMulNBits", inputs, domain=MS, **attrs)[0]
        if mins is None:
            return y
        sums = self._block_sums(x, attrs["K"], attrs["block_size"])
        return b.add("Add", [y, b.add("MatMul", [sums, mins])[0]])[0]

    def _joined(self, parts: list[Linear], index: int, hint: str) -> ir.Value:
        """Input `index` of the parts' MatMulNBits concatenated along N (B, scales and packed zero points all hold
        N's rows first); a part without zero points gets the op's default (2^(bits-1), packed)."""
        arrays = []
        for p in parts:
            value = p.node.inputs[index] if len(p.node.inputs) > index else None
            if value is not None:
                arrays.append(self._read(value).reshape(p.out_features, -1))
            else:
                a = _attrs(p.node)
                blocks = -(-a["K"] // a["block_size"])
                per_row = -(-blocks * a["bits"] // 8)
                default = 0x88 if a["bits"] == 4 else 1 << (a["bits"] - 1)
                arrays.append(np.full((p.out_features, per_row), default, dtype=np.uint8))
        joined = np.concatenate(arrays, axis=0)
        stored = next(self._read(p.node.inputs[index]) for p in parts
                      if len(p.node.inputs) > index and p.node.inputs[index] is not None)
        return self.b.const(np.ascontiguousarray(joined.reshape(-1, *stored.shape[1:])), hint)

    def _joined_mins(self, parts: list[Linear]) -> ir.Value:
        """The minimum terms' [K/block, N] along N (zeros for a part without one)."""
        a = _attrs(parts[0].node)
        blocks = a["K"] // a["block_size"]
        arrays = [self._read(p.mins) if p.mins else np.zeros((blocks, p.out_features), np.float32) for p in parts]
        return self.b.const(np.ascontiguousarray(np.concatenate(arrays, axis=1)), "nbits.mins")

    def _block_sums(self, x: ir.Value, k: int, block: int) -> ir.Value:
        """x [B, S, K] -> [B, S, K/block]: the sums over each block (the Q4_1 minimum term's input)."""
        key = (x, k, block)
        if key not in self.block_sums:
            with self.b.scope("blocksums"):
                self.block_sums[key] = self._sum_blocks(x, k, block)
        return self.block_sums[key]

    def _sum_blocks(self, x: ir.Value, k: int, block: int) -> ir.Value:
        blocked = self.b.add("Reshape", [x, self.b.const(np.array([0, 0, k // block, block], np.int64), "blocks")])
        return self.b.add("ReduceSum", [blocked[0], self.b.const(np.array([-1], np.int64), "last")], keepdims=0)[0]

    def _read(self, value: ir.Value) -> np.ndarray:
        """An initializer's array; external data read from the bundle folder's files (a memory map)."""
        value = self.b.g.root(value)
        if isinstance(value.const_value, ir.ExternalTensor) and self.folder is None:
            raise DSparkError("fused verifier: concatenating stored weights needs the bundle folder")
        return StoredWeights(self.folder or Path(".")).array(value)
