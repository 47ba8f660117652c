"""top_k / top_p / min_p thresholds: read from the most likely candidates where they lie among them, by bisection over
the whole vocabulary where they do not, in PyTorch and in the exported sampler graph (an ONNX If), both against the
distribution written out with a sort (support.stats.processed)."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

import dspark.models.sampling as sampling
from dspark.export.graphs import SAMPLER_INPUTS, SAMPLER_OUTPUTS, SamplerGraph, sampler_example_args
from dspark.export.trace.onnx_export import GraphExample, export_graph
from dspark.runtime.sampling import SamplingParams
from support.stats import processed

V = 64
FEW = 8  # candidates in these tests: thresholds past the 8th token take the bisection


@pytest.fixture
def few_candidates(monkeypatch):
    monkeypatch.setattr(sampling, "CANDIDATES", FEW)


def _rows(rng: np.random.Generator, n: int):
    """n single-row requests: logits of several spreads and every kind of filter."""
    logits = rng.standard_normal((n, 1, V)) * rng.choice([0.3, 1.0, 3.0, 8.0], size=(n, 1, 1))
    top_k = rng.choice([0, 1, 3, 8, 9, 20, 63, 64, 100], size=n)
    top_p = rng.choice([1.0, 0.3, 0.7, 0.9, 0.99], size=n)
    min_p = rng.choice([0.0, 0.0, 0.01, 0.2], size=n)
    temperature = rng.choice([0.5, 1.0, 2.0], size=n)
    return (torch.tensor(logits, dtype=torch.float32), torch.tensor(temperature, dtype=torch.float32),
            torch.tensor(top_k), torch.tensor(top_p, dtype=torch.float32), torch.tensor(min_p, dtype=torch.float32))


def _expected(logits, temperature, top_k, top_p, min_p) -> np.ndarray:
    out = []
    for i in range(logits.shape[0]):
        params = SamplingParams(top_k=int(top_k[i]), top_p=float(top_p[i]), min_p=float(min_p[i]))
        out.append(processed(logits[i, 0].numpy(), [0], (), params, float(temperature[i])))
    return np.stack(out)[:, None]


def test_thresholds_equal_the_sorted_ones_by_candidates_and_by_bisection(few_candidates):
    rng = np.random.default_rng(7)
    args = _rows(rng, 400)
    got = sampling.filtered_probs(*args).numpy()
    expected = _expected(*args)
    assert ((got > 0) == (expected > 0)).all(), "a filter kept or dropped a token the sorted definition does not"
    np.testing.assert_allclose(got, expected, atol=2e-6)
    probs = sampling.token_probs(args[0], args[1])
    k = torch.where((args[2] > 0) & (args[2] < V), args[2], torch.zeros_like(args[2])).view(-1, 1, 1)
    _, _, complete = sampling._thresholds_from_candidates(probs, k, args[3].view(-1, 1, 1))
    assert 50 < int(complete.sum()) < 350, "both ways of finding a threshold must be exercised"


def test_a_row_does_not_depend_on_a_neighbour_that_needs_the_bisection(few_candidates):
    rng = np.random.default_rng(3)
    peaked = torch.tensor(rng.standard_normal((1, 2, V)) * 8.0, dtype=torch.float32)
    flat = torch.tensor(rng.standard_normal((1, 2, V)) * 0.1, dtype=torch.float32)
    one = lambda t: torch.tensor([t])  # noqa: E731
    alone = sampling.filtered_probs(peaked, one(1.0), one(0), one(0.9), one(0.0))
    batch = sampling.filtered_probs(torch.cat([peaked, flat]), torch.tensor([1.0, 1.0]), torch.tensor([0, 0]),
                                    torch.tensor([0.9, 0.99]), torch.tensor([0.0, 0.0]))
    assert torch.equal(alone[0], batch[0])
    assert (batch[1] > 0).sum() > FEW  # the neighbour's nucleus lies past the candidates


def test_the_exported_sampler_takes_both_branches_as_pytorch_does(few_candidates, tmp_path):
    args, dims = sampler_example_args(V)
    example = GraphExample(SamplerGraph(), args, SAMPLER_INPUTS, SAMPLER_OUTPUTS, dims)
    export_graph(example, tmp_path / "sampler.onnx")
    session = ort.InferenceSession(str(tmp_path / "sampler.onnx"), providers=["CPUExecutionProvider"])
    assert "If" in {n.op_type for n in __import__("onnx").load(str(tmp_path / "sampler.onnx")).graph.node}
    rng = np.random.default_rng(11)
    for spread, top_p in ((6.0, 0.9), (0.1, 0.99)):  # thresholds among the candidates; then past them
        b, rows = 3, 4
        feeds = {"logits": (rng.standard_normal((b, rows, V)) * spread).astype(np.float32),
                 "draft_next": rng.integers(0, V, (b, rows)), "verify_len": np.array([3, 1, 0]),
                 "temperature": np.array([1.0, 0.7, 1.3], np.float32),
                 "accept_noise": rng.uniform(1e-6, 1, (b, rows)).astype(np.float32),
                 "sample_noise": rng.uniform(1e-6, 1, b).astype(np.float32),
                 "draft_probs": np.full((b, rows - 1, V), 1.0 / V, np.float32),
                 "counts": np.zeros((b, V), np.float32), "prompt_seen": np.zeros((b, V), np.float32),
                 "logit_bias": np.zeros((b, V), np.float32), "repetition_penalty": np.ones(b, np.float32),
                 "presence_penalty": np.zeros(b, np.float32), "frequency_penalty": np.zeros(b, np.float32),
                 "top_k": np.array([0, 5, 0]), "top_p": np.full(b, top_p, np.float32),
                 "min_p": np.zeros(b, np.float32)}
        got = dict(zip(SAMPLER_OUTPUTS, session.run(list(SAMPLER_OUTPUTS), feeds)))
        want = SamplerGraph()(*[torch.from_numpy(np.asarray(feeds[n])) for n in SAMPLER_INPUTS])
        np.testing.assert_array_equal(got["accepted"], want[0].numpy())
        np.testing.assert_array_equal(got["next_token"], want[1].numpy())
        assert ((got["probs"] > 0) == (want[2].numpy() > 0)).all()
        np.testing.assert_allclose(got["probs"], want[2].numpy(), atol=1e-6)
        kept = np.isfinite(got["logprobs"])
        assert (kept == (got["probs"] > 0)).all()
        np.testing.assert_allclose(got["logprobs"][kept], want[3].numpy()[kept], atol=1e-5)


def test_acceptance_from_logits_makes_the_decisions_of_acceptance_from_probabilities():
    """verify_logits (the verifier graph's) against verify on token_probs: the same accepted lengths and tokens for
    greedy and sampled requests, every proposed length, fewer draft rows than verify rows, tied logits."""
    rng = np.random.default_rng(5)
    for trial in range(200):
        b, k, v = 4, int(rng.integers(1, 6)), int(rng.integers(2, 40))
        kd = int(rng.integers(1, k + 1))
        logits = torch.tensor(rng.standard_normal((b, k, v)) * rng.choice([0.5, 3.0]), dtype=torch.float32)
        if trial % 5 == 0:
            logits[..., : v // 2] = logits.max()  # ties at the top: the first index wins, as argmax's
        temperature = torch.tensor(rng.choice([0.0, 0.5, 1.0, 2.0], size=b), dtype=torch.float32)
        target = sampling.token_probs(logits, temperature)
        greedy_draft = rng.random() < 0.5  # drafts drawn near the target, so that runs of them are accepted
        draft_next = target.argmax(-1) if greedy_draft else torch.tensor(rng.integers(0, v, (b, k)))
        draft_probs = torch.softmax(torch.tensor(rng.standard_normal((b, kd, v)), dtype=torch.float32), -1)
        verify_len = torch.tensor(rng.integers(0, k, size=b))
        accept = torch.tensor(rng.uniform(1e-6, 1, (b, k)), dtype=torch.float32)
        noise = torch.tensor(rng.uniform(1e-6, 1, b), dtype=torch.float32)
        want = sampling.verify(target, draft_next, draft_probs, verify_len, accept, noise)
        got = sampling.verify_logits(logits, temperature, draft_next, draft_probs, verify_len, accept, noise)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), trial
