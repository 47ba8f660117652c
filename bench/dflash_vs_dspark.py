"""DSpark against DFlash on one runtime: two drafters for the same target (e.g. `dspark train` with and without
`--markov-rank 0 --no-confidence --loss ce`, same data and steps), each in its own bundle, measured on the same
prompts: acceptance per block position and tau with every draft verified, then batch-1 tokens/s of each
verification policy against autoregressive decoding, the configurations taking turns (medians of --repeats).

  python bench/dflash_vs_dspark.py --dspark BUNDLE_A --dflash BUNDLE_B [--limit 12 --max-tokens 64]

A DFlash bundle decides with `schedule`/`static` on its position-wise acceptance prior (`dspark calibrate`); the
policies that need an SPS table profile one into the run if the bundle has none. Writes
bench/results/dflash_vs_dspark.json.
"""
from __future__ import annotations

import argparse
from collections import defaultdict

import numpy as np

from common import dev_rows, machine, position_acceptance, write_json

from dspark.calibration.sps import ensure_sps_table
from dspark.runtime import DecodeOptions, Runtime, VerifyPolicy
from dspark.runtime.measure import run_batch

POLICIES = {"dspark": ["all", "schedule+gate"], "dflash": ["all", "fixed:2", "schedule+gate"]}


def acceptance(rt: Runtime, prompts: list[str], max_tokens: int) -> dict:
    res = rt.generate(prompts, DecodeOptions(max_tokens=max_tokens, policy="all", batch_size=len(prompts)))
    committed = [c for r in res for c in r.committed]
    return {"tau": float(np.mean(committed)), "rounds": len(committed),
            **position_acceptance(res, rt.manifest.block_size)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dspark", required=True)
    ap.add_argument("--dflash", required=True)
    ap.add_argument("--prompts")
    ap.add_argument("--limit", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="bench/results/dflash_vs_dspark.json")
    args = ap.parse_args()
    rows = dev_rows(args.prompts, per_domain=args.limit // 3 or 1)[:args.limit]
    prompts = [r["prompt"] for r in rows]
    runtimes = {"dspark": Runtime(args.dspark), "dflash": Runtime(args.dflash)}
    report = {"machine": machine(), "prompts": len(prompts), "max_new_tokens": args.max_tokens,
              "bundles": {"dspark": args.dspark, "dflash": args.dflash}, "acceptance": {}, "speed": {}}
    for name, rt in runtimes.items():
        report["acceptance"][name] = acceptance(rt, prompts, args.max_tokens)
        report[f"{name}_prior"] = rt.manifest.acceptance_prior()
        for policy in POLICIES[name]:
            ensure_sps_table(rt, VerifyPolicy.parse(policy), max_batch=1, say=print, store=False)
        print(name, {k: report["acceptance"][name][k] for k in ("tau", "conditional_at")}, flush=True)
    speeds = defaultdict(list)
    configs = [("ar", "dspark", "ar")] + [(f"{n} {p}", n, p) for n, ps in POLICIES.items() for p in ps]
    for _ in range(args.repeats):
        for label, name, policy in configs:
            run = run_batch(runtimes[name], prompts, 1, policy, args.max_tokens)
            speeds[label].append({"tokens_per_s": run.tokens_per_s, "tau": run.tau,
                                  "verify_budget": run.mean_verify_budget})
            print(f"{label:>22}: {run.tokens_per_s:6.1f} tok/s, tau {run.tau:.2f}", flush=True)
    for label, runs in speeds.items():
        report["speed"][label] = {"tokens_per_s_median": float(np.median([r["tokens_per_s"] for r in runs])),
                                  "tau": runs[0]["tau"], "verify_budget": runs[0]["verify_budget"],
                                  "tokens_per_s": [r["tokens_per_s"] for r in runs]}
    write_json(args.out, report)


if __name__ == "__main__":
    main()
