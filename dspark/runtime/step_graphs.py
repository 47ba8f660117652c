"""The graph calls of the slot machine's rounds (dspark.runtime.slots): each graph's run with one-line errors, and
the verifier's step with the sampler on its logits and the log-probabilities requests asked for."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dspark.errors import DSparkError
from dspark.runtime.backend import STEP_OUTPUTS, Backend
from dspark.runtime.grammar import GrammarRows
from dspark.runtime.logprobs import StepLogprobs
from dspark.runtime.sampling import SamplingRows


@dataclass
class Verified:
    """One verifier step's decisions per row, what the caches take, and the log-probabilities asked for."""

    accepted: np.ndarray
    next_token: np.ndarray
    taps: object
    new_kv: object
    logprobs: StepLogprobs | None
    dead_ends: list[int]  # rows of constrained requests whose grammar allows no token: they end with an error


class StepGraphs:
    """sampling: the slots' sampling rows; top_logprobs [batch]: -1, or the top tokens a slot's request reports;
    grammar: the slots' matchers; kv_outputs: the verifier's new K/V outputs (new_kv, or new_kv.{g} per KV group)."""

    def __init__(self, backend: Backend, sampling: SamplingRows, top_logprobs: np.ndarray, grammar: GrammarRows,
                 kv_outputs: list[str]):
        self.backend, self.sampling, self.top_logprobs = backend, sampling, top_logprobs
        self.grammar, self.kv_outputs = grammar, kv_outputs

    def run(self, graph: str, feeds: dict, fetch: list[str] | None = None) -> dict:
        """One graph call (fetch: the outputs wanted, when not the default ones); an engine's run-time failure (bad
        values, out of memory) becomes one DSparkError line."""
        try:
            run = getattr(self.backend, graph).run
            return run(feeds) if fetch is None else run(feeds, fetch=fetch)
        except DSparkError:
            raise
        except Exception as e:  # onnxruntime / TensorRT raise their own exception types
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise DSparkError(f"the {graph} graph failed at run time: {first[:300]}") from None

    def verify(self, feeds: dict, slots: np.ndarray) -> Verified:
        """The verifier's step on `feeds` (slots: each row's slot); rows of requests with sampling parameters are
        accepted by the sampler graph instead."""
        sampled = np.flatnonzero(self.sampling.on[slots])
        reported = self.top_logprobs[slots] >= 0
        logits = len(sampled) or reported.any()
        out = self.run("verifier", feeds, [*STEP_OUTPUTS, "logits", *self.kv_outputs] if logits else None)
        accepted, nxt = out["accepted"].numpy(), out["next_token"].numpy()
        processed, dead = {}, []
        if len(sampled):  # acceptance under the processed distributions (dspark.runtime.sampling)
            fetch = ["accepted", "next_token", "logprobs"] if reported[sampled].any() else None
            sampler_feeds = self.sampling.sampler_feeds(out["logits"], feeds, sampled, slots[sampled])
            dead = self._mask(sampler_feeds["logits"], feeds, sampled, slots)
            redone = self.run("sampler", sampler_feeds, fetch)
            accepted, nxt = np.array(accepted), np.array(nxt)
            accepted[sampled], nxt[sampled] = redone["accepted"].numpy(), redone["next_token"].numpy()
            if fetch:
                processed = dict(zip(sampled.tolist(), redone["logprobs"].numpy()))
        logprobs = StepLogprobs(out["logits"].numpy(), feeds["temperature"], processed) if reported.any() else None
        new_kv = [self.state(out[name]) for name in self.kv_outputs]
        return Verified(accepted, nxt, self.state(out["taps"]), new_kv[0] if len(new_kv) == 1 else new_kv, logprobs,
                        dead)

    def _mask(self, logits: np.ndarray, feeds: dict, sampled: np.ndarray, slots: np.ndarray) -> list[int]:
        """-inf where a constrained row's grammar refuses a token (logits: the sampled rows', a copy); returns the
        rows whose grammar allows none."""
        dead = []
        rows = feeds["logit_index"].shape[1]
        for k, row in enumerate(sampled):
            slot = int(slots[row])
            if self.grammar.matchers[slot] is None:
                continue
            allowed = self.grammar.masks(slot, feeds["tokens"][row, 1:], min(rows, int(feeds["verify_len"][row]) + 1))
            if allowed is None:
                dead.append(int(row))
            else:
                logits[k, :len(allowed)][~allowed] = -np.inf
        return dead

    def state(self, x):
        """A graph output the caches take: kept where it is on a device backend, else as a host array."""
        return x if self.backend.device_resident else x.numpy()
