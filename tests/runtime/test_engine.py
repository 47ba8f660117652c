"""The always-on engine on the tiny bundle: tokens equal Runtime.generate's whatever else is in flight, per-request
options, cancellation, refusals, shutdown."""
import math
import threading

import pytest

from dspark.errors import DSparkError
from dspark.runtime import DecodeOptions, Runtime
from dspark.runtime.engine import Engine, EngineClosed, EngineOptions, QueueFull
from dspark.runtime.engine_request import RequestOptions

from support.polling import wait_until

PROMPTS = [[1, 2, 3], [2, 2, 4, 1], [3], [4, 1, 1, 2, 3, 2], [0, 4], [2, 3, 1, 1]]


def alone(rt, prompt, max_tokens=24, temperature=0.0, seed=0, policy="all"):
    """What `dspark run` gives: the request decoded on its own."""
    options = DecodeOptions(max_tokens=max_tokens, temperature=temperature, seed=seed, policy=policy)
    return rt.generate([prompt], options)[0].token_ids


@pytest.fixture
def engine(runtime):
    engine = Engine(runtime, EngineOptions(batch_size=3, policy="all", max_queue=16)).start()
    yield engine
    engine.close(grace=0)


def test_greedy_tokens_equal_a_lone_decode_under_load(runtime, engine):
    requests = [engine.submit(p, RequestOptions(max_tokens=24)) for p in PROMPTS]  # 6 requests on 3 slots
    for prompt, request in zip(PROMPTS, requests):
        request.wait()
        assert request.token_ids == alone(runtime, prompt)
        assert request.finish_reason in ("stop", "length")
        assert request.text == runtime.tokenizer.decode(request.token_ids)
    deltas = list(engine.submit(PROMPTS[1], RequestOptions(max_tokens=24, temperature=1.0, seed=2)))
    assert sum((d.token_ids for d in deltas), []) == alone(runtime, PROMPTS[1], temperature=1.0, seed=2)
    assert "".join(d.text for d in deltas) == runtime.tokenizer.decode(sum((d.token_ids for d in deltas), []))
    assert [d.finish_reason is not None for d in deltas] == [False] * (len(deltas) - 1) + [True]


def test_seeded_sampling_is_reproducible_whatever_shares_the_batch(runtime, engine):
    for seed, temperature in ((5, 1.0), (11, 0.7), (3, 1.5)):
        expected = alone(runtime, PROMPTS[0], temperature=temperature, seed=seed)
        company = [engine.submit(p, RequestOptions(max_tokens=24, temperature=0.9, seed=seed + i + 1))
                   for i, p in enumerate(PROMPTS[1:3])]
        mine = engine.submit(PROMPTS[0], RequestOptions(max_tokens=24, temperature=temperature, seed=seed))
        assert mine.wait().token_ids == expected
        for request in company:
            request.wait()


def test_ar_request_in_a_drafting_batch_equals_an_ar_decode(runtime, engine):
    for seed in (1, 2, 9):
        expected = alone(runtime, PROMPTS[3], temperature=1.0, seed=seed, policy="ar")
        other = engine.submit(PROMPTS[1], RequestOptions(max_tokens=24, temperature=1.0, seed=seed))
        mine = engine.submit(PROMPTS[3], RequestOptions(max_tokens=24, temperature=1.0, seed=seed, policy="ar"))
        assert mine.wait().token_ids == expected
        assert mine.committed and set(mine.committed) == {1}  # one token per round: no drafts verified
        other.wait()


def test_stop_strings_end_the_request_and_are_not_returned(runtime, engine):
    tokens = alone(runtime, PROMPTS[0], temperature=1.0, seed=5)
    full = runtime.tokenizer.decode(tokens)
    words = full.split()
    stop = " ".join(words[3:5])  # two words in the middle
    request = engine.submit(PROMPTS[0], RequestOptions(max_tokens=24, temperature=1.0, seed=5, stop=(stop,))).wait()
    assert request.finish_reason == "stop"
    assert request.text == full[:full.index(stop)]
    streamed = "".join(d.text for d in engine.submit(
        PROMPTS[0], RequestOptions(max_tokens=24, temperature=1.0, seed=5, stop=(stop,))))
    assert streamed == request.text


def test_cancel_frees_the_slot_for_the_next_request(runtime):
    engine = Engine(runtime, EngineOptions(batch_size=1, policy="all", max_queue=4)).start()
    try:
        first_delta = threading.Event()
        long = engine.submit(PROMPTS[0], RequestOptions(max_tokens=240),
                             sink=lambda d: first_delta.set())
        waiting = engine.submit(PROMPTS[1], RequestOptions(max_tokens=8))
        assert first_delta.wait(60)
        long.cancel()
        assert waiting.wait().token_ids == alone(runtime, PROMPTS[1], 8)
        assert long.finish_reason == "cancelled" and len(long.token_ids) < 240
        assert wait_until(lambda: engine.busy_slots == 0 and engine.idle())
    finally:
        engine.close(grace=0)


def test_full_queue_and_too_long_requests_are_refused(runtime):
    # not started: nothing leaves the queue
    engine = Engine(runtime, EngineOptions(batch_size=2, policy="all", max_queue=3))
    accepted = [engine.submit(PROMPTS[0], RequestOptions(max_tokens=4)) for _ in range(5)]
    with pytest.raises(QueueFull, match="queue is full"):
        engine.submit(PROMPTS[0], RequestOptions(max_tokens=4))
    room = engine.max_tokens_for(len(PROMPTS[3]))
    with pytest.raises(DSparkError, match="does not fit the context"):
        engine.check(PROMPTS[3], RequestOptions(max_tokens=room + 1))
    engine.check(PROMPTS[3], RequestOptions(max_tokens=room))
    with pytest.raises(DSparkError, match="empty prompt"):
        engine.check([], RequestOptions())
    with pytest.raises(DSparkError, match="may ask for it or 'ar'"):
        engine.check(PROMPTS[0], RequestOptions(policy="fixed:1"))
    engine.start()
    assert all(r.wait().finish_reason == "length" for r in accepted)
    engine.close()


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(max_tokens=2.5), dict(temperature=math.nan),
                                 dict(temperature=-1.0), dict(temperature=1e9), dict(seed=-1), dict(seed=True),
                                 dict(stop=("",)), dict(stop=("x",) * 9)])
def test_bad_request_options_are_refused(bad):
    with pytest.raises(DSparkError):
        RequestOptions(**bad)


def test_close_finishes_or_cancels_every_accepted_request(runtime):
    engine = Engine(runtime, EngineOptions(batch_size=2, policy="all", max_queue=8)).start()
    requests = [engine.submit(p, RequestOptions(max_tokens=200, temperature=1.0, seed=i))
                for i, p in enumerate(PROMPTS)]
    engine.close(grace=0)
    reasons = [r.wait().finish_reason for r in requests]  # each got a final delta: none is left waiting
    assert set(reasons) <= {"stop", "length", "cancelled"} and "cancelled" in reasons
    with pytest.raises(EngineClosed):
        engine.submit(PROMPTS[0], RequestOptions())


class RowSpy:
    """Wraps the verifier graph: records how many rows each call computes."""

    def __init__(self, graph):
        self.graph, self.rows = graph, []

    def run(self, feeds):
        self.rows.append(feeds["tokens"].shape[0])
        return self.graph.run(feeds)


@pytest.mark.parametrize("policy", ["all", "ar"])
def test_rounds_compute_only_the_live_rows(tiny_bundle_v6, policy):
    """A lone request pays a one-row step on a 3-slot engine, and when a request below two live ones leaves, they
    move down (caches, pending features, noise) and keep decoding exactly as alone."""
    rt = Runtime(tiny_bundle_v6[3], threads=1)
    spy = rt.backend.verifier = RowSpy(rt.backend.verifier)
    engine = Engine(rt, EngineOptions(batch_size=3, policy=policy, max_queue=4))
    try:
        engine.start()
        for prompt in PROMPTS[:2]:  # one at a time
            engine.submit(prompt, RequestOptions(max_tokens=6)).wait()
        assert set(spy.rows) == {1}
        engine.close(grace=0)
        asked = [(PROMPTS[4], dict(max_tokens=3)), (PROMPTS[1], dict(max_tokens=16)),
                 (PROMPTS[3], dict(max_tokens=30, temperature=1.0, seed=4))]  # the sampled one moves: slot 2 -> 0
        options = [DecodeOptions(max_tokens=o["max_tokens"], temperature=o.get("temperature", 0.0),
                                 seed=o.get("seed", 0), policy=policy) for _, o in asked]
        lone = [rt.generate([p], o)[0] for (p, _), o in zip(asked, options)]
        spy.rows.clear()
        engine = Engine(rt, EngineOptions(batch_size=3, policy=policy, max_queue=4))  # not started: one prefill
        requests = [engine.submit(p, RequestOptions(**o)) for p, o in asked]
        engine.start()
        assert wait_until(lambda: all(r.done for r in requests), 120)
        assert [r.token_ids for r in requests] == [r.token_ids for r in lone]
        assert [r.committed for r in requests] == [r.committed for r in lone]  # same drafts accepted, round by round
        prefills, rounds = spy.rows[:3], spy.rows[3:]  # each prompt prefilled alone (no padding), then rounds
        assert prefills == [1, 1, 1] and rounds == sorted(rounds, reverse=True) and {3, 2, 1} <= set(rounds)
    finally:
        engine.close(grace=0)
        rt.close()
