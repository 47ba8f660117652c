"""Sampling parameters beyond temperature (top_k, top_p, min_p, penalties, logit_bias): one request's contract, and
the per-slot arrays the sampler graph reads (dspark.export.graphs.SamplerGraph).

A round in which any live request sets one runs the verifier as always, then the sampler on its logits for those
requests' rows: acceptance and resampling against the processed target distribution, so DSpark's tokens are
distributed exactly as autoregressive sampling from that distribution. Drafts are proposed from the drafter's own
distribution (temperature only): exact whatever the proposal, fewer accepted where processing moves mass."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dspark.errors import DSparkError
from dspark.runtime.backend import host
from dspark.schema import check_number, is_int

BIAS_LIMIT = 100.0  # OpenAI's logit_bias range
PENALTY_LIMIT = 2.0  # OpenAI's presence / frequency penalty range
MAX_REPETITION = 100.0


@dataclass(frozen=True)
class SamplingParams:
    """top_k: keep the k most likely tokens (0: all). top_p: keep the smallest most-likely set holding this much
    probability (1: all). min_p: keep tokens of at least min_p x the top probability (0: all).
    repetition_penalty: divide the positive logits of tokens seen in the prompt or output (multiply the negative
    ones) by it (1: off). presence_penalty / frequency_penalty: subtract p x [emitted] + f x count (0: off).
    logit_bias: {token id: added logit}. Applied as vLLM does: bias, penalties, temperature, min_p, top_k, top_p."""

    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)

    def __post_init__(self):
        if not is_int(self.top_k) or self.top_k < 0:
            raise DSparkError(f"top_k must be an integer of at least 0 (0: off), not {self.top_k!r}")
        _number("top_p", self.top_p, 0.0, 1.0, open_low=True)
        _number("min_p", self.min_p, 0.0, 1.0)
        _number("repetition_penalty", self.repetition_penalty, 0.0, MAX_REPETITION, open_low=True)
        _number("presence_penalty", self.presence_penalty, -PENALTY_LIMIT, PENALTY_LIMIT)
        _number("frequency_penalty", self.frequency_penalty, -PENALTY_LIMIT, PENALTY_LIMIT)
        if not isinstance(self.logit_bias, dict):
            raise DSparkError("logit_bias must map token ids to numbers")
        for token, bias in self.logit_bias.items():
            if not is_int(token) or token < 0:
                raise DSparkError(f"logit_bias key {token!r} is not a token id")
            _number(f"logit_bias[{token}]", bias, -BIAS_LIMIT, BIAS_LIMIT)

    @property
    def neutral(self) -> bool:
        """Whether these parameters leave the distribution as temperature alone makes it."""
        return self == NEUTRAL

    @property
    def moves_argmax(self) -> bool:
        """Whether a greedy request decodes differently: logit_bias and the penalties can; min_p, top_k and top_p
        always keep the most likely token, so greedy decoding ignores them."""
        return bool(self.logit_bias) or self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 \
            or self.frequency_penalty != 0.0

    def check_vocab(self, vocab: int) -> None:
        """logit_bias keys must be token ids of this vocabulary."""
        outside = [t for t in self.logit_bias if t >= vocab]
        if outside:
            raise DSparkError(f"logit_bias key {outside[0]} is outside the vocabulary (token ids 0..{vocab - 1})")


def _number(name: str, value, lo: float, hi: float, open_low: bool = False) -> None:
    value = check_number(value, name)  # a finite real number
    if not ((value > lo if open_low else value >= lo) and value <= hi):
        low = f"above {lo:g}" if open_low else f"at least {lo:g}"
        raise DSparkError(f"{name} must be a number {low} and at most {hi:g}, not {value!r}")


NEUTRAL = SamplingParams()


class SamplingRows:
    """Per-slot sampling parameters and what the penalties read: the output tokens' counts and the prompt's tokens
    (vLLM's reading: repetition_penalty sees the prompt and the output, presence and frequency the output only).
    vocab 0: slots without a sampler graph, whose requests all sample with temperature alone."""

    def __init__(self, batch: int, vocab: int):
        self.vocab = vocab
        self.on = np.zeros(batch, dtype=bool)
        self.top_k = np.zeros(batch, dtype=np.int64)
        self.top_p = np.ones(batch, dtype=np.float32)
        self.min_p = np.zeros(batch, dtype=np.float32)
        self.repetition = np.ones(batch, dtype=np.float32)
        self.presence = np.zeros(batch, dtype=np.float32)
        self.frequency = np.zeros(batch, dtype=np.float32)
        self.counts = np.zeros((batch, vocab), dtype=np.float32)
        self.prompt_seen = np.zeros((batch, vocab), dtype=np.float32)
        self.bias = np.zeros((batch, vocab), dtype=np.float32)
        self._rows = ("top_k", "top_p", "min_p", "repetition", "presence", "frequency", "counts",
                      "prompt_seen", "bias")

    def open(self, slot: int, params: SamplingParams, prompt_ids: list[int], greedy: bool,
             constrained: bool = False) -> None:
        """A request (its parameters checked by check_sampling) takes the slot; a slot that is off keeps stale rows,
        which nothing reads. constrained: a grammar masks the request's logits (dspark.runtime.grammar)."""
        self.on[slot] = runs_sampler(params, greedy, constrained)  # else: the verifier's own rule
        if not self.on[slot]:
            return
        self.top_k[slot], self.top_p[slot], self.min_p[slot] = params.top_k, params.top_p, params.min_p
        self.repetition[slot] = params.repetition_penalty
        self.presence[slot], self.frequency[slot] = params.presence_penalty, params.frequency_penalty
        self.counts[slot] = 0.0
        self.prompt_seen[slot] = 0.0
        if params.repetition_penalty != 1.0:
            self.prompt_seen[slot, np.asarray(prompt_ids, dtype=np.int64)] = 1.0
        self.bias[slot] = 0.0
        for token, bias in params.logit_bias.items():
            self.bias[slot, token] = bias

    def emitted(self, slot: int, tokens: list[int]) -> None:
        """Tokens the request has just been given (the penalties count them from the next row on)."""
        if self.on[slot] and tokens:
            np.add.at(self.counts[slot], np.asarray(tokens, dtype=np.int64), 1.0)

    def move(self, src: int, dst: int) -> None:
        self.on[dst], self.on[src] = self.on[src], False
        if self.on[dst]:
            for name in self._rows:
                array = getattr(self, name)
                array[dst] = array[src]

    def feeds(self, slots: np.ndarray) -> dict[str, np.ndarray]:
        """The sampler's per-request inputs for these slots (in this order)."""
        return {"counts": self.counts[slots], "prompt_seen": self.prompt_seen[slots], "logit_bias": self.bias[slots],
                "repetition_penalty": self.repetition[slots], "presence_penalty": self.presence[slots],
                "frequency_penalty": self.frequency[slots], "top_k": self.top_k[slots], "top_p": self.top_p[slots],
                "min_p": self.min_p[slots]}

    def sampler_feeds(self, logits, verifier_feeds: dict, rows: np.ndarray, slots: np.ndarray) -> dict:
        """The sampler's inputs for these rows of a verifier step (slots: the rows' slots): its logits, the draft
        each row judges, the step's acceptance inputs and the slots' parameters, as host arrays."""
        draft_next = judged_tokens(verifier_feeds["tokens"], verifier_feeds["logit_index"])
        return {"logits": host(logits)[rows], "draft_next": draft_next[rows],
                **{name: host(verifier_feeds[name])[rows] for name in STEP_INPUTS}, **self.feeds(slots)}


def runs_sampler(params: SamplingParams, greedy: bool, constrained: bool = False) -> bool:
    """Whether a request's rows are accepted by the sampler graph: a constrained request's always (its logits are
    masked), a greedy request's where its parameters can move the argmax."""
    return constrained or (params.moves_argmax if greedy else not params.neutral)


def judged_tokens(tokens: np.ndarray, logit_index: np.ndarray) -> np.ndarray:
    """The token each verify row judges (the sampler's draft_next): the one after the row's position, as the
    verifier finds it in-graph (the last row: padding)."""
    return np.take_along_axis(tokens, np.minimum(logit_index + 1, tokens.shape[1] - 1), axis=1)


STEP_INPUTS = ("verify_len", "temperature", "accept_noise", "sample_noise", "draft_probs")  # the verifier's, again


def check_sampling(rows: SamplingRows, params: SamplingParams, backend: str, constrained: bool = False) -> None:
    """DSparkError unless slots with these sampling rows (of no vocabulary: no sampler graph) can sample with
    `params` (constrained: under a grammar)."""
    if constrained and not rows.vocab:
        raise DSparkError(f"this bundle or backend ({backend}) runs no sampler graph, which structured outputs "
                          f"need: re-export the bundle with this dspark (`dspark-export onnx`) and run it on "
                          f"onnxruntime")
    if params.neutral:
        return
    if not rows.vocab:
        raise DSparkError(
            f"this bundle or backend ({backend}) runs no sampler graph, so it samples with temperature alone: drop "
            f"top_k, top_p, min_p, the penalties and logit_bias, or re-export the bundle with this dspark "
            f"(`dspark-export onnx`) and run it on onnxruntime")
    params.check_vocab(rows.vocab)
