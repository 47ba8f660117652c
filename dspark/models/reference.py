"""PyTorch reference decoding: autoregressive and DSpark (reference §5), for a batch of requests.

Everything the ONNX bundle and the runtime do is checked against these loops. Batch 1 is the reference
evaluator's setting; larger batches run requests of different lengths side by side (per-request cache
lengths, padded blocks), which the lossless-sampling tests use to draw tens of thousands of samples at once.

Noise is consumed in a fixed order per step, so a runtime drawing from the same seed makes the same choices:
prefill: accept [B, 1], sample [B]; each DSpark round: draft [B, Bk], accept [B, T], sample [B].
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from dspark.errors import DSparkError
from dspark.noise import RequestNoise, stack
from dspark.models.drafter import DSparkDrafter
from dspark.models.layer_kv import kv_groups
from dspark.models.sampling import token_probs, verify
from dspark.models.target import TargetModel


@dataclass
class DecodeResult:
    token_ids: list[int] = field(default_factory=list)
    rounds: int = 0
    accepted: list[int] = field(default_factory=list)  # accepted drafts per round
    proposed: list[int] = field(default_factory=list)  # drafts sent to verification per round
    committed: list[int] = field(default_factory=list)  # tokens committed per round (tau of the round)
    stopped: bool = False  # ended on a stop token (vs max_tokens)

    @property
    def tau(self) -> float:
        """Mean tokens per round including the bonus/correction token (the paper's tau)."""
        return float(np.mean(self.committed)) if self.committed else 0.0


def _noise(noises: list[RequestNoise], live: list[bool], n: int) -> torch.Tensor:
    return torch.from_numpy(stack([src if alive else None for src, alive in zip(noises, live)], n))


def _mask(lengths: list[int], capacity: int) -> torch.Tensor:
    """[B, capacity] 0/1: each request's valid cache prefix (graphs attend over the whole capacity)."""
    return (torch.arange(capacity)[None, :] < torch.tensor(lengths)[:, None]).to(torch.int64)


def _write(cache, new, at: list[int], count: list[int]) -> None:
    """Write each request's new K/V rows into its cache rows (a uniform [L, 2, B, Hkv, cap, hd] or a LayerKV)."""
    for cache_g, new_g in zip(kv_groups(cache), kv_groups(new)):
        cap = cache_g.shape[-2]
        for b, (start, n) in enumerate(zip(at, count)):
            if start + new_g.shape[-2] > cap:
                raise DSparkError(f"context overflow: {start + new_g.shape[-2]} positions exceed the KV capacity {cap}")
            cache_g[:, :, b, :, start:start + n] = new_g[:, :, b, :, :n]


def _capacity(cache) -> int:
    return kv_groups(cache)[0].shape[-2]


def _pad(rows: list[list[int]], fill: int = 0) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [fill] * (width - len(r)) for r in rows], dtype=torch.int64)


def _prefill(target: TargetModel, prompts: list[list[int]], kv: torch.Tensor, temp: torch.Tensor,
             noises: list[RequestNoise]):
    lengths = [len(p) for p in prompts]
    if min(lengths) == 0:
        raise DSparkError("empty prompt: give at least one token")
    b = len(prompts)
    step = target(_pad(prompts), _mask([0] * b, _capacity(kv)), kv)
    _write(kv, step.new_kv, [0] * b, lengths)
    last = step.hidden[torch.arange(b), torch.tensor(lengths) - 1][:, None]
    probs = token_probs(target.logits(last), temp)
    zero = torch.zeros(b, dtype=torch.int64)
    live = [True] * b
    _, first = verify(probs, zero[:, None], probs, zero, _noise(noises, live, 1), _noise(noises, live, 1)[:, 0])
    return step, first, lengths


@torch.no_grad()
def generate_ar(target: TargetModel, prompts: list[list[int]], max_tokens: int, temperature: float = 0.0,
                seed: int = 0, stop_ids: tuple[int, ...] = (), capacity: int | None = None) -> list[DecodeResult]:
    b = len(prompts)
    noises = [RequestNoise(seed, i) for i in range(b)]
    kv = target.new_cache(b, capacity or max(map(len, prompts)) + max_tokens + 1)
    temp = torch.full((b,), float(temperature))
    zero = torch.zeros(b, dtype=torch.int64)
    _, nxt, cache_len = _prefill(target, prompts, kv, temp, noises)
    results = [DecodeResult() for _ in range(b)]
    live = [True] * b
    while True:
        for i in range(b):
            if live[i]:
                tok = int(nxt[i])
                results[i].token_ids.append(tok)
                if tok in stop_ids:
                    results[i].stopped, live[i] = True, False
                elif len(results[i].token_ids) >= max_tokens:
                    live[i] = False
        if not any(live):
            break
        step = target(nxt[:, None], _mask(cache_len, _capacity(kv)), kv)
        _write(kv, step.new_kv, cache_len, [1] * b)
        cache_len = [n + 1 if live[i] else n for i, n in enumerate(cache_len)]
        probs = token_probs(target.logits(step.hidden), temp)
        _, nxt = verify(probs, zero[:, None], probs, zero, _noise(noises, live, 1), _noise(noises, live, 1)[:, 0])
    return results


def _verify_block(target: TargetModel, kv: torch.Tensor, cache_len: list[int], anchor: torch.Tensor, block,
                  verify_len: torch.Tensor, temp: torch.Tensor, noises: list[RequestNoise], live: list[bool]):
    """The target over [anchor, first drafts] of every request, then acceptance and the bonus/correction token."""
    b, bk = block.tokens.shape
    t = 1 + int(verify_len.max())
    tokens = torch.cat([anchor[:, None], block.tokens[:, :t - 1]], dim=1)
    step = target(tokens, _mask(cache_len, _capacity(kv)), kv)
    _write(kv, step.new_kv, cache_len, [t] * b)
    probs = token_probs(target.logits(step.hidden), temp)
    draft_next = torch.cat([block.tokens[:, :t - 1], torch.zeros(b, 1, dtype=torch.int64)], dim=1)
    accept_noise = _noise(noises, live, bk + 1)[:, :t]
    accepted, nxt = verify(probs, draft_next, block.probs, verify_len, accept_noise, _noise(noises, live, 1)[:, 0])
    return step, accepted, nxt


def _commit(res: DecodeResult, drafts: list[int], bonus: int, proposed: int, stop_ids: tuple[int, ...],
            max_tokens: int) -> bool:
    """Record one round of a live request: its accepted drafts, then the bonus/correction token. Whether it goes on."""
    res.rounds += 1
    res.proposed.append(proposed)
    stop_at = next((j for j, tok in enumerate(drafts) if tok in stop_ids), None)
    if stop_at is not None:  # an accepted draft is a stop token: cut there, no bonus (reference §5.5)
        res.token_ids += drafts[:stop_at + 1]
        res.accepted.append(stop_at + 1)
        res.committed.append(stop_at + 1)
        res.stopped = True
        return False
    res.token_ids += drafts + [bonus]
    res.accepted.append(len(drafts))
    res.committed.append(len(drafts) + 1)
    if bonus in stop_ids:
        res.stopped = True
        return False
    return len(res.token_ids) < max_tokens


@torch.no_grad()
def generate_dspark(target: TargetModel, drafter: DSparkDrafter, prompts: list[list[int]], max_tokens: int,
                    temperature: float = 0.0, seed: int = 0, stop_ids: tuple[int, ...] = (),
                    threshold: float = 0.0, capacity: int | None = None) -> list[DecodeResult]:
    """DSpark decoding. `threshold` > 0 verifies only the prefix whose calibrated survival reaches it."""
    bk = drafter.cfg.block_size
    b = len(prompts)
    noises = [RequestNoise(seed, i) for i in range(b)]
    cap = capacity or max(map(len, prompts)) + max_tokens + bk + 1
    kv, draft_kv = target.new_cache(b, cap), drafter.new_cache(b, cap)
    temp = torch.full((b,), float(temperature))

    step, anchor, cache_len = _prefill(target, prompts, kv, temp, noises)
    results = [DecodeResult(token_ids=[int(anchor[i])]) for i in range(b)]
    live = [True] * b
    for i in range(b):
        if int(anchor[i]) in stop_ids:
            results[i].stopped, live[i] = True, False
        elif max_tokens <= 1:
            live[i] = False
    pending, pending_len = step.taps, list(cache_len)  # target features the draft has not consumed yet
    draft_len = [0] * b

    while any(live):
        need = max(n for n, alive in zip(cache_len, live) if alive) + bk + 1
        if need > cap:
            raise DSparkError(f"context overflow: {need} positions exceed the KV capacity {cap}")
        hidden, new_dkv = drafter.backbone(pending, torch.tensor(pending_len), anchor, _mask(draft_len, cap), draft_kv)
        _write(draft_kv, new_dkv, draft_len, pending_len)
        draft_len = [n + c for n, c in zip(draft_len, pending_len)]
        block = drafter.sample_block(hidden, anchor, temp, _noise(noises, live, bk))
        verify_len = torch.full((b,), bk, dtype=torch.int64)
        if threshold > 0:
            verify_len = (drafter.survival(block.conf_logits) >= threshold).sum(dim=1)
        verify_len = torch.where(torch.tensor(live), verify_len, 0)
        step, accepted, nxt = _verify_block(target, kv, cache_len, anchor, block, verify_len, temp, noises, live)

        pending_len = [0] * b
        for i in range(b):
            if not live[i]:
                continue
            a = int(accepted[i])
            live[i] = _commit(results[i], block.tokens[i, :a].tolist(), int(nxt[i]), int(verify_len[i]), stop_ids,
                              max_tokens)
            if live[i]:
                cache_len[i] += a + 1  # anchor + accepted drafts; rejected positions are dropped by the length alone
                pending_len[i] = a + 1
        pending = step.taps[:, :max(max(pending_len), 1)]
        anchor = nxt
    for res in results:
        res.token_ids = res.token_ids[:max_tokens]
    return results
