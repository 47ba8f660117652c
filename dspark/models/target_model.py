"""The target wrappers' common part: a Llama/Qwen3 causal LM with an explicit, fixed-capacity KV cache and the
DeepSpec feature taps (dspark.models.target loads targets and picks the wrapper; target_gemma4 is Gemma-4's)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dspark.errors import DSparkError
from dspark.models.config import TargetConfig
from dspark.models.layers import apply_rope, grouped_attention, rms_norm, rope_cos_sin, rope_inv_freq, split_heads


@dataclass(frozen=True)
class TargetStep:
    hidden: torch.Tensor  # [B, T, d] after the final norm
    taps: torch.Tensor  # [B, T, m*d] outputs of the tapped decoder layers, concatenated in tap order
    new_kv: torch.Tensor  # [L, 2, B, Hkv, T, hd] K/V of the processed positions (RoPE applied)


def kv_cache_shape(cfg: TargetConfig, batch: int, capacity: int) -> tuple[int, ...]:
    if not cfg.uniform:
        raise DSparkError(f"a {cfg.family} target's layers differ in KV geometry: its cache is a LayerKV, not one "
                          f"[L, 2, B, Hkv, cap, hd] tensor")
    return (cfg.num_layers, 2, batch, cfg.num_kv_heads, capacity, cfg.head_dim)


def text_body(hf_model: nn.Module) -> nn.Module:
    """The decoder (embed_tokens, layers, norm) of a causal LM, or of a multimodal Gemma-4's language model."""
    return getattr(hf_model.model, "language_model", hf_model.model)



class TargetModel(nn.Module):
    """Runs an HF Llama/Qwen3 causal LM on its own weights with a caller-owned KV cache.

    `past_kv[l][0]` / `past_kv[l][1]` are layer l's cached keys/values [B, Hkv, capacity, hd] (a [L, 2, ...]
    tensor works, and so does a list of per-layer pairs, which is what the exported graph takes so that every
    layer's cache is bound in place). `past_mask` [B, capacity] marks each request's valid prefix. The step
    returns only the K/V of the new positions: the caller writes them in place, and a rollback is a change of
    the valid length.
    Tap id l is the output of decoder layer l (HF hidden_states[l + 1]); -1 is the embedding output.
    """

    def __init__(self, hf_model: nn.Module, tap_ids: tuple[int, ...] = ()):
        super().__init__()
        self.cfg = TargetConfig.from_dict(hf_model.config.to_dict())
        last = self.cfg.num_layers - 1
        for i in tap_ids:
            if not -1 <= i < last:
                raise DSparkError(f"tap id {i} must be in -1..{last - 1} (the last layer's output is post-norm in HF)")
        self.tap_ids = tuple(tap_ids)
        body = text_body(hf_model)
        self.embed_tokens = body.embed_tokens
        self.layers = body.layers
        self.norm = body.norm
        self.lm_head = hf_model.lm_head
        self.qk_norm = self.cfg.family == "qwen3"
        self.eps = self.cfg.rms_norm_eps
        self.register_buffer("inv_freq", rope_inv_freq(self.cfg.rope, self.cfg.head_dim), persistent=False)

    def _attention(self, layer: nn.Module, x: torch.Tensor, cos, sin, k_past, v_past, past_mask, new_mask):
        attn = layer.self_attn
        hd = self.cfg.head_dim
        q = attn.q_proj(x)
        k = attn.k_proj(x)
        v = split_heads(attn.v_proj(x), hd)
        if self.qk_norm:
            b, t, _ = x.shape
            q = rms_norm(q.view(b, t, -1, hd), attn.q_norm.weight, self.eps).transpose(1, 2)
            k = rms_norm(k.view(b, t, -1, hd), attn.k_norm.weight, self.eps).transpose(1, 2)
        else:
            q, k = split_heads(q, hd), split_heads(k, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = grouped_attention(q, [k_past, k], [v_past, v], [past_mask, new_mask], attn.scaling)
        return attn.o_proj(out), k, v

    def layer_step(self, layer: nn.Module, x: torch.Tensor, cos, sin, k_past, v_past, past_mask, new_mask):
        """One pre-norm decoder layer on the residual stream x, after the layer's cached K, V; tensors in, tensors
        out (the export traces one layer through this and repeats it). Returns the new x and the K, V of x's
        positions."""
        a, k, v = self._attention(layer, self._norm(layer.input_layernorm, x), cos, sin, k_past, v_past,
                                  past_mask, new_mask)
        x = x + a
        x = x + layer.mlp(self._norm(layer.post_attention_layernorm, x))
        return x, k, v

    def forward(self, tokens: torch.Tensor, past_mask: torch.Tensor, past_kv) -> TargetStep:
        b, t = tokens.shape
        past_valid = past_mask.bool()
        cache_len = past_valid.sum(dim=1)
        positions = cache_len[:, None] + torch.arange(t, device=tokens.device)[None, :]
        x = self.embed_tokens(tokens)
        cos, sin = rope_cos_sin(positions, self.inv_freq, x.dtype)
        pm = past_valid[:, None, None, None, :]
        nm = torch.ones(t, t, dtype=torch.bool, device=tokens.device).tril()[None, None, None]
        taps = {-1: x} if -1 in self.tap_ids else {}
        new_kv = []
        for i, layer in enumerate(self.layers):
            x, k, v = self.layer_step(layer, x, cos, sin, past_kv[i][0], past_kv[i][1], pm, nm)
            new_kv.append(torch.stack([k, v]))
            if i in self.tap_ids:
                taps[i] = x
        tap_tensor = torch.cat([taps[i] for i in self.tap_ids], dim=-1) if self.tap_ids else x[..., :0]
        return TargetStep(hidden=self._norm(self.norm, x), taps=tap_tensor, new_kv=torch.stack(new_kv))

    def _norm(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, module.weight, self.eps)

    def tail(self, h: torch.Tensor, first_layer: int) -> torch.Tensor:
        """Final hidden states [B, T, d] from the residual stream `h` entering `first_layer` at positions 0..T-1
        (causal, no cache): with h = the last tap, training needs only the layers after it."""
        b, t, _ = h.shape
        positions = torch.arange(t, device=h.device)[None].expand(b, t)
        cos, sin = rope_cos_sin(positions, self.inv_freq, h.dtype)
        causal = torch.ones(t, t, dtype=torch.bool, device=h.device).tril()[None, None, None]
        empty = h.new_zeros(b, self.cfg.num_kv_heads, 0, self.cfg.head_dim)
        for layer in self.layers[first_layer:]:
            h, _, _ = self.layer_step(layer, h, cos, sin, empty, empty, causal[..., :0], causal)
        return self._norm(self.norm, h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def new_cache(self, batch: int, capacity: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or self.lm_head.weight.dtype  # (a realized low-precision embedding is widened per lookup)
        return torch.zeros(kv_cache_shape(self.cfg, batch, capacity), dtype=dtype)
