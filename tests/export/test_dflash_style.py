"""Drafters without DSpark's heads (DFlash: no Markov head, no confidence head; or a Markov head alone) export
into the same three graphs and decode exactly: the runtime equals the PyTorch reference, greedy and sampled."""
import numpy as np
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


def test_calibrate_measures_the_prior_and_the_policies_use_it(headless, tmp_path):
    """`dspark calibrate` on a drafter without a confidence head stores its acceptance per position; the demo's
    policy becomes Algorithm 1 on it; decoding stays exact and verifies no further than the prior allows."""
    import shutil

    from dspark.calibration.calibrate import calibrate

    bundle = tmp_path / "b"
    shutil.copytree(headless[3], bundle)
    report = calibrate(bundle, prompts(6), tmp_path / "out", max_tokens=16)
    prior = report["acceptance_prior"]
    manifest = Manifest.read(bundle)
    assert manifest.calibration["acceptance_prior"] == prior and len(prior) == manifest.block_size
    assert all(0.0 <= a <= 1.0 for a in prior) and manifest.acceptance_prior() == prior
    assert best_policy(manifest)[0] == "schedule+gate"
    survival = np.cumprod(prior)
    threshold = float(survival[1]) if survival[1] > 0 else 0.0
    with Runtime(bundle) as rt:
        ar = rt.generate(prompts(6), DecodeOptions(max_tokens=20, policy="ar"))
        got = rt.generate(prompts(6), DecodeOptions(max_tokens=20, policy=f"static:{threshold}", batch_size=3))
    assert [r.token_ids for r in got] == [r.token_ids for r in ar]
    allowed = int((survival >= threshold).sum())
    assert max(p for r in got for p in r.proposed) <= allowed
