"""Numpy reference of dspark::ConfidenceTruncate (torch-free). The ONNX function body, the torch op used at export
and the CUDA kernel of the TensorRT plugin must all agree with it.

Inputs (fixed shapes, so a step stays capturable in a CUDA graph):
  survival [B, Bk]  calibrated prefix survival a_{r,j} (non-increasing in j)
  threshold [B]     mode STATIC
  sps [N]           mode SCHEDULE: verifier steps/s at n = 1..N batch tokens (sps[n-1] > 0)
  budget [1]        mode TOPK: draft tokens to admit this step (from confidences two rounds old)
  active [B]        live slots; inactive slots verify nothing and cost nothing
Outputs: verify_len [B] (int64) and verify_mask [B, Bk] (bool), always a prefix per request.

Batch-token cost `n` of an admission: FLAT = R + sum(l_r) (a ragged batch, the paper's setting);
PADDED = R * (1 + max(l_r)) (a padded [R, T] batch, what dspark's ONNX Runtime verifier runs).
"""
from __future__ import annotations

import numpy as np

STATIC, SCHEDULE, TOPK = 0, 1, 2
FLAT, PADDED = 0, 1


def truncate_static(survival: np.ndarray, threshold: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Verify the prefix whose every survival reaches the request's threshold."""
    keep = survival >= np.asarray(threshold)[:, None]
    mask = np.cumsum(~keep, axis=1) == 0
    return mask.sum(axis=1).astype(np.int64), mask


def candidate_order(survival: np.ndarray, active: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """All (r, j) with a > 0 on live slots, by survival descending; ties go to the smaller j, then smaller r
    (so each request's candidates come in position order). Returns (rows, cols, values)."""
    b, bk = survival.shape
    a = np.where(np.asarray(active, bool)[:, None], survival, 0.0).astype(np.float64)
    flat = a.T.reshape(-1)  # index j * B + r: a stable sort on -a breaks ties by (j, r)
    order = np.argsort(-flat, kind="stable")
    order = order[flat[order] > 0]
    return order % b, order // b, flat[order]


def schedule(survival: np.ndarray, sps: np.ndarray, active: np.ndarray, layout: int = FLAT,
             early_stop: bool = True) -> np.ndarray:
    """Algorithm 1: admit candidates in survival order while expected throughput theta = tau * SPS(n) improves.

    early_stop=True stops at the first non-improvement (lossless: admitting (r, j) depends only on entries
    ranked above it, i.e. on request r's earlier positions and on other requests). early_stop=False scans the
    whole path and keeps the best prefix (the unconstrained search, used for the top-K budget).
    Arithmetic is float32 in the order the ONNX body and the CUDA kernel use (tau_i = R + cumsum(a)_i), so all
    three make the same decision even at near-ties. `sps` must be positive; n beyond the table is never admitted.
    """
    b = survival.shape[0]
    live = np.asarray(active, bool)
    sps = np.asarray(sps, dtype=np.float32)
    n_live = int(live.sum())
    lengths = np.zeros(b, dtype=np.int64)
    if n_live == 0:
        return lengths
    rows, cols, vals = candidate_order(survival, live)
    tau = np.float32(n_live) + np.cumsum(vals.astype(np.float32), dtype=np.float32)
    best = np.float32(n_live) * sps[min(n_live, len(sps)) - 1]
    best_lengths = lengths.copy()
    widest = 0
    for i, (r, j) in enumerate(zip(rows, cols)):
        lengths[r] = j + 1
        widest = max(widest, j + 1)
        n = n_live + i + 1 if layout == FLAT else n_live * (1 + widest)
        theta = tau[i] * sps[n - 1] if n <= len(sps) else None
        if theta is not None and theta > best:
            best, best_lengths = theta, lengths.copy()
        elif early_stop:
            break
    return best_lengths


def budget_from(survival_old: np.ndarray, sps: np.ndarray, active: np.ndarray, layout: int = FLAT) -> int:
    """K for the top-K mode: drafts admitted by the unconstrained search over confidences two rounds old."""
    return int(schedule(survival_old, sps, active, layout, early_stop=False).sum())


def top_k(survival: np.ndarray, budget: int, active: np.ndarray) -> np.ndarray:
    """Admit the `budget` best candidates by current survival."""
    lengths = np.zeros(survival.shape[0], dtype=np.int64)
    rows, cols, _ = candidate_order(survival, active)
    for r, j in zip(rows[:max(0, int(budget))], cols[:max(0, int(budget))]):  # ranked above: earlier positions
        lengths[r] = j + 1
    return lengths


def confidence_truncate(survival, threshold=None, sps=None, budget=None, active=None, mode: int = STATIC,
                        layout: int = FLAT) -> tuple[np.ndarray, np.ndarray]:
    survival = np.asarray(survival, dtype=np.float32)
    b, bk = survival.shape
    active = np.ones(b, bool) if active is None else np.asarray(active, bool)
    if mode == STATIC:
        lengths, _ = truncate_static(survival, threshold)
        lengths = np.where(active, lengths, 0)
    elif mode == SCHEDULE:
        lengths = schedule(survival, sps, active, layout)
    elif mode == TOPK:
        lengths = top_k(survival, int(np.asarray(budget).reshape(-1)[0]), active)
    else:
        raise ValueError(f"unknown ConfidenceTruncate mode {mode}")
    lengths = lengths.astype(np.int64)
    return lengths, np.arange(bk)[None, :] < lengths[:, None]
