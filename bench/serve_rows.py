"""What a serving round costs by the rows it computes, in-process on a bundle (no HTTP):

  1. the verifier step alone at 1 vs --batch-size rows (autoregressive decodes, same prompt and capacity);
  2. the engine at concurrency 1 with rounds sized to the live rows vs the old full-width rounds;
  3. at concurrency 4 and --batch-size, tokens/s of drafting (--policy) vs autoregressive requests, and a round
     of the drafting engine that the gate skips vs an autoregressive round (per-round wall time from the engine's
     round callbacks, and its part outside the verifier step), with the drafted rounds the gate still runs.

Variants take turns in every repetition, so the VM's drift hits them alike.

    python bench/serve_rows.py --bundle ~/.cache/dspark/bundles/<demo bundle> --out bench/results/serve_rows.json
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from common import ROOT, dev_rows, machine, write_json

from dspark.runtime import DecodeOptions, Runtime  # noqa: E402
from dspark.runtime.decoder import Decoder  # noqa: E402
from dspark.runtime.engine import Engine, EngineOptions  # noqa: E402
from dspark.runtime.engine_request import EngineObserver, RequestOptions, RoundStats  # noqa: E402


class VerifyTime:
    """The slot machine's RoundObserver: the verifier step time of the latest round."""

    wants: set = set()

    def __init__(self):
        self.seconds = 0.0

    def round(self, record) -> None:
        self.seconds = record.verify_seconds

    def prefilled(self, record) -> None:
        pass


class RoundClock(EngineObserver):
    """Wall time between consecutive round callbacks, by whether the round drafted, and of a plain round the part
    outside its verifier step (`host`: the slot machine's own work, which the VM's drift in step times hides)."""

    def __init__(self):
        self.verify = VerifyTime()  # told of each round by the slot machine just before the engine's stats
        self.reset()

    def round(self, stats: RoundStats) -> None:
        now = time.perf_counter()
        if self.last is not None:
            kind = "drafted" if stats.drafted else "plain"
            self.seconds[kind].append(now - self.last)
            if kind == "plain":
                self.seconds["host"].append(now - self.last - self.verify.seconds)
        self.last = now

    def reset(self) -> None:
        self.last, self.seconds = None, {"drafted": [], "plain": [], "host": []}


def verifier_step_ms(rt: Runtime, prompt: list[int], rows: int, capacity: int, tokens: int) -> float:
    dec = Decoder(rt.backend, rt.manifest, [prompt] * rows,
                  DecodeOptions(max_tokens=tokens, policy="ar", batch_size=rows), capacity=capacity)
    for _ in dec:
        pass
    return 1e3 * dec.times.verify / dec.times.rounds


def engine_tokens_per_s(engine: Engine, prompts: list[list[int]], concurrency: int, max_tokens: int,
                        policy: str | None) -> float:
    start = time.perf_counter()
    requests = [engine.submit(p, RequestOptions(max_tokens=max_tokens, policy=policy))
                for p in prompts[:concurrency]]
    tokens = sum(len(r.wait().token_ids) for r in requests)
    return tokens / (time.perf_counter() - start)


def median(values) -> float | None:
    return round(float(np.median(values)), 3) if len(values) else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "serve_rows.json")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-context", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--policy", default="schedule+gate")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-spin", action="store_true", help="Threads sleep between kernels (dspark serve --no-spin).")
    args = ap.parse_args()
    rt = Runtime(args.bundle, spin=not args.no_spin)  # as dspark serve runs it
    prompts = [rt.encode(r["prompt"]) for r in dev_rows(None, per_domain=3)][:args.batch_size]
    prompts = (prompts * args.batch_size)[:args.batch_size]
    clock = RoundClock()
    engine = Engine(rt, EngineOptions(batch_size=args.batch_size, policy=args.policy,
                                      max_context=args.max_context), observer=clock).start()
    engine.slots.observers.append(clock.verify)
    engine.warm_up(prompts[0], 8)
    steps = {1: [], args.batch_size: []}
    c1 = {"live_rows": {"ar": [], "dspark": []}, "all_rows": {"ar": [], "dspark": []}}
    levels = sorted({4, args.batch_size})
    full = {c: {"ar": [], "dspark": []} for c in levels}
    rounds = {c: {"ar_plain": [], "dspark_plain": [], "dspark_drafted": [], "ar_host": [], "dspark_host": []}
              for c in levels}
    for rep in range(args.reps):
        for rows in (steps if rep % 2 == 0 else list(steps)[::-1]):
            steps[rows].append(verifier_step_ms(rt, prompts[0], rows, args.max_context, args.max_tokens))
        for narrow in ((True, False) if rep % 2 == 0 else (False, True)):
            engine.slots.narrows = narrow  # False: every round computes all --batch-size rows (as before)
            for policy in ("ar", "dspark"):
                c1["live_rows" if narrow else "all_rows"][policy].append(engine_tokens_per_s(
                    engine, prompts, 1, args.max_tokens, "ar" if policy == "ar" else None))
        engine.slots.narrows = True
        for c in levels:
            for policy in (("ar", "dspark") if rep % 2 == 0 else ("dspark", "ar")):
                clock.reset()
                full[c][policy].append(engine_tokens_per_s(engine, prompts, c, args.max_tokens,
                                                           "ar" if policy == "ar" else None))
                rounds[c][f"{policy}_plain"] += clock.seconds["plain"]
                rounds[c][f"{policy}_host"] += clock.seconds["host"]
                if policy == "dspark":
                    rounds[c]["dspark_drafted"] += clock.seconds["drafted"]
        print(json.dumps({"rep": rep, "step_ms": steps, "c1": c1, "full": full}), flush=True)
    engine.close()
    report = {
        "bundle": str(args.bundle), "machine": machine(), "args": {k: str(v) for k, v in vars(args).items()},
        "verifier_step_ms": {f"rows_{k}": {"median": median(v), "runs": [round(x, 2) for x in v]}
                             for k, v in steps.items()},
        "engine_c1_tokens_per_s": {kind: {p: {"median": median(v), "runs": [round(x, 2) for x in v]}
                                          for p, v in by.items()} for kind, by in c1.items()},
        "engine_tokens_per_s": {f"c{c}": {p: {"median": median(v), "runs": [round(x, 2) for x in v]}
                                          for p, v in by.items()} for c, by in full.items()},
        "engine_round_ms": {f"c{c}": {k: {"median": median(1e3 * np.asarray(v)), "rounds": len(v)}
                                      for k, v in by.items()} for c, by in rounds.items()},
    }
    write_json(args.out, report)
    print(json.dumps({k: v for k, v in report.items() if k not in ("machine", "args")}, indent=1))


if __name__ == "__main__":
    main()
