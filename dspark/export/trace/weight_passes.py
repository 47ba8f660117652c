"""Graph passes over a graph traced on the meta device: bind its weights, fold transposes and store precision
lazily, then place every large weight in the bundle's shared data file.

Every initializer carries its origin in `value.meta[ORIGIN]`: the identity of the weight it is made of plus the
transforms applied (transpose, precision), so the same bytes wanted by two graphs are written once.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import onnx_ir as ir
import torch

from dspark.errors import DSparkError
from dspark.export.trace.weights import INLINE_BYTES, IR, WeightStore, to_numpy
from dspark.models.tensors import stored_low

ORIGIN = "dspark.origin"
READ = "dspark.read"  # value.meta: () -> torch.Tensor, the initializer's data before its cast to the value's dtype
TORCH_OF = {ir.DataType.FLOAT: torch.float32, ir.DataType.FLOAT16: torch.float16, ir.DataType.BFLOAT16: torch.bfloat16}


def _bind(value: ir.Value, read: Callable[[], torch.Tensor]) -> None:
    """value's data becomes read() cast to value's dtype, computed when it is written. Transposes and precision
    changes compose on `read` in torch, at the checkpoint's own dtype: a bf16 matrix bound for a bf16 bundle is
    transposed as bf16 and never widened."""
    value.meta[READ] = read
    dtype, shape = TORCH_OF.get(value.dtype), [int(d) for d in value.shape]

    def make() -> ir.Tensor:
        t = read()
        return ir.tensor(to_numpy(t.to(dtype) if dtype is not None else t), name=value.name)

    value.const_value = ir.LazyTensor(make, value.dtype, ir.Shape(shape), name=value.name)


def _read(value: ir.Value) -> Callable[[], torch.Tensor]:
    if READ in value.meta:
        return value.meta[READ]
    tensor = value.const_value  # a constant the exporter or the optimizer made: small, in memory
    return lambda: torch.from_numpy(np.array(tensor.numpy()))


def _origin(value: ir.Value) -> tuple:
    """What `value` is made of. A constant the exporter made is no weight and is never shared: another graph's
    "arange_1" is another tensor."""
    return value.meta.setdefault(ORIGIN, ("constant", object()))


def bind_weights(model: ir.Model, values: dict[str, tuple[object, Callable[[], torch.Tensor]]]) -> None:
    """Give each initializer of a meta-traced graph the tensor it stands for (read only when written)."""
    for name, value in model.graph.initializers.items():
        if name not in values:
            raise DSparkError(f"exported graph has an initializer {name!r} that is no weight of the model")
        identity, read = values[name]
        value.meta[ORIGIN] = (identity,)
        _bind(value, read)  # a bf16 checkpoint read for a graph traced in fp32 is widened only if written as fp32


def fold_transposes_lazily(model: ir.Model, keep: frozenset = frozenset()) -> int:
    """Transpose(initializer) -> a transposed initializer, computed when written: torch.onnx writes
    nn.Linear as MatMul(x, Transpose(W)), which ONNX Runtime would transpose at every load and weight-only quantizers
    (which look for MatMul with a constant B) would skip. Weights whose identity is in `keep` keep their layout: a
    tied vocabulary matrix is gathered as [V, d] by the embeddings, so its LM-head use stays Transpose(W) and the
    bundle stores the matrix once (a mapped ONNX Runtime session then transposes it at every step it is used)."""
    graph = model.graph
    folded = 0
    for node in list(graph):
        if node.op_type != "Transpose" or node.domain != "":
            continue
        src = node.inputs[0]
        if src is None or not src.is_initializer() or src.const_value is None or len(src.uses()) != 1:
            continue
        if src.meta.get(ORIGIN, (None,))[0] in keep:
            continue
        perm_attr = node.attributes.get("perm")
        rank = len(src.shape)
        perm = list(perm_attr.as_ints()) if perm_attr is not None else list(reversed(range(rank)))
        shape = [int(src.shape[p]) for p in perm]
        read = _read(src)
        new = ir.Value(name=f"{src.name}.T", shape=ir.Shape(shape), type=src.type)
        _bind(new, lambda r=read, p=perm: r().permute(p).contiguous())
        new.meta[ORIGIN] = _origin(src) + (("T", tuple(perm)),)
        graph.register_initializer(new)
        ir.convenience.replace_all_uses_with(node.outputs[0], new)
        graph.remove(node, safe=True)
        del graph.initializers[src.name]
        folded += 1
    return folded


def store_low_precision(model: ir.Model, precision: str) -> int:
    """Store weight matrices as fp16/bf16 with a Cast to fp32 where they are used: after a Gather (an embedding
    lookup: only the gathered rows are widened) or right after the weight (ONNX Runtime folds that Cast once, at
    session creation). The graph still computes in fp32. Returns the number of weights converted."""
    if precision == "fp32":
        return 0
    graph = model.graph
    converted = 0
    for name, value in list(graph.initializers.items()):
        if value.dtype != ir.DataType.FLOAT or not stored_low(value.shape) or not value.uses():
            continue
        low = ir.Value(name=f"{name}.{precision}", shape=value.shape, type=ir.TensorType(IR[precision]))
        _bind(low, _read(value))  # rounded from the source dtype (a bf16 checkpoint into a bf16 bundle: as is)
        low.meta[ORIGIN] = _origin(value) + ((precision,),)
        graph.register_initializer(low)
        widened = None
        for user, idx in list(value.uses()):
            if user.op_type == "Gather" and user.domain == "" and idx == 0:
                out = user.outputs[0]
                cast = ir.node("Cast", [out], attributes={"to": ir.DataType.FLOAT})
                cast.outputs[0].type = ir.TensorType(ir.DataType.FLOAT)
                cast.outputs[0].shape = out.shape
                for later, j in list(out.uses()):
                    if later is not cast:
                        later.replace_input_with(j, cast.outputs[0])
                if out in graph.outputs:
                    graph.outputs[graph.outputs.index(out)] = cast.outputs[0]
                user.replace_input_with(0, low)
                out.type = ir.TensorType(IR[precision])
                graph.insert_after(user, cast)
                continue
            if widened is None:
                cast = ir.node("Cast", [low], attributes={"to": ir.DataType.FLOAT})
                cast.outputs[0].type = ir.TensorType(ir.DataType.FLOAT)
                cast.outputs[0].shape = value.shape
                graph.insert_before(_first_user(graph, value), cast)  # alive only while it is used
                widened = cast.outputs[0]
            user.replace_input_with(idx, widened)
        del graph.initializers[name]
        converted += 1
    return converted


def _first_user(graph: ir.Graph, value: ir.Value) -> ir.Node:
    users = {id(node) for node, _ in value.uses()}
    return next(node for node in graph if id(node) in users)


def place_weights(model: ir.Model, store: WeightStore) -> None:
    """Write every initializer of INLINE_BYTES or more into the store (deduplicated by origin) and make the graph
    refer to it there; smaller ones are materialized inside the graph file."""
    for name, value in list(model.graph.initializers.items()):
        tensor = value.const_value
        shape = [int(d) for d in value.shape]
        nbytes = int(np.prod(shape, dtype=np.int64)) * tensor.dtype.itemsize
        if nbytes < INLINE_BYTES:
            value.const_value = ir.tensor(tensor.numpy(), name=name)
            continue
        key = _origin(value) + ((str(tensor.dtype),),)
        value.const_value = store.place(key, tensor.numpy, tensor.dtype, shape, name)
