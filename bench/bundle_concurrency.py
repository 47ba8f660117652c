"""Autoregressive serving throughput of several bundles of one model, in-process (no HTTP): the verifier step
alone at 1 and 8 rows (one prompt, --max-tokens steps), then the engine at concurrency levels (dev prompts, closed
batches, prefills included); every bundle in turn each repetition (the order reversed every other one), spinning
as `dspark serve` runs. For variants of the same weights (a rebuilt fused verifier, other accuracy levels).

    python bench/bundle_concurrency.py --bundle old=BUNDLE_A --bundle new=BUNDLE_B --out bench/results/X.json
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from common import ROOT, dev_rows, machine, write_json
from serve_rows import verifier_step_ms

from dspark.runtime import Runtime  # noqa: E402
from dspark.runtime.engine import Engine, EngineOptions  # noqa: E402
from dspark.runtime.engine_request import RequestOptions  # noqa: E402


def tokens_per_s(rt: Runtime, prompts: list[list[int]], levels: list[int], max_tokens: int,
                 context: int) -> dict[int, float]:
    engine = Engine(rt, EngineOptions(batch_size=max(levels), policy="ar", max_context=context)).start()
    engine.warm_up(prompts[0], 8)
    out = {}
    for c in levels:
        start = time.perf_counter()
        requests = [engine.submit(p, RequestOptions(max_tokens=max_tokens, policy="ar")) for p in prompts[:c]]
        out[c] = sum(len(r.wait().token_ids) for r in requests) / (time.perf_counter() - start)
    engine.close()
    return out


def dev_prompts(bundle, count: int) -> list[list[int]]:
    """`count` dev prompts as token ids (one per domain first, repeated as needed)."""
    rt = Runtime(bundle)
    prompts = [rt.encode(r["prompt"]) for r in dev_rows(None, per_domain=3)]
    rt.close()
    return (prompts * (1 + count // len(prompts)))[:count]


def take_turns(bundles: dict, prompts: list[list[int]], concurrency: list[int], max_tokens: int, context: int,
               reps: int) -> dict:
    """Every bundle in turn each repetition (the order reversed every other one): the verifier step at 1 and 8 rows,
    then engine tokens/s at each concurrency. Returns the report's verifier_step_ms and tokens_per_s."""
    runs = {name: {c: [] for c in concurrency} for name in bundles}
    steps = {name: {rows: [] for rows in (1, 8)} for name in bundles}
    for rep in range(reps):
        for name in (list(bundles) if rep % 2 == 0 else list(bundles)[::-1]):
            rt = Runtime(bundles[name], spin=True)
            for rows in steps[name]:
                steps[name][rows].append(round(verifier_step_ms(rt, prompts[0], rows, context, max_tokens), 3))
            for c, rate in tokens_per_s(rt, prompts, concurrency, max_tokens, context).items():
                runs[name][c].append(round(rate, 2))
            rt.close()
        print(json.dumps({"rep": rep, "steps": steps, "runs": runs}), flush=True)
    return {"verifier_step_ms": {name: {f"rows_{r}": {"median": round(float(np.median(v)), 3), "runs": v}
                                        for r, v in by.items()} for name, by in steps.items()},
            "tokens_per_s": {name: {f"c{c}": {"median": round(float(np.median(v)), 2), "runs": v}
                                    for c, v in by.items()} for name, by in runs.items()}}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", action="append", required=True, metavar="NAME=PATH")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "bundle_concurrency.json")
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",") if x], default=[1, 8, 16])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-context", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=4)
    args = ap.parse_args()
    bundles = dict(item.split("=", 1) for item in args.bundle)
    prompts = dev_prompts(next(iter(bundles.values())), max(args.concurrency))
    report = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()},
              **take_turns(bundles, prompts, args.concurrency, args.max_tokens, args.max_context, args.reps)}
    write_json(args.out, report)
    print(json.dumps({k: report[k] for k in ("verifier_step_ms", "tokens_per_s")}, indent=1))

if __name__ == "__main__":
    main()
