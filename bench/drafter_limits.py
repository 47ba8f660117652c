"""What limits the demo drafter's acceptance: data size, depth, Markov rank, block size and training length.

Every configuration trains from random weights on the same response cache with the same seed, schedule and draft
vocabulary, and is scored teacher-forced on the same held-out responses (the seeded 5% split `dspark train` keeps
out) every --eval-every steps, so the runs differ only in the one setting named. Configurations run one per
process (one CPU thread each, so two run side by side on two cores); `--report` gathers them.

  python bench/drafter_limits.py --data DATA_DIR --config base [--steps 1200]    # one per configuration
  python bench/drafter_limits.py --report                                         # after the runs

Writes bench/results/drafter_limits/CONFIG.json per run and bench/results/drafter_limits.{json,png}.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from common import draft_vocab_ids, machine, pyplot, training_inputs, write_json
from dspark.train.trainer import Trainer, TrainConfig

BASE = dict(layers=2, markov_rank=48, block_size=7, data_fraction=1.0)
CONFIGS = {
    "base": {},
    "data-25pct": dict(data_fraction=0.25),
    "data-50pct": dict(data_fraction=0.5),
    "layers-1": dict(layers=1),
    "layers-4": dict(layers=4),
    "rank-0": dict(markov_rank=0),
    "rank-128": dict(markov_rank=128),
    "block-4": dict(block_size=4),
}
COMMON_POSITIONS = 4  # every configuration drafts at least this many: tau over them compares across block sizes
RESULTS = Path("bench/results/drafter_limits")


def tau_over(accept_at: list[float], positions: int) -> float:
    tau, run = 1.0, 1.0
    for a in accept_at[:positions]:
        run *= a
        tau += run
    return round(tau, 4)


def train_one(args, name: str) -> dict:
    torch.set_num_threads(args.threads)
    setting = {**BASE, **CONFIGS[name]}
    loaded, target, drafter, train, held = training_inputs(
        args.target, args.data, seed=args.seed, num_layers=setting["layers"], block_size=setting["block_size"],
        markov_rank=setting["markov_rank"])
    ids = draft_vocab_ids(loaded, drafter, train, args.draft_vocab)  # from all of train: one vocabulary for every run
    used = train[:max(1, round(len(train) * setting["data_fraction"]))]  # the cache is in domain-interleaved order
    cfg = TrainConfig(steps=args.steps, lr=args.lr, anchors=args.anchors, seqs_per_step=args.seqs_per_step,
                      draft_vocab=args.draft_vocab, precision=args.precision, seed=args.seed, save_every=10 ** 9)
    trainer = Trainer(target, drafter, used, Path(tempfile.mkdtemp()), cfg, ids)
    curve, t0 = [], time.perf_counter()
    while trainer.step < cfg.steps:
        trainer.train_step()
        if trainer.step % args.eval_every == 0 or trainer.step == cfg.steps:
            held_stats = trainer.evaluate(held)
            recent = trainer.history[-args.eval_every:]
            point = {"step": trainer.step, "elapsed_s": round(time.perf_counter() - t0, 1),
                     "train_accept_at_1": round(float(np.mean([h["accept_at"][0] for h in recent])), 4),
                     "train_loss": round(float(np.mean([h["loss"] for h in recent])), 4),
                     "heldout_loss": round(held_stats["loss"], 4), "heldout_accept_at": held_stats["accept_at"],
                     "heldout_tau": round(held_stats["tau_prob"], 4),
                     "heldout_tau_4": tau_over(held_stats["accept_at"], COMMON_POSITIONS)}
            curve.append(point)
            print(f"{name} step {trainer.step}: held-out acceptance "
                  f"{', '.join(f'{a:.3f}' for a in point['heldout_accept_at'])}, tau~{point['heldout_tau']:.3f} "
                  f"(train acc@1 {point['train_accept_at_1']:.3f}), {point['elapsed_s']:.0f} s", flush=True)
    params = sum(p.numel() for n, p in drafter.named_parameters() if p.requires_grad)
    return {"config": name, "setting": setting, "trainable_params": int(params), "train_sequences": len(used),
            "train_tokens": int(sum(len(s.tokens) - s.prompt_len for s in used)), "heldout_sequences": len(held),
            "steps": args.steps, "lr": args.lr, "anchors": args.anchors, "seqs_per_step": args.seqs_per_step,
            "draft_vocab": args.draft_vocab, "precision": args.precision, "threads": args.threads,
            "seed": args.seed, "curve": curve, "final": curve[-1], "machine": machine()}


def plot(runs: dict, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for name, r in runs.items():
        steps = [p["step"] for p in r["curve"]]
        style = dict(marker="o", label=name, lw=2.5 if name == "base" else 1.2)
        axes[0].plot(steps, [p["heldout_tau_4"] for p in r["curve"]], **style)
        axes[1].plot(steps, [p["heldout_accept_at"][0] for p in r["curve"]], **style)
        f = r["final"]["heldout_accept_at"]
        axes[2].plot(range(1, len(f) + 1), f, marker="o", label=name, lw=style["lw"])
    axes[0].set(xlabel="optimizer step", ylabel=f"tau over positions 1-{COMMON_POSITIONS} (teacher-forced)",
                title="held-out tau")
    axes[1].set(xlabel="optimizer step", ylabel="acceptance at position 1", title="held-out position 1")
    axes[2].set(xlabel="block position", ylabel="acceptance", title="held-out acceptance at the last step")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("demo drafter: one setting changed at a time from random weights (bench/drafter_limits.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report() -> None:
    runs = {p.stem: json.loads(p.read_text()) for p in sorted(RESULTS.glob("*.json"))}
    runs = {k: runs[k] for k in sorted(runs, key=lambda k: list(CONFIGS).index(k) if k in CONFIGS else 99)}
    if not runs:
        raise SystemExit(f"no runs in {RESULTS}: run with --config first")
    base = runs.get("base")
    table = {}
    for name, r in runs.items():
        f = r["final"]
        row = {"heldout_tau": f["heldout_tau"], "heldout_tau_4": f["heldout_tau_4"],
               "heldout_accept_at": f["heldout_accept_at"], "train_accept_at_1": f["train_accept_at_1"],
               "train_sequences": r["train_sequences"], "trainable_params": r["trainable_params"],
               "s_per_step": round(f["elapsed_s"] / r["steps"], 3)}
        if base is not None:
            row["tau_4_vs_base"] = round(f["heldout_tau_4"] - base["final"]["heldout_tau_4"], 4)
        table[name] = row
        print(f"{name:>9}: held-out tau~{f['heldout_tau']:.3f} (positions 1-{COMMON_POSITIONS}: "
              f"{f['heldout_tau_4']:.3f}), acc@1 {f['heldout_accept_at'][0]:.3f}, train acc@1 "
              f"{f['train_accept_at_1']:.3f}, {row['s_per_step']:.2f} s/step")
    out = RESULTS.with_suffix(".json")
    write_json(out, {"machine": machine(), "common_positions": COMMON_POSITIONS, "table": table,
                     "runs": {k: {kk: v for kk, v in r.items() if kk != "machine"} for k, r in runs.items()}})
    plot(runs, out.with_suffix(".png"))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", choices=sorted(CONFIGS))
    ap.add_argument("--report", action="store_true")
    ap.add_argument("--data", help="response/feature cache of `dspark train`")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--eval-every", type=int, default=300)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--anchors", type=int, default=48)
    ap.add_argument("--seqs-per-step", type=int, default=2)
    ap.add_argument("--draft-vocab", type=int, default=16384)
    ap.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=42)
    args = ap.parse_args()
    if args.report:
        return report()
    if not args.config or not args.data:
        ap.error("--config and --data are needed to train (or --report)")
    result = train_one(args, args.config)
    write_json(RESULTS / f"{args.config}.json", result)


if __name__ == "__main__":
    main()
