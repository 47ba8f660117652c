"""The DSpark decode loop over a bundle's graphs (numpy only), with continuous batching.

The batch is a fixed set of slots. A request is prefilled into a free slot (a batch-1 verifier call on that
slot's cache views) and decodes until it stops; its slot then takes the next queued request, while the other
slots keep decoding. Each round mirrors dspark.models.reference step for step, and noise is per request
(dspark.noise), so the tokens a request gets do not depend on the other requests in flight. (With the draft
gate on, which rounds draft depends on the batch and on timing, and a round is a plain verifier step for all
slots while any of them is within a block of the context's end: greedy tokens stay the same, sampled ones are
then reproducible in distribution only.)
"""
from __future__ import annotations

import time
from collections import deque
from typing import Iterator

import numpy as np

from dspark.bundle import Manifest
from dspark.errors import DSparkError
from dspark.noise import GREEDY_EPS, RequestNoise, stack
from dspark.runtime.backend import Backend
from dspark.runtime.gate import DraftGate, GateMemory
from dspark.runtime.options import DecodeOptions
from dspark.runtime.results import Event, RequestResult, StepTimes
from dspark.runtime.scheduler import RoundPlanner


class Decoder:
    """Decodes `prompts` (token ids) through `options.batch_size` slots; iterate it for Events, then read `results`
    and `times`. `request_ids` name the requests for their noise (default 0..n-1): a request's tokens do not depend
    on which decoder or slot serves it."""

    def __init__(self, backend: Backend, manifest: Manifest, prompts: list[list[int]],
                 options: DecodeOptions = DecodeOptions(), request_ids: list[int] | None = None,
                 capacity: int | None = None, gates: GateMemory | None = None):
        if not prompts:
            raise DSparkError("no prompts given")
        if any(len(p) == 0 for p in prompts):
            raise DSparkError("empty prompt: give at least one token")
        self.backend, self.manifest, self.options = backend, manifest, options
        self.block_size = manifest.block_size
        self.ar = options.ar
        refused = self._refuse_overflowing(prompts)
        self.capacity = self._capacity(max(len(p) for i, p in enumerate(prompts) if i not in refused), capacity)
        b = min(options.batch_size or len(prompts), len(prompts), backend.max_batch or len(prompts))
        t, d = manifest.target, manifest.draft
        # the backend decides where caches live (host numpy for ONNX Runtime, device memory for TensorRT)
        self.kv = backend.kv_cache(t["num_layers"], b, t["num_kv_heads"], self.capacity, t["head_dim"], "target")
        self.draft_kv = backend.kv_cache(d["num_layers"], b, d["num_kv_heads"], self.capacity, d["head_dim"],
                                         "draft", prefix="draft_past")
        self.prompts = prompts
        self.confidence_log: list[tuple[np.ndarray, int, int]] = []  # (conf logits [Bk], verified, accepted)
        self.request_ids = request_ids or list(range(len(prompts)))
        self.temperature = np.full(b, options.temperature, dtype=np.float32)
        self.policy = options.policy
        sps_table = manifest.calibration.get("sps_table")
        self.planner = RoundPlanner(self.policy, b, sps_table)
        self.gates, self._gate_key = gates, GateMemory.key(self.policy, b, options.temperature == 0)

        def fresh() -> DraftGate:
            return DraftGate(self.policy.sps_table(sps_table), self.block_size, b, self.policy.layout)
        self.gate = None if self.ar or not self.policy.gate else gates.take(self._gate_key, fresh) if gates else fresh()
        self.verify_budget: list[int] = []  # drafts verified per round, summed over requests
        self.conf_temps = np.asarray(manifest.sts_temperatures, dtype=np.float32)
        self.stop_ids = set(manifest.stop_token_ids)
        self.results = [RequestResult(prompt_ids=list(p)) for p in prompts]
        for i, why in refused.items():
            self.results[i].error, self.results[i].done = why, True
        self.times = StepTimes()
        self.queue = deque(i for i in range(len(prompts)) if i not in refused)
        self.slot_req = [-1] * b  # request index held by each slot, -1 = free
        self.noise: list[RequestNoise | None] = [None] * b
        self.anchor = np.zeros(b, dtype=np.int64)
        self._conf: np.ndarray | None = None
        self.ctx = backend.context_rows(b, manifest.graphs["verifier"].outputs[2].shape[-1])  # taps not drafted on
        self._no_drafts = backend.zeros((b, 1, t["vocab_size"]), dtype=np.float32)
        self._zero = np.zeros(b, dtype=np.int64)
        self._no_draft_ids = np.zeros((b, 1), dtype=np.int64)

    @property
    def context_limit(self) -> int:
        fixed = self.backend.fixed_capacity  # engines built for one cache size (TensorRT)
        return min(self.manifest.max_context, fixed or self.manifest.max_context)

    def _refuse_overflowing(self, prompts: list[list[int]]) -> dict[int, str]:
        """Requests whose prompt + max_new_tokens cannot fit the context, with why; every other request is served
        (the last positions of a request near the limit are plain verifier steps). All refused: DSparkError."""
        limit, new = self.context_limit, self.options.max_new_tokens
        refused = {}
        for i, p in enumerate(prompts):
            if len(p) >= limit:
                refused[i] = (f"prompt of request {i} ({len(p)} tokens) is too long for the bundle's max context "
                              f"{limit}")
            elif len(p) + new > limit:
                refused[i] = (f"context overflow: request {i} needs {len(p)} prompt + {new} new tokens = "
                              f"{len(p) + new} positions, the bundle's max context is {limit}; shorten the prompt "
                              f"or max_new_tokens")
        if len(refused) == len(prompts):
            raise DSparkError(refused[0])
        return refused

    def _capacity(self, longest: int, capacity: int | None) -> int:
        return self.backend.fixed_capacity or capacity or min(
            longest + self.options.max_new_tokens + self.block_size + 1, self.context_limit)

    def _room_to_draft(self, live: np.ndarray) -> bool:
        """Whether every live slot can take a full drafted round (anchor + block); if not, the round is a plain
        verifier step, so a request that fits the context exactly is served to its last position."""
        return all(self.kv.room(int(slot)) >= self.block_size + 1 for slot in np.flatnonzero(live))

    def _run(self, graph: str, feeds: dict) -> dict:
        """One graph call; an engine's run-time failure (bad values, out of memory) becomes one DSparkError line."""
        try:
            return getattr(self.backend, graph).run(feeds)
        except DSparkError:
            raise
        except Exception as e:  # onnxruntime / TensorRT raise their own exception types
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise DSparkError(f"the {graph} graph failed at run time: {first[:300]}") from None

    @property
    def batch(self) -> int:
        return len(self.slot_req)

    # -- graph calls ------------------------------------------------------------------------------------------

    def _verify(self, feeds_kv: dict, mask: np.ndarray, tokens, logit_index, verify_len, temperature, accept,
                sample, draft_probs):
        out = self._run("verifier", {
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
            self._open_slot(slot, req)
            self.kv.commit(slot, 0)
            self.draft_kv.commit(slot, 0)
            self.kv.check_room(slot, tokens.shape[1], request=self.request_ids[req])
            self.results[req].started = time.perf_counter()
        n = len(reqs)
        src = [self.noise[s] for s in slots]
        t0 = time.perf_counter()
        _, first, taps, new_kv = self._verify(
            *self.kv.prefill_feeds(n), tokens, (lengths - 1)[:, None], self._zero[:n], self.temperature[slots],
            stack(src, 1), stack(src, 1)[:, 0], self._no_drafts[:n])
        self.times.prefill += time.perf_counter() - t0
        events = []
        for i, (slot, req) in enumerate(zip(slots, reqs)):
            count = int(lengths[i])
            self.kv.write(new_kv, i, count, slot=slot)
            self.kv.commit(slot, count)
            if self.options.record_taps:
                self.results[req].taps.append(self._host(taps)[i, :count].astype(np.float16))
            self.ctx.put(slot, taps, i, count)
            self.anchor[slot] = first[i]
            events.append(Event(req, self._take(slot, [int(first[i])]), self.results[req].done))
        return events

    def _open_slot(self, slot: int, req: int) -> None:
        """Per-request state of a slot taking a request (dspark.runtime.engine adds per-request options)."""
        self.noise[slot] = RequestNoise(self.options.seed, self.request_ids[req])

    def _max_new_tokens(self, req: int) -> int:
        return self.options.max_new_tokens

    def _draft(self, live: np.ndarray):
        t0 = time.perf_counter()
        out = self._run("draft", {"ctx_features": self.ctx.feed(), "ctx_count": self.ctx.count,
                                      "anchor": self.anchor, "past_mask": self.draft_kv.past_mask(),
                                      **self.draft_kv.feeds})
        new_kv = self._state(out["new_draft_kv"])
        t1 = time.perf_counter()
        for slot, count in ((s, int(self.ctx.count[s])) for s in np.flatnonzero(self.ctx.count)):
            self.draft_kv.check_room(slot, count, request=self.request_ids[self.slot_req[slot]])
            self.draft_kv.write(new_kv, slot, count)
            self.draft_kv.commit(slot, int(self.draft_kv.lengths[slot]) + count)
        self.ctx.count[:] = 0  # consumed
        noise = stack([src if alive else None for src, alive in zip(self.noise, live)], self.block_size)  # drawn
        feeds = {"hidden": out["hidden"], "anchor": self.anchor, "conf_temperatures": self.conf_temps,  # always
                 **self.options.heads_feeds(self.planner.feeds(live))}
        # all greedy: no sampling machinery, and the verifier takes zero draft probabilities (the same decisions)
        greedy = self.backend.heads_greedy is not None and not np.any(self.temperature[live] >= GREEDY_EPS)
        heads = self._run("heads_greedy", feeds) if greedy else self._run(
            "heads", {**feeds, "temperature": self.temperature, "draft_noise": noise})
        t2 = time.perf_counter()
        self.times.draft += t1 - t0
        self.times.heads += t2 - t1
        self.times.drafted += 1
        self._conf = heads["conf_logits"].numpy() if self.options.record_confidence else None
        survival = heads["survival"].numpy()
        if self.gate is not None:
            self.gate.observe(survival, live, t2 - t0)
        verify_len = self.options.cut(survival, self.planner.after(survival, live, heads["verify_len"].numpy()))
        return heads["draft_tokens"].numpy(), self._no_drafts if greedy else heads["draft_probs"], verify_len

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
            if len(res.token_ids) + len(out) >= self._max_new_tokens(self.slot_req[slot]):
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
    #
    # One round, for every live slot at once:
    #   1. plan:    draft or not (AR mode, or the draft gate skipping a round that cannot pay)
    #   2. draft:   draft.onnx consumes the target features the draft has not seen and returns its hidden states;
    #               heads.onnx runs the Markov head (block of draft tokens + their probabilities), the confidence
    #               head (calibrated prefix survival) and dspark::ConfidenceTruncate (how many drafts to verify)
    #   3. verify:  verifier.onnx runs the anchor + the verified drafts against the target KV cache. The acceptance
    #               rule (greedy match, or lossless rejection sampling against the draft probabilities) and the
    #               bonus/next token live INSIDE the verifier graph (dspark.export.graphs): the host only reads
    #               how many drafts were accepted and the next token.
    #   4. commit:  per slot, append the accepted drafts + next token (cut at a stop token), write the new K/V and
    #               target features after the valid prefix, and roll back the rest by a length change (O(1)).
    #   5. refill:  slots whose request finished take the next queued request (prefilled together).

    def __iter__(self) -> Iterator[Event]:
        start = time.perf_counter()
        yield from self._fill_free_slots()
        while any(r >= 0 for r in self.slot_req):
            yield from self._round()
            yield from self._fill_free_slots()
        self.times.total = time.perf_counter() - start
        if self.gates is not None and self.gate is not None:
            self.gates.give_back(self._gate_key, self.gate)

    def _round(self) -> Iterator[Event]:
        """Steps 1-4 for every live slot (the serving engine calls it between its own admissions)."""
        live = np.array([r >= 0 for r in self.slot_req])
        noises = [src if alive else None for src, alive in zip(self.noise, live)]
        plain = self.ar or not self._room_to_draft(live) or (self.gate is not None
                                                             and not self.gate.should_draft(live))
        tokens, drafts, draft_probs, verify_len = self._plan(live, plain)
        accepted, nxt, taps, new_kv = self._verify_round(tokens, verify_len, draft_probs, noises, plain, live)
        host_taps = self._host(taps) if self.options.record_taps else None
        for slot in np.flatnonzero(live):
            yield self._commit(slot, int(accepted[slot]), drafts, int(nxt[slot]), int(verify_len[slot]),
                               tokens.shape[1], taps, new_kv, host_taps)

    def _plan(self, live: np.ndarray, plain: bool):
        """The round's verifier tokens [B, T] (anchor + drafts), drafts, draft probabilities and drafts to verify."""
        if plain:  # one verifier position per request: autoregressive decoding
            if not self.ar:
                self.verify_budget.append(0)
            return self.anchor[:, None], self._no_draft_ids, self._no_drafts, self._zero
        drafts, draft_probs, verify_len = self._draft(live)
        verify_len = np.where(live, verify_len, 0)
        self.verify_budget.append(int(verify_len.sum()))
        t = 1 + int(verify_len.max())
        return np.concatenate([self.anchor[:, None], drafts[:, :t - 1]], axis=1), drafts, draft_probs, verify_len

    def _verify_round(self, tokens: np.ndarray, verify_len: np.ndarray, draft_probs, noises: list, plain: bool,
                      live: np.ndarray):
        b, t = tokens.shape
        logit_index = np.broadcast_to(np.arange(t, dtype=np.int64), (b, t)).copy()
        accept = stack(noises, 1 if plain else self.block_size + 1)[:, :t]
        t0 = time.perf_counter()
        out = self._verify(self.kv.feeds, self.kv.past_mask(), tokens, logit_index, verify_len, self.temperature,
                           accept, stack(noises, 1)[:, 0], draft_probs)
        elapsed = time.perf_counter() - t0
        self.times.verify += elapsed
        if self.gate is not None:
            self.gate.observe_verify(b * t, elapsed)  # the positions this step computed
        self.times.rounds += 1
        self.times.round_tokens.append(b * t)
        self.times.round_useful.append(int(np.count_nonzero(live) + verify_len.sum()))  # dead slots verify 0
        return out

    def _commit(self, slot: int, accepted: int, drafts: np.ndarray, nxt: int, verified: int, t: int, taps, new_kv,
                host_taps) -> Event:
        """Commit one slot's round: accepted drafts + the verifier's next token, cut at a stop token."""
        req = self.slot_req[slot]
        res = self.results[req]
        self.kv.check_room(slot, t, request=self.request_ids[req])
        self.kv.write(new_kv, slot, t)
        res.rounds += 1
        res.proposed.append(verified)
        commit = [int(x) for x in drafts[slot, :accepted]] + [nxt]
        stop_at = next((j for j, tok in enumerate(commit[:accepted]) if tok in self.stop_ids), None)
        if stop_at is not None:  # accepted drafts hold a stop token: cut there, no bonus token
            commit = commit[:stop_at + 1]
        res.accepted.append(min(accepted, len(commit)))
        res.committed.append(len(commit))
        if self._conf is not None:
            self.confidence_log.append((self._conf[slot].copy(), verified, res.accepted[-1]))
        if self.options.record_taps:  # the anchor and accepted drafts were processed, whatever comes next
            res.taps.append(host_taps[slot, :accepted + 1].astype(np.float16))
        event = Event(req, self._take(slot, commit), res.done)
        if not res.done:
            self.kv.commit(slot, int(self.kv.lengths[slot]) + accepted + 1)
            if not self.ar:
                self.ctx.put(slot, taps, slot, accepted + 1, append=True)
            self.anchor[slot] = nxt
        return event
