"""Reading a graph's structure and copying parts of it into a new graph (onnx protos, no weight is read)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from dspark.errors import DSparkError

PASS = ("Transpose", "Cast", "Identity", "Reshape")


def load_skeleton(path: Path) -> onnx.ModelProto:
    """A graph without its external weights (they stay where they are); one line if it is not ONNX."""
    try:
        return onnx.load(str(path), load_external_data=False)
    except Exception as e:  # protobuf errors
        raise DSparkError(f"cannot read {path}: {str(e).splitlines()[0][:200]}") from None


class GraphIndex:
    """Producers, consumers, initializers and inputs of a graph."""

    def __init__(self, model: onnx.ModelProto):
        g = model.graph
        self.model = model
        self.inits = {t.name: t for t in g.initializer}
        self.producer = {o: n for n in g.node for o in n.output if o}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for n in g.node:
            for i in n.input:
                self.consumers.setdefault(i, []).append(n)
        self.inputs = {v.name for v in g.input}

    def root(self, name: str) -> str:
        """The initializer a value is a pass-through chain of (or the value itself)."""
        while name not in self.inits and name in self.producer and self.producer[name].op_type in PASS:
            name = self.producer[name].input[0]
        return name

    def constant(self, name: str) -> np.ndarray | None:
        name = self.root(name)
        if name in self.inits and not self.inits[name].external_data:
            return numpy_helper.to_array(self.inits[name])
        node = self.producer.get(name)
        if node is not None and node.op_type == "Constant":
            return numpy_helper.to_array(node.attribute[0].t)
        return None


class GraphBuilder:
    """Copies parts of the old graph into the new one, with some old values replaced by new ones."""

    def __init__(self, g: GraphIndex):
        self.g = g
        self.nodes: list[onnx.NodeProto] = []
        self.inits: dict[str, TensorProto] = {}
        self.copied: dict[tuple[str, str], str] = {}
        self.counter = 0

    def name(self, hint: str) -> str:
        self.counter += 1
        return f"fused/{hint}_{self.counter}"

    def add(self, op: str, inputs: list[str], n_out: int = 1, domain: str = "", names: list[str] | None = None,
            **attrs) -> list[str]:
        outs = names or [self.name(op.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op, inputs, outs, name=self.name(op), domain=domain, **attrs))
        return outs

    def const(self, array: np.ndarray, hint: str) -> str:
        name = self.name(hint)
        self.inits[name] = numpy_helper.from_array(array, name)
        return name

    def copy(self, value: str, subst: dict[str, str], tag: str) -> str:
        """The new name of old `value`, copying the nodes it is computed by; `subst` maps old values to new ones,
        graph inputs and initializers are shared."""
        if value in subst:
            return subst[value]
        if value == "" or value in self.g.inputs:
            return value
        if value in self.g.inits:
            self.inits[value] = self.g.inits[value]
            return value
        key = (value, tag)
        if key in self.copied:
            return self.copied[key]
        node = self.g.producer.get(value)
        if node is None:
            raise DSparkError(f"fused verifier: cannot trace {value!r} in the portable graph")
        inputs = [self.copy(i, subst, tag) for i in node.input]
        outs = [f"{o}@{tag}" if o else "" for o in node.output]
        clone = onnx.NodeProto()
        clone.CopyFrom(node)
        clone.name = f"{node.name or node.output[0]}@{tag}"
        del clone.input[:]
        clone.input.extend(inputs)
        del clone.output[:]
        clone.output.extend(outs)
        self.nodes.append(clone)
        for o, new in zip(node.output, outs):
            if o:
                self.copied[(o, tag)] = new
        return self.copied[key]
