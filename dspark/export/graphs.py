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
from dspark.models.sampling import (filtered_probs, penalised_logits, prefix_survival, processed_logprobs, verify,
                                    verify_logits)
from dspark.models.target import TargetModel
from dspark.ops.confidence_truncate.torch_op import confidence_truncate

VERIFIER_INPUTS = ("tokens", "past_mask", "logit_index", "verify_len", "temperature", "accept_noise", "sample_noise",
                   "draft_probs")  # then past.{l}.key / past.{l}.value for every target layer
VERIFIER_OUTPUTS = ("accepted", "next_token", "taps", "logits", "new_kv")  # logits: read only by the sampler
DRAFT_INPUTS = ("ctx_features", "ctx_count", "anchor", "past_mask")  # then draft_past.{l}.key / .value
DRAFT_OUTPUTS = ("hidden", "new_draft_kv")
HEADS_INPUTS = ("hidden", "anchor", "temperature", "draft_noise", "conf_temperatures", "threshold", "sps", "budget",
                "active", "mode", "layout")
HEADS_OUTPUTS = ("draft_tokens", "draft_probs", "survival", "verify_len", "verify_mask", "conf_logits")
SAMPLER_INPUTS = ("logits", "draft_next", "verify_len", "temperature", "accept_noise", "sample_noise", "draft_probs",
                  "counts", "prompt_seen", "logit_bias", "repetition_penalty", "presence_penalty", "frequency_penalty",
                  "top_k", "top_p", "min_p")
# probs, logprobs: the processed distributions and the log-probabilities logprobs report, read on demand
SAMPLER_OUTPUTS = ("accepted", "next_token", "probs", "logprobs")


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
        logits = self.target.logits(rows).float()
        # Row j judges the token right after it: d_{j+1} = tokens[logit_index[j] + 1] (last row: padding).
        nxt = torch.minimum(logit_index + 1, torch.full_like(logit_index, tokens.shape[1] - 1))  # Min: int-safe in TRT
        draft_next = torch.gather(tokens, 1, nxt)
        accepted, next_token = verify_logits(logits, temperature, draft_next, draft_probs, verify_len, accept_noise,
                                             sample_noise)
        # a uniform target's new K/V are one [L, 2, B, Hkv, T, hd] tensor; a LayerKV's are one per KV group
        # (new_kv.{g}, in dspark.kv_layout's order, which is LayerKV's)
        new_kv = step.new_kv.groups if isinstance(step.new_kv, LayerKV) else [step.new_kv]
        return (accepted, next_token, step.taps, logits, *new_kv)


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


class SamplerGraph(nn.Module):
    """The verifier's acceptance again, on its logits output, for rounds in which a request sets sampling
    parameters (dspark.models.sampling.penalised_logits / filtered_probs): the target distribution each verify row
    judges its draft by, and resamples from, is the processed one. No weights."""

    def forward(self, logits, draft_next, verify_len, temperature, accept_noise, sample_noise, draft_probs, counts,
                prompt_seen, logit_bias, repetition_penalty, presence_penalty, frequency_penalty, top_k, top_p, min_p):
        x = penalised_logits(logits, draft_next, counts, prompt_seen, logit_bias, repetition_penalty,
                             presence_penalty, frequency_penalty)
        probs = filtered_probs(x, temperature, top_k, top_p, min_p)
        return (*verify(probs, draft_next, draft_probs, verify_len, accept_noise, sample_noise), probs,
                processed_logprobs(x, probs, temperature))


def sampler_example_args(vocab: int) -> tuple[tuple[torch.Tensor, ...], dict[str, dict[int, str]]]:
    """Example inputs of SamplerGraph for tracing (two requests, three rows) and their dynamic axes."""
    b, rows = 2, 3
    g = torch.Generator().manual_seed(3)
    args = (
        torch.randn(b, rows, vocab, generator=g),
        torch.tensor([[1, 2, 0], [3, 3, 0]]) % vocab,
        torch.tensor([2, 1]),
        torch.tensor([0.0, 1.0]),
        torch.rand(b, rows, generator=g),
        torch.rand(b, generator=g),
        torch.softmax(torch.randn(b, rows - 1, vocab, generator=g), -1),
        torch.zeros(b, vocab),
        torch.zeros(b, vocab),
        torch.zeros(b, vocab),
        torch.tensor([1.0, 1.2]),
        torch.tensor([0.0, 0.5]),
        torch.tensor([0.0, 0.25]),
        torch.tensor([0, 5]),
        torch.tensor([1.0, 0.9]),
        torch.tensor([0.0, 0.05]),
    )
    dims = {**{name: {0: "batch"} for name in SAMPLER_INPUTS}, "logits": {0: "batch", 1: "rows"},
            "draft_next": {0: "batch", 1: "rows"}, "accept_noise": {0: "batch", 1: "rows"},
            "draft_probs": {0: "batch", 1: "draft_rows"}}
    return args, dims
