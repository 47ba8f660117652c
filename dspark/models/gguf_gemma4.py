"""A Gemma-4 GGUF's text config, read from the file's own metadata.

transformers' GGUF config reader cannot build a Gemma-4 from llama.cpp's files: it takes the per-layer KV head
counts for one number, and it does not read the sliding-window pattern, the sliding layers' head size, the
soft-cap or the full layers' partial RoPE. llama.cpp's converter (conversion/gemma.py) writes all of them, so the
HF `gemma4_text` config is rebuilt here, key by key:

- `attention.sliding_window_pattern` (one bool per layer) gives `layer_types`;
- `attention.key_length` / `_swa` give `global_head_dim` / `head_dim`, `attention.head_count_kv` (one per layer)
  `num_global_key_value_heads` / `num_key_value_heads`;
- full layers stored without `attn_v` mean `attention_k_eq_v`;
- `rope.freq_base` / `_swa` are the two RoPE bases, and the full layers' proportional RoPE is the file's
  `rope_freqs` tensor: 1.0 for each rotated frequency pair, 1e30 for each one left unrotated;
- Gemma-4's norms are stored as they are (no +1 shift, unlike Gemma 2/3) and its layer scalar as
  `layer_output_scale`.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from dspark.errors import DSparkError
from dspark.lazy import LazyModule
from dspark.schema import Fields

gguf = LazyModule("gguf", "pip install gguf (it comes with transformers' GGUF support)")

ARCH = "gemma4"
SLIDING, FULL = "sliding_attention", "full_attention"


def _metadata(reader) -> dict[str, Any]:
    """The architecture's and the tokenizer's scalar keys; a float32 value as the shortest decimal that gives it
    back (the one the converter was handed: 1e-06, not 9.99999997e-07)."""
    out = {}
    for key, field in reader.fields.items():
        if key.startswith(f"{ARCH}.") or (key.startswith("tokenizer.ggml.") and not key.endswith(
                ("tokens", "scores", "token_type", "merges"))):
            value = field.contents()
            if field.types == [gguf.GGUFValueType.FLOAT32]:
                value = float(str(np.float32(value)))
            out[key[len(ARCH) + 1:] if key.startswith(f"{ARCH}.") else key] = value
    return out


def _per_layer(f: Fields, key: str, n: int) -> list[int]:
    value = f.get(key)
    if isinstance(value, list):
        if len(value) != n:
            f.fail(key, f"lists {len(value)} values for {n} layers")
        return [int(v) for v in value]
    return [f.integer(key, 1)] * n


def _uniform(f: Fields, key: str, values: list[int], what: str) -> int:
    if not values:
        return 0
    if len(set(values)) != 1:
        f.fail(key, f"differs between {what} layers ({sorted(set(values))}); dspark needs one value per kind")
    return values[0]


def _full_rope(reader, f: Fields, global_head_dim: int, name: str) -> dict[str, Any]:
    """The full layers' RoPE: proportional, its rotated fraction read from `rope_freqs` (none: all rotated)."""
    rope = {"rope_type": "proportional", "rope_theta": f.number("rope.freq_base", positive=True),
            "partial_rotary_factor": 1.0}
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is None:
        return rope
    values = np.asarray(freqs.data, dtype=np.float64).ravel()
    rotated = int(np.sum(values == 1.0))
    if len(values) != global_head_dim // 2 or not np.all(values[:rotated] == 1.0) or not np.all(values[rotated:] >= 1e29):
        raise DSparkError(f"GGUF {name}: rope_freqs is not the proportional RoPE llama.cpp writes for Gemma-4 "
                          f"({len(values)} factors for head size {global_head_dim}); it cannot be read")
    rope["partial_rotary_factor"] = 2 * rotated / global_head_dim
    return rope


def gemma4_config(reader, name: str) -> dict[str, Any]:
    """The HF `gemma4_text` config (as a dict) of a llama.cpp Gemma-4 GGUF (`name`: the file's, for messages);
    one line naming the key for what it lacks or dspark cannot hold."""
    where = f"GGUF {name}: {ARCH}"
    f = Fields(_metadata(reader), where)
    n = f.integer("block_count", 1)
    pattern = f.get("attention.sliding_window_pattern")
    if not (isinstance(pattern, list) and len(pattern) == n and all(isinstance(p, bool) for p in pattern)):
        f.fail("attention.sliding_window_pattern", f"must list {n} booleans (sliding or not, per layer)")
    layer_types = [SLIDING if p else FULL for p in pattern]
    full_ids = [i for i, t in enumerate(layer_types) if t == FULL]
    kv = _per_layer(f, "attention.head_count_kv", n)
    heads = _uniform(f, "attention.head_count", _per_layer(f, "attention.head_count", n), "all")
    ffn = _uniform(f, "feed_forward_length", _per_layer(f, "feed_forward_length", n), "all")
    global_dim, sliding_dim = f.integer("attention.key_length", 1), f.integer("attention.key_length_swa", 1)
    if f.integer("attention.value_length", 1, default=global_dim) != global_dim or \
            f.integer("attention.value_length_swa", 1, default=sliding_dim) != sliding_dim:
        f.fail("attention.value_length", "differs from attention.key_length; Gemma-4 keys and values share a size")
    if f.integer("rope.dimension_count_swa", 1, default=sliding_dim) != sliding_dim:
        f.fail("rope.dimension_count_swa", f"is not the sliding head size {sliding_dim}: partial RoPE on sliding "
               "layers is not supported")
    names = {t.name for t in reader.tensors}
    with_v = [i for i in full_ids if f"blk.{i}.attn_v.weight" in names]
    if with_v and len(with_v) != len(full_ids):
        f.fail("attn_v", f"is stored for full layers {with_v} but not for the others")
    sliding_kv = _uniform(f, "attention.head_count_kv", [kv[i] for i, t in enumerate(layer_types) if t == SLIDING],
                          "sliding")
    full_kv = _uniform(f, "attention.head_count_kv", [kv[i] for i in full_ids], "full")
    vocab = next((int(t.shape[-1]) for t in reader.tensors if t.name == "token_embd.weight"), None)
    if vocab is None:
        raise DSparkError(f"GGUF {name} has no token_embd.weight")
    softcap = f.get("final_logit_softcapping")
    cfg = dict(
        model_type="gemma4_text", architectures=["Gemma4ForCausalLM"], num_hidden_layers=n,
        hidden_size=f.integer("embedding_length", 1), intermediate_size=ffn, num_attention_heads=heads,
        num_key_value_heads=sliding_kv or full_kv, head_dim=sliding_dim, global_head_dim=global_dim,
        num_global_key_value_heads=full_kv or sliding_kv, attention_k_eq_v=bool(full_ids) and not with_v,
        layer_types=layer_types, sliding_window=f.integer("attention.sliding_window", 1, default=512),
        rms_norm_eps=f.number("attention.layer_norm_rms_epsilon", positive=True),
        final_logit_softcapping=float(softcap) if softcap else None,
        max_position_embeddings=f.integer("context_length", 1, default=131072), vocab_size=vocab,
        vocab_size_per_layer_input=vocab,
        hidden_size_per_layer_input=f.integer("embedding_length_per_layer_input", 0, default=0),
        num_kv_shared_layers=f.integer("attention.shared_kv_layers", 0, default=0),
        enable_moe_block=f.integer("expert_count", 0, default=0) > 0,
        hidden_activation="gelu_pytorch_tanh", attention_bias=False, use_bidirectional_attention=None,
        tie_word_embeddings="output.weight" not in names,
        rope_parameters={FULL: _full_rope(reader, f, global_dim, name),
                         SLIDING: {"rope_type": "default", "rope_theta": f.number("rope.freq_base_swa", positive=True)}},
        bos_token_id=f.get("tokenizer.ggml.bos_token_id"), pad_token_id=f.get("tokenizer.ggml.padding_token_id"),
        eos_token_id=sorted({int(f.get(k)) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
                             if f.get(k) is not None}) or None,
    )
    if with_v and full_kv != sliding_kv:  # (without k_eq_v, transformers gives full layers the sliding count)
        f.fail("attention.head_count_kv", f"is {full_kv} on full layers that store attn_v and {sliding_kv} on "
               "sliding ones; Gemma-4 configs can only differ with k_eq_v")
    return cfg
