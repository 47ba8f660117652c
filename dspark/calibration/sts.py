"""Sequential Temperature Scaling of the confidence head (reference §7.1) and its reliability metrics (numpy)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BINS = 20
GRID = np.exp(np.linspace(np.log(0.25), np.log(4.0), 121))


def ece(pred: np.ndarray, label: np.ndarray, bins: int = BINS) -> float:
    """Expected calibration error over equal-width bins, each bin's gap weighted by its count."""
    if len(pred) == 0:
        return float("nan")
    idx = np.minimum((pred * bins).astype(int), bins - 1)
    total = 0.0
    for b in range(bins):
        sel = idx == b
        if sel.any():
            total += sel.sum() * abs(pred[sel].mean() - label[sel].mean())
    return float(total / len(pred))


def auc(pred: np.ndarray, label: np.ndarray) -> float:
    """Area under the ROC curve (ties count one half); nan when one class is absent."""
    pos, neg = pred[label > 0.5], pred[label <= 0.5]
    if len(pos) == 0 or len(neg) == 0:
        return float("nan")
    order = np.argsort(np.concatenate([pos, neg]), kind="mergesort")
    ranks = np.empty(len(order))
    values = np.concatenate([pos, neg])[order]
    ranks[order] = _tied_ranks(values)
    return float((ranks[:len(pos)].sum() - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg)))


def _tied_ranks(sorted_values: np.ndarray) -> np.ndarray:
    ranks = np.arange(1, len(sorted_values) + 1, dtype=float)
    start = 0
    for i in range(1, len(sorted_values) + 1):
        if i == len(sorted_values) or sorted_values[i] != sorted_values[start]:
            ranks[start:i] = ranks[start:i].mean()
            start = i
    return ranks


def brier(pred: np.ndarray, label: np.ndarray) -> float:
    return float(np.mean((pred - label) ** 2)) if len(pred) else float("nan")


def sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-z))


@dataclass
class Rounds:
    """Verified proposals: confidence logits z [N, Bk], drafts verified [N], drafts accepted [N]."""

    conf_logits: np.ndarray
    proposed: np.ndarray
    accepted: np.ndarray

    def position(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows whose proposal reached position k (1-based) and their prefix labels 1[all of 1..k accepted]."""
        sel = self.proposed >= k
        return sel, (self.accepted[sel] >= k).astype(float)


def survival(conf_logits: np.ndarray, temperatures: np.ndarray) -> np.ndarray:
    """a_k = prod_{i<=k} sigmoid(z_i / T_i) in float64."""
    return np.cumprod(sigmoid(conf_logits.astype(np.float64) / temperatures[None]), axis=1)


def fit_sts(rounds: Rounds, grid: np.ndarray = GRID) -> np.ndarray:
    """Temperatures T_1..T_Bk, each chosen (earlier ones fixed) to minimise the ECE of a_k at position k."""
    bk = rounds.conf_logits.shape[1]
    temps = np.ones(bk)
    for k in range(1, bk + 1):
        sel, label = rounds.position(k)
        if sel.sum() < 20 or label.min() == label.max():
            continue  # too few or one-sided labels: keep T = 1
        z = rounds.conf_logits[sel].astype(np.float64)
        before = np.prod(sigmoid(z[:, :k - 1] / temps[None, :k - 1]), axis=1) if k > 1 else np.ones(len(z))
        errors = [ece(before * sigmoid(z[:, k - 1] / t), label) for t in grid]
        temps[k - 1] = float(grid[int(np.argmin(errors))])
    return temps


def reliability(rounds: Rounds, temperatures: np.ndarray) -> list[dict]:
    """Per-position ECE, AUC, Brier, mean prediction and mean label of a_k."""
    a = survival(rounds.conf_logits, temperatures)
    out = []
    for k in range(1, a.shape[1] + 1):
        sel, label = rounds.position(k)
        pred = a[sel, k - 1]
        out.append({"position": k, "count": int(sel.sum()), "ece": ece(pred, label), "auc": auc(pred, label),
                    "brier": brier(pred, label), "mean_pred": float(pred.mean()) if len(pred) else float("nan"),
                    "mean_label": float(label.mean()) if len(label) else float("nan")})
    return out
