"""The fused verifier with row attention (dspark.export.twins.row_attention): a verifier with int8 activations gets
it by default, every step shape of several requests runs on it in place, and each request's rows are bit for bit
those of its batch-1 steps, whatever the cache's width."""
from collections import Counter

import numpy as np
import onnx
import pytest

from dspark.bundle import Manifest
from dspark.export.quantize.bundle import QuantizeOptions, quantize_bundle
from dspark.export.twins.fused_bundle import FUSED_FILE, add_fused_verifier
from dspark.export.twins.ort_graphs import fuse_bundle
from dspark.runtime import DecodeOptions, Runtime
from dspark.runtime.decoder import Decoder
from dspark.runtime.ort_backend import OrtBackend
from support.tiny import tiny_bundle
from test_bundle_tiny import prompts


def _runtime(bundle, verifier: str = "auto") -> Runtime:
    return Runtime(bundle, backend=OrtBackend(bundle, Manifest.read(bundle), verifier=verifier))


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def int8(request, tmp_path_factory):
    """A tiny pair of each family whose verifier rounds activations to int8 (fused: row attention)."""
    root = tmp_path_factory.mktemp(f"rows-{request.param}")
    *_, bundle = tiny_bundle(root / "bundle", family=request.param, vocab=24, layers=3, block_size=4, seed=5,
                             hidden=64)
    fuse_bundle(bundle)
    quantize_bundle(bundle, ["verifier"], QuantizeOptions(bits=8, min_elements=0, agreement_prompts=0))
    return bundle


def test_int8_activations_get_row_attention_with_no_lanes(int8):
    man = Manifest.read(int8)
    assert man.quantized_activations("verifier")
    assert [t.name for t in man.graphs["verifier_fused"].inputs] == [t.name for t in man.graphs["verifier"].inputs]
    model = onnx.load(str(int8 / FUSED_FILE), load_external_data=False)
    assert {p.key: p.value for p in model.metadata_props} == {"dspark.attention": "rows"}
    ops = Counter(n.op_type for n in model.graph.node)
    layers = man.target["num_layers"]
    assert ops["GroupQueryAttention"] == 0 and ops["ScatterND"] == 2 * layers and ops["Softmax"] == layers
    assert ops["If"] == 1  # the greedy acceptance only


def test_every_step_of_several_requests_runs_fused_with_each_requests_batch_1_tokens(int8):
    ps = [[2]] + prompts(4, seed=4)
    options = DecodeOptions(max_tokens=16, batch_size=3)
    rt = _runtime(int8)
    v = rt.backend.verifier
    assert v.rows and not v.alone and v.lanes == 1
    rt.backend.prepare(3)
    batched = [r.token_ids for r in rt.generate(ps, options)]
    assert v.steps["portable"] == 0 and v.steps["fused"] > 0 and v._portable is None
    assert batched == [r.token_ids for r in rt.generate(ps, options.replace(batch_size=1))]
    assert batched == [r.token_ids for r in rt.generate(ps, options.replace(policy="ar"))]


def _step(rt, kv, tokens: list[list[int]]) -> tuple[np.ndarray, list[np.ndarray]]:
    """(taps, each slot's cache after) of one verifier step of each slot's tokens; the cache is then restored."""
    ids = np.array(tokens, dtype=np.int64)
    b, n = ids.shape
    kv.fit(n)
    before = kv.buffer.copy()
    feeds = {"tokens": ids, "past_mask": kv.past_mask(), "logit_index": np.tile(np.arange(n), (b, 1)),
             "verify_len": np.full(b, n - 1), "temperature": np.zeros(b, np.float32),
             "accept_noise": np.full((b, n), 0.5, np.float32), "sample_noise": np.full(b, 0.5, np.float32),
             "draft_probs": np.zeros((b, max(n - 1, 1), rt.manifest.target["vocab_size"]), np.float32), **kv.feeds}
    out = rt.backend.verifier.run(feeds)
    caches = [kv.buffer[:, :, slot, :, :int(kv.lengths[slot]) + n].copy() for slot in range(b)]
    kv.buffer[...] = before
    return out["taps"].numpy(), caches


def test_a_requests_rows_are_its_batch_1_rows_whatever_the_batch_and_the_caches_width(int8):
    """Three requests, one much longer (its cache is wider than the others need alone), one and two positions:
    each request's taps and new cache entries equal its own batch-1 step's, bit for bit."""
    rt = _runtime(int8)
    long = prompts(1, seed=2)[0] * 30  # past 64 positions: a wider cache than the short prompts need
    ps = [prompts(1, seed=9)[0], long[:80], [3]]
    options = DecodeOptions(max_tokens=4)
    dec = Decoder(rt.backend, rt.manifest, ps, options.replace(batch_size=3))
    next(iter(dec))
    assert dec.kv.width > 64
    for tokens in ([[3], [5], [7]], [[3, 4], [5, 6], [7, 8]]):
        taps, caches = _step(rt, dec.kv, tokens)
        for b in range(3):
            alone = Decoder(rt.backend, rt.manifest, [dec.prompts[b]], options)
            next(iter(alone))
            alone_taps, alone_cache = _step(rt, alone.kv, [tokens[b]])
            assert alone.kv.width < dec.kv.width or b == 1
            assert np.array_equal(taps[b], alone_taps[0])
            assert np.array_equal(caches[b], alone_cache[0])


def test_fp32_row_attention_decodes_the_portable_verifiers_tokens(int8, tmp_path):
    """The graph on fp32 activations too (built by name): the portable verifier's greedy tokens, every step fused."""
    *_, bundle = tiny_bundle(tmp_path / "b", family=Manifest.read(int8).target.get("family", "llama"), vocab=24,
                             layers=3, block_size=4, seed=5, hidden=64)
    man = Manifest.read(bundle)
    add_fused_verifier(bundle, man, "rows")
    man.write(bundle)
    ps = prompts(5, seed=4)
    options = DecodeOptions(max_tokens=16, batch_size=3)
    rt = _runtime(bundle)
    assert rt.backend.verifier.rows
    got = [r.token_ids for r in rt.generate(ps, options)]
    assert rt.backend.verifier.steps["portable"] == 0
    assert got == [r.token_ids for r in _runtime(bundle, "portable").generate(ps, options)]
    assert got == [r.token_ids for r in rt.generate(ps, options.replace(policy="ar"))]
