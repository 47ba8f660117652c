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


def gemma_tokenizer_folder(folder, vocab_size: int):
    """A small SentencePiece-style BPE tokenizer (byte fallback, `▁` for spaces, Gemma's special-token ids: <pad> 0,
    <eos> 1, <bos> 2, <unk> 3, <mask> 4), padded with unused tokens to `vocab_size`: the shape of tokenizer
    llama.cpp's Gemma-4 converter reads (gguf's LlamaHfVocab), which dspark's tiny word-level one is not."""
    import json
    from pathlib import Path

    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
    vocab = {t: i for i, t in enumerate(specials)}
    vocab.update({f"<0x{b:02X}>": len(specials) + b for b in range(256)})
    for c in ["\u2581"] + [chr(c) for c in range(33, 127)]:
        vocab.setdefault(c, len(vocab))
    merges = [("\u2581", "t"), ("h", "e"), ("\u2581t", "he"), ("i", "n"), ("\u2581", "a")]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    if vocab_size < len(vocab):
        raise ValueError(f"vocab_size {vocab_size} is below the tokenizer's {len(vocab)} tokens")
    while len(vocab) < vocab_size:
        vocab[f"<unused{len(vocab)}>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
        "pad_token": "<pad>", "unk_token": "<unk>", "add_bos_token": True}))
    return folder


def write_gemma4_gguf(model: Gemma4ForCausalLM, tokenizer_folder, path, matrices: str = "F32", **drop) -> None:
    """The GGUF llama.cpp's converter (conversion/gemma.py, Gemma4Model) writes for `model`: its metadata keys,
    tensor names (gguf's name map), unshifted norms, `layer_output_scale` for the layer scalar, the full layers'
    proportional RoPE as a `rope_freqs` tensor, no attn_v on k_eq_v full layers; the tokenizer as gguf's
    LlamaHfVocab reads it. Weight matrices are stored as `matrices` (F32, F16, BF16 or Q8_0), the rest in F32.
    `drop` names metadata keys (without the "gemma4." prefix) to leave out, for the bad-file tests."""
    import gguf
    import numpy as np
    from gguf.quants import quantize

    from dspark.models.config import TargetConfig

    raw = model.config.to_dict()
    cfg = TargetConfig.from_dict(raw)
    kind = [t == S for t in cfg.layer_types]
    full_dim = next(d for d, t in zip(cfg.layer_head_dims, cfg.layer_types) if t == F)
    sliding_dim = next(d for d, t in zip(cfg.layer_head_dims, cfg.layer_types) if t == S)
    w = gguf.GGUFWriter(str(path), "gemma4")
    keys = {
        "block_count": (w.add_block_count, cfg.num_layers),
        "context_length": (w.add_context_length, raw["max_position_embeddings"]),
        "embedding_length": (w.add_embedding_length, cfg.hidden_size),
        "feed_forward_length": (w.add_feed_forward_length, cfg.intermediate_size),
        "attention.head_count": (w.add_head_count, cfg.num_heads),
        "attention.head_count_kv": (w.add_head_count_kv, list(cfg.layer_kv_heads)),
        "rope.freq_base": (w.add_rope_freq_base, cfg.rope_full["rope_theta"]),
        "rope.freq_base_swa": (w.add_rope_freq_base_swa, cfg.rope["rope_theta"]),
        "attention.layer_norm_rms_epsilon": (w.add_layer_norm_rms_eps, cfg.rms_norm_eps),
        "attention.key_length": (w.add_key_length, full_dim),
        "attention.value_length": (w.add_value_length, full_dim),
        "final_logit_softcapping": (w.add_final_logit_softcapping, cfg.final_logit_softcapping),
        "attention.sliding_window": (w.add_sliding_window, cfg.sliding_window),
        "attention.shared_kv_layers": (w.add_shared_kv_layers, 0),
        "embedding_length_per_layer_input": (w.add_embedding_length_per_layer_input, 0),
        "attention.sliding_window_pattern": (w.add_sliding_window_pattern, kind),
        "attention.key_length_swa": (w.add_key_length_swa, sliding_dim),
        "attention.value_length_swa": (w.add_value_length_swa, sliding_dim),
        "rope.dimension_count": (w.add_rope_dimension_count, full_dim),
        "rope.dimension_count_swa": (w.add_rope_dimension_count_swa, sliding_dim),
    }
    for key, (add, value) in keys.items():
        if key not in drop:
            add(value)
    vocab = gguf.LlamaHfVocab(tokenizer_folder)
    tokens, scores, types = zip(*vocab.all_tokens())
    w.add_tokenizer_model("gemma4")
    w.add_token_list(list(tokens))
    w.add_token_scores(list(scores))
    w.add_token_types(list(types))
    gguf.SpecialVocab(tokenizer_folder, load_merges=True).add_to_gguf(w)
    w.add_add_space_prefix(False)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, cfg.num_layers)
    rotated = int(full_dim * cfg.rope_full.get("partial_rotary_factor", 1.0) / 2)
    w.add_tensor("rope_freqs.weight",
                 np.array([1.0] * rotated + [1e30] * (full_dim // 2 - rotated), dtype=np.float32))
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        base, _, suffix = name.rpartition(".")
        target = f"{names.get_name(base)}.{suffix}" if names.get_name(base) else f"{names.get_name(name)}.weight"
        data = t.detach().float().numpy()
        if data.ndim == 2 and matrices != "F32":
            qtype = gguf.GGMLQuantizationType[matrices]
            blocks = quantize(data, qtype)
            w.add_tensor(target, blocks, raw_shape=blocks.shape, raw_dtype=qtype)
        else:
            w.add_tensor(target, data.reshape(-1) if data.ndim == 0 else data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
