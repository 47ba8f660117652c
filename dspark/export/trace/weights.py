"""Where an exported graph's weights come from, and how they reach the bundle one tensor at a time.

Bounded-memory export: the graphs are traced on the meta device (shapes only), so tracing never holds weights.
Each initializer is then bound to what it is made of (a tensor in a safetensors checkpoint, read through mmap, or
an in-memory tensor) and written into the bundle's single `weights.data` by `WeightStore`, which reads, converts
and writes one tensor, then lets it go. A tensor several graphs use (the vocabulary matrix: the verifier's and
the draft's embedding, the verifier's and the heads' LM head) is written once; every graph refers to it by offset.
"""
from __future__ import annotations

import math
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import ml_dtypes
import numpy as np
import onnx_ir as ir
import torch

from dspark.bundle import WEIGHTS
from dspark.errors import DSparkError
from dspark.models.tensors import LazyWeights

WEIGHTS_FILE = WEIGHTS
ALIGN = 1 << 16  # ONNX Runtime maps external data that starts on an allocation-granularity boundary
INLINE_BYTES = 1 << 12  # smaller tensors stay inside the graph file
IR = {"fp32": ir.DataType.FLOAT, "fp16": ir.DataType.FLOAT16, "bf16": ir.DataType.BFLOAT16}


def to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def module_values(module: torch.nn.Module, lazy: LazyWeights | None) -> dict[str, tuple[object, Callable[[], torch.Tensor]]]:
    """fully qualified name -> (identity, reader) for every parameter and buffer of `module`: in-memory tensors
    are read as they are, meta ones from the checkpoint. The identity names the same weight in every graph."""
    out = {}
    for name, t in list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False)):
        if t.is_meta:
            if lazy is None or t not in lazy:
                raise DSparkError(f"no weights for {name}: it was never loaded")
            out[name] = (lazy.identity(t), lambda p=t: lazy.read(p))
        else:
            out[name] = (("memory", id(t)), lambda v=t.detach(): v)
    return out


@contextmanager
def traced_on_meta(module: torch.nn.Module) -> Iterator[None]:
    """Move `module` to the meta device for tracing and put its own parameter and buffer objects back afterwards
    (`.to("meta")` replaces them with new ones), so identities, ties and data are kept."""
    saved = [(table, key, t) for m in module.modules() for table in (m._parameters, m._buffers)
             for key, t in table.items() if t is not None]
    module.to("meta")
    try:
        yield
    finally:
        for table, key, t in saved:
            table[key] = t


class WeightStore:
    """Appends tensors to one external data file, aligned, each distinct (identity, layout, dtype) once.

    `place` hands out the offset at once and leaves reading, converting and writing the tensor to one writer
    thread, which works (mostly outside the GIL) while the next graph is traced. Used as a context manager: on
    success it waits for the writes and raises the first error one of them met; when the export is failing (an
    error, Ctrl-C) it drops the writes still queued and waits only for the one under way."""

    def __init__(self, folder: Path, name: str = WEIGHTS_FILE):
        self.folder, self.name = Path(folder), name
        self.path = self.folder / name
        self.file = open(self.path, "wb")
        self.offset = 0
        self.placed: dict[tuple, tuple[int, int]] = {}
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weights")
        self.writes: list[Future] = []

    def __enter__(self) -> WeightStore:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(failed=exc_type is not None)

    def close(self, failed: bool = False) -> None:
        try:
            if not failed:
                for write in self.writes:
                    write.result()
        finally:
            self.writer.shutdown(cancel_futures=True)  # drops queued writes, waits for the one under way
            self.file.close()

    def _write(self, array: Callable[[], np.ndarray], offset: int, length: int, name: str) -> None:
        data = np.ascontiguousarray(array())
        if data.nbytes != length:
            raise DSparkError(f"weight {name} has {data.nbytes} bytes where its shape and type say {length}")
        self.file.seek(offset)
        self.file.write(memoryview(data.reshape(-1).view(np.uint8)))

    def place(self, key: tuple, array: Callable[[], np.ndarray], dtype: ir.DataType, shape: list[int],
              name: str) -> ir.ExternalTensor:
        if key not in self.placed:
            if self.writes and self.writes[-1].done():
                self.writes[-1].result()  # fail early
            length = math.ceil(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
            self.offset += -self.offset % ALIGN
            self.placed[key] = (self.offset, length)
            self.writes.append(self.writer.submit(self._write, array, self.offset, length, name))
            self.offset += length
        offset, length = self.placed[key]
        return ir.ExternalTensor(self.name, offset, length, dtype, shape=ir.Shape(shape), name=name,
                                 base_dir=str(self.folder))
