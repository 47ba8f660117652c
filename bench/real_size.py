"""A real-size quantized bundle on CPU: what one verifier step costs at 1, 2, 4, 8 positions, what drafting costs
next to it, autoregressive tokens/s, peak memory, and the DSpark speed those costs allow (computed).

For each --bundle (e.g. the 4-bit Qwen3-4B/8B-shaped bundles bench/quantize_memory.py --keep leaves): the
verifier step after --past positions at batch 1 on the portable and (when the bundle has one) the fused verifier,
taking turns, medians; a greedy decode with every draft verified (policy all), whose per-stage times give draft +
heads per round; the same prompts autoregressively (tokens/s, prefill included); greedy DSpark = AR (tokens, not
quality: random weights accept nothing); and the process's peak RSS. The DSpark rows are computed, not measured:
a round that commits tau tokens on average costs draft + heads + the smallest measured verifier step of at least
tau + 1 positions.

    python bench/real_size.py --bundle 4b=/work/qmem/4b/bundle-q4 --bundle 8b=/work/qmem/8b/bundle-q4
"""
from __future__ import annotations

import argparse
import resource
from pathlib import Path

import numpy as np


from common import ROOT, earlier_rows, machine, write_json
from verify_ratio import Step, measure, summarize

PROMPTS = ["What is 12 times 7?", "Name three primes.", "Write one sentence about rivers."]


def step_costs(folder: Path, positions: list[int], past: int, reps: int) -> dict:
    from dspark.bundle import Manifest

    steps = {"portable": Step(folder, past, positions, None)}
    if "verifier_fused" in Manifest.read(folder).graphs:
        steps["fused"] = Step(folder, past, positions, None, fused=True)
    return summarize(measure(steps, positions, reps), positions)


def decode(folder: Path, max_new: int) -> dict:
    from cpu_decode import decode_one
    from dspark.runtime import Runtime

    with Runtime(folder) as rt:
        ids = [rt.encode(p) for p in PROMPTS]
        ar = [decode_one(rt, p, max_new, ar=True) for p in ids]
        ds = [decode_one(rt, p, max_new, policy="all") for p in ids]
    drafted = sum(t.drafted for _, _, t in ds) or 1
    return {"greedy_dspark_equals_ar": [a[1].token_ids == d[1].token_ids for a, d in zip(ar, ds)],
            "ar_tokens_per_s": round(float(np.median([a[0] for a in ar])), 3),
            "ar_prefill_s": [round(a[2].prefill, 3) for a in ar],
            "draft_ms_per_round": round(1e3 * sum(t.draft for _, _, t in ds) / drafted, 2),
            "heads_ms_per_round": round(1e3 * sum(t.heads for _, _, t in ds) / drafted, 2)}


def batch_fit(folder: Path, batch: int, context: int, max_new: int) -> dict:
    """Autoregressive decoding of `batch` requests in slots whose caches hold `context` positions: does it fit,
    at what speed, and what the caches take per slot (fp32 K/V of the target and of the draft backbone)."""
    from dspark.runtime import DecodeOptions, Runtime
    from dspark.runtime.decoder import Decoder

    with Runtime(folder) as rt:
        ids = [rt.encode(p) for p in (PROMPTS * batch)[:batch]]
        context = min(context, rt.manifest.max_context)  # (the bundle's own limit, recorded below)
        dec = Decoder(rt.backend, rt.manifest, ids, DecodeOptions(max_new_tokens=max_new, policy="ar",
                                                                  batch_size=batch), capacity=context)
        for _ in dec:
            pass
        tokens = sum(len(r.token_ids) for r in dec.results)
        decode_s = dec.times.total - dec.times.prefill
    return {"batch": batch, "context": dec.capacity, "tokens": tokens,
            "tokens_per_s": round(tokens / decode_s, 3) if decode_s > 0 else None,
            "target_kv_gb_per_slot": round(dec.kv.buffer.nbytes / batch / 2**30, 3),
            "draft_kv_gb_per_slot": round(dec.draft_kv.buffer.nbytes / batch / 2**30, 3),
            "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}


def computed(steps: dict, draft_heads_ms: float, taus: list[float]) -> dict:
    """tokens/s at mean acceptance length tau: tau / (draft + heads + the step of >= tau + 1 positions)."""
    out = {}
    for name, s in steps.items():
        ms = {int(n): v for n, v in s["median_ms"].items()}
        rows = {}
        for tau in taus:
            fits = [n for n in sorted(ms) if n >= tau + 1] or [max(ms)]
            rows[str(tau)] = round(tau / ((draft_heads_ms + ms[fits[0]]) / 1e3), 2)
        out[name] = {"ar_tokens_per_s_from_step": round(1e3 / ms[min(ms)], 2), "dspark_tokens_per_s": rows}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", action="append", required=True, help="LABEL=FOLDER")
    ap.add_argument("--positions", default="1,2,4,8")
    ap.add_argument("--past", type=int, default=200)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--taus", default="2,3,4,5")
    ap.add_argument("--steps-only", action="store_true", help="only the verifier steps (no decode, no batch fit)")
    ap.add_argument("--fit-batch", type=int, default=4)
    ap.add_argument("--fit-context", type=int, default=4096, help="0: no batch-fit run")
    ap.add_argument("--merge", action="store_true", help="keep the other labels' rows of an earlier run in --out")
    ap.add_argument("--out", default=str(ROOT / "bench/results/real_size.json"))
    args = ap.parse_args()
    positions = [int(p) for p in args.positions.split(",")]
    labels = [item.split("=", 1)[0] for item in args.bundle]
    rows = earlier_rows(args.out, "label", labels, args.merge)
    for item in args.bundle:
        label, folder = item.split("=", 1)
        row = {"label": label, "bundle": folder,
               "bundle_bytes": sum(p.stat().st_size for p in Path(folder).iterdir() if p.is_file())}
        row["steps"] = step_costs(Path(folder), positions, args.past, args.reps)
        row["peak_rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
        if not args.steps_only:
            row["decode"] = decode(Path(folder), args.max_new_tokens)
            dh = row["decode"]["draft_ms_per_round"] + row["decode"]["heads_ms_per_round"]
            row["draft_heads_over_step"] = {k: round(dh / v["median_ms"]["1"], 3) for k, v in row["steps"].items()}
            row["computed"] = computed(row["steps"], dh, [float(t) for t in args.taus.split(",")])
            row["peak_rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
        if args.fit_context and not args.steps_only:
            row["batch_fit"] = batch_fit(Path(folder), args.fit_batch, args.fit_context, 16)
        rows.append(row)
        out = write_json(args.out, {"machine": machine(), "past": args.past, "reps": args.reps, "rows": rows,
                                    "note": "DSpark rows under 'computed' are computed from measured costs, not "
                                            "measured (random weights accept nothing)"})
        print(row, flush=True)
    print(out)


if __name__ == "__main__":
    main()
