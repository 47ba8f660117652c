"""The batch slots of the always-on engine: dspark.runtime.decoder.Decoder whose requests arrive while it runs.

Requests are keyed by the engine's request id (the Decoder's prompts/results/queue hold those keys), and each
brings its own options: temperature, seed, max_tokens, and whether it decodes autoregressively inside a
drafting batch. Such an "ar" request is left out of drafting and verifies no drafts (verify_len 0), and its
noise consumes one uniform per draw, as a plain verifier step does, so its tokens equal a pure AR decode's.
"""
from __future__ import annotations

import numpy as np

from dspark.bundle import Manifest
from dspark.noise import RequestNoise
from dspark.runtime.backend import Backend
from dspark.runtime.decoder import Decoder, RequestResult
from dspark.runtime.engine_request import Request
from dspark.runtime.options import DecodeOptions


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
        return super()._draft(live & ~self.ar_slots)

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
