"""Drafter training in fp32 vs bf16 autocast: seconds per optimizer step and what the steps learn, in one process.

Two trainers start from the same random drafter and draw the same sequences and anchors; their steps take turns
(fp32, bf16, fp32, ...) so both see the same machine. Reports median seconds per step and the loss and
teacher-forced acceptance curves (means over windows of steps).

  python bench/train_precision.py --data DATA_DIR [--steps 200] [--sequences 120] [--draft-vocab 16384]

Writes bench/results/train_precision.{json,png}.
"""
from __future__ import annotations

import argparse
import copy
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from common import draft_vocab_ids, machine, pyplot, training_inputs, write_json
from dspark.train.trainer import Trainer, TrainConfig, bf16_is_fast

PRECISIONS = ("fp32", "bf16")


def window_means(values: list[float], window: int) -> list[float]:
    return [round(float(np.mean(values[i:i + window])), 4) for i in range(0, len(values), window)]


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    w = report["window"]
    for prec in PRECISIONS:
        r = report["runs"][prec]
        x = [w * (i + 0.5) for i in range(len(r["loss_windows"]))]
        axes[0].plot(x, r["loss_windows"], marker="o", label=f"{prec} ({r['s_per_step_median']:.2f} s/step)")
        axes[1].plot(x, r["accept_at_1_windows"], marker="o", label=prec)
    axes[0].set(xlabel="optimizer step", ylabel="loss", title="training loss")
    axes[1].set(xlabel="optimizer step", ylabel="teacher-forced acceptance, position 1", title="acceptance")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"drafter training, fp32 vs bf16 autocast ({report['steps']} steps each, steps interleaved)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="response/feature cache of `dspark train`")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--sequences", type=int, default=120, help="train on the first N sequences of the cache")
    ap.add_argument("--window", type=int, default=25)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--anchors", type=int, default=48)
    ap.add_argument("--seqs-per-step", type=int, default=2)
    ap.add_argument("--draft-vocab", type=int, default=16384)
    ap.add_argument("--out", default="bench/results/train_precision.json")
    args = ap.parse_args()

    loaded, target, drafter, train, _ = training_inputs(args.target, args.data)
    train = train[:args.sequences]
    ids = draft_vocab_ids(loaded, drafter, train, args.draft_vocab)
    out = Path(args.out)
    trainers = {}
    for prec in PRECISIONS:
        cfg = TrainConfig(steps=args.steps, lr=args.lr, anchors=args.anchors, seqs_per_step=args.seqs_per_step,
                          draft_vocab=args.draft_vocab, precision=prec, save_every=10 ** 9)
        trainers[prec] = Trainer(target, copy.deepcopy(drafter), train, Path(tempfile.mkdtemp()), cfg, ids)
    for tr in trainers.values():  # computes and keeps each sequence's target log-normalizer before the timing
        tr.evaluate(train)
    seconds = {p: [] for p in PRECISIONS}
    hist = {p: [] for p in PRECISIONS}
    for step in range(args.steps):
        for prec, tr in trainers.items():
            t0 = time.perf_counter()
            hist[prec].append(tr.train_step())
            seconds[prec].append(time.perf_counter() - t0)
        if (step + 1) % args.window == 0:
            print(f"step {step + 1}: " + ", ".join(
                f"{p} {np.median(seconds[p][-args.window:]):.2f} s/step loss {hist[p][-1]['loss']:.3f}"
                for p in PRECISIONS), flush=True)
    runs = {p: {"s_per_step_median": float(np.median(seconds[p])),
                "loss_windows": window_means([h["loss"] for h in hist[p]], args.window),
                "accept_at_1_windows": window_means([h["accept_at"][0] for h in hist[p]], args.window),
                "tau_prob_windows": window_means([h["tau_prob"] for h in hist[p]], args.window)}
            for p in PRECISIONS}
    report = {"machine": machine(), "bf16_native": bf16_is_fast(torch.device("cpu")),
              "torch_threads": torch.get_num_threads(), "sequences": len(train), "steps": args.steps,
              "window": args.window, "lr": args.lr, "anchors": args.anchors, "seqs_per_step": args.seqs_per_step,
              "draft_vocab": args.draft_vocab, "runs": runs,
              "speedup_bf16": runs["fp32"]["s_per_step_median"] / runs["bf16"]["s_per_step_median"]}
    print({k: v for k, v in report.items() if k not in ("machine", "runs")})
    write_json(out, report)
    plot(report, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
