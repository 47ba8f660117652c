"""Whether a round should draft at all (torch-free).

The prefix scheduler decides how many drafts to verify once they exist, when drafting has already been paid
for. When the drafter is weak for the current load, no verification length recovers that cost and a plain
verifier step (autoregressive decoding, verify_len 0: lossless) is faster. The gate makes that choice before
the round from what it has seen: the mean calibrated prefix survival of recent drafted rounds, the measured
draft + heads time, and the verifier's steps/s table.

While it skips, it drafts anyway every `probe` rounds to refresh those estimates, backing off (x2, up to
`max_probe`) while skipping keeps winning, separately for each number of live requests (whether drafting pays
depends on it: a batch that drains to a few requests where drafting pays must not restart the full batch's
back-off). When even the best survival seen lately (a per-position envelope of the smoothed survival that fades
by `envelope_decay` every round, drafted or skipped, so a lucky start stops counting after a few dozen rounds)
could not pay at the current batch, probes wait `hopeless_probe` rounds, longer the further it is from paying: a
probe that cannot change the decision is pure cost.

The SPS table gives the verifier's cost curve as profiled once, on a quiet machine; the draft time is measured
live. On a machine whose speed drifts that compares a live cost with a stale one, so the gate also times the
verifier steps it sees and rescales the table by the smoothed ratio of measured to tabled time (the table's
shape is kept: Algorithm 1's choice of lengths does not depend on its scale, the gate's does).

A loaded bundle keeps its gates between decodes (GateMemory): the serving engine's one gate lives as long as the
engine, and `Runtime.generate` called once per request hands each decode the gate the previous one finished with,
so a drafter that cannot pay is not re-learned (a fresh gate drafts at rounds 1, 5, 13, 29 and 61 before it has
the evidence to probe rarely). A gate for a batch size not seen before starts from the survival another batch
size's gate learned (`inherit`). docs/policies.md has the measurements behind these choices.
"""
from __future__ import annotations

import threading
from typing import Callable

import numpy as np

from dspark.ops.confidence_truncate.reference import PADDED
from dspark.runtime.scheduler import VerifyPolicy


def step_seconds(sps: np.ndarray, tokens: int) -> float:
    """Verifier step time at `tokens` batch tokens from a steps/s table, linear beyond its end."""
    n = max(int(tokens), 1)
    return float(max(1.0, n / len(sps)) / sps[min(n, len(sps)) - 1])


class DraftGate:
    def __init__(self, sps: np.ndarray, block_size: int, batch: int, layout: int = PADDED, probe: int = 4,
                 max_probe: int = 32, hopeless_probe: int = 128, hopeless_factor: int = 4, min_evidence: int = 6,
                 smoothing: float = 0.3, envelope_decay: float = 0.98, probe_budget: float | None = 0.005,
                 max_hopeless: int = 1024):
        self.sps = np.asarray(sps, dtype=np.float64)
        self.batch, self.layout = batch, layout
        self.base_probe, self.max_probe = probe, max_probe
        self.probes: dict[int, int] = {}  # live requests -> backed-off probe interval (default base_probe)
        self.hopeless_probe = max(hopeless_probe, max_probe)
        self.hopeless_factor = max(hopeless_factor, 1)
        self.probe_budget, self.max_hopeless = probe_budget, max(max_hopeless, self.hopeless_probe)
        self.min_evidence, self.observed = min_evidence, 0  # drafted rounds seen before a verdict of hopeless
        self.smoothing = smoothing
        self.survival = np.zeros(block_size)  # mean over live requests, smoothed over drafted rounds
        self.gain = np.zeros(block_size + 1)  # expected accepted drafts when verifying k = 0..Bk
        self.best = np.zeros(block_size)  # envelope of the smoothed survival, fading per round
        self.envelope_decay = envelope_decay
        self.draft_seconds: float | None = None  # draft + heads per round, smoothed
        self.scale: float | None = None  # measured / tabled verifier step time, smoothed (None: none timed yet)
        self.live_scale = True
        self.skipped = 0
        self.since_observed = 0  # rounds since the last drafted one: the envelope fades per round, drafted or not

    def inherit(self, other: "DraftGate") -> None:
        """Start from what a gate of the same policy at another batch size learned of the drafter: its survival (a
        property of the drafter and the requests, not of the batch) and the table's measured scale. Draft time
        and back-off stay this batch's own; a survival seen over min_evidence rounds there that cannot pay here
        waits the hopeless wait at once, as a live count new to a gate with that evidence does (_probe_interval),
        not after a whole back-off."""
        self.survival, self.gain, self.best = other.survival.copy(), other.gain.copy(), other.best.copy()
        self.observed, self.since_observed, self.scale = other.observed, other.since_observed, other.scale

    def _smooth(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.smoothing) * old + self.smoothing * new

    def step(self, tokens: int) -> float:
        return (1.0 if self.scale is None else self.scale) * step_seconds(self.sps, tokens)

    def width(self, live: int, rows: int | None = None) -> int:
        """Rows a verifier step computes: all `rows` of the round (default: the batch; padded layout) or the live
        requests (flat)."""
        return (rows or self.batch) if self.layout == PADDED else live

    def rates(self, live: int, gain: np.ndarray | None = None, rows: int | None = None) -> tuple[float, float]:
        """Expected committed tokens/s of (an autoregressive step, the best common verification length), with the
        expected accepted drafts `gain` (default: from the smoothed survival)."""
        gain = self.gain if gain is None else gain
        width = self.width(live, rows)
        ar = live / self.step(width)
        spec = max(live * (1 + gain[k]) / (self.draft_seconds + self.step(width * (1 + k)))
                   for k in range(len(gain)))
        return ar, spec

    def should_draft(self, live: np.ndarray) -> bool:
        """Before a round over len(live) rows (the slots it computes), `live` marking the requests that would draft."""
        n, rows = int(np.count_nonzero(live)), len(live)
        if self.draft_seconds is None or n == 0:
            draft = True  # nothing measured yet
        else:
            ar, spec = self.rates(n, rows=rows)
            probe = self.probes.get(n, self.base_probe)
            if spec >= ar:
                draft, self.probes[n] = True, self.base_probe
            elif self.skipped + 1 >= self._probe_interval(n, ar, probe, rows):  # probe: refresh the estimates
                draft, self.probes[n] = True, min(2 * probe, self.max_probe)
            else:
                draft = False
        self.skipped = 0 if draft else self.skipped + 1
        self.since_observed += 1
        return draft

    def _probe_interval(self, live: int, ar: float, probe: int, rows: int) -> int:
        """Rounds to skip before the next probe: the backed-off interval, or, once min_evidence drafted rounds have
        been seen (at any number of live requests: the survival is the drafter's, not the batch's) and even the
        best survival seen lately could not pay at this batch, hopeless_probe times how many times slower than AR
        that best would commit (up to hopeless_factor): a drafter that would have to double its acceptance to pay
        is probed half as often. A few drafted rounds are no evidence that drafting cannot pay (a request's first
        also consumes its whole prompt). Evidence is not asked to wait for this count's own back-off: under a
        closed loop the number of live requests keeps changing, and each new count would back off from `probe`
        rounds again."""
        evidence = self.observed >= self.min_evidence  # not on a few rounds' word
        if self.skipped + 1 >= probe and evidence:
            faded = np.cumsum(self.best * self.envelope_decay ** self.since_observed)
            best = self.rates(live, np.concatenate(([0.0], faded)), rows)[1]
            if best < ar:
                wait = self.hopeless_probe * int(min(self.hopeless_factor, max(1.0, ar / max(best, 1e-12))))
                return max(wait, min(self.max_hopeless, self._budgeted_wait(live, rows)))
        return probe

    def _budgeted_wait(self, live: int, rows: int) -> int:
        """Rounds between probes that keep the cheapest probe's loss against plain steps within probe_budget."""
        if self.probe_budget is None:
            return 0
        width = self.width(live, rows)
        plain = self.step(width)
        loss = min(self.draft_seconds + self.step(width * (1 + k)) - (1 + self.gain[k]) * plain
                   for k in range(1, len(self.gain)))
        return int(np.ceil(max(loss, 0.0) / (self.probe_budget * plain)))

    def observe(self, survival: np.ndarray, live: np.ndarray, seconds: float) -> None:
        """After a drafted round: its survival [B, Bk] and what drafting + heads took."""
        if np.any(live):
            self.observed += 1
            mean = survival[live].mean(axis=0)
            first = self.draft_seconds is None
            self.survival = mean if first else (1 - self.smoothing) * self.survival + self.smoothing * mean
            np.cumsum(self.survival, out=self.gain[1:])
            # of the smoothed survival: a max over single rounds (one request's luck at concurrency 1) would
            # keep a batch of 8 probing long after its mean showed drafting cannot pay
            np.maximum(self.best * self.envelope_decay ** max(self.since_observed, 1), self.survival, out=self.best)
            self.since_observed = 0
        self.draft_seconds = self._smooth(self.draft_seconds, seconds)

    def observe_verify(self, tokens: int, seconds: float) -> None:
        """After any verifier step: its batch tokens (as the table counts them) and how long it took."""
        if not self.live_scale:
            return
        self.scale = self._smooth(self.scale, seconds / step_seconds(self.sps, tokens))


def new_gate(policy: VerifyPolicy, sps_table: list[float] | None, block_size: int, batch: int) -> DraftGate | None:
    """A fresh gate for a decode with this policy, or None where the policy does not gate."""
    if policy.is_ar or not policy.gate:
        return None
    return DraftGate(policy.sps_table(sps_table), block_size, batch, policy.layout)


class GateMemory:
    """The draft gates of one loaded bundle between decodes, one per (policy, batch, greedy or not): a decode takes
    its gate out (so two decodes running at once never share one; the second gets a fresh gate) and gives it back
    when it ends. A decode abandoned half-way keeps its gate; the next starts afresh. A fresh gate inherits the
    survival a kept gate of the same policy learned at another batch size."""

    def __init__(self):
        self._kept: dict[tuple, DraftGate] = {}
        self._lock = threading.Lock()

    @staticmethod
    def key(policy: VerifyPolicy, batch: int, greedy: bool) -> tuple:
        return str(policy), None if policy.sps is None else np.asarray(policy.sps).tobytes(), batch, greedy

    def take(self, key: tuple, fresh: Callable[[], DraftGate]) -> DraftGate:
        with self._lock:
            gate = self._kept.pop(key, None)
        if gate is not None:
            return gate
        gate = fresh()
        with self._lock:  # a kept gate is in no decode's hands; the lock keeps it there while it is read
            others = [g for k, g in self._kept.items() if k[:2] == key[:2] and k[3] == key[3]]
            if others:
                gate.inherit(max(others, key=lambda g: g.observed))
        return gate

    def give_back(self, key: tuple, gate: DraftGate) -> None:
        with self._lock:
            self._kept[key] = gate
