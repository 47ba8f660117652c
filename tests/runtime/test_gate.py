"""The draft gate: its cost model, its probing schedule, and exactness of decoding when it skips rounds."""
import numpy as np
import pytest

from dspark.errors import DSparkError
from dspark.ops.confidence_truncate.reference import FLAT, PADDED
from dspark.runtime.gate import DraftGate, GateMemory, step_seconds
from dspark.runtime.scheduler import VerifyPolicy


def test_step_seconds_reads_the_table_and_extrapolates_linearly():
    sps = np.array([100.0, 50.0, 25.0])
    assert step_seconds(sps, 1) == pytest.approx(0.01)
    assert step_seconds(sps, 3) == pytest.approx(0.04)
    assert step_seconds(sps, 6) == pytest.approx(0.08)
    assert step_seconds(sps, 0) == pytest.approx(0.01)


def test_rates_follow_the_cost_model():
    gate = DraftGate(np.array([10.0, 10.0, 5.0, 5.0]), block_size=3, batch=2, layout=PADDED)
    gate.observe(np.array([[0.5, 0.25, 0.1], [0.5, 0.25, 0.1]]), np.array([True, True]), 0.1)
    ar, spec = gate.rates(2)
    assert ar == pytest.approx(2 / 0.1)
    # k = 1: 2 x 1.5 tokens over 0.1 draft + step(4) = 0.2 s; k = 0 gives 2 / 0.2; k >= 2 pay more positions
    assert spec == pytest.approx(max(2 * 1.5 / 0.3, 2 * 1.0 / 0.2, 2 * 1.75 / (0.1 + 0.3), 2 * 1.85 / (0.1 + 0.4)))
    flat = DraftGate(np.array([10.0, 10.0, 5.0, 5.0]), block_size=3, batch=2, layout=FLAT)
    flat.observe(np.array([[0.5, 0.25, 0.1], [0.5, 0.25, 0.1]]), np.array([True, False]), 0.1)
    assert flat.rates(1)[0] == pytest.approx(1 / 0.1)  # flattened: only the live request's position


def _probes(gate, live, survival: float, seconds: float, rounds: int = 20) -> list[int]:
    pattern = []
    for _ in range(rounds):
        d = gate.should_draft(live)
        pattern.append(d)
        if d:
            gate.observe(np.full((len(live), 4), survival), live, seconds=seconds)
    return [i for i, d in enumerate(pattern) if d]


def test_gate_skips_costly_drafts_and_probes_with_backoff():
    """Drafting costs 3 verifier steps; it paid once (survival 0.9), then the drafter turns weak (0.1): the gate
    skips, probing after 2, 4, then 8 rounds, because the survival it has seen could still pay."""
    live = np.array([True])
    gate = DraftGate(np.array([100.0] * 8), block_size=4, batch=1, probe=2, max_probe=8, envelope_decay=1.0)
    assert gate.should_draft(live)  # nothing measured yet
    gate.observe(np.full((1, 4), 0.9), live, seconds=0.03)
    assert gate.should_draft(live)  # it pays
    gate.observe(np.full((1, 4), 0.1), live, seconds=0.03)
    assert _probes(gate, live, 0.1, 0.03) == [1, 5, 13]


def test_a_lucky_start_fades_with_rounds_not_with_probes():
    """The same start with the envelope fading 2% a round: the 0.9 seen once stops counting after ~9 rounds
    (paying needs 0.75), so the gate goes hopeless once it has seen min_evidence drafted rounds instead of probing
    every 8 rounds."""
    live = np.array([True])
    gate = DraftGate(np.array([100.0] * 8), block_size=4, batch=1, probe=2, max_probe=8, hopeless_probe=40)
    gate.should_draft(live)
    gate.observe(np.full((1, 4), 0.9), live, seconds=0.03)
    gate.should_draft(live)
    gate.observe(np.full((1, 4), 0.1), live, seconds=0.03)
    assert _probes(gate, live, 0.1, 0.03, rounds=60) == [1, 5, 13, 21]  # (not every 8 rounds up to 53)


def test_one_bad_first_round_is_not_enough_to_stop_probing():
    """A request's first drafted round (it also consumes the whole prompt) says little: a drafter that is poor
    there and good afterwards is found by the back-off's probes, not left undrafted for hopeless_probe rounds."""
    live = np.array([True])
    gate = DraftGate(np.array([100.0] * 8), block_size=4, batch=1, probe=2, max_probe=8, hopeless_probe=64)
    gate.should_draft(live)
    gate.observe(np.full((1, 4), 0.05), live, seconds=0.03)
    drafted = _probes(gate, live, 0.95, 0.03, rounds=60)
    assert drafted[0] == 1  # the back-off's first probe sees the good drafter...
    assert drafted[-10:] == list(range(50, 60))  # ...and once its smoothed survival pays, every round drafts


def test_gate_waits_longest_when_even_the_best_survival_seen_cannot_pay():
    live = np.array([True])
    gate = DraftGate(np.array([100.0] * 8), block_size=4, batch=1, probe=2, max_probe=8, hopeless_probe=12,
                     probe_budget=None)
    assert gate.should_draft(live)
    gate.observe(np.full((1, 4), 0.1), live, seconds=1.0)  # drafting costs 100 verifier steps
    # the back-off and min_evidence (6) drafted rounds first, then hopeless_factor x hopeless_probe rounds: even
    # its best rate is over 4x below AR's
    assert _probes(gate, live, 0.1, 1.0, rounds=100) == [1, 5, 13, 21, 29, 77]
    plain = DraftGate(np.array([100.0] * 8), block_size=4, batch=1, probe=2, max_probe=8, hopeless_probe=12,
                      hopeless_factor=1, probe_budget=None)
    plain.should_draft(live)
    plain.observe(np.full((1, 4), 0.1), live, seconds=1.0)
    assert _probes(plain, live, 0.1, 1.0, rounds=50) == [1, 5, 13, 21, 29, 41]


def test_a_costly_probe_waits_until_its_loss_fits_the_budget():
    """A probe that loses two plain steps (draft 0.02 s against a 0.01 s step, nothing accepted) waits 400 rounds
    to keep probing within 0.5% of the time, where the survival's own verdict would wait 12; never past
    max_hopeless; a probe that loses almost nothing keeps the survival's wait."""
    live = np.array([True])
    sps = np.array([100.0] * 8)

    def hopeless_wait(seconds: float, survival: float = 0.0, **kw) -> int:
        gate = DraftGate(sps, block_size=4, batch=1, probe=2, max_probe=8, hopeless_probe=12, hopeless_factor=1,
                         **kw)
        gate.should_draft(live)
        gate.observe(np.full((1, 4), survival), live, seconds=seconds)
        drafted = _probes(gate, live, survival, seconds, rounds=1200)
        return drafted[-1] - drafted[-2]

    # k = 1: 0.02 draft + 0.01 for two positions, one committed token worth 0.01: 0.02 lost = 400 x 0.5% x 0.01
    assert hopeless_wait(0.02) == 400
    assert hopeless_wait(0.02, probe_budget=None) == 12
    assert hopeless_wait(1.0) == 1024  # the cap
    assert hopeless_wait(1.0, max_hopeless=600) == 600
    # survival 0.1, a 0.0042 s draft: no k pays (k = 4: 1.4 tokens in 0.0142 s), the best loses 0.0002 s: 4 rounds
    assert hopeless_wait(0.0042, survival=0.1) == 12


def test_a_gate_for_a_new_batch_size_starts_from_the_survival_another_one_learned():
    """A runtime that decoded at batch 1 and now decodes a batch of 2: the new gate knows the drafter's survival
    (it cannot pay) and probes once to time the draft at this batch, then waits the hopeless wait, instead of
    backing off 2, 4, 8 first. Gates of another greedy-ness or policy learn nothing from it."""
    sps = np.array([100.0] * 8)
    policy = VerifyPolicy("all", gate=True, sps=sps)
    memory = GateMemory()

    def make(batch: int):
        return lambda: DraftGate(sps, block_size=4, batch=batch, probe=2, max_probe=8, hopeless_probe=12,
                                 hopeless_factor=1, probe_budget=None)

    one = memory.take(GateMemory.key(policy, 1, True), make(1))
    assert one.observed == 0
    _probes(one, np.array([True]), 0.1, 0.03, rounds=60)
    memory.give_back(GateMemory.key(policy, 1, True), one)
    two = memory.take(GateMemory.key(policy, 2, True), make(2))
    assert two is not one and two.observed == one.observed >= two.min_evidence
    np.testing.assert_array_equal(two.survival, one.survival)
    assert two.draft_seconds is None
    live = np.array([True, True])
    assert _probes(two, live, 0.1, 0.03, rounds=30) == [0, 12, 24]
    assert _probes(make(2)(), live, 0.1, 0.03, rounds=30) == [0, 2, 6, 14, 22]  # without: the back-off
    assert memory.take(GateMemory.key(policy, 1, True), make(1)) is one  # still kept for batch 1
    memory.give_back(GateMemory.key(policy, 1, True), one)
    other = VerifyPolicy("schedule", gate=True, sps=sps)
    for key in (GateMemory.key(policy, 2, False), GateMemory.key(other, 2, True)):
        assert memory.take(key, make(2)).observed == 0


def test_one_lucky_round_does_not_keep_the_gate_probing():
    """Drafting pays only at survival >= 0.75; one round at 0.9 among rounds at 0.1 (one request's luck) moves the
    smoothed survival to 0.34, so once the back-off is done probes still wait hopeless_probe rounds."""
    live = np.array([True])
    gate = DraftGate(np.array([100.0] * 8), block_size=4, batch=1, probe=2, max_probe=8, hopeless_probe=12,
                     hopeless_factor=1, probe_budget=None)
    assert gate.should_draft(live)
    gate.observe(np.full((1, 4), 0.1), live, seconds=0.03)
    gate.observe(np.full((1, 4), 0.9), live, seconds=0.03)
    assert _probes(gate, live, 0.1, 0.03, rounds=40) == [1, 5, 13, 21, 33]  # the back-off, then hopeless_probe


ONE_PAYS = np.array([100.0, 100.0, 12.5, 12.5, 12.5, 12.5, 12.5, 12.5])  # verifying 3+ positions costs 8x one


def drafted_rounds(gate: DraftGate, survival: float = 0.5):
    """rounds(live, n): n rounds through the gate, each drafted one observed with this survival per position;
    returns which rounds drafted."""
    def rounds(live: np.ndarray, n: int) -> list[int]:
        drafted = []
        for i in range(n):
            if gate.should_draft(live):
                drafted.append(i)
                gate.observe(np.full((live.size, 4), survival), live, seconds=0.001)
        return drafted

    return rounds


def test_the_back_off_is_kept_per_number_of_live_requests():
    """Drafting pays for one live request, not for two (verifying 3+ positions costs 8x one): a round where the
    batch drained to one request drafts, and must not restart two requests' back-off (it did: a serving engine
    paid 4 probes after every refill)."""
    gate = DraftGate(ONE_PAYS, block_size=4, batch=2, layout=FLAT, probe=2, max_probe=8, hopeless_probe=10 ** 6)
    two, one = np.array([True, True]), np.array([True, False])
    rounds = drafted_rounds(gate)

    assert rounds(two, 1) == [0]  # nothing measured yet
    ar, spec = gate.rates(2)
    assert spec < ar and np.greater(*gate.rates(1)[::-1])  # pays for one request, not for two
    assert rounds(two, 16) == [1, 5, 13]  # backing off: 2, 4, 8
    assert rounds(one, 3) == [0, 1, 2]  # one request left: every round drafts
    assert rounds(two, 8) == []  # two again: still backed off, now hopeless (was: a probe after 2 rounds)


def test_a_new_number_of_live_requests_is_judged_on_the_evidence_at_once():
    """Under a closed loop the live count keeps changing: once the gate has seen min_evidence drafted rounds, a
    count new to it that cannot pay waits the hopeless wait, not a back-off from `probe` rounds (which cost a
    serving engine 4-9% against AR at concurrency 4-8 with a drafter that could not pay)."""
    gate = DraftGate(ONE_PAYS, block_size=4, batch=3, layout=FLAT, probe=2, max_probe=8, hopeless_probe=10 ** 6)
    one, two = np.array([True, False, False]), np.array([True, True, False])
    rounds = drafted_rounds(gate)

    assert rounds(one, 8) == list(range(8))  # pays for one request: every round drafts, 8 rounds of evidence
    assert gate.rates(2)[1] < gate.rates(2)[0]
    assert rounds(two, 40) == []  # two requests: hopeless at once (was: probes at rounds 1 and 5 first)


def test_gate_keeps_drafting_when_it_pays():
    live = np.array([True, True])
    gate = DraftGate(np.array([100.0] * 16), block_size=4, batch=2)
    for _ in range(10):
        assert gate.should_draft(live)
        gate.observe(np.full((2, 4), 0.9), live, seconds=0.001)
    assert gate.rates(2)[1] > gate.rates(2)[0]


def test_gate_rescales_a_stale_table_by_measured_verifier_steps():
    """The table was profiled on a machine 4x faster than now: against the live draft time (as long as a 1-token
    step now) drafting looks costly, until the gate has timed a few real steps and sees the verifier at its
    present speed."""
    live = np.array([True])
    table = np.array([100.0] * 16)  # 10 ms a step at any width up to 16 tokens (as profiled)
    gate = DraftGate(table, block_size=4, batch=1)
    gate.observe(np.full((1, 4), 0.6), live, seconds=0.04)
    ar, spec = gate.rates(1)
    assert spec < ar  # 40 ms of drafting against a 10 ms step
    for tokens in (1, 5, 1):
        gate.observe_verify(tokens, 0.04)  # the verifier now takes 40 ms
    assert gate.scale == pytest.approx(4.0)
    ar, spec = gate.rates(1)
    assert ar == pytest.approx(1 / 0.04) and spec > ar
    assert gate.should_draft(live)


def test_parse_policy_takes_the_gate_suffix():
    from dspark.runtime.scheduler import VerifyPolicy

    policy = VerifyPolicy.parse("schedule+gate")
    assert policy.kind == "schedule" and policy.gate and not policy.is_ar
    assert VerifyPolicy.parse("ar").is_ar
    assert VerifyPolicy.parse("fixed:3+gate").gamma == 3
    assert not VerifyPolicy.parse("topk").gate
    for text in ("ar", "all", "fixed:3+gate", "static:0.4", "schedule+gate", "topk"):
        assert str(VerifyPolicy.parse(text)) == text
    for bad in ("ar+gate", "fixed:1+fast", "schedule:2"):
        with pytest.raises(DSparkError):
            VerifyPolicy.parse(bad)


def test_gate_without_sps_table_is_a_clear_error(tiny_bundle_v6):
    from dspark.runtime import DecodeOptions, Runtime
    from dspark.runtime.scheduler import VerifyPolicy

    rt = Runtime(tiny_bundle_v6[3])
    if rt.manifest.calibration.get("sps_table"):
        pytest.skip("the tiny bundle carries an SPS table")
    with pytest.raises(DSparkError, match="SPS table"):
        rt.decoder([[1, 2]], DecodeOptions(policy=VerifyPolicy("all", gate=True)))


def test_gated_decoding_is_exact_and_feeds_the_draft_every_position(tiny_bundle_v6):
    """A verifier that costs nothing makes every draft a loss: the gate skips all rounds but its probes. Greedy
    tokens must equal AR's, and the draft cache, fed several positions at once after skipped rounds, must hold
    the same entries as when the draft consumes each round's features."""
    from dspark.runtime import DecodeOptions, Runtime
    from dspark.runtime.scheduler import VerifyPolicy

    rt = Runtime(tiny_bundle_v6[3])
    prompt = [[1, 4, 2, 0, 3]]
    free = np.full(64, 1e9, dtype=np.float32)
    ar = rt.generate(prompt, DecodeOptions(max_tokens=40, policy="ar"))[0].token_ids
    plain = rt.decoder(prompt, DecodeOptions(max_tokens=40))
    gated = rt.decoder(prompt, DecodeOptions(max_tokens=40, policy=VerifyPolicy("all", gate=True, sps=free)))
    gated.gate.live_scale = False  # keep the table's free verifier: measured steps would make it cost something
    gated.gate.hopeless_probe, gated.gate.hopeless_factor = gated.gate.max_probe, 1  # several probes in 40 tokens
    for dec in (plain, gated):
        for _ in dec:
            pass
        assert dec.results[0].token_ids == ar
    assert 2 <= gated.times.drafted < gated.times.rounds
    assert any(p == 0 for p in gated.results[0].proposed)
    n = int(min(plain.draft_kv.lengths[0], gated.draft_kv.lengths[0]))
    assert n > len(prompt[0]) + 10
    np.testing.assert_allclose(gated.draft_kv.buffer[:, :, 0, :, :n], plain.draft_kv.buffer[:, :, 0, :, :n], atol=1e-5)


def test_a_runtime_hands_the_next_decode_the_gate_the_last_one_finished_with(tiny_bundle_v6):
    """Short decodes in a row (Runtime.generate once per request) must not each pay a fresh gate's probes; two
    decodes running at once must not share one gate."""
    from dspark.runtime import DecodeOptions, Runtime
    from dspark.runtime.scheduler import VerifyPolicy

    rt = Runtime(tiny_bundle_v6[3])
    prompt = [[1, 4, 2, 0, 3]]
    free = np.full(64, 1e9, dtype=np.float32)  # a verifier that costs nothing: drafting never pays
    options = DecodeOptions(max_tokens=24, policy=VerifyPolicy("all", gate=True, sps=free))
    ar = rt.generate(prompt, DecodeOptions(max_tokens=24, policy="ar"))[0].token_ids
    first = rt.decoder(prompt, options)
    first.gate.live_scale = False
    assert rt.decoder(prompt, options).gate is not first.gate  # first's is out: a fresh one
    for _ in first:
        pass
    second = rt.decoder(prompt, options)
    assert second.gate is first.gate and second.gate.observed == first.times.drafted >= 2
    assert rt.decoder(prompt, options).gate is not second.gate  # taken again: the one running keeps it
    for other in (options.replace(temperature=0.5), options.replace(policy=VerifyPolicy("schedule", gate=True,
                                                                                         sps=free))):
        assert rt.decoder(prompt, other).gate is not second.gate
    for _ in second:
        pass
    assert second.results[0].token_ids == first.results[0].token_ids == ar
    assert second.times.drafted < first.times.drafted  # it went on backing off where the first had got to
    assert rt.decoder(prompt, options).gate is second.gate
