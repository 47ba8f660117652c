"""Build a bundle's engines with TensorRT for RTX on this (CPU-only) machine, once per precision, each in a fresh
process, and record build time, peak RSS and engine sizes in bench/results/trt_build.json.

    python bench/trt_build.py /tmp/smol_bundle [--precision fp32 --precision fp16] [--max-batch 8]

The bundle is copied first (its engines are not kept). Per graph: the builder's time; process_wall_s: the whole of
the process (import, parse, build and checks of the three graphs; no kernel library); peak RSS is that
process's ru_maxrss.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, machine, write_json

BUILD = """
import json, resource, sys
from dspark.trt.build import build_engines
report = build_engines(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), flavor="rtx", kernels=False)
out = {k: report[k] for k in ("flavor", "tensorrt", "targets", "plugin", "plugin_layers", "engines")}
print("REPORT " + json.dumps({**out, "peak_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


def build_once(bundle: Path, precision: str, max_batch: int, max_context: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="trt_build_") as tmp:
        copy = Path(tmp) / "bundle"
        shutil.copytree(bundle, copy, ignore=shutil.ignore_patterns("engines", "check"))
        start = time.perf_counter()
        run = subprocess.run([sys.executable, "-c", BUILD, str(copy), precision, str(max_batch), str(max_context)],
                             capture_output=True, text=True, cwd=ROOT)
        wall = time.perf_counter() - start
    if run.returncode != 0:
        raise SystemExit(f"build failed ({precision}): {run.stderr.strip().splitlines()[-1:]}")
    report = json.loads(next(line[7:] for line in run.stdout.splitlines() if line.startswith("REPORT ")))
    return {"precision": precision, "max_batch": max_batch, "max_context": max_context,
            "process_wall_s": round(wall, 1), "peak_rss_mb": round(report["peak_rss_kb"] / 1024, 1),
            "engines": {name: {"build_s": e["build_s"], "mb": round(e["bytes"] / 1e6, 2)}
                        for name, e in report["engines"].items()},
            "plugin_layers": report["plugin_layers"], "flavor": report["flavor"], "tensorrt": report["tensorrt"],
            "targets": report["targets"], "plugin": report["plugin"]["implementation"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--precision", action="append", choices=["fp32", "fp16", "bf16"])
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--max-context", type=int, default=2048)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "trt_build.json")
    args = parser.parse_args()
    manifest = json.loads((args.bundle / "manifest.json").read_text())
    runs = [build_once(args.bundle, precision, args.max_batch, args.max_context)
            for precision in args.precision or ["fp32", "fp16"]]
    onnx_mb = {name: round((args.bundle / g["file"]).stat().st_size / 1e6
                           + sum(p.stat().st_size for p in args.bundle.glob(g["file"] + "*.data")) / 1e6, 1)
               for name, g in manifest["graphs"].items()}
    write_json(args.out, {"bundle": str(args.bundle), "sources": manifest.get("sources", {}), "onnx_mb": onnx_mb,
                          "machine": machine(), "gpu": None, "runs": runs})
    print(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
