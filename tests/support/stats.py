"""Exact target distributions and a chi-square goodness-of-fit check for the lossless-sampling tests."""
from __future__ import annotations

from collections import Counter

import numpy as np
import torch
from scipy.stats import chisquare


@torch.no_grad()
def exact_joint(hf_model, prompt: list[int], depth: int, vocab: int) -> dict[tuple[int, ...], float]:
    """P(t_1..t_depth | prompt) under the target at temperature 1, by enumerating every prefix."""
    joint = {(): 1.0}
    for _ in range(depth):
        prefixes = list(joint)
        ids = torch.tensor([prompt + list(p) for p in prefixes])
        probs = torch.softmax(hf_model(ids).logits[:, -1].double(), dim=-1)
        joint = {p + (v,): joint[p] * float(probs[i, v]) for i, p in enumerate(prefixes) for v in range(vocab)}
    return joint


def chi_square_pvalue(samples: list[tuple[int, ...]], expected: dict[tuple[int, ...], float], min_count: float = 5.0):
    """Pearson chi-square of observed joint counts vs expected probabilities; sparse cells are pooled."""
    n = len(samples)
    counts = Counter(samples)
    assert set(counts) <= set(expected), "sampled a sequence with zero target probability"
    obs, exp, pool_o, pool_e = [], [], 0.0, 0.0
    for key, p in expected.items():
        if n * p >= min_count:
            obs.append(counts.get(key, 0))
            exp.append(n * p)
        else:
            pool_o += counts.get(key, 0)
            pool_e += n * p
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    exp = np.asarray(exp) * (n / np.sum(exp))
    return float(chisquare(np.asarray(obs, dtype=float), exp).pvalue)
