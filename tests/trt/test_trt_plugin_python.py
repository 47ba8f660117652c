"""The Python registration of dspark::ConfidenceTruncate against the C++ IPluginV3 (parsed from its source) and
against the CUDA kernel it launches (its compiled signature and launch configuration)."""
import ctypes
import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from dspark.trt.plugin import CONFIDENCE_TRUNCATE, plugin_classes
from dspark.trt.plugin_kernel import (
    PARAMS,
    SOURCE,
    compile_cubin,
    kernel_symbol,
    launch_config,
)

CPP = Path(SOURCE).parent / "trt_plugin" / "ConfidenceTruncatePlugin.cpp"


def cpp_declaration() -> dict:
    text = CPP.read_text()
    constant = {name: re.search(rf'constexpr char const\* {name} = "([^"]*)";', text).group(1)
                for name in ("kNAME", "kVERSION", "kNAMESPACE")}
    counts = {name: int(re.search(rf"constexpr int32_t {name} = (\d+);", text).group(1))
              for name in ("kNB_INPUTS", "kNB_OUTPUTS")}
    types = re.findall(r"DataType::k(\w+)", re.search(r"kTYPES\[[^\]]*\] = \{([^}]*)\}", text).group(1))
    outputs = re.findall(r"outputTypes\[(\d)\] = DataType::k(\w+);", text)
    header = re.search(r"// Inputs : (.*?)\.\s+Outputs: (.*?)\.\n", text, re.DOTALL)
    names = [re.findall(r"(\w+) \[", part.replace("//", " ")) for part in header.groups()]
    fields = re.findall(r"fields_\.nbFields = (\d+);", text)
    return {"name": constant["kNAME"], "version": constant["kVERSION"], "namespace": constant["kNAMESPACE"],
            "inputs": list(zip(names[0], types[:counts["kNB_INPUTS"]])),
            "outputs": list(zip(names[1], types[counts["kNB_INPUTS"]:])), "counts": counts,
            "output_types": [kind for _, kind in sorted(outputs)], "fields": fields,
            "linear_only": "TensorFormat::kLINEAR" in text}


def test_python_and_cpp_plugins_declare_the_same_plugin():
    cpp = cpp_declaration()
    decl = CONFIDENCE_TRUNCATE
    assert (decl.name, decl.version, decl.namespace) == (cpp["name"], cpp["version"], cpp["namespace"])
    assert (len(decl.inputs), len(decl.outputs)) == (cpp["counts"]["kNB_INPUTS"], cpp["counts"]["kNB_OUTPUTS"])
    assert list(decl.inputs) == cpp["inputs"] and list(decl.outputs) == cpp["outputs"]
    assert [kind for _, kind in decl.outputs] == cpp["output_types"]
    assert decl.fields == () and cpp["fields"] and set(cpp["fields"]) == {"0"} and cpp["linear_only"]


def test_the_registered_python_plugin_behaves_as_declared():
    if importlib.util.find_spec("tensorrt_rtx") is None:
        pytest.fail("needs TensorRT for RTX: pip install -e '.[dev]'", pytrace=False)
    from dspark.trt.versions import import_tensorrt

    trt = import_tensorrt("rtx")
    plugin_class, creator_class = plugin_classes(trt)
    creator = creator_class()
    assert (creator.name, creator.plugin_version, creator.plugin_namespace) == ("ConfidenceTruncate", "1", "dspark")
    assert len(creator.field_names) == 0
    plugin = creator.create_plugin("n", trt.PluginFieldCollection([]), trt.TensorRTPhase.BUILD)
    assert plugin.num_outputs == 2 and len(plugin.get_fields_to_serialize()) == 0
    assert plugin.get_output_data_types([trt.DataType.FLOAT] * 7) == [trt.DataType.INT64, trt.DataType.BOOL]
    kinds = [getattr(trt.DataType, k) for _, k in CONFIDENCE_TRUNCATE.inputs + CONFIDENCE_TRUNCATE.outputs]
    for pos, kind in enumerate(kinds):
        for other in {trt.DataType.FLOAT, trt.DataType.INT64, trt.DataType.BOOL, trt.DataType.HALF}:
            for fmt in (trt.TensorFormat.LINEAR, trt.TensorFormat.CHW32):
                desc = trt.DynamicPluginTensorDesc()
                tensor = trt.PluginTensorDesc()
                tensor.type, tensor.format = other, fmt
                desc.desc = tensor
                want = other == kind and fmt == trt.TensorFormat.LINEAR
                assert plugin.supports_format_combination(pos, [desc] * 9, 7) == want, (pos, other, fmt)
    with pytest.raises(ValueError, match="no field"):
        creator.create_plugin("n", trt.PluginFieldCollection([trt.PluginField("mode")]), trt.TensorRTPhase.BUILD)


@pytest.fixture(scope="module")
def nvcc():
    path = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not shutil.which(path):
        pytest.skip("nvcc not installed")
    return path


def test_the_python_runtime_launches_the_kernel_with_its_compiled_signature(nvcc, tmp_path):
    cubin = compile_cubin("89", tmp_path, nvcc=nvcc)
    symbol = kernel_symbol(cubin.read_bytes())
    demangled = subprocess.run(["c++filt", symbol], capture_output=True, text=True).stdout.strip()
    args = re.search(r"confidence_truncate_kernel\((.*)\)", demangled).group(1).split(", ")
    assert len(args) == len(PARAMS)
    for arg, (name, kind) in zip(args, PARAMS):
        assert arg.endswith("*") == (kind is ctypes.c_void_p) and (arg == "int") == (kind is ctypes.c_int), name
    source = re.search(r"__global__ void confidence_truncate_kernel\((.*?)\)", SOURCE.read_text(), re.DOTALL).group(1)
    assert [p.split()[-1].lstrip("*") for p in source.split(",")] == [name for name, _ in PARAMS]
    assert compile_cubin("89", tmp_path, nvcc="/nonexistent") == cubin  # cached by source digest


def test_launch_configuration_is_the_host_launchers(nvcc, tmp_path):
    from dspark.ops.kernels import build_kernel

    library = ctypes.CDLL(str(build_kernel(tmp_path, archs=("89",), nvcc=nvcc)))
    library.dspark_confidence_truncate_smem.restype = ctypes.c_size_t
    for batch in range(1, 300, 7):
        for block in range(1, 17):
            assert launch_config(batch, block)[1] == library.dspark_confidence_truncate_smem(batch, block)
    text = SOURCE.read_text()  # threads: half the sort width, clamped to [128, kMaxThreads]
    assert "constexpr int kMaxThreads = 1024;" in text
    assert "threads = half < 128 ? 128 : half > kMaxThreads ? kMaxThreads : half;" in text
    assert [launch_config(b, k)[0] for b, k in ((1, 1), (8, 33), (64, 64))] == [128, 256, 1024]
