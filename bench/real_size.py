"""A real-size quantized bundle on CPU: verifier step costs, drafting, tokens/s against llama.cpp, memory.

What one verifier step costs at 1, 2, 4, 8 positions, what drafting costs next
to it, autoregressive tokens/s, peak memory, and the DSpark speed those costs allow (computed). For each --bundle
(e.g. the 4-bit Qwen3-4B/8B-shaped bundles bench/quantize_memory.py --keep leaves): the verifier step after --past
positions at batch 1 on the portable and (when the bundle has one) the fused verifier, taking turns, medians; a
greedy decode with every draft verified (policy all), whose per-stage times give draft + heads per round; the same
prompts autoregressively (tokens/s, prefill included); greedy DSpark = AR (tokens, not quality: random weights
accept nothing); and the process's peak RSS. JSON, and a PNG beside it. The DSpark rows are computed, not measured:
a round that commits tau tokens on average costs draft + heads + the smallest measured verifier step of at least tau
+ 1 positions. With --gguf LABEL=FILE (llama-cpp-python built for this CPU): greedy autoregressive tokens/s after
the prefill of dspark and of llama.cpp on that file at --batches, taking turns, and llama.cpp's own cost of a step
of k positions (bench/llama_cpp_decode.py).

    python bench/real_size.py --bundle 4b=WORK/4b/bundle-Q4_K_M --gguf 4b=WORK/4b/Q4_K_M.gguf \
        --bundle 8b=WORK/8b/bundle-Q4_K_M --gguf 8b=WORK/8b/Q4_K_M.gguf   # bench/gguf_kquants.py makes them
"""
from __future__ import annotations

import argparse
import resource
import statistics
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

    with Runtime(folder, weights="packed") as rt:  # auto may map after the step sessions left memory in use
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

    with Runtime(folder, weights="packed") as rt:  # auto may map after the step sessions left memory in use
        ids = [rt.encode(p) for p in (PROMPTS * batch)[:batch]]
        context = min(context, rt.manifest.max_context)  # (the bundle's own limit, recorded below)
        dec = Decoder(rt.backend, rt.manifest, ids, DecodeOptions(max_tokens=max_new, policy="ar",
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


def versus_llama_cpp(folder: Path, gguf: Path, batches: list[int], positions: list[int], past: int, max_new: int,
                     passes: int) -> dict:
    """Greedy autoregressive tokens/s after the prefill, dspark (this bundle) and llama.cpp (the GGUF), at each
    batch size, taking turns, medians over passes; llama.cpp's own step cost at k positions; and how many of
    dspark's greedy tokens llama.cpp's equal (the same weights give the same tokens until a near tie)."""
    from llama_cpp_decode import LlamaCpp

    from dspark.runtime import DecodeOptions, Runtime
    from dspark.runtime.decoder import Decoder

    rates: dict[str, list[float]] = {}
    agree = []
    with Runtime(folder, weights="packed") as rt:  # auto may map after the step sessions left memory in use
        ids = [rt.encode(p) for p in PROMPTS + PROMPTS[:1]]
        llama = LlamaCpp(gguf, max(batches), 512)
        try:
            for _ in range(passes):
                for b in batches:
                    dec = Decoder(rt.backend, rt.manifest, ids[:b], DecodeOptions(max_tokens=max_new,
                                                                                  policy="ar", batch_size=b))
                    for _ in dec:
                        pass
                    ours = [r.token_ids for r in dec.results]
                    rates.setdefault(f"dspark_b{b}", []).append(
                        sum(len(t) - 1 for t in ours) / (dec.times.total - dec.times.prefill))
                    theirs, seconds = llama.greedy(ids[:b], max_new)
                    rates.setdefault(f"llama.cpp_b{b}", []).append(b * (max_new - 1) / seconds)
                    agree += [_common_prefix(o, t) for o, t in zip(ours, theirs)]
            llama_steps = llama.step_ms(ids[0], past, positions, 5)
        finally:
            llama.close()
    med = {k: round(statistics.median(v), 3) for k, v in rates.items()}
    return {"gguf": str(gguf), "gguf_bytes": gguf.stat().st_size, "max_new_tokens": max_new, "passes": passes,
            "tokens_per_s": {k: [round(x, 3) for x in v] for k, v in rates.items()}, "median_tokens_per_s": med,
            "dspark_over_llama_cpp": {f"b{b}": round(med[f"dspark_b{b}"] / med[f"llama.cpp_b{b}"], 3)
                                      for b in batches},
            "llama_cpp_step_ms": llama_steps,
            "llama_cpp_step_ratio_to_1": {k: round(v / llama_steps[min(llama_steps)], 3)
                                          for k, v in llama_steps.items()},
            "greedy_tokens_equal_to_llama_cpp": agree}


def _common_prefix(a: list[int], b: list[int]) -> str:
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"{n}/{min(len(a), len(b))}"


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


def plot(rows: list[dict], path: Path) -> None:
    """Left: a verifier step's cost at k positions over its 1-position cost (dspark's fused and portable graphs,
    llama.cpp's own); right: autoregressive tokens/s of dspark and llama.cpp at each batch, and the computed DSpark
    rates at the mean acceptance lengths asked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    bars: dict[str, list[float]] = {}
    for row in rows:
        for name, s in row["steps"].items():
            ms = {int(k): v for k, v in s["median_ms"].items()}
            left.plot(sorted(ms), [ms[k] / ms[min(ms)] for k in sorted(ms)], "o-",
                      label=f"{row['label']} dspark {name}")
        llama = row.get("llama_cpp")
        if llama:
            ratio = {int(k): v for k, v in llama["llama_cpp_step_ratio_to_1"].items()}
            left.plot(sorted(ratio), [ratio[k] for k in sorted(ratio)], "s--", label=f"{row['label']} llama.cpp")
            for name, rate in llama["median_tokens_per_s"].items():
                bars.setdefault(name, []).append(rate)
        for name, c in row.get("computed", {}).items():
            for tau, rate in c["dspark_tokens_per_s"].items():
                bars.setdefault(f"DSpark {name} tau {tau} (computed)", []).append(rate)
    left.set(xlabel="positions per verifier step", ylabel="step cost / 1-position step")
    left.legend(fontsize=7)
    labels = [r["label"] for r in rows]
    width = 0.8 / max(len(bars), 1)
    for i, (name, rates) in enumerate(bars.items()):
        right.bar([j + i * width for j in range(len(rates))], rates, width, label=name)
    right.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))], labels)
    right.set(ylabel="tokens/s (batch: all requests together)")
    right.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", action="append", required=True, help="LABEL=FOLDER")
    ap.add_argument("--positions", default="1,2,4,8")
    ap.add_argument("--past", type=int, default=200)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--max-tokens", "--max-new-tokens", dest="max_tokens", type=int, default=24)
    ap.add_argument("--taus", default="2,3,4,5")
    ap.add_argument("--steps-only", action="store_true", help="only the verifier steps (no decode, no batch fit)")
    ap.add_argument("--fit-batch", type=int, default=4)
    ap.add_argument("--fit-context", type=int, default=4096, help="0: no batch-fit run")
    ap.add_argument("--gguf", action="append", default=[],
                    help="LABEL=FILE: llama.cpp decodes this GGUF beside the bundle of the same label")
    ap.add_argument("--batches", default="1,4", help="batch sizes of the llama.cpp comparison")
    ap.add_argument("--passes", type=int, default=3, help="passes of the llama.cpp comparison (medians)")
    ap.add_argument("--merge", action="store_true", help="keep the other labels' rows of an earlier run in --out")
    ap.add_argument("--out", default=str(ROOT / "bench/results/real_size.json"))
    args = ap.parse_args()
    positions = [int(p) for p in args.positions.split(",")]
    labels = [item.split("=", 1)[0] for item in args.bundle]
    ggufs = {label: Path(file) for label, file in (item.split("=", 1) for item in args.gguf)}
    rows = earlier_rows(args.out, "label", labels, args.merge)
    for item in args.bundle:
        label, folder = item.split("=", 1)
        row = {"label": label, "bundle": folder,
               "bundle_bytes": sum(p.stat().st_size for p in Path(folder).iterdir() if p.is_file())}
        row["steps"] = step_costs(Path(folder), positions, args.past, args.reps)
        row["peak_rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
        if not args.steps_only:
            row["decode"] = decode(Path(folder), args.max_tokens)
            dh = row["decode"]["draft_ms_per_round"] + row["decode"]["heads_ms_per_round"]
            row["draft_heads_over_step"] = {k: round(dh / v["median_ms"]["1"], 3) for k, v in row["steps"].items()}
            row["computed"] = computed(row["steps"], dh, [float(t) for t in args.taus.split(",")])
            row["peak_rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
        if label in ggufs:
            row["llama_cpp"] = versus_llama_cpp(Path(folder), ggufs[label], [int(b) for b in args.batches.split(",")],
                                                positions, args.past, args.max_tokens, args.passes)
            row["peak_rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
        if args.fit_context and not args.steps_only:
            row["batch_fit"] = batch_fit(Path(folder), args.fit_batch, args.fit_context, 16)
        rows.append(row)
        out = write_json(args.out, {"machine": machine(), "past": args.past, "reps": args.reps, "rows": rows,
                                    "note": "DSpark rows under 'computed' are computed from measured costs, not "
                                            "measured (random weights accept nothing)"})
        print(row, flush=True)
    plot(rows, Path(out).with_suffix(".png"))
    print(out)


if __name__ == "__main__":
    main()
