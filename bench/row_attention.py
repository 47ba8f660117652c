"""The fused verifier's attention, as bundles carry it: GroupQueryAttention (fp32 activations; int8 with one lane
per request) against row attention (dspark.export.twins.row_attention, fp32 and int8), ONNX Runtime CPU,
in-process, on one bundle's weights. Each variant is a linked copy of --bundle whose verifier is re-levelled
(`quantize --accuracy-level`) and re-fused; greedy DSpark at batch 1 and 8 and AR at batch 8 are checked against
AR at batch 1 token for token, then the verifier step at 1 and 8 rows and engine tokens/s (AR, prefills included)
at each concurrency, all variants in turn each repetition, with caches of --max-context positions (dspark serve's
default: 2048), whose width follows the live requests (dspark.runtime.kv.HostKV).

    python bench/row_attention.py --bundle ~/.cache/dspark/bundles/<demo bundle> --out bench/results/X.json
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from bundle_concurrency import dev_prompts, take_turns
from common import ROOT, machine, write_json

from dspark.bundle import Manifest  # noqa: E402
from dspark.export.quantize.bundle import QuantizeOptions, relevel_bundle  # noqa: E402
from dspark.export.twins.fused_bundle import add_fused_verifier, forget_step_costs  # noqa: E402
from dspark.export.twins.ort_fused import LANES  # noqa: E402
from dspark.files import linked_copy  # noqa: E402
from dspark.runtime import DecodeOptions, Runtime  # noqa: E402
from dspark.runtime.decoder import Decoder  # noqa: E402

VARIANTS = {  # name: (accuracy level of the verifier's layers, attention, lanes)
    "fp32_gqa": (0, "gqa", 1), "fp32_rows": (0, "rows", 1),
    "int8_gqa_lanes": (4, "gqa", LANES), "int8_rows": (4, "rows", 1),
}


def variant(src: Path, dst: Path, level: int, attention: str, lanes: int) -> Path:
    shutil.rmtree(dst, ignore_errors=True)
    linked_copy(src, dst)
    manifest = Manifest.read(dst)
    if manifest.quantized["verifier"].get("layer_accuracy_levels") != [level]:
        relevel_bundle(dst, manifest, ["verifier"], QuantizeOptions(accuracy_level=level))
        manifest = Manifest.read(dst)
    add_fused_verifier(dst, manifest, attention, lanes)
    forget_step_costs(manifest)
    manifest.write(dst)
    return dst


def greedy(rt: Runtime, prompts: list[list[int]], batch: int, policy: str, tokens: int, context: int) -> list:
    out = []
    for start in range(0, len(prompts), batch):
        dec = Decoder(rt.backend, rt.manifest, prompts[start:start + batch],
                      DecodeOptions(max_tokens=tokens, policy=policy, batch_size=batch), capacity=context)
        got = [[] for _ in prompts[start:start + batch]]
        for event in dec:
            got[event.request] += list(event.token_ids)
        out += got
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "row_attention.json")
    ap.add_argument("--work", type=Path, default=Path("/tmp/row_attention"))
    ap.add_argument("--max-context", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",") if x], default=[1, 8, 16])
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    bundles = {name: variant(args.bundle, args.work / name, *spec) for name, spec in VARIANTS.items()}
    prompts = dev_prompts(args.bundle, max(args.concurrency))
    exact = {}
    for name, bundle in bundles.items():
        rt = Runtime(bundle)
        ar = greedy(rt, prompts[:8], 1, "ar", 48, args.max_context)
        checks = {"dspark_b1": greedy(rt, prompts[:8], 1, "all", 48, args.max_context),
                  "ar_b8": greedy(rt, prompts[:8], 8, "ar", 48, args.max_context),
                  "dspark_b8": greedy(rt, prompts[:8], 8, "all", 48, args.max_context)}
        exact[name] = {k: sum(a == b for a, b in zip(ar, got)) for k, got in checks.items()} | {"prompts": len(ar)}
        print(name, exact[name], flush=True)
        rt.close()
    report = {"bundle": str(args.bundle), "machine": machine(), "args": {k: str(v) for k, v in vars(args).items()},
              "variants": {name: dict(zip(("accuracy_level", "attention", "lanes"), spec))
                           for name, spec in VARIANTS.items()},
              "greedy_equal_to_ar_b1": exact,
              **take_turns(bundles, prompts, args.concurrency, args.max_tokens, args.max_context, args.reps)}
    write_json(args.out, report)
    print(json.dumps({k: report[k] for k in ("greedy_equal_to_ar_b1", "verifier_step_ms", "tokens_per_s")},
                     indent=1))

if __name__ == "__main__":
    main()
