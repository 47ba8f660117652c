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
    p_tok = torch.gather(target_probs, 2, draft_next.unsqueeze(-1)).squeeze(-1)
    accepted = _accepted(p_tok, _draft_token_probs(draft_probs, draft_next), verify_len, accept_noise)
    p_row = _row(target_probs, accepted)
    return accepted, _correction(p_row, _draft_row(draft_probs, accepted), accepted, verify_len, sample_noise)


def verify_logits(logits: torch.Tensor, temperature: torch.Tensor, draft_next: torch.Tensor, draft_probs: torch.Tensor,
                  verify_len: torch.Tensor, accept_noise: torch.Tensor,
                  sample_noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """verify(token_probs(logits, temperature), ...) with the same decisions, bit for bit, at a third of the cost:
    the one-hot argmax distributions of greedy rows are never written out over the vocabulary, only read where
    acceptance looks (the judged draft of every row, the whole row after the accepted prefix)."""
    b = logits.shape[0]
    greedy = (temperature.float() < GREEDY_EPS).view(b, 1)
    t = temperature.float().view(b, 1, 1)
    logits = logits.float()
    soft = torch.softmax(logits / torch.clamp(t, min=GREEDY_EPS), dim=-1)  # [B, K, V]
    best = logits.argmax(dim=-1)  # [B, K]
    hit = (draft_next == best).to(soft.dtype)
    soft_tok = torch.gather(soft, 2, draft_next.unsqueeze(-1)).squeeze(-1)
    p_tok = torch.where(greedy, hit, soft_tok)
    accepted = _accepted(p_tok, _draft_token_probs(draft_probs, draft_next), verify_len, accept_noise)
    vocab = torch.arange(logits.shape[-1], device=logits.device)
    hard_row = (vocab == torch.gather(best, 1, accepted.view(b, 1))).to(soft.dtype)  # [B, V]
    p_row = torch.where(greedy, hard_row, _row(soft, accepted))
    return accepted, _correction(p_row, _draft_row(draft_probs, accepted), accepted, verify_len, sample_noise)


def _draft_token_probs(draft_probs: torch.Tensor, draft_next: torch.Tensor) -> torch.Tensor:
    """q(d_{j+1}) at every row j [B, K]: draft row min(j, Kd - 1), read without copying rows of the vocabulary."""
    b, kd, v = draft_probs.shape
    k = draft_next.shape[1]
    ar = torch.arange(k, device=draft_next.device)
    rows = torch.minimum(ar, torch.full_like(ar, kd - 1))  # Min, not Clip: TensorRT clips floats only
    return torch.gather(draft_probs.reshape(b, kd * v), 1, rows.unsqueeze(0) * v + draft_next)


def _accepted(p_tok: torch.Tensor, q_tok: torch.Tensor, verify_len: torch.Tensor,
              accept_noise: torch.Tensor) -> torch.Tensor:
    """The leading run of accepted drafts [B]: u_j <= p(d) / q(d) at each proposed row."""
    ratio = p_tok / torch.clamp(q_tok, min=PROB_FLOOR)
    valid = torch.arange(p_tok.shape[1], device=p_tok.device)[None, :] < verify_len[:, None]
    ok = (accept_noise <= ratio) & valid
    # Float cumsum: TensorRT's CumSum takes float types only (counts stay exact).
    return (torch.cumsum((~ok).to(torch.float32), dim=1) == 0).sum(dim=1)


def _row(probs: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
    """probs [B, K, V] at row `accepted` of each request -> [B, V] (whole rows taken: no index over the vocabulary)."""
    b, k, v = probs.shape
    flat = torch.arange(b, device=probs.device) * k + accepted
    return probs.reshape(b * k, v).index_select(0, flat)


def _draft_row(draft_probs: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
    """The draft distribution row `accepted` judges by (row min(accepted, Kd - 1)) [B, V]."""
    kd = draft_probs.shape[1]
    return _row(draft_probs, torch.minimum(accepted, torch.full_like(accepted, kd - 1)))


def _correction(p_row: torch.Tensor, q_row: torch.Tensor, accepted: torch.Tensor, verify_len: torch.Tensor,
                sample_noise: torch.Tensor) -> torch.Tensor:
    """The token after the accepted prefix: from the residual (p - q)+ after a rejection, else from p (bonus)."""
    residual = torch.clamp(p_row - q_row, min=0.0)
    use_residual = (accepted < verify_len) & (residual.sum(dim=-1) > PROB_FLOOR)
    dist = torch.where(use_residual[:, None], residual, p_row)
    return sample(dist, sample_noise)


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
    presence and frequency subtract p * [count > 0] + f * count over the emitted tokens (OpenAI's definition).
    Masks over the vocabulary are 0/1 factors, not Where: ONNX Runtime's CPU Where is ~8x slower at this size."""
    b, k, v = logits.shape
    hit = (draft_next.unsqueeze(-1) == torch.arange(v, device=logits.device)).to(torch.float32)  # [B, K, V]
    count = counts.unsqueeze(1) + (torch.cumsum(hit, dim=1) - hit)  # exclusive: the drafts of earlier rows
    x = logits.float() + logit_bias.unsqueeze(1)
    rep = repetition.view(b, 1, 1)
    emitted = (count > 0).to(torch.float32)
    seen = torch.maximum(emitted, (prompt_seen.unsqueeze(1) > 0).to(torch.float32))
    positive = (x > 0).to(torch.float32)
    x = x * (1.0 + seen * (positive * (1.0 / rep - 1.0) + (1.0 - positive) * (rep - 1.0)))  # (1 where unseen)
    return x - presence.view(b, 1, 1) * emitted - frequency.view(b, 1, 1) * count


def processed_logprobs(logits: torch.Tensor, probs: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """The log-probabilities a request's logprobs report: penalised logits [B, K, V] over the tokens `probs` (the
    filtered distribution, filtered_probs) keeps, at the request's temperature; -inf for the tokens filtered out.
    Greedy rows (one-hot probs) report the penalised logits' own distribution at temperature 1."""
    b = logits.shape[0]
    t = temperature.float().view(b, 1, 1)
    greedy = t < GREEDY_EPS
    z = logits / torch.where(greedy, torch.ones_like(t), t)
    kept = torch.maximum((probs > 0).to(torch.float32), greedy.to(torch.float32))
    top = z.max(dim=-1, keepdim=True).values  # a kept token's: every filter keeps the most likely
    lse = top + torch.log((torch.exp(z - top) * kept).sum(dim=-1, keepdim=True))
    return z - lse + torch.log(kept)  # log 0 = -inf for the tokens filtered out


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


CANDIDATES = 1024  # the most likely tokens a top_k / top_p threshold is read from (TensorRT's TopK stops at 3840)


def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   min_p: torch.Tensor) -> torch.Tensor:
    """Penalised logits [B, K, V] -> the distribution a request samples from [B, K, V] (normalised; one-hot argmax
    where greedy). min_p keeps tokens of at least min_p x the top probability; top_k (0: off) the k most likely
    (ties at the k-th kept); top_p the smallest most-likely set holding top_p of the mass left (ties kept).

    The top_k and top_p thresholds are read from the CANDIDATES most likely tokens where they lie among them (a
    sort of those alone); only when some row's lie further down does the graph take the bisection over the whole
    vocabulary, and then for those rows alone, so a row's distribution never depends on the others in its batch."""
    b, _, v = logits.shape
    probs = token_probs(logits, temperature)
    probs = probs * (probs >= min_p.view(b, 1, 1) * probs.max(dim=-1, keepdim=True).values).to(torch.float32)
    k = torch.where((top_k > 0) & (top_k < v), top_k, torch.zeros_like(top_k)).view(b, 1, 1)  # 0: off
    p = top_p.view(b, 1, 1)
    kth, nucleus, complete = _thresholds_from_candidates(probs, k, p)
    kth, nucleus = _cond(complete.all(), _candidate_thresholds, _bisected_thresholds,
                         (probs, k, p, kth, nucleus, complete))
    probs = probs * ((probs >= kth) & (probs >= nucleus)).to(torch.float32)
    return probs / probs.sum(dim=-1, keepdim=True)


def _thresholds_from_candidates(probs: torch.Tensor, k: torch.Tensor, p: torch.Tensor):
    """The top_k and top_p thresholds [B, K, 1] read from the sorted most likely tokens, and whether they are the
    exact ones (the k-th token and the nucleus's last lie among the candidates). A threshold t keeps probs >= t."""
    c = min(CANDIDATES, probs.shape[-1])
    top = torch.topk(probs, c, dim=-1).values  # descending
    at = torch.maximum(torch.minimum(k, torch.full_like(k, c)) - 1, torch.zeros_like(k))  # Min/Max: int-safe in TRT
    at = at.expand(*top.shape[:2], 1)
    kth = torch.where(k > 0, torch.gather(top, 2, at), torch.zeros_like(top[..., :1]))
    kept = torch.where(top >= kth, top, torch.zeros_like(top))
    mass = (probs * (probs >= kth).to(torch.float32)).sum(dim=-1, keepdim=True) * p
    reached = torch.cumsum(kept, dim=-1) >= mass
    found = reached.any(dim=-1, keepdim=True)
    first = torch.argmax(reached.to(torch.int32), dim=-1, keepdim=True)
    nucleus = torch.where(p >= 1.0, torch.zeros_like(kth), torch.gather(kept, 2, first))
    complete = (k <= c) & (found | (p >= 1.0))  # (k = 0: off)
    return kth, nucleus, complete


def _cond(pred: torch.Tensor, then, otherwise, args: tuple):
    """torch.cond (an ONNX If when exported); on the meta device outside an export (the exporter's shape run), which
    branch runs cannot be known and either gives the shapes."""
    if pred.is_meta and not (torch.compiler.is_exporting() or torch.compiler.is_compiling()):
        return otherwise(*args)
    return torch.cond(pred, then, otherwise, args)


def _candidate_thresholds(probs, k, p, kth, nucleus, complete):
    return kth.clone(), nucleus.clone()


def _bisected_thresholds(probs, k, p, kth, nucleus, complete):
    """The thresholds of the rows whose candidates do not hold them, by bisection over the whole vocabulary."""
    kf = torch.where(k > 0, k, torch.full_like(k, probs.shape[-1])).to(torch.float32)
    full_kth = _largest_threshold(probs, lambda keep: keep.to(torch.float32).sum(dim=-1, keepdim=True) >= kf)
    kept = probs * (probs >= full_kth).to(torch.float32)
    mass = kept.sum(dim=-1, keepdim=True) * p
    full_nucleus = _largest_threshold(kept, lambda keep: (kept * keep).sum(dim=-1, keepdim=True) >= mass)
    full_nucleus = torch.where(p >= 1.0, torch.zeros_like(full_nucleus), full_nucleus)  # (a float sum may lose one)
    return torch.where(complete, kth, full_kth), torch.where(complete, nucleus, full_nucleus)
