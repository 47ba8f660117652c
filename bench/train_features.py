"""Training input features: read the cached taps (fp16, written during generation) vs recompute them with a target
forward pass, per training sequence. The trainer uses the cache; this measures by how much that wins.

  python bench/train_features.py --data DATA_DIR [--sequences 8]

Writes bench/results/train_features.json.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from common import machine, write_json
from dspark.models.target import load_target
from dspark.train.data import read_responses


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="response/feature cache of `dspark train` (responses.jsonl, taps/)")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--out", default="bench/results/train_features.json")
    args = ap.parse_args()

    rows = read_responses(Path(args.data) / "responses.jsonl")[:args.sequences]
    tap_ids = tuple(rows[0]["tap_ids"])
    loaded = load_target(args.target)
    target = loaded.wrapper(tap_ids).eval()
    t = loaded.config
    cached, recomputed, max_err, lengths = [], [], [], []
    for r in rows:
        ids = r["prompt_ids"] + r["response_ids"]
        t0 = time.perf_counter()
        taps = np.load(Path(args.data) / "taps" / f"{r['index']}.npy").astype(np.float32)
        cached.append(time.perf_counter() - t0)
        tokens = torch.tensor([ids[:-1]])
        empty = [(torch.zeros(1, target.cfg.num_kv_heads, 0, target.cfg.head_dim),) * 2 for _ in target.layers]
        t0 = time.perf_counter()
        with torch.no_grad():
            step = target(tokens, torch.zeros(1, 0, dtype=torch.int64), empty)
        recomputed.append(time.perf_counter() - t0)
        ref = step.taps[0].float().numpy()
        n = min(len(ref), len(taps))
        max_err.append(float(np.abs(ref[:n] - taps[:n]).max() / np.abs(ref[:n]).max()))
        lengths.append(len(ids))
    report = {"machine": machine(), "sequences": len(rows), "mean_tokens": float(np.mean(lengths)),
              "cached_ms_median": 1000 * float(np.median(cached)),
              "recompute_ms_median": 1000 * float(np.median(recomputed)),
              "speedup_cached": float(np.median(recomputed) / np.median(cached)),
              "cache_bytes_per_token": int(2 * len(tap_ids) * t.hidden_size),
              "max_diff_cached_vs_recomputed_rel_to_max_abs": max(max_err)}
    print({k: v for k, v in report.items() if k != "machine"})
    write_json(args.out, report)


if __name__ == "__main__":
    main()
