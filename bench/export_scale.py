"""Export cost against model size: random weights with the real Qwen3 shapes, a DeepSpec-shaped drafter.

For each size it writes a random target (bf16, sharded safetensors + index, real config) and a random drafter of
the released shape (5 layers at the target's width, block 7, Markov rank 256) as a DeepSpec checkpoint, then runs
`dspark-export onnx` in a child process under /usr/bin/time (wall time, peak RSS), without check data (the work
Edge-LLM's exporter does) and with it, and loads the bundle in a second child: runtime peak RSS, one
autoregressive step's time, and greedy DSpark against AR on a few prompts.

    python bench/export_scale.py --sizes 0.6b,1.7b,4b --precision bf16 --work /tmp/scale
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from common import ROOT, earlier_rows, machine, write_json

QWEN3 = {  # hidden, layers, intermediate, heads, kv heads, tied embeddings (Qwen3 configs on the Hub)
    "0.6b": (1024, 28, 3072, 16, 8, True),
    "1.7b": (2048, 28, 6144, 16, 8, True),
    "4b": (2560, 36, 9728, 32, 8, True),
    "8b": (4096, 36, 12288, 32, 8, False),
}
VOCAB = 151936
SHARD_BYTES = 2 << 30


def taps(layers: int) -> list[int]:
    """DeepSpec's released drafters tap five layers spread over the target ([1, 9, 17, 25, 33] for 36)."""
    step = (layers - 4) // 4
    return [1 + i * step for i in range(5)]


def write_target(size: str, folder: Path, tokenizer_from: Path) -> int:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    hidden, layers, inter, heads, kv, tied = QWEN3[size]
    config = Qwen3Config(architectures=["Qwen3ForCausalLM"], vocab_size=VOCAB, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, head_dim=128, tie_word_embeddings=tied,
                         max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6, torch_dtype="bfloat16")
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
    if tied:
        shapes.pop("lm_head.weight", None)
    params = write_random_shards(folder, shapes)
    config.save_pretrained(folder)
    for f in tokenizer_from.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
            shutil.copyfile(f, folder / f.name)
    return params


def write_random_shards(folder: Path, shapes: dict) -> int:
    """A new folder of bf16 safetensors shards (up to SHARD_BYTES each, named -of-N, with the index): matrices
    random (normal, 0.02), vectors and scalars at 1; returns the parameter count."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    shard, shard_bytes, weight_map, params, n = {}, 0, {}, 0, 0

    def flush():
        nonlocal shard, shard_bytes, n
        n += 1
        name = f"model-{n:05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
        shard, shard_bytes = {}, 0

    for name, shape in shapes.items():
        if len(shape) <= 1:
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        params += t.numel()
        shard[name] = t
        shard_bytes += t.numel() * 2
        if shard_bytes >= SHARD_BYTES:
            flush()
    if shard:
        flush()
    renamed = {f"model-{i:05d}.safetensors": f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)}
    for old, new in renamed.items():
        (folder / old).rename(folder / new)
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": params * 2}, "weight_map": {k: renamed[v] for k, v in weight_map.items()}}))
    return params


def write_drafter(target: Path, folder: Path, tap_ids: list[int] | None = None) -> int:
    import torch

    from dspark.models.checkpoint import save_draft
    from dspark.models.config import TargetConfig, draft_config_for
    from dspark.models.drafter import DSparkDrafter, init_weights
    from dspark.models.pair import choose_mask_token
    from dspark.models.target import load_target
    from dspark.models.tensors import CheckpointTensors

    loaded = load_target(str(target), lazy=True)
    cfg = draft_config_for(TargetConfig.from_dict(json.loads((target / "config.json").read_text())),
                           mask_token_id=choose_mask_token(loaded), num_layers=5, block_size=7,
                           target_layer_ids=tuple(tap_ids or taps(loaded.config.num_layers)), markov_rank=256)
    tensors = CheckpointTensors(target)
    embed = torch.nn.Embedding.from_pretrained(tensors.read("model.embed_tokens.weight").float())
    head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
    head.weight = embed.weight if "lm_head.weight" not in tensors else torch.nn.Parameter(
        tensors.read("lm_head.weight").float())
    drafter = DSparkDrafter(cfg, embed_tokens=embed, lm_head=head)
    torch.manual_seed(1)
    init_weights(drafter)
    save_draft(drafter, folder, include_shared=True)  # as DeepSpec writes it (Edge-LLM reads it too)
    return sum(t.numel() for t in drafter.trainable_state_dict().values())


def checkpoint_params(folder: Path) -> int:
    """Parameters stored in a checkpoint folder (a drafter's own: its shared embedding/LM head left out)."""
    from safetensors import safe_open

    total = 0
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            for k in f.keys():
                if folder.name == "draft" and k in ("embed_tokens.weight", "lm_head.weight"):
                    continue
                total += int(np.prod(f.get_slice(k).get_shape()))
    return total


def _anon_kb(pid: int) -> int:
    """Private (anonymous) resident memory of a process and its descendants, in KiB."""
    total = 0
    try:
        with open(f"/proc/{pid}/status") as f:
            total += next((int(line.split()[1]) for line in f if line.startswith("RssAnon:")), 0)
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                total += sum(_anon_kb(int(c)) for c in f.read().split())
    except OSError:  # gone meanwhile
        pass
    return total


def timed(cmd: list[str], log: Path) -> dict:
    """Wall time and peak RSS (/usr/bin/time: resident pages, the mapped checkpoint and bundle files included) of
    a command, and its peak private memory sampled every 0.5 s (what the machine cannot reclaim)."""
    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(["/usr/bin/time", "-v", *cmd], stdout=out, stderr=subprocess.STDOUT, text=True)
        anon = 0
        while proc.poll() is None:
            anon = max(anon, _anon_kb(proc.pid))
            time.sleep(0.5)
    wall = time.perf_counter() - t0
    text = log.read_text()
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    return {"returncode": proc.returncode, "wall_s": round(wall, 1),
            "peak_rss_gb": round(int(rss.group(1)) / 2**20, 3) if rss else None,
            "peak_anon_gb": round(anon / 2**20, 3),
            "tail": text.split("\tCommand being timed:")[0].strip().splitlines()[-3:] if proc.returncode else []}


RUN_CHILD = r"""
import json, resource, sys, threading, time
from dspark.runtime import DecodeOptions, Runtime
bundle, prompts, weights = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
anon = [0.0]
def watch():  # process-private memory (ru_maxrss also counts the bundle file's mapped pages, which are shared)
    while True:
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                anon[0] = max(anon[0], int(line.split()[1]) / 2**20)
        time.sleep(0.1)
threading.Thread(target=watch, daemon=True).start()
t0 = time.perf_counter(); rt = Runtime(bundle, weights=weights); load = time.perf_counter() - t0
rss_loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
ids = [rt.encode(p) for p in prompts]
def timed(n):
    t = time.perf_counter(); rt.generate([ids[0]], DecodeOptions(max_tokens=n, policy="ar")); return time.perf_counter() - t
one, five = min(timed(1) for _ in range(2)), min(timed(5) for _ in range(2))
same = []
for p in ids:
    ar = rt.generate([p], DecodeOptions(max_tokens=12, policy="ar"))[0].token_ids
    ds = rt.generate([p], DecodeOptions(max_tokens=12, policy="all"))[0].token_ids
    same.append(ar == ds)
print(json.dumps({"weights": rt.backend.weights, "load_s": round(load, 1), "rss_loaded_gb": round(rss_loaded, 3),
                  "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),
                  "peak_anon_gb": round(anon[0], 3), "ar_step_s": round((five - one) / 4, 4),
                  "greedy_dspark_equals_ar": same}))
"""


def runtime_figures(bundle: Path, prompts: list[str], weights: str = "auto") -> dict:
    """In a fresh process: load time, peak RSS and private memory, one AR step, greedy DSpark vs AR; `weights` is
    the ONNX Runtime weights mode (auto, packed or mapped)."""
    proc = subprocess.run([sys.executable, "-c", RUN_CHILD, str(bundle), json.dumps(prompts), weights],
                          capture_output=True, text=True)
    if proc.returncode:
        return {"error": proc.stderr.strip().splitlines()[-1:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def one_size(size: str, args, tokenizer_from: Path) -> dict:
    work = Path(args.work) / size
    t0 = time.perf_counter()
    if args.keep and (work / "draft" / "config.json").exists():  # kept from an earlier run
        shutil.rmtree(work / "bundle", ignore_errors=True)
        params, draft_params = checkpoint_params(work / "target"), checkpoint_params(work / "draft")
    else:
        shutil.rmtree(work, ignore_errors=True)
        params = write_target(size, work / "target", tokenizer_from)
        draft_params = write_drafter(work / "target", work / "draft")
    row = {"size": size, "target_params": params, "draft_own_params": draft_params,
           "make_checkpoints_s": round(time.perf_counter() - t0, 1)}
    bundle = work / "bundle"
    cmd = [str(Path(sys.executable).with_name("dspark-export")), "onnx", "--target", str(work / "target"),
           "--draft", str(work / "draft"), "-o", str(bundle), "--precision", args.precision, "-q"]
    same_work = work / "bundle-no-check"  # what Edge-LLM's exporter does: the graphs and weights, no check data
    shutil.rmtree(same_work, ignore_errors=True)
    row["export_no_check"] = timed(cmd[:cmd.index("-o") + 1] + [str(same_work)] + cmd[cmd.index("-o") + 2:]
                                   + ["--no-check"], work / "export_no_check.log")
    if size not in args.check_sizes.split(","):  # too big to record check data here: the runtime on this bundle
        if row["export_no_check"]["returncode"] == 0:
            row.update(bundle_sizes(same_work))
            row["runtime"] = runtime_figures(same_work, args.prompts)
        shutil.rmtree(same_work, ignore_errors=True)
        return finish(row, args, work)
    shutil.rmtree(same_work, ignore_errors=True)
    row["export"] = timed(cmd, work / "export.log")
    if row["export"]["returncode"] == 0:
        row.update(bundle_sizes(bundle))
        row["rss_over_weights"] = round(row["export"]["peak_rss_gb"] * 2**30 / max(1, row["weights_bytes"]), 2)
        row["check"] = timed([str(Path(sys.executable).with_name("dspark-export")), "check", str(bundle)],
                             work / "check.log")
        row["runtime"] = runtime_figures(bundle, args.prompts)
    return finish(row, args, work)


def bundle_sizes(bundle: Path) -> dict:
    files = {p.name: p.stat().st_size for p in bundle.iterdir() if p.is_file()}
    return {"bundle_bytes": sum(files.values()), "weights_bytes": files.get("weights.data", 0)}


def finish(row: dict, args, work: Path) -> dict:
    if args.edgellm:
        row["edgellm"] = edgellm_export(Path(args.edgellm), work)
    row["measured"] = time.strftime("%Y-%m-%d %H:%M")
    print(json.dumps(row), flush=True)
    if not args.keep:
        shutil.rmtree(work / "target", ignore_errors=True)
    return row


def edgellm_export(exporter: Path, work: Path) -> dict:
    """NVIDIA TensorRT Edge-LLM's exporter on the same pair: the DSpark base graph, then the draft graph with its
    Markov/confidence sidecars (two runs; times add up, the peak is the larger)."""
    out = work / "edgellm"
    base = timed([str(exporter), str(work / "target"), str(out / "base"), "--dspark-base", "--dspark-draft-dir",
                  str(work / "draft")], work / "edgellm_base.log")
    draft = timed([str(exporter), str(work / "target"), str(out / "draft"), "--dspark-draft", "--dspark-draft-dir",
                   str(work / "draft")], work / "edgellm_draft.log")
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) if out.exists() else 0
    result = {"base": base, "draft": draft, "wall_s": round(base["wall_s"] + draft["wall_s"], 1),
              "peak_rss_gb": max(base["peak_rss_gb"] or 0, draft["peak_rss_gb"] or 0),
              "peak_anon_gb": max(base.get("peak_anon_gb") or 0, draft.get("peak_anon_gb") or 0), "output_bytes": size}
    shutil.rmtree(out, ignore_errors=True)
    return result


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.get("bundle_bytes")]
    x = [r["target_params"] / 1e9 for r in ok]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    checked = [r for r in ok if "export" in r]
    xc = [r["target_params"] / 1e9 for r in checked]
    axes[0].plot(xc, [r["export"]["wall_s"] for r in checked], "o-", label="dspark-export onnx (+ check data)")
    same = [r for r in ok if "export_no_check" in r]
    axes[0].plot([r["target_params"] / 1e9 for r in same], [r["export_no_check"]["wall_s"] for r in same], "o:",
                 label="dspark-export onnx --no-check")
    if any("edgellm" in r for r in ok):
        edge = [r for r in ok if "edgellm" in r]
        axes[0].plot([r["target_params"] / 1e9 for r in edge], [r["edgellm"]["wall_s"] for r in edge], "s--",
                     label="TensorRT Edge-LLM exporter")
        axes[1].plot([r["target_params"] / 1e9 for r in edge], [r["edgellm"]["peak_rss_gb"] for r in edge], "s:",
                     label="Edge-LLM export peak RSS")
    axes[0].legend()
    axes[0].set(xlabel="target parameters (B)", ylabel="export wall time (s)")
    axes[1].plot(xc, [r["export"]["peak_rss_gb"] for r in checked], "o-", label="export peak RSS (+ check data)")
    axes[1].plot([r["target_params"] / 1e9 for r in same], [r["export_no_check"]["peak_rss_gb"] for r in same], "o:",
                 label="export peak RSS, --no-check")
    axes[1].plot(x, [r["weights_bytes"] / 2**30 for r in ok], "s--", label="bundle weights")
    axes[1].plot(x, [r["runtime"].get("peak_rss_gb", float("nan")) for r in ok], "^-", label="runtime peak RSS")
    axes[1].set(xlabel="target parameters (B)", ylabel="GiB")
    axes[1].legend()
    axes[2].plot(x, [r["runtime"].get("ar_step_s", float("nan")) for r in ok], "o-")
    for r, xi in zip(ok, x):
        axes[2].annotate(r["runtime"].get("weights", ""), (xi, r["runtime"].get("ar_step_s", 0)), fontsize=8)
    axes[2].set(xlabel="target parameters (B)", ylabel="one AR step, ONNX Runtime CPU (s)")
    fig.suptitle("dspark-export on random Qwen3-shaped pairs (2-core VM)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="0.6b,1.7b,4b")
    ap.add_argument("--precision", default="bf16", choices=["fp32", "fp16", "bf16"])
    ap.add_argument("--work", default="/tmp/dspark-export-scale")
    ap.add_argument("--keep", action="store_true", help="keep the random checkpoints (and reuse kept ones)")
    ap.add_argument("--edgellm", help="path of tensorrt-edgellm-export: run it on the same pairs for comparison")
    ap.add_argument("--check-sizes", default="0.6b,1.7b,4b",
                    help="sizes also exported with check data and checked (the others: --no-check export only)")
    ap.add_argument("--merge", action="store_true", help="keep the other sizes' rows of an earlier run in --out")
    ap.add_argument("--out", default=str(ROOT / "bench/results/export_scale.json"))
    ap.add_argument("--prompts", nargs="*", default=["What is 12 times 7?", "Name three primes.",
                                                        "Write one sentence about rivers."])
    args = ap.parse_args()
    from dspark.models.target import load_target

    tokenizer_from = load_target("smollm2-135m", lazy=True).folder  # any chat tokenizer: the weights are random
    sizes = args.sizes.split(",")
    rows = earlier_rows(args.out, "size", sizes, args.merge)
    for size in sizes:  # the JSON is rewritten after each size: a long run keeps what it measured
        rows.append(one_size(size, args, tokenizer_from))
        rows.sort(key=lambda r: r["target_params"])
        out = write_json(args.out, {"machine": machine(), "precision": args.precision, "vocab": VOCAB, "rows": rows})
    plot(rows, out.with_suffix(".png"))
    print(out)


if __name__ == "__main__":
    main()
