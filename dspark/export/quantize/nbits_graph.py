"""Graph surgery for weight-only quantization (onnx protos): find MatMuls with constant weights, whatever chain of
Transpose/Cast/Identity leads from a stored initializer to them, and replace them by MatMulNBits nodes.

Nothing here assumes how a bundle stores its weights (fp32 or fp16/bf16 initializers, a tied embedding read
through a Transpose, external data in any file): the model is an onnx.load result with its data resolved, and
every weight is followed back to the initializer it comes from.

    before:  initializer W [K, N] (fp32/fp16/bf16) --(Transpose | Cast | Identity)*--> MatMul(x, .) --> y
    after:   B (uint8 blocks), scales[, zero_points] ------------------------------> MatMulNBits(x, B, ...) --> y
             (the chain and W leave the graph when nothing else reads them)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from dspark.export.quantize.gguf_blocks import NBitsWeight
from dspark.export.quantize.weight_stream import StoredWeights

PASS_THROUGH = ("Transpose", "Cast", "Identity")
MS_DOMAIN = "com.microsoft"


@dataclass
class ConstWeight:
    """A MatMul whose B input is a constant: B = chain(initializer), a [K, N] matrix, read when asked for."""
    node: onnx.NodeProto
    source: str  # the initializer it comes from
    storage: np.dtype  # that initializer's element type (what the export stored)
    shape: tuple[int, int]  # [K, N]
    init: onnx.TensorProto
    chain: list[onnx.NodeProto]
    stored: StoredWeights | None = None  # where external data lives (None: the model's data is loaded)

    @property
    def weight(self) -> np.ndarray:
        """float32 [K, N], the matrix the MatMul multiplies by: read anew on each access (one weight at a time)."""
        stored = self.stored.array(self.init) if self.stored else numpy_helper.to_array(self.init)
        return np.ascontiguousarray(_apply(stored, self.chain).astype(np.float32))


def _producers(model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    return {o: n for n in model.graph.node for o in n.output}


def resolve(name: str, producers: dict, inits: dict) -> tuple[str, list[onnx.NodeProto]] | None:
    """(initializer, pass-through nodes from it to `name`, outermost first), or None when `name` is computed."""
    chain = []
    while name not in inits:
        node = producers.get(name)
        if node is None or node.op_type not in PASS_THROUGH or node.domain not in ("", "ai.onnx"):
            return None
        chain.append(node)
        name = node.input[0]
    return name, chain


def _apply(array: np.ndarray, chain: list[onnx.NodeProto]) -> np.ndarray:
    for node in reversed(chain):  # innermost (next to the initializer) first
        if node.op_type == "Transpose":
            array = array.transpose(_perm(node, array.ndim))
    return array


def _perm(node: onnx.NodeProto, rank: int) -> list[int]:
    return next((list(a.ints) for a in node.attribute if a.name == "perm"), list(reversed(range(rank))))


def _float32_product(init: onnx.TensorProto, chain: list[onnx.NodeProto]) -> bool:
    """Whether the MatMul at the end of the chain multiplies in float32 (a Cast decides, else the stored type)."""
    cast = next((n for n in chain if n.op_type == "Cast"), None)  # the outermost Cast
    elem = next(a.i for a in cast.attribute if a.name == "to") if cast else init.data_type
    return elem == onnx.TensorProto.FLOAT


def _sources(model: onnx.ModelProto, min_elements: int):
    """(MatMul node, initializer, pass-through chain) for every float32 MatMul by a 2-D constant."""
    producers = _producers(model)
    inits = {i.name: i for i in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx"):
            continue
        resolved = resolve(node.input[1], producers, inits)
        if resolved is None:
            continue
        init = inits[resolved[0]]
        if len(init.dims) == 2 and int(np.prod(init.dims)) >= min_elements and _float32_product(init, resolved[1]):
            yield node, init, resolved[1]


def constant_matmul_weights(model: onnx.ModelProto, min_elements: int = 0,
                            stored: StoredWeights | None = None) -> list[ConstWeight]:
    """Every float32 MatMul whose B is a 2-D constant of at least min_elements elements, in graph order. Shapes
    come from the initializers' dims: no weight is read here. `stored`: where a skeleton model's external data is."""
    found = []
    for node, init, chain in _sources(model, min_elements):
        dims = list(init.dims)
        for link in reversed(chain):  # innermost first, as _apply
            if link.op_type == "Transpose":
                dims = [dims[p] for p in _perm(link, len(dims))]
        storage = np.dtype(helper.tensor_dtype_to_np_dtype(init.data_type))
        found.append(ConstWeight(node, init.name, storage, (dims[0], dims[1]), init, chain, stored))
    return found


class NBitsWriter:
    """Replaces MatMuls by MatMulNBits nodes in one graph; the Q4_1 minimum term's block sums of an activation are
    computed once however many matrices read that activation."""

    def __init__(self, model: onnx.ModelProto, accuracy_level: int,
                 store: Callable[[np.ndarray, str], onnx.TensorProto] = numpy_helper.from_array):
        """store(array, name) -> the initializer holding it (in the proto, or in a data file being written)."""
        self.model, self.accuracy_level, self.store = model, accuracy_level, store
        self.written: list[str] = []  # the initializers this writer made
        self.block_sums: dict[tuple[str, int, int], str] = {}
        self.new_nodes: dict[str, list[onnx.NodeProto]] = {}  # MatMul name -> its replacement
        self.pending: list[onnx.NodeProto] = []  # block-sum nodes, placed before their first reader

    def _init(self, array: np.ndarray, name: str) -> str:
        self.model.graph.initializer.append(self.store(array, name))
        self.written.append(name)
        return name

    def replace(self, node: onnx.NodeProto, w: NBitsWeight, accuracy_level: int | None = None) -> None:
        """Queue the replacement of MatMul `node` (activation node.input[0], weight [K, N] = w's transpose)."""
        level = self.accuracy_level if accuracy_level is None else accuracy_level
        base = node.name or node.output[0]
        inputs = [node.input[0], self._init(w.packed, f"{base}.nbits.B"),
                  self._init(w.scales.reshape(-1), f"{base}.nbits.scales")]
        if w.zero_points is not None:
            inputs.append(self._init(w.zero_points.reshape(-1), f"{base}.nbits.zero_points"))
        out = node.output[0] if w.mins is None else f"{base}.nbits.out"
        nodes = [helper.make_node("MatMulNBits", inputs, [out], name=f"{base}.nbits", domain=MS_DOMAIN, K=w.cols,
                                  N=w.rows, bits=w.bits, block_size=w.block_size,
                                  accuracy_level=level)]
        if w.mins is not None:
            sums = self._block_sums(node.input[0], w.cols, w.block_size)
            mins = self._init(np.ascontiguousarray(w.mins.T), f"{base}.nbits.mins")  # [K/block, N]
            nodes += [helper.make_node("MatMul", [sums, mins], [f"{base}.mins.out"], name=f"{base}.mins"),
                      helper.make_node("Add", [out, f"{base}.mins.out"], [node.output[0]], name=f"{base}.mins.add")]
        self.new_nodes[node.name or node.output[0]] = nodes

    def _block_sums(self, x: str, k: int, block: int) -> str:
        """x [..., K] -> [..., K/block]: the sum over each block of `block` consecutive features."""
        key = (x, k, block)
        if key not in self.block_sums:
            p = f"{x}.blocksum{block}"
            tail = self._init(np.array([k // block, block], dtype=np.int64), f"{p}.tail")
            start = self._init(np.array([0], dtype=np.int64), f"{p}.start")
            stop = self._init(np.array([-1], dtype=np.int64), f"{p}.stop")
            axes = self._init(np.array([-1], dtype=np.int64), f"{p}.axes")
            self.pending.extend([
                helper.make_node("Shape", [x], [f"{p}.shape"], name=f"{p}.shape"),
                helper.make_node("Slice", [f"{p}.shape", start, stop], [f"{p}.lead"], name=f"{p}.lead"),
                helper.make_node("Concat", [f"{p}.lead", tail], [f"{p}.blocked_shape"], name=f"{p}.concat", axis=0),
                helper.make_node("Reshape", [x, f"{p}.blocked_shape"], [f"{p}.blocked"], name=f"{p}.reshape"),
                helper.make_node("ReduceSum", [f"{p}.blocked", axes], [p], name=p, keepdims=0)])
            self.block_sums[key] = p
        return self.block_sums[key]

    def apply(self) -> int:
        """Swap the queued nodes in, in place of their MatMuls (block sums right before their first reader)."""
        graph = self.model.graph
        result, placed = [], set()
        for node in graph.node:
            key = node.name or node.output[0]
            if key not in self.new_nodes:
                result.append(node)
                continue
            for extra in self._sums_for(node.input[0]):
                if extra.name not in placed:
                    placed.add(extra.name)
                    result.append(extra)
            result.extend(self.new_nodes[key])
        del graph.node[:]
        graph.node.extend(result)
        prune(self.model)
        return len(self.new_nodes)

    def _sums_for(self, x: str) -> list[onnx.NodeProto]:
        return [n for n in self.pending if n.name.startswith(f"{x}.blocksum")]


def _used_names(graph: onnx.GraphProto) -> set[str]:
    """Every name a node of the graph, or of a subgraph in its attributes, reads; and the graph's outputs."""
    used = {o.name for o in graph.output}
    for node in graph.node:
        used.update(node.input)
        for attr in node.attribute:
            for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
                used |= _used_names(sub)
    return used


def prune(model: onnx.ModelProto) -> None:
    """Drop pass-through nodes nothing reads and initializers nothing reads."""
    graph = model.graph
    while True:
        used = _used_names(graph)
        dead = [n for n in graph.node if n.op_type in PASS_THROUGH and not any(o in used for o in n.output)]
        if not dead:
            break
        for n in dead:
            graph.node.remove(n)
    used = _used_names(graph)
    keep = [i for i in graph.initializer if i.name in used]
    del graph.initializer[:]
    graph.initializer.extend(keep)


def vocab_matmul_output(model: onnx.ModelProto, vocab: int) -> str:
    """Name of the tensor the LM head writes (the logits): the last MatMul by a constant [K, vocab] weight (shapes
    only, no weight is read). A graph quantized by NBitsWriter keeps that name for the same tensor."""
    found = None
    for w in constant_matmul_weights(model):
        if w.shape[1] == vocab:
            found = w.node.output[0]
    if found is None:
        raise ValueError(f"no MatMul with {vocab} outputs (the LM head) in graph {model.graph.name!r}")
    return found


def nbits_model(w: NBitsWeight, accuracy_level: int = 0) -> onnx.ModelProto:
    """A one-MatMul model Y = A W^T with W held as NBitsWriter writes it (A: [M, K], Y: [M, N])."""
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["A", "W"], ["Y"], name="matmul")], "nbits",
        [helper.make_tensor_value_info("A", onnx.TensorProto.FLOAT, ["M", w.cols])],
        [helper.make_tensor_value_info("Y", onnx.TensorProto.FLOAT, ["M", w.rows])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MS_DOMAIN, 1)])
    writer = NBitsWriter(model, accuracy_level)
    writer.replace(model.graph.node[0], w)
    writer.apply()
    return model


def probe_weight(w: NBitsWeight) -> np.ndarray:
    """[N, K]: the weight ONNX Runtime's MatMulNBits kernel (fp32 activations) actually multiplies by, read back
    by multiplying the identity."""
    session = ort.InferenceSession(nbits_model(w).SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"A": np.eye(w.cols, dtype=np.float32)})[0].T
