"""One measured batched run through the runtime (used by `dspark bench` and bench/scheduler.py)."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np

from dspark.runtime.gate import step_seconds
from dspark.runtime.options import DecodeOptions
from dspark.runtime.scheduler import VerifyPolicy


@dataclass
class BatchRun:
    policy: str
    concurrency: int
    requests: int  # that ran
    skipped: int  # prompts too long for the context with max_tokens: they did not run
    tokens: int
    seconds: float
    tokens_per_s: float  # aggregate
    per_request_tokens_per_s: float  # median over requests, admission to finish
    tau: float
    mean_verify_budget: float  # drafts verified per request per round
    rounds: int
    drafted_rounds: int  # rounds that ran the draft (all of them unless the draft gate skipped some)
    padded_positions: int  # verifier positions computed (batch x T per round, the padded layout we run)
    useful_positions: int  # positions of live requests' anchor + verified drafts
    flat_time_ratio: float | None  # SPS-table estimate: verifier time if flattened / time padded

    def as_dict(self) -> dict:
        return asdict(self)


def run_batch(rt, prompts: list, concurrency: int, policy: VerifyPolicy | str, max_tokens: int = 64,
              temperature: float = 0.0, seed: int = 0, say: Callable[[str], None] = lambda line: None) -> BatchRun:
    """`say` gets one line when prompts too long for the context are skipped (the counts are of those that ran)."""
    options = DecodeOptions(max_tokens=max_tokens, temperature=temperature, seed=seed, policy=policy,
                            batch_size=concurrency)
    dec = rt.decoder(prompts, options)
    if dec.skipped():
        say(dec.skipped())
    ran = [r for i, r in enumerate(dec.results) if i not in dec.refused]
    t0 = time.perf_counter()
    for _ in dec:
        pass
    seconds = time.perf_counter() - t0
    tokens = sum(len(r.token_ids) for r in ran)
    proposed = [p for r in ran for p in r.proposed]
    committed = [c for r in ran for c in r.committed]
    return BatchRun(policy=str(options.policy), concurrency=concurrency, requests=len(ran),
                    skipped=len(dec.refused), tokens=tokens, seconds=seconds, tokens_per_s=tokens / seconds,
                    per_request_tokens_per_s=float(np.median([r.tokens_per_s for r in ran])),
                    tau=float(np.mean(committed)) if committed else 1.0,
                    mean_verify_budget=float(np.mean(proposed)) if proposed else 0.0, rounds=dec.times.rounds,
                    drafted_rounds=dec.times.drafted,
                    padded_positions=int(sum(dec.times.round_tokens)),
                    useful_positions=int(sum(dec.times.round_useful)),
                    flat_time_ratio=flat_time_ratio(dec.times.round_tokens, dec.times.round_useful,
                                                    rt.manifest.calibration.get("sps_table")))


def needs_sps_table(policy: VerifyPolicy | str) -> bool:
    """Whether decoding with `policy` reads the verifier's steps/s table (Algorithm 1, top-K, the draft gate)."""
    policy = VerifyPolicy.parse(policy) if isinstance(policy, str) else policy
    return policy.kind in ("schedule", "topk") or policy.gate


def flat_time_ratio(padded: list[int], useful: list[int], sps: list[float] | None) -> float | None:
    """Padding vs flattening, measured through the verifier's own cost curve: the summed step time (1 / steps/s
    at n tokens) of the useful positions over that of the padded positions we actually ran."""
    if not sps or not padded:
        return None
    sps = np.asarray(sps, dtype=np.float64)
    return float(sum(step_seconds(sps, n) for n in useful) / sum(step_seconds(sps, n) for n in padded))
