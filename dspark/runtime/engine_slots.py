"""The batch slots of the always-on engine: dspark.runtime.decoder.Decoder whose requests arrive while it runs.

Requests are keyed by the engine's request id (the Decoder's prompts/results/queue hold those keys), and each
brings its own options: temperature, seed, max_tokens, and whether it decodes autoregressively inside a
drafting batch. Such an "ar" request is left out of drafting and verifies no drafts (verify_len 0), and its
noise consumes one uniform per draw, as a plain verifier step does, so its tokens equal a pure AR decode's.

Rounds compute the live rows only: live requests are kept in the leading slots (a request leaving a slot below
another live one has that one moved down: its cache prefix is copied once), and a round with n live requests
runs every graph on views of the first n rows of the caches and per-slot arrays (made once; nothing is copied or
allocated per round for it). One request pays a one-row step, not a --batch-size step. Backends whose state is
not host numpy (TensorRT) keep full-width rounds.
"""
from __future__ import annotations

import numpy as np

from dspark.bundle import Manifest
from dspark.noise import RequestNoise
from dspark.runtime.backend import Backend
from dspark.runtime.decoder import Decoder
from dspark.runtime.results import RequestResult
from dspark.runtime.engine_request import Request
from dspark.runtime.kv import HostKV, HostRows
from dspark.runtime.options import DecodeOptions

ROW_STATE = ("kv", "draft_kv", "ctx", "temperature", "anchor", "ar_slots", "_no_drafts", "_zero", "_no_draft_ids")


class LeadingKV:
    """The first n slots of a HostKV as the graphs read them (views: no copy); writes go to the whole cache."""

    def __init__(self, whole: HostKV, n: int):
        self.whole = whole
        self.feeds = {name: whole.buffer[i, j, :n] for name, i, j in whole.names}
        self.lengths = whole.lengths[:n]
        self._mask = whole.past_mask()[:n]

    def past_mask(self) -> np.ndarray:
        return self._mask

    def __getattr__(self, name):  # write, commit, check_room, room, capacity: slot indices are the whole's
        return getattr(self.whole, name)


class LeadingRows:
    """The first n slots of a HostRows (its row buffer may grow, so rows are read through the whole). Slots marked
    in `dropped` ("ar" requests, which never draft) keep no target features: they would only pile up."""

    def __init__(self, whole: HostRows, n: int, dropped: np.ndarray):
        self.whole, self.n, self.dropped = whole, n, dropped
        self.count = whole.count[:n]

    def put(self, slot: int, taps, row: int, count: int, append: bool = False) -> None:
        if not self.dropped[slot]:
            self.whole.put(slot, taps, row, count, append)

    def feed(self) -> np.ndarray:
        return np.ascontiguousarray(self.whole.rows[:self.n, :max(int(self.count.max()), 1)])


def move_kv(kv: HostKV, src: int, dst: int) -> None:
    """Move slot src's valid cache prefix to slot dst (free); src is left empty."""
    length = int(kv.lengths[src])
    kv.buffer[:, :, dst, :, :length] = kv.buffer[:, :, src, :, :length]
    kv.commit(dst, 0)
    kv.commit(dst, length)
    kv.commit(src, 0)


def move_rows(rows: HostRows, src: int, dst: int) -> None:
    count = int(rows.count[src])
    rows.rows[dst, :count] = rows.rows[src, :count]
    rows.count[dst], rows.count[src] = count, 0


class PlainStepNoise(RequestNoise):
    """A request's noise as autoregressive steps draw it: one uniform per draw (accept, then sample); the verifier
    never reads the accept noise past verify_len 0, so the rest is padding."""

    def draw(self, n: int) -> np.ndarray:
        out = np.ones(n, dtype=np.float32)
        out[0] = super().draw(1)[0]
        return out


class EngineSlots(Decoder):
    def __init__(self, backend: Backend, manifest: Manifest, options: DecodeOptions, batch: int, capacity: int):
        # The Decoder sizes its slots from a prompt list; the engine's requests come later, through `add`.
        super().__init__(backend, manifest, [[0]] * batch, options.replace(batch_size=batch, max_new_tokens=1),
                         capacity=capacity)
        self.queue.clear()
        self.prompts, self.results, self.request_ids = {}, {}, {}
        self.requests: dict[int, Request] = {}
        self.ar_slots = np.zeros(self.batch, dtype=bool)
        self.narrows = isinstance(self.kv, HostKV) and isinstance(self.draft_kv, HostKV) \
            and isinstance(self.ctx, HostRows)
        self._whole = {name: getattr(self, name) for name in ROW_STATE}
        self._whole_slot_req, self._threshold = self.slot_req, self.planner.threshold
        self._leading = {n: self._leading_state(n) for n in range(1, self.batch + 1)} if self.narrows else {}
        if self.narrows:
            self._use_rows(self.batch)

    def _leading_state(self, n: int) -> dict:
        """Views of the first n slots' state (the whole state's own objects when n is the batch)."""
        leading = {name: value[:n] for name, value in self._whole.items() if isinstance(value, np.ndarray)}
        if n < self.batch:
            leading.update(kv=LeadingKV(self.kv, n), draft_kv=LeadingKV(self.draft_kv, n))
        else:
            leading = dict(self._whole)
        return {**leading, "ctx": LeadingRows(self.ctx, n, self.ar_slots)}

    def add(self, request: Request) -> None:
        self.requests[request.id] = request
        self.prompts[request.id] = request.prompt_ids
        self.results[request.id] = RequestResult(prompt_ids=list(request.prompt_ids))
        self.request_ids[request.id] = 0
        self.queue.append(request.id)

    def forget(self, request_id: int) -> None:
        for table in (self.requests, self.prompts, self.results, self.request_ids):
            table.pop(request_id, None)

    def free_slots(self) -> int:
        free = sum(1 for r in self.slot_req if r < 0 or self.results[r].done)
        return free - len(self.queue)

    def live(self) -> np.ndarray:
        return np.array([r >= 0 for r in self.slot_req])

    def _open_slot(self, slot: int, req: int) -> None:
        request = self.requests[req]
        self.temperature[slot] = request.options.temperature
        self.ar_slots[slot] = request.ar
        self.noise[slot] = (PlainStepNoise if request.ar else RequestNoise)(request.options.seed, 0)

    def _max_new_tokens(self, req: int) -> int:
        return self.requests[req].options.max_tokens

    def _draft(self, live: np.ndarray):
        self.ctx.count[self.ar_slots] = 0  # "ar" requests never draft: their target features are not drafted from
        return super()._draft(live & ~self.ar_slots)

    def _fill_free_slots(self, max_prefill_tokens: int | None = None):
        """Admissions; on a host backend each prompt is prefilled alone: a batched prefill pads every prompt to
        the longest, and on CPU that padding costs more than batching saves (six dev prompts of 36-211 tokens on
        SmolLM2: 4.0 s alone vs 4.0-6.4 s batched)."""
        if max_prefill_tokens is None:
            max_prefill_tokens = 1 if self.narrows else 8192
        yield from super()._fill_free_slots(max_prefill_tokens)
        if self.narrows:
            self._compact()

    def _compact(self) -> None:
        """Move live requests down into free slots below them, so the live slots are the leading ones."""
        while True:
            live = [s for s, r in enumerate(self.slot_req) if r >= 0]
            holes = [s for s, r in enumerate(self.slot_req) if r < 0]
            if not live or not holes or holes[0] > live[-1]:
                return
            self._move(live[-1], holes[0])

    def _move(self, src: int, dst: int) -> None:
        move_kv(self.kv, src, dst)
        move_kv(self.draft_kv, src, dst)
        move_rows(self._whole["ctx"], src, dst)
        for array in (self.temperature, self.anchor, self.ar_slots):
            array[dst] = array[src]
        self.slot_req[dst], self.slot_req[src] = self.slot_req[src], -1
        self.noise[dst], self.noise[src] = self.noise[src], None

    def _round(self):
        """A round on the leading slots that are live (all of them on a backend that cannot narrow)."""
        if not self.narrows:
            yield from super()._round()
            return
        self._use_rows(1 + max(s for s, r in enumerate(self.slot_req) if r >= 0))  # the live ones, once compact
        try:
            yield from super()._round()
        finally:
            self._use_rows(len(self._whole_slot_req))  # (self.batch is the narrowed slot_req's length here)

    def _use_rows(self, n: int) -> None:
        for name, value in self._leading[n].items():
            setattr(self, name, value)
        whole = self._whole_slot_req
        self.slot_req = whole if n == len(whole) else whole[:n]
        self.planner.threshold = self._threshold[:n]  # a view
        if self.gate is not None:
            self.gate.batch = n  # the padded width of the steps it predicts

    def _plan(self, live: np.ndarray, plain: bool):
        plain = plain or not (live & ~self.ar_slots).any()  # only "ar" requests live: a plain step
        tokens, drafts, draft_probs, verify_len = super()._plan(live, plain)
        if not plain:
            verify_len = np.where(self.ar_slots, 0, verify_len)
            tokens = tokens[:, :1 + int(verify_len.max())]
        return tokens, drafts, draft_probs, verify_len

    def trim_logs(self, keep: int = 256) -> None:
        """An always-on loop must not grow per-round lists without end (they are kept for benchmarks)."""
        for log in (self.times.round_tokens, self.times.round_useful, self.verify_budget, self.confidence_log,
                    self.planner.budgets):
            if len(log) > 2 * keep:
                del log[:-keep]
