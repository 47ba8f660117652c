"""A trained drafter's acceptance claim, measured as `dspark train` measures its held-out sequences: the target's
greedy responses to prompts the drafter never trained on, then the teacher-forced acceptance per block position
(dspark.train.Trainer.evaluate). `dspark train` writes this into the checkpoint's config.json
(`expected_acceptance`); this script measures it for a drafter trained before it did (the demo drafter), and
writes the figures with how they were made.

  python bench/drafter_claim.py --bundle SMOLLM2_BUNDLE [--skip 1001 --count 48]

--skip: prompts of train.jsonl, in `dspark train`'s domain-interleaved order, the drafter was trained on (the demo
drafter: the first 1001); the next --count are used.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from common import machine, write_json

from dspark.models.checkpoint import load_draft
from dspark.models.draft_vocab import read_ranking, shortlist
from dspark.models.target import load_target
from dspark.prompts import read_prompts
from dspark.resolve import resolve_draft
from dspark.tokenizer import ChatTokenizer
from dspark.train.data import generate_responses, interleave_domains
from dspark.train.trainer import Trainer, TrainConfig, load_samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--draft", default="smollm2-135m-dspark")
    ap.add_argument("--bundle", required=True, help="A bundle of this target with the drafter's taps (responses "
                    "and their target features come from its verifier).")
    ap.add_argument("--prompts", default=str(Path(__file__).resolve().parents[2] / "shared/data/prompts/train.jsonl"))
    ap.add_argument("--skip", type=int, default=1001)
    ap.add_argument("--count", type=int, default=48)
    ap.add_argument("--draft-vocab", type=int, default=16384, help="As the drafter was trained and is exported.")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--out", default="bench/results/drafter_claim.json")
    args = ap.parse_args()
    rows = read_prompts(Path(args.prompts))
    picked = [rows[i] for i in interleave_domains(rows)[args.skip:args.skip + args.count]]
    loaded = load_target(args.target)
    body = loaded.hf_model
    drafter = load_draft(args.draft, loaded.config, body.model.embed_tokens, body.lm_head)
    target = loaded.wrapper(drafter.cfg.target_layer_ids)
    vocab = drafter.cfg.vocab_size
    ids = None
    if args.draft_vocab:
        ids = shortlist(read_ranking(resolve_draft(args.draft), vocab), args.draft_vocab, vocab,
                        ChatTokenizer(loaded.folder).stop_ids)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp)
        generate_responses(Path(args.bundle), picked, data / "responses.jsonl", args.max_tokens, 16)
        samples = load_samples(data, drafter.cfg.target_layer_ids)
        trainer = Trainer(target, drafter, samples, data / "run", TrainConfig(draft_vocab=args.draft_vocab), ids)
        scores = trainer.evaluate(samples)
    domains = sorted({r.get("domain", "all") for r in picked})
    write_json(args.out, {
        "machine": machine(), "draft": args.draft, "target": args.target, "bundle": args.bundle,
        "prompts": f"{Path(args.prompts).name}, positions {args.skip}..{args.skip + args.count - 1} of dspark "
                   f"train's domain-interleaved order ({', '.join(domains)})",
        "sequences": scores["sequences"], "accept_at": scores["accept_at"], "tau_prob": scores["tau_prob"],
        "loss": scores["loss"], "draft_vocab": args.draft_vocab, "max_tokens": args.max_tokens})
    print(f"accept_at {scores['accept_at']} tau~{scores['tau_prob']:.3f} on {scores['sequences']} sequences")


if __name__ == "__main__":
    main()
