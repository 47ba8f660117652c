"""dspark::ConfidenceTruncate: numpy reference == ONNX function body, prefixes, non-anticipation (Algorithm 1),
the Appendix A counterexample, lossless sampling with scheduling on, and the CUDA kernel builds."""
import shutil
import subprocess

import numpy as np
import onnxruntime as ort
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dspark.models.sampling import verify
from dspark.ops.confidence_truncate import reference as ref
from dspark.ops.confidence_truncate.onnx_function import standalone_model
from support.stats import chi_square_pvalue, exact_joint

SESSION = ort.InferenceSession(standalone_model().SerializeToString(), providers=["CPUExecutionProvider"])


@st.composite
def batches(draw):
    b = draw(st.integers(1, 8))
    bk = draw(st.integers(1, 7))
    n = draw(st.integers(1, 64))
    seed = draw(st.integers(0, 2 ** 31 - 1))
    rng = np.random.default_rng(seed)
    survival = np.cumprod(rng.random((b, bk)) ** draw(st.sampled_from([0.1, 0.5, 2.0])), axis=1).astype(np.float32)
    if draw(st.booleans()):
        survival = np.round(survival, 1).astype(np.float32)  # ties and exact zeros
    sps = (rng.random(n) * 100 + 1).astype(np.float32)
    if draw(st.booleans()):
        sps = np.sort(sps)[::-1].copy()
    return dict(survival=survival, threshold=rng.random(b).astype(np.float32), sps=sps,
                budget=np.array([rng.integers(0, b * bk + 2)], np.int64), active=rng.random(b) < 0.8)


def run_onnx(case, mode, layout):
    feeds = dict(case, mode=np.array([mode], np.int64), layout=np.array([layout], np.int64))
    return SESSION.run(None, feeds)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches(), st.sampled_from([ref.STATIC, ref.SCHEDULE, ref.TOPK]), st.sampled_from([ref.FLAT, ref.PADDED]))
def test_onnx_body_equals_numpy_and_gives_prefixes(case, mode, layout):
    lengths, mask = run_onnx(case, mode, layout)
    want_len, want_mask = ref.confidence_truncate(case["survival"], case["threshold"], case["sps"], case["budget"],
                                                  case["active"], mode, layout)
    np.testing.assert_array_equal(lengths, want_len)
    np.testing.assert_array_equal(mask, want_mask)
    bk = case["survival"].shape[1]
    assert np.array_equal(mask, np.arange(bk)[None] < lengths[:, None])  # a prefix per request
    assert np.all(lengths[~case["active"]] == 0)


@settings(max_examples=200, deadline=None)
@given(batches(), st.sampled_from([ref.FLAT, ref.PADDED]), st.data())
def test_algorithm1_is_non_anticipating(case, layout, data):
    """Whether (r, j) is admitted never depends on a_{r,k} for k > j (changed, keeping a non-increasing)."""
    s = case["survival"]
    b, bk = s.shape
    base = ref.schedule(s, case["sps"], case["active"], layout)
    r = data.draw(st.integers(0, b - 1))
    j = data.draw(st.integers(0, bk - 1))
    changed = s.copy()
    rng = np.random.default_rng(data.draw(st.integers(0, 1000)))
    changed[r, j + 1:] = np.sort(rng.random(bk - j - 1) * s[r, j])[::-1]
    other = ref.schedule(changed, case["sps"], case["active"], layout)
    assert (base[r] >= j + 1) == (other[r] >= j + 1)
    for q in range(b):  # nor for any other request's positions ranked above (r, j + 1)
        if q != r:
            ahead = [k for k in range(bk) if s[q, k] > s[r, j]]
            for k in ahead:
                assert (base[q] >= k + 1) == (other[q] >= k + 1)


def test_budget_uses_the_unconstrained_search():
    survival = np.array([[0.8, 0.72]], np.float32)
    sps = np.array([1.0, 0.5, 0.45], np.float32)
    assert ref.schedule(survival, sps, np.array([True]))[0] == 0  # Theta_1 = 0.9 < Theta_0 = 1: stop
    assert ref.budget_from(survival, sps, np.array([True])) == 2  # Theta_2 = 1.134 is the global best


# -- Appendix A: why the early stop is required ----------------------------------------------------------------

def appendix_a_first_tokens(early_stop: bool, n: int = 20000, seed: int = 0) -> list[tuple[int]]:
    """R=1, gamma=2, vocab {A, B}: p_t = (0.7, 0.3), p_d = (0.5, 0.5), a_1 = 0.8, c_2 = 0.9 after A, 0 after B."""
    rng = np.random.default_rng(seed)
    sps = np.array([1.0, 0.5, 0.45], np.float32)
    p_t = torch.tensor([0.7, 0.3])
    p_d = torch.tensor([0.5, 0.5])
    d1 = (rng.random(n) >= 0.5).astype(np.int64)  # 0 = A, 1 = B
    lengths = []
    for tok in d1:
        survival = np.array([[0.8, 0.8 * (0.9 if tok == 0 else 0.0)]], np.float32)
        lengths.append(min(1, int(ref.schedule(survival, sps, np.array([True]), ref.FLAT, early_stop)[0])))
    target_probs = p_t.expand(n, 2, 2).clone()
    draft_next = torch.stack([torch.from_numpy(d1), torch.zeros(n, dtype=torch.int64)], 1)
    draft_probs = p_d.expand(n, 1, 2).clone()
    u = torch.from_numpy((1 - rng.random((n, 3))).astype(np.float32))
    accepted, nxt = verify(target_probs, draft_next, draft_probs, torch.tensor(lengths), u[:, :2], u[:, 2])
    first = torch.where(accepted > 0, draft_next[:, 0], nxt)
    return [(int(t),) for t in first]


def test_appendix_a_global_search_over_current_confidences_is_biased():
    expected = {(0,): 0.7, (1,): 0.3}
    assert chi_square_pvalue(appendix_a_first_tokens(early_stop=True), expected) > 1e-3
    biased = appendix_a_first_tokens(early_stop=False)
    assert chi_square_pvalue(biased, expected) < 1e-6
    assert abs(np.mean([t == (0,) for t in biased]) - 0.85) < 0.01  # the paper's 0.85 instead of 0.7


# -- lossless sampling through the bundle with scheduling on ---------------------------------------------------

SAMPLES = 24000
PROMPT = [1, 4, 2, 0]


@pytest.mark.parametrize("kind", ["schedule", "topk"])
def test_bundle_sampling_is_lossless_with_scheduling(tiny_bundle_v6, kind):
    from dspark.runtime import DecodeOptions, Runtime
    from dspark.runtime.scheduler import VerifyPolicy

    hf, target, drafter, path = tiny_bundle_v6
    batch = 4000
    n = np.arange(1, batch * 4 + 2)
    sps = np.exp(-0.3 / batch * np.maximum(n - batch, 0)).astype(np.float32)  # admit drafts with a > ~0.3
    rt = Runtime(path)
    dec = rt.decoder([PROMPT] * SAMPLES, DecodeOptions(max_tokens=3, temperature=1.0, seed=77, batch_size=batch,
                                                       policy=VerifyPolicy(kind, sps=sps, layout=ref.FLAT)))
    for _ in dec:
        pass
    stop = set(rt.manifest.stop_token_ids)
    samples = [tuple(r.token_ids) for r in dec.results if len(r.token_ids) == 3]
    expected = {k: p for k, p in exact_joint(hf, PROMPT, 3, 6).items() if not stop.intersection(k[:2])}
    assert chi_square_pvalue(samples, expected) > 1e-3
    proposed = np.concatenate([r.proposed for r in dec.results])
    assert 0 < proposed.mean() < drafter.cfg.block_size  # the scheduler really cut some proposals


def test_cuda_kernel_compiles_for_sm80_and_sm90(tmp_path):
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not shutil.which(nvcc):
        pytest.skip("nvcc not installed")
    from dspark.ops.kernels import build_kernel

    lib = build_kernel(tmp_path, archs=("80", "90"), nvcc=nvcc)
    symbols = subprocess.run(["nm", "-D", str(lib)], capture_output=True, text=True).stdout
    assert "dspark_confidence_truncate" in symbols and "dspark_confidence_truncate_smem" in symbols
    assert "dspark_scatter_rows" in symbols  # the GPU runtime's cache-append kernel


def test_flat_time_ratio_follows_the_cost_curve():
    from dspark.runtime.measure import flat_time_ratio

    flat_cost = [10.0] * 16  # steps/s independent of the token count: flattening saves nothing
    assert flat_time_ratio([8, 16], [3, 5], flat_cost) == pytest.approx(1.0)
    linear = [100.0 / n for n in range(1, 17)]  # time proportional to tokens: saves the padding share
    assert flat_time_ratio([8, 16], [3, 5], linear) == pytest.approx(8 / 24)
    assert flat_time_ratio([8], [3], None) is None


def test_batch_run_counts_padded_and_useful_positions(tiny_bundle_v6):
    from dspark.runtime import Runtime
    from dspark.runtime.measure import run_batch

    rt = Runtime(tiny_bundle_v6[3])
    prompts = [[1, 2, 3], [4, 0], [2, 2, 1, 5, 3], [0]]
    ar = run_batch(rt, prompts, 2, "ar", max_tokens=6)
    assert ar.useful_positions <= ar.padded_positions == 2 * ar.rounds
    fixed = run_batch(rt, prompts, 3, "fixed:2", max_tokens=6)
    assert fixed.useful_positions <= fixed.padded_positions <= 3 * 3 * fixed.rounds
    assert fixed.mean_verify_budget <= 2
    assert fixed.tokens == ar.tokens  # greedy: the same tokens whatever the policy


@pytest.mark.parametrize("policy", ["static:0.3", "schedule", "topk", "fixed:2", "all"])
def test_a_drafter_without_confidence_decides_on_its_acceptance_prior(policy):
    """DFlash: every row's survival is the running product of the prior, and the policy decides on that as the
    heads graph would on a confidence head's (the numpy reference of ConfidenceTruncate)."""
    from dspark.runtime.scheduler import RoundPlanner, VerifyPolicy

    prior = [0.8, 0.6, 0.5, 0.3]
    expected_survival = np.cumprod(np.array(prior, np.float32))
    sps = (100.0 / (1 + 0.1 * np.arange(32))).astype(np.float32)
    planner = RoundPlanner(VerifyPolicy.parse(policy), 3, sps.tolist(), prior=prior)
    active = np.array([True, False, True])
    feeds = planner.feeds(active)
    ones = np.ones((3, 4), np.float32)
    survival = planner.survival(ones)
    assert np.allclose(survival, expected_survival[None]) and np.all(ones == 1)
    got = planner.after(survival, active, np.full(3, 4))  # the graph, which saw no survival, verified all
    want, _ = ref.confidence_truncate(survival, feeds["threshold"], sps, feeds["budget"], active,
                                      int(feeds["mode"][0]), int(feeds["layout"][0]))
    if policy == "fixed:2":
        want = np.minimum(want, 2)
    assert got.tolist() == np.where(active, want, 0).tolist()
    if policy == "static:0.3":
        assert got.tolist() == [2, 0, 2]  # 0.8, 0.48 reach 0.3; 0.24 does not
    without = RoundPlanner(VerifyPolicy.parse(policy), 3, sps.tolist())
    without.feeds(active)
    assert without.survival(ones) is ones  # a confidence head's survival is taken as the graph gives it
