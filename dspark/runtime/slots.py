"""The slot machine: a fixed set of batch slots, their caches, and the DSpark round over the live ones.

Every decode in dspark runs here. `Decoder` (a batch of prompts) adds every request and steps until none is
left; `Engine` (the always-on server loop) adds requests as they arrive and steps forever. A request queues
until a slot frees up, is prefilled into it (a verifier call on an empty cache, its K/V written into the slot's
cache), then decodes round by round until a stop token, its max_tokens or a cancel; its slot then takes the next
queued request while the other slots go on. Each round mirrors dspark.models.reference step for step:

    1. plan:    draft or not (policy "ar", the draft gate, no room left for a block, only "ar" requests live)
    2. draft:   draft.onnx consumes the target features the draft has not seen; heads.onnx runs the Markov head
                (a block of draft tokens + their probabilities), the confidence head (calibrated prefix survival)
                and dspark::ConfidenceTruncate; the RoundPlanner turns that into drafts verified per request
    3. verify:  verifier.onnx runs each anchor + its verified drafts against the target cache; acceptance (greedy
                match, or lossless rejection sampling) and the next token are computed inside the graph (for
                requests with top_k, top_p, penalties...: by sampler.onnx on its logits, dspark.runtime.sampling)
    4. commit:  per request, the accepted drafts + next token (cut at a stop token; their log-probabilities where
                asked, dspark.runtime.logprobs), K/V and target features kept after the valid prefix, the rest
                rolled back by a length change (O(1))

Noise is per request (dspark.noise), so a request's tokens do not depend on the other requests in flight.

On host backends (ONNX Runtime) a round computes the leading rows that hold live requests (kept there: one leaving
a slot below a live one has that one moved down) through `Rows`, views of the first n slots, over caches as wide as
the longest live request (HostKV.fit). Device backends (TensorRT) compute every slot each round.
"""
from __future__ import annotations

import time
from collections import deque

import numpy as np

from dspark.bundle import Manifest
from dspark.kv_layout import kv_groups, kv_output_names
from dspark.noise import GREEDY_EPS, PlainStepNoise, RequestNoise, stack
from dspark.runtime.backend import Backend, host
from dspark.runtime.gate import DraftGate
from dspark.runtime.kv import HostKV, HostRows, move_kv, move_rows
from dspark.runtime.observers import CONFIDENCE, TAPS, PrefillRecord, RoundObserver, RoundRecord
from dspark.runtime.grammar import GrammarRows
from dspark.runtime.logprobs import StepLogprobs, check_logprobs
from dspark.runtime.results import Event
from dspark.runtime.rows import Rows
from dspark.runtime.sampling import SamplingRows, check_sampling, runs_sampler
from dspark.runtime.slot_request import Slot, SlotRequest, choices_queued
from dspark.runtime.step_graphs import StepGraphs, Verified
from dspark.runtime.scheduler import RoundPlanner, VerifyPolicy


class Slots:
    def __init__(self, backend: Backend, manifest: Manifest, policy: VerifyPolicy, batch: int, capacity: int,
                 gate: DraftGate | None = None, threshold_rule: str = "cumulative",
                 observers: tuple[RoundObserver, ...] = ()):
        self.backend, self.manifest, self.policy, self.capacity = backend, manifest, policy, capacity
        self.block_size = manifest.block_size
        t, d = manifest.target, manifest.draft
        # the backend decides where caches live (host numpy for ONNX Runtime, device memory for TensorRT)
        self.kv = backend.grouped_kv_cache(kv_groups(t), batch, capacity, "target")  # (one group: uniform)
        self.draft_kv = backend.kv_cache(d["num_layers"], batch, d["num_kv_heads"], capacity, d["head_dim"],
                                         "draft", prefix="draft_past")
        self.ctx = backend.context_rows(batch, manifest.tap_features)
        self.slots = [Slot() for _ in range(batch)]
        self.queue: deque[SlotRequest] = deque()
        self.temperature = np.zeros(batch, dtype=np.float32)
        self.anchor = np.zeros(batch, dtype=np.int64)
        self.ar = np.zeros(batch, dtype=bool)  # "ar" requests: they never draft
        self.occupied = np.zeros(batch, dtype=bool)
        self.top_logprobs = np.full(batch, -1, dtype=np.int64)  # -1: no logprobs
        # top_k, top_p, min_p, penalties, logit_bias: only with a sampler graph (else rows of no vocabulary)
        self.sampling = SamplingRows(batch, t["vocab_size"] if backend.sampler is not None else 0)
        self.grammar = GrammarRows(batch, t["vocab_size"])  # response_format: per-slot matchers
        self.graphs = StepGraphs(backend, self.sampling, self.top_logprobs, self.grammar, kv_output_names(t))
        self.planner = RoundPlanner(policy, batch, manifest.calibration.get("sps_table"), threshold_rule,
                                    manifest.acceptance_prior())
        self.gate = gate
        self.conf_temps = np.asarray(manifest.sts_temperatures, dtype=np.float32)
        self.stop_ids = set(manifest.stop_token_ids)
        self.observers = list(observers)
        self._wants = set().union(*(o.wants for o in self.observers))
        # host state narrows to the live rows; a device backend's does not
        self.narrows = isinstance(self.kv, HostKV) and isinstance(self.draft_kv, HostKV) \
            and isinstance(self.ctx, HostRows)
        whole = Rows(batch, self.kv, self.draft_kv, self.ctx, self.temperature, self.anchor, self.ar, self.occupied,
                     self.top_logprobs, backend.zeros((batch, 1, t["vocab_size"]), dtype=np.float32),
                     np.zeros(batch, dtype=np.int64), np.zeros((batch, 1), dtype=np.int64))
        self._rows = {batch: whole}
        if self.narrows:
            self._rows.update({n: whole.leading(n) for n in range(1, batch)})
        # a host backend prefills each prompt alone: a batched prefill pads every prompt to the longest, and on CPU
        # that padding costs more than batching saves
        self.prefill_tokens = 1 if self.narrows else 8192

    # -- the client's side ------------------------------------------------------------------------------------

    @property
    def batch(self) -> int:
        return len(self.slots)

    def add(self, request: SlotRequest) -> None:
        """Queue a request; a step admits it when a slot is free."""
        self.check(request.sampling, request.temperature, request.logprobs, request.grammar is not None)
        self.queue.append(request)

    def check(self, sampling, temperature: float, logprobs: int | None, constrained: bool) -> None:
        """DSparkError unless the backend and bundle can decode a request so (constrained: under a grammar)."""
        check_sampling(self.sampling, sampling, self.backend.kind, constrained)
        if logprobs is not None:
            check_logprobs(self.backend, runs_sampler(sampling, temperature < GREEDY_EPS, constrained))

    def cancel(self, request: SlotRequest) -> None:
        """Stop a request: a queued one never runs, one in a slot leaves it at the next step."""
        if request in self.queue:
            self.queue.remove(request)
        request.result.done = True

    @property
    def live(self) -> int:
        """Slots holding a request."""
        return int(self.occupied.sum())

    @property
    def busy(self) -> bool:
        """Whether a step has anything to do."""
        return bool(self.queue) or bool(self.occupied.any())

    def free_slots(self) -> int:
        """Slots a newly added request could take at the next step (free or finishing, beyond the queue's)."""
        free = sum(1 for s in self.slots if s.request is None or s.request.result.done)
        return free - len(self.queue)

    def kv_used(self) -> int:
        """Target cache positions held by live requests."""
        return int(self.kv.lengths[self.occupied].sum())

    def step(self) -> list:
        """admit, then round: the Events of one round boundary and the round after it."""
        return self.admit() + self.round()

    def round(self) -> list:
        """One round over the live rows (none live: nothing); finished requests leave their slots after it.
        Returns the Events: tokens committed per request."""
        if not self.occupied.any():
            return []
        n = 1 + int(np.flatnonzero(self.occupied)[-1]) if self.narrows else self.batch
        events = self._round(self._rows[n])
        self._release()
        return events

    # -- admissions -------------------------------------------------------------------------------------------

    def admit(self) -> list:
        """Free finished slots and prefill queued requests into free slots (together, at most prefill_tokens padded
        tokens a call). Returns the Events: each prefilled request's first token."""
        events = []
        while True:
            self._release()
            free = [i for i, s in enumerate(self.slots) if s.request is None]
            if not free or not self.queue:
                break
            group, longest = [], 0
            while len(group) < len(free) and self.queue:
                nxt, size = len(self.queue[0].prompt_ids), choices_queued(self.queue)  # a request's choices go together
                if len(group) + size > len(free) or (
                        group and max(longest, nxt) * (len(group) + 1) > self.prefill_tokens):
                    break
                longest = max(longest, nxt)
                group += [self.queue.popleft() for _ in range(size)]
            if not group:
                break
            events += self._prefill(free[:len(group)], group)  # a request may finish at once (a stop token)
        if self.narrows:
            self._compact()
        return events

    def _prefill(self, slots: list[int], requests: list[SlotRequest]) -> list:
        """One verifier call on an empty dummy cache; each prompt's K/V are then written into its slot's cache.
        The choices of one prompt (n > 1, host caches) prefill it but its last token once, in the first choice's
        slot; the others copy that cache, and every choice computes the last prompt token in its first round, with
        its own noise (its first token comes from that round)."""
        for slot, request in zip(slots, requests):
            self._open(slot, request)
        firsts = {id(r.shares_prompt_with) for r in requests if self.narrows and r.shares_prompt_with is not None}
        cut = {id(r): slot for slot, r in zip(slots, requests) if id(r) in firsts and len(r.prompt_ids) > 1}
        copies = [(slot, r) for slot, r in zip(slots, requests) if id(r.shares_prompt_with) in cut]
        slots, requests = zip(*[(slot, r) for slot, r in zip(slots, requests) if id(r.shares_prompt_with) not in cut])
        prompts = [r.prompt_ids[:-1] if id(r) in cut else r.prompt_ids for r in requests]
        lengths = np.array([len(p) for p in prompts], dtype=np.int64)
        tokens = np.zeros((len(requests), int(lengths.max())), dtype=np.int64)
        for i, (slot, prompt) in enumerate(zip(slots, prompts)):
            tokens[i, :lengths[i]] = prompt
            self.kv.check_room(slot, tokens.shape[1], request=requests[i].id)
        n, noises = len(requests), [self.slots[s].noise for s in slots]
        whole = self._rows[self.batch]
        t0 = time.perf_counter()
        step = self._verify(*self.kv.prefill_feeds(n), tokens, (lengths - 1)[:, None], whole.zero[:n],
                            self.temperature[list(slots)], stack(noises, 1), stack(noises, 1)[:, 0],
                            whole.no_drafts[:n], np.asarray(slots))
        seconds = time.perf_counter() - t0
        events = []
        for i, (slot, request) in enumerate(zip(slots, requests)):
            count = int(lengths[i])
            self.kv.write(step.new_kv, i, count, slot=slot)
            self.kv.commit(slot, count)
            if not request.ar:
                self.ctx.put(slot, step.taps, i, count)
            if id(request) in cut:  # its choices' first round computes the last prompt token
                self.anchor[slot] = request.prompt_ids[-1]
            else:
                self.anchor[slot] = step.next_token[i]
                events.append(self._dead_end(request) if i in step.dead_ends else
                              self._event(slot, request, [int(step.next_token[i])], step.logprobs, i))
        for slot, request in copies:
            move_kv(self.kv, cut[id(request.shares_prompt_with)], slot, keep=True)
            move_rows(self.ctx, cut[id(request.shares_prompt_with)], slot, keep=True)
            self.anchor[slot] = request.prompt_ids[-1]
        self._tell("prefilled", PrefillRecord(list(requests), lengths.tolist(), seconds,
                                              host(step.taps) if TAPS in self._wants else None))
        return events

    def _open(self, slot: int, request: SlotRequest) -> None:
        """A request takes a free slot: its per-slot state, an empty cache."""
        self.slots[slot] = Slot(request, (PlainStepNoise if request.ar else RequestNoise)(request.seed,
                                                                                          request.stream))
        self.temperature[slot], self.ar[slot], self.occupied[slot] = request.temperature, request.ar, True
        self.top_logprobs[slot] = -1 if request.logprobs is None else request.logprobs
        self.sampling.open(slot, request.sampling, request.prompt_ids, request.temperature < GREEDY_EPS,
                           request.grammar is not None)
        self.grammar.open(slot, request.grammar)
        self.kv.commit(slot, 0)
        self.draft_kv.commit(slot, 0)
        self.ctx.count[slot] = 0
        request.result.started = time.perf_counter()

    def _release(self) -> None:
        """Free the slots whose request is done (finished, stopped or cancelled)."""
        for i, s in enumerate(self.slots):
            if s.request is not None and s.request.result.done:
                self.slots[i] = Slot()
                self.occupied[i] = False
                self.ctx.count[i] = 0

    def _compact(self) -> None:
        """Move live requests down into free slots below them, so the live slots are the leading ones."""
        while True:
            live, holes = np.flatnonzero(self.occupied), np.flatnonzero(~self.occupied)
            if not len(live) or not len(holes) or holes[0] > live[-1]:
                return
            src, dst = int(live[-1]), int(holes[0])
            move_kv(self.kv, src, dst)
            move_kv(self.draft_kv, src, dst)
            move_rows(self.ctx, src, dst)
            for array in (self.temperature, self.anchor, self.ar, self.occupied, self.top_logprobs):
                array[dst] = array[src]
            self.sampling.move(src, dst)
            self.grammar.move(src, dst)
            self.occupied[src] = False
            self.slots[dst], self.slots[src] = self.slots[src], Slot()

    # -- one round --------------------------------------------------------------------------------------------

    def _round(self, rows: Rows) -> list:
        live = rows.occupied
        drafting = live & ~rows.ar
        noises = [s.noise for s in self.slots[:rows.n]]  # None for free rows: they draw nothing
        plain = self.policy.is_ar or not self._room_to_draft(live) or (
            self.gate is not None and not self.gate.should_draft(live)) or not drafting.any()
        record = RoundRecord(requests=[s.request for s in self.slots[:rows.n]], positions=1, drafted=not plain,
                             verify_len=rows.zero, accepted=rows.zero)
        if plain:  # one verifier position per request: autoregressive decoding
            tokens, drafts, draft_probs = rows.anchor[:, None], rows.no_draft_ids, rows.no_drafts
        else:
            drafts, draft_probs, record.verify_len = self._draft(rows, drafting, noises, record)
            t = 1 + int(record.verify_len.max())
            tokens = np.concatenate([rows.anchor[:, None], drafts[:, :t - 1]], axis=1)
        record.positions = tokens.shape[1]
        b, t = tokens.shape
        logit_index = np.broadcast_to(np.arange(t, dtype=np.int64), (b, t)).copy()
        accept = stack(noises, 1 if plain else self.block_size + 1)[:, :t]
        t0 = time.perf_counter()
        rows.kv.fit(t)
        step = self._verify(rows.kv.feeds, rows.kv.past_mask(), tokens, logit_index, record.verify_len,
                            rows.temperature, accept, stack(noises, 1)[:, 0], draft_probs, np.arange(b))
        record.verify_seconds = time.perf_counter() - t0
        if self.gate is not None:
            self.gate.observe_verify(b * t, record.verify_seconds)  # the positions this step computed
        record.accepted = step.accepted
        events = [self._dead_end(self.slots[slot].request) if slot in step.dead_ends else
                  self._commit(rows, int(slot), drafts, int(record.verify_len[slot]), t, step)
                  for slot in np.flatnonzero(live)]
        if TAPS in self._wants:
            record.taps = host(step.taps)
        self._tell("round", record)
        return events

    def _room_to_draft(self, live: np.ndarray) -> bool:
        """Whether every live slot can take a full drafted round (anchor + block); if not, the round is a plain
        verifier step, so a request that fits the context exactly is served to its last position."""
        return all(self.kv.room(int(slot)) >= self.block_size + 1 for slot in np.flatnonzero(live))

    def _draft(self, rows: Rows, drafting: np.ndarray, noises: list, record: RoundRecord):
        """Draft + heads for the drafting rows: (draft tokens, their probabilities, drafts to verify per row)."""
        t0 = time.perf_counter()
        rows.draft_kv.fit(0)  # narrowed when a long request left (a write widens it)
        out = self.graphs.run("draft", {"ctx_features": rows.ctx.feed(), "ctx_count": rows.ctx.count,
                                        "anchor": rows.anchor, "past_mask": rows.draft_kv.past_mask(),
                                        **rows.draft_kv.feeds})
        new_kv = self.graphs.state(out["new_draft_kv"])
        t1 = time.perf_counter()
        for slot in np.flatnonzero(rows.ctx.count):
            count = int(rows.ctx.count[slot])
            self.draft_kv.check_room(slot, count, request=self.slots[slot].request.id)
            self.draft_kv.write(new_kv, slot, count)
            self.draft_kv.commit(slot, int(self.draft_kv.lengths[slot]) + count)
        rows.ctx.count[:] = 0  # consumed
        noise = stack([src if on else None for src, on in zip(noises, drafting)], self.block_size)  # drawn
        feeds = {"hidden": out["hidden"], "anchor": rows.anchor, "conf_temperatures": self.conf_temps,
                 **self.planner.feeds(drafting)}
        # all greedy: no sampling machinery, and the verifier takes zero draft probabilities (the same decisions)
        greedy = self.backend.heads_greedy is not None and not np.any(rows.temperature[drafting] >= GREEDY_EPS)
        heads = self.graphs.run("heads_greedy", feeds) if greedy else self.graphs.run(
            "heads", {**feeds, "temperature": rows.temperature, "draft_noise": noise})
        t2 = time.perf_counter()
        record.draft_seconds, record.heads_seconds = t1 - t0, t2 - t1
        if CONFIDENCE in self._wants:
            record.conf_logits = heads["conf_logits"].numpy()
        survival = self.planner.survival(heads["survival"].numpy())
        if self.gate is not None:
            self.gate.observe(survival, drafting, t2 - t0)
        verify_len = self.planner.after(survival, drafting, heads["verify_len"].numpy())
        drafts = heads["draft_tokens"].numpy()
        for slot in np.flatnonzero(drafting):  # a constrained request verifies up to the first draft it refuses
            verify_len[slot] = self.grammar.verified(int(slot), drafts[slot], int(verify_len[slot]))
        return drafts, rows.no_drafts if greedy else heads["draft_probs"], verify_len

    def _commit(self, rows: Rows, slot: int, drafts: np.ndarray, verified: int, t: int, step: Verified) -> Event:
        """One slot's round: accepted drafts + the verifier's next token, cut at a stop token."""
        request = self.slots[slot].request
        res = request.result
        accepted, nxt = int(step.accepted[slot]), int(step.next_token[slot])
        self.kv.check_room(slot, t, request=request.id)
        self.kv.write(step.new_kv, slot, t)
        res.rounds += 1
        res.proposed.append(verified)
        commit = [int(x) for x in drafts[slot, :accepted]] + [nxt]
        stop_at = next((j for j, tok in enumerate(commit[:accepted]) if tok in self.stop_ids), None)
        if stop_at is not None:  # accepted drafts hold a stop token: cut there, no bonus token
            commit = commit[:stop_at + 1]
        res.accepted.append(min(accepted, len(commit)))
        res.committed.append(len(commit))
        event = self._event(slot, request, commit, step.logprobs, slot)
        if not res.done:
            self.kv.commit(slot, int(self.kv.lengths[slot]) + accepted + 1)
            if not rows.ar[slot]:
                rows.ctx.put(slot, step.taps, slot, accepted + 1, append=True)
            rows.anchor[slot] = nxt
        return event

    def _event(self, slot: int, request: SlotRequest, tokens: list[int], logprobs: StepLogprobs | None,
               row: int) -> Event:
        """Tokens committed to a request (row: its row of the step), with their log-probabilities where asked."""
        out, top = self._take(slot, request, tokens), int(self.top_logprobs[slot])
        self.grammar.advance(slot, out, self.stop_ids)
        entries = None if top < 0 or logprobs is None else logprobs.entries(row, out, top)
        request.result.logprobs += entries or []
        return Event(request.id, out, request.result.done, entries)

    @staticmethod
    def _dead_end(request: SlotRequest) -> Event:
        """A constrained request whose grammar allows no token: it ends with an error; the others go on."""
        request.result.fail("the grammar allows no token at this point (an unsatisfiable schema?)")
        return Event(request.id, [], True)

    def _take(self, slot: int, request: SlotRequest, tokens: list[int]) -> list[int]:
        """Append tokens to the request up to a stop token or its max_tokens; returns what was appended."""
        res, out = request.result, []
        for tok in tokens:
            out.append(tok)
            if tok in self.stop_ids:
                res.stopped = res.done = True
                break
            if len(res.token_ids) + len(out) >= request.max_tokens:
                res.done = True
                break
        res.token_ids += out
        self.sampling.emitted(slot, out)  # what the penalties count
        if res.done:
            res.seconds = time.perf_counter() - res.started
        return out

    # -- graph calls ------------------------------------------------------------------------------------------

    def _verify(self, feeds_kv: dict, mask, tokens, logit_index, verify_len, temperature, accept, sample,
                draft_probs, slots: np.ndarray) -> Verified:
        return self.graphs.verify({"tokens": tokens, "past_mask": mask, "logit_index": logit_index,
                                   "verify_len": verify_len, "temperature": temperature, "accept_noise": accept,
                                   "sample_noise": sample, "draft_probs": draft_probs, **feeds_kv}, slots)

    def _tell(self, what: str, record) -> None:
        for observer in self.observers:
            getattr(observer, what)(record)
