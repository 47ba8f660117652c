"""Acceptance benchmark on dev prompts: tau (including the bonus token) per domain and position-wise conditional
acceptance, greedy and temperature 1, for one or more bundles (e.g. DSpark vs its DFlash ablation).

  python bench/acceptance.py --bundle dspark=BUNDLE_A --bundle dflash=BUNDLE_B [--max-new-tokens 128]

Writes bench/results/acceptance.json and acceptance.png.
"""
from __future__ import annotations

import argparse
from collections import defaultdict

import numpy as np

from common import dev_rows, machine, position_acceptance, write_json


def evaluate(path: str, rows: list[dict], max_new: int, temperature: float, batch: int, seed: int) -> dict:
    from dspark.runtime import DecodeOptions, Runtime

    rt = Runtime(path)
    res = rt.generate([r["prompt"] for r in rows], DecodeOptions(max_tokens=max_new, temperature=temperature,
                                                                 seed=seed, batch_size=batch))
    by_domain = defaultdict(list)
    for r, out in zip(rows, res):
        by_domain[r.get("domain", "all")].append(out)
    domains = {}
    for d, outs in sorted(by_domain.items()):
        committed = [c for o in outs for c in o.committed]
        domains[d] = {"tau": float(np.mean(committed)), "prompts": len(outs), "rounds": len(committed),
                      **position_acceptance(outs, rt.manifest.block_size)}
    committed = [c for o in res for c in o.committed]
    return {"tau": float(np.mean(committed)), "tau_macro": float(np.mean([v["tau"] for v in domains.values()])),
            "rounds": len(committed), "tokens": int(sum(len(o.token_ids) for o in res)), "domains": domains,
            **position_acceptance(res, rt.manifest.block_size), "sources": rt.manifest.sources.get("draft")}


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    names = list(report["results"])
    for ax, temp in zip(axes[:2], ("greedy", "t1")):
        domains = sorted({d for n in names for d in report["results"][n][temp]["domains"]})
        width = 0.8 / max(1, len(names))
        for i, n in enumerate(names):
            vals = [report["results"][n][temp]["domains"].get(d, {}).get("tau", np.nan) for d in domains]
            ax.bar(np.arange(len(domains)) + i * width, vals, width, label=n)
        ax.set_xticks(np.arange(len(domains)) + width * (len(names) - 1) / 2, domains)
        ax.set_title(f"tau per round ({'greedy' if temp == 'greedy' else 'temperature 1'})")
        ax.legend(fontsize=8)
    for n in names:
        for temp, style in (("greedy", "-o"), ("t1", "--s")):
            cond = report["results"][n][temp]["conditional_at"]
            axes[2].plot(range(1, len(cond) + 1), cond, style, ms=3, label=f"{n} {temp}")
    axes[2].set_title("conditional acceptance by position")
    axes[2].set_xlabel("draft position")
    axes[2].set_ylim(0, 1)
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", action="append", required=True, help="NAME=PATH (repeatable)")
    ap.add_argument("--prompts")
    ap.add_argument("--max-tokens", "--max-new-tokens", dest="max_tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/acceptance.json")
    args = ap.parse_args()
    rows = dev_rows(args.prompts)
    report = {"machine": machine(), "prompts": len(rows), "max_new_tokens": args.max_tokens, "results": {}}
    for spec in args.bundle:
        name, path = spec.split("=", 1)
        report["results"][name] = {
            "bundle": path,
            "greedy": evaluate(path, rows, args.max_tokens, 0.0, args.batch, args.seed),
            "t1": evaluate(path, rows, args.max_tokens, 1.0, args.batch, args.seed),
        }
        g, t = report["results"][name]["greedy"], report["results"][name]["t1"]
        per_domain = ", ".join(f"{d} {v['tau']:.2f}" for d, v in g["domains"].items())
        print(f"{name}: greedy tau {g['tau']:.2f} ({per_domain}) | T=1 tau {t['tau']:.2f}")
    names = list(report["results"])
    if len(names) >= 2:  # the first two: DSpark vs its DFlash ablation
        a, b = names[:2]
        report["ratio"] = {t: report["results"][a][t]["tau"] / report["results"][b][t]["tau"] for t in ("greedy", "t1")}
        print(f"{a} / {b} tau: {report['ratio']}")
    out = write_json(args.out, report)
    plot(report, str(out.with_suffix(".png")))
    print(f"-> {out}")


if __name__ == "__main__":
    main()
