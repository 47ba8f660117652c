"""Log-probabilities of the tokens a request is given (OpenAI's logprobs / top_logprobs).

A token's log-probability is the one the processed target distribution gives it at the position it was emitted:
the distribution autoregressive decoding samples that token from (temperature, and for a request with sampling
parameters bias, penalties, min_p, top_k and top_p: the sampler graph's `logprobs` output); a greedy request reports
the distribution at temperature 1. A token accepted as a draft or resampled after a rejection reports the target's
log-probability, not the drafter's or the residual's: what autoregressive decoding would report for it."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dspark.errors import DSparkError
from dspark.noise import GREEDY_EPS
from dspark.schema import is_int

MAX_TOP_LOGPROBS = 20  # OpenAI's top_logprobs limit


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token: its log-probability and the `top` most likely tokens of its position (id, logprob), most
    likely first (-inf: a token the request's filters removed)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def check_top_logprobs(value) -> int | None:
    """None: no logprobs; k in 0..MAX_TOP_LOGPROBS: each token's log-probability and its position's k most likely."""
    if value is None:
        return None
    if not is_int(value) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise DSparkError(f"top logprobs must be an integer in 0..{MAX_TOP_LOGPROBS}, not {value!r}")
    return int(value)


def log_softmax(logits: np.ndarray, temperature: float) -> np.ndarray:
    """Rows of logits [K, V] -> their log-probabilities at this temperature (greedy: at temperature 1)."""
    z = np.asarray(logits, dtype=np.float32) / (temperature if temperature >= GREEDY_EPS else 1.0)
    top = z.max(axis=-1, keepdims=True)
    return z - (top + np.log(np.exp(z - top).sum(axis=-1, keepdims=True)))


def token_logprobs(rows: np.ndarray, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Row j of log-probabilities [K, V] is the distribution tokens[j] was emitted from."""
    entries = []
    for row, token in zip(rows, tokens):
        best: tuple[tuple[int, float], ...] = ()
        if top:
            ids = np.argpartition(-row, top - 1)[:top]
            ids = ids[np.lexsort((ids, -row[ids]))]  # most likely first, ties by id
            best = tuple((int(i), float(row[i])) for i in ids)
        entries.append(TokenLogprob(int(token), float(row[token]), best))
    return entries


class StepLogprobs:
    """One verifier step's log-probabilities for the rows whose requests asked for them, computed only for the
    positions a request commits. logits [B, K, V]: the verifier's; processed: row -> the sampler's logprobs [K, V]
    (rows of requests with sampling parameters); temperature [B]."""

    def __init__(self, logits: np.ndarray, temperature: np.ndarray, processed: dict[int, np.ndarray]):
        self.logits, self.temperature, self.processed = logits, temperature, processed

    def entries(self, row: int, tokens: list[int], top: int) -> list[TokenLogprob]:
        """Row `row`'s committed tokens (position j emitted tokens[j])."""
        if row in self.processed:
            rows = self.processed[row][:len(tokens)]
        else:
            rows = log_softmax(self.logits[row, :len(tokens)], float(self.temperature[row]))
        return token_logprobs(rows, tokens, top)


def check_logprobs(backend, sampled: bool) -> None:
    """DSparkError unless this backend can report log-probabilities (sampled: for a request whose sampling
    parameters run the sampler graph)."""
    if not backend.logits or backend.device_resident:
        raise DSparkError(f"this bundle or backend ({backend.kind}) gives no logits to compute logprobs from: "
                          f"re-export the bundle with this dspark (`dspark-export onnx`) and run it on onnxruntime")
    if sampled and "logprobs" not in backend.sampler.outputs:
        raise DSparkError("this bundle's sampler graph gives no logprobs for requests with sampling parameters: "
                          "re-export the bundle with this dspark (`dspark-export onnx`)")
