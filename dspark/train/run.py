"""`dspark train`: generate the target's responses, then train and save a DeepSpec-format drafter."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import click
import torch

from dspark.errors import DSparkError

DEFAULT_SEED = 42


@dataclass
class TrainRun:
    target: str
    prompts: Path
    output: Path
    data: Path | None = None
    bundle: Path | None = None
    max_prompts: int | None = None
    max_new_tokens: int = 256
    gen_batch: int = 16
    layers: int = 2
    block_size: int = 7
    markov_rank: int = 48
    markov_type: str = "vanilla"
    intermediate_size: int = 1024
    confidence: bool = True
    loss: str = "dspark"
    steps: int = 2000
    lr: float = 6e-4
    anchors: int = 32
    seqs_per_step: int = 4
    seed: int | None = None  # None: 42, or with init_from a seed derived from the starting weights
    init_from: str | None = None  # a DeepSpec checkpoint to start from (its architecture wins over the flags)
    draft_vocab: int = 0  # > 0: train the heads over the N most frequent response tokens (export with the same N)
    import_responses: Path | None = None  # responses generated elsewhere (a GPU box) to merge into the cache
    balance_domains: bool = False
    precision: str = "auto"  # auto: bf16 where the device runs it natively (AVX512-BF16/AMX CPU, CUDA), else fp32

    def _say(self, msg: str) -> None:
        click.echo(f"[train {time.strftime('%H:%M:%S')}] {msg}", err=True)

    def _warm_start(self, loaded):
        """Continue from a trained drafter's weights with a fresh optimizer and schedule. Its STS temperatures are
        dropped: they belong to the old weights, so calibrate again after training."""
        from dspark.models.checkpoint import load_draft

        body = loaded.hf_model
        drafter = load_draft(self.init_from, loaded.config, body.model.embed_tokens, body.lm_head)
        drafter.cfg = dataclasses.replace(drafter.cfg, confidence_temperatures=())
        drafter.sts_temperatures.fill_(1.0)
        self._say(f"starting from {self.init_from} ({drafter.cfg.num_layers} layers, block {drafter.cfg.block_size}, "
                  f"Markov rank {drafter.cfg.markov_rank})")
        return drafter

    def _anchor_seed(self, drafter) -> int:
        if self.seed is not None or self.init_from is None:
            return DEFAULT_SEED if self.seed is None else self.seed
        digest = hashlib.sha256()
        for p in drafter.parameters():
            digest.update(p.detach().float().cpu().numpy().tobytes()[:4096])
        return DEFAULT_SEED ^ int.from_bytes(digest.digest()[:4], "little")

    def _precision(self) -> str:
        if self.precision != "auto":
            return self.precision
        from dspark.train.trainer import bf16_is_fast

        return "bf16" if bf16_is_fast(torch.device("cuda" if torch.cuda.is_available() else "cpu")) else "fp32"

    def _generation_bundle(self, pair) -> Path:
        if self.bundle is not None:
            return self.bundle
        path = self.output / "work" / "target-bundle"
        if not (path / "manifest.json").exists():
            from dspark.export.onnx_export import export_bundle

            self._say(f"exporting a generation bundle to {path}")
            export_bundle(pair, path, force=True)
        return path

    def run(self, generate_only: bool = False) -> Path:
        from dspark.cli import default_dev_prompts, read_prompts
        from dspark.models.checkpoint import save_draft
        from dspark.models.draft_vocab import rank_tokens, write_ranking
        from dspark.models.pair import Pair, random_drafter
        from dspark.models.target import load_target
        from dspark.train.data import check_prompts, compute_taps, generate_responses, import_responses
        from dspark.train.trainer import Trainer, TrainConfig, load_samples, split_samples

        rows = read_prompts(self.prompts)
        try:
            check_prompts(rows, default_dev_prompts())
        except DSparkError as e:
            if "dev prompts" in str(e):
                raise
        data = self.data or self.output / "data"
        loaded = load_target(self.target)
        if self.init_from is not None:
            drafter = self._warm_start(loaded)
        else:
            drafter = random_drafter(loaded, seed=DEFAULT_SEED if self.seed is None else self.seed,
                                     num_layers=self.layers, block_size=self.block_size,
                                     markov_rank=self.markov_rank, markov_head_type=self.markov_type,
                                     confidence_head=self.confidence, intermediate_size=self.intermediate_size)
        target = loaded.wrapper(drafter.cfg.target_layer_ids)
        self._say(f"generating responses into {data} (resumes where it stopped)")
        done = [0]

        def progress(k, tps):
            done[0] += k
            if done[0] // 25 != (done[0] - k) // 25:
                self._say(f"{done[0]} responses, {tps:.0f} tokens/s")

        if self.import_responses is not None:
            from dspark.tokenizer import ChatTokenizer

            added = import_responses(self.import_responses, data / "responses.jsonl", rows,
                                     ChatTokenizer(loaded.folder).encode_chat)
            self._say(f"imported {added} responses from {self.import_responses}")
        if torch.cuda.is_available() and self.bundle is None:  # GPU: HF generate is the fastest generator there
            from dspark.train.data import generate_responses_torch

            generate_responses_torch(loaded, rows, data / "responses.jsonl", drafter.cfg.target_layer_ids,
                                     self.max_new_tokens, max(self.gen_batch, 64), self.max_prompts, progress=progress)
        else:  # CPU: the ONNX Runtime bundle, autoregressive with continuous batching
            bundle = self._generation_bundle(Pair(loaded, target, drafter, "random"))
            generate_responses(bundle, rows, data / "responses.jsonl", self.max_new_tokens, self.gen_batch,
                               self.max_prompts, progress=progress)
            done[0] = 0
            computed = compute_taps(bundle, data / "responses.jsonl", rows, self.max_prompts, self.gen_batch,
                                    progress=progress)
            if computed:
                self._say(f"computed the taps of {computed} imported responses")
        if generate_only:
            return data
        samples = load_samples(data, drafter.cfg.target_layer_ids)
        if not samples:
            raise DSparkError(f"no usable responses in {data}")
        cfg_kw = dict(steps=self.steps, lr=self.lr, anchors=self.anchors, seqs_per_step=self.seqs_per_step,
                      seed=self._anchor_seed(drafter), draft_vocab=self.draft_vocab,
                      balance_domains=self.balance_domains, precision=self._precision())
        cfg = TrainConfig(**cfg_kw) if self.loss == "dspark" else TrainConfig.dflash(**cfg_kw)
        train, held = split_samples(samples, cfg.holdout)
        self.output.mkdir(parents=True, exist_ok=True)
        with open(self.output / "heldout_prompts.jsonl", "w") as f:  # for `dspark calibrate --prompts`
            for s in sorted(held, key=lambda s: s.index):
                f.write(json.dumps(rows[s.index]) + "\n")
        if torch.cuda.is_available():
            target, drafter = target.cuda(), drafter.cuda()
        vocab_ids = None
        ranking = rank_tokens([s.tokens[s.prompt_len:] for s in train], drafter.cfg.vocab_size)
        if self.draft_vocab:
            from dspark.models.draft_vocab import shortlist
            from dspark.tokenizer import ChatTokenizer

            ranked, _ = ranking
            vocab_ids = shortlist(ranked, self.draft_vocab, drafter.cfg.vocab_size,
                                  ChatTokenizer(loaded.folder).stop_ids)
        trainer = Trainer(target, drafter, train, self.output, cfg, vocab_ids)
        if trainer.load_state():
            self._say(f"resumed at step {trainer.step}")
        msg = f"training on {len(train)} sequences ({len(held)} held out) for {cfg.steps} steps, {cfg.precision}"
        if cfg.balance_domains:
            msg += "; domains drawn uniformly (" + ", ".join(f"{d} {len(p)}" for d, p in trainer.pools.items()) + ")"
        self._say(msg)
        self.output.mkdir(parents=True, exist_ok=True)
        with open(self.output / "train_log.jsonl", "a") as log:
            history = trainer.run(log=log)
        heldout = trainer.evaluate(held) if held else None
        if heldout:
            self._say(f"held-out sequences: teacher-forced acceptance by position "
                      f"{', '.join(f'{a:.2f}' for a in heldout['accept_at'])}, tau~{heldout['tau_prob']:.2f}")
        ckpt = save_draft(drafter.cpu(), self.output / "checkpoint")
        write_ranking(ckpt, *ranking, drafter.cfg.vocab_size,
                      f"target responses to {len(train)} prompts of {self.prompts.name}")
        summary = {"checkpoint": str(ckpt), "sequences": len(train), "held_out": sorted(s.index for s in held),
                   "tokens": int(sum(len(s.tokens) - s.prompt_len for s in train)), "train_config": cfg.__dict__,
                   "draft_config": drafter.cfg.to_dict(), "final": history[-1] if history else None,
                   "heldout": heldout}
        (self.output / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        self._say(f"wrote {ckpt}")
        return ckpt
