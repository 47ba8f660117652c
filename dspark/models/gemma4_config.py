"""Gemma-4 text configs: the per-layer geometry (sliding-window vs full layers) a uniform LayerGeometry lacks.

A Gemma-4 config.json is either a multimodal `gemma4` / `gemma4_unified` config whose decoder lives under
`text_config`, or a `gemma4_text` / `gemma4_unified_text` one. Two spellings of the full layers' geometry exist:
the checkpoints' own (`global_head_dim`, `num_global_key_value_heads`, as transformers 5.10 writes it) and the
`per_layer_config` overrides newer transformers write instead; both are read here.
"""
from __future__ import annotations

import math
from typing import Any

from dspark.errors import DSparkError
from dspark.schema import Fields, check_number

GEMMA4_TOP = ("gemma4", "gemma4_unified")
GEMMA4_TEXT = ("gemma4_text", "gemma4_unified_text")
SLIDING, FULL = "sliding_attention", "full_attention"
ACTIVATIONS = ("gelu_pytorch_tanh",)  # the one the released Gemma-4 configs use


def gemma4_text_config(cfg: dict[str, Any], where: str) -> tuple[dict[str, Any], str]:
    """The decoder's config (and where it is) of a Gemma-4 config.json, top-level or text-only."""
    if cfg.get("model_type") in GEMMA4_TOP:
        text = Fields(cfg, where).obj("text_config").raw
        if text.get("model_type", GEMMA4_TEXT[GEMMA4_TOP.index(cfg["model_type"])]) not in GEMMA4_TEXT:
            raise DSparkError(f"{where}.text_config.model_type {text.get('model_type')!r} is not a Gemma-4 text "
                              f"decoder ({', '.join(GEMMA4_TEXT)})")
        return text, f"{where}.text_config"
    return cfg, where


def _rope(raw: Any, where: str) -> dict[str, Any]:
    f = Fields(raw, where)
    kind = f.string("rope_type", default="default", choices=("default", "proportional"))
    rope = {"rope_type": kind, "rope_theta": f.number("rope_theta", positive=True, default=10000.0)}
    if kind == "proportional":
        rope["partial_rotary_factor"] = f.number("partial_rotary_factor", positive=True, default=1.0)
        rope["factor"] = f.number("factor", positive=True, default=1.0)
        if rope["partial_rotary_factor"] > 1:
            f.fail("partial_rotary_factor", f"is {rope['partial_rotary_factor']}, above 1")
    return rope


def gemma4_ropes(f: Fields) -> tuple[dict[str, Any], dict[str, Any]]:
    """RoPE of the sliding and of the full layers (`rope_parameters` keyed by layer type)."""
    ropes = f.obj("rope_parameters", default={
        SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
        FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}})
    # (a top-level rope_theta / rope_type beside the two is what transformers' standardisation leaves in a config
    # whose layer_types lost a kind, e.g. DeepSpec's draft configs: it applies to neither and is ignored)
    if not set(ropes.raw) <= {SLIDING, FULL, "rope_theta", "rope_type"}:
        f.fail("rope_parameters", f"must be keyed by {SLIDING} / {FULL}, not {sorted(ropes.raw)}")
    return (_rope(ropes.raw.get(SLIDING, {}), f"{ropes.where}.{SLIDING}"),
            _rope(ropes.raw.get(FULL, {}), f"{ropes.where}.{FULL}"))


def refuse_unsupported(f: Fields) -> None:
    """One line for each Gemma-4 feature dspark does not implement (gemma-4-12B-it uses none of them)."""
    if f.integer("hidden_size_per_layer_input", 0, default=0):
        f.fail("hidden_size_per_layer_input", "> 0: per-layer input embeddings (PLE, the E2B/E4B models) are not "
               "supported")
    if f.boolean("enable_moe_block", default=False):
        f.fail("enable_moe_block", "is true: Gemma-4 mixture-of-experts blocks (26B-A4B) are not supported")
    if f.integer("num_kv_shared_layers", 0, default=0):
        f.fail("num_kv_shared_layers", "> 0: layers reusing an earlier layer's K/V are not supported")
    if f.get("use_bidirectional_attention") == "all":
        f.fail("use_bidirectional_attention", "is 'all': only a causal decoder can be a target")
    f.string("hidden_activation", default=ACTIVATIONS[0], choices=ACTIVATIONS)


def gemma4_layer_dims(f: Fields, layer_types: list[str], head_dim: int, kv_heads: int
                      ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per-layer (head_dim, num_key_value_heads): sliding layers use head_dim / num_key_value_heads; full layers
    global_head_dim and, when attention_k_eq_v, num_global_key_value_heads (transformers' rule)."""
    dims, heads = [head_dim] * len(layer_types), [kv_heads] * len(layer_types)
    if f.has("per_layer_config"):
        over = f.obj("per_layer_config")
        for key, value in over.raw.items():
            one = Fields(value, f"{over.where}.{key}")
            if not (isinstance(key, str) and key.isdigit() and int(key) < len(layer_types)):
                over.fail(str(key), f"is not a layer index below {len(layer_types)}")
            if not set(one.raw) <= {"head_dim", "num_key_value_heads"}:
                one.fail("", f"overrides {sorted(one.raw)}; only head_dim and num_key_value_heads are supported")
            dims[int(key)] = one.integer("head_dim", 1, default=dims[int(key)])
            heads[int(key)] = one.integer("num_key_value_heads", 1, default=heads[int(key)])
    else:
        k_eq_v = f.boolean("attention_k_eq_v", default=False)
        global_dim = f.integer("global_head_dim", 1, default=512)
        global_kv = f.integer("num_global_key_value_heads", 1, default=kv_heads) if k_eq_v else kv_heads
        for i, kind in enumerate(layer_types):
            if kind == FULL:
                dims[i], heads[i] = global_dim, global_kv
    return tuple(dims), tuple(heads)


def gemma4_fields(f: Fields, num_layers: int, heads: int, head_dim: int, kv_heads: int) -> dict[str, Any]:
    """TargetConfig's Gemma-4 fields from a text config (unsupported features refused, one line each)."""
    refuse_unsupported(f)
    layer_types = f.get("layer_types")
    if layer_types is None:  # transformers' default: every 6th layer full, and the last
        layer_types = [SLIDING if (i + 1) % 6 else FULL for i in range(num_layers)]
    if not (isinstance(layer_types, list) and len(layer_types) == num_layers
            and all(t in (SLIDING, FULL) for t in layer_types)):
        f.fail("layer_types", f"must list {num_layers} entries of {SLIDING} / {FULL}")
    layer_types = list(layer_types[:-1]) + [FULL]  # transformers forces the last layer to full attention
    dims, kv = gemma4_layer_dims(f, layer_types, head_dim, kv_heads)
    for i, h in enumerate(kv):
        if heads % h:
            f.fail("layer_types", f"layer {i} has {h} KV heads, which do not divide {heads} attention heads")
    sliding, full = gemma4_ropes(f)
    softcap = f.get("final_logit_softcapping")
    if softcap is not None:
        check_number(softcap, f"{f.where}.final_logit_softcapping", positive=True)
    return dict(
        layer_types=tuple(layer_types), layer_head_dims=dims, layer_kv_heads=kv,
        sliding_window=f.integer("sliding_window", 1, default=512),
        k_eq_v=f.boolean("attention_k_eq_v", default=False),
        final_logit_softcapping=float(softcap or 0.0),
        embed_scale=math.sqrt(f.integer("hidden_size", 1)),
        rope=sliding, rope_full=full,
    )


# -- the Gemma-4 DSpark draft (DeepSpec's Gemma4DSparkModel: config = the target's text config + DSpark fields) --

# kept verbatim in DraftConfig.extra (the sliding layers' geometry, which the draft does not use but its config
# carries), and re-derived from the draft's own fields when written
GEMMA4_DRAFT_KEPT = ("head_dim", "num_key_value_heads", "rope_parameters", "model_type")
GEMMA4_DRAFT_DERIVED = ("global_head_dim", "num_global_key_value_heads", "attention_k_eq_v", "final_logit_softcapping",
                        "hidden_activation", "hidden_size_per_layer_input", "enable_moe_block",
                        "num_kv_shared_layers", "use_double_wide_mlp")


def gemma4_draft_fields(f: Fields, geometry: dict[str, Any]) -> dict[str, Any]:
    """A Gemma-4 draft's attention geometry follows the target's full layers: head_dim = global_head_dim; KV heads
    = num_global_key_value_heads with attention_k_eq_v (no v_proj), else num_key_value_heads; full-layer RoPE."""
    refuse_unsupported(f)
    k_eq_v = f.boolean("attention_k_eq_v", default=False)
    kv = f.integer("num_global_key_value_heads", 1) if k_eq_v else geometry["num_kv_heads"]
    if geometry["num_heads"] % kv:
        f.fail("num_global_key_value_heads", f"{kv} does not divide num_attention_heads {geometry['num_heads']}")
    softcap = f.get("final_logit_softcapping")
    if softcap is not None:
        check_number(softcap, f"{f.where}.final_logit_softcapping", positive=True)
    geometry.update(head_dim=f.integer("global_head_dim", 1, default=512), num_kv_heads=kv, rope=gemma4_ropes(f)[1])
    return dict(variant="gemma4", k_eq_v=k_eq_v, final_logit_softcapping=float(softcap or 0.0),
                embed_scale=math.sqrt(geometry["hidden_size"]))


def gemma4_draft_geometry_dict(cfg: Any) -> dict[str, Any]:
    """The Gemma-4 text-config fields of a draft's config.json (what DeepSpec's Gemma4DSparkModel reads)."""
    extra = cfg.extra
    ropes = dict(extra.get("rope_parameters") or {SLIDING: {"rope_type": "default", "rope_theta": 10000.0}})
    ropes[FULL] = dict(cfg.rope)
    out = dict(
        model_type=extra.get("target_text_model_type", extra.get("model_type", "gemma4_text")),
        architectures=["Gemma4DSparkModel"],
        head_dim=extra.get("head_dim", cfg.head_dim),
        num_key_value_heads=extra.get("num_key_value_heads", cfg.num_kv_heads) if cfg.k_eq_v else cfg.num_kv_heads,
        global_head_dim=cfg.head_dim,
        num_global_key_value_heads=cfg.num_kv_heads,
        attention_k_eq_v=cfg.k_eq_v,
        rope_parameters=ropes,
        final_logit_softcapping=cfg.final_logit_softcapping or None,
        hidden_activation=ACTIVATIONS[0],
        hidden_size_per_layer_input=0, enable_moe_block=False, num_kv_shared_layers=0, use_double_wide_mlp=False,
    )
    return out
