"""Gemma-4 targets: config reading and the wrapper against transformers' Gemma-4 (fp32, 1e-5)."""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma4UnifiedTextConfig

from dspark.errors import DSparkError
from dspark.models.config import TargetConfig
from dspark.models.layer_kv import LayerKV
from dspark.models.reference import _write, generate_ar
from dspark.models.pair import load_pair
from dspark.models.target import load_target, wrap_target
from support.gemma4 import GEMMA4_12B_IT, F, S, param_count, tiny_gemma4, tiny_gemma4_text
from support.tiny import tiny_tokenizer_folder

# fp32 against transformers' own Gemma-4: the two sum in different orders, a few ulp apart on logits of size ~3
# (1.1e-5 on one machine)
TOL = 5e-5


def test_reads_the_12b_config():
    cfg = TargetConfig.from_dict(GEMMA4_12B_IT)
    assert (cfg.family, cfg.num_layers, cfg.hidden_size, cfg.vocab_size) == ("gemma4", 48, 3840, 262144)
    assert cfg.full_layer_ids == tuple(range(5, 48, 6))
    assert {(cfg.kv_heads_of(i), cfg.head_dim_of(i)) for i in cfg.full_layer_ids} == {(1, 512)}
    assert {(cfg.kv_heads_of(i), cfg.head_dim_of(i)) for i in range(48) if cfg.is_sliding(i)} == {(8, 256)}
    assert cfg.k_eq_v and cfg.sliding_window == 1024 and cfg.final_logit_softcapping == 30.0
    assert cfg.embed_scale == pytest.approx(3840 ** 0.5) and cfg.tie_word_embeddings and not cfg.uniform
    assert cfg.rope_full == {"rope_type": "proportional", "rope_theta": 1e6, "partial_rotary_factor": 0.25,
                             "factor": 1.0}
    assert cfg.rope_of(0)["rope_theta"] == 1e4 and cfg.rope_of(5) is cfg.rope_full
    assert TargetConfig.from_dict(GEMMA4_12B_IT["text_config"]) == cfg  # the text config alone reads the same


def test_12b_size():
    """11.907e9 text parameters (1.007e9 of them the tied embedding): 23.81 GB in bf16, as transformers builds it."""
    n = param_count(GEMMA4_12B_IT["text_config"])
    assert n["total"] == 11_907_350_320
    text = {k: v for k, v in GEMMA4_12B_IT["text_config"].items() if k != "model_type"}
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(Gemma4UnifiedTextConfig(**text))
    params = sum(p.numel() for p in hf.parameters()) + sum(b.numel() for n, b in hf.named_buffers()
                                                            if n.endswith("layer_scalar"))
    assert params == n["total"]


def test_per_layer_config_spelling_reads_like_global_fields():
    """transformers 5.2x writes per_layer_config instead of global_head_dim / num_global_key_value_heads."""
    ours = TargetConfig.from_dict(tiny_gemma4_text())
    assert TargetConfig.from_dict(tiny_gemma4().config.to_dict()) == ours
    assert [ours.head_dim_of(i) for i in range(4)] == [8, 16, 8, 16]
    assert [ours.kv_heads_of(i) for i in range(4)] == [2, 1, 2, 1]


@pytest.mark.parametrize("key, value, says", [
    ("hidden_size_per_layer_input", 16, "per-layer input embeddings"),
    ("enable_moe_block", True, "mixture-of-experts"),
    ("num_kv_shared_layers", 2, "earlier layer's K/V"),
    ("hidden_activation", "silu", "not one of gelu_pytorch_tanh"),
])
def test_unsupported_features_are_refused_in_one_line(key, value, says):
    cfg = copy.deepcopy(GEMMA4_12B_IT)
    cfg["text_config"][key] = value
    with pytest.raises(DSparkError, match=says) as err:
        TargetConfig.from_dict(cfg)
    assert "\n" not in str(err.value)


def _hf(model, ids):
    out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
    return out.logits, out.hidden_states


@torch.no_grad()
def test_prefill_and_steps_match_transformers_past_the_window():
    """Two requests of different lengths: prefill, then single-token steps well past sliding_window (5), each
    position's logits and taps against transformers on that request's whole sequence."""
    hf = tiny_gemma4()
    taps = (-1, 0, 1, 2)
    target = wrap_target(hf, taps).eval()
    assert type(target).__name__ == "Gemma4Target"
    g = torch.Generator().manual_seed(1)
    seqs = torch.randint(0, 96, (2, 16), generator=g)
    lengths = [6, 3]
    cache = target.new_cache(2, 20)
    assert isinstance(cache, LayerKV) and [tuple(t.shape) for t in cache.groups] == [(2, 2, 2, 2, 20, 8),
                                                                                    (2, 2, 2, 1, 20, 16)]
    prompt = seqs[:, :6].clone()
    step = target(prompt, torch.zeros(2, 20, dtype=torch.int64), cache)
    _write(cache, step.new_kv, [0, 0], lengths)
    for b, n in enumerate(lengths):
        logits, hidden = _hf(hf, seqs[b:b + 1, :n])
        assert (target.logits(step.hidden[b:b + 1, :n]) - logits).abs().max() < TOL
        want = torch.cat([hidden[i + 1] for i in taps], dim=-1)
        assert (step.taps[b:b + 1, :n] - want).abs().max() < TOL
    cache_len = list(lengths)
    for _ in range(10):
        nxt = torch.stack([seqs[b, cache_len[b]] for b in range(2)])[:, None]
        mask = (torch.arange(20)[None] < torch.tensor(cache_len)[:, None]).long()
        step = target(nxt, mask, cache)
        _write(cache, step.new_kv, cache_len, [1, 1])
        cache_len = [n + 1 for n in cache_len]
        for b, n in enumerate(cache_len):
            logits, hidden = _hf(hf, seqs[b:b + 1, :n])
            assert (target.logits(step.hidden[b]) - logits[0, -1]).abs().max() < TOL
            want = torch.cat([hidden[i + 1][0, -1] for i in taps], dim=-1)
            assert (step.taps[b, 0] - want).abs().max() < TOL
    assert min(cache_len) > 2 * hf.config.sliding_window


@torch.no_grad()
def test_multi_token_step_and_tail_match_transformers():
    """A verify-sized step (several new tokens after a cache) and tail() (the layers after a tap, no cache)."""
    hf = tiny_gemma4(seed=3)
    target = wrap_target(hf, (1,)).eval()
    seq = torch.randint(0, 96, (1, 14), generator=torch.Generator().manual_seed(2))
    logits, hidden = _hf(hf, seq)
    cache = target.new_cache(1, 16)
    first = target(seq[:, :6], torch.zeros(1, 16, dtype=torch.int64), cache)
    _write(cache, first.new_kv, [0], [6])
    step = target(seq[:, 6:], (torch.arange(16) < 6).long()[None], cache)
    assert (target.logits(step.hidden) - logits[:, 6:]).abs().max() < TOL
    assert (target.tail(hidden[2], 2) - hidden[-1]).abs().max() < TOL  # hidden[-1] is after the final norm


def test_softcap_bounds_the_logits():
    hf = tiny_gemma4()
    with torch.no_grad():
        hf.lm_head.weight.mul_(1000.0)
        target = wrap_target(hf).eval()
        hidden = target(torch.tensor([[1, 2, 3]]), torch.zeros(1, 4, dtype=torch.int64), target.new_cache(1, 4)).hidden
        logits = target.logits(hidden)
    assert logits.abs().max() <= 30.0 and logits.abs().max() > 29.0
    assert (logits - hf(input_ids=torch.tensor([[1, 2, 3]])).logits).abs().max() < 1e-4


@torch.no_grad()
def test_generate_ar_equals_transformers_greedy():
    hf = tiny_gemma4(seed=5)
    target = wrap_target(hf).eval()
    prompt = [3, 14, 15, 9, 2]
    ours = generate_ar(target, [prompt], max_tokens=12)[0].token_ids
    ids = torch.tensor([prompt])
    for _ in range(12):
        ids = torch.cat([ids, hf(input_ids=ids).logits[:, -1:].argmax(-1)], dim=1)
    assert ours == ids[0, len(prompt):].tolist()


def test_layer_types_must_match_the_layer_count():
    with pytest.raises(DSparkError, match="layer_types must list 4 entries"):
        TargetConfig.from_dict(tiny_gemma4_text(layer_types=[S, F]))


@torch.no_grad()
def test_load_target_eager_and_lazy(tmp_path):
    """From a saved folder: the eager load, and the lazy one (meta modules; layer_scalar read from the checkpoint
    like the weights, embed_scale known from the module) once a pair realizes it."""
    hf = tiny_gemma4(seed=2)
    folder = tmp_path / "gemma"
    hf.save_pretrained(folder)
    tiny_tokenizer_folder(folder, 90)  # ids 90..95 unused: the random drafter's mask token
    seq = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
    want = hf(input_ids=seq).logits
    for target in (load_target(str(folder)).wrapper(), None):
        if target is None:
            pair = load_pair(str(folder), "random", lazy=True)
            assert pair.loaded.lazy is not None and pair.drafter.cfg.variant == "gemma4"
            pair.realize()
            target = pair.target
        got = target.logits(target(seq, torch.zeros(1, 7, dtype=torch.int64), target.new_cache(1, 7)).hidden)
        assert (got - want).abs().max() < TOL


def _multimodal(kind: str):
    """The tiny Gemma-4 as a gemma4 (multimodal, no towers) or gemma4_unified_text model (the 12B's decoder type)."""
    import transformers as tf

    text = {k: v for k, v in tiny_gemma4_text().items() if k != "model_type"}
    torch.manual_seed(4)
    if kind == "gemma4":
        cfg = tf.Gemma4Config(text_config=tf.Gemma4TextConfig(**text), vision_config=None, audio_config=None)
        model = tf.Gemma4ForConditionalGeneration(cfg)
    else:
        drop = ("vocab_size_per_layer_input", "hidden_size_per_layer_input", "enable_moe_block", "num_experts",
                "top_k_experts", "moe_intermediate_size")
        model = tf.Gemma4UnifiedForCausalLM(tf.Gemma4UnifiedTextConfig(**{k: v for k, v in text.items()
                                                                           if k not in drop}))
    model.config._attn_implementation = "eager"
    return model.eval()


@torch.no_grad()
@pytest.mark.parametrize("kind", ["gemma4", "gemma4_unified_text"])
def test_multimodal_and_unified_models_wrap(kind):
    hf = _multimodal(kind)
    target = wrap_target(hf, (0, 1)).eval()
    assert target.cfg.family == "gemma4" and target.cfg.full_layer_ids == (1, 3)
    seq = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    got = target.logits(target(seq, torch.zeros(1, 8, dtype=torch.int64), target.new_cache(1, 8)).hidden)
    assert (got - hf(input_ids=seq).logits).abs().max() < TOL
