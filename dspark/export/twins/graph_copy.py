"""Reading a graph's structure and copying parts of it into a new graph (onnx_ir; no weight is read)."""
from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np
import onnx_ir as ir

from dspark.errors import DSparkError

PASS = ("Transpose", "Cast", "Identity", "Reshape")
# a tensor of the new graph this size or larger goes to its own data file: onnx.save(size_threshold=1024), which
# wrote the fused graph before, compared sys.getsizeof of the bytes (33 more than their length) with the threshold
OWN_DATA_BYTES = 1024 - sys.getsizeof(b"")


class GraphIndex:
    """The values of a graph by name, and the constants behind them."""

    def __init__(self, model: ir.Model):
        self.model, self.graph = model, model.graph
        self.values = {v.name: v for v in (*self.graph.inputs, *self.graph.initializers.values())}
        self.values.update((o.name, o) for node in self.graph for o in node.outputs if o.name)

    def root(self, value: ir.Value) -> ir.Value:
        """The initializer a value is a pass-through chain of (or the value itself)."""
        while not value.is_initializer() and value.producer() is not None and value.producer().op_type in PASS:
            value = value.producer().inputs[0]
        return value

    def constant(self, value: ir.Value) -> np.ndarray | None:
        value = self.root(value)
        if value.is_initializer():
            tensor = value.const_value
            return None if isinstance(tensor, ir.ExternalTensor) else tensor.numpy()
        node = value.producer()
        if node is not None and node.op_type == "Constant":
            return ir.convenience.get_const_tensor(value).numpy()
        return None

    @staticmethod
    def consumers(value: ir.Value) -> list[ir.Node]:
        """The nodes reading `value`, once per input they read it as."""
        return [use.node for use in value.uses()]


def described(value: ir.Value, like: ir.Value) -> ir.Value:
    """`value` with the type, shape, doc string and metadata of `like`; returns `value`."""
    value.type, value.shape, value.doc_string = like.type, like.shape, like.doc_string
    value.metadata_props.update(like.metadata_props)
    return value


def take_over(old: ir.Value, new: ir.Value) -> None:
    """`new` in place of `old` wherever a node or the graph's outputs read it, under its name and description."""
    ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)
    name, old.name = old.name, None
    described(new, old).name = name


class UniqueNames:
    """Names asked for, made unique in the order they are asked for: a name taken already gets _1, _2, ..."""

    def __init__(self, taken=()):
        self.taken: set[str] = set(taken)

    def __call__(self, wanted: str) -> str:
        name, k = wanted, 0
        while name in self.taken:
            k += 1
            name = f"{wanted}_{k}"
        self.taken.add(name)
        return name


class GraphBuilder:
    """Copies parts of the old graph into the new one, with some old values replaced by new ones.

    A node it makes is named by the scopes it is made in and its operator (fused/layers.3/attn/GroupQueryAttention),
    a node it copies by its name in the old graph under fused/ (fused/target/embed_tokens/Gather); a name already
    taken gets _1, _2, ... Values are named fused/<hint>_<n>, n counting the values and nodes made so far."""

    def __init__(self, g: GraphIndex):
        self.g = g
        self.nodes: list[ir.Node] = []
        self.inits: dict[str, ir.Value] = {}
        self.inputs = {v.name: described(ir.Value(name=v.name), v) for v in g.graph.inputs}
        self.copied: dict[tuple[ir.Value, str], ir.Value] = {}
        self.named: dict[str, ir.Value] = {}
        self.counter = 0
        self.scopes = ["fused"]
        self.node_name = UniqueNames()

    def name(self, hint: str) -> str:
        self.counter += 1
        return f"fused/{hint}_{self.counter}"

    @contextmanager
    def scope(self, name: str) -> Iterator[None]:
        """Nodes made within are named under `name` (inside the scopes already open)."""
        self.scopes.append(name)
        try:
            yield
        finally:
            self.scopes.pop()

    def add(self, op: str, inputs: list[ir.Value | None], n_out: int = 1, domain: str = "",
            names: list[str] | None = None, **attrs) -> list[ir.Value]:
        outs = names or [self.name(op.lower()) for _ in range(n_out)]
        self.counter += 1  # (a node takes a number too)
        node = ir.node(op, inputs, dict(sorted(attrs.items())), domain=domain, num_outputs=len(outs),
                       name=self.node_name("/".join([*self.scopes, op])))
        for value, name in zip(node.outputs, outs):
            value.name = name
            self.named[name] = value
        self.nodes.append(node)
        return list(node.outputs)

    def const(self, array: np.ndarray, hint: str) -> ir.Value:
        name = self.name(hint)
        self.inits[name] = ir.Value(name=name, const_value=ir.tensor(array, name=name))
        return self.inits[name]

    def input(self, name: str, shape: list | None = None) -> ir.Value:
        """The new graph's input `name`: one of the old graph's, or (given its shape) a new float input."""
        if shape is not None and name not in self.inputs:
            self.inputs[name] = ir.Value(name=name, type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(shape))
        return self.inputs[name]

    def copy(self, value: ir.Value | None, subst: dict[ir.Value, ir.Value], tag: str) -> ir.Value | None:
        """The new value of old `value`, copying the nodes it is computed by; `subst` maps old values to new ones,
        graph inputs and initializers are shared."""
        if value is None or value in subst:
            return subst[value] if value is not None else None
        if value.is_graph_input():
            return self.inputs[value.name]
        if value.is_initializer():
            if value.name not in self.inits:  # (the file describes the tensor once, in the initializer)
                self.inits[value.name] = ir.Value(name=value.name, const_value=value.const_value)
            return self.inits[value.name]
        key = (value, tag)
        if key not in self.copied:
            self._copy_node(value, subst, tag)
        return self.copied[key]

    def _copy_node(self, value: ir.Value, subst: dict[ir.Value, ir.Value], tag: str) -> None:
        node = value.producer()
        if node is None:
            raise DSparkError(f"fused verifier: cannot trace {value.name!r} in the portable graph")
        inputs = [self.copy(i, subst, tag) for i in node.inputs]
        attributes = [ir.Attr(a.name, a.type, a.value, doc_string=a.doc_string) for a in node.attributes.values()]
        name = self.node_name(f"fused/{node.name or node.outputs[0].name}")
        clone = ir.Node(node.domain, node.op_type, inputs, attributes, overload=node.overload,
                        num_outputs=len(node.outputs), name=name, doc_string=node.doc_string,
                        metadata_props=dict(node.metadata_props))
        for old, new in zip(node.outputs, clone.outputs):
            new.name = f"{old.name}@{tag}" if old.name else ""
            self.copied[(old, tag)] = new
        self.nodes.append(clone)


def write_own_data(model: ir.Model, folder: Path, location: str) -> bool:
    """Move every tensor of OWN_DATA_BYTES or more that the graph holds in memory into `location` (in `folder`),
    one after the other, as onnx.save's external data writer lays them out; the tensors already in data files stay
    where they are. Returns whether the file was written."""
    moving = [v for v in model.graph.initializers.values()
              if not isinstance(v.const_value, ir.ExternalTensor) and v.const_value.nbytes >= OWN_DATA_BYTES]
    if not moving:
        return False
    with open(folder / location, "wb") as f:
        for value in moving:
            tensor, offset = value.const_value, f.tell()
            f.write(tensor.tobytes())
            value.const_value = ir.ExternalTensor(location, offset, f.tell() - offset, tensor.dtype,
                                                  shape=ir.Shape(tensor.shape.numpy()), name=value.name,
                                                  base_dir=folder)
    return True
