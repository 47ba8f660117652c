"""Sampling and speculative acceptance as tensor programs driven by uniform noise.

The same functions run in the PyTorch reference and are traced into the ONNX graphs, so a bundle and the
reference make the same decisions from the same noise. Conventions:
  * temperature < GREEDY_EPS means greedy: the distribution is the one-hot argmax, so greedy is the same
    program as sampling (exact-match acceptance and argmax correction fall out of the formulas);
  * uniforms are in (0, 1]; a token is the first index whose CDF reaches u * total, and a draft token is
    accepted iff u <= p_target / max(p_draft, 1e-8) (P(u <= r) = r for such u).
"""
from __future__ import annotations

import torch

from dspark.noise import GREEDY_EPS
PROB_FLOOR = 1e-8


def token_probs(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """logits [B, ..., V], temperature [B] -> probabilities (one-hot argmax where greedy)."""
    t = temperature.float().view(-1, *([1] * (logits.dim() - 1)))
    logits = logits.float()
    soft = torch.softmax(logits / torch.clamp(t, min=GREEDY_EPS), dim=-1)
    vocab = torch.arange(logits.shape[-1], device=logits.device)
    hard = (vocab == logits.argmax(dim=-1, keepdim=True)).to(soft.dtype)
    return torch.where(t < GREEDY_EPS, hard, soft)


def sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: probs [..., V] (need not be normalised), u [...] in (0, 1] -> indices [...]."""
    cdf = torch.cumsum(probs, dim=-1)
    reached = cdf >= u.unsqueeze(-1) * cdf[..., -1:]
    return torch.argmax(reached.to(torch.int32), dim=-1)


def verify(
    target_probs: torch.Tensor,
    draft_next: torch.Tensor,
    draft_probs: torch.Tensor,
    verify_len: torch.Tensor,
    accept_noise: torch.Tensor,
    sample_noise: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative acceptance with residual resampling and a bonus token.

    target_probs [B, K, V]: target distribution at verify row j (the row after the anchor plus j drafts).
    draft_next [B, K]: the draft token that row j judges (d_{j+1}); the last entry is padding.
    draft_probs [B, Kd, V]: draft distribution of d_{j+1} at row j (rows past Kd-1 are never used).
    verify_len [B]: drafts actually proposed (0..K-1). accept_noise [B, K], sample_noise [B].
    Returns (accepted [B], next_token [B]): the length of the accepted prefix and the correction/bonus token.
    """
    b, k, v = target_probs.shape
    kd = draft_probs.shape[1]
    ar = torch.arange(k, device=target_probs.device)
    rows = torch.minimum(ar, torch.full_like(ar, kd - 1))  # Min, not Clip: TensorRT clips floats only
    q_rows = draft_probs.index_select(1, rows)  # [B, K, V]
    p_tok = torch.gather(target_probs, 2, draft_next.unsqueeze(-1)).squeeze(-1)
    q_tok = torch.gather(q_rows, 2, draft_next.unsqueeze(-1)).squeeze(-1)
    ratio = p_tok / torch.clamp(q_tok, min=PROB_FLOOR)
    valid = torch.arange(k, device=target_probs.device)[None, :] < verify_len[:, None]
    ok = (accept_noise <= ratio) & valid
    # Leading run of accepts. Float cumsum: TensorRT's CumSum takes float types only (counts stay exact).
    accepted = (torch.cumsum((~ok).to(torch.float32), dim=1) == 0).sum(dim=1)
    pick = accepted.view(b, 1, 1).expand(b, 1, v)
    p_row = torch.gather(target_probs, 1, pick).squeeze(1)
    q_row = torch.gather(q_rows, 1, pick).squeeze(1)
    residual = torch.clamp(p_row - q_row, min=0.0)
    use_residual = (accepted < verify_len) & (residual.sum(dim=-1) > PROB_FLOOR)
    dist = torch.where(use_residual[:, None], residual, p_row)
    return accepted, sample(dist, sample_noise)


def prefix_survival(conf_logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """Calibrated prefix survival a_k = prod_{i<=k} sigmoid(z_i / T_i); conf_logits [B, Bk], temperatures [Bk].

    Computed as exp(cumsum(log sigmoid)) because ONNX has no cumulative product."""
    log_sig = -torch.nn.functional.softplus(-conf_logits.float() / temperatures.float())
    return torch.exp(torch.cumsum(log_sig, dim=-1))
