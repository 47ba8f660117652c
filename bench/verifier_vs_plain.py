"""Is the verifier graph slower than a plain export of the same target? Per-step cost, in one run:

  hf_eager      the HF model's forward with a KV cache (torch, eager attention)
  plain_ort     a plain torch.onnx (dynamo) export of that HF model: logits of the last position + concatenated
                KV, nothing else; ONNX Runtime fp32 with the same session options as the runtime
  verifier_ort  the bundle's verifier.onnx: in-graph acceptance, taps, new-KV-only output, fixed-capacity cache

each over 1 and 8 new positions after a past of --past positions, taking turns repetition by repetition (a shared
VM's drift hits all alike); medians. Also measures the machine's memory bandwidth, since a 135M-parameter fp32
step reads ~0.54 GB of weights and is bandwidth-bound on these VMs.

  python bench/verifier_vs_plain.py --bundle BUNDLE [--past 200] [--reps 20] [--work DIR]
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from common import bandwidth_gb_s, machine, write_json


def export_plain(hf, path: Path) -> None:
    """Dynamo export of the HF model with its past K/V as inputs (eager attention: sdpa's is_causal does not
    trace with a symbolic sequence length)."""
    import torch
    from transformers.cache_utils import DynamicCache

    layers = hf.config.num_hidden_layers

    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = hf

        def forward(self, input_ids, attention_mask, past):
            cache = DynamicCache(config=hf.config)
            for i in range(layers):
                cache.update(past[2 * i], past[2 * i + 1], i)
            out = self.m(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True)
            kv = out.past_key_values.layers
            return out.logits[:, -1], [t for i in range(layers) for t in (kv[i].keys, kv[i].values)]

    kvh, hd = hf.config.num_key_value_heads, hf.config.head_dim
    past = [torch.randn(1, kvh, 16, hd) for _ in range(2 * layers)]
    seq, cap, full = (torch.export.Dim(n, max=m) for n, m in (("seq", 2048), ("past", 4096), ("total", 6144)))
    shapes = {"input_ids": {1: seq}, "attention_mask": {1: full}, "past": [{2: cap} for _ in past]}
    example = (torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 18, dtype=torch.long), past)
    program = torch.onnx.export(Plain().eval(), example, dynamo=True, dynamic_shapes=shapes, external_data=True,
                                input_names=["input_ids", "attention_mask"] + [f"past.{i}" for i in range(len(past))])
    program.optimize()
    path.parent.mkdir(parents=True, exist_ok=True)
    program.save(str(path), external_data=True)


def plain_feeds(session, t: int, past: int) -> dict:
    feeds = {}
    for i in session.get_inputs():
        if i.name == "input_ids":
            feeds[i.name] = np.full((1, t), 100, dtype=np.int64)
        elif i.name == "attention_mask":
            feeds[i.name] = np.ones((1, past + t), dtype=np.int64)
        else:
            feeds[i.name] = np.random.default_rng(0).standard_normal((1, i.shape[1], past, i.shape[3]), np.float32)
    return feeds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--past", type=int, default=200)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--work", default="/tmp/dspark-plain-export", help="where the plain export is cached")
    ap.add_argument("--out", default="bench/results/verifier_vs_plain.json")
    args = ap.parse_args()

    import onnxruntime as ort
    import torch
    from transformers.cache_utils import DynamicCache

    from dspark.bundle import Manifest
    from dspark.calibration.sps import step_feeds
    from dspark.models.target import load_target
    from dspark.runtime.kv import HostKV
    from dspark.runtime.ort_backend import session_options

    bundle = Path(args.bundle)
    manifest = Manifest.read(bundle)
    loaded = load_target(manifest.sources["target"]["name"])
    hf = loaded.hf_model
    plain_path = Path(args.work) / "plain.onnx"
    if not plain_path.exists():
        t = time.perf_counter()
        export_plain(hf, plain_path)
        print(f"plain export: {time.perf_counter() - t:.0f} s")
    plain = ort.InferenceSession(str(plain_path), session_options(), providers=["CPUExecutionProvider"])
    verifier = ort.InferenceSession(str(bundle / manifest.graphs["verifier"].file), session_options(),
                                    providers=["CPUExecutionProvider"])
    layers, kvh, hd = hf.config.num_hidden_layers, hf.config.num_key_value_heads, hf.config.head_dim
    torch.set_num_threads(2)
    cache = HostKV(layers, 1, kvh, args.past + 8, hd)
    cache.commit(0, args.past)
    cache.fit(8)
    draft_probs = np.zeros((1, manifest.block_size, manifest.target["vocab_size"]), dtype=np.float32)

    def hf_step(t: int):
        past = [torch.randn(1, kvh, args.past, hd) for _ in range(2 * layers)]
        ids = torch.full((1, t), 100, dtype=torch.long)

        def run():
            cache = DynamicCache(config=hf.config)
            for i in range(layers):
                cache.update(past[2 * i], past[2 * i + 1], i)
            with torch.inference_mode():
                hf(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return run

    def ort_step(session, feeds):
        return lambda: session.run(None, feeds)

    methods = {}
    for t in (1, 8):
        methods[f"hf_eager_T{t}"] = hf_step(t)
        methods[f"plain_ort_T{t}"] = ort_step(plain, plain_feeds(plain, t, args.past))
        methods[f"verifier_ort_T{t}"] = ort_step(verifier, step_feeds(cache, t, draft_probs))
    for run in methods.values():
        for _ in range(3):
            run()
    times: dict[str, list[float]] = {k: [] for k in methods}
    for _ in range(args.reps):
        for name, run in methods.items():
            t = time.perf_counter()
            run()
            times[name].append(1000 * (time.perf_counter() - t))
    ms = {k: float(np.median(v)) for k, v in times.items()}
    weights_gb = sum(p.numel() for p in hf.parameters()) * 4 / 1e9  # tied embedding counted once
    out = {"machine": machine(), "bundle": str(bundle), "past": args.past, "reps": args.reps,
           "median_ms": ms, "all_ms": times, "memory_bandwidth_gb_s": bandwidth_gb_s(), "weights_gb": weights_gb,
           "ratios": {"verifier_over_plain_T1": ms["verifier_ort_T1"] / ms["plain_ort_T1"],
                      "verifier_over_plain_T8": ms["verifier_ort_T8"] / ms["plain_ort_T8"],
                      "hf_over_plain_T1": ms["hf_eager_T1"] / ms["plain_ort_T1"],
                      "hf_over_verifier_T1": ms["hf_eager_T1"] / ms["verifier_ort_T1"],
                      "verifier_T8_over_T1": ms["verifier_ort_T8"] / ms["verifier_ort_T1"],
                      "plain_T8_over_T1": ms["plain_ort_T8"] / ms["plain_ort_T1"]}}
    out["weights_read_gb_s_verifier_T1"] = weights_gb / (ms["verifier_ort_T1"] / 1000)
    write_json(args.out, out)
    for k, v in ms.items():
        print(f"{k:18s} {v:7.1f} ms")
    for k, v in out["ratios"].items():
        print(f"{k:24s} {v:.2f}")
    print(f"memory bandwidth (copy) {out['memory_bandwidth_gb_s']:.1f} GB/s; weights {weights_gb:.2f} GB -> "
          f"verifier T=1 reads {out['weights_read_gb_s_verifier_T1']:.1f} GB/s")


if __name__ == "__main__":
    main()
