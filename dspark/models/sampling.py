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


# -- sampling parameters (the sampler graph: dspark.export.graphs.SamplerGraph) ----------------------------------
#
# The order is vLLM's: logit_bias, then the penalties (on the logits), then temperature, min_p, top_k, top_p (on the
# probabilities). A greedy request takes the argmax of its penalised logits.

THRESHOLD_STEPS = 40  # bisection steps of a top_k / top_p threshold: exact up to values 2^-40 of the row's max apart


def penalised_logits(logits: torch.Tensor, draft_next: torch.Tensor, counts: torch.Tensor, prompt_seen: torch.Tensor,
                     logit_bias: torch.Tensor, repetition: torch.Tensor, presence: torch.Tensor,
                     frequency: torch.Tensor) -> torch.Tensor:
    """logits [B, K, V] at the K verify rows; draft_next [B, K] the token row j judges, so rows after j see it as
    emitted (row j sees the drafts of rows 0..j-1, as autoregressive decoding would once they are accepted);
    counts [B, V] the tokens emitted before the round's first row; prompt_seen [B, V] 1 where the prompt holds a
    token; logit_bias [B, V]; repetition / presence / frequency [B] (1, 0, 0: off).

    repetition divides a seen token's positive logit and multiplies a negative one (seen: in the prompt or emitted);
    presence and frequency subtract p * [count > 0] + f * count over the emitted tokens (OpenAI's definition)."""
    b, k, v = logits.shape
    hit = (draft_next.unsqueeze(-1) == torch.arange(v, device=logits.device)).to(torch.float32)  # [B, K, V]
    count = counts.unsqueeze(1) + (torch.cumsum(hit, dim=1) - hit)  # exclusive: the drafts of earlier rows
    x = logits.float() + logit_bias.unsqueeze(1)
    rep = repetition.view(b, 1, 1)
    seen = (count > 0) | (prompt_seen.unsqueeze(1) > 0)
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    emitted = (count > 0).to(torch.float32)
    return x - presence.view(b, 1, 1) * emitted - frequency.view(b, 1, 1) * count


def processed_logprobs(logits: torch.Tensor, probs: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """The log-probabilities a request's logprobs report: penalised logits [B, K, V] over the tokens `probs` (the
    filtered distribution, filtered_probs) keeps, at the request's temperature; -inf for the tokens filtered out.
    Greedy rows (one-hot probs) report the penalised logits' own distribution at temperature 1."""
    b = logits.shape[0]
    t = temperature.float().view(b, 1, 1)
    greedy = t < GREEDY_EPS
    z = logits / torch.where(greedy, torch.ones_like(t), t)
    kept = (probs > 0) | greedy
    floor = torch.full_like(z, float("-inf"))
    z = torch.where(kept, z, floor)
    return torch.where(kept, z - torch.logsumexp(z, dim=-1, keepdim=True), floor)


def _largest_threshold(values: torch.Tensor, enough) -> torch.Tensor:
    """The largest t in [0, max(values)] (per row of values [..., V], to THRESHOLD_STEPS bisection steps) at which
    enough(values >= t) still holds; enough must hold at 0 and be monotone. A fixed loop of comparisons and sums:
    TensorRT's TopK stops at 3840, under a vocabulary."""
    lo = torch.zeros_like(values[..., :1])
    hi = values.max(dim=-1, keepdim=True).values
    for _ in range(THRESHOLD_STEPS):
        mid = (lo + hi) * 0.5
        ok = enough(values >= mid)
        lo, hi = torch.where(ok, mid, lo), torch.where(ok, hi, mid)
    return lo


def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   min_p: torch.Tensor) -> torch.Tensor:
    """Penalised logits [B, K, V] -> the distribution a request samples from [B, K, V] (normalised; one-hot argmax
    where greedy). min_p keeps tokens of at least min_p x the top probability; top_k (0: off) the k most likely
    (ties at the k-th kept); top_p the smallest most-likely set holding top_p of the mass left (ties kept)."""
    b, _, v = logits.shape
    probs = token_probs(logits, temperature)
    probs = torch.where(probs >= min_p.view(b, 1, 1) * probs.max(dim=-1, keepdim=True).values, probs,
                        torch.zeros_like(probs))
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, v)).to(torch.float32).view(b, 1, 1)
    kth = _largest_threshold(probs, lambda keep: keep.to(torch.float32).sum(dim=-1, keepdim=True) >= k)
    probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    p = top_p.view(b, 1, 1)
    mass = probs.sum(dim=-1, keepdim=True) * p
    nucleus = _largest_threshold(probs, lambda keep: (probs * keep).sum(dim=-1, keepdim=True) >= mass)
    nucleus = torch.where(p >= 1.0, torch.zeros_like(nucleus), nucleus)  # (a float sum may lose the smallest)
    probs = torch.where(probs >= nucleus, probs, torch.zeros_like(probs))
    return probs / probs.sum(dim=-1, keepdim=True)
