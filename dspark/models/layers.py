"""Building blocks shared by the target wrapper and the drafter; every op here exports cleanly to ONNX."""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

NEG_INF = torch.finfo(torch.float32).min


def rope_inv_freq(rope: dict[str, Any], head_dim: int) -> torch.Tensor:
    """inv_freq for 'default', 'llama3' and 'proportional' RoPE, as transformers computes it."""
    base = float(rope["rope_theta"])
    if rope.get("rope_type") == "proportional":  # Gemma-4 full layers: the first partial_rotary_factor of the
        # pairs rotate at the frequencies of the full head_dim, the rest get 0 (cos 1, sin 0: not rotated)
        angles = int(rope.get("partial_rotary_factor", 1.0) * head_dim // 2)
        rotated = 1.0 / (base ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / head_dim))
        return torch.cat([rotated, torch.zeros(head_dim // 2 - angles)]) / float(rope.get("factor", 1.0))
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.get("rope_type", "default") == "llama3":
        factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        old_len = rope["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [B, T] -> cos, sin [B, 1, T, head_dim] (broadcast over heads)."""
    freqs = positions[..., None].float() * inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight (no weight: Gemma-4's scale-free v_norm). Written with a division (not
    rsqrt) because that is the pattern ONNX Runtime fuses into one SimplifiedLayerNormalization kernel."""
    dtype = x.dtype
    x = x.float()
    x = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x.to(dtype) if weight is None else weight * x.to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.variance_epsilon)


class SwiGLU(nn.Module):
    def __init__(self, d: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(d, inter, bias=False)
        self.up_proj = nn.Linear(d, inter, bias=False)
        self.down_proj = nn.Linear(inter, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GeGLU(SwiGLU):
    """Gemma's gated MLP: down(gelu_tanh(gate(x)) * up(x)) (hidden_activation gelu_pytorch_tanh)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


def split_heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[B, T, H*hd] -> [B, H, T, hd]"""
    b, t, _ = x.shape
    return x.view(b, t, -1, head_dim).transpose(1, 2)


def grouped_attention(
    q: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    masks: list[torch.Tensor],
    scale: float,
) -> torch.Tensor:
    """Softmax attention of q over several key/value segments without concatenating the segments.

    q: [B, H, T, hd]; keys/values: [B, Hkv, S_i, hd]; masks: bool, broadcastable to [B, 1, 1, T, S_i]
    (True = may attend). Query heads are grouped onto their KV head by a reshape, so K/V are never repeated,
    and the cached segment is read in place instead of being copied into a concatenation.
    Returns [B, T, H*hd].
    """
    b, h, t, hd = q.shape
    hkv = keys[0].shape[1]
    g = h // hkv
    qg = q.reshape(b, hkv, g * t, hd)
    scores = []
    for k, m in zip(keys, masks):
        s = torch.matmul(qg, k.transpose(2, 3)) * scale
        s = s.view(b, hkv, g, t, k.shape[2]).float()
        scores.append(torch.where(m, s, NEG_INF))
    probs = torch.softmax(torch.cat(scores, dim=-1), dim=-1).to(q.dtype)
    out = None
    start = 0
    for v in values:
        n = v.shape[2]
        p = probs[..., start:start + n].reshape(b, hkv, g * t, n)
        part = torch.matmul(p, v)
        out = part if out is None else out + part
        start += n
    return out.view(b, hkv, g, t, hd).reshape(b, h, t, hd).transpose(1, 2).reshape(b, t, h * hd)


def block_attention(attn: nn.Module, u: torch.Tensor, ctx: torch.Tensor, ctx_rope, blk_rope,
                    masks: list[torch.Tensor], past=None):
    """A draft layer's attention (every draft variant's): the normalized block slots u [B, T, d] attend to the
    context ctx [B, C, d] (projected to K/V here) and to each other, after the cached context segment `past`
    (K, V) when given; `attn` brings project_kv, project_q, o_proj and scaling. Returns the attention output
    [B, T, d] and the context's (K, V) [B, Hkv, C, hd]."""
    k_ctx, v_ctx = attn.project_kv(ctx, *ctx_rope)
    k_blk, v_blk = attn.project_kv(u, *blk_rope)
    q = attn.project_q(u, *blk_rope)
    keys, values = [k_ctx, k_blk], [v_ctx, v_blk]
    if past is not None:
        keys, values = [past[0], *keys], [past[1], *values]
    return attn.o_proj(grouped_attention(q, keys, values, masks, attn.scaling)), (k_ctx, v_ctx)

