"""What one verifier step costs at 1, 2, 4, 8 new positions (batch 1), per verifier precision, in one run.

Speculation pays only if verifying k positions costs little more than 1. Variants, built from the fp32 bundle
(--bundle) into --work once (hard-linked copies, only verifier.onnx rewritten by `dspark-export quantize`):

  fp32             the verifier as exported
  q8               onnxruntime's 8-bit quantizer (round to nearest, block 32; int8 activations, accuracy_level 4)
  q4-*             its 4-bit recipes (LM head at 8 bits): symmetric or not, block 32 or 16, accuracy_level 4, or
                   the default for a verifier's 4-bit weights (acc0: fp32 activations; the 8-bit head keeps 4)
  gguf             the GGUF's own blocks (SmolLM2: Q4_1 layers + Q8_0 LM head), the defaults: fp32 activations
                   for the 4-bit layers, int8 for the 8-bit head
  gguf-acc4        the same blocks, int8 activations everywhere
  gguf-acc0-head0  fp32 activations everywhere (the 8-bit head's fp32 path is slow on CPU)
  gguf-floatzp     Q4_1 as MatMulNBits floating zero points (-m/d): the op's own asymmetric form

Each variant whose bundle has a fused verifier (dspark-export fuse; the fp32 variant gets one in --work when the
bundle has none) is also measured on it, as "NAME+fused": the step the runtime takes at batch 1.

Variants take turns repetition by repetition (a shared VM's drift hits all alike); each step runs after a past
of --past positions; medians. Also stores each variant's top-1 agreement with fp32 (from its manifest), its
verifier's bytes on disk, the machine's copy bandwidth, and for --exactness variants whether greedy DSpark
(policy all) equals the same bundle's autoregressive output on --exactness-prompts dev prompts.

  python bench/verify_ratio.py --bundle BUNDLE [--variants fp32,q8,gguf] [--reps 15] [--work DIR]
  (the results of the last run: bench/results/verify_ratio.json)
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from common import bandwidth_gb_s, machine, write_json
from dspark.bundle import Manifest
from dspark.calibration.sps import step_feeds
from dspark.export.quantize.bundle import QuantizeOptions, quantize_bundle
from dspark.export.quantize.agreement import spread
from dspark.prompts import default_prompts_path, read_prompts
from dspark.runtime import DecodeOptions, Runtime
from dspark.runtime.kv import HostKV
from dspark.export.twins.ort_graphs import fuse_bundle
from dspark.files import linked_copy
from dspark.runtime.fused_verifier import FusedVerifier
from dspark.runtime.ort_backend import OrtBackend, OrtGraph, session_options

VARIANTS = {
    "fp32": None,
    "q8": QuantizeOptions(bits=8, gguf="off"),
    "q4-sym32": QuantizeOptions(bits=4, block_size=32, gguf="off", accuracy_level=4),
    "q4-asym32": QuantizeOptions(bits=4, block_size=32, symmetric=False, gguf="off", accuracy_level=4),
    "q4-asym16": QuantizeOptions(bits=4, block_size=16, symmetric=False, gguf="off", accuracy_level=4),
    "q4-asym32-acc0": QuantizeOptions(bits=4, block_size=32, symmetric=False, gguf="off"),
    "gguf": QuantizeOptions(),
    "gguf-acc4": QuantizeOptions(accuracy_level=4),
    "gguf-acc0-head0": QuantizeOptions(accuracy_level=0, head_accuracy_level=0),
    "gguf-floatzp": QuantizeOptions(q4_1="float-zp"),
}
EXACTNESS = "fp32,q8,q4-asym16,q4-asym32-acc0,gguf,gguf-acc4"


def build(source: Path, work: Path, name: str, agreement: dict) -> Path:
    if VARIANTS[name] is None:
        return fused_copy(source, work / name)
    out = work / name
    if out.exists() and "verifier" in Manifest.read(out).quantized:
        return out
    shutil.rmtree(out, ignore_errors=True)
    linked_copy(fused_copy(source, work / "fp32"), out)
    t0 = time.perf_counter()
    quantize_bundle(out, ["verifier"], replace(VARIANTS[name], **agreement))
    print(f"built {name} in {time.perf_counter() - t0:.0f}s", flush=True)
    return out


def fused_copy(source: Path, out: Path) -> Path:
    """The bundle itself when it has a fused verifier, else a linked copy with one (the quantized variants are
    made from it, so quantizing rebuilds theirs)."""
    if "verifier_fused" in Manifest.read(source).graphs:
        return source
    if not (out.exists() and "verifier_fused" in Manifest.read(out).graphs):
        shutil.rmtree(out, ignore_errors=True)
        linked_copy(source, out)
        fuse_bundle(out, ["verifier_fused"])
    return out


class Step:
    """One variant's verifier graph, a KV cache at --past and the feeds of a step over n positions."""

    def __init__(self, folder: Path, past: int, positions: list[int], threads: int | None, fused: bool = False):
        self.manifest = Manifest.read(folder)
        t = self.manifest.target
        opts = session_options(threads)
        self.graph = OrtGraph(folder, "verifier", self.manifest.graphs["verifier"], opts)
        if fused:  # in place: the step writes its K/V after the (uncommitted) past, as the runtime's does
            portable = self.graph
            self.graph = FusedVerifier(OrtGraph(folder, "verifier_fused", self.manifest.graphs["verifier_fused"],
                                                opts), lambda: portable)
        cache = HostKV(t["num_layers"], 1, t["num_kv_heads"], past + max(positions) + 1, t["head_dim"])
        cache.commit(0, past)
        cache.fit(max(positions))
        probs = np.zeros((1, self.manifest.block_size, t["vocab_size"]), np.float32)
        self.feeds = {n: step_feeds(cache, n, probs) for n in positions}

    def seconds(self, n: int) -> float:
        t0 = time.perf_counter()
        self.graph.run(self.feeds[n])
        return time.perf_counter() - t0

    def verifier_bytes(self, folder: Path) -> int:
        """The verifier's own files (a fused verifier's: its graph and concatenated weights, on top)."""
        spec = self.manifest.graphs["verifier"]
        return sum(p.stat().st_size for p in folder.iterdir() if p.name.startswith(spec.file))


def exactness(folder: Path, prompts: int, tokens: int, fused: bool = False) -> dict:
    """Greedy DSpark (every draft verified) vs the same bundle's autoregressive decoding, prompt by prompt (all
    prompts in one batch on the portable verifier; one at a time on the fused one, where it takes every step)."""
    rows = spread(read_prompts(default_prompts_path()), prompts)
    manifest = Manifest.read(folder)
    backend = OrtBackend(folder, manifest, verifier="fused" if fused else "portable")
    batch = 1 if fused else None
    with Runtime(folder, backend=backend) as rt:
        ids = [rt.encode(r["prompt"]) for r in rows]
        ar = rt.generate(ids, DecodeOptions(max_tokens=tokens, policy="ar", batch_size=batch))
        ds = rt.generate(ids, DecodeOptions(max_tokens=tokens, policy="all", batch_size=batch))
    equal = [a.token_ids == d.token_ids for a, d in zip(ar, ds)]
    return {"equal": sum(equal), "prompts": len(equal), "tokens": tokens,
            "tau": round(float(np.mean([d.tau for d in ds])), 3)}


def measure(steps: dict[str, Step], positions: list[int], reps: int, warmup: int = 2) -> dict:
    times = {name: {n: [] for n in positions} for name in steps}
    for rep in range(warmup + reps):
        for name, step in steps.items():  # variants take turns, and positions within each
            for n in positions:
                s = step.seconds(n)
                if rep >= warmup:
                    times[name][n].append(s)
    return times


def summarize(times: dict, positions: list[int]) -> dict:
    out = {}
    for name, per_n in times.items():
        med = {n: float(np.median(v)) for n, v in per_n.items()}
        base = med[positions[0]]
        out[name] = {"median_ms": {str(n): round(1e3 * s, 3) for n, s in med.items()},
                     "ratio_to_1": {str(n): round(s / base, 3) for n, s in med.items()},
                     "ms_per_position": {str(n): round(1e3 * s / n, 3) for n, s in med.items()}}
    for n in positions:
        best = min(out, key=lambda k: out[k]["ms_per_position"][str(n)])
        for name in out:
            out[name].setdefault("cheapest_at", [])
            if name == best:
                out[name]["cheapest_at"].append(n)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bundle", required=True, help="an fp32 bundle (the demo bundle)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--positions", default="1,2,4,8")
    ap.add_argument("--past", type=int, default=200)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--agreement-prompts", type=int, default=12)
    ap.add_argument("--agreement-tokens", type=int, default=48)
    ap.add_argument("--exactness", default=EXACTNESS, help="variants whose greedy DSpark vs AR is checked ('': none)")
    ap.add_argument("--exactness-prompts", type=int, default=9)
    ap.add_argument("--exactness-tokens", type=int, default=64)
    ap.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "dspark-verify-ratio"),
                    help="where the quantized variants are built (kept for the next run)")
    ap.add_argument("--out", default="bench/results/verify_ratio.json")
    args = ap.parse_args()
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        ap.error(f"unknown variant(s) {unknown}: {', '.join(VARIANTS)}")
    positions = [int(n) for n in args.positions.split(",")]
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    folders = {n: build(Path(args.bundle), work, n, {"agreement_prompts": args.agreement_prompts,
                                                         "agreement_tokens": args.agreement_tokens}) for n in names}
    steps = {n: Step(folders[n], args.past, positions, args.threads) for n in names}
    for n in names:
        if "verifier_fused" in Manifest.read(folders[n]).graphs:
            steps[f"{n}+fused"] = Step(folders[n], args.past, positions, args.threads, fused=True)
            folders[f"{n}+fused"] = folders[n]
    times = measure(steps, positions, args.reps)
    summary = summarize(times, positions)
    for name, step in steps.items():
        record = step.manifest.quantized.get("verifier", {})
        summary[name]["verifier_mb"] = round(step.verifier_bytes(folders[name]) / 1e6, 1)
        summary[name]["agreement_with_fp32"] = record.get("agreement")
        summary[name]["max_abs_weight_diff"] = (record.get("gguf_blocks") or {}).get("max_abs_weight_diff")
        summary[name]["matmulnbits"] = record.get("matmulnbits")
    checked = [n for n in args.exactness.split(",") if n in steps]
    for name in checked + [f"{n}+fused" for n in checked if f"{n}+fused" in steps]:
        summary[name]["dspark_equals_ar"] = exactness(folders[name], args.exactness_prompts, args.exactness_tokens,
                                                      fused=name.endswith("+fused"))
        print(name, summary[name]["dspark_equals_ar"], flush=True)
    result = {"machine": machine(), "bundle": str(args.bundle), "past": args.past, "reps": args.reps,
              "threads": args.threads or os.cpu_count(), "copy_bandwidth_gb_s": round(bandwidth_gb_s(), 1),
              "variants": summary, "raw_s": {k: {str(n): v for n, v in t.items()} for k, t in times.items()}}
    print(f"{'variant':<20} " + " ".join(f"{f'{n} pos ms':>10}" for n in positions) + "  ratio 8/1  ms/pos@max")
    for name, s in summary.items():
        print(f"{name:<20} " + " ".join(f"{s['median_ms'][str(n)]:>10.2f}" for n in positions)
              + f"  {s['ratio_to_1'][str(positions[-1])]:>9.2f}  {s['ms_per_position'][str(positions[-1])]:>10.2f}")
    print(f"wrote {write_json(args.out, result)}")


if __name__ == "__main__":
    main()
