"""ONNX Runtime's greedy heads (heads_greedy.onnx): the heads of all-greedy rounds without the sampling machinery.
They give the heads' tokens, survival and verification lengths, decoding with them gives the same tokens, rounds
with a sampled request keep the full heads, and a manifest that names something else is refused."""
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from dspark.bundle import Manifest, sha256_file
from dspark.cli import export_cli
from dspark.errors import DSparkError
from dspark.export.check.parity import check_bundle
from dspark.export.quantize.weight_stream import load_skeleton
from dspark.export.twins.greedy_heads import GREEDY_FILE, greedy_heads
from dspark.export.trace.onnx_export import export_bundle
from dspark.export.twins.ort_graphs import TWINS, fuse_bundle
from dspark.export.quantize.bundle import quantize_graph
from dspark.files import linked_copy
from dspark.models.pair import Pair
from dspark.runtime import DecodeOptions, Runtime
from dspark.runtime.ort_backend import OrtBackend
from support.tiny import TinyLoaded, tiny_bundle, tiny_pair, tiny_tokenizer_folder, twin_naming_its_source

PROMPTS = [[3, 5, 7, 9, 2], [11, 4, 6], [8, 1, 13, 2, 2, 5, 19]]


@pytest.fixture(scope="module", params=["llama-vanilla", "qwen3-rnn", "llama-draft-vocab", "llama-no-confidence"])
def bundle(request, tmp_path_factory):
    """Tiny pairs with each kind of heads: vanilla / rnn Markov head, a draft vocabulary (tokens mapped back to the
    full vocabulary), no confidence head."""
    root = tmp_path_factory.mktemp(request.param)
    family = request.param.split("-")[0]
    kw = dict(vocab=40, layers=2, block_size=4, seed=7)
    if request.param == "qwen3-rnn":
        kw["markov_head_type"] = "rnn"
    if request.param == "llama-no-confidence":
        kw["confidence"] = False
    if request.param != "llama-draft-vocab":
        return tiny_bundle(root / "bundle", family=family, **kw)[-1]
    hf, target, drafter = tiny_pair(family, **kw)
    tok = tiny_tokenizer_folder(root / "tok", kw["vocab"])
    pair = Pair(loaded=TinyLoaded(hf, tok), target=target, drafter=drafter, draft_source="random")
    return export_bundle(pair, root / "bundle", max_context=256, force=True, quiet=True, draft_vocab=16,
                         ranking=list(range(kw["vocab"]))[::-1])


def _runtime(folder: Path, greedy_heads: bool = True) -> Runtime:
    rt = Runtime(folder)
    if not greedy_heads:
        rt.backend.heads_greedy = None
    return rt


def _calls(rt: Runtime) -> Counter:
    counts = Counter()
    for name in ("heads", "heads_greedy"):
        graph = getattr(rt.backend, name)
        run = graph.run

        def counted(feeds, _run=run, _name=name):
            counts[_name] += 1
            return _run(feeds)

        graph.run = counted
    return counts


def test_export_adds_greedy_heads_without_sampling_ops_or_copied_weights(bundle):
    man = Manifest.read(bundle)
    spec, heads = man.graphs["heads_greedy"], man.graphs["heads"]
    assert spec.file == GREEDY_FILE and spec.sha256 == sha256_file(bundle / GREEDY_FILE)
    assert [t.name for t in spec.inputs] == [t.name for t in heads.inputs
                                             if t.name not in ("temperature", "draft_noise")]
    assert [t.name for t in spec.outputs] == [t.name for t in heads.outputs if t.name != "draft_probs"]
    model = onnx.load(str(bundle / GREEDY_FILE), load_external_data=False)
    full = onnx.load(str(bundle / heads.file), load_external_data=False)
    ops, full_ops = (Counter(n.op_type for n in m.graph.node) for m in (model, full))
    assert not ops["Softmax"] and not ops["ScatterElements"]
    assert ops["CumSum"] == full_ops["CumSum"] - man.block_size  # the survival's stays, the samplers' CDFs go
    assert ops["ArgMax"] == man.block_size and len(model.graph.node) < len(full.graph.node)
    stored = {t.name for t in full.graph.initializer if t.external_data}
    assert {t.name for t in model.graph.initializer if t.external_data} <= stored  # no weight is copied


def test_greedy_heads_give_the_heads_outputs_on_greedy_rounds(bundle):
    """Same draft tokens, survival, conf logits and verification lengths, bit for bit, on random hidden states
    (every scheduling mode)."""
    rt = _runtime(bundle)
    man = rt.manifest
    rng = np.random.default_rng(0)
    b, bk = 3, man.block_size
    for mode in (0, 1, 2):
        feeds = {"hidden": rng.standard_normal((b, bk, man.graphs["heads"].inputs[0].shape[-1])).astype(np.float32),
                 "anchor": rng.integers(0, man.target["vocab_size"], b), "temperature": np.zeros(b, np.float32),
                 "draft_noise": rng.uniform(0.01, 1.0, (b, bk)).astype(np.float32),
                 "conf_temperatures": np.asarray(man.sts_temperatures, np.float32),
                 "threshold": np.full(b, 0.3, np.float32), "sps": np.array([50.0, 45, 40, 30, 20, 10], np.float32),
                 "budget": np.array([3]), "active": np.array([True, False, True]), "mode": np.array([mode]),
                 "layout": np.array([1])}
        full = {k: v.numpy() for k, v in rt.backend.heads.run(feeds).items()}
        greedy = {k: v.numpy() for k, v in rt.backend.heads_greedy.run(
            {k: v for k, v in feeds.items() if k not in ("temperature", "draft_noise")}).items()}
        assert set(greedy) == set(full) - {"draft_probs"}
        for k, v in greedy.items():
            np.testing.assert_array_equal(v, full[k], err_msg=k)
        # the one-hot distributions the verifier would have got: exactly the drafted tokens
        tokens = full["draft_tokens"]
        assert np.all(full["draft_probs"].argmax(-1) == tokens) and np.all(full["draft_probs"].sum(-1) == 1)


@pytest.mark.parametrize("policy", ["all", "schedule"])
def test_greedy_decoding_with_greedy_heads_gives_the_same_tokens_and_rounds(bundle, policy):
    man = Manifest.read(bundle)
    if policy == "schedule":
        man.calibration["sps_table"] = [60.0, 58, 50, 45, 40, 30, 25, 20, 18, 16, 14, 12]
    options = DecodeOptions(max_tokens=20, policy=policy, batch_size=2)
    rt = _runtime(bundle)
    rt.manifest = man
    calls = _calls(rt)
    fast = rt.generate(PROMPTS, options)
    slow_rt = _runtime(bundle, greedy_heads=False)
    slow_rt.manifest = man
    slow = slow_rt.generate(PROMPTS, options)
    assert calls["heads_greedy"] > 0 and calls["heads"] == 0
    for a, b in zip(fast, slow):
        assert a.token_ids == b.token_ids and a.accepted == b.accepted and a.proposed == b.proposed
    ar = Runtime(bundle).generate(PROMPTS, DecodeOptions(max_tokens=20, policy="ar"))
    assert [r.token_ids for r in fast] == [r.token_ids for r in ar]


def test_a_round_with_a_sampled_request_keeps_the_full_heads(bundle):
    """Sampling needs the draft distributions: the greedy twin is not used, and the tokens are those of a runtime
    without it."""
    options = DecodeOptions(max_tokens=16, policy="all", temperature=0.9, seed=4)
    rt = _runtime(bundle)
    calls = _calls(rt)
    got = rt.generate(PROMPTS, options)
    want = _runtime(bundle, greedy_heads=False).generate(PROMPTS, options)
    assert calls["heads"] > 0 and calls["heads_greedy"] == 0
    assert [r.token_ids for r in got] == [r.token_ids for r in want]


def test_check_compares_the_greedy_heads_too(bundle):
    rep = check_bundle(bundle)
    rows = [r for r in rep.rows if r.graph == "heads_greedy"]
    assert rows and all(r.passed for r in rows) and "draft_probs" not in {r.output for r in rows}
    assert rep.passed


def test_quantizing_the_heads_rebuilds_their_greedy_twin(bundle, tmp_path):
    q = tmp_path / "q"
    linked_copy(bundle, q)
    before = Manifest.read(q).graphs["heads_greedy"].sha256
    quantize_graph(q, "heads", min_elements=0)
    man = Manifest.read(q)
    assert man.graphs["heads_greedy"].sha256 == sha256_file(q / GREEDY_FILE) != before
    model = onnx.load(str(q / GREEDY_FILE), load_external_data=False)
    assert any(n.op_type == "MatMulNBits" for n in model.graph.node)
    options = DecodeOptions(max_tokens=16, policy="all")
    rt = _runtime(q)
    calls = _calls(rt)
    assert ([r.token_ids for r in rt.generate(PROMPTS, options)]
            == [r.token_ids for r in _runtime(q, greedy_heads=False).generate(PROMPTS, options)])
    assert calls["heads_greedy"] > 0
    assert Manifest.read(bundle).graphs["heads_greedy"].sha256 == before  # the source bundle is untouched


def test_fuse_adds_greedy_heads_to_an_older_bundle(tmp_path):
    *_, bundle = tiny_bundle(tmp_path / "b", family="llama", vocab=24, layers=2, block_size=3, seed=2)
    man = Manifest.read(bundle)
    del man.graphs["heads_greedy"]  # as bundles were before greedy heads
    man.write(bundle)
    (bundle / GREEDY_FILE).unlink()
    res = CliRunner().invoke(export_cli, ["fuse", str(bundle)])
    assert res.exit_code == 0, res.output
    assert f"wrote {GREEDY_FILE}" in res.output and "multiple of 16" in res.output  # head_dim 8: no fused verifier
    assert "heads_greedy" in Manifest.read(bundle).graphs and "verifier_fused" not in Manifest.read(bundle).graphs
    res = CliRunner().invoke(export_cli, ["fuse", str(bundle)])
    assert res.exit_code == 0 and "already has" in res.output
    assert Runtime(bundle).backend.heads_greedy is not None


def test_a_heads_graph_without_its_samplers_is_refused_and_export_goes_on(bundle, tmp_path, monkeypatch):
    model = load_skeleton(bundle / "heads.onnx")
    with pytest.raises(DSparkError, match="found 4 samplers .* expected one per draft position \\(5\\)"):
        greedy_heads(model, 5)

    def refuse(folder, manifest):
        raise DSparkError("cannot rewrite this one")

    monkeypatch.setitem(TWINS, "heads_greedy", (*TWINS["heads_greedy"][:2], refuse))
    with pytest.warns(UserWarning, match="no greedy heads graph in this bundle: cannot rewrite this one"):
        *_, plain = tiny_bundle(tmp_path / "b", family="llama", vocab=12, layers=2, block_size=3, seed=2)
    assert "heads_greedy" not in Manifest.read(plain).graphs and not (plain / GREEDY_FILE).exists()
    assert Runtime(plain).generate([[1, 2, 3]], DecodeOptions(max_tokens=4))[0].token_ids


def test_a_greedy_heads_entry_that_is_not_this_bundles_is_refused(bundle, tmp_path):
    """A manifest whose heads_greedy names the full heads graph: one line, not a run that binds inputs it lacks."""
    bad = twin_naming_its_source(bundle, tmp_path / "bad", "heads_greedy", "heads")
    with pytest.raises(DSparkError, match="is not the greedy heads graph of this bundle"):
        OrtBackend(bad, Manifest.read(bad))
    with pytest.raises(DSparkError):
        fuse_bundle(tmp_path / "nothing")
