"""A GGUF file's own quantized blocks, re-expressed as ONNX Runtime MatMulNBits weights, exactly.

Every GGUF format below stores, per sub-block of `sub` consecutive input features of one output row, integer
values v, a float scale s and, for the asymmetric formats, a float minimum m: w = s * v (+ m). MatMulNBits holds
w = scale * (code - zero_point) per block of `sub`, so the values become codes (v + 8 in 4 bits with the default
zero point 8, v + 128 in 8 bits with the default 128, or v itself in 4 bits with zero points 0), the scales are
computed in float32 exactly as the gguf reader computes them, and a minimum becomes a second, small term:
y = x W^T = MatMulNBits(x) + blocksum(x) @ M, where blocksum sums x over each sub-block and M [K/sub, N] holds the
minima ("mins"). Each weight ONNX Runtime multiplies by is then s * v + m, rounded as the reader rounds it.

  format  sub  values        MatMulNBits              minimum term
  Q8_0    32   int8          8-bit                    no
  Q4_0    32   0..15 - 8     4-bit                    no
  Q4_1    32   0..15         4-bit, zero points 0     yes
  Q5_0    32   0..31 - 16    8-bit                    no
  Q5_1    32   0..31         8-bit                    yes
  Q2_K    16   0..3          4-bit, zero points 0     yes (scale d * 4-bit, minimum dmin * 4-bit)
  Q3_K    16   -4..3         4-bit                    no  (scale d * (6-bit - 32))
  Q4_K    32   0..15         4-bit, zero points 0     yes (scale d * 6-bit, minimum dmin * 6-bit)
  Q5_K    32   0..31         8-bit                    yes (as Q4_K)
  Q6_K    16   0..63 - 32    8-bit                    no  (scale d * int8)

Q4_1's minimum can also be written as MatMulNBits' floating zero points (zp = -m / d): inexact, and a slow path of
the CPU kernel (dequantize, then a float GEMM); mode "float-zp" builds them for measurement only.

GGUF stores row n of a [N, K] matrix as K/B consecutive blocks (B = 32, or 256 for the K-quants' super-blocks);
MatMulNBits packs 4-bit codes 2i and 2i + 1 into byte i of a block.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dspark.errors import DSparkError
from dspark.lazy import LazyModule

gguf = LazyModule("gguf", "pip install gguf (it comes with transformers' GGUF support)")

FORMATS = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
Q4_1_MODES = ("mins", "float-zp")
QK_K = 256  # elements of a K-quant super-block


@dataclass
class GgufMatrix:
    """One 2-D quantized tensor as the file stores it: rows x (K/B blocks of raw bytes)."""
    name: str
    qtype: str  # one of FORMATS
    rows: int  # N (output features)
    cols: int  # K (input features, the quantized axis)
    raw: np.ndarray  # uint8 [N, K/B, bytes per block]

    def dequantize(self) -> np.ndarray:
        """[N, K] float32, by the gguf package's own dequantizer (what transformers' GGUF loader uses)."""
        qtype = gguf.GGMLQuantizationType[self.qtype]
        return gguf.quants.dequantize(self.raw.reshape(self.rows, -1), qtype).reshape(self.rows, self.cols)

    def take_rows(self, start: int, stop: int) -> "GgufMatrix":
        return GgufMatrix(self.name, self.qtype, stop - start, self.cols, self.raw[start:stop])


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

    def window(self, rows: int, cols: int) -> "NBitsWeight":
        """The weight's first `rows` outputs over its first `cols` inputs (whole blocks), as a weight of its own:
        probing a window of a real-size matrix costs what probing a small one does."""
        rows, blocks = min(rows, self.rows), min(cols, self.cols) // self.block_size
        zp = self.zero_points
        if zp is not None:
            zp = (np.zeros(rows * ((blocks * self.bits + 7) // 8), np.uint8) if zp.dtype == np.uint8
                  else np.ascontiguousarray(zp[:rows, :blocks]))
        cut = (lambda a: None if a is None else np.ascontiguousarray(a[:rows, :blocks]))
        return NBitsWeight(self.bits, self.block_size, rows, blocks * self.block_size, cut(self.packed),
                           cut(self.scales), zp, cut(self.mins))

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


@dataclass
class SubBlocks:
    """A GGUF matrix decoded to w = scales * values (+ mins), one scale (and minimum) per sub-block."""
    values: np.ndarray  # int16 [N, K/sub, sub]
    scales: np.ndarray  # float32 [N, K/sub]
    mins: np.ndarray | None = None  # float32 [N, K/sub]: added to every weight of the sub-block


def _unfold(b: np.ndarray, chunk: int, shifts: tuple[int, ...], mask: int) -> np.ndarray:
    """Bit fields of bytes [..., n] -> [..., n * len(shifts)] in element order: chunks of `chunk` bytes, each
    giving its bytes' field at shifts[0], then at shifts[1], ... (how GGUF lays its low and high bits out)."""
    lead = b.shape[:-1]
    parts = b.reshape(lead + (-1, 1, chunk)) >> np.array(shifts, dtype=np.uint8).reshape(-1, 1)
    return (parts & np.uint8(mask)).reshape(lead + (-1,))


def _half(raw: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte `at` of every block, as float32 [N, nb, 1]."""
    return np.ascontiguousarray(raw[..., at:at + 2]).view(np.float16).astype(np.float32)


def _per_sub(x: np.ndarray, sub: int) -> np.ndarray:
    """[N, nb, values per block] -> [N, nb * block / sub, sub]."""
    return x.reshape(x.shape[0], -1, sub)


def _low_high(low: np.ndarray, high: np.ndarray, shift: int) -> np.ndarray:
    return low.astype(np.int16) | (high.astype(np.int16) << shift)


def _q5_high(raw: np.ndarray, at: int) -> np.ndarray:
    """Q5_0/Q5_1's 32 high bits (a little-endian uint32): bit j is element j's."""
    return np.unpackbits(np.ascontiguousarray(raw[..., at:at + 4]), axis=-1, bitorder="little")


def _k_scale_min(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> eight 6-bit scales and eight 6-bit minima per super-block."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _q8_0(raw):
    return SubBlocks(raw[..., 2:].view(np.int8).astype(np.int16), _half(raw, 0)[..., 0])


def _q4_0(raw):
    return SubBlocks(_unfold(raw[..., 2:], 16, (0, 4), 0x0F).astype(np.int16) - 8, _half(raw, 0)[..., 0])


def _q4_1(raw):
    return SubBlocks(_unfold(raw[..., 4:], 16, (0, 4), 0x0F).astype(np.int16), _half(raw, 0)[..., 0],
                     _half(raw, 2)[..., 0])


def _q5_0(raw):
    values = _low_high(_unfold(raw[..., 6:], 16, (0, 4), 0x0F), _q5_high(raw, 2), 4) - 16
    return SubBlocks(values, _half(raw, 0)[..., 0])


def _q5_1(raw):
    values = _low_high(_unfold(raw[..., 8:], 16, (0, 4), 0x0F), _q5_high(raw, 4), 4)
    return SubBlocks(values, _half(raw, 0)[..., 0], _half(raw, 2)[..., 0])


def _q2_k(raw):
    scales, d, dmin = raw[..., 0:16], _half(raw, 80), _half(raw, 82)
    values = _per_sub(_unfold(raw[..., 16:80], 32, (0, 2, 4, 6), 0x03).astype(np.int16), 16)
    sc = d * (scales & 0x0F).astype(np.float32)
    mn = dmin * (scales >> 4).astype(np.float32)
    return SubBlocks(values, sc.reshape(values.shape[:2]), -mn.reshape(values.shape[:2]))


def _q3_k(raw):
    low = _unfold(raw[..., 32:96], 32, (0, 2, 4, 6), 0x03)
    high = _unfold(raw[..., 0:32], 32, tuple(range(8)), 0x01)
    values = _per_sub(low.astype(np.int16) - ((1 - high.astype(np.int16)) << 2), 16)
    s = raw[..., 96:108]
    six = _unfold(s[..., 0:8], 8, (0, 4), 0x0F) | (_unfold(s[..., 8:12], 4, (0, 2, 4, 6), 0x03) << 4)
    sc = _half(raw, 108) * (six.astype(np.int8) - np.int8(32)).astype(np.float32)
    return SubBlocks(values, sc.reshape(values.shape[:2]))


def _q4_k(raw, high: np.ndarray | None = None, at: int = 16):
    d, dmin = _half(raw, 0), _half(raw, 2)
    sc, mn = _k_scale_min(raw[..., 4:16])
    low = _unfold(raw[..., at:at + 128], 32, (0, 4), 0x0F)
    values = _per_sub(low.astype(np.int16) if high is None else _low_high(low, high, 4), 32)
    return SubBlocks(values, (d * sc).reshape(values.shape[:2]), -(dmin * mn).reshape(values.shape[:2]))


def _q5_k(raw):
    return _q4_k(raw, _unfold(raw[..., 16:48], 32, tuple(range(8)), 0x01), at=48)


def _q6_k(raw):
    values = _low_high(_unfold(raw[..., 0:128], 64, (0, 4), 0x0F), _unfold(raw[..., 128:192], 32, (0, 2, 4, 6), 0x03),
                       4) - 32
    values = _per_sub(values, 16)
    sc = _half(raw, 208) * raw[..., 192:208].view(np.int8).astype(np.float32)
    return SubBlocks(values, sc.reshape(values.shape[:2]))


DECODERS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q2_K": _q2_k,
            "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}
# the range of each format's values: 4-bit MatMulNBits codes where it fits, else 8-bit
VALUE_RANGE = {"Q8_0": (-128, 127), "Q4_0": (-8, 7), "Q4_1": (0, 15), "Q5_0": (-16, 15), "Q5_1": (0, 31),
               "Q2_K": (0, 3), "Q3_K": (-4, 3), "Q4_K": (0, 15), "Q5_K": (0, 31), "Q6_K": (-32, 31)}


def sub_blocks(m: GgufMatrix) -> SubBlocks:
    """The matrix's values, scales and minima, computed in float32 as the gguf reader computes them."""
    if m.qtype not in DECODERS:
        raise DSparkError(f"{m.name}: GGUF type {m.qtype} has no MatMulNBits form here ({', '.join(FORMATS)})")
    return DECODERS[m.qtype](m.raw)


def to_nbits(m: GgufMatrix, q4_1: str = "mins") -> NBitsWeight:
    """The MatMulNBits form of a GGUF matrix (see the module docstring)."""
    blocks = sub_blocks(m)
    n, nb, sub = blocks.values.shape
    low, high = VALUE_RANGE[m.qtype]
    if m.qtype == "Q4_1" and q4_1 == "float-zp":
        d = blocks.scales
        with np.errstate(divide="ignore", invalid="ignore"):
            zp = np.where(d == 0, 0.0, -blocks.mins / d).astype(np.float32)
        return NBitsWeight(4, sub, n, m.cols, _pack4(blocks.values.astype(np.uint8)), d, zero_points=zp)
    if blocks.mins is not None and high <= 15:  # unsigned 4-bit values: zero points 0
        zeros = np.zeros(n * ((nb * 4 + 7) // 8), dtype=np.uint8)
        return NBitsWeight(4, sub, n, m.cols, _pack4(blocks.values.astype(np.uint8)), blocks.scales, zeros,
                           blocks.mins)
    if low >= -8 and high <= 7:  # signed 4-bit values: the default zero point 8
        return NBitsWeight(4, sub, n, m.cols, _pack4((blocks.values + 8).astype(np.uint8)), blocks.scales)
    return NBitsWeight(8, sub, n, m.cols, (blocks.values + 128).astype(np.uint8), blocks.scales, mins=blocks.mins)


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
        block = gguf.GGML_QUANT_SIZES[t.tensor_type][0] if qtype in FORMATS else 0
        if qtype not in FORMATS or cols % block:
            other[t.name] = qtype
            continue
        raw = np.asarray(t.data).reshape(rows, cols // block, -1)
        found.append(GgufMatrix(t.name, qtype, rows, cols, raw))
    return found, other
