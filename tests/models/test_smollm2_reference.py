"""Integration: the PyTorch reference on the real SmolLM2-135M-Instruct target."""
import pytest
import torch

from support.prompts import dev_prompts
from dspark.models.reference import generate_dspark

pytestmark = pytest.mark.integration  # the real SmolLM2-135M-Instruct target


def test_taps_equal_hf_hidden_states(smollm2):
    pair, tok = smollm2
    ids = torch.tensor([tok.encode_chat(dev_prompts(1)[0])])
    target = pair.target
    with torch.no_grad():
        ref = pair.loaded.hf_model(ids, output_hidden_states=True)
        # Two chunks through the explicit KV cache, so the cached path is what gets compared.
        kv = target.new_cache(1, ids.shape[1])
        cut = ids.shape[1] // 2
        mask = torch.zeros(1, ids.shape[1], dtype=torch.long)
        first = target(ids[:, :cut], mask, kv)
        kv[..., :cut, :] = first.new_kv
        mask[:, :cut] = 1
        second = target(ids[:, cut:], mask, kv)
    taps = torch.cat([first.taps, second.taps], dim=1)
    d = target.cfg.hidden_size
    for j, layer in enumerate(target.tap_ids):
        want = ref.hidden_states[layer + 1]
        got = taps[..., j * d:(j + 1) * d]
        scale = want.abs().max()
        torch.testing.assert_close(got / scale, want / scale, rtol=0, atol=2e-6)
    logits = target.logits(torch.cat([first.hidden, second.hidden], dim=1))
    torch.testing.assert_close(logits, ref.logits, rtol=1e-4, atol=1e-3)


def test_greedy_dspark_random_drafter_reproduces_hf_generate(smollm2):
    pair, tok = smollm2
    prompts = [tok.encode_chat(p) for p in dev_prompts(3, stride=35)]  # one math, one chat, one code prompt
    ds = generate_dspark(pair.target, pair.drafter, prompts, 64)  # no stop tokens: 64 tokens each
    hf = pair.loaded.hf_model
    for ids, res in zip(prompts, ds):
        want = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                           max_new_tokens=64, min_new_tokens=64, do_sample=False)[0, len(ids):].tolist()
        assert res.token_ids == want
        assert res.rounds < 64  # a random drafter is still accepted now and then
