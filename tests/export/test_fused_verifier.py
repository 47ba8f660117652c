"""ONNX Runtime's fused verifier (dspark-export fuse): GroupQueryAttention writing the cache in place,
SkipSimplifiedLayerNormalization, the same weights as the portable verifier. Decoding with it gives the portable
verifier's tokens, greedy DSpark equals its own AR, and steps it cannot take fall back to the portable graph."""
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from dspark.bundle import Manifest, sha256_file
from dspark.cli import export_cli
from dspark.errors import DSparkError
from dspark.export.twins.fused_bundle import FUSED_FILE, add_fused_verifier
from dspark.export.twins.ort_fused import LANES
from dspark.export.twins.ort_graphs import TWINS, fuse_bundle
from dspark.export.quantize.bundle import QuantizeOptions, quantize_bundle
from dspark.files import linked_copy
from dspark.runtime import DecodeOptions, Runtime
from dspark.runtime.decoder import Decoder
from dspark.runtime.fused_verifier import FusedVerifier, lane_count
from dspark.runtime.ort_backend import OrtBackend
from support.tiny import restamp, tiny_bundle, twin_naming_its_source
from test_bundle_tiny import prompts


def _runtime(bundle: Path, verifier: str) -> Runtime:
    return Runtime(bundle, backend=OrtBackend(bundle, Manifest.read(bundle), verifier=verifier))


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def fused(request, tmp_path_factory):
    """A tiny pair of each family (Qwen3: per-head q/k norms) with a fused verifier (head_dim 16: the least
    GroupQueryAttention takes)."""
    root = tmp_path_factory.mktemp(f"fused-{request.param}")
    *_, bundle = tiny_bundle(root / "bundle", family=request.param, vocab=24, layers=3, block_size=4, seed=5,
                             hidden=64)
    fuse_bundle(bundle)
    return bundle


def test_fuse_adds_a_graph_of_fused_operators_sharing_the_weights(fused, laned):
    """(fp32 activations: one lane by default; the lanes are checked on a copy built with them)"""
    assert [t.name for t in Manifest.read(fused).graphs["verifier_fused"].inputs] == \
        [t.name for t in Manifest.read(fused).graphs["verifier"].inputs]
    man = Manifest.read(laned)
    spec = man.graphs["verifier_fused"]
    assert spec.file == FUSED_FILE and spec.sha256 == sha256_file(laned / FUSED_FILE)
    layers = man.target["num_layers"]
    takes = [t.name for t in man.graphs["verifier"].inputs]
    lanes = [f"lane{r}.past.{i}.{kind}" for r in range(1, LANES) for i in range(layers) for kind in ("key", "value")]
    assert [t.name for t in spec.inputs] == takes + lanes
    assert [t.name for t in spec.outputs][:3] == ["accepted", "next_token", "taps"]
    assert sum(t.name.startswith("present.") for t in spec.outputs) == 2 * layers
    assert [t.name for t in spec.outputs][-len(lanes):] == [n.replace("past", "present") for n in lanes]
    model = onnx.load(str(laned / FUSED_FILE), load_external_data=False)
    ops = Counter(n.op_type for n in model.graph.node)
    assert ops["GroupQueryAttention"] == layers and ops["SkipSimplifiedLayerNormalization"] == 2 * layers
    # lanes 1.. of a layer: nested Ifs, each running one more lane's attention; one If for the acceptance
    assert ops["If"] == layers + 1
    everywhere = Counter(n.op_type for n in _all_nodes(model.graph))
    assert everywhere["If"] == layers * (LANES - 1) + 1 and everywhere["GroupQueryAttention"] == layers * LANES
    portable = onnx.load(str(fused / "verifier.onnx"), load_external_data=False)
    single = onnx.load(str(fused / FUSED_FILE), load_external_data=False)
    assert len(single.graph.node) < 0.55 * len(portable.graph.node)  # (both end in the same ~60-node acceptance)
    per_layer = (len(model.graph.node) - len(single.graph.node) - 16 * LANES) / layers  # (16 a lane's lengths)
    assert per_layer <= 1 + 8  # one If (lanes 1.. nested in it), and lane 0's row slices and padding
    stored = {t.name for t in portable.graph.initializer if t.external_data}
    assert {t.name for t in model.graph.initializer if t.external_data} <= stored  # no weight is copied
    assert (fused / FUSED_FILE).stat().st_size < 200_000


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_fused_verifier_decodes_the_portable_verifiers_tokens(fused, temperature):
    ps = prompts(6, seed=3)
    options = DecodeOptions(max_tokens=16, batch_size=1, temperature=temperature, seed=7)
    rt = _runtime(fused, "fused")
    assert isinstance(rt.backend.verifier, FusedVerifier)
    ds = [r.token_ids for r in rt.generate(ps, options)]
    assert ds == [r.token_ids for r in _runtime(fused, "portable").generate(ps, options)]
    if temperature == 0.0:
        assert ds == [r.token_ids for r in rt.generate(ps, options.replace(policy="ar"))]
    steps = rt.backend.verifier.steps
    assert steps["prefill"] > 0 and steps["fused"] > 0 and steps["portable"] == 0  # batch 1: every step fused
    assert rt.backend.verifier._portable is None  # never loaded: no second copy of the weights


def _all_nodes(graph):
    for node in graph.node:
        yield node
        for a in node.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield from _all_nodes(a.g)


def _with_lanes(fused: Path, folder: Path, lanes: int) -> Path:
    linked_copy(fused, folder)
    man = Manifest.read(folder)
    add_fused_verifier(folder, man, "gqa", lanes)
    man.write(folder)
    return folder


@pytest.fixture(scope="module")
def laned(fused, tmp_path_factory):
    """The bundle with its fused graph built with lanes (the default for int8 activations only)."""
    return _with_lanes(fused, tmp_path_factory.mktemp("laned") / "bundle", LANES)


@pytest.mark.parametrize("lanes", [LANES, 2])
def test_several_requests_take_fused_steps_in_lanes(fused, lanes, tmp_path):
    """Every step of several requests, drafted rounds included, runs on the fused graph (in groups of `lanes`
    when the batch has more requests), with the tokens of the portable verifier and of AR."""
    folder = _with_lanes(fused, tmp_path / "bundle", lanes)
    ps = prompts(5, seed=4)
    options = DecodeOptions(max_tokens=16, batch_size=3)
    rt = _runtime(folder, "auto")
    assert rt.backend.verifier.lanes == lanes
    batched = [r.token_ids for r in rt.generate(ps, options)]
    steps = dict(rt.backend.verifier.steps)
    assert steps["portable"] == 0 and steps["fused"] > 0
    assert rt.backend.verifier._portable is None
    assert batched == [r.token_ids for r in rt.generate(ps, options.replace(policy="ar"))]
    assert batched == [r.token_ids for r in _runtime(fused, "portable").generate(ps, options)]


def test_several_requests_fall_back_to_the_portable_graph_for_multi_position_steps(fused):
    """A fused graph without lanes (fp32 activations): drafted rounds of several requests run on the portable
    graph."""
    ps = prompts(5, seed=4)
    options = DecodeOptions(max_tokens=16, batch_size=3)
    rt = _runtime(fused, "auto")
    assert rt.backend.verifier.lanes == 1
    batched = [r.token_ids for r in rt.generate(ps, options)]
    steps = dict(rt.backend.verifier.steps)
    assert steps["portable"] > 0 and steps["fused"] == 0  # drafted rounds of 3 requests: portable
    assert batched == [r.token_ids for r in rt.generate(ps, options.replace(policy="ar"))]
    assert rt.backend.verifier.steps["fused"] > 0 and rt.backend.verifier.steps["portable"] == steps["portable"]
    assert batched == [r.token_ids for r in _runtime(fused, "portable").generate(ps, options)]


def test_a_fused_step_writes_the_new_entries_into_the_cache(fused):
    """The same step through both graphs: the fused one leaves in the cache what the portable one returns."""
    rt = _runtime(fused, "fused")
    dec = rt.decoder([prompts(1, seed=8)[0]], DecodeOptions(max_tokens=4))
    next(iter(dec))  # prefill
    kv = dec.kv
    length = int(kv.lengths[0])
    before = kv.buffer.copy()
    tokens = np.array([[3, 5, 7]], dtype=np.int64)
    feeds = {"tokens": tokens, "past_mask": kv.past_mask(), "logit_index": np.arange(3)[None],
             "verify_len": np.array([2]), "temperature": np.zeros(1, np.float32),
             "accept_noise": np.full((1, 3), 0.5, np.float32), "sample_noise": np.full(1, 0.5, np.float32),
             "draft_probs": np.zeros((1, 2, rt.manifest.target["vocab_size"]), np.float32), **kv.feeds}
    portable = rt.backend.verifier.portable.run(feeds)
    fused_out = rt.backend.verifier.run(feeds)
    new = portable["new_kv"].numpy()[:, :, 0]
    assert np.allclose(kv.buffer[:, :, 0, :, length:length + 3], new, atol=1e-4)
    assert np.array_equal(kv.buffer[:, :, 0, :, :length], before[:, :, 0, :, :length])  # the past is untouched
    assert int(kv.lengths[0]) == length  # written, not committed
    assert fused_out["next_token"].numpy().tolist() == portable["next_token"].numpy().tolist()


def test_quantizing_the_verifier_rebuilds_its_fused_twin(fused, tmp_path):
    q = tmp_path / "q"
    linked_copy(fused, q)
    old = sha256_file(q / FUSED_FILE)
    quantize_bundle(q, ["verifier"], QuantizeOptions(bits=8, min_elements=0, agreement_prompts=0))
    man = Manifest.read(q)
    assert man.graphs["verifier_fused"].sha256 == sha256_file(q / FUSED_FILE) != old
    ops = Counter(n.op_type for n in onnx.load(str(q / FUSED_FILE), load_external_data=False).graph.node)
    layers = man.target["num_layers"]
    # q/k/v and gate/up each one MatMulNBits over concatenated blocks (stored beside the graph), o and down, head;
    # int8 activations: row attention, whose MatMuls are its scores and weighted values
    assert ops["MatMulNBits"] == 4 * layers + 1 and ops["MatMul"] == 2 * layers
    assert ops["Split"] == 2 * layers  # gate/up, q/k/v (llama: split by the attention; qwen3: for its q/k norms)
    assert (q / f"{FUSED_FILE}.data").stat().st_size > 0
    assert sha256_file(fused / FUSED_FILE) == old  # the source bundle is untouched
    ps = prompts(4, seed=6)
    options = DecodeOptions(max_tokens=16, batch_size=1)
    rt = _runtime(q, "fused")
    assert [r.token_ids for r in rt.generate(ps, options)] == \
        [r.token_ids for r in rt.generate(ps, options.replace(policy="ar"))]


def test_fuse_refuses_a_verifier_it_cannot_map(fused, tmp_path):
    """A verifier whose projections are not named by module (as dspark < 0.2 quantized them): one line."""
    bad = tmp_path / "bad"
    linked_copy(fused, bad)
    model = onnx.load(str(bad / "verifier.onnx"), load_external_data=False)
    for init in model.graph.initializer:
        init.name = init.name.replace("q_proj", "qq")
    for node in model.graph.node:
        node.input[:] = [i.replace("q_proj", "qq") for i in node.input]
    (bad / "verifier.onnx").unlink()
    onnx.save(model, str(bad / "verifier.onnx"))
    restamp(bad)  # consistent with its manifest: what fuse must refuse is the naming, not damage
    with pytest.raises(DSparkError, match="not named by module"):
        fuse_bundle(bad, ["verifier_fused"])
    res = CliRunner().invoke(export_cli, ["fuse", "--rebuild", str(bad)])
    assert res.exit_code != 0 and "not named by module" in res.output and "Traceback" not in res.output
    assert "verifier_fused" in Manifest.read(bad).graphs  # unchanged: the old fused graph is still there


def test_a_bundle_without_a_fused_verifier_refuses_verifier_fused(tmp_path):
    *_, bundle = tiny_bundle(tmp_path / "plain", family="llama", vocab=12, layers=2, block_size=3, seed=2)
    with pytest.raises(DSparkError, match="multiple of 16"):
        fuse_bundle(bundle, ["verifier_fused"])  # head_dim 8
    assert "multiple of 16" in fuse_bundle(bundle)["verifier_fused"]  # the greedy heads need no head_dim
    with pytest.raises(DSparkError, match="dspark-export fuse"):
        OrtBackend(bundle, Manifest.read(bundle), verifier="fused")
    with pytest.raises(DSparkError, match="unknown verifier"):
        OrtBackend(bundle, Manifest.read(bundle), verifier="fast")
    res = CliRunner().invoke(export_cli, ["quantize", str(bundle), "--graphs", "verifier", "--min-elements", "0",
                                          "--agreement-prompts", "0"])  # 8-bit: int8 activations
    assert res.exit_code == 0, res.output
    assert "has no fused verifier (ONNX Runtime's GroupQueryAttention on CPU needs a head_dim" in res.output
    assert Manifest.read(bundle).quantized_activations("verifier")
    res = CliRunner().invoke(export_cli, ["quantize", str(bundle), "--graphs", "draft", "--min-elements", "0"])
    assert res.exit_code == 0 and "fused" not in res.output, res.output  # said once, by the verifier's quantize


def test_gguf_blocks_fuse_with_their_minimum_terms(fused, tmp_path, monkeypatch):
    """A GGUF target's Q4_1/Q4_0 blocks: the fused graph concatenates q/k/v and gate/up blocks and their Q4_1
    minimum terms, and computes what the portable quantized graph computes."""
    import test_quantize_verifier as gguf_tests

    if Manifest.read(fused).target["family"] != "llama":
        pytest.skip("the GGUF writer of these tests names llama tensors")
    q = tmp_path / "gguf"
    shutil.copytree(fused, q)  # a real copy: make_gguf_target reads the weights with onnx, which refuses links
    monkeypatch.setattr(gguf_tests, "V", Manifest.read(fused).target["vocab_size"])
    gguf_tests.make_gguf_target(q, tmp_path / "tiny.gguf")
    records = quantize_bundle(q, ["verifier"], QuantizeOptions(bits=4, min_elements=0, agreement_prompts=0))
    assert records["verifier"]["gguf_blocks"]["formats"]["Q4_1"] > 0
    layers = Manifest.read(q).target["num_layers"]
    # a verifier with a fused twin rounds its layers' activations to int8 by default (fast, exact on the twin)
    assert records["verifier"]["matmulnbits"] == {"4-bit, accuracy_level 4": 7 * layers, "8-bit, accuracy_level 4": 1}
    assert Manifest.read(q).quantized_activations("verifier")
    model = onnx.load(str(q / FUSED_FILE), load_external_data=False)
    ops = Counter(n.op_type for n in model.graph.node)
    assert ops["MatMulNBits"] == 4 * layers + 1 and ops["ReduceSum"] >= 3 * layers  # minimum terms' block sums
    ps = prompts(4, seed=12)
    options = DecodeOptions(max_tokens=16, batch_size=1)
    fused_rt, portable_rt = _runtime(q, "fused"), _runtime(q, "portable")
    got = [r.token_ids for r in fused_rt.generate(ps, options)]
    assert got == [r.token_ids for r in fused_rt.generate(ps, options.replace(policy="ar"))]
    assert got == [r.token_ids for r in portable_rt.generate(ps, options)]
    assert fused_rt.backend.verifier.steps["fused"] > 0


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_low_precision_bundle_gets_a_fused_verifier(tmp_path, precision):
    """Weights stored at bf16/fp16 (Casts in the portable graph, the embedding's rows widened after the lookup):
    the fused verifier takes them, packed or mapped, and decodes the portable verifier's tokens."""
    from dspark.export.trace.onnx_export import export_bundle
    from dspark.models.pair import Pair
    from support.tiny import TinyLoaded, tiny_pair, tiny_tokenizer_folder

    hf, target, drafter = tiny_pair("qwen3", vocab=24, layers=2, seed=3, block_size=4, hidden=64)
    out = tmp_path / "bundle"
    pair = Pair(loaded=TinyLoaded(hf, tiny_tokenizer_folder(tmp_path / "tok", 24)), target=target, drafter=drafter,
                draft_source="random")
    export_bundle(pair, out, max_context=256, force=True, quiet=True, precision=precision)
    man = Manifest.read(out)
    assert man.precision == precision and "verifier_fused" in man.graphs
    ps, options = prompts(3, seed=2), DecodeOptions(max_tokens=12, batch_size=1)
    for weights in ("packed", "mapped"):
        fused_rt = Runtime(out, backend=OrtBackend(out, man, weights=weights, verifier="fused"))
        portable_rt = Runtime(out, backend=OrtBackend(out, man, weights=weights, verifier="portable"))
        got = [r.token_ids for r in fused_rt.generate(ps, options)]
        assert got == [r.token_ids for r in portable_rt.generate(ps, options)]
        assert got == [r.token_ids for r in fused_rt.generate(ps, options.replace(policy="ar"))]


def test_export_keeps_a_valid_bundle_when_fusing_fails(tmp_path, monkeypatch):
    """The portable verifier serves every backend: a fused graph that cannot be built is skipped with a warning."""

    def refuse(folder, manifest):
        manifest.graphs["verifier_fused"] = manifest.graphs["verifier"]  # half-entered, as a failure could leave it
        raise DSparkError("cannot fuse this one")

    monkeypatch.setitem(TWINS, "verifier_fused", (*TWINS["verifier_fused"][:2], refuse))
    with pytest.warns(UserWarning, match="no fused verifier in this bundle: cannot fuse this one"):
        *_, bundle = tiny_bundle(tmp_path / "b", family="llama", vocab=12, layers=2, block_size=3, seed=2,
                                 hidden=64)
    man = Manifest.read(bundle)
    assert "verifier_fused" not in man.graphs and not (bundle / FUSED_FILE).exists()
    assert Runtime(bundle).generate([[1, 2, 3]], DecodeOptions(max_tokens=4))[0].token_ids


def test_a_fused_graph_that_is_not_this_bundles_is_refused(fused, tmp_path):
    """A manifest whose verifier_fused names the portable verifier (no present.* outputs): one line, not a
    decode that silently never writes its cache."""
    bad = twin_naming_its_source(fused, tmp_path / "bad", "verifier_fused", "verifier")
    with pytest.raises(DSparkError, match=r"graphs.verifier_fused has 0 present.\* cache outputs"):
        Manifest.read(bad)  # the manifest's sizes are checked against each graph it names, at read


@pytest.mark.parametrize("slots", [1, 3])
@pytest.mark.parametrize("lanes", [1, LANES])
def test_a_serving_engine_loads_the_portable_verifier_before_it_is_ready(fused, laned, slots, lanes):
    """A fused graph without lanes runs multi-position steps of several requests on the portable graph,
    loaded on first use (0.8 s for SmolLM2 fp32): an engine with several slots loads it while warming up, so no
    request waits for it; a one-slot engine never needs it, nor does any engine on a graph with lanes."""
    from dspark.runtime.engine import Engine, EngineOptions

    rt = _runtime(fused if lanes == 1 else laned, "auto")
    engine = Engine(rt, EngineOptions(batch_size=slots, policy="all")).start()
    try:
        engine.warm_up([3, 4, 5])
        assert (rt.backend.verifier._portable is not None) == (slots > 1 and lanes == 1)
    finally:
        engine.close()


def _step(rt, kv, tokens: list[int] | list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(taps, the cache after) of one fused verifier step (a request's tokens, or each request's) from the cache as
    it is, which is then restored."""
    before = kv.buffer.copy()
    ids = np.array(tokens if isinstance(tokens[0], list) else [tokens], dtype=np.int64)
    b, n = ids.shape
    feeds = {"tokens": ids, "past_mask": kv.past_mask(), "logit_index": np.tile(np.arange(n), (b, 1)),
             "verify_len": np.full(b, n - 1), "temperature": np.zeros(b, np.float32),
             "accept_noise": np.full((b, n), 0.5, np.float32), "sample_noise": np.full(b, 0.5, np.float32),
             "draft_probs": np.zeros((b, max(n - 1, 1), rt.manifest.target["vocab_size"]), np.float32), **kv.feeds}
    out = rt.backend.verifier.run(feeds)
    after = kv.buffer.copy()
    kv.buffer[...] = before
    return out["taps"].numpy(), after


def test_a_batch_1_step_computes_a_position_as_a_longer_step_does(fused):
    """One position alone and the same position first of two give bit-identical taps and cache entries (the
    attention runs on at least two rows: ort_fused._PadToTwo), so greedy DSpark equals AR on a verifier that
    quantizes activations too."""
    rt = _runtime(fused, "fused")
    dec = rt.decoder([prompts(1, seed=9)[0]], DecodeOptions(max_tokens=4))
    next(iter(dec))
    kv, length = dec.kv, int(dec.kv.lengths[0])
    one_taps, one_cache = _step(rt, kv, [3])
    for second in (5, 11):
        two_taps, two_cache = _step(rt, kv, [3, second])
        assert np.array_equal(one_taps[0, 0], two_taps[0, 0])
        assert np.array_equal(one_cache[:, :, 0, :, :length + 1], two_cache[:, :, 0, :, :length + 1])


def test_a_step_that_fills_the_cache_leaves_out_the_padding_row(fused):
    rt = _runtime(fused, "fused")
    prompt = prompts(1, seed=9)[0]
    dec = Decoder(rt.backend, rt.manifest, [prompt], DecodeOptions(max_tokens=4), capacity=len(prompt) + 1)
    next(iter(dec))
    kv = dec.kv
    assert kv.room(0) == 1
    taps, cache = _step(rt, kv, [3])  # the padding row would go one past the cache: left out, no error
    roomy = Decoder(rt.backend, rt.manifest, [prompt], DecodeOptions(max_tokens=4), capacity=len(prompt) + 8)
    next(iter(roomy))
    roomy_taps, roomy_cache = _step(rt, roomy.kv, [3])
    assert np.allclose(taps, roomy_taps, atol=1e-5)
    assert np.allclose(cache[..., :len(prompt) + 1, :], roomy_cache[..., :len(prompt) + 1, :], atol=1e-5)


@pytest.mark.parametrize("lanes", [LANES, 1])
def test_a_verifier_with_int8_activations_gives_each_request_its_batch_1_tokens(fused, tmp_path, lanes):
    """int8 activations turn a rounding apart into different tokens, and only a batch-1 GroupQueryAttention computes
    every position alike: several requests' steps run each request's attention in its own lane (a fused graph built
    without lanes runs them one request at a time), so each request gets its batch-1 tokens, bit for bit."""
    q = tmp_path / "q"
    linked_copy(fused, q)
    quantize_bundle(q, ["verifier"], QuantizeOptions(bits=8, min_elements=0, agreement_prompts=0))
    q = _with_lanes(q, q.with_name(f"gqa{lanes}"), lanes)  # (by default: row attention, test_row_attention)
    man = Manifest.read(q)
    assert man.quantized_activations("verifier") and not Manifest.read(fused).quantized_activations("verifier")
    ps = [[2]] + prompts(4, seed=4)  # a one-token prompt: prefilled alone on one row (plus its copy), or with others
    options = DecodeOptions(max_tokens=16, batch_size=3)
    rt = _runtime(q, "auto")
    assert rt.backend.verifier.alone and rt.backend.verifier.lanes == lanes
    rt.backend.prepare(3)
    assert rt.backend.verifier._portable is None  # never needed
    batched = [r.token_ids for r in rt.generate(ps, options)]
    assert rt.backend.verifier.steps["portable"] == 0
    assert batched == [r.token_ids for r in rt.generate(ps, options.replace(batch_size=1))]
    assert batched == [r.token_ids for r in rt.generate(ps, options.replace(policy="ar"))]
    dec = rt.decoder(ps[:3], options)
    next(iter(dec))  # the three prefilled
    for tokens in ([[3], [5], [7]], [[3, 4], [5, 6], [7, 8]]):  # each request's rows: its batch-1 step's, bit for bit
        taps, cache = _step(rt, dec.kv, tokens)
        for b in range(3):
            alone = Decoder(rt.backend, rt.manifest, [dec.prompts[b]], options)
            next(iter(alone))
            alone_taps, alone_cache = _step(rt, alone.kv, tokens[b])
            n = int(alone.kv.lengths[0]) + len(tokens[b])
            assert np.array_equal(taps[b], alone_taps[0])
            assert np.array_equal(cache[:, :, b, :, :n], alone_cache[:, :, 0, :, :n])


def test_accuracy_levels_of_a_quantized_verifier_change_without_requantizing(fused, tmp_path):
    """`quantize --accuracy-level` on a quantized verifier: only the graphs' levels change (the weights' data
    files are the same files), the fused twin is rebuilt at the new level (row attention for int8 activations), and
    greedy DSpark still equals AR."""
    q = tmp_path / "q"
    linked_copy(fused, q)
    quantize_bundle(q, ["verifier"], QuantizeOptions(bits=4, min_elements=0, accuracy_level=0, agreement_prompts=0))
    man = Manifest.read(q)
    assert not man.quantized_activations("verifier") and man.quantized["verifier"]["layer_accuracy_levels"] == [0]
    assert lane_count([t.name for t in man.graphs["verifier_fused"].inputs]) == 1  # fp32 activations: no lanes
    data = q / f"{man.graphs['verifier'].file}.data"
    inode = data.stat().st_ino
    res = CliRunner().invoke(export_cli, ["quantize", str(q), "--graphs", "verifier"])
    assert res.exit_code != 0 and "already quantized" in res.output and "--accuracy-level" in res.output
    res = CliRunner().invoke(export_cli, ["quantize", str(q), "--graphs", "verifier", "--accuracy-level", "4"])
    assert res.exit_code == 0, res.output
    assert "4-bit, accuracy_level 4" in res.output
    man = Manifest.read(q)
    assert man.quantized_activations("verifier") and "agreement" not in man.quantized["verifier"]
    assert data.stat().st_ino == inode  # the weights were not rewritten
    assert onnx.load(str(q / FUSED_FILE), load_external_data=False).metadata_props[0].value == "rows"
    for graph in ("verifier", "verifier_fused"):
        path = q / man.graphs[graph].file
        assert man.graphs[graph].sha256 == sha256_file(path)
        levels = {a.i for n in onnx.load(str(path), load_external_data=False).graph.node
                  if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "accuracy_level"}
        assert levels == {4}, graph
    ps = prompts(3, seed=9)
    options = DecodeOptions(max_tokens=12, batch_size=1)
    rt = _runtime(q, "auto")
    assert [r.token_ids for r in rt.generate(ps, options)] == \
        [r.token_ids for r in rt.generate(ps, options.replace(policy="ar"))]


@pytest.mark.parametrize("record, rounds", [
    ({"verifier": {"layer_accuracy_levels": [4]}}, True),
    ({"verifier": {"layer_accuracy_levels": [0, 2]}}, True),
    ({"verifier": {"layer_accuracy_levels": [0, 1]}, "heads": {"layer_accuracy_levels": [4]}}, False),
    ({"verifier": {"matmulnbits": {"4-bit, accuracy_level 4": 3}}}, False),  # recorded before the layers' levels
    ({"verifier": {"layer_accuracy_levels": "4"}}, False),
    ({"verifier": {"layer_accuracy_levels": [True, "4", 4.0]}}, False),
    ({"verifier": [4]}, False),
    ({}, False),
])
def test_quantized_activations_reads_the_quantization_record(fused, record, rounds):
    man = Manifest.read(fused)
    man.quantized = record
    assert man.quantized_activations("verifier") is rounds


@pytest.mark.parametrize("length", [1, 5])
def test_a_prefill_returns_the_prompts_entries_only(fused, length):
    """A batch-1 prefill pads its attention too; the new K/V it returns are the prompt's (as the portable
    verifier's), not the padding row's."""
    rt = _runtime(fused, "fused")
    dec = rt.decoder([prompts(1, seed=9)[0]], DecodeOptions(max_tokens=4))
    past, mask = dec.kv.prefill_feeds(1)
    feeds = {"tokens": np.arange(2, 2 + length, dtype=np.int64)[None], "past_mask": mask,
             "logit_index": np.array([[length - 1]]), "verify_len": np.zeros(1, np.int64),
             "temperature": np.zeros(1, np.float32), "accept_noise": np.full((1, 1), 0.5, np.float32),
             "sample_noise": np.full(1, 0.5, np.float32),
             "draft_probs": np.zeros((1, 1, rt.manifest.target["vocab_size"]), np.float32), **past}
    fused_kv = rt.backend.verifier.run(feeds)["new_kv"].numpy()
    portable_kv = rt.backend.verifier.portable.run(feeds)["new_kv"].numpy()
    assert fused_kv.shape == portable_kv.shape and fused_kv.shape[-2] == length
    assert np.allclose(fused_kv, portable_kv, atol=1e-4)


def test_a_greedy_step_decides_as_the_sampled_acceptance_does(fused):
    """Every request greedy: the fused graph's argmax branch (dspark.export.twins.greedy_accept). Each request's
    drafts are its greedy continuation up to a wrong token at a row of its own; the branch must accept the
    matching prefix within verify_len and correct with the argmax after it, as the copied acceptance decides the
    same rows in a step with one sampled request beside them."""
    rt = _runtime(fused, "fused")
    verifier, vocab = rt.backend.verifier, rt.manifest.target["vocab_size"]
    dec = rt.decoder([prompts(1, seed=9)[0]], DecodeOptions(max_tokens=4))

    def step(tokens, verify_len, temperature):
        b, s = tokens.shape
        past, mask = dec.kv.prefill_feeds(b)
        feeds = {"tokens": tokens, "past_mask": mask, "logit_index": np.tile(np.arange(s), (b, 1)),
                 "verify_len": verify_len, "temperature": temperature,
                 "accept_noise": np.full((b, s), 0.5, np.float32), "sample_noise": np.full(b, 0.5, np.float32),
                 "draft_probs": np.zeros((b, 1, vocab), np.float32), **past}
        out = verifier.run(feeds, ["logits"])
        return out["accepted"].numpy(), out["next_token"].numpy(), out["logits"].numpy()

    rows = 6
    tokens = np.random.default_rng(4).integers(0, vocab, (3, rows)).astype(np.int64)
    greedy = np.zeros(3, np.float32)
    for j in range(rows - 1):  # the greedy continuation: every draft matches
        tokens[:, j + 1] = step(tokens, np.zeros(3, np.int64), greedy)[2][:, j].argmax(-1)
    wrong_at = np.array([0, 2, rows - 1])  # row j judges tokens[j + 1]; the last request: none wrong
    for b, j in enumerate(wrong_at[:2]):
        tokens[b, j + 1] = (tokens[b, j + 1] + 1) % vocab
    verify_len = np.array([3, 5, 3])
    accepted, next_token, logits = step(tokens, verify_len, greedy)
    assert accepted.tolist() == np.minimum(wrong_at, verify_len).tolist() == [0, 2, 3]
    assert next_token.tolist() == [int(logits[b, a].argmax()) for b, a in enumerate(accepted)]
    mixed = step(np.vstack([tokens, tokens[:1]]), np.append(verify_len, 1), np.append(greedy, 1.0).astype(np.float32))
    assert mixed[0][:3].tolist() == accepted.tolist() and mixed[1][:3].tolist() == next_token.tolist()
    ifs = [n for n in onnx.load(str(fused / FUSED_FILE), load_external_data=False).graph.node if n.op_type == "If"]
    assert [n.name for n in ifs if "acceptance" in n.name]  # the graph decides behind the acceptance If
