"""Live drafter acceptance in `dspark serve`: the acceptance length and position-1 acceptance over the latest
drafted rounds, exported per bundle, and one warning when position 1 stays far below what `dspark-export check`
measured on the same bundle (dspark.acceptance: a collapse that shows only in production, e.g. a prompt mix
the drafter was never trained for)."""
from __future__ import annotations

from collections import deque
from typing import Callable

from prometheus_client import CollectorRegistry, Gauge

from dspark.acceptance import CLAIM_RATIO

WINDOW = 512  # drafted request-rounds the live figures average over; the warning waits for a full window


class AcceptanceWatch:
    def __init__(self, registry: CollectorRegistry, model: str, checked_position1: float | None,
                 warn: Callable[[str], None]):
        self.model, self.checked, self.warn = model, checked_position1, warn
        self.lengths: deque[int] = deque(maxlen=WINDOW)  # tokens committed per drafted request-round
        self.position1: deque[int] = deque(maxlen=WINDOW)  # first draft accepted, of rounds that verified one
        self.warned = False
        self.length_gauge = Gauge("dspark_acceptance_length", f"Tokens committed per drafted round (bonus "
                                  f"included), mean over the latest {WINDOW} drafting requests' rounds", ["model"],
                                  registry=registry)
        self.position1_gauge = Gauge("dspark_acceptance_position1", f"Share of first drafts accepted, over the "
                                     f"latest {WINDOW} rounds that verified one", ["model"], registry=registry)
        if checked_position1 is not None:
            Gauge("dspark_acceptance_position1_checked", "Position-1 acceptance `dspark-export check` measured on "
                  "this bundle (the package's prompts, greedy)", ["model"], registry=registry
                  ).labels(model).set(checked_position1)

    def observe(self, verified: list[int], accepted: list[int]) -> None:
        for v, a in zip(verified, accepted):
            self.lengths.append(a + 1)
            if v >= 1:
                self.position1.append(1 if a >= 1 else 0)
        if self.lengths:
            self.length_gauge.labels(self.model).set(sum(self.lengths) / len(self.lengths))
        if self.position1:
            live = sum(self.position1) / len(self.position1)
            self.position1_gauge.labels(self.model).set(live)
            if (not self.warned and self.checked is not None and len(self.position1) == WINDOW
                    and live < CLAIM_RATIO * self.checked):
                self.warned = True
                self.warn(f"warning: {self.model}: the drafter accepts {live:.2f} of first drafts over the latest "
                          f"{WINDOW} rounds, under half the {self.checked:.2f} `dspark-export check` measured on "
                          f"this bundle: its acceptance collapsed for this traffic (is it the drafter's target and "
                          f"domain?); decoding stays exact, only slower")
