"""The DSpark decode loop over a bundle's graphs (numpy only), with continuous batching.

The batch is a fixed set of slots. A request is prefilled into a free slot (a batch-1 verifier call on that
slot's cache views) and decodes until it stops; its slot then takes the next queued request, while the other
slots keep decoding. Each round mirrors dspark.models.reference step for step, and noise is per request
(dspark.noise), so the tokens a request gets do not depend on the other requests in flight. (With the draft
gate on, which rounds draft depends on the batch and on timing: greedy tokens stay the same, sampled ones are
then reproducible in distribution only.)
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from dspark.bundle import Manifest
from dspark.errors import DSparkError
from dspark.noise import RequestNoise, stack
from dspark.runtime.gate import DraftGate
from dspark.runtime.scheduler import RoundPlanner, VerifyPolicy


@dataclass
class RequestResult:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    rounds: int = 0
    accepted: list[int] = field(default_factory=list)  # accepted drafts per round
    proposed: list[int] = field(default_factory=list)  # drafts verified per round
    committed: list[int] = field(default_factory=list)  # tokens committed per round (its tau)
    stopped: bool = False
    done: bool = False
    started: float = 0.0
    seconds: float = 0.0
    taps: list = field(default_factory=list, repr=False)  # target features per position (record_taps=True)

    @property
    def tau(self) -> float:
        return float(np.mean(self.committed)) if self.committed else 0.0

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.seconds if self.seconds > 0 else 0.0


@dataclass
class StepTimes:
    """Seconds per stage over a whole decode; host = everything outside the graphs."""

    draft: float = 0.0
    heads: float = 0.0
    verify: float = 0.0
    prefill: float = 0.0
    total: float = 0.0
    rounds: int = 0
    drafted: int = 0  # rounds that ran the draft graphs
    round_tokens: list[int] = field(default_factory=list)  # verifier positions (batch x T) per round
    round_useful: list[int] = field(default_factory=list)  # of those, positions of live requests' anchor + drafts

    @property
    def host(self) -> float:
        return self.total - self.draft - self.heads - self.verify - self.prefill

    def as_dict(self) -> dict:
        return {"draft_s": self.draft, "heads_s": self.heads, "verify_s": self.verify, "prefill_s": self.prefill,
                "host_s": self.host, "total_s": self.total, "rounds": self.rounds, "drafted_rounds": self.drafted}


@dataclass
class Event:
    """Tokens committed for one request in one step."""

    request: int
    token_ids: list[int]
    done: bool


class Decoder:
    """Decodes `prompts` through `batch_size` slots; iterate it for Events, then read `results` and `times`."""

    def __init__(self, backend, manifest: Manifest, prompts: list[list[int]], max_new_tokens: int,
                 temperature: float = 0.0, seed: int = 0, threshold: float = 0.0, ar: bool = False,
                 batch_size: int | None = None, capacity: int | None = None, record_taps: bool = False,
                 record_confidence: bool = False, policy: VerifyPolicy | None = None,
                 request_ids: list[int] | None = None):
        if not prompts:
            raise DSparkError("no prompts given")
        if any(len(p) == 0 for p in prompts):
            raise DSparkError("empty prompt: give at least one token")
        if max_new_tokens < 1:
            raise DSparkError("max_new_tokens must be at least 1")
        self.backend, self.man = backend, manifest
        self.bk = manifest.block_size
        longest = max(map(len, prompts))
        fixed = backend.fixed_capacity  # engines built for one cache size (TensorRT)
        limit = min(manifest.max_context, fixed or manifest.max_context)
        need = longest + max_new_tokens + self.bk + 1
        if longest + self.bk + 2 > limit:
            raise DSparkError(f"prompt of {longest} tokens is too long for the bundle's max context {limit}")
        self.capacity = fixed or capacity or min(need, limit)
        b = min(batch_size or len(prompts), len(prompts), backend.max_batch or len(prompts))
        t, d = manifest.target, manifest.draft
        # the backend decides where caches live (host numpy for ONNX Runtime, device memory for TensorRT)
        self.kv = backend.kv_cache(t["num_layers"], b, t["num_kv_heads"], self.capacity, t["head_dim"], "target")
        self.dkv = backend.kv_cache(d["num_layers"], b, d["num_kv_heads"], self.capacity, d["head_dim"], "draft",
                                    prefix="draft_past")
        self.prompts = prompts
        self.max_new = max_new_tokens
        self.ar = ar
        self.record_taps = record_taps
        self.record_confidence = record_confidence
        self.confidence_log: list[tuple[np.ndarray, int, int]] = []  # (conf logits [Bk], verified, accepted)
        self.seed = seed
        self.request_ids = request_ids or list(range(len(prompts)))  # noise identity (a request's tokens don't
        # depend on which decoder or slot serves it)
        self.temperature = np.full(b, temperature, dtype=np.float32)
        self.policy = policy or VerifyPolicy("static" if threshold > 0 else "all", threshold=threshold)
        self.planner = RoundPlanner(self.policy, b, manifest.calibration.get("sps_table"))
        self.gate = None if ar or not self.policy.gate else DraftGate(
            self.policy.sps_table(manifest.calibration.get("sps_table")), self.bk, b, self.policy.layout)
        self.verify_budget: list[int] = []  # drafts verified per round, summed over requests
        self.conf_temps = np.asarray(manifest.sts_temperatures, dtype=np.float32)
        self.stop_ids = set(manifest.stop_token_ids)
        self.results = [RequestResult(prompt_ids=list(p)) for p in prompts]
        self.times = StepTimes()
        self.queue = deque(range(len(prompts)))
        self.slot_req = [-1] * b  # request index held by each slot, -1 = free
        self.noise: list[RequestNoise | None] = [None] * b
        self.anchor = np.zeros(b, dtype=np.int64)
        self._conf: np.ndarray | None = None
        taps = manifest.graphs["verifier"].outputs[2].shape[-1]
        self.ctx = backend.context_rows(b, taps)  # target features the draft has not seen
        self._no_drafts = backend.zeros((b, 1, t["vocab_size"]), dtype=np.float32)
        self._zero = np.zeros(b, dtype=np.int64)
        self._no_draft_ids = np.zeros((b, 1), dtype=np.int64)

    @property
    def batch(self) -> int:
        return len(self.slot_req)

    # -- graph calls ------------------------------------------------------------------------------------------

    def _verify(self, feeds_kv: dict, mask: np.ndarray, tokens, logit_index, verify_len, temperature, accept,
                sample, draft_probs):
        out = self.backend.verifier.run({
            "tokens": tokens, "past_mask": mask, "logit_index": logit_index, "verify_len": verify_len,
            "temperature": temperature, "accept_noise": accept, "sample_noise": sample, "draft_probs": draft_probs,
            **feeds_kv,
        })
        return out["accepted"].numpy(), out["next_token"].numpy(), self._state(out["taps"]), self._state(out["new_kv"])

    def _state(self, x):
        """A graph output the caches take: kept where it is on a device backend, else as a host array."""
        return x if self.backend.device_resident else x.numpy()

    @staticmethod
    def _host(x) -> np.ndarray:
        return x if isinstance(x, np.ndarray) else x.numpy()

    def _admit(self, slots: list[int], reqs: list[int]) -> list[Event]:
        """Prefill requests into free slots with one verifier call. A prefill has no past, so it runs against an
        empty dummy cache and its K/V are written into each slot's cache afterwards."""
        prompts = [self.prompts[r] for r in reqs]
        lengths = np.array([len(p) for p in prompts], dtype=np.int64)
        tokens = np.zeros((len(reqs), int(lengths.max())), dtype=np.int64)
        for i, p in enumerate(prompts):
            tokens[i, :len(p)] = p
        for slot, req in zip(slots, reqs):
            self.slot_req[slot] = req
            self.noise[slot] = RequestNoise(self.seed, self.request_ids[req])
            self.kv.commit(slot, 0)
            self.dkv.commit(slot, 0)
            self.kv.check_room(slot, tokens.shape[1])
            self.results[req].started = time.perf_counter()
        n = len(reqs)
        src = [self.noise[s] for s in slots]
        t0 = time.perf_counter()
        _, first, taps, new_kv = self._verify(
            *self.kv.prefill_feeds(n), tokens, (lengths - 1)[:, None], self._zero[:n], self.temperature[:n],
            stack(src, 1), stack(src, 1)[:, 0], self._no_drafts[:n])
        self.times.prefill += time.perf_counter() - t0
        events = []
        for i, (slot, req) in enumerate(zip(slots, reqs)):
            count = int(lengths[i])
            self.kv.write(new_kv, i, count, slot=slot)
            self.kv.commit(slot, count)
            if self.record_taps:
                self.results[req].taps.append(self._host(taps)[i, :count].astype(np.float16))
            self.ctx.put(slot, taps, i, count)
            self.anchor[slot] = first[i]
            events.append(Event(req, self._take(slot, [int(first[i])]), self.results[req].done))
        return events

    def _draft(self, live: np.ndarray):
        t0 = time.perf_counter()
        out = self.backend.draft.run({"ctx_features": self.ctx.feed(), "ctx_count": self.ctx.count,
                                      "anchor": self.anchor, "past_mask": self.dkv.past_mask(), **self.dkv.feeds})
        new_kv = self._state(out["new_draft_kv"])
        t1 = time.perf_counter()
        for slot in np.flatnonzero(self.ctx.count):
            count = int(self.ctx.count[slot])
            self.dkv.check_room(slot, count)
            self.dkv.write(new_kv, slot, count)
            self.dkv.commit(slot, int(self.dkv.lengths[slot]) + count)
        self.ctx.count[:] = 0  # consumed
        noises = [src if alive else None for src, alive in zip(self.noise, live)]
        heads = self.backend.heads.run({"hidden": out["hidden"], "anchor": self.anchor,
                                        "temperature": self.temperature, "draft_noise": stack(noises, self.bk),
                                        "conf_temperatures": self.conf_temps, **self.planner.feeds(live)})
        t2 = time.perf_counter()
        self.times.draft += t1 - t0
        self.times.heads += t2 - t1
        self.times.drafted += 1
        self._conf = heads["conf_logits"].numpy() if self.record_confidence else None
        survival = heads["survival"].numpy()
        if self.gate is not None:
            self.gate.observe(survival, live, t2 - t0)
        verify_len = self.planner.after(survival, live, heads["verify_len"].numpy())
        return heads["draft_tokens"].numpy(), heads["draft_probs"], verify_len

    # -- bookkeeping ------------------------------------------------------------------------------------------

    def _take(self, slot: int, tokens: list[int]) -> list[int]:
        """Append tokens to the slot's request up to a stop token or max_new_tokens; returns what was appended."""
        res = self.results[self.slot_req[slot]]
        out = []
        for tok in tokens:
            out.append(tok)
            if tok in self.stop_ids:
                res.stopped = res.done = True
                break
            if len(res.token_ids) + len(out) >= self.max_new:
                res.done = True
                break
        res.token_ids += out
        if res.done:
            res.seconds = time.perf_counter() - res.started
        return out

    def _fill_free_slots(self, max_prefill_tokens: int = 8192) -> Iterator[Event]:
        """Admit queued requests into free slots (prefilled together, in chunks of at most max_prefill_tokens)."""
        while True:
            free = [s for s in range(self.batch) if self.slot_req[s] < 0 or self.results[self.slot_req[s]].done]
            if not free or not self.queue:
                break
            slots, reqs, longest = [], [], 0
            while free and self.queue:
                nxt = len(self.prompts[self.queue[0]])
                if reqs and max(longest, nxt) * (len(reqs) + 1) > max_prefill_tokens:
                    break
                longest = max(longest, nxt)
                slots.append(free.pop(0))
                reqs.append(self.queue.popleft())
            yield from self._admit(slots, reqs)  # a request may finish at once (stop token): loop again
        for slot in range(self.batch):
            if self.slot_req[slot] >= 0 and self.results[self.slot_req[slot]].done:
                self.slot_req[slot] = -1
                self.noise[slot] = None
                self.ctx.count[slot] = 0

    # -- loop -------------------------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Event]:
        start = time.perf_counter()
        b = self.batch
        yield from self._fill_free_slots()
        while any(r >= 0 for r in self.slot_req):
            live = np.array([r >= 0 for r in self.slot_req])
            noises = [src if alive else None for src, alive in zip(self.noise, live)]
            plain = self.ar or (self.gate is not None and not self.gate.should_draft(live))
            if plain:  # one verifier position per request: autoregressive decoding
                verify_len, drafts, t, draft_probs = self._zero, self._no_draft_ids, 1, self._no_drafts
                tokens = self.anchor[:, None]
                if not self.ar:
                    self.verify_budget.append(0)
            else:
                drafts, draft_probs, verify_len = self._draft(live)
                verify_len = np.where(live, verify_len, 0)
                self.verify_budget.append(int(verify_len.sum()))
                t = 1 + int(verify_len.max())
                tokens = np.concatenate([self.anchor[:, None], drafts[:, :t - 1]], axis=1)
            logit_index = np.broadcast_to(np.arange(t, dtype=np.int64), (b, t)).copy()
            accept = stack(noises, 1 if plain else self.bk + 1)[:, :t]
            t0 = time.perf_counter()
            accepted, nxt, taps, new_kv = self._verify(self.kv.feeds, self.kv.past_mask(), tokens, logit_index,
                                                       verify_len, self.temperature, accept, stack(noises, 1)[:, 0],
                                                       draft_probs)
            elapsed = time.perf_counter() - t0
            self.times.verify += elapsed
            if self.gate is not None:
                self.gate.observe_verify(b * t, elapsed)  # the positions this step computed
            self.times.rounds += 1
            self.times.round_tokens.append(b * t)
            self.times.round_useful.append(int(np.count_nonzero(live) + verify_len.sum()))  # dead slots verify 0
            host_taps = self._host(taps) if self.record_taps else None
            for slot in np.flatnonzero(live):
                res, a = self.results[self.slot_req[slot]], int(accepted[slot])
                self.kv.check_room(slot, t)
                self.kv.write(new_kv, slot, t)
                res.rounds += 1
                res.proposed.append(int(verify_len[slot]))
                commit = [int(x) for x in drafts[slot, :a]] + [int(nxt[slot])]
                stop_at = next((j for j, tok in enumerate(commit[:a]) if tok in self.stop_ids), None)
                if stop_at is not None:  # accepted drafts hold a stop token: cut there, no bonus token
                    commit = commit[:stop_at + 1]
                res.accepted.append(min(a, len(commit)))
                res.committed.append(len(commit))
                if self._conf is not None:
                    self.confidence_log.append((self._conf[slot].copy(), int(verify_len[slot]), res.accepted[-1]))
                if self.record_taps:  # the anchor and accepted drafts were processed, whatever comes next
                    res.taps.append(host_taps[slot, :a + 1].astype(np.float16))
                yield Event(self.slot_req[slot], self._take(slot, commit), res.done)
                if not res.done:
                    self.kv.commit(slot, int(self.kv.lengths[slot]) + a + 1)
                    if not self.ar:
                        self.ctx.put(slot, taps, slot, a + 1, append=True)
                    self.anchor[slot] = nxt[slot]
            yield from self._fill_free_slots()
        self.times.total = time.perf_counter() - start
