"""A GGUF file's own quantized blocks, re-expressed as ONNX Runtime MatMulNBits weights (blocks of 32 along K).

  Q8_0  w = d * q, q int8             -> 8-bit, stored q + 128 with the default zero point 128: exact
  Q4_0  w = d * (q - 8), q in 0..15   -> 4-bit, the default zero point 8: exact
  Q4_1  w = d * q + m, q in 0..15     -> 4-bit with zero points 0 plus a per-block minimum term: y = x W^T is
        MatMulNBits(x) + blocksum(x) @ M, where blocksum sums x over each block of 32 and M [K/32, N] holds the
        minima ("mins"). Each weight is still d * q + m, as the GGUF reader computes it. MatMulNBits' floating
        zero points (zp = -m / d) express the same weights inexactly and run on a slow path of the CPU kernel
        (dequantize, then a float GEMM); mode "float-zp" builds them for measurement only.

GGUF stores row n of a [N, K] matrix as K/32 consecutive blocks; a 4-bit block packs element j in the low nibble
and element j + 16 in the high nibble of byte j, MatMulNBits packs elements 2i and 2i + 1 into byte i.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dspark.errors import DSparkError
from dspark.lazy import LazyModule

gguf = LazyModule("gguf", "pip install gguf (it comes with transformers' GGUF support)")

BLOCK = 32
FORMATS = ("Q8_0", "Q4_0", "Q4_1")
Q4_1_MODES = ("mins", "float-zp")


@dataclass
class GgufMatrix:
    """One 2-D quantized tensor as the file stores it: rows x (K/32 blocks of raw bytes)."""
    name: str
    qtype: str  # "Q8_0", "Q4_0", "Q4_1"
    rows: int  # N (output features)
    cols: int  # K (input features, the quantized axis)
    raw: np.ndarray  # uint8 [N, K/32, bytes per block]

    def dequantize(self) -> np.ndarray:
        """[N, K] float32, by the gguf package's own dequantizer (what transformers' GGUF loader uses)."""
        qtype = gguf.GGMLQuantizationType[self.qtype]
        return gguf.quants.dequantize(self.raw.reshape(self.rows, -1), qtype).reshape(self.rows, self.cols)


@dataclass
class NBitsWeight:
    """Initializer contents of one MatMulNBits node (input B of shape [N, K/block, block*bits/8])."""
    bits: int
    block_size: int
    rows: int  # N
    cols: int  # K
    packed: np.ndarray  # uint8 [N, K/block, blob]
    scales: np.ndarray  # float32 [N, K/block]
    zero_points: np.ndarray | None = None  # uint8 packed [N * ceil(nb * bits / 8)] or float32 [N, nb]
    mins: np.ndarray | None = None  # float32 [N, K/block]: Q4_1's per-block minimum, added by the blocksum term

    def take_rows(self, order: np.ndarray) -> "NBitsWeight":
        """The same weight with its output rows reordered (row i of the result = row order[i])."""

        def pick(a):
            if a is None or a.ndim == 1:  # packed uint8 zero points are all zeros here: only their length matters
                return a
            return np.ascontiguousarray(a[order])

        return NBitsWeight(self.bits, self.block_size, self.rows, self.cols, pick(self.packed), pick(self.scales),
                           pick(self.zero_points), pick(self.mins))

    def dequantize(self) -> np.ndarray:
        """[N, K] float32: what MatMulNBits (+ the mins term) computes as the weight, in numpy."""
        q = unpack(self.packed, self.bits).astype(np.float32)  # [N, nb, block]
        if self.zero_points is None:
            zp = np.float32(1 << (self.bits - 1))
        elif self.zero_points.dtype == np.uint8:
            zp = np.float32(0.0)  # only zero-valued uint8 zero points are built here
        else:
            zp = self.zero_points[..., None]
        w = (q - zp) * self.scales[..., None]
        if self.mins is not None:
            w = w + self.mins[..., None]
        return w.reshape(self.rows, self.cols)


def unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """MatMulNBits blobs [N, nb, blob] -> unsigned codes [N, nb, block]."""
    if bits == 8:
        return packed
    codes = np.empty(packed.shape[:-1] + (packed.shape[-1] * 2,), dtype=np.uint8)
    codes[..., 0::2] = packed & 0x0F
    codes[..., 1::2] = packed >> 4
    return codes


def _pack4(codes: np.ndarray) -> np.ndarray:
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def _gguf_nibbles(qs: np.ndarray) -> np.ndarray:
    """GGUF 4-bit block bytes [..., 16] -> codes [..., 32] in element order."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _half(raw: np.ndarray, at: int) -> np.ndarray:
    return np.ascontiguousarray(raw[..., at:at + 2]).view(np.float16)[..., 0].astype(np.float32)


def to_nbits(m: GgufMatrix, q4_1: str = "mins") -> NBitsWeight:
    """The MatMulNBits form of a GGUF matrix (see the module docstring)."""
    n, nb = m.rows, m.cols // BLOCK
    if m.qtype == "Q8_0":
        codes = (m.raw[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return NBitsWeight(8, BLOCK, n, m.cols, codes, _half(m.raw, 0))
    codes = _gguf_nibbles(m.raw[..., -16:])
    packed = _pack4(codes)
    if m.qtype == "Q4_0":
        return NBitsWeight(4, BLOCK, n, m.cols, packed, _half(m.raw, 0))
    if m.qtype != "Q4_1":
        raise DSparkError(f"{m.name}: GGUF type {m.qtype} has no MatMulNBits form here ({', '.join(FORMATS)})")
    d, mins = _half(m.raw, 0), _half(m.raw, 2)
    if q4_1 == "float-zp":
        with np.errstate(divide="ignore", invalid="ignore"):
            zp = np.where(d == 0, 0.0, -mins / d).astype(np.float32)
        return NBitsWeight(4, BLOCK, n, m.cols, packed, d, zero_points=zp)
    zeros = np.zeros(n * ((nb * 4 + 7) // 8), dtype=np.uint8)
    return NBitsWeight(4, BLOCK, n, m.cols, packed, d, zero_points=zeros, mins=mins)


def read_matrices(path: Path) -> tuple[list[GgufMatrix], dict[str, str]]:
    """The file's 2-D tensors of a format MatMulNBits can hold, and {name: type} of the other 2-D tensors."""
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # the gguf package raises ValueError and friends for bad files
        first = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise DSparkError(f"cannot read GGUF {path}: {first}") from None
    found, other = [], {}
    for t in reader.tensors:
        if len(t.shape) != 2:
            continue
        qtype = t.tensor_type.name
        cols, rows = int(t.shape[0]), int(t.shape[1])  # ggml order: ne0 = K is the fastest axis
        if qtype not in FORMATS or cols % BLOCK:
            other[t.name] = qtype
            continue
        raw = np.asarray(t.data).reshape(rows, cols // BLOCK, -1)
        found.append(GgufMatrix(t.name, qtype, rows, cols, raw))
    return found, other
