"""What n > 1 saves: one request of n choices (the prompt prefilled once, copied into the other choices' slots)
against n separate requests of the same prompt, on the always-on engine (the demo bundle by default). Per prompt,
the two take turns; time to the last choice's first token and to the last token, medians over prompts.

  python bench/choices_cost.py [--bundle BUNDLE] [--prompts 3] [--n 4] [--max-tokens 32] [--repeat 8]
  (--repeat: how many times each prompt's text is repeated, for a prompt long enough that its prefill shows)
  (the results of the last run: bench/results/choices_cost.json)
"""
from __future__ import annotations

import time

import numpy as np

from common import demo_parser, dev_rows, machine, write_json
from dspark.demo import demo_bundle_path
from dspark.runtime import Runtime
from dspark.runtime.engine import Engine, EngineOptions
from dspark.runtime.engine_request import RequestOptions


def _timed(requests: list, t0: float) -> tuple[float, float, int]:
    """(seconds to the last choice's first token, seconds to the last token, tokens) of finished requests."""
    first = max(r.first_token_at for r in requests) - t0
    last = max(r.finished_at for r in requests) - t0
    return first, last, sum(len(r.token_ids) for r in requests)


def main() -> None:
    ap = demo_parser(__doc__, "bench/results/choices_cost.json", prompts=3, max_tokens=32)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=8)
    args = ap.parse_args()
    bundle = args.bundle or demo_bundle_path("gguf")
    rt = Runtime(bundle)
    engine = Engine(rt, EngineOptions(batch_size=args.n, policy="all")).start()
    rows = dev_rows(None, per_domain=1, limit=args.prompts)
    runs: dict[str, list[tuple[float, float, int]]] = {"one request, n choices": [], "n requests": []}
    lengths = []
    try:
        engine.submit(rt.encode("Hello"), RequestOptions(max_tokens=4)).wait()  # sessions warm
        for i, row in enumerate(rows):
            ids = rt.encode(" ".join([row["prompt"]] * args.repeat))
            lengths.append(len(ids))
            options = RequestOptions(max_tokens=args.max_tokens, temperature=0.7, seed=i)
            for name in runs:
                t0 = time.perf_counter()
                if name == "n requests":
                    requests = [engine.submit(ids, options) for _ in range(args.n)]
                else:
                    requests = engine.submit_choices(ids, options, args.n)
                runs[name].append(_timed([r.wait() for r in requests], t0))
            print(f"prompt {i + 1}/{len(rows)} ({len(ids)} tokens) done", flush=True)
    finally:
        engine.close()
    out = []
    for name, timings in runs.items():
        first, last, tokens = (np.array(x) for x in zip(*timings))
        out.append({"method": name, "first_token_s": round(float(np.median(first)), 3),
                    "total_s": round(float(np.median(last)), 3),
                    "tokens_per_s": round(float(np.median(tokens / last)), 2)})
        print(f"{name:<24} last first token {out[-1]['first_token_s']:>7} s   all done {out[-1]['total_s']:>7} s   "
              f"{out[-1]['tokens_per_s']:>7} tokens/s")
    write_json(args.out, {"bundle": str(bundle), "n": args.n, "max_tokens": args.max_tokens,
                          "prompt_tokens": lengths, "machine": machine(), "rows": out})


if __name__ == "__main__":
    main()
