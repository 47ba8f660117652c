"""Deliberately wrong pieces for negative tests: a lossless-sampling test must be able to fail."""
from __future__ import annotations

import torch

from dspark.models.sampling import PROB_FLOOR, sample, token_probs


def wrong_verify(target_probs, draft_next, draft_probs, verify_len, accept_noise, sample_noise):
    """A deliberately wrong acceptance rule: accept whenever p_target >= 0.5 * p_draft."""
    b, k, v = target_probs.shape
    rows = torch.clamp(torch.arange(k, device=target_probs.device), max=draft_probs.shape[1] - 1)
    q_rows = draft_probs.index_select(1, rows)
    p_tok = torch.gather(target_probs, 2, draft_next[..., None])[..., 0]
    q_tok = torch.gather(q_rows, 2, draft_next[..., None])[..., 0]
    ok = (p_tok >= 0.5 * q_tok) & (torch.arange(k, device=target_probs.device)[None] < verify_len[:, None])
    accepted = (torch.cumsum((~ok).float(), 1) == 0).sum(1)
    pick = accepted.view(b, 1, 1).expand(b, 1, v)
    p_row, q_row = torch.gather(target_probs, 1, pick)[:, 0], torch.gather(q_rows, 1, pick)[:, 0]
    res = torch.clamp(p_row - q_row, min=0)
    use = (accepted < verify_len) & (res.sum(-1) > PROB_FLOOR)
    return accepted, sample(torch.where(use[:, None], res, p_row), sample_noise)


def wrong_verify_logits(logits, temperature, draft_next, draft_probs, verify_len, accept_noise, sample_noise):
    """wrong_verify in the verifier graph's signature (dspark.models.sampling.verify_logits)."""
    return wrong_verify(token_probs(logits, temperature), draft_next, draft_probs, verify_len, accept_noise,
                        sample_noise)
