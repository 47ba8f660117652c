"""Scheduler benchmark (one run): for R concurrent requests in {1, 2, 4, 8}, autoregressive decoding, fixed
verification lengths gamma in {1, 3, 7}, a static survival threshold, Algorithm 1 and its top-K variant, the
last two also with the draft gate (+gate: skip drafting in rounds where a plain verifier step is expected to win).
Reports aggregate and per-request tokens/s, the mean verification budget per request, and padding vs flattening:
verifier positions computed (padded [R, T]) vs useful, and the verifier time flattening would take by the SPS table.

  python bench/scheduler.py --bundle BUNDLE [--limit 16] [--max-new-tokens 64]
  (the bundle needs an SPS table: dspark calibrate --sps BUNDLE)

Writes bench/results/scheduler.json and scheduler.png.
"""
from __future__ import annotations

import argparse

from common import dev_rows, machine, write_json

POLICIES = ["ar", "fixed:1", "fixed:3", "fixed:7", "static:0.3", "schedule", "topk", "schedule+gate", "topk+gate"]


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for i, policy in enumerate(report["policies"]):
        rows = [r for r in report["runs"] if r["policy"] == policy]
        xs = [r["concurrency"] for r in rows]
        style = "-s" if policy.endswith("+gate") else "-o" if policy in ("schedule", "topk") else "--."
        color = f"C{i % 10}"  # one color per policy in every panel (the legend is drawn in the first only)
        axes[0].plot(xs, [r["tokens_per_s"] for r in rows], style, color=color, label=policy)
        axes[1].plot(xs, [r["per_request_tokens_per_s"] for r in rows], style, color=color, label=policy)
        if policy != "ar":
            axes[2].plot(xs, [r["mean_verify_budget"] for r in rows], style, color=color, label=policy)
    for ax, title in zip(axes, ("aggregate tokens/s", "per-request tokens/s", "drafts verified / request / round")):
        ax.set_title(title)
        ax.set_xlabel("concurrent requests R")
        ax.set_xscale("log", base=2)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--prompts")
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--max-tokens", "--max-new-tokens", dest="max_tokens", type=int, default=64)
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--out", default="bench/results/scheduler.json")
    args = ap.parse_args()

    from dspark.runtime import Runtime
    from dspark.runtime.measure import run_batch

    rows = dev_rows(args.prompts, per_domain=max(1, args.limit // 3))[:args.limit]
    rt = Runtime(args.bundle)
    policies = args.policies.split(",")
    report = {"machine": machine(), "bundle": args.bundle, "prompts": len(rows), "max_new_tokens": args.max_tokens,
              "policies": policies, "sps_table_len": len(rt.manifest.calibration.get("sps_table") or []), "runs": []}
    for r in [int(x) for x in args.concurrency.split(",")]:
        for policy in policies:
            res = run_batch(rt, [row["prompt"] for row in rows], r, policy, args.max_tokens).as_dict()
            report["runs"].append(res)
            print(f"R={r:<3} {policy:<13} {res['tokens_per_s']:7.1f} tok/s  per-request "
                  f"{res['per_request_tokens_per_s']:6.1f}  tau {res['tau']:.2f}  budget {res['mean_verify_budget']:.2f}  "
                  f"drafted {res['drafted_rounds']}/{res['rounds']}  "
                  f"padding waste {1 - res['useful_positions'] / max(1, res['padded_positions']):.0%}"
                  + (f" (flat/padded verifier time ~{res['flat_time_ratio']:.2f})" if res["flat_time_ratio"] else ""),
                  flush=True)
    out = write_json(args.out, report)
    plot(report, str(out.with_suffix(".png")))
    print(f"-> {out}")


if __name__ == "__main__":
    main()
