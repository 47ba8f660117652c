"""PyTorch reference decoding on tiny random models: greedy equality and lossless sampling."""
import pytest
import torch

import dspark.models.reference as reference
from dspark.errors import DSparkError
from dspark.models.reference import generate_ar, generate_dspark
from dspark.models.sampling import sample
from support.faults import wrong_verify
from support.stats import chi_square_pvalue, exact_joint
from support.tiny import tiny_pair

V = 8


def random_prompts(n, vocab=V, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab - 1, (int(torch.randint(3, 14, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.mark.parametrize("family,markov", [("llama", "vanilla"), ("qwen3", "gated"), ("qwen3", "rnn")])
def test_greedy_dspark_equals_greedy_ar(family, markov):
    hf, target, drafter = tiny_pair(family, vocab=V, block_size=5, markov_head_type=markov, seed=3)
    prompts = random_prompts(24)
    ar = generate_ar(target, prompts, 40)
    ds = generate_dspark(target, drafter, prompts, 40)
    assert [r.token_ids for r in ds] == [r.token_ids for r in ar]
    accepted = [a for r in ds for a in r.accepted]
    assert 0 in accepted and sum(a > 0 for a in accepted) >= 5, "the drafter should be partly accepted"
    hf_out = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                          max_new_tokens=40, do_sample=False)[0, len(p):].tolist() for p in prompts[:6]]
    assert hf_out == [r.token_ids for r in ar[:6]]


def test_batched_decoding_equals_one_by_one():
    _, target, drafter = tiny_pair("qwen3", vocab=V, block_size=4, seed=5)
    prompts = random_prompts(9, seed=1)
    one = [generate_dspark(target, drafter, [p], 30)[0].token_ids for p in prompts]
    batch = generate_dspark(target, drafter, prompts, 30)
    assert [r.token_ids for r in batch] == one
    assert [r.token_ids for r in generate_ar(target, prompts, 30)] == one


def test_stop_tokens_and_max_new_tokens():
    _, target, drafter = tiny_pair("llama", vocab=V, block_size=4, seed=2)
    prompt = random_prompts(1, seed=4)[0]
    free = generate_dspark(target, drafter, [prompt], 40)[0]
    assert len(free.token_ids) == 40 and not free.stopped
    stop = free.token_ids[11]
    first = free.token_ids.index(stop)
    stopped = generate_dspark(target, drafter, [prompt], 40, stop_ids=(stop,))[0]
    assert stopped.stopped and stopped.token_ids == free.token_ids[:first + 1]
    assert generate_ar(target, [prompt], 40, stop_ids=(stop,))[0].token_ids == stopped.token_ids
    assert len(generate_dspark(target, drafter, [prompt], 7)[0].token_ids) == 7
    # tau counts the bonus/correction token: committed = accepted + 1 except on a stop inside the drafts
    assert all(c == a + 1 for c, a in zip(free.committed, free.accepted))


def test_threshold_truncates_verification():
    _, target, drafter = tiny_pair("qwen3", vocab=V, block_size=5, seed=6)
    prompt = random_prompts(1, seed=8)[0]
    full = generate_dspark(target, drafter, [prompt], 40)[0]
    cut = generate_dspark(target, drafter, [prompt], 40, threshold=0.3)[0]
    assert cut.token_ids == full.token_ids
    assert max(full.proposed) == 5 and min(cut.proposed) < 5


def test_empty_prompt_and_overflow_are_clear_errors():
    _, target, drafter = tiny_pair("llama", vocab=V, block_size=4)
    with pytest.raises(DSparkError, match="empty prompt"):
        generate_dspark(target, drafter, [[]], 5)
    with pytest.raises(DSparkError, match="context overflow"):
        generate_dspark(target, drafter, [[1, 2, 3]], 30, capacity=12)


def test_inverse_cdf_sampler_never_picks_zero_probability_tokens():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]])
    for u in [1e-7, 0.25, 0.5, 0.5000001, 0.99, 1.0]:
        assert int(sample(probs, torch.tensor([u]))[0]) in (1, 3)


# -- lossless sampling --------------------------------------------------------------------------------------------

SAMPLES = 24000
DEPTH = 3


def _dspark_samples(target, drafter, prompt, seed, **kw):
    out = generate_dspark(target, drafter, [prompt] * SAMPLES, DEPTH, temperature=1.0, seed=seed, **kw)
    return [tuple(r.token_ids) for r in out]


@pytest.fixture(scope="module")
def sampling_pair():
    hf, target, drafter = tiny_pair("llama", vocab=6, layers=2, block_size=3, seed=11)
    prompt = [1, 4, 2, 0]
    return hf, target, drafter, prompt, exact_joint(hf, prompt, DEPTH, 6)


def test_sampling_is_lossless(sampling_pair):
    hf, target, drafter, prompt, expected = sampling_pair
    samples = _dspark_samples(target, drafter, prompt, seed=1234)
    assert chi_square_pvalue(samples, expected) > 1e-3


def test_sampling_is_lossless_with_confidence_threshold(sampling_pair):
    hf, target, drafter, prompt, expected = sampling_pair
    samples = _dspark_samples(target, drafter, prompt, seed=99, threshold=0.4)
    assert chi_square_pvalue(samples, expected) > 1e-3


def test_wrong_acceptance_rule_is_detected(sampling_pair, monkeypatch):
    hf, target, drafter, prompt, expected = sampling_pair
    monkeypatch.setattr(reference, "verify", wrong_verify)
    samples = _dspark_samples(target, drafter, prompt, seed=1234)
    assert chi_square_pvalue(samples, expected) < 1e-6
