"""Which GGUF tensor each of a graph's MatMul weights was dequantized from, found by value.

The export dequantizes the same GGUF (transformers' loader, the gguf package's dequantizer), so every output row
of a graph weight [K, N] equals a row of one GGUF matrix [N, K] bit for bit once rounded to the type the export
stored (float32 today; float16/bfloat16 are matched after rounding the GGUF rows the same way). Rows may be
reordered (transformers undoes llama.cpp's rotary permutation of q/k rows), so rows are matched as a multiset and
the row order is returned; matrices are never matched by name, which only serves as a cross-check.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from dspark.export.quantize.gguf_blocks import GgufMatrix
from dspark.export.quantize.nbits_graph import ConstWeight

_MULTIPLIERS = np.random.default_rng(20260).integers(1, 1 << 63, size=1 << 16, dtype=np.uint64) | np.uint64(1)

# llama.cpp's tensor names -> the HF module path transformers' GGUF loader gives them (a cross-check only)
HF_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
            "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj"}


@dataclass
class Match:
    weight: ConstWeight
    matrix: GgufMatrix
    order: np.ndarray  # graph output row i = GGUF row order[i]
    name_agrees: bool


def row_hashes(rows: np.ndarray) -> np.ndarray:
    """A 64-bit hash per row of a float32 [N, K] matrix, equal for bit-identical rows."""
    bits = np.ascontiguousarray(rows, dtype=np.float32).view(np.uint32).astype(np.uint64)
    mult = _MULTIPLIERS[np.arange(rows.shape[1]) % len(_MULTIPLIERS)]
    with np.errstate(over="ignore"):
        return (bits * mult).sum(axis=1, dtype=np.uint64)


def _as_stored(rows: np.ndarray, storage: np.dtype) -> np.ndarray:
    """float32 rows rounded through the storage type the export used (a no-op for float32)."""
    if storage == np.float32:
        return rows
    dtype = ml_dtypes.bfloat16 if storage.name == "bfloat16" else storage
    return rows.astype(dtype).astype(np.float32)


def _signature(hashes: np.ndarray) -> bytes:
    return np.sort(hashes).tobytes()


def _order(graph_hashes: np.ndarray, gguf_hashes: np.ndarray) -> np.ndarray:
    """order with gguf_hashes[order] == graph_hashes (equal rows are interchangeable: same values)."""
    by_gguf = np.argsort(gguf_hashes, kind="stable")
    by_graph = np.argsort(graph_hashes, kind="stable")
    order = np.empty_like(by_graph)
    order[by_graph] = by_gguf
    return order


def hf_name(gguf_name: str) -> str | None:
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", gguf_name)
    if m and m.group(2) in HF_NAMES:
        return f"layers.{m.group(1)}.{HF_NAMES[m.group(2)]}.weight"
    if gguf_name in ("token_embd.weight", "output.weight"):
        return "embed_tokens.weight" if gguf_name == "token_embd.weight" else "lm_head.weight"
    return None


def _names_agree(matrix: GgufMatrix, weight: ConstWeight) -> bool:
    want = hf_name(matrix.name)
    if want is None:
        return False
    tied = matrix.name == "token_embd.weight" and "lm_head.weight" in weight.source
    return want in weight.source or tied


def match_weights(weights: list[ConstWeight], matrices: list[GgufMatrix]) -> tuple[list[Match], list[ConstWeight]]:
    """(weights matched to a GGUF matrix with their row order, weights no GGUF matrix holds)."""
    wanted: dict[tuple, list[tuple[ConstWeight, np.ndarray]]] = {}
    for w in weights:
        hashes = row_hashes(w.weight.T)
        wanted.setdefault((w.shape[1], w.shape[0], w.storage.name, _signature(hashes)), []).append((w, hashes))
    storages = {w.storage for w in weights}
    matches = []
    for matrix in matrices:
        if not any(k[0] == matrix.rows and k[1] == matrix.cols for k in wanted):
            continue
        rows = matrix.dequantize()
        for storage in storages:
            hashes = row_hashes(_as_stored(rows, storage))
            for w, graph_hashes in wanted.pop((matrix.rows, matrix.cols, storage.name, _signature(hashes)), []):
                matches.append(Match(w, matrix, _order(graph_hashes, hashes), _names_agree(matrix, w)))
    matched = {id(m.weight) for m in matches}
    return matches, [w for w in weights if id(w) not in matched]
