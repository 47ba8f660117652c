"""Drafters without DSpark's heads (DFlash: no Markov head, no confidence head; or a Markov head alone) export
into the same three graphs and decode exactly: the runtime equals the PyTorch reference, greedy and sampled."""
import pytest

from dspark.bundle import Manifest
from dspark.demo import best_policy
from dspark.models.reference import generate_ar, generate_dspark
from dspark.runtime import DecodeOptions, Runtime
from support.tiny import tiny_bundle
from test_bundle_tiny import prompts  # token ids below 6: valid in this vocabulary too

V = 16


@pytest.fixture(scope="module", params=[(0, False), (6, False)], ids=["dflash", "markov-only"])
def headless(request, tmp_path_factory):
    rank, confidence = request.param
    return tiny_bundle(tmp_path_factory.mktemp("headless") / "b", family="qwen3", vocab=V, layers=2, block_size=4,
                       seed=3, markov_rank=rank, confidence=confidence)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_drafter_without_dspark_heads_decodes_as_the_reference(headless, temperature):
    hf, target, drafter, path = headless
    ps = prompts(6)
    with Runtime(path) as rt:
        stop = tuple(rt.manifest.stop_token_ids)
        ref = [r.token_ids for r in generate_dspark(target, drafter, ps, 20, temperature, 5, stop)]
        ref_ar = [r.token_ids for r in generate_ar(target, ps, 20, temperature, 5, stop)]
        for policy in ("all", "fixed:2"):
            got = rt.generate(ps, DecodeOptions(max_tokens=20, temperature=temperature, seed=5, policy=policy,
                                                batch_size=3))
            if policy == "all":
                assert [r.token_ids for r in got] == ref
            if temperature == 0.0:
                assert [r.token_ids for r in got] == ref_ar


def test_without_a_confidence_head_the_demo_policy_verifies_every_draft(headless):
    manifest = Manifest.read(headless[3])
    assert manifest.draft["confidence_head"] is False
    assert best_policy(manifest)[0] == "all+gate"
