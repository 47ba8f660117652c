"""dspark::ConfidenceTruncate on the torch side: the numpy reference in eager mode, and a single custom node
during ONNX export (the export then attaches the op's ONNX function body, see dspark.ops.confidence_truncate.onnx_function)."""
from __future__ import annotations

import torch

from dspark.ops.confidence_truncate import reference
from dspark.ops.confidence_truncate.onnx_function import DOMAIN, OP_NAME, OP_VERSION


def confidence_truncate(survival: torch.Tensor, threshold: torch.Tensor, sps: torch.Tensor, budget: torch.Tensor,
                        active: torch.Tensor, mode: torch.Tensor, layout: torch.Tensor):
    """survival [B, Bk] -> verify_len [B] int64, verify_mask [B, Bk] bool (a prefix per request)."""
    if torch.onnx.is_in_onnx_export():
        verify_len, verify_mask = torch.onnx.ops.symbolic_multi_out(
            f"{DOMAIN}::{OP_NAME}", (survival, threshold, sps, budget, active, mode, layout), {},
            dtypes=(torch.int64, torch.bool), shapes=(survival.shape[:1], survival.shape), version=OP_VERSION)
        return verify_len, verify_mask
    if survival.is_meta:  # shapes only (the export's output specs): no data to decide from
        return (torch.empty(survival.shape[:1], dtype=torch.int64, device="meta"),
                torch.empty(survival.shape, dtype=torch.bool, device="meta"))
    lengths, mask = reference.confidence_truncate(
        survival.detach().float().cpu().numpy(), threshold.cpu().numpy(), sps.cpu().numpy(), budget.cpu().numpy(),
        active.cpu().numpy(), int(mode.reshape(-1)[0]), int(layout.reshape(-1)[0]))
    return torch.from_numpy(lengths).to(survival.device), torch.from_numpy(mask).to(survival.device)
