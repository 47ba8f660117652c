"""Draft checkpoints in other layouts (z-lab/SpecForge DFlash, SpecForge DSpark, speculators dflash/dspark with d2t
maps) load as the drafter they were written from, decode exactly, and anything else is refused in one line."""
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from dspark.errors import DSparkError
from dspark.export.trace.onnx_export import export_bundle
from dspark.models.checkpoint import load_draft, read_layout, save_draft
from dspark.models.layouts import default_dflash_taps
from dspark.models.pair import Pair
from dspark.models.reference import generate_ar, generate_dspark
from dspark.models.tensors import LazyWeights
from dspark.runtime import DecodeOptions, Runtime
from support.foreign import specforge_dspark, speculators, with_cfg, zlab_dflash
from support.tiny import TinyLoaded, tiny_pair, tiny_tokenizer_folder

V = 32
IDS = [0, 2, 3, 5, 8, 9, 11, 12, 15, 17, 20, 21, 24, 26, 30, 31]  # a reduced draft vocabulary (16 of 32)


def _pair(rank=0, confidence=False, markov="vanilla", seed=0):
    return tiny_pair("qwen3", vocab=V, layers=6, seed=seed, block_size=4, markov_rank=rank, markov_head_type=markov,
                     confidence=confidence, draft_layers=2, tap_ids=(1, 2, 4))


def _same_state(loaded, original):
    want, got = original.state_dict(), loaded.state_dict()
    assert set(got) == set(want)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, msg=k)
    assert loaded.cfg == original.cfg


def _load(folder, target, **kw):
    return load_draft(folder, target.cfg, target.embed_tokens, target.lm_head, **kw)


@pytest.mark.parametrize("block_in_dflash_config", [False, True], ids=["block-top-level", "block-in-dflash_config"])
def test_zlab_dflash_loads_as_written(tmp_path, block_in_dflash_config):
    _, target, drafter = _pair()
    original = with_cfg(drafter, sample_from_anchor=False)
    folder = zlab_dflash(original, tmp_path / "z", block_in_dflash_config)
    layout = read_layout(folder)
    assert layout.name == "z-lab/SpecForge DFlash"
    assert layout.config.block_size == json.loads((folder / "config.json").read_text()).get("block_size", 5) - 1
    loaded = _load(folder, target)
    _same_state(loaded, original)
    assert loaded.lm_head is target.lm_head and not loaded.cfg.sample_from_anchor


def test_zlab_default_taps_are_spread_as_zlab_spreads_them():
    assert default_dflash_taps(36, 5) == [1, 9, 17, 25, 33]  # z-lab's Qwen3-8B drafters
    assert default_dflash_taps(40, 1) == [20]


@pytest.mark.parametrize("early_names", [False, True], ids=["heads", "logit_head-prefix"])
@pytest.mark.parametrize("anchor_first", [False, True], ids=["predict-at-masks", "shift_label"])
def test_specforge_dspark_loads_as_written(tmp_path, early_names, anchor_first):
    _, target, drafter = _pair(rank=6, confidence=True, markov="rnn")
    original = with_cfg(drafter, sample_from_anchor=anchor_first)
    folder = specforge_dspark(original, tmp_path / "s", early_names)
    assert read_layout(folder).name == "SpecForge DSpark"
    _same_state(_load(folder, target), original)


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_speculators_full_vocabulary_loads_eager_and_lazy(tmp_path, kind):
    _, target, drafter = _pair(rank=6 if kind == "dspark" else 0, confidence=kind == "dspark")
    original = with_cfg(drafter, sample_from_anchor=kind == "dspark")
    folder = speculators(original, tmp_path / "v", kind, verifier_norm=True)
    raw = json.loads((folder / "config.json").read_text())
    assert raw["aux_hidden_state_layer_ids"] == [2, 3, 5]  # hidden-state indices: DeepSpec ids + 1
    _same_state(_load(folder, target), original)
    alone = load_draft(folder)  # embed_tokens and lm_head from the checkpoint: no target needed
    _same_state(alone, original)
    lazy = LazyWeights()
    meta = _load(folder, target, lazy=lazy)
    for name, p in meta.named_parameters():
        if name.startswith(("embed_tokens.", "lm_head.")):
            assert p is target.embed_tokens.weight or p is target.lm_head.weight
        else:
            torch.testing.assert_close(lazy.read(p), original.state_dict()[name], msg=name)


def _d2t_drafter():
    hf, target, drafter = _pair(rank=6, confidence=True, seed=4)
    return hf, target, with_cfg(drafter, ids=IDS, sample_from_anchor=False, draft_vocab_size=len(IDS))


def test_speculators_d2t_drafter_has_its_own_head_and_map(tmp_path):
    _, target, original = _d2t_drafter()
    folder = speculators(original, tmp_path / "d2t")
    stored = load_file(folder / "model.safetensors")
    assert stored["lm_head.weight"].shape == (len(IDS), 32) and stored["d2t"].tolist()[:3] == [0, 1, 1]
    loaded = _load(folder, target)
    _same_state(loaded, original)
    assert loaded.draft_ids.tolist() == IDS and loaded.lm_head is not target.lm_head
    assert not torch.equal(loaded.lm_head.weight, target.lm_head.weight[IDS])  # its own rows, not the target's
    g = torch.Generator().manual_seed(0)
    block = loaded.sample_block(torch.randn(64, 4, 32, generator=g), torch.randint(0, V, (64,), generator=g),
                                torch.ones(64), torch.rand(64, 4, generator=g))
    assert set(block.tokens.unique().tolist()) <= set(IDS)
    lazy = LazyWeights()
    meta = _load(folder, target, lazy=lazy)
    assert meta.draft_ids.tolist() == IDS
    torch.testing.assert_close(lazy.read(meta.lm_head.weight), original.lm_head.weight)


def _bundle(kind, tmp_path_factory):
    root = tmp_path_factory.mktemp(kind)
    if kind == "zlab-dflash":
        hf, target, drafter = _pair(seed=3)
        folder = zlab_dflash(with_cfg(drafter, sample_from_anchor=False), root / "draft")
    else:
        hf, target, drafter = _d2t_drafter()
        folder = speculators(drafter, root / "draft")
    loaded = _load(folder, target)
    pair = Pair(TinyLoaded(hf, tiny_tokenizer_folder(root / "tok", V)), target, loaded, str(folder))
    path = export_bundle(pair, root / "bundle", max_context=256, quiet=True, check_data=False)
    return target, loaded, path


@pytest.fixture(scope="module")
def zlab_bundle(tmp_path_factory):
    return _bundle("zlab-dflash", tmp_path_factory)


@pytest.fixture(scope="module")
def d2t_bundle(tmp_path_factory):
    return _bundle("speculators-d2t", tmp_path_factory)


@pytest.mark.parametrize("bundle", ["zlab_bundle", "d2t_bundle"])
def test_a_foreign_drafter_decodes_as_the_reference_and_greedy_equals_ar(request, bundle):
    target, drafter, path = request.getfixturevalue(bundle)
    ps = [[1, 4, 2, 0], [3, 3, 5], [0, 1, 7, 9, 2]]
    with Runtime(path) as rt:
        stop = tuple(rt.manifest.stop_token_ids)
        fixed = drafter.fixed_vocab
        assert rt.manifest.draft["draft_vocab"] == (len(IDS) if fixed else None)
        assert rt.manifest.block_size == 4
        for temperature in (0.0, 1.0):
            ref = [r.token_ids for r in generate_dspark(target, drafter, ps, 20, temperature, 5, stop)]
            got = rt.generate(ps, DecodeOptions(max_tokens=20, temperature=temperature, seed=5, policy="all"))
            assert [r.token_ids for r in got] == ref
        ar = [r.token_ids for r in generate_ar(target, ps, 20, 0.0, 5, stop)]
        assert [r.token_ids for r in rt.generate(ps, DecodeOptions(max_tokens=20))] == ar


def test_the_d2t_map_is_the_heads_graph_draft_ids(d2t_bundle):
    import onnx
    from onnx import numpy_helper

    target, drafter, path = d2t_bundle
    model = onnx.load(str(path / "heads.onnx"), load_external_data=False)
    ints = [numpy_helper.to_array(t) for t in model.graph.initializer if t.data_type == onnx.TensorProto.INT64]
    assert any(a.shape == (len(IDS),) and a.tolist() == IDS for a in ints)


def _config(folder, edit):
    cfg = json.loads((folder / "config.json").read_text())
    edit(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))


def _tensors(folder, edit):
    t = load_file(folder / "model.safetensors")
    edit(t)
    save_file(t, str(folder / "model.safetensors"))


def _qkv(t):
    t["layers.0.self_attn.qkv_proj.weight"] = torch.cat([t.pop(f"layers.0.self_attn.{x}_proj.weight") for x in "qkv"])


def _twin_heads(t):
    t["markov_head.markov_w1.weight"] = t["logit_head.markov_head.markov_w1.weight"].clone()


def _offset(t, row, to):
    t["d2t"][row] = to - row


REFUSED = {  # case: (layout written, damage, message)
    "speculators eagle3": ("speculators", lambda f: _config(f, lambda c: c.update(speculators_model_type="eagle3")),
                           "a speculators 'eagle3' drafter; dspark runs DSpark/DFlash block drafters only"),
    "EAGLE architecture": ("zlab", lambda f: _config(f, lambda c: (c.pop("dflash_config"), c.update(
        architectures=["LlamaForCausalLMEagle3"]))), "is an EAGLE drafter"),
    "foreign architecture": ("zlab", lambda f: _config(f, lambda c: (c.pop("dflash_config"), c.update(
        architectures=["MistralForCausalLM"]))), "not a DSpark draft config"),
    "unknown dflash_config field": ("zlab", lambda f: _config(f, lambda c: c["dflash_config"].update(gamma=3)),
                                    "dflash_config.gamma is a field dspark does not understand"),
    "unknown speculators field": ("speculators", lambda f: _config(f, lambda c: c.update(
        eagle_aux_hidden_state_layer_ids=[1])), "speculators field 'eagle_aux_hidden_state_layer_ids'"),
    "attention bias": ("zlab", lambda f: _config(f, lambda c: c.update(attention_bias=True)), "attention_bias"),
    "sliding-window layers": ("zlab", lambda f: _config(f, lambda c: c["layer_types"].__setitem__(
        0, "sliding_attention")), "has sliding_attention layers"),
    "activation": ("speculators", lambda f: _config(f, lambda c: c["transformer_layer_config"].update(
        hidden_act="gelu")), "hidden_act is 'gelu'"),
    "projector": ("specforge", lambda f: _config(f, lambda c: c["dflash_config"].update(projector_type="mlp")),
                  "projector_type is 'mlp'"),
    "Domino prefix": ("specforge", lambda f: _config(f, lambda c: c["dflash_config"].update(
        pure_draft_prefix_len=2)), "a Domino drafter"),
    "no mask token (DFlash)": ("zlab", lambda f: _config(f, lambda c: c["dflash_config"].pop("mask_token_id")),
                               "names no dflash_config.mask_token_id"),
    "no mask token (speculators)": ("speculators", lambda f: _config(f, lambda c: c.update(mask_token_id=None)),
                                    "names no mask_token_id"),
    "target hidden size": ("speculators", lambda f: _config(f, lambda c: c.update(target_hidden_size=64)),
                           "target_hidden_size 64 differs"),
    "block of one slot": ("zlab", lambda f: _config(f, lambda c: c.update(block_size=1)), "leaves no mask slot"),
    "no taps nor depth": ("zlab", lambda f: _config(f, lambda c: (c.pop("num_target_layers"), c[
        "dflash_config"].pop("target_layer_ids"))), "names neither num_target_layers"),
    "fused qkv": ("zlab", lambda f: _tensors(f, _qkv), "has a fused qkv_proj"),
    "heads under two names": ("specforge-early", lambda f: _tensors(f, _twin_heads), "which are one weight"),
    "no d2t": ("d2t", lambda f: _tensors(f, lambda t: t.pop("d2t")), "has no d2t map"),
    "d2t outside the vocabulary": ("d2t", lambda f: _tensors(f, lambda t: _offset(t, 3, V)), "outside the target's"),
    "d2t twice onto one id": ("d2t", lambda f: _tensors(f, lambda t: _offset(t, 3, IDS[2])), "twice onto one"),
    "d2t not integers": ("d2t", lambda f: _tensors(f, lambda t: t.update(d2t=t["d2t"].float())), "integer offsets"),
    "t2d disagrees": ("d2t", lambda f: _tensors(f, lambda t: t["t2d"].__setitem__(IDS[0], False)),
                      "does not mark the 16 ids"),
    "reduced head, full vocabulary config": ("d2t", lambda f: _config(f, lambda c: c.update(draft_vocab_size=V)),
                                             r"lm_head.weight has shape \[16, 32\]"),
}


def _written(kind, folder):
    if kind == "d2t":
        return speculators(_d2t_drafter()[2], folder), _d2t_drafter()[1]
    _, target, drafter = _pair(rank=6 if kind.startswith(("specforge", "speculators")) else 0,
                               confidence=kind.startswith("specforge"))
    if kind == "zlab":
        return zlab_dflash(with_cfg(drafter, sample_from_anchor=False), folder), target
    if kind.startswith("specforge"):
        return specforge_dspark(drafter, folder, early_names=kind == "specforge-early"), target
    return speculators(drafter, folder), target


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_layout_dspark_does_not_run_is_refused_in_one_line(tmp_path, case):
    kind, damage, message = REFUSED[case]
    folder, target = _written(kind, tmp_path / "draft")
    _load(folder, target)  # loads before the damage
    damage(folder)
    with pytest.raises(DSparkError, match=message) as err:
        _load(folder, target)
    assert "\n" not in str(err.value)


def test_a_d2t_drafter_is_never_written_nor_given_another_vocabulary(tmp_path):
    hf, target, drafter = _d2t_drafter()
    with pytest.raises(DSparkError, match="no DeepSpec layout"):
        save_draft(drafter, tmp_path / "out")
    with pytest.raises(DSparkError, match="its own 16-token vocabulary"):
        drafter.set_draft_vocab(list(range(16)))
    pair = Pair(TinyLoaded(hf, tiny_tokenizer_folder(tmp_path / "tok", V)), target, drafter, "random")
    with pytest.raises(DSparkError, match="drop --draft-vocab"):
        export_bundle(pair, tmp_path / "bundle", quiet=True, check_data=False, draft_vocab=8, ranking=[1, 2])
    assert not (tmp_path / "bundle").exists() and np.array_equal(drafter.draft_ids.numpy(), IDS)
