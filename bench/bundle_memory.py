"""Runtime cost of a bundle's weight layout: load time, RSS after load, peak RSS after decoding and one
autoregressive step, for several bundles of the same pair, each measured in a fresh process, bundles taking turns.

    python bench/bundle_memory.py --bundle old=/tmp/a --bundle fp32=/tmp/b --bundle bf16=/tmp/c@mapped --rounds 3

PATH@MODE picks ONNX Runtime's weights mode (packed: fp32 copies made at load; mapped: used from the bundle file;
auto, the default). peak_anon_gb is the process's private memory; peak_rss_gb also counts the mapped bundle pages,
which the three graphs (and other processes serving the bundle) share and the kernel can reclaim.
"""
from __future__ import annotations

import argparse
import statistics

from common import ROOT, machine, write_json
from export_scale import runtime_figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", action="append", required=True, help="LABEL=PATH[@auto|packed|mapped]")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench/results/bundle_memory.json"))
    ap.add_argument("--prompts", nargs="*", default=["What is 12 times 7?", "Name three primes."])
    args = ap.parse_args()
    bundles = dict(b.split("=", 1) for b in args.bundle)
    runs: dict[str, list[dict]] = {k: [] for k in bundles}
    for _ in range(args.rounds):
        for label, path in bundles.items():
            folder, _, weights = path.partition("@")
            runs[label].append(runtime_figures(folder, args.prompts, weights or "auto"))
            print(label, runs[label][-1], flush=True)
    keys = ("load_s", "rss_loaded_gb", "peak_rss_gb", "peak_anon_gb", "ar_step_s")
    summary = {label: {k: statistics.median(r[k] for r in rows) for k in keys} | {
        "greedy_dspark_equals_ar": all(all(r["greedy_dspark_equals_ar"]) for r in rows), "weights": rows[0]["weights"]}
        for label, rows in runs.items() if all("error" not in r for r in rows)}
    out = write_json(args.out, {"machine": machine(), "bundles": bundles, "rounds": args.rounds,
                                "median": summary, "runs": runs})
    print(out)


if __name__ == "__main__":
    main()
