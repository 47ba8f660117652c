"""Checkpoint tensors read one at a time (safetensors through mmap, single file or validated shards), and the
rule for which weights a fp16/bf16 bundle stores at that precision."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn
from safetensors import SafetensorError, safe_open

from dspark.errors import DSparkError
from dspark.files import read_json
from dspark.schema import Fields, contained

PRECISIONS = ("fp32", "fp16", "bf16")
STORED = {"F32": "fp32", "F16": "fp16", "BF16": "bf16"}  # safetensors dtype -> precision
TORCH = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def read_shard_index(folder: Path, what: str = "draft") -> dict[str, set[str]]:
    """shard file -> tensor names, from model.safetensors.index.json, every shard a .safetensors file inside the
    checkpoint folder (DSparkError otherwise)."""
    index = folder / "model.safetensors.index.json"
    weight_map = Fields(read_json(index, f"{what} index {index}"), f"{what} index {index}").obj("weight_map").raw
    if not weight_map or not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise DSparkError(f"{what} index {index}: weight_map must map tensor names to shard files")
    shards: dict[str, set[str]] = {}
    for name, shard in weight_map.items():
        path = contained(folder, shard, f"{what} checkpoint")
        if not shard.endswith(".safetensors") or not path.is_file():
            raise DSparkError(f"{what} index {index} lists shard {shard!r}, which is not a .safetensors file there")
        shards.setdefault(shard, set()).add(name)
    return shards


def stored_low(tensor_or_shape) -> bool:
    """Weights a fp16/bf16 bundle stores at that precision: matrices (linear layers, embeddings). Norm weights,
    biases and buffers stay fp32; the PyTorch reference of `dspark-export check` rounds exactly the same set."""
    shape = getattr(tensor_or_shape, "shape", tensor_or_shape)
    return len(shape) >= 2


class CheckpointTensors:
    """The tensors of a safetensors checkpoint folder (model.safetensors, or the shards its
    model.safetensors.index.json lists, checked against the files), read one at a time through mmap."""

    def __init__(self, folder: Path, what: str = "target"):
        self.folder, self.what = Path(folder), what
        self.files: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, str] = {}
        index = self.folder / "model.safetensors.index.json"
        single = self.folder / "model.safetensors"
        if single.exists():
            self._scan(single, None)
        elif index.exists():
            for shard, names in read_shard_index(self.folder, what).items():
                self._scan(self.folder / shard, names)
        else:
            raise DSparkError(f"{what} folder {self.folder} has no model.safetensors (nor a shard index)")

    def _scan(self, path: Path, names: set[str] | None) -> None:
        try:
            with safe_open(str(path), framework="pt") as f:
                keys = set(f.keys())
                slices = {k: f.get_slice(k) for k in keys}
                shapes = {k: tuple(s.get_shape()) for k, s in slices.items()}
                dtypes = {k: s.get_dtype() for k, s in slices.items()}
        except (SafetensorError, OSError, ValueError) as e:
            raise DSparkError(f"{self.what} weights {path} are corrupt or not safetensors "
                              f"({str(e).splitlines()[0]})") from None
        if names is not None and names - keys:
            raise DSparkError(f"{self.what} shard {path.name} lacks {sorted(names - keys)[0]}, which its index "
                              f"places there")
        for k in keys if names is None else names:
            self.files[k] = path
            self.shapes[k], self.dtypes[k] = shapes[k], dtypes[k]

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def precision(self) -> str:
        """The precision its weight matrices are stored at: fp32 when they mix types or use another one."""
        found = {STORED.get(self.dtypes[k]) for k, shape in self.shapes.items() if stored_low(shape)}
        return found.pop() if len(found) == 1 and None not in found else "fp32"

    def read(self, name: str) -> torch.Tensor:
        with safe_open(str(self.files[name]), framework="pt") as f:
            return f.get_tensor(name)


@contextmanager
def params_on_meta() -> Iterator[None]:
    """Modules built within get their parameters on the meta device (never filled in, so never resident) and
    their buffers (RoPE frequencies and such, computed from the config) as usual."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


class LazyWeights:
    """Tensors left on the meta device and how to read each one, by identity (so a tied LM head finds the
    embedding it is tied to): the target's and the drafter's checkpoint tensors, and tensors derived from them."""

    def __init__(self) -> None:
        self.readers: dict[int, tuple[tuple, Callable[[], torch.Tensor]]] = {}
        self.kept: list[torch.Tensor] = []  # the registered tensors themselves, so their ids stay theirs

    def add(self, t: torch.Tensor, identity: tuple, read: Callable[[], torch.Tensor]) -> None:
        self.readers[id(t)] = (identity, read)
        self.kept.append(t)

    def add_checkpoint(self, tensors: CheckpointTensors, params: dict[str, torch.Tensor]) -> None:
        """params: checkpoint tensor name -> the meta tensor that stands for it."""
        for name, t in params.items():
            self.add(t, ("checkpoint", str(tensors.folder), name), lambda n=name: tensors.read(n))

    def __contains__(self, t: torch.Tensor) -> bool:
        return id(t) in self.readers

    def identity(self, t: torch.Tensor) -> tuple:
        return self.readers[id(t)][0]

    def read(self, t: torch.Tensor) -> torch.Tensor:
        return self.readers[id(t)][1]()
