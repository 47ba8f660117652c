"""Node names of the traced graphs: where each node belongs, as a path.

torch.onnx records the module path of the code each node comes from (the node's `pkg.torch.onnx.name_scopes`
metadata: the enclosing modules' paths, then the FX node's name). A node is named after the innermost module, its
path's dots made slashes (a layer index stays with its list), then its operator:

    target.layers.3.mlp.up_proj  (aten.linear)  ->  target/layers.3/mlp/up_proj/MatMul

A node of a stamped layer (dspark.export.stamp) takes its layer's path from the call it was inlined from (the
traced layer knows itself as `layer`); code outside any module is the graph's own (verifier/ArgMax); a node a pass
made and named keeps its name (dims/batch/Shape); one made and left unnamed takes the scope of the node it reads,
else of its first reader, else the graph's. A name already taken gets _1, _2, ... in graph order, so names are
unique and the same on every export.
"""
from __future__ import annotations

import ast

import onnx_ir as ir

from dspark.export.stamp import LAYER, TRACED_LAYER
from dspark.export.twins.graph_copy import UniqueNames

SCOPES = "pkg.torch.onnx.name_scopes"
NO_MODULE = "_empty_nn_module_stack_from_metadata_hook"


def module_path(path: str) -> str:
    """target.layers.3.mlp -> target/layers.3/mlp"""
    parts: list[str] = []
    for part in path.split("."):
        if part.isdigit() and parts:
            parts[-1] += f".{part}"
        else:
            parts.append(part)
    return "/".join(parts)


def _traced_scope(node: ir.Node, root: str) -> str | None:
    """The scope torch.onnx (and the stamped layer) recorded for the node; None for a node made by a pass."""
    layer = node.metadata_props.pop(LAYER, None)
    recorded = node.metadata_props.get(SCOPES)
    if recorded is None:
        return None
    modules = [s for s in ast.literal_eval(recorded)[:-1] if s and s != NO_MODULE]
    inner = modules[-1] if modules else None
    if layer is not None:
        within = inner is not None and (inner == TRACED_LAYER or inner.startswith(f"{TRACED_LAYER}."))
        inner = layer + inner[len(TRACED_LAYER):] if within else layer
    return module_path(inner) if inner else root


def _borrowed_scope(node: ir.Node, scopes: dict[ir.Node, str]) -> str | None:
    """The scope of the node this one reads, else of its first reader."""
    for value in node.inputs:
        if value is not None and value.producer() in scopes:
            return scopes[value.producer()]
    for value in node.outputs:
        for use in value.uses():
            if use.node in scopes:
                return scopes[use.node]
    return None


def name_nodes(model: ir.Model, root: str) -> None:
    """Name every node of the model's graph (and of its subgraphs) by where it belongs; root: the scope of the
    graph's own code (its file's stem: verifier, draft, heads). Function bodies' nodes are named after their
    function."""
    names = UniqueNames()
    nodes = list(model.graph.all_nodes())
    traced = {node: scope for node in nodes if (scope := _traced_scope(node, root)) is not None}
    for node in nodes:
        if node in traced:
            node.name = names(f"{traced[node]}/{node.op_type}")
        elif node.name and "/" in node.name:
            node.name = names(node.name)
        else:
            node.name = names(f"{_borrowed_scope(node, traced) or root}/{node.op_type}")
    for function in model.functions.values():
        in_function = UniqueNames()
        for node in function:
            node.name = in_function(f"{function.name}/{node.op_type}")
