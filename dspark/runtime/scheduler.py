"""How many draft tokens each request verifies per round (torch-free).

The decision itself runs inside heads.onnx (dspark::ConfidenceTruncate); this module picks the op's mode and
inputs per round. Policies (`VerifyPolicy.parse` reads them from text, e.g. "static:0.4" or "schedule+gate"):
  ar          never draft: one verifier position per round (autoregressive decoding with the same graph)
  all         verify every draft (threshold 0)
  fixed       verify at most `gamma` drafts (a constant cap, applied on the host)
  static      verify the prefix whose calibrated survival reaches `threshold`
  schedule    Algorithm 1 over the batch with the bundle's SPS table (early stop: lossless)
  topk        admit the K best drafts by current survival, K from confidences two rounds old
Any policy can add the draft gate (dspark.runtime.gate): skip drafting in rounds where it cannot pay.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from dspark.bundle import MAX_BLOCK
from dspark.errors import DSparkError
from dspark.ops.confidence_truncate.reference import PADDED, SCHEDULE, STATIC, TOPK, budget_from, confidence_truncate

KINDS = ("ar", "all", "fixed", "static", "schedule", "topk")


MAX_GAMMA = MAX_BLOCK  # drafts a round may verify: at most a block


@dataclass
class VerifyPolicy:
    kind: str = "all"
    threshold: float = 0.0
    gamma: int | None = None
    sps: np.ndarray | None = None  # steps/s at 1..N batch tokens; default: the bundle's calibration
    layout: int = PADDED  # our verifier runs padded [B, T] batches
    gate: bool = False  # skip drafting when a plain verifier step is expected to be faster

    def __post_init__(self):
        if self.kind not in KINDS:
            raise DSparkError(f"unknown verification policy {self.kind!r} (choose from {', '.join(KINDS)})")
        if self.kind == "fixed" and (self.gamma is None or not 0 <= self.gamma <= MAX_GAMMA):
            raise DSparkError(f"the fixed policy needs gamma in 0..{MAX_GAMMA} (drafts verified per round, at most a "
                              f"block), not {self.gamma}")
        if self.kind == "ar" and self.gate:
            raise DSparkError("'ar' never drafts, so it takes no '+gate'")

    @property
    def is_ar(self) -> bool:
        return self.kind == "ar"

    @classmethod
    def parse(cls, text: str) -> "VerifyPolicy":
        """'ar', 'all', 'fixed:3', 'static:0.4', 'schedule', 'topk', each but 'ar' optionally with '+gate'."""
        body, plus, extra = text.partition("+")
        if plus and extra != "gate":
            raise DSparkError(f"bad policy {text!r}: the only suffix is '+gate'")
        name, _, arg = body.partition(":")
        try:
            if name == "fixed":
                return cls("fixed", gamma=int(arg), gate=bool(plus))
            if name == "static":
                return cls("static", threshold=float(arg), gate=bool(plus))
        except ValueError:
            raise DSparkError(f"bad policy {text!r}: fixed:N takes an integer, static:T a number") from None
        if arg:
            raise DSparkError(f"bad policy {text!r}: {name} takes no ':' argument")
        return cls(name, gate=bool(plus))

    def __str__(self) -> str:
        arg = {"fixed": f":{self.gamma}", "static": f":{self.threshold:g}"}.get(self.kind, "")
        return f"{self.kind}{arg}{'+gate' if self.gate else ''}"

    def sps_table(self, bundle_table: list[float] | None) -> np.ndarray:
        sps = self.sps if self.sps is not None else bundle_table
        if sps is None or len(sps) == 0:
            what = f"the {self.kind} policy" if self.kind in ("schedule", "topk") else "the draft gate"
            raise DSparkError(f"{what} needs an SPS table: run `dspark calibrate --sps BUNDLE`")
        return np.asarray(sps, dtype=np.float32)


class RoundPlanner:
    """Every round's answer to "how many drafts does each request verify", outside the heads graph: the
    ConfidenceTruncate inputs (mode, threshold, SPS table, top-K budget, which rows draft), then, from the graph's
    choice, the host-side cuts: the fixed policy's cap, DeepSpec's first-position threshold rule, and zero for
    every row that did not draft (free slots, "ar" requests)."""

    def __init__(self, policy: VerifyPolicy, batch: int, sps_table: list[float] | None,
                 threshold_rule: str = "cumulative", prior: list[float] | None = None):
        """`prior`: a drafter without a confidence head (DFlash) has no survival of its own; with the acceptance
        per block position (conditional on the positions before, `acceptance_prior`), every round's survival is
        its running product, the same for every request, and the policy decides on that."""
        self.policy = policy
        self.prior = None if prior is None else np.cumprod(np.asarray(prior, dtype=np.float32)).astype(np.float32)
        self.budget = np.zeros(1, dtype=np.int64)
        if policy.kind in ("schedule", "topk"):
            self.sps = policy.sps_table(sps_table)
        else:
            self.sps = np.ones(1, dtype=np.float32)
        self.mode = np.array([{"schedule": SCHEDULE, "topk": TOPK}.get(policy.kind, STATIC)], dtype=np.int64)
        self.layout = np.array([policy.layout], dtype=np.int64)
        # the first-position rule lets every draft through the graph and cuts on the host (after)
        self.first_rule = threshold_rule == "first" and policy.kind == "static"
        static = policy.threshold if policy.kind == "static" and not self.first_rule else 0.0
        self.threshold = np.full(batch, static, dtype=np.float32)
        self.history: deque[tuple[np.ndarray, np.ndarray]] = deque(maxlen=2)  # (survival, active) per round

    def feeds(self, active: np.ndarray) -> dict[str, np.ndarray]:
        """The heads graph's policy inputs for a round over len(active) rows; `active`: the rows that draft."""
        budget = 0
        if self.policy.kind == "topk":
            if len(self.history) == 2:  # confidences two rounds old: known before this round started
                survival, was_active = self.history[0]
                budget = budget_from(survival, self.sps, was_active, self.policy.layout)
            else:
                budget = int(active.sum()) * 64  # no history yet: admit everything
        self.budget = np.array([budget], dtype=np.int64)
        return {"threshold": self.threshold[:len(active)], "sps": self.sps, "budget": self.budget,
                "active": active, "mode": self.mode, "layout": self.layout}

    def survival(self, graph_survival: np.ndarray) -> np.ndarray:
        """The round's survival [rows, Bk]: the heads graph's, or the position-wise prior's for every row."""
        if self.prior is None:
            return graph_survival
        return np.broadcast_to(self.prior[:graph_survival.shape[1]], graph_survival.shape).copy()

    def after(self, survival: np.ndarray, active: np.ndarray, verify_len: np.ndarray) -> np.ndarray:
        """Drafts each row verifies, from the graph's verify_len (recording this round's survival for top-K)."""
        if self.policy.kind == "topk":
            self.history.append((survival.copy(), active.copy()))
        if self.prior is not None:  # the graph decided on no survival at all: decide again on the prior's
            verify_len, _ = confidence_truncate(survival, self.threshold[:len(active)], self.sps, self.budget, active,
                                                int(self.mode[0]), int(self.layout[0]))
        if self.policy.kind == "fixed":
            verify_len = np.minimum(verify_len, self.policy.gamma)
        if self.first_rule:
            verify_len = first_below(survival, self.policy.threshold)
        return np.where(active, verify_len, 0)


def first_below(survival: np.ndarray, threshold: float) -> np.ndarray:
    """DeepSpec's --confidence-threshold: per row, the first position whose own confidence (survival over the
    previous position's survival) is below the threshold; every draft when none is."""
    with np.errstate(divide="ignore", invalid="ignore"):
        previous = np.concatenate([np.ones_like(survival[:, :1]), survival[:, :-1]], axis=1)
        below = ~(survival / previous >= threshold)
    return np.where(below.any(axis=1), below.argmax(axis=1), survival.shape[1]).astype(np.int64)
