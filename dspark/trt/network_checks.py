"""What `dspark-export build` checks on each parsed network and built engine before it writes anything: every
dspark node became a plugin layer, and the engine's inputs and outputs (names, element types, ranks) and its
optimization profiles are the manifest's contract. Each problem is one line."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dspark.bundle import GraphSpec
from dspark.integrity import read_onnx
from dspark.ops.confidence_truncate.onnx_function import DOMAIN
from dspark.trt.profiles import Profile

PLUGIN_KINDS = ("PLUGIN_V3", "PLUGIN_V2", "PLUGIN")
# TensorRT DataType member -> numpy dtype name (the manifest's spelling)
DTYPES = {"FLOAT": "float32", "HALF": "float16", "BF16": "bfloat16", "INT32": "int32", "INT64": "int64",
          "BOOL": "bool", "UINT8": "uint8", "INT8": "int8"}


@dataclass(frozen=True)
class TensorRecord:
    name: str
    is_input: bool
    dtype: str
    rank: int

    def as_dict(self) -> dict:
        return {"name": self.name, "mode": "input" if self.is_input else "output", "dtype": self.dtype,
                "rank": self.rank}


def plugin_layers(trt, network) -> list[str]:
    """`namespace::name` of each plugin layer of the network, in layer order."""
    kinds = {getattr(trt.LayerType, kind) for kind in PLUGIN_KINDS if hasattr(trt.LayerType, kind)}
    found = []
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        if layer.type not in kinds:
            continue
        layer.__class__ = trt.IPluginV3Layer if layer.type == trt.LayerType.PLUGIN_V3 else layer.__class__
        plugin = getattr(layer, "plugin", None)
        core = plugin.get_capability_interface(trt.PluginCapabilityType.CORE) if plugin is not None else None
        found.append(f"{core.plugin_namespace}::{core.plugin_name}" if core is not None else "?")
    return found


def dspark_nodes(path: Path) -> int:
    model = read_onnx(path)
    return sum(1 for node in model.graph.node if node.domain == DOMAIN)


def node_problems(path: Path, declaration) -> list[str]:
    """dspark nodes the plugin cannot stand for. The parser hands a plugin only the node attributes its creator
    declares and drops the rest silently, so an attribute the plugin does not declare is refused here."""
    model = read_onnx(path)
    versions = {opset.domain: opset.version for opset in model.opset_import}
    problems = []
    if any(node.domain == DOMAIN for node in model.graph.node) and versions.get(DOMAIN) != int(declaration.version):
        problems.append(f"{path.name}: imports {DOMAIN} opset {versions.get(DOMAIN)}, the plugin is version "
                        f"{declaration.version}")
    for node in model.graph.node:
        if node.domain != DOMAIN:
            continue
        where = f"{path.name}: {DOMAIN}::{node.op_type} node {node.name or node.output[0]}"
        if node.op_type != declaration.name:
            problems.append(f"{where} has no dspark TensorRT plugin")
            continue
        unknown = [a.name for a in node.attribute if a.name not in declaration.fields]
        if unknown:
            problems.append(f"{where} has attribute(s) {', '.join(unknown)} the plugin does not declare "
                            f"(fields: {', '.join(declaration.fields) or 'none'})")
        if len(node.input) != len(declaration.inputs) or len(node.output) != len(declaration.outputs):
            problems.append(f"{where} has {len(node.input)} inputs / {len(node.output)} outputs, the plugin "
                            f"{len(declaration.inputs)} / {len(declaration.outputs)}")
    return problems


def network_io(trt, network) -> list[TensorRecord]:
    records = []
    for is_input, count, get in ((True, network.num_inputs, network.get_input),
                                 (False, network.num_outputs, network.get_output)):
        for i in range(count):
            tensor = get(i)
            kind = tensor.dtype.name
            records.append(TensorRecord(tensor.name, is_input, DTYPES.get(kind, kind.lower()), len(tensor.shape)))
    return records


def io_problems(spec: GraphSpec, records: list[TensorRecord]) -> list[str]:
    """Differences between the network's inputs/outputs and the manifest's (order-free, by name)."""
    problems = []
    for is_input, tensors in ((True, spec.inputs), (False, spec.outputs)):
        kind = "input" if is_input else "output"
        want = {t.name: (t.dtype, len(t.shape)) for t in tensors}
        got = {r.name: (r.dtype, r.rank) for r in records if r.is_input == is_input}
        problems += [f"{spec.file}: {kind} {name} is missing from the network" for name in want if name not in got]
        problems += [f"{spec.file}: the network has an extra {kind} {name}" for name in got if name not in want]
        problems += [f"{spec.file}: {kind} {name} is {got[name][0]} rank {got[name][1]} in the network, "
                     f"{want[name][0]} rank {want[name][1]} in the manifest"
                     for name in want if name in got and got[name] != want[name]]
    return problems


def profile_problems(spec: GraphSpec, built: list[tuple[Profile, object]]) -> list[str]:
    """Each TensorRT optimization profile must hold the (min, opt, max) shapes planned for it, for every input."""
    problems = []
    for planned, profile in built:
        for tensor in spec.inputs:
            want = [tuple(shape) for shape in planned.shapes[tensor.name]]
            got = [tuple(shape) for shape in profile.get_shape(tensor.name)]
            if got != want:
                problems.append(f"{spec.file}: profile {planned.name} gives {tensor.name} {got}, planned {want}")
    return problems


def plan_problems(spec: GraphSpec, plan: bytes) -> list[str]:
    """The serialized engine must name every input and output of the manifest (its binding table)."""
    return [f"{spec.file}: the engine does not name {tensor.name}" for tensor in spec.inputs + spec.outputs
            if tensor.name.encode() not in plan]
