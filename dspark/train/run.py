"""`dspark train`: generate the target's responses, then train and save a DeepSpec-format drafter."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path
from typing import Callable

import click
import numpy as np
import torch

from dspark.errors import DSparkError
from dspark.export.trace.onnx_export import export_bundle
from dspark.models.checkpoint import load_draft, save_draft
from dspark.models.config import with_claim
from dspark.models.draft_vocab import rank_tokens, shortlist, write_ranking
from dspark.models.drafter import DSparkDrafter
from dspark.models.pair import Pair, random_drafter
from dspark.models.target import LoadedTarget, TargetModel, load_target, text_body
from dspark.prompts import dev_prompts_path, read_prompts
from dspark.tokenizer import ChatTokenizer
from dspark.train.data import (check_prompts, compute_taps, generate_responses, generate_responses_torch,
                               import_responses)
from dspark.train.options import TrainOptions
from dspark.train.trainer import Sample, Trainer, TrainConfig, bf16_is_fast, load_samples, split_samples

DEFAULT_SEED = 42


class ResponseProgress:
    """The `progress` callback of the generators: counts finished responses and reports every 25th."""

    def __init__(self, say: Callable[[str], None]):
        self.say, self.done = say, 0

    def __call__(self, finished: int, tokens_per_s: float) -> None:
        self.done += finished
        if self.done // 25 != (self.done - finished) // 25:
            self.say(f"{self.done} responses, {tokens_per_s:.0f} tokens/s")


class TrainRun(TrainOptions):
    """One `dspark train` run: its options (TrainOptions) and the steps that carry them out."""

    def _say(self, msg: str) -> None:
        click.echo(f"[train {time.strftime('%H:%M:%S')}] {msg}", err=True)

    def _read_prompts(self) -> list[dict]:
        rows = read_prompts(self.prompts)
        try:
            check_prompts(rows, dev_prompts_path())
        except DSparkError as e:
            if "dev prompts" in str(e):
                raise
        return rows

    def _random_drafter(self, loaded: LoadedTarget) -> DSparkDrafter:
        return random_drafter(loaded, seed=DEFAULT_SEED if self.seed is None else self.seed,
                              num_layers=self.layers, block_size=self.block_size, markov_rank=self.markov_rank,
                              markov_head_type=self.markov_type, confidence_head=self.confidence,
                              intermediate_size=self.intermediate_size, mask_token_id=self.mask_token_id)

    def _warm_start(self, loaded: LoadedTarget) -> DSparkDrafter:
        """Continue from a trained drafter's weights with a fresh optimizer and schedule. Its STS temperatures are
        dropped: they belong to the old weights, so calibrate again after training; so is its claimed acceptance
        (training measures the new one)."""
        body = loaded.hf_model
        drafter = load_draft(self.init_from, loaded.config, text_body(body).embed_tokens, body.lm_head)
        drafter.cfg = with_claim(dataclasses.replace(drafter.cfg, confidence_temperatures=()), (), "")
        drafter.sts_temperatures.fill_(1.0)
        self._say(f"starting from {self.init_from} ({drafter.cfg.num_layers} layers, block {drafter.cfg.block_size}, "
                  f"Markov rank {drafter.cfg.markov_rank})")
        return drafter

    def _anchor_seed(self, drafter: DSparkDrafter) -> int:
        if self.seed is not None or self.init_from is None:
            return DEFAULT_SEED if self.seed is None else self.seed
        digest = hashlib.sha256()
        for p in drafter.parameters():
            digest.update(p.detach().float().cpu().numpy().tobytes()[:4096])
        return DEFAULT_SEED ^ int.from_bytes(digest.digest()[:4], "little")

    def _precision(self) -> str:
        if self.precision != "auto":
            return self.precision
        return "bf16" if bf16_is_fast(torch.device("cuda" if torch.cuda.is_available() else "cpu")) else "fp32"

    def _generation_bundle(self, pair: Pair) -> Path:
        if self.bundle is not None:
            return self.bundle
        path = self.output / "work" / "target-bundle"
        if not (path / "manifest.json").exists():
            self._say(f"exporting a generation bundle to {path}")
            export_bundle(pair, path, force=True)
        return path

    def run(self) -> Path:
        """The checkpoint folder (with generate_only: the response cache)."""
        rows = self._read_prompts()
        data = self.data or self.output / "data"
        loaded = load_target(self.target)
        drafter = self._warm_start(loaded) if self.init_from is not None else self._random_drafter(loaded)
        target = loaded.wrapper(drafter.cfg.target_layer_ids)
        self._generate(loaded, target, drafter, rows, data)
        if self.generate_only:
            return data
        return self._train(loaded, target, drafter, rows, data)

    # -- steps ------------------------------------------------------------------------------------------------

    def _generate(self, loaded: LoadedTarget, target: TargetModel, drafter: DSparkDrafter, rows: list[dict],
                  data: Path) -> None:
        """Fill the response cache data/responses.jsonl (+ taps), resuming where it stopped."""
        self._say(f"generating responses into {data} (resumes where it stopped)")
        progress = ResponseProgress(self._say)
        responses = data / "responses.jsonl"
        if self.import_responses is not None:
            added = import_responses(self.import_responses, responses, rows, ChatTokenizer(loaded.folder).encode_chat)
            self._say(f"imported {added} responses from {self.import_responses}")
        if torch.cuda.is_available() and self.bundle is None:  # GPU: HF generate is the fastest generator there
            generate_responses_torch(loaded, rows, responses, drafter.cfg.target_layer_ids, self.max_tokens,
                                     max(self.gen_batch, 64), self.max_prompts, progress=progress)
            return
        # CPU: the ONNX Runtime bundle, autoregressive with continuous batching
        bundle = self._generation_bundle(Pair(loaded, target, drafter, "random"))
        generate_responses(bundle, rows, responses, self.max_tokens, self.gen_batch, self.max_prompts,
                           progress=progress)
        progress.done = 0
        computed = compute_taps(bundle, responses, rows, self.max_prompts, self.gen_batch, progress=progress)
        if computed:
            self._say(f"computed the taps of {computed} imported responses")

    def _train_config(self, drafter: DSparkDrafter) -> TrainConfig:
        cfg_kw = dict(steps=self.steps, lr=self.lr, anchors=self.anchors, seqs_per_step=self.seqs_per_step,
                      seed=self._anchor_seed(drafter), draft_vocab=self.draft_vocab,
                      balance_domains=self.balance_domains, precision=self._precision())
        return TrainConfig(**cfg_kw) if self.loss == "dspark" else TrainConfig.dflash(**cfg_kw)

    def _write_heldout_prompts(self, rows: list[dict], held: list[Sample]) -> None:
        """OUTPUT/heldout_prompts.jsonl, for `dspark calibrate --prompts`."""
        self.output.mkdir(parents=True, exist_ok=True)
        with open(self.output / "heldout_prompts.jsonl", "w") as f:
            for s in sorted(held, key=lambda s: s.index):
                f.write(json.dumps(rows[s.index]) + "\n")

    def _draft_vocab_ids(self, loaded: LoadedTarget, ranked: list[int], vocab_size: int) -> np.ndarray | None:
        if not self.draft_vocab:
            return None
        return shortlist(ranked, self.draft_vocab, vocab_size, ChatTokenizer(loaded.folder).stop_ids)

    def _train(self, loaded: LoadedTarget, target: TargetModel, drafter: DSparkDrafter, rows: list[dict],
               data: Path) -> Path:
        samples = load_samples(data, drafter.cfg.target_layer_ids)
        if not samples:
            raise DSparkError(f"no usable responses in {data}")
        cfg = self._train_config(drafter)
        train, held = split_samples(samples, cfg.holdout)
        self._write_heldout_prompts(rows, held)
        if torch.cuda.is_available():
            target, drafter = target.cuda(), drafter.cuda()
        ranking = rank_tokens([s.tokens[s.prompt_len:] for s in train], drafter.cfg.vocab_size)
        vocab_ids = self._draft_vocab_ids(loaded, ranking[0], drafter.cfg.vocab_size)
        trainer = Trainer(target, drafter, train, self.output, cfg, vocab_ids)
        history, heldout = self._fit(trainer, train, held)
        if heldout:  # what `dspark-export check` holds a bundle of this drafter to (dspark.acceptance)
            drafter.cfg = with_claim(drafter.cfg, heldout["accept_at"],
                                     f"teacher-forced on {len(held)} held-out sequences (dspark train)")
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

    def _fit(self, trainer: Trainer, train: list[Sample], held: list[Sample]) -> tuple[list[dict], dict | None]:
        """Train (resuming a saved state), logging to OUTPUT/train_log.jsonl; the history and the held-out scores."""
        if trainer.load_state():
            self._say(f"resumed at step {trainer.step}")
        cfg = trainer.cfg
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
        return history, heldout
