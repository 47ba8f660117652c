"""The DSpark drafter: parallel block backbone, sequential (Markov) head and confidence head.

Module and parameter names follow DeepSpec's Qwen3DSparkModel so state dicts load unchanged
(dspark-reference.md §1-§4). The embedding and LM head are the target's, shared, never trained.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dspark.errors import DSparkError
from dspark.models.config import DraftConfig
from dspark.models.drafter_gemma4 import Gemma4DraftLayer
from dspark.models.layers import (RMSNorm, SwiGLU, apply_rope, block_attention, rope_cos_sin, rope_inv_freq,
                                  split_heads)
from dspark.models.sampling import prefix_survival, sample, token_probs


TensorPair = tuple[torch.Tensor, torch.Tensor]


class DraftAttention(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.head_dim = hd
        self.q_proj = nn.Linear(d, cfg.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, cfg.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, cfg.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * hd, d, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.scaling = hd ** -0.5

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, d] -> K (k_norm + RoPE), V: [B, Hkv, T, hd]."""
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, -1, self.head_dim)).transpose(1, 2)
        return apply_rope(k, cos, sin), split_heads(self.v_proj(x), self.head_dim)

    def project_q(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, -1, self.head_dim)).transpose(1, 2)
        return apply_rope(q, cos, sin)


class DraftLayer(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, ctx_rope: TensorPair, blk_rope: TensorPair,
                masks: list[torch.Tensor], past: TensorPair | None = None) -> tuple[torch.Tensor, TensorPair]:
        """Block slots x [B, T, d] attend to the context ctx [B, C, d] (projected to K/V here, not residual) and to
        each other, after the cached context segment `past` (K, V) when given; ctx_rope / blk_rope: RoPE (cos, sin)
        of the context / block positions; masks: one per segment, in order. Returns the new x and the context's
        (K, V) [B, Hkv, C, hd]."""
        a, ctx_kv = block_attention(self.self_attn, self.input_layernorm(x), ctx, ctx_rope, blk_rope, masks, past)
        x = x + a
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, ctx_kv


class MarkovHead(nn.Module):
    """Bias B(x_{k-1}, .) added to the base logits before temperature (reference §2)."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        r, d, v = cfg.markov_rank, cfg.hidden_size, cfg.vocab_size
        self.kind = cfg.markov_head_type
        self.rank = r
        self.markov_w1 = nn.Embedding(v, r)  # indexed by target ids
        self.markov_w2 = nn.Linear(r, cfg.head_rows, bias=False)  # a reduced vocabulary's rows (d2t), else V
        if self.kind == "gated":
            self.gate_proj = nn.Linear(d + r, r)
        elif self.kind == "rnn":
            self.joint_proj = nn.Linear(2 * r + d, 3 * r)

    def step(self, prev: torch.Tensor, h: torch.Tensor, state: torch.Tensor | None, w2: torch.Tensor | None = None):
        """One position: prev tokens [...], h [..., d], RNN state [..., r] -> (bias [..., V], e = W1[prev], new state).
        w2: rows of markov_w2 for a draft vocabulary (bias over those tokens only)."""
        w2 = self.markov_w2.weight if w2 is None else w2
        e = self.markov_w1(prev)
        if self.kind == "vanilla":
            return nn.functional.linear(e, w2), e, state
        if self.kind == "gated":
            g = torch.sigmoid(self.gate_proj(torch.cat([h, e], dim=-1)))
            return nn.functional.linear(g * e, w2), e, state
        if state is None:
            state = torch.zeros_like(e)
        gate, cand, out = self.joint_proj(torch.cat([state, e, h], dim=-1)).chunk(3, dim=-1)
        z = torch.sigmoid(gate)
        new_state = z * state + (1 - z) * torch.tanh(cand)
        return nn.functional.linear(torch.tanh(out), w2), e, new_state


class ConfidenceHead(nn.Module):
    def __init__(self, in_features: int):
        super().__init__()
        self.proj = nn.Linear(in_features, 1)

    def forward(self, f: torch.Tensor) -> torch.Tensor:
        return self.proj(f).squeeze(-1)


@dataclass(frozen=True)
class DraftBlock:
    tokens: torch.Tensor  # [B, Bk] sampled d_1..d_Bk
    probs: torch.Tensor  # [B, Bk, V] draft distribution each token was sampled from
    conf_logits: torch.Tensor  # [B, Bk] pre-token confidence logits (zeros when the head is absent)


class DSparkDrafter(nn.Module):
    def __init__(self, cfg: DraftConfig, embed_tokens: nn.Embedding | None = None, lm_head: nn.Linear | None = None):
        super().__init__()
        self.cfg = cfg
        d, v = cfg.hidden_size, cfg.vocab_size
        self.embed_tokens = embed_tokens if embed_tokens is not None else nn.Embedding(v, d)
        # a reduced draft vocabulary (cfg.draft_vocab_size, from a d2t map) brings its own LM head, never the target's
        own_head = cfg.draft_vocab_size > 0 or lm_head is None
        self.lm_head = nn.Linear(d, cfg.head_rows, bias=False) if own_head else lm_head
        layer = Gemma4DraftLayer if cfg.variant == "gemma4" else DraftLayer
        self.layers = nn.ModuleList(layer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.fc = nn.Linear(cfg.num_taps * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.markov_head = MarkovHead(cfg) if cfg.markov_rank > 0 else None
        self.confidence_head = ConfidenceHead(cfg.conf_in_features) if cfg.enable_confidence_head else None
        self.register_buffer("inv_freq", rope_inv_freq(cfg.rope, cfg.head_dim), persistent=False)
        self.register_buffer("sts_temperatures", torch.tensor(cfg.sts_temperatures, dtype=torch.float32),
                             persistent=False)
        self._set_ids(None)  # a draft vocabulary (dspark.models.draft_vocab), if set

    @property
    def fixed_vocab(self) -> bool:
        """The drafter's own LM head has a row per draft-vocabulary token (a d2t map): no other vocabulary."""
        return self.cfg.draft_vocab_size > 0

    def set_draft_vocab(self, ids) -> None:
        """Draft only from these token ids (None: the whole vocabulary). The heads then score just those rows of
        the LM head and the Markov bias; the distributions they return stay full-vocabulary (zero elsewhere).
        A drafter with its own reduced LM head takes its d2t map (target id of each row, in row order) only."""
        if self.fixed_vocab:
            n = self.cfg.draft_vocab_size
            known = self.draft_ids
            if ids is None or len(ids) != n or (known is not None and not torch.equal(
                    torch.as_tensor(ids, dtype=torch.long).cpu(), known.cpu())):
                raise DSparkError(f"this drafter drafts from its own {n}-token vocabulary (its d2t map), no other")
        self._set_ids(ids)

    def _set_ids(self, ids) -> None:
        if ids is not None:
            device = self.lm_head.weight.device
            ids = torch.as_tensor(ids, dtype=torch.long, device="cpu" if device.type == "meta" else device)
        # an own reduced head is already the draft vocabulary's rows, in the map's order
        rows = (lambda w: None if ids is None or self.fixed_vocab else w.detach()[ids].clone())
        self.register_buffer("draft_ids", ids, persistent=False)
        self.register_buffer("draft_lm_weight", rows(self.lm_head.weight), persistent=False)
        self.register_buffer("draft_markov_w2", rows(self.markov_head.markov_w2.weight)
                             if self.markov_head is not None else None, persistent=False)

    # -- backbone ---------------------------------------------------------------------------------------------

    def block_inputs(self, anchor: torch.Tensor) -> torch.Tensor:
        """[anchor, mask x (slots-1)] embeddings: [B, slots, d] (slots = Bk, or Bk+1 when the anchor's slot
        predicts nothing)."""
        ids = torch.full((anchor.shape[0], self.cfg.block_slots), self.cfg.mask_token_id, dtype=anchor.dtype,
                         device=anchor.device)
        ids = torch.cat([anchor[:, None], ids[:, 1:]], dim=1)
        if self.cfg.embed_scale == 1.0:
            return self.embed_tokens(ids)
        # Gemma: sqrt(d) in the dtype the layers compute in (the weights', as HF's scaled embedding; fp32 in a
        # bundle and in the reference of a realized fp16/bf16 pair, whose matrices are widened when used), applied
        # to the weight's rows (a shared target embedding module may scale by itself)
        w, dtype = self.embed_tokens.weight, self.norm.weight.dtype
        scale = torch.full((), self.cfg.embed_scale, dtype=dtype, device=w.device)  # (an op when traced, no
        return nn.functional.embedding(ids, w).to(dtype) * scale  # lifted constant)

    def backbone(
        self,
        ctx_features: torch.Tensor,
        ctx_count: torch.Tensor,
        anchor: torch.Tensor,
        past_mask: torch.Tensor,
        draft_kv: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Incremental parallel draft of one block per request.

        ctx_features [B, C, m*d]: target taps of positions the draft has not seen (rows >= ctx_count[b] are padding);
        anchor [B]: last committed token, at position cache_len + ctx_count; past_mask [B, capacity]: valid prefix
        of the draft's context K/V cache, draft_kv[l][0/1] = [B, Hkv, capacity, hd]. Block queries see every cached and new context
        position (all strictly before the anchor) and the whole block, in both directions.
        Returns block hidden states [B, Bk, d] (after `norm`) and the new context K/V [Ld, 2, B, Hkv, C, hd].
        """
        b, c, _ = ctx_features.shape
        bk = self.cfg.block_slots
        past_valid = past_mask.bool()
        cache_len = past_valid.sum(dim=1)
        ar_c = torch.arange(c, device=anchor.device)
        ctx_pos = cache_len[:, None] + ar_c[None, :]
        blk_pos = (cache_len + ctx_count)[:, None] + torch.arange(bk, device=anchor.device)[None, :]
        ctx = self.hidden_norm(self.fc(ctx_features))
        x = self.block_inputs(anchor)
        ccos, csin = rope_cos_sin(ctx_pos, self.inv_freq, x.dtype)
        bcos, bsin = rope_cos_sin(blk_pos, self.inv_freq, x.dtype)
        masks = (past_valid[:, None, None, None, :], (ar_c[None, :] < ctx_count[:, None])[:, None, None, None, :],
                 torch.ones(1, 1, 1, 1, bk, dtype=torch.bool, device=anchor.device))
        new_kv = []
        for i, layer in enumerate(self.layers):
            x, k, v = self.layer_step(layer, x, ctx, ccos, csin, bcos, bsin, *masks, draft_kv[i][0], draft_kv[i][1])
            new_kv.append(torch.stack([k, v]))
        return self.norm(x[:, bk - self.cfg.block_size:]), torch.stack(new_kv)

    @staticmethod
    def layer_step(layer: DraftLayer, x, ctx, ctx_cos, ctx_sin, blk_cos, blk_sin, past_mask, ctx_mask, blk_mask,
                   k_past, v_past):
        """One incremental backbone layer, tensors in, tensors out (the export traces one layer through this and
        repeats it): the new x and the new context's K, V."""
        x, (k, v) = layer(x, ctx, (ctx_cos, ctx_sin), (blk_cos, blk_sin), [past_mask, ctx_mask, blk_mask],
                          past=(k_past, v_past))
        return x, k, v

    def packed_blocks(self, ctx_features: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """Training forward: many blocks of one sequence at once (DeepSpec's packed block-sparse attention).

        ctx_features [S, m*d]: taps of positions 0..S-1; tokens [>= S] the sequence; anchors [A] positions.
        Block a (anchor p) sees context positions < p and its own slots, exactly as backbone() does at inference.
        Returns block hidden states [A, Bk, d].
        """
        bk = self.cfg.block_slots
        s, a = ctx_features.shape[0], anchors.shape[0]
        dev = ctx_features.device
        ctx = self.hidden_norm(self.fc(ctx_features))[None]  # [1, S, d]
        x = self.block_inputs(tokens[anchors]).reshape(1, a * bk, -1)
        blk_pos = (anchors[:, None] + torch.arange(bk, device=dev)[None]).reshape(1, a * bk)
        ccos, csin = rope_cos_sin(torch.arange(s, device=dev)[None], self.inv_freq, x.dtype)
        bcos, bsin = rope_cos_sin(blk_pos, self.inv_freq, x.dtype)
        block_id = torch.arange(a, device=dev).repeat_interleave(bk)
        ctx_mask = (torch.arange(s, device=dev)[None, :] < anchors.repeat_interleave(bk)[:, None])[None, None, None]
        blk_mask = (block_id[:, None] == block_id[None, :])[None, None, None]
        for layer in self.layers:
            x, _ = layer(x, ctx, (ccos, csin), (bcos, bsin), [ctx_mask, blk_mask])
        return self.norm(x.view(a, bk, -1)[:, bk - self.cfg.block_size:])

    def new_cache(self, batch: int, capacity: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        cfg = self.cfg
        dtype = dtype or self.fc.weight.dtype
        return torch.zeros(cfg.num_layers, 2, batch, cfg.num_kv_heads, capacity, cfg.head_dim, dtype=dtype)

    # -- sequential heads -------------------------------------------------------------------------------------

    def base_logits(self, hidden: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """U_k = lm_head(h_k) (over `rows` of the head when given), soft-capped for Gemma before any Markov bias."""
        logits = self.lm_head(hidden) if rows is None else nn.functional.linear(hidden, rows)
        cap = self.cfg.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits

    def confidence_features(self, h: torch.Tensor, e: torch.Tensor | None) -> torch.Tensor:
        return torch.cat([h, e], dim=-1) if self.cfg.confidence_head_with_markov else h

    def sample_block(self, hidden: torch.Tensor, anchor: torch.Tensor, temperature: torch.Tensor,
                     noise: torch.Tensor) -> DraftBlock:
        """Left-to-right over the block: logits_k = U_k + Markov bias(x_{k-1}), sample d_k, feed it forward.

        hidden [B, Bk, d], anchor [B], temperature [B], noise [B, Bk] uniforms in (0, 1].
        """
        ids = self.draft_ids
        if self.fixed_vocab and ids is None:
            raise DSparkError("a reduced-vocabulary drafter needs its d2t map (set_draft_vocab) before it drafts")
        base = self.base_logits(hidden, self.draft_lm_weight)
        prev, state = anchor, None
        tokens, probs, confs = [], [], []
        for k in range(self.cfg.block_size):
            h = hidden[:, k]
            logits, e = base[:, k], None
            if self.markov_head is not None:
                bias, e, state = self.markov_head.step(prev, h, state, self.draft_markov_w2)
                logits = logits + bias
            if self.confidence_head is not None:
                confs.append(self.confidence_head(self.confidence_features(h, e)))
            p = token_probs(logits, temperature)
            prev = sample(p, noise[:, k])
            if ids is not None:  # back to vocabulary ids and full-vocabulary distributions
                prev = ids[prev]
                p = torch.zeros(p.shape[0], self.cfg.vocab_size, dtype=p.dtype, device=p.device).scatter(
                    1, ids.expand(p.shape[0], -1), p)
            tokens.append(prev)
            probs.append(p)
        conf = torch.stack(confs, dim=1) if confs else torch.zeros_like(noise)
        return DraftBlock(tokens=torch.stack(tokens, dim=1), probs=torch.stack(probs, dim=1), conf_logits=conf)

    def survival(self, conf_logits: torch.Tensor) -> torch.Tensor:
        """Calibrated prefix survival; without a confidence head every prefix is 'certain' (1.0)."""
        if self.confidence_head is None:
            return torch.ones_like(conf_logits, dtype=torch.float32)
        return prefix_survival(conf_logits, self.sts_temperatures)

    # -- teacher-forced heads (training) ----------------------------------------------------------------------

    def teacher_forced_heads(self, hidden: torch.Tensor, prev_tokens: torch.Tensor,
                             vocab_ids: torch.Tensor | None = None,
                             head_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [N, Bk, d], prev_tokens [N, Bk] = [anchor, y_1..y_{Bk-1}] -> corrected logits [N, Bk, V],
        confidence logits [N, Bk]. With vocab_ids [V'], logits over those tokens only ([N, Bk, V']); head_rows,
        the frozen LM head's rows of vocab_ids, saves gathering them on every call."""
        w2 = None
        if self.fixed_vocab:
            raise DSparkError("dspark does not train a reduced-vocabulary (d2t) drafter")
        if vocab_ids is None:
            logits = self.base_logits(hidden)
        else:
            logits = self.base_logits(hidden, self.lm_head.weight[vocab_ids] if head_rows is None else head_rows)
            if self.markov_head is not None:
                w2 = self.markov_head.markov_w2.weight[vocab_ids]
        e = None
        if self.markov_head is not None:
            mh = self.markov_head
            if mh.kind == "rnn":
                state, biases, es = None, [], []
                for k in range(hidden.shape[1]):
                    bias, ek, state = mh.step(prev_tokens[:, k], hidden[:, k], state, w2)
                    biases.append(bias)
                    es.append(ek)
                bias, e = torch.stack(biases, 1), torch.stack(es, 1)
            else:
                bias, e, _ = mh.step(prev_tokens, hidden, None, w2)
            logits = logits + bias
        if self.confidence_head is None:
            return logits, torch.zeros(hidden.shape[:2], dtype=hidden.dtype, device=hidden.device)
        return logits, self.confidence_head(self.confidence_features(hidden, e))

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.state_dict().items() if not k.startswith(("embed_tokens.", "lm_head."))}


def init_weights(drafter: DSparkDrafter, std: float = 0.02) -> None:
    """HF-style init of the drafter's own weights (Linear/Embedding ~ N(0, std), biases 0, norms 1);
    the shared embedding and LM head are left alone."""
    for name, m in drafter.named_modules():
        if name in ("embed_tokens", "lm_head"):
            continue
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=std)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, RMSNorm):
            nn.init.ones_(m.weight)
