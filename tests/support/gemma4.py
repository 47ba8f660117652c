"""A tiny random Gemma-4 text target with the features gemma-4-12B-it uses, and that model's real config.

GEMMA4_12B_IT is google/gemma-4-12B-it's config.json (model_type gemma4_unified, written by transformers
5.10.0.dev0) as two independent public copies print it; its vision/audio sub-configs are cut to the fields that
name them (dspark reads only text_config).
"""
from __future__ import annotations

import copy

import torch
from transformers import Gemma4ForCausalLM, Gemma4TextConfig

S, F = "sliding_attention", "full_attention"

GEMMA4_12B_TEXT = {
    "attention_bias": False, "attention_dropout": 0.0, "attention_k_eq_v": True, "bos_token_id": 2,
    "enable_moe_block": False, "eos_token_id": 1, "final_logit_softcapping": 30.0, "global_head_dim": 512,
    "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 3840,
    "hidden_size_per_layer_input": 0, "initializer_range": 0.02, "intermediate_size": 15360,
    "layer_types": ([S] * 5 + [F]) * 8, "max_position_embeddings": 262144, "model_type": "gemma4_unified_text",
    "moe_intermediate_size": None, "num_attention_heads": 16, "num_experts": None, "num_global_key_value_heads": 1,
    "num_hidden_layers": 48, "num_key_value_heads": 8, "num_kv_shared_layers": 0, "pad_token_id": 0,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {
        "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
        "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
    },
    "sliding_window": 1024, "tie_word_embeddings": True, "top_k_experts": None,
    "use_bidirectional_attention": "vision", "use_cache": True, "use_double_wide_mlp": False,
    "vocab_size": 262144, "vocab_size_per_layer_input": 262144,
}

GEMMA4_12B_IT = {
    "architectures": ["Gemma4UnifiedForConditionalGeneration"],
    "audio_config": {"model_type": "gemma4_unified_audio", "audio_embed_dim": 640, "hidden_size": 640,
                     "output_proj_dims": 640},
    "audio_token_id": 258881, "boa_token_id": 256000, "boi_token_id": 255999, "dtype": "bfloat16",
    "eoa_token_index": 258883, "eoi_token_id": 258882, "image_token_id": 258880, "initializer_range": 0.02,
    "model_type": "gemma4_unified",
    "text_config": GEMMA4_12B_TEXT,
    "tie_word_embeddings": True, "transformers_version": "5.10.0.dev0", "video_token_id": 258884,
    "vision_config": {"model_type": "gemma4_unified_vision", "mm_embed_dim": 3840, "output_proj_dims": 3840,
                      "patch_size": 16, "model_patch_size": 48},
}

# DeepSpec's config/dspark/dspark_gemma4_12b.py
GEMMA4_12B_DRAFT = dict(block_size=7, num_draft_layers=5, target_layer_ids=[5, 17, 29, 41, 46], mask_token_id=4,
                        markov_rank=256, markov_head_type="vanilla", confidence_head=True)


def tiny_gemma4_text(**over) -> dict:
    """The 12B's text config at toy size: 2 sliding + 2 full layers, k_eq_v, 1 global KV head of twice the head
    dim, proportional RoPE, soft-capping; sliding_window 5 so short decodes cross it."""
    cfg = copy.deepcopy(GEMMA4_12B_TEXT)
    cfg.update(model_type="gemma4_text", hidden_size=32, intermediate_size=64, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=16,
               num_global_key_value_heads=1, vocab_size=96, vocab_size_per_layer_input=96, sliding_window=5,
               layer_types=[S, F, S, F], max_position_embeddings=512, use_bidirectional_attention=None)
    cfg.update(over)
    return cfg


def tiny_gemma4(seed: int = 0, **over) -> Gemma4ForCausalLM:
    """Random weights, with norms, layer scalars and logits far from their init so each of them shows."""
    torch.manual_seed(seed)
    cfg = tiny_gemma4_text(**over)
    model = Gemma4ForCausalLM(Gemma4TextConfig(**cfg))
    model.config._attn_implementation = "eager"
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.5 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand_like(b))
        model.model.embed_tokens.weight.mul_(8.0)  # peaked logits (tied head), still under the soft cap
    return model.eval()


def param_count(text: dict) -> dict[str, int]:
    """Parameters of a Gemma-4 text decoder by part, from its config alone (sliding/full geometry, k_eq_v)."""
    d, inter, v, heads = text["hidden_size"], text["intermediate_size"], text["vocab_size"], text["num_attention_heads"]
    out = {"embed": v * d, "lm_head": 0 if text.get("tie_word_embeddings", True) else v * d, "final_norm": d}
    attn = mlp = norms = 0
    for kind in text["layer_types"]:
        full = kind == F
        hd = text["global_head_dim"] if full else text["head_dim"]
        kv = text["num_global_key_value_heads"] if full and text["attention_k_eq_v"] else text["num_key_value_heads"]
        has_v = not (full and text["attention_k_eq_v"])
        attn += d * heads * hd * 2 + d * kv * hd * (2 if has_v else 1)  # q, o; k (and v)
        norms += 4 * d + 2 * hd  # 4 layer norms, q_norm, k_norm (v_norm has no weight)
        mlp += 3 * d * inter
    out.update(attention=attn, mlp=mlp, norms=norms, layer_scalars=len(text["layer_types"]))
    out["total"] = sum(out.values())
    return out


def tiny_gemma4_pair(seed: int = 0, block_size: int = 4, draft_layers: int = 2, markov_rank: int = 8,
                     tap_ids: tuple[int, ...] = (0, 1, 2), **over):
    """(hf, target, drafter): the tiny Gemma-4 and a random Gemma-4 DSpark drafter sharing its embedding/head."""
    from dspark.models.config import draft_config_for
    from dspark.models.drafter import DSparkDrafter, init_weights
    from dspark.models.target import wrap_target

    hf = tiny_gemma4(seed, **over)
    target = wrap_target(hf, tap_ids).eval()
    cfg = draft_config_for(target.cfg, mask_token_id=4, num_layers=draft_layers, block_size=block_size,
                           target_layer_ids=tap_ids, markov_rank=markov_rank)
    drafter = DSparkDrafter(cfg, embed_tokens=hf.model.embed_tokens, lm_head=hf.lm_head)
    torch.manual_seed(seed + 1)
    init_weights(drafter, std=0.2)
    with torch.no_grad():
        for name, b in drafter.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand_like(b))
    return hf, target, drafter.eval()
