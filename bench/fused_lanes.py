"""Several requests per fused verifier step: the fused graph with lanes (each request's attention on its own, every
other kernel on all rows at once) against the graph built before lanes (batch-1 and one-position steps fused;
drafted rounds of several requests on the portable graph, or, with int8 activations, one request at a time).

  python bench/fused_lanes.py --bundle BUNDLE [--lanes 1,8] [--batches 1,4,8] [--policies ar,all]

Each lane count gets a linked copy of BUNDLE (under --work) whose fused twin is rebuilt with it; one run, the
variants taking turns per (batch, policy, pass), medians over passes. Writes JSON (default
bench/results/fused_lanes.json): decode tokens/s (all requests together, after prefill), which graph took the steps,
and whether every variant gave the same tokens.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from common import dev_rows, machine, write_json


def variant(bundle: Path, lanes: int, work: Path) -> Path:
    from dspark.bundle import Manifest
    from dspark.export.twins.fused_bundle import add_fused_verifier
    from dspark.files import linked_copy

    folder = work / f"{bundle.name}-lanes{lanes}"
    if not folder.exists():
        linked_copy(bundle, folder)
        manifest = Manifest.read(folder)
        add_fused_verifier(folder, manifest, "gqa", lanes)
        manifest.write(folder)
    return folder


def decode(rt, prompts: list[list[int]], batch: int, policy: str, max_new: int) -> tuple[float, list, dict]:
    from dspark.runtime import DecodeOptions

    before = dict(rt.backend.verifier.steps)
    dec = rt.decoder(prompts, DecodeOptions(max_tokens=max_new, batch_size=batch, policy=policy))
    for _ in dec:
        pass
    seconds = dec.times.total - dec.times.prefill
    tokens = sum(len(r.token_ids) for r in dec.results)
    steps = {k: v - before.get(k, 0) for k, v in rt.backend.verifier.steps.items()}
    return tokens / seconds, [r.token_ids for r in dec.results], steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", required=True, type=Path, help="a bundle with a fused verifier")
    ap.add_argument("--lanes", default="1,8", help="lane counts to compare")
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--policies", default="ar,all")
    ap.add_argument("--max-tokens", "--max-new-tokens", dest="max_tokens", type=int, default=48)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--work", type=Path, default=Path("/tmp/dspark-lanes"))
    ap.add_argument("--prompts", default=None, help="JSONL prompts (default: the dev set)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "fused_lanes.json"))
    args = ap.parse_args()

    from dspark.runtime import Runtime

    lanes = [int(n) for n in args.lanes.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    policies = args.policies.split(",")
    args.work.mkdir(parents=True, exist_ok=True)
    runtimes = {n: Runtime(variant(args.bundle, n, args.work), weights="packed") for n in lanes}
    rt0 = runtimes[lanes[0]]
    texts = [r["prompt"] for r in dev_rows(args.prompts, per_domain=2)]
    prompts = [rt0.encode(t) for t in (texts * 8)[:max(batches)]]
    for rt in runtimes.values():  # load every session a step may need before timing
        decode(rt, prompts[:max(batches)], max(batches), "all", 4)
    rows = []
    for batch in batches:
        for policy in policies:
            rates: dict[int, list[float]] = {n: [] for n in lanes}
            tokens, steps = {}, {}
            for _ in range(args.passes):
                for n, rt in runtimes.items():
                    rate, tokens[n], steps[n] = decode(rt, prompts[:batch], batch, policy, args.max_tokens)
                    rates[n].append(rate)
            row = {"batch": batch, "policy": policy,
                   "tokens_per_s": {str(n): round(float(np.median(r)), 2) for n, r in rates.items()},
                   "passes": {str(n): [round(x, 2) for x in r] for n, r in rates.items()},
                   "steps": {str(n): s for n, s in steps.items()},
                   "same_tokens": all(t == tokens[lanes[0]] for t in tokens.values())}
            rows.append(row)
            print(row, flush=True)
    write_json(args.out, {"bundle": str(args.bundle), "machine": machine(), "lanes": lanes,
                          "max_new_tokens": args.max_tokens, "passes": args.passes,
                          "time": time.strftime("%Y-%m-%d %H:%M"), "rows": rows})


if __name__ == "__main__":
    main()
