"""Numpy reference of dspark::ConfidenceTruncate (torch-free; the ONNX body, the torch op and the CUDA kernel
must all agree with it)."""
from __future__ import annotations

import numpy as np


def truncate_static(survival: np.ndarray, threshold: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """survival [B, Bk] (non-increasing), threshold [B] -> verify_len [B] int64, verify_mask [B, Bk] bool.

    A position is verified when it and every earlier position have survival >= threshold, so the mask is
    always a prefix even if survival is not monotone."""
    keep = survival >= np.asarray(threshold)[:, None]
    mask = np.cumsum(~keep, axis=1) == 0
    return mask.sum(axis=1).astype(np.int64), mask
