"""The Gemma-4 target: transformers' Gemma-4 text decoder on its own weights, with a caller-owned KV cache.

What differs from a Llama/Qwen3 layer (each computed here as transformers' Gemma4TextDecoderLayer does):
- two kinds of layers (`layer_types`): sliding-window layers (a query at position p sees keys at positions
  p - sliding_window + 1 .. p; head_dim, num_key_value_heads, default RoPE at theta 1e4) and full layers
  (global_head_dim, num_global_key_value_heads, proportional RoPE: only the first partial_rotary_factor of the
  frequency pairs rotate, theta 1e6);
- attention_k_eq_v: full layers have no v_proj, V is k_proj's output;
- q_norm/k_norm (RMSNorm per head) and a scale-free v_norm on V; attention scale 1 (the norms set it);
- sandwich norms: post_attention_layernorm on the attention output and pre/post_feedforward_layernorm around the
  MLP before each residual add; the layer output is multiplied by its `layer_scalar` buffer;
- the input embedding is scaled by sqrt(hidden_size) (HF's Gemma4TextScaledWordEmbedding, in the weights' dtype);
- gelu-tanh gated MLP (HF's module, reused as is); logits soft-capped: s * tanh(logits / s).
The cache keeps every position for every layer (a LayerKV: one tensor per KV geometry); sliding layers mask the
keys outside their window, so a ring buffer of sliding_window positions is a later memory saving, not a change in
what is computed.
"""
from __future__ import annotations

import torch
from torch import nn

from dspark.models.layer_kv import LayerKV
from dspark.models.layers import apply_rope, grouped_attention, rms_norm, rope_cos_sin, rope_inv_freq
from dspark.models.target_model import TargetModel, TargetStep


def softcap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    return logits if not cap else torch.tanh(logits / cap) * cap


class Gemma4Target(TargetModel):
    """TargetModel for family gemma4: `past_kv` is a LayerKV (or any per-layer list of [2, B, Hkv_l, cap, hd_l])."""

    def __init__(self, hf_model: nn.Module, tap_ids: tuple[int, ...] = ()):
        super().__init__(hf_model, tap_ids)  # inv_freq: the sliding layers' RoPE
        cfg = self.cfg
        full = cfg.full_layer_ids[0] if cfg.full_layer_ids else 0
        self.register_buffer("inv_freq_full", rope_inv_freq(cfg.rope_full or cfg.rope, cfg.head_dim_of(full)),
                             persistent=False)

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[bool, tuple[torch.Tensor, torch.Tensor]]:
        """(cos, sin) by layer kind: True = sliding."""
        return {True: rope_cos_sin(positions, self.inv_freq, dtype),
                False: rope_cos_sin(positions, self.inv_freq_full, dtype)}

    def _masks(self, positions: torch.Tensor, past_valid: torch.Tensor) -> dict[bool, tuple[torch.Tensor, torch.Tensor]]:
        """(past mask, new mask) by layer kind, broadcastable to [B, Hkv, g, T, S]. Cache slot j holds position j."""
        t, cap = positions.shape[1], past_valid.shape[1]
        dev = positions.device
        steps = torch.arange(t, device=dev)
        causal = (steps[:, None] >= steps[None, :])[None, None, None]
        full = (past_valid[:, None, None, None, :], causal)
        window = self.cfg.sliding_window
        slot = torch.arange(cap, device=dev)
        seen = slot[None, None, :] > (positions[:, :, None] - window)  # [B, T, cap]
        sliding = ((past_valid[:, None, :] & seen)[:, None, None],
                   causal & ((steps[:, None] - steps[None, :]) < window)[None, None, None])
        return {True: sliding, False: full}

    def _attention(self, layer: nn.Module, x: torch.Tensor, cos, sin, k_past, v_past, past_mask, new_mask):
        attn = layer.self_attn
        b, t, _ = x.shape
        hd, eps = attn.head_dim, self.eps
        q = rms_norm(attn.q_proj(x).view(b, t, -1, hd), attn.q_norm.weight, eps).transpose(1, 2)
        k_raw = attn.k_proj(x).view(b, t, -1, hd)
        v_raw = k_raw if attn.v_proj is None else attn.v_proj(x).view(b, t, -1, hd)
        k = rms_norm(k_raw, attn.k_norm.weight, eps).transpose(1, 2)
        v = rms_norm(v_raw, None, eps).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = grouped_attention(q, [k_past, k], [v_past, v], [past_mask, new_mask], attn.scaling)
        return attn.o_proj(out), k, v

    def layer_step(self, layer: nn.Module, x: torch.Tensor, cos, sin, k_past, v_past, past_mask, new_mask):
        """One Gemma-4 decoder layer (sandwich norms, layer_scalar); the caller passes the RoPE and masks of the
        layer's kind, so a tracer repeats one graph per kind. Returns the new x and the K, V of x's positions."""
        a, k, v = self._attention(layer, self._norm(layer.input_layernorm, x), cos, sin, k_past, v_past,
                                  past_mask, new_mask)
        x = x + self._norm(layer.post_attention_layernorm, a)
        x = x + self._norm(layer.post_feedforward_layernorm, layer.mlp(self._norm(layer.pre_feedforward_layernorm, x)))
        return x * layer.layer_scalar.to(x.dtype), k, v

    def _run(self, x: torch.Tensor, positions: torch.Tensor, past_valid: torch.Tensor, past_kv, first: int = 0):
        ropes, masks = self._rope(positions, x.dtype), self._masks(positions, past_valid)
        taps = {-1: x} if -1 in self.tap_ids and first == 0 else {}
        new_kv = []
        for i in range(first, self.cfg.num_layers):
            kind = self.cfg.is_sliding(i)
            x, k, v = self.layer_step(self.layers[i], x, *ropes[kind], past_kv[i][0], past_kv[i][1], *masks[kind])
            new_kv.append(torch.stack([k, v]))
            if i in self.tap_ids:
                taps[i] = x
        return x, taps, new_kv

    def forward(self, tokens: torch.Tensor, past_mask: torch.Tensor, past_kv) -> TargetStep:
        t = tokens.shape[1]
        past_valid = past_mask.bool()
        positions = past_valid.sum(dim=1)[:, None] + torch.arange(t, device=tokens.device)[None, :]
        x, taps, new_kv = self._run(self.embed_tokens(tokens), positions, past_valid, past_kv)
        tap_tensor = torch.cat([taps[i] for i in self.tap_ids], dim=-1) if self.tap_ids else x[..., :0]
        return TargetStep(hidden=self._norm(self.norm, x), taps=tap_tensor,
                          new_kv=LayerKV.stack(new_kv, geometry=self._geometry()))

    def tail(self, h: torch.Tensor, first_layer: int) -> torch.Tensor:
        b, t, _ = h.shape
        positions = torch.arange(t, device=h.device)[None].expand(b, t)
        empty = [h.new_zeros(2, b, self.cfg.kv_heads_of(i), 0, self.cfg.head_dim_of(i))
                 for i in range(self.cfg.num_layers)]
        x, _, _ = self._run(h, positions, torch.zeros(b, 0, dtype=torch.bool, device=h.device), empty, first_layer)
        return self._norm(self.norm, x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return softcap(self.lm_head(hidden), self.cfg.final_logit_softcapping)

    def _geometry(self) -> list[tuple[int, int]]:
        return [(self.cfg.kv_heads_of(i), self.cfg.head_dim_of(i)) for i in range(self.cfg.num_layers)]

    def new_cache(self, batch: int, capacity: int, dtype: torch.dtype | None = None) -> LayerKV:
        return LayerKV.zeros(self._geometry(), batch, capacity, dtype or self.lm_head.weight.dtype)
