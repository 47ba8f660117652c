"""One request as a batch slot decodes it, and what a slot holds (dspark.runtime.slots)."""
from __future__ import annotations

from dataclasses import dataclass, field

from dspark.errors import DSparkError
from dspark.noise import RequestNoise
from dspark.runtime.grammar import Grammar
from dspark.runtime.logprobs import check_top_logprobs
from dspark.runtime.results import RequestResult
from dspark.runtime.sampling import NEUTRAL, SamplingParams


@dataclass(eq=False)
class SlotRequest:
    """One request as a slot decodes it. `id` names it in Events; `seed` and `stream` key its noise (a batch
    decode numbers its requests 0..n-1 under one seed, the engine gives each its own seed and stream 0).
    ar: decode autoregressively inside a drafting batch (no drafts verified; noise drawn as a plain step).
    sampling: top_k, top_p, min_p, penalties, logit_bias (dspark.runtime.sampling).
    logprobs: None, or each token's log-probability with its position's `logprobs` most likely tokens
    (dspark.runtime.logprobs). shares_prompt_with: the first choice of the same prompt (n > 1), queued right before
    this one: the slots prefill the prompt once and copy it (dspark.runtime.slots). grammar: what the tokens must
    parse as (response_format, dspark.runtime.grammar)."""

    id: int
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    seed: int = 0
    stream: int = 0
    ar: bool = False
    sampling: SamplingParams = NEUTRAL
    logprobs: int | None = None
    shares_prompt_with: "SlotRequest | None" = None
    grammar: Grammar | None = None
    result: RequestResult = field(init=False)

    def __post_init__(self):
        if not self.prompt_ids:
            raise DSparkError("empty prompt: give at least one token")
        self.logprobs = check_top_logprobs(self.logprobs)
        self.result = RequestResult(prompt_ids=list(self.prompt_ids))


def choices_queued(queue) -> int:
    """The queue's first request and the other choices of its prompt queued right behind it (n > 1)."""
    head, size = queue[0], 1
    while size < len(queue) and queue[size].shares_prompt_with is head:
        size += 1
    return size


@dataclass
class Slot:
    """What one batch slot holds besides its cache rows: the request and its noise generator (per-request decoding
    state such as sampling parameters, logprobs or grammar state belongs here)."""

    request: SlotRequest | None = None
    noise: RequestNoise | None = None
