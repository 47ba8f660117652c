"""What structured outputs cost a decode (the demo bundle by default): ms per round, tau and tokens/s of DSpark
(policy all) and AR without a format, with json_object and with a json_schema, greedy and sampled, in one run; and
the time the grammar engine (llguidance) takes per round: the masks of the verified rows and the draft check.

Constrained rows go through the sampler graph on masked logits (dspark.runtime.grammar); drafts stay the drafter's
own, so a drafter that proposes text the grammar refuses loses acceptance. Formats take turns prompt by prompt;
medians over prompts.

  python bench/structured_cost.py [--bundle BUNDLE] [--prompts 4] [--max-tokens 64]
  (the results of the last run: bench/results/structured_cost.json)
"""
from __future__ import annotations

import time

import numpy as np

from common import demo_parser, dev_rows, machine, write_json
from dspark.demo import demo_bundle_path
from dspark.runtime import DecodeOptions, Runtime
from dspark.runtime.grammar import GrammarRows

SCHEMA = {"type": "object", "properties": {"topic": {"type": "string", "maxLength": 40},
                                           "answer": {"type": "string"},
                                           "confidence": {"type": "integer", "minimum": 0, "maximum": 100}},
          "required": ["topic", "answer", "confidence"], "additionalProperties": False}


class GrammarClock:
    """Seconds spent in the grammar engine (GrammarRows.masks and .verified), by wrapping them."""

    def __init__(self):
        self.seconds = 0.0
        for name in ("masks", "verified"):
            real = getattr(GrammarRows, name)

            def timed(*args, _real=real, **kwargs):
                t0 = time.perf_counter()
                try:
                    return _real(*args, **kwargs)
                finally:
                    self.seconds += time.perf_counter() - t0
            setattr(GrammarRows, name, timed)


def main() -> None:
    args = demo_parser(__doc__, "bench/results/structured_cost.json", prompts=4, max_tokens=64).parse_args()
    bundle = args.bundle or demo_bundle_path("gguf")
    rt = Runtime(bundle)
    clock = GrammarClock()
    formats = {"none": None, "json_object": rt.grammars.json_object(), "json_schema": rt.grammars.json_schema(SCHEMA)}
    prompts = [rt.encode(r["prompt"] + " Answer in JSON.") for r in dev_rows(None, per_domain=1, limit=args.prompts)]
    runs: dict[tuple[str, str, float], list] = {}
    for i, ids in enumerate(prompts):
        for temperature in (0.7, 0.0):
            for name, grammar in formats.items():
                for policy in ("all", "ar"):
                    before = clock.seconds
                    res = rt.generate([ids], DecodeOptions(max_tokens=args.max_tokens, temperature=temperature,
                                                           seed=i, policy=policy, grammar=grammar))[0]
                    runs.setdefault((name, policy, temperature), []).append((res, clock.seconds - before))
        print(f"prompt {i + 1}/{len(prompts)} done", flush=True)
    rows = []
    for (name, policy, temperature), results in runs.items():
        rows.append({"format": name, "policy": policy, "temperature": temperature,
                     "ms_per_round": round(float(np.median([1000 * r.seconds / max(r.rounds, 1)
                                                            for r, _ in results])), 2),
                     "grammar_ms_per_round": round(float(np.median([1000 * g / max(r.rounds, 1)
                                                                    for r, g in results])), 2),
                     "tau": round(float(np.median([r.tau for r, _ in results])), 3),
                     "tokens_per_s": round(float(np.median([r.tokens_per_s for r, _ in results])), 2),
                     "tokens": int(sum(len(r.token_ids) for r, _ in results))})
    for temperature in (0.7, 0.0):
        print(f"\ntemperature {temperature}")
        print(f"{'format':<12} {'DSpark ms/round':>15} {'grammar ms':>10} {'tau':>6} {'tok/s':>7} {'AR ms/step':>11} "
              f"{'grammar ms':>10} {'tok/s':>7}")
        for name in formats:
            ds, ar = (next(r for r in rows if r["format"] == name and r["policy"] == p
                           and r["temperature"] == temperature) for p in ("all", "ar"))
            print(f"{name:<12} {ds['ms_per_round']:>15} {ds['grammar_ms_per_round']:>10} {ds['tau']:>6} "
                  f"{ds['tokens_per_s']:>7} {ar['ms_per_round']:>11} {ar['grammar_ms_per_round']:>10} "
                  f"{ar['tokens_per_s']:>7}")
    write_json(args.out, {"bundle": str(bundle), "prompts": len(prompts), "max_tokens": args.max_tokens,
                          "schema": SCHEMA, "machine": machine(), "rows": rows})


if __name__ == "__main__":
    main()
