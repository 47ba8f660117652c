"""What each sampling parameter (and logprobs) costs a decode on a bundle (the demo's by default): ms per round, tau
and tokens/s of DSpark (policy all) and of its AR, per parameter set, sampled at one temperature and greedy, in one
run.

A request that sets top_k, top_p, min_p, a penalty or logit_bias takes its acceptance from the sampler graph on the
verifier's logits (dspark.runtime.sampling): an extra graph call and a copy of the logits per round, and drafts
proposed from the drafter's own distribution, so processing that moves mass costs accepted drafts. logprobs fetch the
logits too, and take a log-softmax and a top-k per emitted token on the host (dspark.runtime.logprobs). Parameter
sets (and bundles, given several: e.g. one whose sampler graph an older dspark wrote) take turns prompt by prompt
(a shared VM's drift hits all alike); medians over prompts.

  python bench/sampling_cost.py [--bundle BUNDLE ...] [--prompts 4] [--max-tokens 64] [--temperature 0.7]
                                [--only NAME ...] [--batch N]

With --batch N, N different prompts decode together (one request each, all with the parameters), and a row's
ms/round and tokens/s are the batch's (all requests' tokens over the decode's wall time).
  (the results of the last run: bench/results/sampling_cost.json)
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from common import dev_rows, machine, write_json
from dspark.demo import demo_bundle_path
from dspark.runtime import DecodeOptions, Runtime
from dspark.runtime.sampling import SamplingParams

SETS = {  # name: parameters, or (parameters, top logprobs)
    "none": SamplingParams(),
    "logprobs (top 0)": (SamplingParams(), 0),
    "logprobs (top 5)": (SamplingParams(), 5),
    "logprobs (top 20)": (SamplingParams(), 20),
    "top_p=0.9 + logprobs (top 5)": (SamplingParams(top_p=0.9), 5),
    "top_k=40": SamplingParams(top_k=40),
    "top_p=0.9": SamplingParams(top_p=0.9),
    "min_p=0.05": SamplingParams(min_p=0.05),
    "repetition_penalty=1.1": SamplingParams(repetition_penalty=1.1),
    "presence_penalty=0.5": SamplingParams(presence_penalty=0.5),
    "frequency_penalty=0.5": SamplingParams(frequency_penalty=0.5),
    "logit_bias(8 tokens)": SamplingParams(logit_bias={t: -5.0 for t in range(100, 108)}),
    "chat-ui (top_p .95, top_k 40, rep 1.1)": SamplingParams(top_k=40, top_p=0.95, repetition_penalty=1.1),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", nargs="+", help="default: the demo bundle (`dspark demo` makes it); several: "
                    "each in turn")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--batch", type=int, default=1, help="requests decoded together (default 1)")
    ap.add_argument("--only", nargs="*", help="the parameter sets to run (default: all; `none` always runs)")
    ap.add_argument("--out", default="bench/results/sampling_cost.json")
    args = ap.parse_args()
    sets = {name: value if isinstance(value, tuple) else (value, None) for name, value in SETS.items()
            if not args.only or name in args.only or name == "none"}
    bundles = args.bundle or [str(demo_bundle_path("gguf"))]
    runtimes = {bundle: Runtime(bundle) for bundle in bundles}
    encode = next(iter(runtimes.values())).encode
    rows_in = dev_rows(None, per_domain=max(1, args.batch), limit=args.prompts * args.batch)
    prompts = [[encode(r["prompt"]) for r in rows_in[i:i + args.batch]] for i in range(0, len(rows_in), args.batch)]
    runs: dict[tuple[str, str, str, float], list] = {}
    for i, batch in enumerate(prompts):
        for temperature in (args.temperature, 0.0):
            for name, (params, logprobs) in sets.items():
                for bundle, rt in runtimes.items():
                    for policy in ("all", "ar"):
                        options = DecodeOptions(max_tokens=args.max_tokens, temperature=temperature, seed=i,
                                                policy=policy, sampling=params, logprobs=logprobs,
                                                batch_size=len(batch))
                        started = time.perf_counter()
                        results = rt.generate(batch, options)
                        runs.setdefault((bundle, name, policy, temperature), []).append(
                            (results, time.perf_counter() - started))
        print(f"batch {i + 1}/{len(prompts)} done", flush=True)
    rows = []
    for (bundle, name, policy, temperature), batches in runs.items():
        ms = [1000 * wall / max(max(r.rounds for r in results), 1) for results, wall in batches]
        speed = [sum(len(r.token_ids) for r in results) / wall for results, wall in batches]
        rows.append({"bundle": bundle, "params": name, "policy": policy, "temperature": temperature,
                     "batch": args.batch, "ms_per_round": round(float(np.median(ms)), 2),
                     "tau": round(float(np.median([r.tau for results, _ in batches for r in results])), 3),
                     "tokens_per_s": round(float(np.median(speed)), 2),
                     "tokens": int(sum(len(r.token_ids) for results, _ in batches for r in results))})
    for bundle in bundles:
        for temperature in (args.temperature, 0.0):
            print(f"\n{bundle}, temperature {temperature}")
            print(f"{'parameters':<40} {'DSpark ms/round':>15} {'tau':>6} {'tok/s':>7} {'AR ms/step':>11} "
                  f"{'tok/s':>7}")
            for name in sets:
                ds, ar = (next(r for r in rows if r["bundle"] == bundle and r["params"] == name
                               and r["policy"] == p and r["temperature"] == temperature) for p in ("all", "ar"))
                print(f"{name:<40} {ds['ms_per_round']:>15} {ds['tau']:>6} {ds['tokens_per_s']:>7} "
                      f"{ar['ms_per_round']:>11} {ar['tokens_per_s']:>7}")
    write_json(args.out, {"bundles": bundles, "prompts": len(prompts), "max_tokens": args.max_tokens,
                          "machine": machine(), "rows": rows})


if __name__ == "__main__":
    main()
