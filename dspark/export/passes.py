"""Graph clean-ups applied to the exported models (onnx-ir), cheap enough to run on every export."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx_ir as ir
import onnxscript.optimizer


def fold_weight_transposes(model: ir.Model) -> int:
    """Replace Transpose(initializer) by a transposed initializer, so MatMuls read weights directly.

    torch.onnx writes nn.Linear as MatMul(x, Transpose(W)); ONNX Runtime then transposes every weight at load,
    and weight-only quantizers, which look for MatMul with a constant B, skip them. Returns the count folded.
    """
    graph = model.graph
    folded = 0
    for node in list(graph):
        if node.op_type != "Transpose" or node.domain != "":
            continue
        src = node.inputs[0]
        if src is None or not src.is_initializer() or src.const_value is None:
            continue
        if len(src.uses()) != 1:
            continue
        perm_attr = node.attributes.get("perm")
        array = src.const_value.numpy()
        perm = list(perm_attr.as_ints()) if perm_attr is not None else list(reversed(range(array.ndim)))
        out = node.outputs[0]
        new = ir.Value(name=f"{src.name}.T", shape=ir.Shape([array.shape[p] for p in perm]), type=src.type,
                       const_value=ir.tensor(np.ascontiguousarray(array.transpose(perm)), name=f"{src.name}.T"))
        graph.register_initializer(new)
        ir.convenience.replace_all_uses_with(out, new)
        graph.remove(node, safe=True)
        del graph.initializers[src.name]
        folded += 1
    return folded


def optimize_graph(model: ir.Model) -> None:
    """Constant folding and clean-up (onnxscript's optimizer) without inlining, so dspark functions stay calls.

    Runs after fold_weight_transposes, so no large initializer needs folding: the size limits keep it fast.
    This turns CastLike of constants and computed axes into initializers, which the TensorRT parser requires."""

    onnxscript.optimizer.optimize(model, inline=False, input_size_limit=1 << 16, output_size_limit=1 << 20)


def cast_matmuls(model: ir.Model, dtype: str) -> int:
    """Run MatMul/Gemm with constant weights in fp16/bf16: weights stored in that type, activations cast on the
    way in and the product cast back to fp32. For strongly typed TensorRT networks (TensorRT 11), where precision
    comes from the graph's types; everything else (norms, softmax, sampling, acceptance) stays fp32.
    Returns the number of matmuls converted."""

    elem = {"fp16": ir.DataType.FLOAT16, "bf16": ir.DataType.BFLOAT16}[dtype]
    np_type = {"fp16": np.float16, "bf16": ml_dtypes.bfloat16}[dtype]
    graph = model.graph
    converted = 0
    for node in list(graph):
        if node.op_type not in ("MatMul", "Gemm") or node.domain != "":
            continue
        weight = node.inputs[1]
        if weight is None or not weight.is_initializer() or weight.const_value is None:
            continue
        if weight.const_value.dtype != ir.DataType.FLOAT or len(weight.uses()) != 1:
            continue
        low = ir.Value(name=f"{weight.name}.{dtype}", shape=weight.shape, type=ir.TensorType(elem),
                       const_value=ir.tensor(weight.const_value.numpy().astype(np_type), name=f"{weight.name}.{dtype}"))
        graph.register_initializer(low)
        cast_in = ir.node("Cast", [node.inputs[0]], attributes={"to": elem})
        graph.insert_before(node, cast_in)
        node.replace_input_with(0, cast_in.outputs[0])
        node.replace_input_with(1, low)
        if node.op_type == "Gemm" and len(node.inputs) > 2 and node.inputs[2] is not None:
            bias = node.inputs[2]
            cast_bias = ir.node("Cast", [bias], attributes={"to": elem})
            graph.insert_before(node, cast_bias)
            node.replace_input_with(2, cast_bias.outputs[0])
        out = node.outputs[0]
        out.type = ir.TensorType(elem)
        cast_out = ir.node("Cast", [out], attributes={"to": ir.DataType.FLOAT})
        cast_out.outputs[0].type = ir.TensorType(ir.DataType.FLOAT)
        cast_out.outputs[0].shape = out.shape
        graph.insert_after(node, cast_out)
        for user, idx in list(out.uses()):
            if user is not cast_out:
                user.replace_input_with(idx, cast_out.outputs[0])
        if out in graph.outputs:
            graph.outputs[graph.outputs.index(out)] = cast_out.outputs[0]
        del graph.initializers[weight.name]
        converted += 1
    return converted
