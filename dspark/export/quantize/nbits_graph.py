"""Graph surgery for weight-only quantization (onnx_ir): find MatMuls with constant weights, whatever chain of
Transpose/Cast/Identity leads from a stored initializer to them, and replace them by MatMulNBits nodes.

Nothing here assumes how a bundle stores its weights (fp32 or fp16/bf16 initializers, a tied embedding read
through a Transpose, external data in any file): every weight is followed back to the initializer it comes from,
and read from where that initializer's data is (a skeleton's external data: a memory map of its span).

    before:  initializer W [K, N] (fp32/fp16/bf16) --(Transpose | Cast | Identity)*--> MatMul(x, .) --> y
    after:   B (uint8 blocks), scales[, zero_points] ------------------------------> MatMulNBits(x, B, ...) --> y
             (the chain and W leave the graph when nothing else reads them)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import onnx_ir as ir
import onnxruntime as ort

from dspark.export.quantize.gguf_blocks import NBitsWeight
from dspark.export.quantize.weight_stream import StoredWeights
from dspark.export.twins.graph_copy import UniqueNames, take_over

PASS_THROUGH = ("Transpose", "Cast", "Identity")
MS_DOMAIN = "com.microsoft"


@dataclass
class ConstWeight:
    """A MatMul whose B input is a constant: B = chain(initializer), a [K, N] matrix, read when asked for."""
    node: ir.Node
    source: str  # the initializer it comes from
    storage: np.dtype  # that initializer's element type (what the export stored)
    shape: tuple[int, int]  # [K, N]
    init: ir.Value
    chain: list[ir.Node]
    stored: StoredWeights | None = None  # where external data lives (None: read where the tensor says)
    key: str | None = None  # what the tensors replacing it are named after (None: the MatMul's output)

    @property
    def weight(self) -> np.ndarray:
        """float32 [K, N], the matrix the MatMul multiplies by: read anew on each access (one weight at a time)."""
        stored = self.stored.array(self.init) if self.stored else self.init.const_value.numpy()
        return np.ascontiguousarray(_apply(stored, self.chain).astype(np.float32))


def resolve(value: ir.Value) -> tuple[ir.Value, list[ir.Node]] | None:
    """(initializer, pass-through nodes from it to `value`, outermost first), or None when `value` is computed."""
    chain = []
    while not value.is_initializer():
        node = value.producer()
        if node is None or node.op_type not in PASS_THROUGH or node.domain not in ("", "ai.onnx"):
            return None
        chain.append(node)
        value = node.inputs[0]
    return value, chain


def _apply(array: np.ndarray, chain: list[ir.Node]) -> np.ndarray:
    for node in reversed(chain):  # innermost (next to the initializer) first
        if node.op_type == "Transpose":
            array = array.transpose(_perm(node, array.ndim))
    return array


def _perm(node: ir.Node, rank: int) -> list[int]:
    return node.attributes.get_ints("perm", list(reversed(range(rank))))


def _float32_product(init: ir.Value, chain: list[ir.Node]) -> bool:
    """Whether the MatMul at the end of the chain multiplies in float32 (a Cast decides, else the stored type)."""
    cast = next((n for n in chain if n.op_type == "Cast"), None)  # the outermost Cast
    elem = cast.attributes.get_int("to") if cast else init.const_value.dtype
    return elem == ir.DataType.FLOAT


def _sources(model: ir.Model, min_elements: int):
    """(MatMul node, initializer, pass-through chain) for every float32 MatMul by a 2-D constant."""
    for node in model.graph:
        if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx"):
            continue
        resolved = resolve(node.inputs[1])
        if resolved is None:
            continue
        init, chain = resolved
        dims = init.const_value.shape.numpy()
        if len(dims) == 2 and int(np.prod(dims)) >= min_elements and _float32_product(init, chain):
            yield node, init, chain


def constant_matmul_weights(model: ir.Model, min_elements: int = 0,
                            stored: StoredWeights | None = None) -> list[ConstWeight]:
    """Every float32 MatMul whose B is a 2-D constant of at least min_elements elements, in graph order. Shapes
    come from the initializers' tensors: no weight is read here. `stored`: where a skeleton model's external data
    is."""
    found = []
    for node, init, chain in _sources(model, min_elements):
        dims = list(init.const_value.shape.numpy())
        for link in reversed(chain):  # innermost first, as _apply
            if link.op_type == "Transpose":
                dims = [dims[p] for p in _perm(link, len(dims))]
        storage = init.const_value.dtype.numpy()
        found.append(ConstWeight(node, init.name, storage, (dims[0], dims[1]), init, chain, stored))
    return found


def _in_memory(array: np.ndarray, name: str) -> ir.TensorProtocol:
    return ir.tensor(array, name=name)


class NBitsWriter:
    """Replaces MatMuls by MatMulNBits nodes in one graph; the Q4_1 minimum term's block sums of an activation are
    computed once however many matrices read that activation.

    The new nodes are named in the MatMul's scope (target/layers.3/mlp/up_proj/MatMul ->
    target/layers.3/mlp/up_proj/MatMulNBits, .../mins/MatMul, .../mins/Add; block sums .../blocksum32/ReduceSum in
    the scope of the first MatMul reading the activation), the new tensors after the weight's key
    (<key>.nbits.B, <key>.nbits.scales, ...)."""

    def __init__(self, model: ir.Model, accuracy_level: int,
                 store: Callable[[np.ndarray, str], ir.TensorProtocol] = _in_memory):
        """store(array, name) -> the tensor holding it (in the graph file, or in a data file being written)."""
        self.model, self.accuracy_level, self.store = model, accuracy_level, store
        self.written: list[str] = []  # the initializers this writer made
        self.block_sums: dict[tuple[ir.Value, int, int], ir.Value] = {}
        self.new_nodes: dict[ir.Node, tuple[ir.Value, list[ir.Node]]] = {}  # MatMul -> (its activation, replacement)
        self.pending: dict[ir.Value, list[ir.Node]] = {}  # block-sum nodes of an activation, before its first reader
        self._name = UniqueNames(node.name for node in model.graph.all_nodes())

    def _init(self, array: np.ndarray, name: str) -> ir.Value:
        # (no type or shape on the value: the graph file describes the tensor once, in the initializer)
        value = ir.Value(name=name, const_value=self.store(array, name))
        self.model.graph.register_initializer(value)
        self.written.append(name)
        return value

    def replace(self, node: ir.Node, w: NBitsWeight, accuracy_level: int | None = None, key: str | None = None) -> None:
        """Queue the replacement of MatMul `node` (activation node.inputs[0], weight [K, N] = w's transpose); the
        new tensors are named after `key` (default: the MatMul's output)."""
        level = self.accuracy_level if accuracy_level is None else accuracy_level
        base, scope = key or node.outputs[0].name, _scope(node)
        x = node.inputs[0]
        inputs = [x, self._init(w.packed, f"{base}.nbits.B"), self._init(w.scales.reshape(-1), f"{base}.nbits.scales")]
        if w.zero_points is not None:
            inputs.append(self._init(w.zero_points.reshape(-1), f"{base}.nbits.zero_points"))
        attributes = {"K": w.cols, "N": w.rows, "accuracy_level": level, "bits": w.bits, "block_size": w.block_size}
        nodes = [_node("MatMulNBits", inputs, f"{base}.nbits.out", self._name(f"{scope}/MatMulNBits"), attributes,
                       MS_DOMAIN)]
        if w.mins is not None:
            sums = self._block_sums(x, w.cols, w.block_size, scope)
            mins = self._init(np.ascontiguousarray(w.mins.T), f"{base}.nbits.mins")  # [K/block, N]
            nodes.append(_node("MatMul", [sums, mins], f"{base}.mins.out", self._name(f"{scope}/mins/MatMul")))
            nodes.append(_node("Add", [nodes[0].outputs[0], nodes[1].outputs[0]], "", self._name(f"{scope}/mins/Add")))
        self.new_nodes[node] = x, nodes

    def _block_sums(self, x: ir.Value, k: int, block: int, scope: str) -> ir.Value:
        """x [..., K] -> [..., K/block]: the sum over each block of `block` consecutive features."""
        key = (x, k, block)
        if key not in self.block_sums:
            p, at = f"{x.name}.blocksum{block}", f"{scope}/blocksum{block}"
            tail = self._init(np.array([k // block, block], dtype=np.int64), f"{p}.tail")
            start = self._init(np.array([0], dtype=np.int64), f"{p}.start")
            stop = self._init(np.array([-1], dtype=np.int64), f"{p}.stop")
            axes = self._init(np.array([-1], dtype=np.int64), f"{p}.axes")
            shape = _node("Shape", [x], f"{p}.shape", self._name(f"{at}/Shape"))
            lead = _node("Slice", [shape.outputs[0], start, stop], f"{p}.lead", self._name(f"{at}/Slice"))
            concat = _node("Concat", [lead.outputs[0], tail], f"{p}.blocked_shape", self._name(f"{at}/Concat"),
                           {"axis": 0})
            reshape = _node("Reshape", [x, concat.outputs[0]], f"{p}.blocked", self._name(f"{at}/Reshape"))
            total = _node("ReduceSum", [reshape.outputs[0], axes], p, self._name(f"{at}/ReduceSum"), {"keepdims": 0})
            self.pending.setdefault(x, []).extend([shape, lead, concat, reshape, total])
            self.block_sums[key] = total.outputs[0]
        return self.block_sums[key]

    def apply(self) -> int:
        """Swap the queued nodes in, in place of their MatMuls (block sums right before their first reader)."""
        graph = self.model.graph
        for node in [n for n in graph if n in self.new_nodes]:
            x, new = self.new_nodes[node]  # (x: as replace saw it; a MatMul replaced before may write it now)
            graph.insert_before(node, [*self.pending.pop(x, []), *new])
            take_over(node.outputs[0], new[-1].outputs[0])
            graph.remove(node, safe=True)
        prune(self.model)
        return len(self.new_nodes)


def _scope(node: ir.Node) -> str:
    """Where a node's replacement goes: its name's scope (target/layers.3/mlp/up_proj/MatMul ->
    target/layers.3/mlp/up_proj), or the name itself if it has none."""
    name = node.name or node.outputs[0].name
    return name.rpartition("/")[0] or name


def _node(op: str, inputs: list[ir.Value], output: str, name: str, attributes: dict | None = None,
          domain: str = "") -> ir.Node:
    node = ir.node(op, inputs, attributes, domain=domain, name=name)
    node.outputs[0].name = output or None
    return node


def prune(model: ir.Model) -> None:
    """Drop pass-through nodes nothing reads and initializers nothing reads."""
    graph = model.graph
    while True:
        dead = [n for n in graph if n.op_type in PASS_THROUGH and not any(_read(o) for o in n.outputs)]
        if not dead:
            break
        for n in dead:
            graph.remove(n, safe=True)
    for name, value in list(graph.initializers.items()):
        if not _read(value):
            del graph.initializers[name]


def _read(value: ir.Value) -> bool:
    """Whether a node (of the graph or of a subgraph) or the graph's outputs read `value`."""
    return bool(value.uses()) or value.is_graph_output()


def vocab_matmul_output(model: ir.Model, vocab: int) -> str:
    """Name of the tensor the LM head writes (the logits): the last MatMul by a constant [K, vocab] weight (shapes
    only, no weight is read). A graph quantized by NBitsWriter keeps that name for the same tensor."""
    found = None
    for w in constant_matmul_weights(model):
        if w.shape[1] == vocab:
            found = w.node.outputs[0].name
    if found is None:
        raise ValueError(f"no MatMul with {vocab} outputs (the LM head) in graph {model.graph.name!r}")
    return found


def nbits_model(w: NBitsWeight, accuracy_level: int = 0) -> ir.Model:
    """A one-MatMul model Y = A W^T with W held as NBitsWriter writes it (A: [M, K], Y: [M, N])."""
    a = ir.Value(name="A", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(["M", w.cols]))
    matmul = _node("MatMul", [a, ir.Value(name="W")], "Y", "probe/MatMul")
    y = matmul.outputs[0]
    y.type, y.shape = ir.TensorType(ir.DataType.FLOAT), ir.Shape(["M", w.rows])
    graph = ir.Graph([a], [y], nodes=[matmul], name="nbits", opset_imports={"": 21, MS_DOMAIN: 1})
    model = ir.Model(graph, ir_version=10)
    writer = NBitsWriter(model, accuracy_level)
    writer.replace(matmul, w)
    writer.apply()
    return model


def probe_weight(w: NBitsWeight) -> np.ndarray:
    """[N, K]: the weight ONNX Runtime's MatMulNBits kernel (fp32 activations) actually multiplies by, read back
    by multiplying the identity."""
    model = ir.to_proto(nbits_model(w)).SerializeToString()
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    return session.run(None, {"A": np.eye(w.cols, dtype=np.float32)})[0].T
