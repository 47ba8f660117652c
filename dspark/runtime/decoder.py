"""A batch of prompts decoded to the end: a client of the slot machine (dspark.runtime.slots).

Every prompt is added at once; the machine admits them into `batch_size` slots as slots free up and steps
until none is left. Requests are numbered 0..n-1 and each one's noise is keyed by (seed, its number), so the
tokens a request gets do not depend on the other requests in flight. (With the draft gate on, which rounds draft
depends on the batch and on timing, and a round is a plain verifier step for all slots while any of them is
within a block of the context's end: greedy tokens stay the same, sampled ones are then reproducible in
distribution only.)
"""
from __future__ import annotations

import time
from typing import Iterator

from dspark.bundle import Manifest
from dspark.errors import DSparkError
from dspark.runtime.backend import Backend, available_memory
from dspark.runtime.engine_choice import refuse_unfit, slot_bytes
from dspark.runtime.gate import DraftGate, GateMemory, new_gate
from dspark.runtime.observers import RoundObserver, StepTimer
from dspark.runtime.options import DecodeOptions
from dspark.runtime.results import Event, RequestResult, StepTimes
from dspark.runtime.room import max_new_tokens, skipped_line
from dspark.runtime.slot_request import SlotRequest
from dspark.runtime.slots import Slots


class Decoder:
    """Decodes `prompts` (token ids) through `options.batch_size` slots; iterate it for Events, then read `results`
    and `times`. `request_ids` name the requests for their noise (default 0..n-1): a request's tokens do not depend
    on which decoder or slot serves it. `observers` see every prefill and round (dspark.runtime.observers)."""

    def __init__(self, backend: Backend, manifest: Manifest, prompts: list[list[int]],
                 options: DecodeOptions = DecodeOptions(), request_ids: list[int] | None = None,
                 capacity: int | None = None, gates: GateMemory | None = None,
                 observers: tuple[RoundObserver, ...] = ()):
        if not prompts:
            raise DSparkError("no prompts given")
        if any(len(p) == 0 for p in prompts):
            raise DSparkError("empty prompt: give at least one token")
        self.backend, self.manifest, self.options, self.prompts = backend, manifest, options, prompts
        self.refused = refused = self._refuse_overflowing(prompts)  # request index: why it does not run
        longest = max(len(p) for i, p in enumerate(prompts) if i not in refused)
        capacity = backend.fixed_capacity or capacity or min(
            longest + options.max_tokens + manifest.block_size + 1, self.context_limit)
        batch = min(options.batch_size or len(prompts), len(prompts), backend.max_batch or len(prompts))
        if backend.fixed_capacity is None:  # host caches: sized here
            refuse_unfit(batch, slot_bytes(manifest, capacity), available_memory(),
                         "give fewer prompts at once (a smaller batch size, -R in dspark bench) or fewer --max-tokens")
        self.gates, self._gate_key = gates, GateMemory.key(options.policy, batch, options.temperature == 0)
        self.timer = StepTimer()
        self.slots = Slots(backend, manifest, options.policy, batch, capacity, gate=self._take_gate(batch),
                           threshold_rule=options.threshold_rule, observers=(self.timer, *observers))
        ids = request_ids or list(range(len(prompts)))
        self.requests = [SlotRequest(i, list(p), options.max_tokens, options.temperature, options.seed, ids[i],
                                     ar=options.ar, sampling=options.sampling, logprobs=options.logprobs,
                                     grammar=options.grammar)
                         for i, p in enumerate(prompts)]
        self.results = [r.result for r in self.requests]
        for i, why in refused.items():
            self.results[i].error, self.results[i].done = why, True

    def _take_gate(self, batch: int) -> DraftGate | None:
        """The gate this decode drafts under: the one a previous decode of this policy and batch left in `gates`."""
        policy, manifest = self.options.policy, self.manifest
        if policy.is_ar or not policy.gate:
            return None

        def fresh() -> DraftGate:
            return new_gate(policy, manifest.calibration.get("sps_table"), manifest.block_size, batch)
        return self.gates.take(self._gate_key, fresh) if self.gates else fresh()

    @property
    def context_limit(self) -> int:
        return context_limit(self.backend, self.manifest)

    def _refuse_overflowing(self, prompts: list[list[int]]) -> dict[int, str]:
        return overflowing(prompts, self.context_limit, self.options.max_tokens)

    def skipped(self) -> str | None:
        """One line on the prompts refused for the context (None when every prompt runs)."""
        if not self.refused:
            return None
        return skipped_line(len(self.refused), len(self.prompts), self.options.max_tokens, self.context_limit)

    def __iter__(self) -> Iterator[Event]:
        start = time.perf_counter()
        for request in self.requests:
            if not request.result.done:
                self.slots.add(request)
        while self.slots.busy:
            yield from self.slots.admit()
            yield from self.slots.round()
        self.times.total = time.perf_counter() - start
        if self.gates is not None and self.gate is not None:
            self.gates.give_back(self._gate_key, self.gate)

    # what the slot machine holds, for callers that inspect a decode

    @property
    def times(self) -> StepTimes:
        return self.timer.times

    @property
    def gate(self) -> DraftGate | None:
        return self.slots.gate

    @property
    def batch(self) -> int:
        return self.slots.batch

    @property
    def capacity(self) -> int:
        return self.slots.capacity

    @property
    def kv(self):
        return self.slots.kv

    @property
    def draft_kv(self):
        return self.slots.draft_kv


def overflowing(prompts: list[list[int]], limit: int, new: int) -> dict[int, str]:
    """Requests whose prompt + `new` tokens cannot fit a context of `limit` positions, with why; every other
    request is served (the last positions of a request near the limit are plain verifier steps). All refused:
    DSparkError."""
    refused = {}
    for i, p in enumerate(prompts):
        if max_new_tokens(limit, len(p)) < 1:
            refused[i] = (f"prompt of request {i} ({len(p)} tokens) is too long for the bundle's max context "
                          f"{limit}")
        elif new > max_new_tokens(limit, len(p)):
            refused[i] = (f"context overflow: request {i} needs {len(p)} prompt + {new} new tokens = "
                          f"{len(p) + new} positions, the bundle's max context is {limit}; shorten the prompt "
                          f"or max_tokens")
    if len(refused) == len(prompts):
        raise DSparkError(refused[0] if len(prompts) == 1 else f"none of the {len(prompts)} prompts fits the "
                          f"context with max_tokens {new}: {refused[0]}")
    return refused


def context_limit(backend: Backend, manifest: Manifest) -> int:
    """Positions a request may fill: the bundle's max context, or less on engines built for one cache size
    (TensorRT)."""
    fixed = backend.fixed_capacity
    return min(manifest.max_context, fixed or manifest.max_context)

