"""Static lint of a bundle's graphs against the TensorRT 10 ONNX parser's operator support.

The rules are our summary of onnx-tensorrt's support matrix for TensorRT 10.x (docs/operators.md in
onnx/onnx-tensorrt): which operators parse, which element types an operator accepts, and which inputs must be
build-time constants. dspark-domain nodes are fine when a plugin of that name ships with dspark (TensorRT uses the
plugin; the function body is only for ONNX Runtime). Runtime-specific contrib ops (com.microsoft) are flagged.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import onnx

from dspark.bundle import GRAPHS, Manifest
from dspark.integrity import read_onnx

FLOATS = {"FLOAT", "FLOAT16", "BFLOAT16"}
INTS = {"INT32", "INT64"}
ANY = FLOATS | INTS | {"BOOL", "UINT8", "INT8"}

# op -> element types accepted on the first input (None: not checked)
SUPPORTED: dict[str, set[str] | None] = {
    **{op: FLOATS | INTS for op in ("Abs", "Add", "Sub", "Mul", "Div", "Neg", "Max", "Min", "Mod", "Equal", "Greater",
                                    "GreaterOrEqual", "Less", "LessOrEqual", "ArgMax", "ArgMin", "Range", "ReduceMax",
                                    "ReduceMin", "ReduceMean", "ReduceSum", "ReduceProd", "Sign", "IsNaN")},
    **{op: FLOATS for op in ("CumSum", "Exp", "Log", "Sqrt", "Pow", "Reciprocal", "Sigmoid", "Tanh", "Softplus",
                             "Softmax", "LogSoftmax", "MatMul", "Gemm", "Erf", "Sin", "Cos", "Clip", "Relu",
                             "LeakyRelu", "Gelu", "HardSigmoid", "Floor", "Ceil", "Round", "ReduceL2",
                             "ReduceLogSumExp", "LayerNormalization")},
    **{op: ANY for op in ("Cast", "Concat", "Constant", "ConstantOfShape", "Expand", "Gather", "GatherElements",
                          "GatherND", "Identity", "Reshape", "Shape", "Size", "Slice", "Split", "Squeeze",
                          "Unsqueeze", "Transpose", "Tile", "Trilu", "Where", "Flatten", "ScatterND",
                          "ScatterElements", "OneHot", "Pad", "TopK", "If", "Loop", "NonZero")},
    **{op: {"BOOL"} for op in ("Not", "And", "Or", "Xor")},
}
UNSUPPORTED_NOTE = {
    "Multinomial": "no TensorRT support; sample by inverse CDF with noise inputs",
    "RandomNormal": "no TensorRT support", "Unique": "no TensorRT support", "StringNormalizer": "strings",
    "SequenceConstruct": "sequence types are not supported", "SequenceAt": "sequence types are not supported",
    "SplitToSequence": "sequence types are not supported", "ConcatFromSequence": "sequence types are not supported",
}
# op -> input positions that must be initializers / constants at build time
CONSTANT_INPUTS = {"CumSum": (1,), "ReduceSum": (1,), "ReduceMean": (1,), "ReduceMax": (1,), "ReduceMin": (1,),
                   "ReduceProd": (1,), "Squeeze": (1,), "Unsqueeze": (1,), "Slice": (3,), "TopK": (1,),
                   "OneHot": (1,)}
PLUGINS = {("dspark", "ConfidenceTruncate")}


@dataclass
class LintFinding:
    graph: str
    node: str
    op: str
    problem: str


def _elem_types(model: onnx.ModelProto) -> dict[str, str]:
    try:
        inferred = onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False)
    except Exception:  # inference is best effort; unknown types are simply not checked
        inferred = model
    g = inferred.graph
    types = {}
    for vi in list(g.value_info) + list(g.input) + list(g.output):
        if vi.type.HasField("tensor_type"):
            types[vi.name] = onnx.TensorProto.DataType.Name(vi.type.tensor_type.elem_type)
    for init in g.initializer:
        types[init.name] = onnx.TensorProto.DataType.Name(init.data_type)
    return types


def _constants(graph: onnx.GraphProto) -> set[str]:
    names = {i.name for i in graph.initializer}
    names |= {o for n in graph.node if n.op_type == "Constant" for o in n.output}
    return names


def lint_model(model: onnx.ModelProto, graph_name: str) -> list[LintFinding]:
    findings: list[LintFinding] = []
    types = _elem_types(model)
    consts = _constants(model.graph)
    local = {(f.domain, f.name) for f in model.functions}
    for node in model.graph.node:
        where = node.name or node.output[0]
        if node.domain not in ("", "ai.onnx"):
            if (node.domain, node.op_type) in PLUGINS:
                if (node.domain, node.op_type) not in local:
                    findings.append(LintFinding(graph_name, where, f"{node.domain}::{node.op_type}",
                                                "no function body: ONNX Runtime could not run it"))
                continue
            findings.append(LintFinding(graph_name, where, f"{node.domain}::{node.op_type}",
                                        "custom-domain op without a dspark TensorRT plugin"))
            continue
        if node.op_type not in SUPPORTED:
            note = UNSUPPORTED_NOTE.get(node.op_type, "not in TensorRT 10's ONNX operator support")
            findings.append(LintFinding(graph_name, where, node.op_type, note))
            continue
        allowed = SUPPORTED[node.op_type]
        if allowed and node.input and node.input[0] in types and types[node.input[0]] not in allowed:
            findings.append(LintFinding(graph_name, where, node.op_type,
                                        f"input type {types[node.input[0]]} not supported "
                                        f"(allowed: {', '.join(sorted(allowed))})"))
        for pos in CONSTANT_INPUTS.get(node.op_type, ()):
            if len(node.input) > pos and node.input[pos] and node.input[pos] not in consts:
                findings.append(LintFinding(graph_name, where, node.op_type,
                                            f"input {pos} ({node.input[pos]}) must be a build-time constant"))
    return findings


def lint_bundle(bundle: Path, manifest: Manifest | None = None) -> list[LintFinding]:
    manifest = manifest or Manifest.read_checked(bundle)
    out = []
    # the portable graphs (their ONNX Runtime twins are its own), and the sampler where the bundle has one
    for name in (*GRAPHS, *(["sampler"] if "sampler" in manifest.graphs else [])):
        spec = manifest.graphs[name]
        model = read_onnx(Manifest.path(bundle, spec.file), f"{spec.file} ({name} graph)")
        out += lint_model(model, name)
    return out
