"""The Gemma-4 DSpark draft layer (DeepSpec's Gemma4DSparkDecoderLayer; dspark-reference.md §1.5).

It differs from the Qwen3 draft layer in:
- geometry: every draft layer is a full-attention layer of the target (global_head_dim; with attention_k_eq_v,
  num_global_key_value_heads KV heads and no v_proj, V being k_proj's output), attention scale 1;
- a scale-free RMSNorm `v_norm` on V (context and block alike), after q_norm/k_norm as in Qwen3;
- sandwich norms: post_attention_layernorm on the attention output, pre/post_feedforward_layernorm around a
  gelu-tanh gated MLP, and the output multiplied by the `layer_scalar` buffer (saved, 1 unless a checkpoint says);
- RoPE: the target's full-layer RoPE (proportional, partial_rotary_factor 0.25 in gemma-4-12B-it).
The drafter adds the embedding scale sqrt(hidden_size) and the logit soft-cap (before the Markov bias).
State-dict names are DeepSpec's, so its checkpoints load unchanged.
"""
from __future__ import annotations

import torch
from torch import nn

from dspark.models.config import DraftConfig
from dspark.models.layers import GeGLU, RMSNorm, apply_rope, block_attention, rms_norm

TensorPair = tuple[torch.Tensor, torch.Tensor]


class Gemma4DraftAttention(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.head_dim, self.eps = hd, cfg.rms_norm_eps
        self.q_proj = nn.Linear(d, cfg.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, cfg.num_kv_heads * hd, bias=False)
        self.v_proj = None if cfg.k_eq_v else nn.Linear(d, cfg.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * hd, d, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.scaling = 1.0

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> TensorPair:
        """x [B, T, d] -> K (k_norm + RoPE), V (v_norm): [B, Hkv, T, hd]."""
        b, t, _ = x.shape
        k = self.k_proj(x).view(b, t, -1, self.head_dim)
        v = k if self.v_proj is None else self.v_proj(x).view(b, t, -1, self.head_dim)
        k = self.k_norm(k).transpose(1, 2)
        return apply_rope(k, cos, sin), rms_norm(v, None, self.eps).transpose(1, 2)

    def project_q(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return apply_rope(self.q_norm(self.q_proj(x).view(b, t, -1, self.head_dim)).transpose(1, 2), cos, sin)


class Gemma4DraftLayer(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = Gemma4DraftAttention(cfg)
        self.mlp = GeGLU(d, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.pre_feedforward_layernorm = RMSNorm(d, eps)
        self.post_feedforward_layernorm = RMSNorm(d, eps)
        self.register_buffer("layer_scalar", torch.ones(1))

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, ctx_rope: TensorPair, blk_rope: TensorPair,
                masks: list[torch.Tensor], past: TensorPair | None = None) -> tuple[torch.Tensor, TensorPair]:
        """As DraftLayer.forward (the block attends to the context, projected here, and to itself)."""
        a, ctx_kv = block_attention(self.self_attn, self.input_layernorm(x), ctx, ctx_rope, blk_rope, masks, past)
        x = x + self.post_attention_layernorm(a)
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return x * self.layer_scalar.to(x.dtype), ctx_kv
