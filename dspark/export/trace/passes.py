"""Graph clean-ups applied to the exported models (onnx-ir), cheap enough to run on every export."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx_ir as ir
from onnx_ir.passes import common
from onnxscript.optimizer import constant_folding


FOLD_INPUT_ELEMENTS = 1 << 16


def share_dim_sizes(model: ir.Model) -> int:
    """Read each named dynamic dimension's size from one graph input: every Shape(v, start=k, end=k + 1) whose
    axis k is a named symbolic dim becomes that one value, so the shape arithmetic built on it is shared (common
    subexpression elimination then merges it). A layer traced on its own reads batch and capacity from its own
    inputs; stamped once per layer, that would be ~16 shape nodes per layer that a whole-model trace shares.
    Returns the number of Shape nodes replaced."""
    graph = model.graph
    source: dict[str, tuple[ir.Value, int]] = {}
    for value in graph.inputs:
        for axis, dim in enumerate(value.shape or ()):
            if isinstance(dim, ir.SymbolicDim) and dim.value is not None:
                source.setdefault(dim.value, (value, axis))
    shared: dict[str, ir.Value] = {}
    replaced = 0
    for node in list(graph):
        if node.op_type != "Shape" or node.domain != "" or node.inputs[0] is None or node.inputs[0].shape is None:
            continue
        start, end = node.attributes.get("start"), node.attributes.get("end")
        if start is None or end is None or end.as_int() != start.as_int() + 1 or start.as_int() < 0:
            continue
        shape = node.inputs[0].shape
        dim = shape[start.as_int()] if start.as_int() < len(shape) else None
        if not isinstance(dim, ir.SymbolicDim) or dim.value not in source:
            continue
        if dim.value not in shared:
            value, axis = source[dim.value]
            first = ir.node("Shape", [value], attributes={"start": axis, "end": axis + 1},
                            name=f"dims/{dim.value}/Shape")
            first.outputs[0].shape, first.outputs[0].type = ir.Shape([1]), ir.TensorType(ir.DataType.INT64)
            graph.insert_before(next(iter(graph)), first)
            shared[dim.value] = first.outputs[0]
        if node.outputs[0] is not shared[dim.value]:
            ir.convenience.replace_all_uses_with(node.outputs[0], shared[dim.value])
            graph.remove(node, safe=True)
            replaced += 1
    return replaced


def optimize_graph(model: ir.Model) -> None:
    """Constant folding and clean-up without inlining, so dspark functions stay calls: onnxscript's optimizer
    pipeline minus its pattern rewriter. On the SmolLM2 verifier the rewriter took 40 of 42 s and removed 7 of
    2287 nodes (3 Reshape, 2 Unsqueeze, a Squeeze and a Concat), which ONNX Runtime and TensorRT eliminate too.

    Runs after the weight passes, so no large initializer needs folding: the size limits keep it fast. A large
    Transpose(initializer) still there was kept on purpose (a tied vocabulary matrix, stored once in its gathered
    layout), so the optimizer's rule of always folding a weight's only Transpose is turned off for those.
    This turns CastLike of constants and computed axes into initializers, which the TensorRT parser requires."""

    def should_fold(node: ir.Node) -> bool | None:
        if node.op_type == "Transpose" and node.domain == "":
            src = node.inputs[0]
            if src is not None and src.const_value is not None and src.const_value.size > FOLD_INPUT_ELEMENTS:
                return False
        return None

    fold = constant_folding.FoldConstantsPass(shape_inference=True, input_size_limit=FOLD_INPUT_ELEMENTS,
                                              output_size_limit=1 << 20, should_fold=should_fold)
    share_dim_sizes(model)
    ir.passes.Sequential(
        ir.passes.PassManager([fold, common.RemoveUnusedNodesPass(), common.RemoveUnusedFunctionsPass(),
                               common.RemoveUnusedOpsetsPass()], steps=2, early_stop=True),
        common.RemoveUnusedNodesPass(),
        common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
        common.LiftSubgraphInitializersToMainGraphPass(),
        common.DeduplicateInitializersPass(),
        common.CommonSubexpressionEliminationPass(),
        common.OutputFixPass(),
        common.NameFixPass(),
    )(model)


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
        stored = _stored_at(weight, elem)
        if stored is not None:  # a bundle that stores this weight at `dtype` already: use it as it is
            low, weight = stored, None
        elif weight is None or not weight.is_initializer() or weight.const_value is None:
            continue
        elif weight.const_value.dtype != ir.DataType.FLOAT or len(weight.uses()) != 1:
            continue
        else:
            low = ir.Value(name=f"{weight.name}.{dtype}", shape=weight.shape, type=ir.TensorType(elem),
                           const_value=ir.tensor(weight.const_value.numpy().astype(np_type),
                                                 name=f"{weight.name}.{dtype}"))
            graph.register_initializer(low)
        cast_in = ir.node("Cast", [node.inputs[0]], attributes={"to": elem}, name=f"{node.name}/cast_in")
        graph.insert_before(node, cast_in)
        node.replace_input_with(0, cast_in.outputs[0])
        node.replace_input_with(1, low)
        if node.op_type == "Gemm" and len(node.inputs) > 2 and node.inputs[2] is not None:
            bias = node.inputs[2]
            cast_bias = ir.node("Cast", [bias], attributes={"to": elem}, name=f"{node.name}/cast_bias")
            graph.insert_before(node, cast_bias)
            node.replace_input_with(2, cast_bias.outputs[0])
        out = node.outputs[0]
        out.type = ir.TensorType(elem)
        cast_out = ir.node("Cast", [out], attributes={"to": ir.DataType.FLOAT}, name=f"{node.name}/cast_out")
        cast_out.outputs[0].type = ir.TensorType(ir.DataType.FLOAT)
        cast_out.outputs[0].shape = out.shape
        graph.insert_after(node, cast_out)
        for user, idx in list(out.uses()):
            if user is not cast_out:
                user.replace_input_with(idx, cast_out.outputs[0])
        if out in graph.outputs:  # (the verifier's logits) the fp32 product keeps the output's name
            name, out.name = out.name, f"{out.name}.{dtype}"
            cast_out.outputs[0].name = name
            graph.outputs[graph.outputs.index(out)] = cast_out.outputs[0]
        if weight is not None:
            del graph.initializers[weight.name]
        else:
            _drop_unused_casts(graph)
        converted += 1
    return converted


def _drop_unused_casts(graph: ir.Graph) -> None:
    for cast in [n for n in graph if n.op_type == "Cast" and not n.outputs[0].uses()
                 and n.outputs[0] not in graph.outputs]:
        graph.remove(cast, safe=True)


def _stored_at(weight: ir.Value | None, elem: ir.DataType) -> ir.Value | None:
    """The `elem` initializer behind weight = Cast(initializer, to=float) (a fp16/bf16 bundle), else None."""
    cast = weight.producer() if weight is not None else None
    if cast is None or cast.op_type != "Cast" or cast.domain != "":
        return None
    src = cast.inputs[0]
    if src is None or not src.is_initializer() or src.dtype != elem:
        return None
    return src
