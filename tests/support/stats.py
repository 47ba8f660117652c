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


def processed(logits: np.ndarray, prompt: list[int], emitted: tuple[int, ...], params, temperature: float) -> np.ndarray:
    """The distribution a request with SamplingParams `params` samples from after `emitted`, written out with a
    sort (the graphs bisect a threshold instead): bias, penalties, temperature, min_p, top_k, top_p."""
    x = np.asarray(logits, dtype=np.float64).copy()
    v = x.shape[-1]
    for token, bias in params.logit_bias.items():
        x[token] += bias
    counts = np.bincount(np.asarray(emitted, dtype=np.int64), minlength=v).astype(np.float64)
    seen = counts > 0
    seen[np.asarray(prompt)] = True
    rep = params.repetition_penalty
    x = np.where(seen, np.where(x > 0, x / rep, x * rep), x)
    x = x - params.presence_penalty * (counts > 0) - params.frequency_penalty * counts
    p = np.exp((x - x.max()) / temperature)
    p /= p.sum()
    p[p < params.min_p * p.max()] = 0.0
    if params.top_k:
        kth = np.sort(p)[::-1][min(params.top_k, v) - 1]
        p[p < kth] = 0.0
    if params.top_p < 1.0:
        s = np.sort(p)[::-1]
        m = int(np.searchsorted(np.cumsum(s), params.top_p * s.sum()))  # first index whose mass reaches top_p
        p[p < s[min(m, v - 1)]] = 0.0
    return p / p.sum()


@torch.no_grad()
def exact_joint_processed(hf_model, prompt: list[int], depth: int, vocab: int, params, temperature: float = 1.0
                          ) -> dict[tuple[int, ...], float]:
    """exact_joint for autoregressive sampling from the processed distribution (`processed`) at every step."""
    joint = {(): 1.0}
    for _ in range(depth):
        prefixes = list(joint)
        ids = torch.tensor([prompt + list(p) for p in prefixes])
        logits = hf_model(ids).logits[:, -1].double().numpy()
        joint = {p + (v,): joint[p] * float(q[v]) for i, p in enumerate(prefixes)
                 for q in [processed(logits[i], prompt, p, params, temperature)] for v in range(vocab) if q[v] > 0}
    return joint
