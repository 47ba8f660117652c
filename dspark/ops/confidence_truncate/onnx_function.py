"""The body of dspark::ConfidenceTruncate as an ONNX function (ONNX Runtime runs it; TensorRT swaps in the plugin).

Same contract as dspark.ops.confidence_truncate.reference: inputs survival [B, Bk], threshold [B], sps [N], budget [1],
active [B] (bool), mode [1], layout [1]; outputs verify_len [B] int64, verify_mask [B, Bk] bool.
All three modes are computed and the requested one selected (they cost a few hundred elements).
Candidate order: TopK over the position-major flattening (index j*B + r); ONNX's TopK puts the lower index
first among equal values, which is the tie rule of the reference (smaller j, then smaller r).
"""
from __future__ import annotations

import onnx
import onnx_ir as ir
from onnx import TensorProto, helper
from onnxscript import BOOL, FLOAT, INT64, opset20 as op, script
from onnxscript.values import Opset

DOMAIN = "dspark"
OP_NAME = "ConfidenceTruncate"
OP_VERSION = 1
INPUTS = ("survival", "threshold", "sps", "budget", "active", "mode", "layout")
dspark_opset = Opset(DOMAIN, OP_VERSION)


@script(opset=dspark_opset, default_opset=op)
def ConfidenceTruncate(survival: FLOAT, threshold: FLOAT, sps: FLOAT, budget: INT64, active: BOOL, mode: INT64,
                       layout: INT64) -> tuple[INT64, BOOL]:
    zero_f = op.Constant(value_float=0.0)
    one_i = op.Constant(value_int=1)
    axis0 = op.Constant(value_ints=[0])
    axis1 = op.Constant(value_ints=[1])
    shape = op.Shape(survival)
    b = op.Gather(shape, op.Constant(value_int=0))
    bk = op.Gather(shape, op.Constant(value_int=1))
    live = op.Unsqueeze(active, axis1)

    # mode 0: static threshold on cumulative survival
    keep = op.And(op.GreaterOrEqual(survival, op.Unsqueeze(threshold, axis1)), live)
    dropped = op.CumSum(op.Cast(op.Not(keep), to=FLOAT.dtype), one_i)
    static_len = op.ReduceSum(op.Cast(op.Equal(dropped, zero_f), to=INT64.dtype), axis1, keepdims=0)

    # candidates in survival order (ties: smaller j, then smaller r)
    a = op.Where(live, survival, zero_f)
    flat = op.Reshape(op.Transpose(a, perm=[1, 0]), op.Constant(value_ints=[-1]))
    m = op.Mul(b, bk)
    values, index = op.TopK(flat, op.Reshape(m, op.Constant(value_ints=[1])), axis=0, largest=1, sorted=1)
    rows = op.Mod(index, b)
    cols = op.Div(index, b)
    valid = op.Greater(values, zero_f)
    n_live = op.ReduceSum(op.Cast(active, to=INT64.dtype), axis0, keepdims=0)
    n_live_f = op.Cast(n_live, to=FLOAT.dtype)
    # batch tokens after admitting candidates 0..i: FLAT R + i + 1, PADDED R * (1 + running max of j + 1)
    steps = op.Range(op.Constant(value_int=0), m, one_i)
    flat_cost = op.Add(op.Add(n_live, steps), one_i)
    pos = op.Add(cols, one_i)
    lower = op.LessOrEqual(op.Unsqueeze(steps, axis0), op.Unsqueeze(steps, axis1))  # [i, k]: k <= i
    running_max = op.ReduceMax(op.Where(lower, op.Unsqueeze(pos, axis0), op.Constant(value_int=0)), axis1,
                               keepdims=0)
    padded_cost = op.Mul(n_live, op.Add(running_max, one_i))
    cost = op.Where(op.Equal(layout, op.Constant(value_ints=[1])), padded_cost, flat_cost)

    table = op.Shape(sps)
    in_table = op.LessOrEqual(cost, table)
    sps_at = op.Gather(sps, op.Max(op.Min(op.Sub(cost, one_i), op.Sub(table, one_i)), op.Constant(value_int=0)))
    base_at = op.Max(op.Min(op.Sub(n_live, one_i), op.Reshape(op.Sub(table, one_i), op.Constant(value_ints=[]))),
                     op.Constant(value_int=0))
    base = op.Mul(n_live_f, op.Gather(sps, base_at))
    tau = op.Add(n_live_f, op.CumSum(values, op.Constant(value_int=0)))
    theta = op.Mul(tau, sps_at)
    previous = op.Concat(op.Reshape(base, op.Constant(value_ints=[1])), op.Slice(theta, op.Constant(value_ints=[0]),
                                                                                op.Constant(value_ints=[-1])), axis=0)
    improves = op.And(op.And(valid, in_table), op.Greater(theta, previous))
    lead = op.Equal(op.CumSum(op.Cast(op.Not(improves), to=FLOAT.dtype), op.Constant(value_int=0)), zero_f)
    # mode 2: the `budget` best candidates
    in_budget = op.And(op.Less(steps, op.Reshape(budget, op.Constant(value_ints=[-1]))), valid)

    scheduled = op.Equal(mode, op.Constant(value_ints=[1]))
    chosen = op.Or(op.And(scheduled, lead), op.And(op.Not(scheduled), in_budget))  # no bool Where in ORT
    owner = op.Equal(op.Unsqueeze(rows, axis1),
                     op.Unsqueeze(op.Range(op.Constant(value_int=0), b, one_i), axis0))  # [M, B]
    picked = op.ReduceSum(op.Cast(op.And(owner, op.Unsqueeze(chosen, axis1)), to=INT64.dtype), axis0, keepdims=0)
    verify_len = op.Where(op.Equal(mode, op.Constant(value_ints=[0])), static_len, picked)
    columns = op.Range(op.Constant(value_int=0), bk, one_i)
    verify_mask = op.Less(op.Unsqueeze(columns, axis0), op.Unsqueeze(verify_len, axis1))
    return verify_len, verify_mask


def attach_functions(model) -> None:
    """Give an onnx_ir Model that calls dspark ops their function bodies, so ONNX Runtime can run them."""

    used = {node.op_type for node in model.graph.all_nodes() if node.domain == DOMAIN}
    if not used:
        return
    if OP_NAME in used and (DOMAIN, OP_NAME, "") not in model.functions:
        fn = ir.serde.deserialize_function(ConfidenceTruncate.to_function_proto())
        model.functions[fn.identifier()] = fn
    model.opset_imports[DOMAIN] = OP_VERSION


def standalone_model(opset: int = 20):
    """A one-node ONNX model calling dspark::ConfidenceTruncate, for tests and kernel cross-checks."""

    f, i, bo = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL
    inputs = [helper.make_tensor_value_info("survival", f, ["B", "Bk"]),
              helper.make_tensor_value_info("threshold", f, ["B"]),
              helper.make_tensor_value_info("sps", f, ["N"]), helper.make_tensor_value_info("budget", i, [1]),
              helper.make_tensor_value_info("active", bo, ["B"]), helper.make_tensor_value_info("mode", i, [1]),
              helper.make_tensor_value_info("layout", i, [1])]
    outputs = [helper.make_tensor_value_info("verify_len", i, ["B"]),
               helper.make_tensor_value_info("verify_mask", bo, ["B", "Bk"])]
    node = helper.make_node(OP_NAME, list(INPUTS), ["verify_len", "verify_mask"], domain=DOMAIN)
    graph = helper.make_graph([node], "confidence_truncate", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset),
                                                    helper.make_opsetid(DOMAIN, OP_VERSION)],
                              functions=[ConfidenceTruncate.to_function_proto()])
    onnx.checker.check_model(model)
    return model
