"""Peak memory of `dspark-export quantize` against the bundle it writes, on random Qwen3-shaped pairs.

For each size: a random bf16 target with the real config and a DeepSpec-shaped drafter (bench/export_scale.py's
checkpoints), exported without check data; then `dspark-export quantize --graphs verifier,draft --bits 4` (8-bit
LM head) in a child process under /usr/bin/time: wall time, peak RSS, and the quantized graphs' bytes. The bound
the runtime's users need: peak RSS <= 1.5 x the quantized bundle + 1 GB.

    python bench/quantize_memory.py --sizes 1.7b,4b,8b --work /tmp/qmem
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from common import ROOT, earlier_rows, machine, write_json
from export_scale import checkpoint_params, timed, write_drafter, write_target

TOOL = Path(sys.executable).with_name("dspark-export")


def graph_bytes(bundle: Path, graphs: list[str]) -> int:
    from dspark.bundle import Manifest

    manifest = Manifest.read(bundle)
    total = 0
    for g in graphs:
        f = Manifest.path(bundle, manifest.graphs[g].file)
        total += f.stat().st_size + sum(p.stat().st_size for p in f.parent.glob(f"{f.name}.data"))
    return total


def one_size(size: str, args, tokenizer_from: Path) -> dict:
    work = Path(args.work) / size
    t0 = time.perf_counter()
    if not (work / "draft" / "config.json").exists():
        shutil.rmtree(work, ignore_errors=True)
        write_target(size, work / "target", tokenizer_from)
        write_drafter(work / "target", work / "draft")
    row = {"size": size, "target_params": checkpoint_params(work / "target"),
           "make_checkpoints_s": round(time.perf_counter() - t0, 1)}
    bundle = work / "bundle"
    if not (bundle / "manifest.json").exists() or args.reexport:
        shutil.rmtree(bundle, ignore_errors=True)
        row["export"] = timed([str(TOOL), "onnx", "--target", str(work / "target"), "--draft", str(work / "draft"),
                               "-o", str(bundle), "--precision", "bf16", "--no-check", "-q",
                               "--max-context", str(args.max_context)], work / "export.log")
        if row["export"]["returncode"]:
            return row
    graphs = ["verifier", "draft"]
    row["max_context"] = json.loads((bundle / "manifest.json").read_text())["max_context"]
    row["bf16_graph_bytes"] = graph_bytes(bundle, graphs)
    quantized = work / "bundle-q4"
    shutil.rmtree(quantized, ignore_errors=True)
    shutil.copytree(bundle, quantized, copy_function=__import__("os").link)  # hard links: the tool must not write them
    row["quantize"] = timed([str(TOOL), "quantize", str(quantized), "--graphs", ",".join(graphs), "--bits", "4",
                             "--agreement-prompts", str(args.agreement_prompts)], work / "quantize.log")
    if row["quantize"]["returncode"] == 0:
        q = graph_bytes(quantized, graphs)
        bundle_bytes = sum(p.stat().st_size for p in quantized.rglob("*") if p.is_file())
        bound = 1.5 * bundle_bytes / 2**30 + 1.0
        row.update({"q4_graph_bytes": q, "q4_bundle_bytes": bundle_bytes, "bound_gb": round(bound, 2),
                    "within_bound": row["quantize"]["peak_rss_gb"] <= bound})
    if not args.keep:
        shutil.rmtree(quantized, ignore_errors=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1.7b,4b,8b")
    ap.add_argument("--work", default="/tmp/dspark-quantize-memory")
    ap.add_argument("--agreement-prompts", type=int, default=0, help="the agreement run (0: none; it decodes)")
    ap.add_argument("--reexport", action="store_true")
    ap.add_argument("--max-context", type=int, default=4096, help="the bundles' context (export --max-context)")
    ap.add_argument("--merge", action="store_true", help="keep the other sizes' rows of an earlier run in --out")
    ap.add_argument("--keep", action="store_true", help="keep the quantized bundles")
    ap.add_argument("--out", default=str(ROOT / "bench/results/quantize_memory.json"))
    args = ap.parse_args()
    from dspark.models.target import load_target

    tokenizer_from = load_target("smollm2-135m", lazy=True).folder  # any chat tokenizer: the weights are random
    sizes = args.sizes.split(",")
    rows = earlier_rows(args.out, "size", sizes, args.merge)
    for size in sizes:
        rows.append(one_size(size, args, tokenizer_from))
        out = write_json(args.out, {"machine": machine(), "rows": rows})
        print(rows[-1], flush=True)
    print(out)


if __name__ == "__main__":
    main()
