"""What travels with one request through the always-on engine (dspark.runtime.engine): its options, its handle
(cancel, iterate deltas), the text deltas it is sent, and the observer interface the engine reports to."""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

from dspark.errors import DSparkError
from dspark.runtime.grammar import Grammar
from dspark.runtime.logprobs import TokenLogprob, check_top_logprobs
from dspark.runtime.options import check_seed, check_temperature, check_tokens
from dspark.runtime.sampling import NEUTRAL, SamplingParams
from dspark.tokenizer import ChatTokenizer, IncrementalDetokenizer

MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256


@dataclass(frozen=True)
class RequestOptions:
    """max_tokens: tokens to generate at most. temperature: 0 = greedy. seed: keys the request's noise, so the
    same prompt, options and seed give the same tokens whatever else is in flight (`dspark run --seed`).
    stop: strings that end the request (not included in its text). policy: None = the engine's; "ar" decodes
    this request autoregressively inside a drafting batch (exact; same tokens as `dspark run --ar`).
    sampling: top_k, top_p, min_p, penalties, logit_bias (dspark.runtime.sampling).
    logprobs: None, or each token's log-probability with its position's `logprobs` most likely tokens (0..20),
    delivered with the deltas (dspark.runtime.logprobs). grammar: what the tokens must parse as
    (Engine.grammar_tokenizer().json_schema(...), dspark.runtime.grammar)."""

    max_tokens: int = 128
    temperature: float = 0.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    policy: str | None = None
    sampling: SamplingParams = NEUTRAL
    logprobs: int | None = None
    grammar: Grammar | None = None

    def __post_init__(self):
        check_top_logprobs(self.logprobs)
        check_tokens("max_tokens", self.max_tokens)
        check_temperature(self.temperature)
        check_seed(self.seed)
        if len(self.stop) > MAX_STOP_STRINGS or any(not s or len(s) > MAX_STOP_CHARS for s in self.stop):
            raise DSparkError(f"stop takes at most {MAX_STOP_STRINGS} non-empty strings of at most "
                              f"{MAX_STOP_CHARS} characters")


@dataclass
class Delta:
    """New text of a request (and the token ids it came from); the last delta has a finish_reason:
    "stop" (stop token or stop string), "length" (max_tokens), "cancelled" or "error" (with `error`). logprobs: of
    the tokens not yet reported (a delta whose text a stop string holds back reports them with a later one)."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)


class StopText:
    """Text of a growing token list, held back while it could still end in one of the stop strings."""

    def __init__(self, tokenizer: ChatTokenizer, stop: tuple[str, ...]):
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.stop = stop
        self.text = ""  # everything decoded so far
        self.sent = 0  # characters released

    def add(self, token_ids: list[int]) -> tuple[str, bool]:
        """(text to release now, whether a stop string was hit)."""
        self.text += self.detokenizer.add(token_ids)
        start = max(0, self.sent - max((len(s) for s in self.stop), default=0))
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            return self.flush(), True
        held = max((k for s in self.stop for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
        end = max(self.sent, len(self.text) - held)
        piece, self.sent = self.text[self.sent:end], end
        return piece, False

    def flush(self) -> str:
        piece, self.sent = self.text[self.sent:], len(self.text)
        return piece


class Request:
    """A submitted request. Iterate it for Deltas (or give `sink` to Engine.submit to be called from the engine's
    thread instead); `cancel()` frees its slot at the next round boundary."""

    def __init__(self, request_id: int, prompt_ids: list[int], options: RequestOptions, ar: bool,
                 sink: Callable[[Delta], None] | None, choice: int = 0, first_choice: "Request | None" = None):
        self.id, self.prompt_ids, self.options, self.ar = request_id, prompt_ids, options, ar
        self.choice, self.first_choice = choice, first_choice  # OpenAI's n: which choice; the prompt's first
        self._queue: queue.SimpleQueue[Delta] | None = None if sink else queue.SimpleQueue()
        self.sink = sink or self._queue.put
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.logprobs: list[TokenLogprob] = []  # per token, where options.logprobs asks for them
        self.logprobs_sent = 0
        self.committed: list[int] = []  # tokens committed per round (tau)
        self.proposed: list[int] = []  # drafts verified per round (0: a round without drafts)
        self.accepted: list[int] = []  # of those, drafts accepted
        self.submitted = time.perf_counter()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.finished_at: float | None = None
        self.cancelled = threading.Event()
        self.stop_text: StopText | None = None  # set when the request takes a slot

    def cancel(self) -> None:
        self.cancelled.set()

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def tau(self) -> float:
        return sum(self.committed) / len(self.committed) if self.committed else 0.0

    def __iter__(self) -> Iterator[Delta]:
        if self._queue is None:
            raise DSparkError("this request delivers to its sink; it cannot be iterated")
        while True:
            delta = self._queue.get()
            yield delta
            if delta.finish_reason is not None:
                return

    def wait(self) -> "Request":
        """Consume every delta (blocking) and return the finished request."""
        for _ in self:
            pass
        return self


@dataclass
class RoundStats:
    """One decode round as the engine saw it (for metrics)."""

    busy_slots: int
    queue_depth: int
    kv_used: int  # target cache positions held by live requests
    kv_capacity: int  # positions all slots can hold
    drafted: bool
    gate_skipped: bool
    verified: list[int] = field(default_factory=list)  # drafts verified per drafting request
    accepted: list[int] = field(default_factory=list)  # drafts accepted per drafting request


class EngineObserver:
    """What the engine reports, from its loop thread (dspark.serve.metrics implements it with Prometheus)."""

    def queue_depth(self, depth: int) -> None: ...
    def round(self, stats: RoundStats) -> None: ...
    def occupancy(self, busy_slots: int, kv_used: int) -> None: ...
    def first_token(self, seconds: float) -> None: ...
    def tokens(self, count: int, seconds_each: float) -> None: ...
    def finished(self, request: Request) -> None: ...
    def refused(self, reason: str) -> None: ...
