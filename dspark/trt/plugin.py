"""dspark::ConfidenceTruncate registered from Python (TensorRT's Python IPluginV3 API), so engines can be built
without compiling the C++ plugin (no TensorRT headers needed).

The declaration below must equal the C++ creator's in dspark/ops/trt_plugin/ConfidenceTruncatePlugin.cpp (a test
parses both): name, version, namespace, no fields, seven inputs and two outputs with these types, linear format.
The build phase needs only shapes, types and formats; `enqueue` (runtime phase, a GPU) launches the CUDA kernel of
dspark/ops/confidence_truncate.cu through cuda-python (dspark.trt.plugin_kernel, imported on first launch).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from dspark.bundle import Manifest
from dspark.errors import DSparkError
from dspark.ops.confidence_truncate.onnx_function import (
    DOMAIN,
    INPUTS,
    OP_NAME,
    OP_VERSION,
)


@dataclass(frozen=True)
class PluginDeclaration:
    name: str
    version: str
    namespace: str
    fields: tuple[str, ...]
    inputs: tuple[tuple[str, str], ...]  # (name, TensorRT DataType member name)
    outputs: tuple[tuple[str, str], ...]


CONFIDENCE_TRUNCATE = PluginDeclaration(
    name=OP_NAME, version=str(OP_VERSION), namespace=DOMAIN, fields=(),
    inputs=tuple(zip(INPUTS, ("FLOAT", "FLOAT", "FLOAT", "INT64", "BOOL", "INT64", "INT64"))),
    outputs=(("verify_len", "INT64"), ("verify_mask", "BOOL")))


class ConfidenceTruncateMethods:
    """The plugin's behaviour; combined with the TensorRT base classes of the imported flavor by `plugin_classes`."""

    declaration = CONFIDENCE_TRUNCATE
    trt: ModuleType  # set on the combined class

    def __init__(self):
        for base in self.trt_bases():
            base.__init__(self)
        decl = self.declaration
        self.plugin_name, self.plugin_version, self.plugin_namespace = decl.name, decl.version, decl.namespace
        self.num_outputs = len(decl.outputs)
        self.launcher = None  # the kernel, loaded at the first enqueue

    @classmethod
    def trt_bases(cls) -> tuple:
        trt = cls.trt
        return trt.IPluginV3, trt.IPluginV3OneCore, trt.IPluginV3OneBuild, trt.IPluginV3OneRuntime

    def get_capability_interface(self, capability_type):
        return self

    def clone(self):
        return type(self)()

    def configure_plugin(self, inputs, outputs) -> None:
        if len(inputs) != len(self.declaration.inputs) or len(outputs) != self.num_outputs:
            raise ValueError(f"{self.plugin_name}: {len(inputs)} inputs / {len(outputs)} outputs")

    def get_output_data_types(self, input_types):
        return [getattr(self.trt.DataType, kind) for _, kind in self.declaration.outputs]

    def get_output_shapes(self, inputs, shape_inputs, expr_builder):
        survival = inputs[0]  # [B, Bk] -> verify_len [B], verify_mask [B, Bk]
        if len(survival) != 2:
            raise ValueError(f"{self.plugin_name}: survival must be 2-D, got {len(survival)} dims")
        verify_len = self.trt.DimsExprs(1)
        verify_len[0] = survival[0]
        verify_mask = self.trt.DimsExprs(2)
        verify_mask[0], verify_mask[1] = survival[0], survival[1]
        return [verify_len, verify_mask]

    def supports_format_combination(self, pos, in_out, num_inputs) -> bool:
        kinds = [kind for _, kind in self.declaration.inputs + self.declaration.outputs]
        if num_inputs != len(self.declaration.inputs) or not 0 <= pos < len(kinds):
            return False
        desc = in_out[pos].desc
        return desc.type == getattr(self.trt.DataType, kinds[pos]) and desc.format == self.trt.TensorFormat.LINEAR

    def get_workspace_size(self, inputs, outputs) -> int:
        return 0

    def get_valid_tactics(self):
        return []

    def set_tactic(self, tactic) -> None:
        pass

    def on_shape_change(self, inputs, outputs) -> None:
        survival = inputs[0].dims
        if len(survival) != 2:
            raise ValueError(f"{self.plugin_name}: survival must be 2-D")

    def attach_to_context(self, resource_context):
        return self.clone()

    def get_fields_to_serialize(self):
        return self.trt.PluginFieldCollection([])

    def enqueue(self, input_desc, output_desc, inputs, outputs, workspace, stream) -> None:
        if self.launcher is None:
            kernel = importlib.import_module("dspark.trt.plugin_kernel")  # cuda-python: only where a GPU runs it
            self.launcher = kernel.ConfidenceTruncateKernel.for_current_device()
        batch, block = (int(d) for d in input_desc[0].dims)
        self.launcher.launch(list(inputs), list(outputs), batch, block, int(input_desc[2].dims[0]), int(stream))


class ConfidenceTruncateCreatorMethods:
    declaration = CONFIDENCE_TRUNCATE
    trt: ModuleType
    plugin_class: type

    def __init__(self):
        self.trt.IPluginCreatorV3One.__init__(self)
        decl = self.declaration
        self.name, self.plugin_version, self.plugin_namespace = decl.name, decl.version, decl.namespace
        self.field_names = self.trt.PluginFieldCollection([])

    def create_plugin(self, name, field_collection, phase):
        unknown = [field.name for field in field_collection if field.name not in self.declaration.fields]
        if unknown:  # the parser passes ONNX node attributes as fields: a node this plugin cannot honour
            raise ValueError(f"{self.declaration.namespace}::{self.declaration.name} has no field(s) "
                             f"{', '.join(unknown)}")
        return self.plugin_class()


_CLASSES: dict[str, tuple[type, type]] = {}


def plugin_classes(trt: ModuleType) -> tuple[type, type]:
    """(plugin class, creator class) on the base classes of this TensorRT module (tensorrt or tensorrt_rtx)."""
    if trt.__name__ not in _CLASSES:
        _CLASSES[trt.__name__] = _combine(trt)
    return _CLASSES[trt.__name__]


def _combine(trt: ModuleType) -> tuple[type, type]:
    plugin = type("ConfidenceTruncatePlugin", (ConfidenceTruncateMethods, trt.IPluginV3, trt.IPluginV3OneCore,
                                               trt.IPluginV3OneBuild, trt.IPluginV3OneRuntime), {"trt": trt})
    creator = type("ConfidenceTruncateCreator", (ConfidenceTruncateCreatorMethods, trt.IPluginCreatorV3One),
                   {"trt": trt, "plugin_class": plugin})
    return plugin, creator


_REGISTERED: dict[str, object] = {}  # module name -> the creator TensorRT holds (kept alive here)


def register_python_plugin(trt: ModuleType) -> object:
    """Register the Python creator once per process and flavor; refuse when another creator of the same name,
    version and namespace (e.g. the C++ library's) is already registered."""
    if trt.__name__ in _REGISTERED:
        return _REGISTERED[trt.__name__]
    decl = CONFIDENCE_TRUNCATE
    registry = trt.get_plugin_registry()
    if registry.get_creator(decl.name, decl.version, decl.namespace) is not None:
        raise DSparkError(f"a {decl.namespace}::{decl.name} v{decl.version} plugin is already registered in this "
                          f"process (the C++ library?); build with one of the two, not both")
    creator = plugin_classes(trt)[1]()
    if not registry.register_creator(creator, decl.namespace):
        raise DSparkError(f"TensorRT refused to register the Python {decl.namespace}::{decl.name} plugin")
    _REGISTERED[trt.__name__] = creator
    return creator


def load_recorded_plugin(trt: ModuleType, folder: Path, record: dict) -> None:
    """Make the plugin a bundle's engines were built with creatable (before deserializing them): the C++ library
    the manifest's `tensorrt.plugin` names, else the Python registration."""
    if not record.get("library"):
        register_python_plugin(trt)
        return
    library = Manifest.path(folder, record["library"])
    if trt.get_plugin_registry().load_library(str(library)) is None:
        raise DSparkError(f"{trt.__name__} could not load plugins from {library} (not a plugin library for this "
                          f"TensorRT, or its creator is already registered)")
