"""What a decode is asked to do: the one contract between callers (CLI, API, benchmarks) and the decode loop."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dspark.errors import DSparkError
from dspark.runtime.scheduler import VerifyPolicy


@dataclass(frozen=True)
class DecodeOptions:
    """max_new_tokens: tokens to generate per request at most (a stop token ends a request earlier).
    temperature: 0 = greedy; sampling is lossless at any temperature.
    seed: with the request's index, keys its noise: a request's tokens do not depend on what else is in flight.
    policy: how many drafts a round verifies, a VerifyPolicy or its text ("ar", "all", "fixed:N", "static:T",
        "schedule", "topk", optionally "+gate"); "ar" decodes autoregressively with the same verifier graph.
    batch_size: slots decoding at once (default: all requests); further requests queue for a free slot.
    record_taps / record_confidence: keep target features per position / confidence logits per round (training,
        calibration)."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    seed: int = 0
    policy: VerifyPolicy | str = "all"
    batch_size: int | None = None
    record_taps: bool = False
    record_confidence: bool = False

    def __post_init__(self):
        if isinstance(self.policy, str):
            object.__setattr__(self, "policy", VerifyPolicy.parse(self.policy))
        if not isinstance(self.policy, VerifyPolicy):
            raise DSparkError(f"policy must be a VerifyPolicy or its text, not {type(self.policy).__name__}")
        if self.max_new_tokens < 1:
            raise DSparkError("max_new_tokens must be at least 1")
        if self.batch_size is not None and self.batch_size < 1:
            raise DSparkError("batch_size must be at least 1")

    @property
    def ar(self) -> bool:
        return self.policy.is_ar

    def replace(self, **changes) -> "DecodeOptions":
        return dataclasses.replace(self, **changes)
