"""dspark::ConfidenceTruncate on the torch side: the eager implementation, and a single custom node during ONNX
export (the export then attaches the op's ONNX function body, see dspark.plugins.truncate_onnx)."""
from __future__ import annotations

import torch

from dspark.plugins.truncate_onnx import DOMAIN, OP_NAME, OP_VERSION


def _truncate_static(survival: torch.Tensor, threshold: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    keep = survival >= threshold[:, None]
    mask = torch.cumsum((~keep).to(torch.float32), dim=1) == 0
    return mask.sum(dim=1), mask


def confidence_truncate(survival: torch.Tensor, threshold: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """survival [B, Bk], threshold [B] -> verify_len [B] int64, verify_mask [B, Bk] bool (a prefix)."""
    if torch.onnx.is_in_onnx_export():
        verify_len, verify_mask = torch.onnx.ops.symbolic_multi_out(
            f"{DOMAIN}::{OP_NAME}", (survival, threshold), {}, dtypes=(torch.int64, torch.bool),
            shapes=(survival.shape[:1], survival.shape), version=OP_VERSION)
        return verify_len, verify_mask
    return _truncate_static(survival, threshold)
