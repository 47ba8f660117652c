"""Profile the verifier's steps/s per batch-token count on the actual backend, for the prefix scheduler.

The ONNX Runtime verifier runs padded [R, T] batches, so a step over n = R * T tokens is measured at that shape
for R = 1..max_batch and T = 1..Bk+1; counts in between (used by the flat layout) are interpolated.
Stored in the manifest as calibration.sps_table (entry n-1 = steps/s at n tokens) with the raw measurements."""
from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from dspark.bundle import Manifest
from dspark.calibration import sps_cache
from dspark.kv_layout import kv_groups
from dspark.runtime.measure import needs_sps_table
from dspark.runtime.scheduler import VerifyPolicy

clock = time.perf_counter


def step_feeds(cache, n: int, draft_probs) -> dict:
    """Verifier inputs for a greedy step over n new tokens (n - 1 drafts) of every request in `cache`, after its
    committed lengths; `draft_probs` [R, block, vocab] on the cache's backend."""
    r = len(cache.lengths)
    return {"tokens": np.ones((r, n), np.int64), "past_mask": cache.past_mask(),
            "logit_index": np.broadcast_to(np.arange(n, dtype=np.int64), (r, n)).copy(),
            "verify_len": np.full(r, n - 1, np.int64), "temperature": np.zeros(r, np.float32),
            "accept_noise": np.ones((r, n), np.float32), "sample_noise": np.ones(r, np.float32),
            "draft_probs": draft_probs, **cache.feeds}


def verifier_step_seconds(rt, cache, positions: list[int], reps: int, warmup: int = 1) -> dict[int, float]:
    """Median seconds of one verifier step over each count of new tokens in `positions`, for every request of
    `cache` (a KV cache of the runtime's backend whose committed lengths set the context), after `warmup` untimed
    rounds. The counts are timed in turn within each repetition, so drift of the machine's speed (frequent on
    shared VMs) hits them alike and their ratios hold."""
    manifest = rt.manifest
    cache.fit(max(positions))  # (a host cache: as wide as the steps reach)
    draft_probs = rt.backend.zeros((len(cache.lengths), manifest.block_size, manifest.target["vocab_size"]),
                                   dtype=np.float32)
    feeds = {n: step_feeds(cache, n, draft_probs) for n in positions}
    times: dict[int, list[float]] = {n: [] for n in positions}
    for rep in range(warmup + reps):
        for n in positions:
            t0 = clock()
            rt.backend.verifier.run(feeds[n])
            if rep >= warmup:
                times[n].append(clock() - t0)
    return {n: float(np.median(t)) for n, t in times.items()}


def profile(rt, max_batch: int = 8, context: int = 256, reps: int = 9) -> dict:
    t = rt.manifest.target
    bk = rt.manifest.block_size
    backend = rt.backend
    fixed = backend.fixed_capacity  # TensorRT engines: caches at the build's --max-context
    if fixed:
        context = min(context, fixed - bk - 1)
    max_batch = min(max_batch, backend.max_batch or max_batch)
    measured: dict[int, float] = {}
    raw = []
    for r in range(1, max_batch + 1):
        cache = backend.grouped_kv_cache(kv_groups(t), r, fixed or context + bk + 1)
        for slot in range(r):
            cache.commit(slot, context)
        seconds = verifier_step_seconds(rt, cache, list(range(1, bk + 2)), reps, warmup=2)
        for steps in range(1, bk + 2):
            sps = 1.0 / seconds[steps]
            n = r * steps
            measured[n] = max(measured.get(n, 0.0), sps)  # the best shape reaching n tokens
            raw.append({"batch": r, "positions": steps, "tokens": n, "steps_per_s": sps})
    ns = np.array(sorted(measured))
    table = np.interp(np.arange(1, ns.max() + 1), ns, [measured[n] for n in ns])
    return {"sps_table": [float(x) for x in table], "sps_measurements": raw, "sps_context": context,
            "sps_backend": rt.backend.kind}


def write_sps(bundle: Path, result: dict) -> None:
    manifest = Manifest.read(bundle)
    manifest.calibration.update(result)
    manifest.write(bundle)


def ensure_sps_table(rt, policy: VerifyPolicy | str | None = None, max_batch: int = 1,
                     say: Callable[[str], None] | None = None, store: bool = True) -> bool:
    """Profile the SPS table on first use when `policy` (any policy if None) needs one and the bundle has none
    covering `max_batch` requests: kept in `rt.manifest`, so decoders made afterwards use it, and with `store` also
    written to the bundle's manifest (the demo's own bundle; `dspark run` and `bench` never change a bundle the user
    did not name as output, so their profile is kept in the user cache, dspark.calibration.sps_cache, and reused).
    A batch-1 profile takes seconds; beyond the batches it covers, a table extrapolates linearly, which overrates the
    cost of larger batches.
    Torch-free: the run, bench and demo commands call it before decoding. Returns True when it profiled."""
    if policy is not None and not needs_sps_table(policy):
        return False
    needed = min(max_batch, rt.backend.max_batch or max_batch) * (rt.manifest.block_size + 1)
    table = rt.manifest.calibration.get("sps_table") or []
    if len(table) >= needed:
        return False
    say = say or (lambda message: None)
    cached = None if store else sps_cache.load(rt)
    if cached is not None and len(cached["sps_table"]) >= needed:
        rt.manifest.calibration.update(cached)
        say(f"using the SPS table profiled earlier for {rt.folder} on this machine ({sps_cache.entry_path(rt)})")
        return False
    batches = "batch 1" if max_batch == 1 else f"batch 1..{max_batch}"
    what = "no SPS table" if not table else f"the SPS table covers {len(table)} batch tokens"
    kept = "stored in its manifest" if store else "kept in the user cache (`dspark calibrate --sps` stores one)"
    say(f"{what} in {rt.folder}: profiling the verifier's steps/s at {batches}, {kept}")
    result = profile(rt, max_batch=max_batch)
    rt.manifest.calibration.update(result)
    if not store:
        sps_cache.store(rt, result)
        return True
    try:
        write_sps(rt.folder, result)
    except OSError as e:
        say(f"could not store the SPS table in {rt.folder} ({e.strerror}): it is profiled again next time")
    return True
