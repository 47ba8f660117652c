"""Per-request uniform noise, so a request samples the same tokens whatever else shares its batch.

Every request owns a generator seeded by (seed, request index) and draws a fixed amount per step:
prefill and AR steps: accept 1 + sample 1; DSpark rounds: draft Bk, accept Bk + 1 (the first T are used), sample 1.
The PyTorch reference and the runtime both draw through this module.
"""
from __future__ import annotations

import numpy as np

from dspark.errors import DSparkError

GREEDY_EPS = 1e-5  # a temperature below this decodes greedily (dspark.models.sampling)


class RequestNoise:
    def __init__(self, seed: int, request: int):
        if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 0 for v in (seed, request)):
            raise DSparkError(f"a noise seed is a non-negative integer, not {seed!r} (request {request!r})")
        self.rng = np.random.default_rng([int(seed), int(request)])

    def draw(self, n: int) -> np.ndarray:
        """n uniforms in (0, 1] (float32)."""
        return (1.0 - self.rng.random(n)).astype(np.float32)


def stack(noises: list[RequestNoise | None], n: int) -> np.ndarray:
    """[B, n]: one row per slot; empty slots (None) get ones and consume nothing."""
    out = np.ones((len(noises), n), dtype=np.float32)
    for i, src in enumerate(noises):
        if src is not None:
            out[i] = src.draw(n)
    return out


class PlainStepNoise(RequestNoise):
    """A request's noise as autoregressive steps draw it, for a request decoding autoregressively inside a
    drafting batch: one uniform per draw (accept, then sample); the verifier never reads the accept noise past
    verify_len 0, so the rest is padding. Equal to RequestNoise for one-position draws."""

    def draw(self, n: int) -> np.ndarray:
        out = np.ones(n, dtype=np.float32)
        out[0] = super().draw(1)[0]
        return out
