"""Loading targets (HF folders, GGUF files, eager or lazy) and choosing their wrapper (dspark.models.target_model)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, Gemma4TextConfig, GemmaTokenizer, \
    GenerationConfig

from dspark.bundle import sha256_file
from dspark.errors import DSparkError
from dspark.files import atomic_folder, read_json
from dspark.models.config import TargetConfig
from dspark.models.gguf_gemma4 import ARCH as GEMMA4_ARCH
from dspark.models.gguf_gemma4 import gemma4_config
from dspark.models.gguf_tensors import GgufTensors, architecture, open_reader
from dspark.models.tensors import CheckpointTensors, LazyWeights
from dspark.models.target_gemma4 import Gemma4Target
from dspark.models.target_model import TargetModel, TargetStep, kv_cache_shape, text_body  # noqa: F401 (re-exported)
from dspark.resolve import cache_dir, resolve_target

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json", "config.json")


def wrap_target(hf_model: nn.Module, tap_ids: tuple[int, ...] = ()) -> "TargetModel":
    """The wrapper class of the model's family (Gemma-4 has its own)."""
    if TargetConfig.from_dict(hf_model.config.to_dict()).family == "gemma4":
        return Gemma4Target(hf_model, tap_ids)
    return TargetModel(hf_model, tap_ids)



@dataclass
class LoadedTarget:
    hf_model: nn.Module
    config: TargetConfig
    folder: Path  # an HF folder holding config.json and the tokenizer files
    source: str  # what the user asked for (name or path)
    source_file: Path  # the file or folder it resolved to
    lazy: LazyWeights | None = None  # set when hf_model was built on the meta device: where its weights are
    precision: str = "fp32"  # what its checkpoint stores its weight matrices at (known for a lazy load)

    def wrapper(self, tap_ids: tuple[int, ...] = ()) -> TargetModel:
        return wrap_target(self.hf_model, tap_ids).eval()

    def tokenizer_files(self) -> list[Path]:
        return [self.folder / f for f in TOKENIZER_FILES if (self.folder / f).exists()]


@lru_cache(maxsize=8)
def _file_digest(path: Path, size: int, mtime_ns: int) -> str:
    return sha256_file(path)


def _gguf_cache_folder(gguf: Path) -> Path:
    """targets/<stem>-<sha256 prefix>: keyed by the file's content (the hash the manifest records), so every
    copy of the same GGUF, in any venv, shares one dequantized folder."""
    st = gguf.stat()
    return cache_dir() / "targets" / f"{gguf.stem}-{_file_digest(gguf.resolve(), st.st_size, st.st_mtime_ns)[:16]}"


def _write_hf_config(folder: Path) -> None:
    """config.json as HF writes it for an unquantized model: no "quantization_config" key at all (a null one
    stops tools such as onnxruntime-genai's model builder)."""
    path = folder / "config.json"
    config = read_json(path)
    if config.pop("quantization_config", "absent") != "absent":
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _convert_gguf(gguf: Path) -> Path:
    """A GGUF's config, tokenizer and generation config as an HF folder (made once, a few MB): its weights stay in
    the file, read one tensor at a time by dspark.models.gguf_tensors (an older cache folder may also hold a
    dequantized model.safetensors, which is then used)."""
    folder = _gguf_cache_folder(gguf)
    if (folder / "config.json").exists():  # (written last, by atomic_folder)
        return folder
    reader = open_reader(gguf)
    try:
        if architecture(reader) == GEMMA4_ARCH:  # (transformers' GGUF config reader cannot build a Gemma-4: see
            config = Gemma4TextConfig(**gemma4_config(reader, gguf.name))  # dspark.models.gguf_gemma4)
            tok = GemmaTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        else:
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except DSparkError:
        raise
    except Exception as e:  # transformers raises many types for foreign files
        raise DSparkError(f"cannot read GGUF {gguf}: {str(e).splitlines()[0]}") from None
    config.quantization_config = None
    if hasattr(config, "_name_or_path"):
        config._name_or_path = gguf.name
    with atomic_folder(folder) as tmp:
        config.save_pretrained(tmp)
        GenerationConfig.from_model_config(config).save_pretrained(tmp)
        tok.save_pretrained(tmp)
        _write_hf_config(tmp)
    return folder


def _checkpoint(folder: Path, gguf: Path | None, hf: nn.Module) -> CheckpointTensors | GgufTensors:
    if gguf is not None and not (folder / "model.safetensors").exists():
        return GgufTensors(gguf, hf)
    return CheckpointTensors(folder)


def _lazy_model(folder: Path, dtype: torch.dtype, gguf: Path | None = None
                ) -> tuple[nn.Module, LazyWeights, str]:
    """The model's modules on the meta device and, per parameter, its tensor in the checkpoint (read later,
    one at a time: the export never holds the whole target)."""
    try:
        config = AutoConfig.from_pretrained(folder)
        with torch.device("meta"):
            hf = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
    except Exception as e:
        raise DSparkError(f"cannot build the target from {folder / 'config.json'}: {str(e).splitlines()[0]}") from None
    tensors = _checkpoint(folder, gguf, hf)
    params = dict(hf.named_parameters())  # a tied LM head is listed once, under the embedding's name
    for name in params:
        if name not in tensors:
            raise DSparkError(f"target checkpoint {tensors.folder} has no tensor {name}")
        if tuple(tensors.shapes[name]) != tuple(params[name].shape):
            raise DSparkError(f"target checkpoint {tensors.folder}: {name} is {list(tensors.shapes[name])}, its "
                              f"config says {list(params[name].shape)}")
    lazy = LazyWeights()
    lazy.add_checkpoint(tensors, {**params, **_lazy_buffers(hf, tensors, lazy)})
    return hf.eval(), lazy, tensors.precision()


def _lazy_buffers(hf: nn.Module, tensors, lazy: LazyWeights) -> dict[str, torch.Tensor]:
    """Buffers the wrapper computes with: saved ones (Gemma-4's layer_scalar) are returned, to be read from the
    checkpoint like weights; a scaled embedding's embed_scale, never saved, is registered in `lazy` with its value
    (the module keeps it as a number)."""
    found = {}
    for name, buf in hf.named_buffers():
        if name in tensors:
            if tuple(tensors.shapes[name]) != tuple(buf.shape):
                raise DSparkError(f"target checkpoint {tensors.folder}: {name} is {list(tensors.shapes[name])}, "
                                  f"its config says {list(buf.shape)}")
            found[name] = buf
    for name, module in hf.named_modules():
        scale, buf = getattr(module, "scalar_embed_scale", None), getattr(module, "embed_scale", None)
        if scale is not None and isinstance(buf, torch.Tensor) and buf.is_meta:
            lazy.add(buf, ("constant", f"{name}.embed_scale", float(scale)), lambda v=float(scale): torch.tensor(v))
    return found


def _eager_from_gguf(folder: Path, gguf: Path, dtype: torch.dtype) -> nn.Module:
    """The model built from the cache folder's config, every tensor read from the file (dspark's own reader)."""
    hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=dtype,
                                          attn_implementation="eager")
    tensors = GgufTensors(gguf, hf)
    params = dict(hf.named_parameters())  # (a tied LM head is listed once, under the embedding's name)
    with torch.no_grad():
        for name, value in hf.state_dict().items():
            if name in tensors:
                value.copy_(tensors.read(name).reshape(value.shape))
            elif name in params:
                raise DSparkError(f"target GGUF {gguf} has no tensor for {name}")
    return hf


def check_target(name_or_path: str) -> Path:
    """The checks that need no weights (the path, the file type, an HF folder's config), so a bad target is
    refused before anything is loaded or displayed; the resolved path."""
    path = resolve_target(name_or_path)
    if path.is_file():
        if path.suffix != ".gguf":
            raise DSparkError(f"target file {path} is not a .gguf; give an HF folder or a GGUF file")
        return path
    if not (path / "config.json").exists():
        raise DSparkError(f"target folder {path} has no config.json (expected an HF model folder)")
    TargetConfig.from_dict(read_json(path / "config.json", f"target config {path / 'config.json'}"))
    return path


def load_target(name_or_path: str, dtype: torch.dtype = torch.float32, lazy: bool = False) -> LoadedTarget:
    """With lazy, the weights stay in the checkpoint (meta-device modules + LazyWeights) until someone reads them."""
    path = check_target(name_or_path)
    gguf = None
    if path.is_file():
        folder, gguf = _convert_gguf(path), path
    else:
        folder = path
    config = TargetConfig.from_dict(read_json(folder / "config.json", f"target config {folder / 'config.json'}"))
    if lazy:
        hf, weights, precision = _lazy_model(folder, dtype, gguf)
        return LoadedTarget(hf_model=hf, config=config, folder=folder, source=name_or_path, source_file=path,
                            lazy=weights, precision=precision)
    try:
        if gguf is not None and config.family == "gemma4":  # (one the transformers loader lacks)
            hf = _eager_from_gguf(folder, gguf, dtype)
        elif gguf is not None and not (folder / "model.safetensors").exists():  # transformers' loader, in memory
            hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype,
                                                      attn_implementation="eager")
            hf.hf_quantizer, hf.config.quantization_config = None, None
        else:
            hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager")
    except Exception as e:
        raise DSparkError(f"cannot load target weights from {folder}: {str(e).splitlines()[0]}") from None
    hf.eval()
    return LoadedTarget(hf_model=hf, config=config, folder=folder, source=name_or_path, source_file=path)
