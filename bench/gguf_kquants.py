"""GGUF K-quant targets made the way users get them, kept exactly, and decoded against llama.cpp on the same file.

For one Qwen3 shape (random bf16 weights, the real config, bench/export_scale.py's checkpoints): llama.cpp's own
converter (`convert_hf_to_gguf.py` from the llama.cpp sources the llama-cpp-python sdist vendors, --llama) makes an
F16 GGUF and `llama_cpp.llama_model_quantize` each asked type (Q4_K_M, Q5_K_M, ...). Then for each file:
`dspark-export onnx --target FILE.gguf` (weights read from the file, no dequantized cache) and
`dspark-export quantize --graphs verifier,draft --bits 4` (the verifier keeps the file's blocks), each under
/usr/bin/time; the formats kept and the largest |w - gguf| read back from ONNX Runtime's kernel; greedy DSpark
against AR on a few prompts (tokens, not quality: random weights accept nothing); and autoregressive tokens/s of
dspark and of llama.cpp (llama-cpp-python) on the same file and prompts, taking turns, medians.

    python bench/gguf_kquants.py --size 0.6b --types Q4_K_M,Q5_K_M --llama /path/to/vendor/llama.cpp
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import ROOT, machine, write_json
from export_scale import timed, write_drafter, write_target

TOOL = Path(sys.executable).with_name("dspark-export")
PROMPTS = ["What is 12 times 7?", "Name three primes.", "Write one sentence about rivers."]


def make_gguf(llama: Path, target: Path, work: Path, qtype: str) -> Path:
    import llama_cpp

    f16, out = work / "f16.gguf", work / f"{qtype}.gguf"
    if not out.exists() and not f16.exists():
        env = dict(os.environ, PYTHONPATH=str(llama / "gguf-py"))
        subprocess.run([sys.executable, str(llama / "convert_hf_to_gguf.py"), str(target), "--outtype", "f16",
                        "--outfile", str(f16)], check=True, env=env, stdout=subprocess.DEVNULL)
    if not out.exists():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{qtype}")
        params.nthread = 2
        if llama_cpp.llama_model_quantize(str(f16).encode(), str(out).encode(), params) != 0:
            raise SystemExit(f"llama_model_quantize {qtype} failed")
    return out


def decode_speed(bundle: Path, gguf: Path, max_new: int, passes: int) -> dict:
    """Greedy DSpark = AR on the prompts, then AR tokens/s of dspark and llama.cpp taking turns (medians)."""
    from llama_cpp import Llama

    from dspark.runtime import DecodeOptions, Runtime

    with Runtime(bundle) as rt:
        ids = [rt.encode(p) for p in PROMPTS]
        ar = rt.generate(ids, DecodeOptions(max_tokens=max_new, policy="ar", batch_size=1))
        ds = rt.generate(ids, DecodeOptions(max_tokens=max_new, policy="all", batch_size=1))
        equal = [a.token_ids == d.token_ids for a, d in zip(ar, ds)]
        rates: dict[str, list[float]] = {"dspark_ar": [], "llama.cpp": []}
        if not passes:
            return {"greedy_dspark_equals_ar": equal, "max_new_tokens": max_new, "prompts": len(PROMPTS)}
        llm = Llama(model_path=str(gguf), n_ctx=512, n_threads=2, n_threads_batch=2, verbose=False)
        for _ in range(passes):
            t0, n = time.perf_counter(), 0
            for p in ids:
                n += len(rt.generate([p], DecodeOptions(max_tokens=max_new, policy="ar"))[0].token_ids)
            rates["dspark_ar"].append(n / (time.perf_counter() - t0))
            t0, n = time.perf_counter(), 0
            for p in ids:
                llm.reset()
                for k, _tok in enumerate(llm.generate(p, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True)):
                    if k + 1 >= max_new:
                        break
                n += max_new
            rates["llama.cpp"].append(n / (time.perf_counter() - t0))
    med = {k: round(statistics.median(v), 2) for k, v in rates.items()}
    return {"greedy_dspark_equals_ar": equal, "tokens_per_s": {k: [round(x, 2) for x in v] for k, v in rates.items()},
            "median_tokens_per_s": med, "dspark_over_llama_cpp": round(med["dspark_ar"] / med["llama.cpp"], 3),
            "max_new_tokens": max_new, "prompts": len(PROMPTS), "note": "prefill included in both, same prompts"}


def one_type(args, work: Path, gguf: Path) -> dict:
    row: dict = {"type": gguf.stem, "gguf_bytes": gguf.stat().st_size, "precision": args.precision}
    bundle, cache = work / f"bundle-{gguf.stem}", work / "cache"
    if not (bundle / "manifest.json").exists():
        os.environ["DSPARK_CACHE"] = str(cache)  # the target's cache of this run only: its size is reported
        row["export"] = timed([str(TOOL), "onnx", "--target", str(gguf), "--draft", str(work / "draft"), "-o",
                               str(bundle), "--no-check", "-q", "--precision", args.precision],
                              work / f"export-{gguf.stem}.log")
        row["quantize"] = timed([str(TOOL), "quantize", str(bundle), "--graphs", "verifier,draft", "--bits", "4",
                                 "--agreement-prompts", "0"], work / f"quantize-{gguf.stem}.log")
        for step in ("export", "quantize"):
            if row[step]["returncode"]:
                raise SystemExit(f"{step} failed: {row[step]['tail']}")
        row["target_cache_bytes"] = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file())
    manifest = json.loads((bundle / "manifest.json").read_text())
    blocks = manifest["quantized"]["verifier"].get("gguf_blocks", {})
    row["kept_formats"] = blocks.get("formats")
    row["max_abs_weight_diff"] = blocks.get("max_abs_weight_diff")
    row["not_kept"] = blocks.get("unsupported")
    row["matmulnbits"] = manifest["quantized"]["verifier"].get("matmulnbits")
    row["decode"] = decode_speed(bundle, gguf, args.max_tokens, args.passes)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="0.6b")
    ap.add_argument("--types", default="Q4_K_M,Q5_K_M")
    ap.add_argument("--llama", required=True, type=Path, help="llama.cpp sources (convert_hf_to_gguf.py, gguf-py)")
    ap.add_argument("--work", default="/tmp/dspark-gguf-kquants", type=Path)
    ap.add_argument("--max-tokens", "--max-new-tokens", dest="max_tokens", type=int, default=32)
    ap.add_argument("--passes", type=int, default=3, help="tokens/s passes against llama.cpp (0: tokens only)")
    ap.add_argument("--precision", default="bf16", choices=["fp32", "bf16"],
                    help="the bundle's stored precision before quantizing (fp32 is 4x a 4-bit file: 18 GB at 4B)")
    ap.add_argument("--out", default=str(ROOT / "bench/results/gguf_kquants.json"))
    args = ap.parse_args()
    from dspark.models.target import load_target

    work = args.work / args.size
    if not (work / "draft" / "config.json").exists():
        tokenizer_from = load_target("smollm2-135m", lazy=True).folder  # any chat tokenizer: the weights are random
        write_target(args.size, work / "target", tokenizer_from)
        write_drafter(work / "target", work / "draft")
    rows = []
    for qtype in args.types.split(","):
        rows.append(one_type(args, work, make_gguf(args.llama, work / "target", work, qtype)))
        out = write_json(args.out, {"machine": machine(), "size": args.size, "rows": rows})
        print(json.dumps(rows[-1]), flush=True)
    print(out)


if __name__ == "__main__":
    main()
