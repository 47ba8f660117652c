"""The GPU backend (dspark.trt.backend.TrtBackend) on CPU, through dspark.testing.gpu_emulator: device-resident
caches, cache appends by row scatter, bound-once buffers, pinned double-buffered host I/O, CUDA-graph replay, profile
limits.
The real CUDA/TensorRT run is bench/device_check.sh and `dspark doctor`; this checks our side of the contract."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark.bundle import Manifest
from dspark.errors import DSparkError
from dspark.ops.scatter_rows.reference import scatter_rows
from dspark.runtime import DecodeOptions, TapsLog
from dspark.runtime.decoder import Decoder
from dspark.runtime.ort_backend import OrtBackend
from dspark.runtime.scheduler import VerifyPolicy
from dspark.testing.gpu_emulator import emulated_backend
from dspark.trt.state import disjoint_waves

PROMPTS = [[1, 4, 2, 0, 3], [5, 2], [5, 1, 1, 3, 0, 0, 2, 4], [3], [0, 4, 4, 1]]


@pytest.fixture(scope="module")
def bundle(tiny_bundle_v6):
    return tiny_bundle_v6[3]


def decode(backend, man, prompts=PROMPTS, prepare=None, observers=(), **options):
    dec = Decoder(backend, man, prompts, DecodeOptions(**{"max_tokens": 24, **options}), observers=observers)
    if prepare is not None:
        prepare(dec)
    for _ in dec:
        pass
    return dec


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_trt_backend_decodes_like_onnxruntime(bundle, temperature):
    """Five requests through three slots (admission while others decode), greedy and sampled: same tokens, same
    target features, and the device caches hold what the host caches hold."""
    host_taps, dev_taps = TapsLog(), TapsLog()

    def whole_rows(dec):  # the device backend computes every slot and never moves a request: compare slot by slot
        dec.slots.narrows = False
    host = decode(OrtBackend(bundle, Manifest.read(bundle)), Manifest.read(bundle), temperature=temperature, seed=4,
                  batch_size=3, prepare=whole_rows, observers=(host_taps,))
    backend, man = emulated_backend(bundle, max_batch=3, max_context=96)
    dev = decode(backend, man, temperature=temperature, seed=4, batch_size=3, observers=(dev_taps,))
    assert [r.token_ids for r in dev.results] == [r.token_ids for r in host.results]
    assert len({tuple(r.token_ids) for r in host.results}) > 2
    for i in range(len(PROMPTS)):
        np.testing.assert_allclose(dev_taps.take(i), host_taps.take(i), atol=1e-3)
    for d, h in ((dev.kv, host.kv), (dev.draft_kv, host.draft_kv)):
        assert np.array_equal(d.lengths, h.lengths)
        cache = backend.device.cuda.view(d.ptr, d.shape, np.float32)
        for slot, n in enumerate(h.lengths):
            np.testing.assert_allclose(cache[:, :, slot, :, :n], h.buffer[:, :, slot, :, :n], atol=1e-5)


def test_steady_state_binds_nothing_and_replays_cuda_graphs(bundle):
    backend, man = emulated_backend(bundle, max_batch=2, max_context=96, cuda_graphs=True)
    want = decode(*emulated_backend(bundle, max_batch=2, max_context=96), prompts=PROMPTS[:2], max_tokens=40)
    cuda = backend.device.cuda
    dec = Decoder(backend, man, PROMPTS[:2], DecodeOptions(max_tokens=40))
    it = iter(dec)
    for _ in range(12):  # prefill and the first rounds: buffers allocated, shapes seen, graphs captured
        next(it)
    mallocs, binds = cuda.counts["malloc"], sum(g.context.binds for g in (backend.verifier, backend.draft,
                                                                         backend.heads))
    replays = cuda.counts["replay"]
    for _ in it:
        pass
    assert [r.token_ids for r in dec.results] == [r.token_ids for r in want.results]
    assert cuda.counts["malloc"] == mallocs  # no allocation in steady state
    assert sum(g.context.binds for g in (backend.verifier, backend.draft, backend.heads)) == binds
    assert cuda.counts["replay"] > replays and cuda.counts["capture"] <= 3 * (man.block_size + 2)



def test_repeated_decodes_reuse_device_memory_and_a_collected_backend_frees_it(bundle):
    """A service calls generate again and again: the second decode of the same shapes gets its caches back from the
    pool (no allocation, no new graph capture), a decode of other shapes frees the old caches, ping-pong lanes are
    kept, and once the backend and its decoders are gone nothing stays allocated on the device or pinned."""
    import gc

    backend, man = emulated_backend(bundle, max_batch=3, max_context=96, cuda_graphs=True)
    cuda = backend.device.cuda
    first = [r.token_ids for r in decode(backend, man, PROMPTS[:2], max_tokens=30).results]
    mallocs, captures, replays = cuda.counts["malloc"], cuda.counts["capture"], cuda.counts["replay"]
    again = [r.token_ids for r in decode(backend, man, PROMPTS[:2], max_tokens=30).results]
    assert again == first
    assert cuda.counts["malloc"] == mallocs and cuda.counts["capture"] == captures
    assert cuda.counts["replay"] > replays
    decode(backend, man, PROMPTS[:3], max_tokens=8, batch_size=3)  # other cache shapes: new blocks
    pooled = sum(map(len, backend.device.pool.values()))
    assert pooled >= 6 and backend.device.trim() > 0  # both decodes' caches, rows and zeros were pooled
    assert cuda.counts["free"] >= pooled and not backend.device.pool
    assert backend.lanes(2)[1] is backend.lanes(2)[1]
    assert cuda.live()["device"] > 0 and cuda.live()["streams"] == 4
    del backend
    gc.collect()
    assert cuda.live() == {"device": 0, "pinned": 0, "streams": 0, "events": 0, "graphs": 0}


def test_draft_gate_piles_features_beyond_the_fixed_width(bundle):
    """With verification free, the gate skips most drafts, so more rows wait than the draft input holds; the
    device rows grow and the tokens stay exact."""
    backend, man = emulated_backend(bundle, max_batch=1, max_context=96)
    ar = decode(OrtBackend(bundle, Manifest.read(bundle)), Manifest.read(bundle), PROMPTS[:1], max_tokens=40,
                policy="ar")
    free = np.full(64, 1e9, dtype=np.float32)

    def probe_often(dec):  # several probes within 40 tokens, though no draft can pay against a free verifier
        dec.gate.hopeless_probe, dec.gate.hopeless_factor = dec.gate.max_probe, 1

    gated = decode(backend, man, PROMPTS[:1], max_tokens=40, policy=VerifyPolicy("all", gate=True, sps=free),
                   prepare=probe_often)
    assert gated.results[0].token_ids == ar.results[0].token_ids
    assert 2 <= gated.times.drafted < gated.times.rounds
    assert gated.slots.ctx.width > man.block_size + 1
    plain = decode(OrtBackend(bundle, Manifest.read(bundle)), Manifest.read(bundle), PROMPTS[:1], max_tokens=40)
    n = int(min(plain.draft_kv.lengths[0], gated.draft_kv.lengths[0]))  # the draft saw every position's features
    assert n > len(PROMPTS[0]) + 10
    cache = backend.device.cuda.view(gated.draft_kv.ptr, gated.draft_kv.shape, np.float32)
    np.testing.assert_allclose(cache[:, :, 0, :, :n], plain.draft_kv.buffer[:, :, 0, :, :n], atol=1e-5)


def test_engine_limits_are_clear_errors(bundle):
    backend, man = emulated_backend(bundle, max_batch=2, max_context=24)
    with pytest.raises(DSparkError, match="too long"):
        Decoder(backend, man, [[1] * 30], DecodeOptions(max_tokens=4))
    dec = Decoder(backend, man, PROMPTS, DecodeOptions(max_tokens=4, batch_size=8))
    assert dec.batch == 2  # the engines hold two requests at a time; the others wait for a slot
    with pytest.raises(DSparkError, match="context overflow"):
        decode(backend, man, [[1] * 12], max_tokens=40)
    with pytest.raises(DSparkError, match="outside its optimization profile"):
        backend.verifier.run({**{t.name: np.zeros([3 if d == "batch" else 1 if isinstance(d, str) else d
                                                    for d in t.shape], dtype=t.dtype)
                                 for t in man.graphs["verifier"].inputs}})


def test_scatter_reference_appends_rows_and_clips():
    src = np.arange(2 * 3 * 2 * 4 * 5, dtype=np.float32).reshape(2, 3, 2, 4, 5)
    dst = np.zeros((2, 4, 2, 6, 5), dtype=np.float32)
    scatter_rows(src, dst, [0, 2, 1], [3, 1, 0], [2, 4, 0], [3, 4, 0])
    assert np.array_equal(dst[:, 3, :, 2:5], src[:, 0, :, :3])
    assert np.array_equal(dst[:, 1, :, 4:6], src[:, 2, :, :2])  # rows past the destination are dropped
    assert not dst[:, 0].any() and not dst[:, 2].any() and not dst[:, 3, :, :2].any()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 2), st.integers(-2, 6), st.integers(0, 4)),
                min_size=1, max_size=8), st.randoms())
def test_appends_split_into_waves_whose_rows_may_land_in_any_order(entries, random):
    """One scatter launch writes its rows in no defined order (the H200 run of bench/device_check.sh saw 3 of 60
    random tables with overlapping destinations come out different from the in-order reference): any order of
    the entries inside each wave, waves in turn, must give what the queue's order gives."""
    src = np.random.default_rng(0).standard_normal((1, 3, 1, 4, 2)).astype(np.float32)
    queue = [(None, *e) for e in entries]
    want = np.zeros((1, 3, 1, 7, 2), dtype=np.float32)
    scatter_rows(src, want, *np.array([e[1:] for e in queue]).T)
    got = np.zeros_like(want)
    waves = disjoint_waves(queue)
    assert sorted(e for w in waves for e in w) == sorted(queue)
    for wave in waves:
        for e in random.sample(wave, len(wave)):
            scatter_rows(src, got, [e[1]], [e[2]], [e[3]], [e[4]])
    assert np.array_equal(got, want)
    rows = [(e[2], r) for e in queue for r in range(max(e[3], 0), e[3] + e[4])]
    if len(rows) == len(set(rows)):  # no destination row written twice: one launch
        assert len(waves) == 1


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_pingpong_micro_batches_on_two_lanes_give_the_same_tokens(bundle, temperature):
    from dspark.runtime.pingpong import generate_pingpong

    class Rt:  # the part of Runtime generate_pingpong uses, on the emulated backend
        def __init__(self, backend, man):
            self.backend, self.manifest = backend, man

        def encode(self, p):
            return list(p)

    backend, man = emulated_backend(bundle, max_batch=2, max_context=96)
    single = decode(OrtBackend(bundle, Manifest.read(bundle)), Manifest.read(bundle), temperature=temperature, seed=9)
    run = generate_pingpong(Rt(backend, man), PROMPTS, micro_batches=2,
                            options=DecodeOptions(max_tokens=24, temperature=temperature, seed=9))
    assert run.lanes == 2 and run.tokens_per_s > 0
    assert [r.token_ids for r in run.results] == [r.token_ids for r in single.results]
    with pytest.raises(DSparkError, match="no lanes"):
        generate_pingpong(Rt(OrtBackend(bundle, man), man), PROMPTS, micro_batches=2)


def test_device_runtime_check_script_runs_emulated(bundle, tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "bench" / "device_runtime_check.py"
    out = subprocess.run([sys.executable, str(script), "--emulate", "--bundle", str(bundle), "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads((tmp_path / "device_runtime_emulated.json").read_text())
    assert res["scatter_mismatches"] == 0 and res["tokens_equal_T1"] and res["graph_replay_ok"]


def test_sps_profile_runs_on_the_trt_backend(bundle):
    """`dspark calibrate --sps --backend tensorrt`: the table comes from the engines at their fixed capacity."""
    from dspark.calibration.sps import profile

    class Rt:
        def __init__(self, backend, man):
            self.backend, self.manifest = backend, man

    backend, man = emulated_backend(bundle, max_batch=2, max_context=48)
    res = profile(Rt(backend, man), max_batch=8, context=256, reps=1)
    assert len(res["sps_table"]) == 2 * (man.block_size + 1)  # batch capped at the engines' max_batch
    assert res["sps_backend"] == "tensorrt" and all(x > 0 for x in res["sps_table"])
    assert {m["batch"] for m in res["sps_measurements"]} == {1, 2}


def test_doctor_gpu_checks_pass_on_emulated_engines(bundle):
    """The GPU half of `dspark doctor` (per-graph parity on the recorded inputs, greedy token equality eager and
    with CUDA graphs, the speed line) runs end to end on the emulated engines and passes."""
    from dspark.trt.gpu_checks import compare_with_onnxruntime

    backend, man = emulated_backend(bundle, max_batch=2, max_context=96)
    rows = compare_with_onnxruntime(bundle, man, backend.engines, backend.device.cuda)
    assert [r[0] for r in rows][:1] == ["engine outputs vs ONNX Runtime (Polygraphy)"] and len(rows) == 4
    assert all(status == "ok" for _, status, _ in rows), rows
    assert "identical" in rows[1][2] and "identical" in rows[2][2]
