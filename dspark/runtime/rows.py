"""What one round of the slot machine (dspark.runtime.slots) reads: the leading n slots' caches and arrays."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dspark.runtime.kv import LeadingKV, LeadingRows


@dataclass
class Rows:
    """The leading n slots as one round's graphs read them: views of the caches and per-slot arrays (no copy)."""

    n: int
    kv: object
    draft_kv: object
    ctx: object
    temperature: np.ndarray
    anchor: np.ndarray
    ar: np.ndarray
    occupied: np.ndarray
    top_logprobs: np.ndarray  # -1: no logprobs, else the most likely tokens each emitted token reports
    no_drafts: object  # zero draft probabilities [n, 1, V] (plain and all-greedy rounds)
    zero: np.ndarray
    no_draft_ids: np.ndarray

    def leading(self, n: int) -> "Rows":
        """The first n of these rows (host caches and arrays only)."""
        views = {name: value[:n] for name, value in self.__dict__.items() if isinstance(value, np.ndarray)}
        return Rows(**{**self.__dict__, **views, "n": n, "kv": LeadingKV(self.kv, n),
                       "draft_kv": LeadingKV(self.draft_kv, n), "ctx": LeadingRows(self.ctx, n),
                       "no_drafts": self.no_drafts[:n]})
