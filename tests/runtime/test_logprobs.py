"""logprobs / top_logprobs: each emitted token's log-probability under the processed target distribution, as
autoregressive decoding reports it, whether the token was an accepted draft, a resampled one or a bonus token;
checked against one forward pass of the PyTorch target over the whole output (tests/support/stats.processed)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dspark.errors import DSparkError
from dspark.runtime import DecodeOptions, Runtime
from dspark.runtime.engine import Engine, EngineOptions
from dspark.runtime.engine_request import RequestOptions
from dspark.runtime.logprobs import log_softmax, token_logprobs
from dspark.runtime.sampling import SamplingParams
from support.stats import processed

PROMPTS = [[1, 4, 2, 0], [3, 3, 1], [2, 0, 4, 4, 1, 3]]
TOP = 3

CASES = {  # (sampling parameters, temperature)
    "greedy": (SamplingParams(), 0.0),
    "sampled": (SamplingParams(), 1.5),
    "sampled, every parameter": (SamplingParams(top_k=4, top_p=0.9, min_p=0.05, repetition_penalty=1.3,
                                                frequency_penalty=0.5, logit_bias={1: 1.0}), 2.0),
    "greedy, penalised": (SamplingParams(repetition_penalty=1.5, presence_penalty=0.5), 0.0),
}


@pytest.fixture(scope="module")
def rt(tiny_bundle_v6):
    runtime = Runtime(tiny_bundle_v6[3])
    yield runtime
    runtime.close()


def _results(rt, prompts, options: DecodeOptions):
    decoder = rt.decoder(prompts, options)
    for _ in decoder:
        pass
    return decoder.results


def _decode(rt, params, temperature, policy="all", seeds=range(4)):
    results = []
    for seed in seeds:
        results += _results(rt, PROMPTS, DecodeOptions(max_tokens=12, temperature=temperature, seed=seed,
                                                       policy=policy, sampling=params, logprobs=TOP))
    return results


@torch.no_grad()
def _reference(hf, prompt: list[int], tokens: list[int], params: SamplingParams, temperature: float) -> np.ndarray:
    """[len(tokens), V]: the log-probabilities autoregressive decoding reports at each output position."""
    logits = hf(torch.tensor([prompt + tokens])).logits[0].double().numpy()
    if temperature == 0.0:  # greedy: the penalised distribution at temperature 1, unfiltered
        params, temperature = SamplingParams(repetition_penalty=params.repetition_penalty,
                                             presence_penalty=params.presence_penalty,
                                             frequency_penalty=params.frequency_penalty,
                                             logit_bias=params.logit_bias), 1.0
    with np.errstate(divide="ignore"):
        return np.stack([np.log(processed(logits[len(prompt) - 1 + j], prompt, tuple(tokens[:j]), params,
                                          temperature)) for j in range(len(tokens))])


@pytest.mark.parametrize("case", list(CASES))
def test_logprobs_are_the_processed_targets(tiny_bundle_v6, rt, case):
    params, temperature = CASES[case]
    results = _decode(rt, params, temperature)
    assert np.mean([a for r in results for a in r.accepted]) > 0.2  # most tokens came from multi-position steps
    for r in results:
        assert [e.token for e in r.logprobs] == r.token_ids
        want = _reference(tiny_bundle_v6[0], r.prompt_ids, r.token_ids, params, temperature)
        for entry, row in zip(r.logprobs, want):
            assert entry.logprob == pytest.approx(row[entry.token], abs=2e-4)
            top_ids = sorted(range(len(row)), key=lambda v: (-row[v], v))[:TOP]
            assert [i for i, _ in entry.top] == top_ids
            got = np.array([lp for _, lp in entry.top])
            assert np.allclose(got, row[top_ids], atol=2e-4)  # -inf where a filter removed the token


def test_greedy_dspark_reports_what_autoregressive_decoding_does(rt):
    for params, _ in (CASES["greedy"], CASES["greedy, penalised"]):
        spec, ar = _decode(rt, params, 0.0, seeds=[0]), _decode(rt, params, 0.0, policy="ar", seeds=[0])
        for a, b in zip(spec, ar):
            assert a.token_ids == b.token_ids
            assert np.allclose([e.logprob for e in a.logprobs], [e.logprob for e in b.logprobs], atol=1e-5)


def test_the_drafters_probabilities_are_not_what_is_reported(tiny_bundle_v6, rt):
    """Negative control: the reference tells the target's log-probabilities from another model's."""
    drafter_like = SamplingParams(logit_bias={0: 3.0})  # a distribution the request did not sample from
    r = _decode(rt, SamplingParams(), 1.5, seeds=[1])[0]
    want = _reference(tiny_bundle_v6[0], r.prompt_ids, r.token_ids, drafter_like, 1.5)
    assert not all(abs(e.logprob - row[e.token]) < 2e-4 for e, row in zip(r.logprobs, want))


def test_no_logprobs_unless_asked(rt):
    results = _results(rt, PROMPTS, DecodeOptions(max_tokens=6, temperature=1.0))
    assert all(r.logprobs == [] for r in results)


def test_top_logprobs_ranks_and_ties():
    rows = log_softmax(np.array([[0.0, 2.0, 2.0, -1.0]]), 0.0)
    (entry,) = token_logprobs(rows, [3], 3)
    assert entry.token == 3 and entry.logprob == pytest.approx(float(rows[0, 3]))
    assert [i for i, _ in entry.top] == [1, 2, 0]  # most likely first, ties by id
    assert token_logprobs(rows, [1], 0)[0].top == ()


@pytest.mark.parametrize("bad", [-1, 21, 2.5, True, "3"])
def test_out_of_range_top_logprobs_are_refused(bad):
    with pytest.raises(DSparkError, match="top logprobs must be an integer in 0..20"):
        DecodeOptions(logprobs=bad)
    with pytest.raises(DSparkError, match="top logprobs"):
        RequestOptions(logprobs=bad)


def test_a_backend_without_logits_refuses_logprobs_in_one_line(tiny_bundle_v6):
    runtime = Runtime(tiny_bundle_v6[3])
    try:
        runtime.backend.logits = False
        with pytest.raises(DSparkError, match="gives no logits to compute logprobs from"):
            _results(runtime, PROMPTS, DecodeOptions(max_tokens=4, logprobs=1))
        results = _results(runtime, PROMPTS, DecodeOptions(max_tokens=4))  # without logprobs: as before
        assert all(r.token_ids for r in results)
    finally:
        runtime.close()


def test_the_engine_delivers_every_tokens_logprobs_once(rt):
    engine = Engine(rt, EngineOptions(batch_size=3, policy="all")).start()
    try:
        options = RequestOptions(max_tokens=10, temperature=1.2, seed=4, stop=("0 1",), logprobs=2)
        requests = [engine.submit(p, options) for p in PROMPTS]
        for request in requests:
            deltas = list(request)
            delivered = [e for d in deltas for e in d.logprobs]
            assert [e.token for e in delivered] == request.token_ids
            assert all(len(e.top) == 2 for e in delivered)
    finally:
        engine.close()
