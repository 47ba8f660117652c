"""What a slot machine reports after each prefill and each round, and the observers that listen.

The decode state carries decoding only. Everything else a caller wants from a decode (step timing for
benchmarks, confidence logits for calibration, target features for training, metrics for the server) is an
observer handed to dspark.runtime.slots.Slots: it is called with one record per prefill and per round, valid
during the call only, and keeps what it wants. Host copies that cost something (target features, confidence
logits) are made only when an observer asks for them (`wants`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
import numpy as np

from dspark.runtime.results import StepTimes
from dspark.runtime.slot_request import SlotRequest

TAPS, CONFIDENCE = "taps", "confidence"


@dataclass
class PrefillRecord:
    """Prompts prefilled together into free slots."""

    requests: list[SlotRequest]
    lengths: list[int]  # prompt tokens per request
    seconds: float
    taps: np.ndarray | None = None  # [n, T, features] host copy (observers wanting TAPS)


@dataclass
class RoundRecord:
    """One round over the leading `rows` slots; row r holds requests[r] (None: a free row computed as padding)."""

    requests: list[SlotRequest | None]
    positions: int  # verifier positions per row: anchor + the longest verified prefix of drafts
    drafted: bool  # the draft and heads graphs ran (not a plain verifier step)
    verify_len: np.ndarray  # drafts verified per row
    accepted: np.ndarray  # drafts the verifier accepted per row (a request's result keeps them cut at a stop token)
    draft_seconds: float = 0.0  # draft graph
    heads_seconds: float = 0.0
    verify_seconds: float = 0.0
    conf_logits: np.ndarray | None = None  # [rows, Bk] (observers wanting CONFIDENCE, drafted rounds)
    taps: np.ndarray | None = None  # [rows, T, features] host copy (observers wanting TAPS)

    @property
    def rows(self) -> int:
        return len(self.requests)

    def live(self) -> list[int]:
        return [r for r, req in enumerate(self.requests) if req is not None]

    def drafting(self) -> list[int]:
        """Rows whose request drafted this round (none in a plain round; never an "ar" request)."""
        return [r for r, req in enumerate(self.requests) if req is not None and not req.ar] if self.drafted else []


class RoundObserver:
    """Listens to a slot machine (dspark.runtime.slots.Slots); override what you need."""

    wants: frozenset[str] = frozenset()  # TAPS, CONFIDENCE: host copies the records should carry

    def prefilled(self, record: PrefillRecord) -> None: ...
    def round(self, record: RoundRecord) -> None: ...


class StepTimer(RoundObserver):
    """Seconds per stage and padding counters of a whole decode (benchmarks, `dspark run --stats`)."""

    def __init__(self):
        self.times = StepTimes()

    def prefilled(self, record: PrefillRecord) -> None:
        self.times.prefill += record.seconds

    def round(self, record: RoundRecord) -> None:
        times = self.times
        times.draft += record.draft_seconds
        times.heads += record.heads_seconds
        times.verify += record.verify_seconds
        times.rounds += 1
        times.drafted += record.drafted
        times.round_tokens.append(record.rows * record.positions)
        times.round_useful.append(len(record.live()) + int(record.verify_len.sum()))  # free rows verify 0


class ConfidenceLog(RoundObserver):
    """(confidence logits [Bk], drafts verified, drafts accepted) per drafting request per round: what `dspark
    calibrate` fits its temperatures on."""

    wants = frozenset({CONFIDENCE})

    def __init__(self):
        self.rounds: list[tuple[np.ndarray, int, int]] = []

    def round(self, record: RoundRecord) -> None:
        if record.conf_logits is None:
            return
        for r in record.drafting():
            kept = record.requests[r].result.accepted[-1]
            self.rounds.append((record.conf_logits[r].copy(), int(record.verify_len[r]), kept))


@dataclass
class TapsLog(RoundObserver):
    """Target features of every position a request's verifier processed, as fp16 arrays per request id (training
    data: the prompt's, then each round's anchor + accepted drafts). `take` hands a request's over and forgets them."""

    wants = frozenset({TAPS})
    by_request: dict[int, list[np.ndarray]] = field(default_factory=dict)

    def prefilled(self, record: PrefillRecord) -> None:
        for i, (request, count) in enumerate(zip(record.requests, record.lengths)):
            self.by_request.setdefault(request.id, []).append(record.taps[i, :count].astype(np.float16))

    def round(self, record: RoundRecord) -> None:
        for r in record.live():
            self.by_request[record.requests[r].id].append(record.taps[r, :int(record.accepted[r]) + 1].astype(np.float16))

    def take(self, request_id: int) -> np.ndarray:
        return np.concatenate(self.by_request.pop(request_id))
