"""Trace one decoder layer and stamp it once per layer.

torch.onnx spends most of an export tracing and decomposing the decoder layers, which are the same code on other
weights: 58 s of the Qwen3-0.6B verifier's export went to torch.onnx, nearly all of it in its 28 layers. While
the graph is traced, each layer's `layer_step` becomes one `dspark.stamp::Layer` node whose inputs are the step's
tensors and then the layer's own weights. The first layer is traced on its own into an ONNX function with its
weights as inputs, and every call is then inlined. Once passes.share_dim_sizes has merged the shape arithmetic each
copy computes for itself, the graph is the one a whole-model trace writes (tests/export/test_stamp.py), traced in
the time of one layer.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import onnx_ir as ir
import torch
from onnx_ir.passes.common import InlinePass
from torch import nn

from dspark.errors import DSparkError

DOMAIN = "dspark.stamp"
OP = "Layer"


@dataclass
class LayerStack:
    """Identical layers that `owner.layer_step(layer, *tensors) -> (x, k, v)` runs one at a time."""

    owner: nn.Module
    layers: nn.ModuleList
    dims: tuple[dict[int, str], ...]  # per tensor input of layer_step: axis -> dynamic dim name
    kv_len_input: int  # the tensor input whose axis 1 counts the positions of the K/V a step returns
    kv_heads: int
    head_dim: int
    op: str = OP  # the function's name: one per kind of layer (Gemma-4: sliding and full layers)
    example: tuple[torch.Tensor, ...] | None = field(default=None, repr=False)  # the first eager call's tensors
    step: Callable | None = field(default=None, repr=False)  # the owner's own layer_step, while it is stamped

    def stampable(self) -> bool:
        first = [t.shape for _, t in layer_tensors(self.layers[0])]
        return len(self.layers) > 1 and all([t.shape for _, t in layer_tensors(layer)] == first
                                            for layer in self.layers)


def layer_tensors(layer: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """A layer's own tensors, the stamped op's inputs after the step's: its parameters, then its saved buffers
    (Gemma-4's layer_scalar: a constant of the traced layer would give every copy the first layer's)."""
    saved = [(n, b) for n, b in layer.named_buffers() if n.rpartition(".")[2] not in _non_persistent(layer, n)]
    return list(layer.named_parameters()) + saved


def _non_persistent(layer: nn.Module, name: str) -> set[str]:
    owner = layer.get_submodule(name.rpartition(".")[0]) if "." in name else layer
    return owner._non_persistent_buffers_set


@contextmanager
def stamped(stacks: "LayerStack | Sequence[LayerStack] | None") -> Iterator[None]:
    """For stacks the caller found stampable (None or none: nothing to do), all of one owner, each a kind of its
    layers. Within: an eager call runs the real step (and records each stack's first call's tensors, the example
    its layer is traced on); a call under torch.onnx.export is one dspark.stamp::<stack.op> node (a layer in no
    stack is traced as it is)."""
    stacks = [stacks] if isinstance(stacks, LayerStack) else list(stacks or ())
    if not stacks:
        yield
        return
    owner = stacks[0].owner
    step = owner.layer_step
    of = {id(layer): stack for stack in stacks for layer in stack.layers}
    for stack in stacks:
        stack.step = step

    def layer_step(layer: nn.Module, *tensors: torch.Tensor):
        stack = of.get(id(layer))
        if stack is None or not torch.onnx.is_in_onnx_export():
            if stack is not None and stack.example is None:
                stack.example = tensors
            return step(layer, *tensors)
        x = tensors[0]
        kv = (x.shape[0], stack.kv_heads, tensors[stack.kv_len_input].shape[1], stack.head_dim)
        outs = torch.onnx.ops.symbolic_multi_out(
            f"{DOMAIN}::{stack.op}", (*tensors, *(t for _, t in layer_tensors(layer))), {}, dtypes=(x.dtype,) * 3,
            shapes=(x.shape, kv, kv), version=1)
        return tuple(out.to(x.device) for out in outs)  # the op's outputs are made on the default device

    owner.layer_step = layer_step
    try:
        yield
    finally:
        del owner.layer_step  # the class's own method again
        for stack in stacks:
            stack.step = None


class _OneLayer(nn.Module):
    def __init__(self, step, layer: nn.Module):
        super().__init__()
        self.step, self.layer = step, layer

    def forward(self, *tensors: torch.Tensor):
        return self.step(self.layer, *tensors)


# (set down here: the graphs record the lines of the code above, which a stamped layer runs)
TRACED_LAYER = "layer"  # the traced layer's module path inside its function: _OneLayer.layer
LAYER = "dspark.layer"  # metadata of an inlined node: its layer's module path (naming reads and removes it)


def layer_function(stack: LayerStack) -> ir.Function:
    """Trace the stack's first layer on the recorded example into dspark.stamp::Layer: the step's tensors, then
    the layer's weights, as inputs. Call within `stamped(stack)`, with the layers on the meta device."""
    if stack.example is None or stack.step is None:
        raise DSparkError("no layer step ran before the export: nothing to trace the layer on")
    one = _OneLayer(stack.step, stack.layers[0])
    cache: dict[str, torch.export.Dim] = {}
    dims = [{axis: cache.setdefault(name, torch.export.Dim(name, min=1, max=1 << 20)) for axis, name in d.items()}
            or None for d in stack.dims]
    prog = torch.onnx.export(one, stack.example, dynamo=True, dynamic_shapes=(tuple(dims),), optimize=False,
                             verbose=False, report=False)
    graph = prog.model.graph
    weights = []
    for name, param in layer_tensors(stack.layers[0]):
        value = graph.initializers.get(f"{TRACED_LAYER}.{name}")
        if value is None:  # unused by the step: still an input, so the calls line up
            value = ir.Value(name=f"{TRACED_LAYER}.{name}", shape=ir.Shape(list(param.shape)))
        else:
            del graph.initializers[value.name]
            value.const_value = None
        weights.append(value)
    for name, value in list(graph.initializers.items()):  # constants the trace lifted: a function has none
        del graph.initializers[name]
        tensor = value.const_value
        if tensor is None or isinstance(tensor, ir.Tensor) and getattr(tensor.raw, "is_meta", False):
            raise DSparkError(f"the traced layer holds a constant {name!r} with no data")
        const = ir.node("Constant", [], attributes={"value": tensor}, name=f"{name}.const")
        graph.insert_before(next(iter(graph)), const)
        ir.convenience.replace_all_uses_with(value, const.outputs[0])
        const.outputs[0].name = name
    graph.inputs.extend(weights)
    graph.name = stack.op
    return ir.Function(DOMAIN, stack.op, "", graph=graph, attributes=[])


def inline_layers(model: ir.Model, functions: "ir.Function | Sequence[ir.Function]") -> int:
    """Replace every dspark.stamp::<name> call in `model` by the body of the function of that name on that call's
    inputs. Each inlined node carries its layer's module path (metadata LAYER: the call's, found from its last
    weight's name) for dspark.export.trace.naming, which names the nodes and removes it."""
    functions = [functions] if isinstance(functions, ir.Function) else list(functions)
    calls = []
    for function in functions:
        mine = [node for node in model.graph if node.domain == DOMAIN and node.op_type == function.name]
        weight = function.inputs[-1].name  # layer.<name in the layer>; the call's: <layer's path>.<name in the layer>
        for call in mine:
            call.metadata_props[LAYER] = call.inputs[-1].name.removesuffix(weight[len(TRACED_LAYER):])
        for domain, version in function.opset_imports.items():
            model.opset_imports.setdefault(domain, version)
        model.functions[function.identifier()] = function
        calls += mine
    InlinePass(criteria=lambda f: f.domain == DOMAIN)(model)
    model.opset_imports.pop(DOMAIN, None)
    return len(calls)
