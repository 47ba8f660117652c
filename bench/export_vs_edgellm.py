"""dspark-export (without check data, the same work as the peer's exporter) against NVIDIA TensorRT Edge-LLM's
exporter on one pair made by bench/export_scale.py, the two taking turns: wall time, peak RSS, private memory.

    python bench/export_vs_edgellm.py --work /tmp/scale --size 0.6b --edgellm PATH --rounds 2
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
from pathlib import Path

from common import ROOT, machine, write_json
from export_scale import edgellm_export, timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", required=True, help="export_scale.py's --work (kept with --keep)")
    ap.add_argument("--size", default="0.6b")
    ap.add_argument("--edgellm", required=True, help="path of tensorrt-edgellm-export")
    ap.add_argument("--precision", default="bf16", choices=["fp32", "fp16", "bf16"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench/results/export_vs_edgellm.json"))
    args = ap.parse_args()
    work = Path(args.work) / args.size
    if not (work / "target" / "config.json").exists() or not (work / "draft" / "config.json").exists():
        sys.exit(f"no kept pair in {work}: run bench/export_scale.py --sizes {args.size} --keep first")
    runs: dict[str, list[dict]] = {"dspark": [], "edgellm": []}
    out = work / "ab_bundle"
    for _ in range(args.rounds):
        shutil.rmtree(out, ignore_errors=True)
        runs["dspark"].append(timed([str(Path(sys.executable).with_name("dspark-export")), "onnx", "--target",
                                     str(work / "target"), "--draft", str(work / "draft"), "-o", str(out),
                                     "--precision", args.precision, "--no-check"], work / "ab_dspark.log"))
        runs["dspark"][-1]["output_bytes"] = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
        runs["edgellm"].append(edgellm_export(Path(args.edgellm), work))
        print({k: v[-1]["wall_s"] for k, v in runs.items()}, flush=True)
    shutil.rmtree(out, ignore_errors=True)
    keys = ("wall_s", "peak_rss_gb", "peak_anon_gb")
    median = {name: {k: statistics.median(r.get(k) or 0 for r in rows) for k in keys} for name, rows in runs.items()}
    write_json(args.out, {"machine": machine(), "size": args.size, "precision": args.precision,
                          "rounds": args.rounds, "median": median, "runs": runs})
    print(median)


if __name__ == "__main__":
    main()
