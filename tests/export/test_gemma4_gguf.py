"""Gemma-4 targets given as GGUF files, in the layout llama.cpp's converter writes them (support.gemma4's writer,
which equals the converter's output tensor for tensor on this tiny model in F32, F16, BF16 and Q8_0): the config
rebuilt from the file's metadata, weights read as the gguf package dequantizes them, and a bundle exported from
the file that checks and decodes like the PyTorch reference."""
import gguf
import numpy as np
import pytest
import torch

from dspark.bundle import Manifest
from dspark.errors import DSparkError
from dspark.export.check.parity import check_bundle, format_report
from dspark.models.config import TargetConfig
from dspark.models.gguf_gemma4 import gemma4_config
from dspark.models.reference import generate_ar
from dspark.models.target import load_target, wrap_target
from dspark.runtime import DecodeOptions, Runtime
from support.gemma4 import gemma_tokenizer_folder, tiny_gemma4, write_gemma4_gguf

V = 384


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(hf model, {matrix type: gguf path}), with the dspark cache (where GGUF configs go) private to the module."""
    root = tmp_path_factory.mktemp("gemma4_gguf")
    model = tiny_gemma4(seed=4, vocab_size=V, vocab_size_per_layer_input=V)
    tok = gemma_tokenizer_folder(root / "tok", V)
    paths = {}
    for kind in ("F32", "Q8_0"):
        paths[kind] = root / f"tiny-{kind}.gguf"
        write_gemma4_gguf(model, tok, paths[kind], matrices=kind)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DSPARK_CACHE", str(root / "cache"))
        yield model, paths


def test_config_is_rebuilt_from_the_files_metadata(files):
    model, paths = files
    raw = gemma4_config(gguf.GGUFReader(str(paths["F32"])), "tiny.gguf")
    got, want = TargetConfig.from_dict(raw), TargetConfig.from_dict(model.config.to_dict())
    assert got == want
    assert got.rope_full == want.rope_full and got.rope == want.rope  # (not part of ==)
    assert (got.layer_types, got.layer_kv_heads, got.k_eq_v) == (tuple(model.config.layer_types), (2, 1, 2, 1), True)
    assert raw["rope_parameters"]["full_attention"]["partial_rotary_factor"] == 0.25
    assert (raw["final_logit_softcapping"], raw["sliding_window"], raw["tie_word_embeddings"]) == (30.0, 5, True)


def test_f32_file_gives_the_models_logits_exactly(files):
    model, paths = files
    ids = torch.tensor([[2, 50, 60, 70, 80, 90, 100, 110, 120, 130, 140, 150]])  # past the 5-position window
    loaded = load_target(str(paths["F32"]))
    assert loaded.config.family == "gemma4"
    with torch.no_grad():
        assert torch.equal(loaded.hf_model(ids).logits, model(ids).logits)
        scalars = [m.layer_scalar for m in loaded.hf_model.model.layers]
        assert torch.equal(torch.cat(scalars), torch.cat([m.layer_scalar for m in model.model.layers]))


def test_q8_0_weights_are_the_readers_dequantized_values(files):
    model, paths = files
    loaded = load_target(str(paths["Q8_0"]))
    reader = {t.name: t for t in gguf.GGUFReader(str(paths["Q8_0"])).tensors}
    got = dict(loaded.hf_model.named_parameters())
    pairs = {"model.embed_tokens.weight": "token_embd.weight", "model.layers.1.self_attn.k_proj.weight":
             "blk.1.attn_k.weight", "model.layers.2.mlp.down_proj.weight": "blk.2.ffn_down.weight"}
    for hf_name, gguf_name in pairs.items():
        t = reader[gguf_name]
        want = gguf.quants.dequantize(t.data, t.tensor_type).reshape(got[hf_name].shape)
        assert t.tensor_type == gguf.GGMLQuantizationType.Q8_0
        assert np.array_equal(got[hf_name].detach().numpy(), want)
        assert not torch.equal(got[hf_name], dict(model.named_parameters())[hf_name])  # rounded, so this can fail


def test_bundle_from_the_file_checks_and_decodes_as_the_model(files, tmp_path):
    from dspark.export.trace.onnx_export import export_bundle
    from dspark.models.pair import load_pair

    model, paths = files
    pair = load_pair(str(paths["F32"]), "random", lazy=True)
    bundle = export_bundle(pair, tmp_path / "bundle", max_context=128, quiet=True)
    man = Manifest.read_checked(bundle)
    assert [g["kind"] for g in man.target["kv_groups"]] == ["sliding_attention", "full_attention"]
    report = check_bundle(bundle)
    assert report.passed, format_report(report)
    rt = Runtime(bundle)
    prompts = [[2, 50, 60, 70], [2, 80, 90, 100, 110, 120, 130]]
    want = [r.token_ids for r in generate_ar(wrap_target(model).eval(), prompts, 12, 0.0, 0,
                                             tuple(rt.manifest.stop_token_ids))]
    for policy in ("ar", "all"):
        got = rt.generate(prompts, DecodeOptions(max_tokens=12, policy=policy, batch_size=2))
        assert [r.token_ids for r in got] == want


@pytest.mark.parametrize("drop, says", [
    ("attention.sliding_window_pattern", r"bad.gguf: gemma4.attention.sliding_window_pattern must list 4 booleans"),
    ("attention.key_length_swa", r"bad.gguf: gemma4.attention.key_length_swa is missing"),
])
def test_a_file_missing_what_gemma4_needs_is_refused_in_one_line(files, tmp_path, drop, says):
    model, _ = files
    path = tmp_path / "bad.gguf"
    write_gemma4_gguf(model, gemma_tokenizer_folder(tmp_path / "tok", V), path, **{drop: True})
    with pytest.raises(DSparkError, match=says) as err:
        load_target(str(path), lazy=True)
    assert "\n" not in str(err.value)
