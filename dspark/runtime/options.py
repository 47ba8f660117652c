"""What a decode is asked to do: the one contract between callers (CLI, API, benchmarks) and the decode loop."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from dspark.errors import DSparkError
from dspark.runtime.grammar import Grammar
from dspark.runtime.logprobs import check_top_logprobs
from dspark.runtime.sampling import NEUTRAL, SamplingParams
from dspark.runtime.scheduler import VerifyPolicy
from dspark.schema import check_number, is_int


@dataclass(frozen=True)
class DecodeOptions:
    """max_tokens: tokens to generate per request at most (a stop token ends a request earlier).
    temperature: 0 = greedy; sampling is lossless at any temperature.
    seed: with the request's index, keys its noise: a request's tokens do not depend on what else is in flight.
    policy: how many drafts a round verifies, a VerifyPolicy or its text ("ar", "all", "fixed:N", "static:T",
        "schedule", "topk", optionally "+gate"); "ar" decodes autoregressively with the same verifier graph.
    batch_size: slots decoding at once (default: all requests); further requests queue for a free slot.
    threshold_rule: how a static threshold cuts the drafts: "cumulative" (default) verifies the prefix whose
        calibrated survival (the product of the per-position confidences) reaches it; "first" is DeepSpec's
        --confidence-threshold: cut at the first position whose own confidence is below it.
    sampling: top_k, top_p, min_p, penalties and logit_bias (dspark.runtime.sampling), lossless like temperature.
    logprobs: None, or each token's log-probability under the processed target distribution with its position's
        `logprobs` most likely tokens (0..20) in RequestResult.logprobs (dspark.runtime.logprobs).
    grammar: what every request's tokens must parse as (rt.grammars.json_schema(...), dspark.runtime.grammar)."""

    max_tokens: int = 128
    temperature: float = 0.0
    seed: int = 0
    policy: VerifyPolicy | str = "all"
    batch_size: int | None = None
    threshold_rule: str = "cumulative"
    sampling: SamplingParams = NEUTRAL
    logprobs: int | None = None
    grammar: Grammar | None = None

    def __post_init__(self):
        if isinstance(self.policy, str):
            object.__setattr__(self, "policy", VerifyPolicy.parse(self.policy))
        if not isinstance(self.policy, VerifyPolicy):
            raise DSparkError(f"policy must be a VerifyPolicy or its text, not {type(self.policy).__name__}")
        check_policy(self.policy)
        check_tokens("max_tokens", self.max_tokens)
        check_temperature(self.temperature)
        check_seed(self.seed)
        if self.batch_size is not None:
            _integer("batch_size", self.batch_size, 1)
        if not isinstance(self.sampling, SamplingParams):
            raise DSparkError(f"sampling must be SamplingParams, not {type(self.sampling).__name__}")
        check_top_logprobs(self.logprobs)
        if self.threshold_rule not in THRESHOLD_RULES:
            raise DSparkError(f"threshold_rule {self.threshold_rule!r} is not one of {', '.join(THRESHOLD_RULES)}")

    @property
    def ar(self) -> bool:
        return self.policy.is_ar

    def replace(self, **changes) -> "DecodeOptions":
        return dataclasses.replace(self, **changes)


THRESHOLD_RULES = ("cumulative", "first")
MAX_TEMPERATURE = 100.0  # beyond it a distribution is uniform to float precision


# one validator per request value, for every way in (DecodeOptions, the engine's RequestOptions, HTTP, Triton, CLI)

def check_tokens(name: str, value) -> int:
    """A token budget (max_tokens): an integer of at least 1."""
    return _integer(name, value, 1)


def check_temperature(value) -> float:
    """0 = greedy, up to MAX_TEMPERATURE."""
    temperature = check_number(value, "temperature", lo=0.0)
    if temperature > MAX_TEMPERATURE:
        raise DSparkError(f"temperature must be at most {MAX_TEMPERATURE:g}, not {value!r}")
    return temperature


def check_seed(value) -> int:
    return _integer("seed", value, 0, (1 << 63) - 1)


def _integer(name: str, value, lo: int, hi: int | None = None) -> int:
    if not is_int(value) and not isinstance(value, np.integer):
        raise DSparkError(f"{name} must be an integer, not {value!r}")
    if value < lo or (hi is not None and value > hi):
        raise DSparkError(f"{name} must be at least {lo}" + (f" and at most {hi}" if hi is not None else "")
                          + f", not {value}")
    return int(value)


def check_policy(policy: VerifyPolicy) -> None:
    """What VerifyPolicy itself lets through: a threshold outside 0..1 or NaN, a fractional gamma, a bad table."""
    check_number(policy.threshold, f"policy {policy.kind} threshold", lo=0.0)
    if policy.threshold > 1:
        raise DSparkError(f"policy {policy.kind} threshold {policy.threshold} is a survival probability: give 0..1")
    if policy.gamma is not None:
        _integer(f"policy {policy.kind} gamma", policy.gamma, 0)
    if policy.sps is not None:
        sps = np.asarray(policy.sps)
        if sps.ndim != 1 or not sps.size or not np.issubdtype(sps.dtype, np.number) or not np.all(np.isfinite(sps)) \
                or np.any(sps <= 0):
            raise DSparkError("policy sps must be a 1-D table of positive finite steps/s")
