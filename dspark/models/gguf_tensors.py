"""A GGUF target's tensors under their HF names, each one dequantized only when it is read.

transformers' GGUF loader dequantizes the whole file into float32 at once (16 GB for a 4B model); the export reads
one weight at a time, so this reads each tensor the same way (the gguf package's dequantizer, then transformers'
per-architecture processing such as undoing llama.cpp's rotary row order of q/k) when the export asks for it.
The values are the ones transformers' loader gives, bit for bit: the quantizer finds the file's blocks by them.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from dspark.errors import DSparkError
from dspark.lazy import LazyModule

gguf = LazyModule("gguf", "pip install gguf (it comes with transformers' GGUF support)")


def architecture(reader) -> str:
    """general.architecture of an open GGUF (gguf.GGUFReader)."""
    field = reader.fields.get("general.architecture")
    if field is None:
        raise DSparkError("the GGUF has no general.architecture")
    return bytes(field.parts[field.data[0]]).decode()


def _hf_names(arch: str, hf_model: torch.nn.Module) -> dict[str, str]:
    """GGUF tensor name -> HF parameter name, from gguf's name map of the architecture (built once: transformers'
    own get_gguf_hf_weights_map rebuilds it for every submodule, 41 s for SmolLM2, for the same result)."""
    found = next((a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch), None)
    if found is None:
        raise DSparkError(f"GGUF architecture {arch!r} is unknown to the gguf package; pip install -U gguf")
    names = gguf.get_tensor_name_map(found, hf_model.config.num_hidden_layers)
    mapping = {}
    for hf_name in hf_model.state_dict():  # (meta tensors: nothing is read)
        base, _, suffix = hf_name.rpartition(".")
        gguf_name = names.get_name(base)
        if gguf_name is not None:
            mapping[f"{gguf_name}.{suffix}"] = hf_name
        elif (whole := names.get_name(hf_name)) is not None:  # a bare buffer (Gemma-4's layer_scalar), which
            mapping[f"{whole}.weight"] = hf_name  # llama.cpp's converter stores with a .weight suffix
    return mapping


def open_reader(path: Path):
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the gguf package raises ValueError and friends for bad files
        first = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise DSparkError(f"cannot read GGUF {path}: {first}") from None


class GgufTensors:
    """The interface of dspark.models.tensors.CheckpointTensors (folder, shapes, `in`, precision(), read(name))
    over a GGUF file, for the HF model `hf_model` (built on the meta device from the file's config)."""

    def __init__(self, path: Path, hf_model: torch.nn.Module):
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

        self.folder = Path(path)  # (the identity LazyWeights records)
        self.reader = open_reader(path)
        arch = architecture(self.reader)
        self.processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=hf_model.config.to_dict())
        self.mapping = _hf_names(arch, hf_model)
        self.tensors, self.shapes = {}, {}
        for t in self.reader.tensors:
            hf_name = self.mapping.get(t.name)
            if hf_name is not None:
                self.tensors[hf_name] = t
                self.shapes[hf_name] = tuple(int(d) for d in reversed(t.shape.tolist()))  # ggml order: fastest last

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def precision(self) -> str:
        return "fp32"  # what dequantizing gives

    def read(self, name: str) -> torch.Tensor:
        t = self.tensors[name]
        weights = gguf.quants.dequantize(t.data, t.tensor_type)
        result = self.processor.process(weights=weights, name=t.name, tensor_key_mapping=self.mapping,
                                        parsed_parameters={})
        return torch.from_numpy(np.array(result.weights, dtype=np.float32).reshape(self.shapes[name]))
