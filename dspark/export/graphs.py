"""The three exported graphs as torch modules whose forward() is exactly the graph's I/O contract.

verifier: the target over T positions per request with in-graph acceptance (greedy and temperature sampling);
          also serves prefill (logit row = last prompt position) and AR steps (T = 1).
draft:    the parallel backbone over one block, consuming new context features.
heads:    the sequential Markov + confidence heads unrolled over the block, sampling, prefix survival and the
          dspark::ConfidenceTruncate op that sets each request's verification length.
"""
from __future__ import annotations

import torch
from torch import nn

from dspark.kv_layout import KVGroup, group_layers, kv_output_names
from dspark.models.config import TargetConfig
from dspark.models.drafter import DSparkDrafter
from dspark.models.layer_kv import LayerKV
from dspark.models.sampling import prefix_survival, token_probs, verify
from dspark.models.target import TargetModel
from dspark.ops.confidence_truncate.torch_op import confidence_truncate

VERIFIER_INPUTS = ("tokens", "past_mask", "logit_index", "verify_len", "temperature", "accept_noise", "sample_noise",
                   "draft_probs")  # then past.{l}.key / past.{l}.value for every target layer
VERIFIER_OUTPUTS = ("accepted", "next_token", "taps", "new_kv")
DRAFT_INPUTS = ("ctx_features", "ctx_count", "anchor", "past_mask")  # then draft_past.{l}.key / .value
DRAFT_OUTPUTS = ("hidden", "new_draft_kv")
HEADS_INPUTS = ("hidden", "anchor", "temperature", "draft_noise", "conf_temperatures", "threshold", "sps", "budget",
                "active", "mode", "layout")
HEADS_OUTPUTS = ("draft_tokens", "draft_probs", "survival", "verify_len", "verify_mask", "conf_logits")


def past_names(prefix: str, layers: int) -> tuple[str, ...]:
    """Per-layer cache inputs: the host binds each layer's slice of its cache buffer in place (no copy)."""
    return tuple(f"{prefix}.{i}.{kind}" for i in range(layers) for kind in ("key", "value"))


def target_kv_groups(cfg: TargetConfig) -> list[KVGroup]:
    """The KV groups of a target (one for a uniform target; the manifest records them when there are more)."""
    return group_layers([(cfg.kv_heads_of(i), cfg.head_dim_of(i)) for i in range(cfg.num_layers)], cfg.layer_types)


def verifier_outputs(cfg: TargetConfig) -> tuple[str, ...]:
    """VERIFIER_OUTPUTS, with one new_kv.{g} per KV group in place of new_kv for a non-uniform target."""
    if cfg.uniform:
        return VERIFIER_OUTPUTS
    return VERIFIER_OUTPUTS[:-1] + tuple(kv_output_names({"kv_groups": target_kv_groups(cfg)}))


def _pairs(past: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(past[2 * i], past[2 * i + 1]) for i in range(len(past) // 2)]


class VerifierGraph(nn.Module):
    def __init__(self, target: TargetModel):
        super().__init__()
        self.target = target

    def forward(self, tokens, past_mask, logit_index, verify_len, temperature, accept_noise, sample_noise,
                draft_probs, past: list[torch.Tensor]):
        step = self.target(tokens, past_mask, _pairs(past))
        d = step.hidden.shape[-1]
        rows = torch.gather(step.hidden, 1, logit_index.unsqueeze(-1).expand(-1, -1, d))
        probs = token_probs(self.target.logits(rows), temperature)
        # Row j judges the token right after it: d_{j+1} = tokens[logit_index[j] + 1] (last row: padding).
        nxt = torch.minimum(logit_index + 1, torch.full_like(logit_index, tokens.shape[1] - 1))  # Min: int-safe in TRT
        draft_next = torch.gather(tokens, 1, nxt)
        accepted, next_token = verify(probs, draft_next, draft_probs, verify_len, accept_noise, sample_noise)
        # a uniform target's new K/V are one [L, 2, B, Hkv, T, hd] tensor; a LayerKV's are one per KV group
        # (new_kv.{g}, in dspark.kv_layout's order, which is LayerKV's)
        new_kv = step.new_kv.groups if isinstance(step.new_kv, LayerKV) else [step.new_kv]
        return (accepted, next_token, step.taps, *new_kv)


class DraftGraph(nn.Module):
    def __init__(self, drafter: DSparkDrafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, ctx_features, ctx_count, anchor, past_mask, past: list[torch.Tensor]):
        return self.drafter.backbone(ctx_features, ctx_count, anchor, past_mask, _pairs(past))


class HeadsGraph(nn.Module):
    def __init__(self, drafter: DSparkDrafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, hidden, anchor, temperature, draft_noise, conf_temperatures, threshold, sps, budget, active,
                mode, layout):
        block = self.drafter.sample_block(hidden, anchor, temperature, draft_noise)
        if self.drafter.confidence_head is None:
            survival = torch.ones_like(draft_noise)
        else:
            survival = prefix_survival(block.conf_logits, conf_temperatures)
        verify_len, verify_mask = confidence_truncate(survival, threshold, sps, budget, active, mode, layout)
        return block.tokens, block.probs, survival, verify_len, verify_mask, block.conf_logits
