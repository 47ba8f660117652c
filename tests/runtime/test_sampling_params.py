"""top_k, top_p, min_p, penalties and logit_bias under speculative decoding: the sampler graph's tokens are
distributed as autoregressive sampling from the processed target distribution (chi-square against the exact joint
written out independently with sorts, tests/support/stats.processed), with negative controls that must fail."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

from dspark.errors import DSparkError
from dspark.runtime import DecodeOptions, Runtime
from dspark.runtime.engine import Engine, EngineOptions
from dspark.runtime.engine_request import RequestOptions
from dspark.runtime.sampling import SamplingParams
from support.stats import chi_square_pvalue, exact_joint_processed

PROMPT = [1, 4, 2, 0]
SAMPLES = 12000
V = 6  # tiny_bundle_v6: vocabulary 6, stop token 5

# (parameters, temperature): temperatures at which the tiny target's processed joint over 3 tokens has many cells
CASES = {
    "top_k": (SamplingParams(top_k=2), 2.0),
    "top_p": (SamplingParams(top_p=0.8), 3.0),
    "min_p": (SamplingParams(min_p=0.2), 3.0),
    "logit_bias": (SamplingParams(logit_bias={0: -2.0, 2: 1.5}), 1.5),
    "repetition_penalty": (SamplingParams(repetition_penalty=1.8), 1.0),
    "presence_penalty": (SamplingParams(presence_penalty=1.0), 1.0),
    "frequency_penalty": (SamplingParams(frequency_penalty=0.8), 1.0),
    "combined": (SamplingParams(top_k=4, top_p=0.9, min_p=0.05, repetition_penalty=1.3, frequency_penalty=0.5,
                                logit_bias={1: 1.0}), 2.0),
}


def _samples(runtime: Runtime, params: SamplingParams, temperature: float, policy: str = "all", seed: int = 5):
    decoder = runtime.decoder([PROMPT] * SAMPLES, DecodeOptions(max_tokens=3, temperature=temperature, seed=seed,
                                                                batch_size=2000, policy=policy, sampling=params))
    decoder.slots.prefill_tokens = 1 << 20  # the same prompt: prefill each wave in one call (the test's speed)
    for _ in decoder:
        pass
    results = decoder.results
    return [tuple(r.token_ids) for r in results if len(r.token_ids) == 3], results


def _expected(hf, runtime: Runtime, params: SamplingParams, temperature: float) -> dict:
    stop = set(runtime.manifest.stop_token_ids)
    joint = exact_joint_processed(hf, PROMPT, 3, V, params, temperature)
    return {k: p for k, p in joint.items() if not stop.intersection(k[:2])}  # paths that do not stop early


def _fit(samples: list, expected: dict) -> float:
    """chi_square_pvalue, or 0 when a sample has no probability under `expected` at all (a negative control)."""
    return chi_square_pvalue(samples, expected) if set(samples) <= set(expected) else 0.0


@pytest.fixture(scope="module")
def rt(tiny_bundle_v6):
    runtime = Runtime(tiny_bundle_v6[3])
    yield runtime
    runtime.close()


@pytest.mark.parametrize("case", list(CASES))
def test_dspark_samples_the_processed_distribution(tiny_bundle_v6, rt, case):
    params, temperature = CASES[case]
    samples, results = _samples(rt, params, temperature)
    assert len(samples) > 0.3 * SAMPLES
    assert chi_square_pvalue(samples, _expected(tiny_bundle_v6[0], rt, params, temperature)) > 1e-3
    assert np.mean([a for r in results for a in r.accepted]) > 0.05  # drafts were verified, and some accepted


def test_autoregressive_sampling_takes_the_same_processing(tiny_bundle_v6, rt):
    params, temperature = CASES["combined"]
    samples, _ = _samples(rt, params, temperature, policy="ar", seed=6)
    assert chi_square_pvalue(samples, _expected(tiny_bundle_v6[0], rt, params, temperature)) > 1e-3


def test_unprocessed_sampling_fails_the_processed_test(tiny_bundle_v6, rt):
    """Negative control: plain temperature sampling is told apart from each processed distribution."""
    for case in ("top_p", "frequency_penalty"):
        params, temperature = CASES[case]
        samples, _ = _samples(rt, SamplingParams(), temperature)
        assert _fit(samples, _expected(tiny_bundle_v6[0], rt, params, temperature)) < 1e-6


def test_penalties_that_ignore_the_earlier_drafts_of_a_block_are_caught(tiny_bundle_v6, rt, tmp_path, monkeypatch):
    """Negative control: a sampler whose row j does not count the drafts of rows 0..j-1 (what autoregressive
    decoding would have emitted by then) is exact for AR steps but not for DSpark rounds, and the test sees it."""
    import torch

    from dspark.export import graphs
    from dspark.export.trace.onnx_export import export_graph, sampler_example
    from dspark.models import sampling
    from dspark.models.pair import Pair
    from support.tiny import TinyLoaded, restamp

    hf, target, drafter, path = tiny_bundle_v6
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    real = sampling.penalised_logits

    def blind(logits, draft_next, *rest):
        return real(logits, torch.full_like(draft_next, -1), *rest)  # no draft is ever counted

    monkeypatch.setattr(graphs, "penalised_logits", blind)
    export_graph(sampler_example(Pair(TinyLoaded(hf, path), target, drafter, "random")), bad / "sampler.onnx")
    restamp(bad)
    params = SamplingParams(frequency_penalty=2.0)
    expected = _expected(hf, rt, params, 1.0)
    assert _fit(_samples(rt, params, 1.0)[0], expected) > 1e-3  # the real sampler passes the same test
    with Runtime(bad) as runtime:
        samples, _ = _samples(runtime, params, 1.0)
        assert _fit(samples, expected) < 1e-6


def test_greedy_with_penalties_equals_autoregressive_and_a_request_ignores_its_neighbours(rt):
    params = SamplingParams(presence_penalty=1.5, frequency_penalty=0.5, logit_bias={3: -2.0})
    prompts = [[1, 4, 2, 0], [2, 2, 1], [0, 3]]
    ar = rt.generate(prompts, DecodeOptions(max_tokens=10, policy="ar", sampling=params))
    ds = rt.generate(prompts, DecodeOptions(max_tokens=10, policy="all", sampling=params))
    assert [r.token_ids for r in ds] == [r.token_ids for r in ar]
    assert [r.token_ids for r in ds] != [r.token_ids for r in rt.generate(prompts, DecodeOptions(max_tokens=10))]
    # a seeded sampled request: the same tokens alone and beside requests with other parameters
    options = DecodeOptions(max_tokens=8, temperature=1.0, seed=9, sampling=SamplingParams(top_p=0.8))
    alone = rt.generate([PROMPT], options)[0].token_ids
    engine = Engine(rt, EngineOptions(batch_size=4, policy="all", max_queue=8)).start()
    try:
        mine = engine.submit(PROMPT, RequestOptions(max_tokens=8, temperature=1.0, seed=9,
                                                    sampling=SamplingParams(top_p=0.8)))
        others = [engine.submit(p, RequestOptions(max_tokens=8, temperature=0.7, seed=s,
                                                  sampling=SamplingParams(top_k=2, repetition_penalty=1.5)))
                  for s, p in enumerate(prompts)]
        assert mine.wait().token_ids == alone
        for o in others:
            o.wait()
    finally:
        engine.close(grace=0)


def test_greedy_requests_with_only_min_p_top_k_top_p_skip_the_sampler(rt, monkeypatch):
    """Those keep the most likely token: greedy decoding is unchanged, and no round pays for the sampler."""
    calls = []
    run = rt.backend.sampler.run
    monkeypatch.setattr(rt.backend.sampler, "run", lambda feeds, **kw: calls.append(1) or run(feeds, **kw))
    prompts = [[1, 4, 2, 0], [2, 2, 1]]
    plain = rt.generate(prompts, DecodeOptions(max_tokens=10))
    filtered = rt.generate(prompts, DecodeOptions(max_tokens=10, sampling=SamplingParams(top_k=2, top_p=0.5,
                                                                                         min_p=0.3)))
    assert [r.token_ids for r in filtered] == [r.token_ids for r in plain] and not calls
    rt.generate(prompts, DecodeOptions(max_tokens=10, sampling=SamplingParams(top_k=2, logit_bias={1: 0.5})))
    assert calls  # a bias can move the argmax: those rounds take the sampler


@pytest.mark.parametrize("field, value, words", [
    ("top_p", 0.0, "top_p must be a number above 0"), ("top_p", 1.5, "at most 1"), ("top_k", -1, "top_k must"),
    ("min_p", 1.2, "min_p must"), ("presence_penalty", 2.5, "presence_penalty must"),
    ("frequency_penalty", float("nan"), "frequency_penalty must"), ("repetition_penalty", 0.0, "repetition_penalty"),
    ("logit_bias", {1: 101.0}, "logit_bias[1] must"), ("logit_bias", {-1: 1.0}, "not a token id"),
])
def test_out_of_range_parameters_are_refused_naming_the_field(field, value, words):
    with pytest.raises(DSparkError, match=words.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(**{field: value})


def test_a_bias_outside_the_vocabulary_and_a_bundle_without_a_sampler_are_refused(tiny_bundle_v6, rt, tmp_path):
    with pytest.raises(DSparkError, match="logit_bias key 6 is outside the vocabulary"):
        rt.generate([PROMPT], DecodeOptions(max_tokens=2, sampling=SamplingParams(logit_bias={6: 1.0})))
    from dspark.bundle import Manifest

    old = tmp_path / "old"
    shutil.copytree(tiny_bundle_v6[3], old)
    manifest = Manifest.read(old)
    del manifest.graphs["sampler"]
    manifest.write(old)
    with Runtime(old) as runtime:
        assert runtime.generate([PROMPT], DecodeOptions(max_tokens=2))[0].token_ids
        with pytest.raises(DSparkError, match="runs no sampler graph"):
            runtime.generate([PROMPT], DecodeOptions(max_tokens=2, sampling=SamplingParams(top_k=2)))
