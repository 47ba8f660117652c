"""The Gemma-4 DSpark drafter (DeepSpec's Gemma4DSparkModel): its config.json, its layer against transformers'
Gemma-4 modules, checkpoints, and lossless greedy decoding on a tiny random pair."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import Gemma4TextConfig
from transformers.models.gemma4.modeling_gemma4 import Gemma4TextDecoderLayer, Gemma4TextRotaryEmbedding

from dspark.errors import DSparkError
from dspark.models.checkpoint import load_draft, save_draft
from dspark.models.config import DraftConfig, TargetConfig, draft_config_for
from dspark.models.drafter import DSparkDrafter
from dspark.models.layers import rope_cos_sin
from dspark.models.reference import generate_ar, generate_dspark
from support.gemma4 import GEMMA4_12B_DRAFT, GEMMA4_12B_IT, F, S, tiny_gemma4_pair, tiny_gemma4_text
from support.tiny import tiny_hf

TOL = 1e-5


def deepspec_style_config() -> dict:
    """What DeepSpec's build_draft_config + save_pretrained write for the tiny target (transformers 5.10)."""
    cfg = tiny_gemma4_text()
    cfg.update(architectures=["Gemma4DSparkModel"], num_hidden_layers=2, layer_types=[F, F], block_size=4,
               mask_token_id=4, target_layer_ids=[0, 1, 2], num_target_layers=4, num_anchors=512,
               enable_confidence_head=True, confidence_head_with_markov=True, markov_rank=8,
               markov_head_type="vanilla", target_model_type="gemma4", target_text_model_type="gemma4_text",
               tie_word_embeddings=False, dtype="float32")
    cfg["rope_parameters"] = dict(cfg["rope_parameters"], rope_theta=None, rope_type="default")  # its leftovers
    return cfg


def test_reads_deepspec_gemma4_draft_config_and_writes_it_back():
    raw = deepspec_style_config()
    cfg = DraftConfig.from_dict(raw)
    assert (cfg.variant, cfg.head_dim, cfg.num_kv_heads, cfg.k_eq_v) == ("gemma4", 16, 1, True)
    assert cfg.rope["rope_type"] == "proportional" and cfg.final_logit_softcapping == 30.0
    assert cfg.embed_scale == pytest.approx(32 ** 0.5)
    out = cfg.to_dict()
    for key in ("architectures", "model_type", "head_dim", "num_key_value_heads", "global_head_dim",
                "num_global_key_value_heads", "attention_k_eq_v", "layer_types", "final_logit_softcapping",
                "hidden_activation", "num_anchors", "target_layer_ids", "mask_token_id", "markov_rank"):
        assert out[key] == raw[key], key
    assert out["rope_parameters"][F] == dict(raw["rope_parameters"][F], factor=1.0)
    assert DraftConfig.from_dict(out) == cfg


def test_12b_draft_geometry():
    """DeepSpec's dspark_gemma4_12b config: 5 layers of the target's full-layer geometry, no v_proj."""
    target = TargetConfig.from_dict(GEMMA4_12B_IT)
    opts = dict(GEMMA4_12B_DRAFT)
    layers = opts.pop("num_draft_layers")
    cfg = draft_config_for(target, num_layers=layers, **opts)
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.num_heads, cfg.k_eq_v) == (512, 1, 16, True)
    assert cfg.rope == target.rope_full
    with torch.device("meta"):
        drafter = DSparkDrafter(cfg)
    own = {k: v for k, v in drafter.state_dict().items() if not k.startswith(("embed_tokens", "lm_head"))}
    assert not any("v_proj" in k for k in own)
    # 5 x 241,844,225 (layers) + fc 73,728,000 + norms 7,680 + Markov 134,217,728 + confidence 4,097
    assert sum(v.numel() for v in own.values()) == 1_417_178_630  # + the target's embedding and head


def test_draft_style_must_match_the_target_family():
    llama = TargetConfig.from_dict(tiny_hf("llama").config.to_dict())
    gemma_style = DraftConfig.from_dict(dict(deepspec_style_config(), num_target_layers=4))
    with pytest.raises(DSparkError, match="gemma4-style draft for a llama target"):
        gemma_style.check_fits(llama)
    gemma = TargetConfig.from_dict(tiny_gemma4_text())
    qwen_style = draft_config_for(llama, mask_token_id=4, target_layer_ids=(0, 1, 2))
    with pytest.raises(DSparkError, match="qwen3-style draft for a gemma4 target"):
        qwen_style.check_fits(gemma)


@torch.no_grad()
def test_draft_layer_matches_transformers_gemma4_modules():
    """One draft layer = transformers' full-attention Gemma-4 layer whose attention runs, unmasked, over
    [context ; input_layernorm(block)] (the context is projected to K/V but not normed), read at the block rows."""
    _, _, drafter = tiny_gemma4_pair()
    ours = drafter.layers[0]
    hf_cfg = Gemma4TextConfig(**tiny_gemma4_text(num_hidden_layers=1, layer_types=[F]))
    hf_cfg._attn_implementation = "eager"
    theirs = Gemma4TextDecoderLayer(hf_cfg, 0).eval()
    missing = theirs.load_state_dict(ours.state_dict(), strict=True)
    assert not missing.missing_keys and theirs.self_attn.v_proj is None
    g = torch.Generator().manual_seed(3)
    c, b = 7, 4
    x, ctx = torch.randn(1, b, 32, generator=g), torch.randn(1, c, 32, generator=g)
    positions = torch.arange(c + b)[None]
    cos, sin = Gemma4TextRotaryEmbedding(hf_cfg)(x, positions, F)
    u = theirs.input_layernorm(x)
    a, _ = theirs.self_attn(hidden_states=torch.cat([ctx, u], 1), position_embeddings=(cos, sin),
                            attention_mask=None, shared_kv_states={})
    h = x + theirs.post_attention_layernorm(a[:, c:])
    want = (h + theirs.post_feedforward_layernorm(theirs.mlp(theirs.pre_feedforward_layernorm(h)))) * theirs.layer_scalar
    ctx_rope = rope_cos_sin(positions[:, :c], drafter.inv_freq, x.dtype)
    blk_rope = rope_cos_sin(positions[:, c:], drafter.inv_freq, x.dtype)
    got, _ = ours(x, ctx, ctx_rope, blk_rope, [torch.ones(1, 1, 1, 1, c, dtype=torch.bool),
                                               torch.ones(1, 1, 1, 1, b, dtype=torch.bool)])
    assert (got - want).abs().max() < TOL


@torch.no_grad()
@pytest.mark.parametrize("k_eq_v", [True, False])
def test_checkpoint_round_trip(tmp_path, k_eq_v):
    hf, target, drafter = tiny_gemma4_pair(attention_k_eq_v=k_eq_v)
    save_draft(drafter, tmp_path / "d", dtype=torch.float32)
    written = json.loads((tmp_path / "d" / "config.json").read_text())
    assert written["architectures"] == ["Gemma4DSparkModel"] and written["attention_k_eq_v"] is k_eq_v
    loaded = load_draft(tmp_path / "d", target.cfg, hf.model.embed_tokens, hf.lm_head).eval()
    assert loaded.layers[0].layer_scalar.item() == drafter.layers[0].layer_scalar.item() != 1.0
    assert (loaded.layers[0].self_attn.v_proj is None) is k_eq_v
    feats = torch.randn(1, 6, 3 * 32, generator=torch.Generator().manual_seed(0))
    args = (feats, torch.tensor([6]), torch.tensor([9]), torch.zeros(1, 8, dtype=torch.int64))
    h1, _ = drafter.backbone(*args, drafter.new_cache(1, 8))
    h2, _ = loaded.backbone(*args, loaded.new_cache(1, 8))
    assert torch.equal(h1, h2)


@torch.no_grad()
def test_lazy_load_reads_the_layer_scalars_and_registers_every_weight(tmp_path):
    """A lazily loaded Gemma-4 drafter (the export's path): its layer scalars, buffers of one number, are read at
    load; every parameter stays on the meta device and reads back as saved."""
    from dspark.models.tensors import LazyWeights

    hf, target, drafter = tiny_gemma4_pair()
    save_draft(drafter, tmp_path / "d", dtype=torch.float32)
    lazy = LazyWeights()
    loaded = load_draft(tmp_path / "d", target.cfg, hf.model.embed_tokens, hf.lm_head, lazy=lazy)
    assert loaded.layers[0].layer_scalar.item() == drafter.layers[0].layer_scalar.item() != 1.0
    saved = dict(drafter.named_parameters())
    for name, param in loaded.named_parameters():
        if name in saved and param.is_meta:
            assert torch.equal(lazy.read(param), saved[name]), name
    assert any(p.is_meta for p in loaded.parameters())


@torch.no_grad()
@pytest.mark.parametrize("k_eq_v", [True, False])
def test_generate_dspark_greedy_equals_generate_ar(k_eq_v):
    """Two requests of different lengths, decoded well past the sliding window (5)."""
    _, target, drafter = tiny_gemma4_pair(attention_k_eq_v=k_eq_v)
    prompts = [[3, 14, 15, 9, 2, 6, 5], [7, 8]]
    ar = generate_ar(target, prompts, max_tokens=14)
    ds = generate_dspark(target, drafter, prompts, max_tokens=14)
    for a, d in zip(ar, ds):
        assert d.token_ids == a.token_ids
    assert sum(sum(d.accepted) for d in ds) > 0  # the drafts are checked, not all rejected
