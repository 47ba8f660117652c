"""What a decode hands back: per-request results, per-stage times, and the events a decode yields."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from dspark.runtime.logprobs import TokenLogprob


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
    text: str = ""  # the decoded tokens (Runtime.generate fills it in)
    error: str | None = None  # why this request was refused (it alone; the batch's other requests still run)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per token, where the request asked for them

    @property
    def tau(self) -> float:
        return float(np.mean(self.committed)) if self.committed else 0.0

    def fail(self, error: str) -> None:
        """End a running request with an error (it alone)."""
        self.error, self.done = error, True
        self.seconds = time.perf_counter() - self.started

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
    logprobs: list[TokenLogprob] | None = None  # per token, where the request asked for them
