"""CPU decoding benchmark, everything in one run on the same prompts (issue: ONNX Runtime DSpark runtime):
HF transformers greedy generate, ONNX Runtime AR fp32, ONNX Runtime DSpark fp32 (all drafts verified and, when
the bundle has an SPS table from `dspark calibrate --sps`, with Algorithm 1 choosing how many), and optionally
DSpark on other bundles of the same pair (e.g. `--extra heads-q8=BUNDLE_Q8` after `dspark-export quantize`).

  python bench/cpu_decode.py --bundle BUNDLE [--extra NAME=BUNDLE] [--per-domain 2] [--max-new-tokens 128]

All methods, HF included, take turns prompt by prompt (drift of a shared VM's speed hits them alike).
Writes JSON (default bench/results/cpu_decode.json): tokens/s per method (median over prompts and overall),
tau, position-wise acceptance, time split per round (draft / heads / verify / host), and the verifier's cost of an
8-position step relative to a 1-position step.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from common import dev_rows, machine, position_acceptance, write_json


def decode_one(rt, prompt, max_new, ar=False, policy=None):
    from dspark.runtime import DecodeOptions

    dec = rt.decoder([prompt], DecodeOptions(max_tokens=max_new, policy="ar" if ar else (policy or "all")))
    for _ in dec:
        pass
    res = dec.results[0]
    decode_s = dec.times.total - dec.times.prefill
    return (len(res.token_ids) / decode_s if decode_s > 0 else 0.0), res, dec.times


def run_interleaved(methods: dict, prompts) -> dict:
    """{name: decode(prompt) -> tuple} -> {name: lists of each tuple element}. Every method decodes a prompt before
    any decodes the next, so drift of a shared VM's speed during the run hits all methods alike and their ratios
    hold."""
    runs: dict[str, tuple[list, ...]] = {}
    for p in prompts:
        for name, decode in methods.items():
            out = decode(p)
            for acc, value in zip(runs.setdefault(name, tuple([] for _ in out)), out):
                acc.append(value)
    return runs


def dspark_method(rt, run, ar_res) -> dict:
    rates, res, times = run
    tot = {k: sum(getattr(t, k) for t in times) for k in ("draft", "heads", "verify", "total", "prefill")}
    rounds = sum(t.rounds for t in times)
    host = tot["total"] - tot["prefill"] - tot["draft"] - tot["heads"] - tot["verify"]
    return {"tokens_per_s_median": float(np.median(rates)), "per_prompt": rates,
            "tokens": int(sum(len(r.token_ids) for r in res)),
            "tau": float(np.mean([c for r in res for c in r.committed])),
            "greedy_equals_ar": all(a.token_ids == d.token_ids for a, d in zip(ar_res, res)),
            **position_acceptance(res, rt.manifest.block_size),
            "per_round_ms": {k: 1000 * v / rounds for k, v in (("draft", tot["draft"]), ("heads", tot["heads"]),
                                                                  ("verify", tot["verify"]), ("host", host))},
            "draft_plus_heads_over_verify": (tot["draft"] + tot["heads"]) / tot["verify"],
            "drafts_verified_per_round": float(np.mean([n for r in res for n in r.proposed])),
            "quantized": rt.manifest.quantized}


def verify_cost_ratio(rt, reps: int = 15) -> dict:
    """Median time of a verifier step over 8 positions vs 1 position, same cache length (~200 positions)."""
    from dspark.calibration.sps import verifier_step_seconds
    from dspark.runtime.kv import HostKV

    t = rt.manifest.target
    cache = HostKV(t["num_layers"], 1, t["num_kv_heads"], 256, t["head_dim"])
    cache.commit(0, 200)
    block = rt.manifest.block_size
    out = verifier_step_seconds(rt, cache, [1, block + 1], reps, warmup=3)
    return {"step_1_ms": 1000 * out[1], f"step_{block + 1}_ms": 1000 * out[block + 1],
            "ratio": out[block + 1] / out[1]}


def hf_decoder(target: str, max_new: int):
    """HF transformers greedy generate (eager, KV cache) of one prompt -> (tokens/s, generated ids). Its time
    includes the prompt's prefill, which the ONNX Runtime rates leave out (~1 step of 128)."""
    import torch

    from dspark.models.target import load_target

    hf = load_target(target).hf_model

    def decode(ids):
        x = torch.tensor([ids])
        with torch.no_grad():
            t0 = time.perf_counter()
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False)
            d = time.perf_counter() - t0
        return (out.shape[1] - len(ids)) / d, out[0, len(ids):].tolist()

    return decode


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--target", default="smollm2-135m", help="for the HF transformers baseline")
    ap.add_argument("--prompts")
    ap.add_argument("--per-domain", type=int, default=2)
    ap.add_argument("--max-tokens", "--max-new-tokens", dest="max_tokens", type=int, default=128)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--extra", action="append", default=[], help="NAME=BUNDLE: DSpark on another bundle of the pair")
    ap.add_argument("--allow-other-draft", action="store_true")
    ap.add_argument("--out", default="bench/results/cpu_decode.json")
    args = ap.parse_args()

    from dspark.runtime import Runtime
    from dspark.runtime.scheduler import VerifyPolicy

    rows = dev_rows(args.prompts, per_domain=args.per_domain)
    rt = Runtime(args.bundle)
    ids = [rt.encode(r["prompt"]) for r in rows]
    report = {"machine": machine(), "bundle": args.bundle, "manifest_sources": rt.manifest.sources,
              "prompts": [{"domain": r.get("domain"), "source": r.get("source")} for r in rows],
              "max_new_tokens": args.max_tokens, "methods": {}}
    ort = {"ort_ar_fp32": (rt, {"ar": True}), "ort_dspark_fp32": (rt, {})}
    if rt.manifest.calibration.get("sps_table"):
        ort["ort_dspark_fp32_scheduled"] = (rt, {"policy": VerifyPolicy("schedule")})
    for spec in args.extra:
        name, _, path = spec.partition("=")
        other = Runtime(path)
        if other.manifest.sources.get("draft") != rt.manifest.sources.get("draft") and not args.allow_other_draft:
            raise SystemExit(f"--extra {spec}: a different draft than {args.bundle} (pass --allow-other-draft)")
        ort[f"ort_dspark_{name}"] = (other, {})
    max_new = args.max_tokens
    methods = {name: (lambda p, rt=r, kw=kw: decode_one(rt, p, max_new, **kw)) for name, (r, kw) in ort.items()}
    if not args.skip_hf:
        methods["hf_eager_greedy"] = hf_decoder(args.target, max_new)
    runs = run_interleaved(methods, ids)
    hf_run = runs.pop("hf_eager_greedy", None)
    ar_rates, ar_res, _ = runs.pop("ort_ar_fp32")
    report["methods"]["ort_ar_fp32"] = {
        "tokens_per_s_median": float(np.median(ar_rates)), "per_prompt": ar_rates,
        "tokens": int(sum(len(r.token_ids) for r in ar_res))}
    for name, run in runs.items():
        report["methods"][name] = dspark_method(ort[name][0], run, ar_res)
        ratio = name.replace("ort_dspark_fp32", "dspark").replace("ort_dspark_", "dspark_") + "_over_ort_ar"
        report.setdefault("ratios", {})[ratio] = (report["methods"][name]["tokens_per_s_median"]
                                                  / report["methods"]["ort_ar_fp32"]["tokens_per_s_median"])
    report["verify_cost"] = verify_cost_ratio(rt)
    if hf_run is not None:
        hf_rates, hf_out = hf_run
        report["methods"]["hf_eager_greedy"] = {"tokens_per_s_median": float(np.median(hf_rates)),
                                                "per_prompt": hf_rates,
                                                "equals_ort_ar": [h == a.token_ids[:len(h)] or h[:len(a.token_ids)] == a.token_ids
                                                                  for h, a in zip(hf_out, ar_res)]}
        report.setdefault("ratios", {})["ort_ar_over_hf"] = (report["methods"]["ort_ar_fp32"]["tokens_per_s_median"]
                                                            / report["methods"]["hf_eager_greedy"]["tokens_per_s_median"])
    path = write_json(args.out, report)
    m = report["methods"]
    print(f"{'method':<28}{'tok/s (median)':>16}{'tau':>8}{'drafts verified':>17}")
    for name, v in m.items():
        print(f"{name:<28}{v['tokens_per_s_median']:>16.1f}{v.get('tau', float('nan')):>8.2f}"
              f"{v.get('drafts_verified_per_round', float('nan')):>17.2f}")
    print(f"verify {rt.manifest.block_size + 1} vs 1 positions: x{report['verify_cost']['ratio']:.2f}; "
          f"host per round {m['ort_dspark_fp32']['per_round_ms']['host']:.2f} ms")
    for name, v in m.items():
        if "per_round_ms" in v:
            print(f"{name}: draft+heads / verify = {v['draft_plus_heads_over_verify']:.2f}, per round (ms) "
                  + ", ".join(f"{k} {x:.1f}" for k, x in v["per_round_ms"].items()))
    print(f"ratios: {report['ratios']}  -> {path}")


if __name__ == "__main__":
    main()
