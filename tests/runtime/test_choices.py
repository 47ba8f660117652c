"""n > 1 (OpenAI's n): a prompt's choices take slots together, its prompt is prefilled once (all but its last token,
copied into the other choices' slots), and each choice is an independent sample from the target: chi-square of
each choice's tokens against the exact joint, and of the pairs of first tokens against the product of marginals,
with a negative control (two choices on one noise stream) that must fail."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from dspark.errors import DSparkError
from dspark.runtime import DecodeOptions, Runtime
from dspark.runtime.engine import Engine, EngineOptions
from dspark.runtime.engine_request import RequestOptions
from dspark.runtime.observers import RoundObserver
from dspark.runtime.scheduler import VerifyPolicy
from dspark.runtime.slot_request import SlotRequest
from dspark.runtime.slots import Slots
from dspark.runtime.sampling import SamplingParams
from support.stats import chi_square_pvalue, exact_joint_processed

PROMPT = [1, 4, 2, 0]
FAMILIES = 3000
V = 6
T = 3.0  # a temperature at which the first token has several likely values


def _joint(hf, depth: int) -> dict:
    return exact_joint_processed(hf, PROMPT, depth, V, SamplingParams(), T)


def _independent(hf) -> dict:
    first = _joint(hf, 1)
    return {(a, b): first[(a,)] * first[(b,)] for a in range(V) for b in range(V)}


class Prefills(RoundObserver):
    def __init__(self):
        self.rows = 0

    def prefilled(self, record) -> None:
        self.rows += len(record.requests)


@pytest.fixture(scope="module")
def rt(tiny_bundle_v6):
    runtime = Runtime(tiny_bundle_v6[3])
    yield runtime
    runtime.close()


def _families(rt, n: int, temperature: float = T, same_stream: bool = False, prompt=PROMPT, max_tokens=3):
    """FAMILIES prompts of n choices each through one slot machine: (tokens per family and choice, prefill rows).
    same_stream: a broken family, whose choices are separate requests on one noise stream."""
    prefills = Prefills()
    slots = Slots(rt.backend, rt.manifest, VerifyPolicy.parse("all"), 1200, len(prompt) + max_tokens + 8,
                  observers=(prefills,))
    slots.prefill_tokens = 1 << 20
    families = []
    for f in range(FAMILIES):
        first = None
        family = []
        for i in range(n):
            request = SlotRequest(f * n + i, prompt, max_tokens, temperature, seed=f, stream=0 if same_stream else i,
                                  shares_prompt_with=None if same_stream else first)
            first = first or request
            family.append(request)
            slots.add(request)
        families.append(family)
    while slots.busy:
        slots.step()
    return [[tuple(r.result.token_ids) for r in family] for family in families], prefills.rows


def _full(samples, depth=3):
    return [s for s in samples if len(s) == depth]


def test_each_choice_samples_the_target_and_the_prompt_is_prefilled_once(tiny_bundle_v6, rt):
    families, prefill_rows = _families(rt, 2)
    assert prefill_rows == FAMILIES  # one prefill row per family, not per choice
    stop = set(rt.manifest.stop_token_ids)
    joint = {k: p for k, p in _joint(tiny_bundle_v6[0], 3).items() if not stop.intersection(k[:2])}
    for choice in range(2):
        samples = _full([family[choice] for family in families])
        assert len(samples) > 0.3 * FAMILIES
        assert chi_square_pvalue(samples, joint) > 1e-3
    pairs = [(a[0], b[0]) for a, b in families]
    assert chi_square_pvalue(pairs, _independent(tiny_bundle_v6[0])) > 1e-3
    assert len(Counter(pairs)) > V  # the choices differ


def test_two_choices_on_one_noise_stream_are_caught(tiny_bundle_v6, rt):
    """Negative control: choices drawn from one noise stream are identical, far from independent samples."""
    families, _ = _families(rt, 2, same_stream=True)
    pairs = [(a[0], b[0]) for a, b in families]
    assert chi_square_pvalue(pairs, _independent(tiny_bundle_v6[0])) < 1e-6


def test_greedy_choices_equal_the_greedy_decode(rt):
    for prompt in (PROMPT, [3]):  # a one-token prompt: nothing to share, each choice prefills it
        expected = rt.generate([prompt], DecodeOptions(max_tokens=10))[0].token_ids
        engine = Engine(rt, EngineOptions(batch_size=3, policy="all")).start()
        try:
            requests = engine.submit_choices(prompt, RequestOptions(max_tokens=10), 3)
            assert [r.wait().token_ids for r in requests] == [expected] * 3
        finally:
            engine.close()


def test_seeded_choices_are_reproducible_and_n_beyond_the_slots_is_refused(rt):
    engine = Engine(rt, EngineOptions(batch_size=3, policy="all")).start()
    try:
        options = RequestOptions(max_tokens=12, temperature=1.0, seed=21, logprobs=1)
        first = [r.wait() for r in engine.submit_choices(PROMPT, options, 3)]
        again = [r.wait() for r in engine.submit_choices(PROMPT, options, 3)]
        assert [r.token_ids for r in first] == [r.token_ids for r in again]
        assert len({tuple(r.token_ids) for r in first}) > 1
        assert all(len(r.logprobs) == len(r.token_ids) for r in first)
        with pytest.raises(DSparkError, match="n must be an integer in 1..3"):
            engine.submit_choices(PROMPT, options, 4)
    finally:
        engine.close()
    assert np.all(engine.slots.occupied == 0)
