"""A Gemma-4-12B-shaped pair converted on this machine: random bf16 weights with gemma-4-12B-it's real text config,
a random drafter of DeepSpec's released Gemma-4 shape (5 layers, block 7, Markov rank 256, taps 5/17/29/41/46).

Steps, each in a child process under /usr/bin/time (wall time, peak RSS, peak private memory): write the target
(sharded safetensors + index) and the drafter (DeepSpec layout); `dspark-export onnx --precision bf16 --no-check`;
`dspark-export quantize --graphs verifier,draft --bits 4`; then the 4-bit bundle in a fresh process (load, peak
RSS, one autoregressive step, greedy DSpark against AR on a few prompts: tokens, not quality). Also the cache per
slot from the manifest. Checkpoints and bundles are removed afterwards unless --keep.

    python bench/gemma4_scale.py --work /work/g4scale
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from common import ROOT, machine, write_json
from export_scale import bundle_sizes, runtime_figures, timed, write_drafter, write_random_shards

sys.path.insert(0, str(ROOT / "tests"))
from support.gemma4 import GEMMA4_12B_DRAFT, GEMMA4_12B_TEXT, gemma_tokenizer_folder  # noqa: E402

PROMPTS = ["the cat in the hat", "in the", "a tea"]
TOOL = Path(sys.executable).with_name("dspark-export")


def write_target(folder: Path) -> int:
    """gemma-4-12B-it's text decoder (Gemma4ForCausalLM) with random bf16 weights, norms and layer scalars at 1."""
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    text = dict(GEMMA4_12B_TEXT, model_type="gemma4_text", architectures=["Gemma4ForCausalLM"], dtype="bfloat16")
    config = Gemma4TextConfig(**text)
    with torch.device("meta"):
        model = Gemma4ForCausalLM(config)
        shapes = {k: v.shape for k, v in model.state_dict().items() if not k.endswith(("inv_freq", "embed_scale"))}
    shapes.pop("lm_head.weight", None)  # tied
    params = write_random_shards(folder, shapes)
    config.save_pretrained(folder)
    gemma_tokenizer_folder(folder, 384)
    return params


def cache_per_slot(bundle: Path) -> dict:
    from dspark.bundle import Manifest
    from dspark.kv_layout import bytes_per_position

    man = Manifest.read_checked(bundle)
    per_pos = bytes_per_position(man.target)
    return {"target_kv_bytes_per_position": per_pos,
            "target_kv_gb_per_slot": round(per_pos * man.max_context / 2**30, 3), "max_context": man.max_context}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--max-context", type=int, default=2048)
    ap.add_argument("--keep", action="store_true", help="keep checkpoints and bundles (and reuse kept ones)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gemma4_scale.json")
    ap.add_argument("--agreement-prompts", type=int, default=6, help="quantize's agreement run (0: none)")
    ap.add_argument("--no-runtime", action="store_true", help="stop after quantizing")
    ap.add_argument("--weights", default="auto", help="ONNX Runtime weights mode of the runtime figures")
    ap.add_argument("--merge", action="store_true", help="add the row to the rows already in --out")
    args = ap.parse_args()
    work = args.work
    target, draft, bundle = work / "target", work / "draft", work / "bundle"
    row: dict = {"config": "gemma-4-12B-it text decoder (tests/support/gemma4.py GEMMA4_12B_TEXT)",
                 "draft": GEMMA4_12B_DRAFT}
    t0 = time.perf_counter()
    if not (args.keep and (draft / "config.json").exists()):
        shutil.rmtree(work, ignore_errors=True)
        row["target_params"] = write_target(target)
        row["draft_own_params"] = write_drafter(target, draft, GEMMA4_12B_DRAFT["target_layer_ids"])
    row["make_checkpoints_s"] = round(time.perf_counter() - t0, 1)
    row["target_checkpoint_bytes"] = sum(p.stat().st_size for p in target.glob("*.safetensors"))
    shutil.rmtree(bundle, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    row["export"] = timed([str(TOOL), "onnx", "--target", str(target), "--draft", str(draft), "-o", str(bundle),
                           "--precision", "bf16", "--max-context", str(args.max_context), "--no-check", "-q"],
                          work / "export.log")
    if row["export"]["returncode"] == 0:
        row["bf16_bundle"] = bundle_sizes(bundle)
        row["cache"] = cache_per_slot(bundle)
        row["quantize"] = timed([str(TOOL), "quantize", str(bundle), "--graphs", "verifier,draft", "--bits", "4",
                                 "--agreement-prompts", str(args.agreement_prompts)], work / "quantize.log")
        if row["quantize"]["returncode"] == 0:
            row["q4_bundle"] = bundle_sizes(bundle)
            row["quantized"] = (work / "quantize.log").read_text().split("\tCommand being timed:")[0].strip()
            if not args.no_runtime:
                row["runtime"] = runtime_figures(bundle, PROMPTS, args.weights)
    row["measured"] = time.strftime("%Y-%m-%d %H:%M")
    print(json.dumps(row), flush=True)
    rows = json.loads(args.out.read_text())["rows"] if args.merge and args.out.exists() else []
    write_json(args.out, {"machine": machine(), "rows": [*rows, row]})
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
