"""The always-on engine: one decode loop thread owns the batch slots and admits requests at every round boundary.

    engine = Engine(Runtime("bundle/"), EngineOptions(max_queue=64))  # batch slots and policy: chosen, engine.choice
    engine.start()
    request = engine.submit(engine.runtime.encode("Hello"), RequestOptions(max_tokens=32, seed=1))
    for delta in request:
        print(delta.text, end="")
    engine.close(grace=10)

Submitting is thread-safe and never waits for the loop: a request joins a bounded queue (refused with QueueFull
when it is full, EngineClosed once closing, and with one line when prompt + max_tokens cannot fit a slot's
context), and the loop moves queued requests into free slots between rounds. A cancelled request leaves its
slot at the next round boundary. A request's tokens do not depend on what else is in flight: its noise is keyed
by its own seed (dspark.noise), greedy decoding equals `dspark run`'s.
"""
from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable


from dspark.errors import DSparkError
from dspark.runtime.api import Runtime
from dspark.runtime.backend import available_memory
from dspark.runtime.engine_choice import choose
from dspark.runtime.engine_request import Delta, EngineObserver, Request, RequestOptions, RoundStats, StopText
from dspark.runtime.gate import new_gate
from dspark.runtime.observers import RoundObserver, RoundRecord
from dspark.runtime.room import max_new_tokens
from dspark.runtime.scheduler import VerifyPolicy
from dspark.runtime.slot_request import SlotRequest
from dspark.runtime.slots import Slots
from dspark.schema import is_int


class QueueFull(DSparkError):
    """The engine's queue is full: retry later."""


class EngineClosed(DSparkError):
    """The engine is shutting down or stopped (or failed): it admits nothing more."""


@dataclass(frozen=True)
class EngineOptions:
    """batch_size: slots decoding at once. policy: the engine's VerifyPolicy (text or object). Either None (or
    "auto"): chosen from the bundle, the backend and the memory available (dspark.runtime.engine_choice; the
    engine's `choice` says what and why). max_queue: requests waiting for a slot at most. max_context: positions
    a slot's caches hold (default: the bundle's max context; every slot allocates it up front)."""

    batch_size: int | None = None
    policy: VerifyPolicy | str | None = None
    max_queue: int = 64
    max_context: int | None = None

    def __post_init__(self):
        if (self.batch_size is not None and self.batch_size < 1) or self.max_queue < 0:
            raise DSparkError("batch_size must be at least 1 and max_queue at least 0")


class Engine:
    def __init__(self, runtime: Runtime, options: EngineOptions = EngineOptions(),
                 observer: EngineObserver | None = None):
        self.runtime, self.options = runtime, options
        self.observer = observer or EngineObserver()
        manifest, backend = runtime.manifest, runtime.backend
        limits = [manifest.max_context, backend.fixed_capacity, options.max_context]
        self.capacity = min(x for x in limits if x)
        self.choice = choose(manifest, backend.max_batch, self.capacity, options.batch_size, options.policy,
                             available_memory())
        self.batch, self.policy = self.choice.batch_size, self.choice.policy
        self.slots = self._new_slots()
        self._pending: deque[Request] = deque()
        self._requests: dict[int, Request] = {}  # in the slots
        self._decoding: dict[int, SlotRequest] = {}  # the slot machine's record of each of them
        self._ids = itertools.count(1)
        self._cond = threading.Condition()
        self._closing = False
        self._thread: threading.Thread | None = None

    def _new_slots(self) -> Slots:
        manifest = self.runtime.manifest
        gate = new_gate(self.policy, manifest.calibration.get("sps_table"), manifest.block_size, self.batch)
        slots = Slots(self.runtime.backend, manifest, self.policy, self.batch, self.capacity, gate=gate,
                      observers=(_RoundReport(self),))
        # every slot's caches resident from the start: a slot's first request does not fault their pages in while
        # the batch waits, and a machine short of that memory finds out now, not under load
        for cache in (slots.kv, slots.draft_kv):
            cache.reserve()
        return slots

    # -- the caller's side (any thread) -----------------------------------------------------------------------

    def start(self) -> "Engine":
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="dspark-engine", daemon=True)
            self._thread.start()
        return self

    def max_tokens_for(self, prompt_len: int) -> int:
        """The most tokens a request with this prompt may ask for (the rule `dspark run` applies)."""
        return max_new_tokens(self.capacity, prompt_len)

    def check(self, prompt_ids: list[int], options: RequestOptions) -> bool:
        """Refuse what can never run (one line); returns whether the request decodes autoregressively."""
        if not prompt_ids:
            raise DSparkError("empty prompt: give at least one token")
        room = self.max_tokens_for(len(prompt_ids))
        if options.max_tokens > room:
            raise DSparkError(f"prompt of {len(prompt_ids)} tokens + max_tokens {options.max_tokens} does not fit "
                              f"the context of {self.capacity} positions (at most {max(room, 0)} new tokens)")
        self.slots.check(options.sampling, options.temperature, options.logprobs, options.grammar is not None)
        if options.policy is None:
            return self.policy.is_ar
        asked = VerifyPolicy.parse(options.policy)
        if asked.is_ar or asked == self.policy:
            return asked.is_ar
        raise DSparkError(f"this engine decodes with policy {str(self.policy)!r}; a request may ask for it or 'ar'")

    def submit(self, prompt_ids: list[int], options: RequestOptions = RequestOptions(),
               sink: Callable[[Delta], None] | None = None) -> Request:
        return self.submit_choices(prompt_ids, options, 1, None if sink is None else [sink])[0]

    def submit_choices(self, prompt_ids: list[int], options: RequestOptions, n: int,
                       sinks: list[Callable[[Delta], None]] | None = None) -> list[Request]:
        """n completions of one prompt (OpenAI's n), each a Request of its own (sinks: one per choice, or None to
        iterate them). They take slots together and the prompt is prefilled once; choice i draws the noise stream i
        of the request's seed, so the same seed and n give the same choices."""
        ar = self.check(prompt_ids, options)
        if not is_int(n) or not 1 <= n <= self.batch:
            raise DSparkError(f"n must be an integer in 1..{self.batch} (this engine's batch slots: every choice "
                              f"decodes in a slot of its own), not {n!r}")
        with self._cond:
            if self._closing:
                self.observer.refused("closed")
                raise EngineClosed("the engine is shutting down")
            if len(self._pending) + len(self._requests) + n > self.batch + self.options.max_queue:
                self.observer.refused("queue_full")
                raise QueueFull(f"the queue is full ({self.options.max_queue} requests waiting); retry later")
            requests: list[Request] = []
            for i in range(n):
                requests.append(Request(next(self._ids), list(prompt_ids), options, ar, sinks and sinks[i],
                                        choice=i, first_choice=requests[0] if i else None))
            self._pending.extend(requests)
            self.observer.queue_depth(len(self._pending))
            self._cond.notify_all()
        return requests

    @property
    def queue_depth(self) -> int:
        return len(self._pending)

    @property
    def busy_slots(self) -> int:
        return self.slots.live

    def idle(self) -> bool:
        with self._cond:
            return not self._pending and not self._requests

    def warm_up(self, prompt_ids: list[int], max_tokens: int = 4) -> None:
        """One short request through every graph, so the first real request does not pay first-call costs, and
        the graphs only batches of several requests take loaded too."""
        self.runtime.backend.prepare(self.batch)
        self.submit(prompt_ids, RequestOptions(max_tokens=max_tokens)).wait()

    def close(self, grace: float = 10.0) -> None:
        """Stop admitting, let queued and running requests finish for up to `grace` seconds, then cancel the rest
        (each gets a final delta: nothing accepted is dropped silently) and stop the loop."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            deadline = time.monotonic() + grace
            while (self._pending or self._requests) and self._thread and self._thread.is_alive():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            for request in [*self._pending, *self._requests.values()]:
                request.cancel()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()

    # -- the loop (its own thread) ----------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._requests and not self._closing:
                    self._cond.wait()
                if self._closing and not self._pending and not self._requests:
                    self._cond.notify_all()
                    return
                taken, dropped = self._take_pending()
            for request in dropped:
                self._finish(request, "cancelled")
            try:
                self._step(taken)
            except Exception as e:  # a failed graph call: fail every request in flight, keep serving
                self._fail_all(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")

    def _take_pending(self) -> tuple[list[Request], list[Request]]:
        """Under the lock: queued requests that fit the free slots, and queued requests already cancelled."""
        dropped = [r for r in self._pending if r.cancelled.is_set()]
        for request in dropped:
            self._pending.remove(request)
        taken = []
        leaving = sum(1 for r in self._requests.values() if r.cancelled.is_set() and not r.done)
        free = self.slots.free_slots() + leaving  # cancelled requests leave their slots at this boundary
        while self._pending and len(taken) < max(free, 0):
            size = 1  # a request's choices take slots together
            while size < len(self._pending) and self._pending[size].first_choice is self._pending[0]:
                size += 1
            if len(taken) + size > free:
                break
            taken += [self._pending.popleft() for _ in range(size)]
        for request in taken:
            self._requests[request.id] = request
        self.observer.queue_depth(len(self._pending))
        return taken, dropped

    def _step(self, taken: list[Request]) -> None:
        """One round boundary (cancellations, admissions, freed slots), then one round if any slot is live."""
        for request in list(self._requests.values()):
            if request.cancelled.is_set() and not request.done:
                self.slots.cancel(self._decoding[request.id])
                self._finish(request, "cancelled")
        for request in taken:
            request.stop_text = StopText(self.runtime.tokenizer, request.options.stop)
            options = request.options
            first = request.first_choice and self._decoding.get(request.first_choice.id)
            self._decoding[request.id] = SlotRequest(request.id, request.prompt_ids, options.max_tokens,
                                                     options.temperature, options.seed, request.choice,
                                                     ar=request.ar, sampling=options.sampling,
                                                     logprobs=options.logprobs, shares_prompt_with=first,
                                                     grammar=options.grammar)
            self.slots.add(self._decoding[request.id])
        self._deliver(self.slots.step())
        self._forget_finished()
        self.observer.occupancy(self.slots.live, self.slots.kv_used())

    def _deliver(self, events) -> None:
        for event in events:
            request = self._requests[event.request]
            if request.done:  # cancelled this round: its last tokens are not sent
                continue
            result = self._decoding[event.request].result
            now = time.perf_counter()
            if request.first_token_at is None:
                request.first_token_at = now
                self.observer.first_token(now - request.submitted)
            elif event.token_ids:
                self.observer.tokens(len(event.token_ids), (now - request.last_token_at) / len(event.token_ids))
            request.last_token_at = now
            request.token_ids += event.token_ids
            request.logprobs += event.logprobs or []
            if result.committed and len(request.committed) < len(result.committed):
                request.committed.append(result.committed[-1])
                request.proposed.append(result.proposed[-1])
                request.accepted.append(result.accepted[-1])
            if result.error is not None:  # this request alone failed (a grammar's dead end)
                self._finish(request, "error", error=result.error)
                continue
            piece, stopped = request.stop_text.add(event.token_ids)
            if stopped or event.done:
                result.done = True  # a stop string frees the slot at the next boundary
                request.text += piece
                self._finish(request, "stop" if stopped or result.stopped else "length", piece, event.token_ids)
            elif piece:
                request.text += piece
                self._send(request, Delta(piece, event.token_ids))

    def _finish(self, request: Request, reason: str, piece: str = "", token_ids: list[int] | None = None,
                error: str | None = None) -> None:
        if request.done:
            return
        if request.stop_text is not None and reason != "stop":
            tail = request.stop_text.flush()
            piece, request.text = piece + tail, request.text + tail
        request.finish_reason, request.error = reason, error
        request.finished_at = time.perf_counter()
        self._send(request, Delta(piece, token_ids or [], reason, error))
        self.observer.finished(request)

    @staticmethod
    def _send(request: Request, delta: Delta) -> None:
        delta.logprobs, request.logprobs_sent = request.logprobs[request.logprobs_sent:], len(request.logprobs)
        try:
            request.sink(delta)
        except Exception:  # a listener that is gone (a closed event loop): nobody waits for this request
            request.cancel()

    def _forget_finished(self) -> None:
        with self._cond:
            for request_id in [i for i, r in self._requests.items() if r.done]:
                del self._requests[request_id]
                del self._decoding[request_id]
            self._cond.notify_all()

    def observe_round(self, record: RoundRecord) -> None:
        """Metrics of one round (called by the slot machine, from the loop thread)."""
        live, drafting = record.live(), record.drafting()
        stats = RoundStats(busy_slots=len(live), queue_depth=len(self._pending), kv_used=self.slots.kv_used(),
                           kv_capacity=self.slots.batch * self.capacity, drafted=record.drafted,
                           gate_skipped=not record.drafted and self.slots.gate is not None
                           and any(not record.requests[r].ar for r in live))
        for r in drafting:
            result = record.requests[r].result
            stats.verified.append(result.proposed[-1])
            stats.accepted.append(result.accepted[-1])
        self.observer.round(stats)

    def _fail_all(self, message: str) -> None:
        with self._cond:
            failed = [*self._requests.values()]
            self._requests.clear()
            self._decoding.clear()
            self.slots = self._new_slots()  # the slots' state may be half-written: start from empty caches
        for request in failed:
            self._finish(request, "error", error=message)


class _RoundReport(RoundObserver):
    """The engine's metrics as an observer of its slot machine."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def round(self, record: RoundRecord) -> None:
        self.engine.observe_round(record)
