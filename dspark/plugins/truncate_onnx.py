"""The body of dspark::ConfidenceTruncate as an ONNX function (ONNX Runtime runs it; TensorRT swaps in the plugin)."""
from __future__ import annotations

from onnxscript import BOOL, FLOAT, INT64, opset20 as op, script
from onnxscript.values import Opset

DOMAIN = "dspark"
OP_NAME = "ConfidenceTruncate"
OP_VERSION = 1
dspark_opset = Opset(DOMAIN, OP_VERSION)


@script(opset=dspark_opset, default_opset=op)
def ConfidenceTruncate(survival: FLOAT, threshold: FLOAT) -> tuple[INT64, BOOL]:
    keep = op.GreaterOrEqual(survival, op.Unsqueeze(threshold, op.Constant(value_ints=[1])))
    dropped = op.CumSum(op.Cast(op.Not(keep), to=FLOAT.dtype), op.Constant(value_int=1))
    verify_mask = op.Equal(dropped, op.Constant(value_float=0.0))
    verify_len = op.ReduceSum(op.Cast(verify_mask, to=INT64.dtype), op.Constant(value_ints=[1]), keepdims=0)
    return verify_len, verify_mask


def attach_functions(model) -> None:
    """Give an onnx_ir Model that calls dspark ops their function bodies, so ONNX Runtime can run them."""
    import onnx_ir as ir

    used = {node.op_type for node in model.graph.all_nodes() if node.domain == DOMAIN}
    if not used:
        return
    if OP_NAME in used and (DOMAIN, OP_NAME, "") not in model.functions:
        fn = ir.serde.deserialize_function(ConfidenceTruncate.to_function_proto())
        model.functions[fn.identifier()] = fn
    model.opset_imports[DOMAIN] = OP_VERSION
