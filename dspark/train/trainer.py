"""DSpark drafter training (reference §6): packed blocks per sequence, CE + L1 + confidence BCE,
AdamW with warmup + cosine, checkpoint and resume."""
from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from dspark.errors import DSparkError, first_line
from dspark.files import parse_json
from dspark.models.drafter import DSparkDrafter
from dspark.models.target import TargetModel
from dspark.train.data import read_responses, save_shared

STATE = "train_state.pt"
PRECISIONS = ("fp32", "bf16")


def bf16_is_fast(device: torch.device) -> bool:
    """Whether bf16 matmuls run natively: a CUDA GPU that supports them, or a CPU with AVX512-BF16 or AMX (oneDNN
    emulates bf16 on other CPUs, slower than fp32)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(f in flags.split() for f in ("avx512_bf16", "amx_bf16"))


@dataclass
class TrainConfig:
    steps: int = 2000
    lr: float = 6e-4
    warmup: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seqs_per_step: int = 4  # sequences per optimizer step (gradient accumulation)
    anchors: int = 32  # anchors sampled per sequence
    decay_gamma: float = 4.0  # position weights exp(-j / gamma)
    alpha_ce: float = 0.1
    alpha_l1: float = 0.9
    alpha_conf: float = 1.0
    seed: int = 42
    save_every: int = 100
    holdout: float = 0.05  # fraction of samples kept out of training (calibration / validation)
    draft_vocab: int = 0  # > 0: train the heads on this many most frequent response tokens (as they will draft)
    balance_domains: bool = False  # draw each sequence's domain uniformly, then a sequence of it
    precision: str = "fp32"  # "bf16": the drafter's forward under bf16 autocast (fp32 master weights, fp32 losses)

    @classmethod
    def dflash(cls, **kw) -> "TrainConfig":
        """DeepSpec's DFlash baseline: CE only."""
        return cls(alpha_ce=1.0, alpha_l1=0.0, alpha_conf=0.0, **kw)


@dataclass
class Sample:
    index: int
    tokens: np.ndarray  # prompt + response ids
    prompt_len: int
    taps_path: Path  # [len(tokens) - 1, m*d] fp16 target features
    domain: str = ""


def load_samples(data_dir: Path, tap_ids: tuple[int, ...]) -> list[Sample]:
    out = []
    for r in read_responses(data_dir / "responses.jsonl"):
        if tuple(r.get("tap_ids", ())) != tuple(tap_ids):
            raise DSparkError(f"cached features use taps {r.get('tap_ids')}, the drafter needs {list(tap_ids)}; "
                              f"regenerate the data for these taps")
        tokens = np.asarray(r["prompt_ids"] + r["response_ids"], dtype=np.int64)
        if len(r["response_ids"]) < 3:
            continue
        taps = data_dir / "taps" / f"{r['index']}.npy"
        if taps.exists():  # imported responses have none until compute_taps has run
            out.append(Sample(r["index"], tokens, len(r["prompt_ids"]), taps, r.get("domain", "")))
    return out


def split_samples(samples: list[Sample], holdout: float, seed: int = 0) -> tuple[list[Sample], list[Sample]]:
    """A fixed, seeded split by sample index: each index draws its own key, so whether a prompt is held out never
    depends on which other prompts have responses (data arrives in domain order, not index order)."""
    keys = {s.index: np.random.default_rng([seed, s.index]).random() for s in samples}
    held = [s for s in samples if keys[s.index] < holdout]
    return [s for s in samples if keys[s.index] >= holdout], held


def lr_at(step: int, cfg: TrainConfig) -> float:
    warm = max(1, int(cfg.steps * cfg.warmup))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    progress = (step - warm) / max(1, cfg.steps - warm)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def acceptance(stats: list[dict]) -> dict:
    """Mean teacher-forced acceptance per block position over sequences, and the tau it implies."""
    acc = np.nanmean([st["accept_at"] for st in stats], axis=0)
    return {"accept_at": [round(float(a), 4) for a in acc],
            "tau_prob": float(1 + np.sum(np.cumprod(np.nan_to_num(acc))))}


class Trainer:
    def __init__(self, target: TargetModel, drafter: DSparkDrafter, samples: list[Sample], out_dir: Path,
                 cfg: TrainConfig, vocab_ids: np.ndarray | None = None):
        """vocab_ids: the draft vocabulary of cfg.draft_vocab tokens (sorted ids)."""
        self.target, self.drafter, self.samples, self.out, self.cfg = target, drafter, samples, Path(out_dir), cfg
        self.device = next(drafter.parameters()).device
        if cfg.precision not in PRECISIONS:
            raise DSparkError(f"precision {cfg.precision!r}: expected one of {', '.join(PRECISIONS)}")
        if (0 if vocab_ids is None else len(vocab_ids)) != cfg.draft_vocab:
            raise DSparkError(f"draft_vocab {cfg.draft_vocab} needs that many vocab_ids")
        self.vocab_ids = None if vocab_ids is None else torch.as_tensor(vocab_ids, dtype=torch.long,
                                                                         device=self.device)
        self.head_rows = None
        if self.vocab_ids is not None:  # full id -> position in the draft vocabulary (-1: outside)
            self.local = torch.full((drafter.cfg.vocab_size,), -1, dtype=torch.long, device=self.device)
            self.local[self.vocab_ids] = torch.arange(len(vocab_ids), device=self.device)
            # Both LM heads are frozen (usually one module): gather their rows once, not per sequence (that gather
            # took ~30% of a CPU step's time in the profiler).
            rows = (lambda w: None if w is None else w.detach()[self.vocab_ids].clone())
            head = target.lm_head
            self.head_rows = rows(drafter.lm_head.weight)
            self.target_rows = self.head_rows if head.weight is drafter.lm_head.weight else rows(head.weight)
            self.target_bias = rows(head.bias)
        self._lse: dict[int, torch.Tensor] = {}  # target log-normalizer per sample (draft-vocabulary training)
        self._head_tag = "" if vocab_ids is None else hashlib.sha256(
            target.lm_head.weight.detach().cpu().float().numpy().tobytes()).hexdigest()[:12]
        self.tail_from = max(drafter.cfg.target_layer_ids) + 1
        d = drafter.cfg.hidden_size
        last = drafter.cfg.target_layer_ids.index(max(drafter.cfg.target_layer_ids))
        self.last_tap = slice(last * d, (last + 1) * d)
        for p in target.parameters():
            p.requires_grad_(False)
        for name, p in drafter.named_parameters():
            p.requires_grad_(not name.startswith(("embed_tokens.", "lm_head.")))
        self.params = [p for p in drafter.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.step = 0
        self.rng = np.random.default_rng(cfg.seed)
        pools: dict[str, list[int]] = {}
        for i, s in enumerate(samples):
            pools.setdefault(s.domain if cfg.balance_domains else "", []).append(i)
        self.pools = {d: pools[d] for d in sorted(pools)}
        self.orders: dict[str, list[int]] = {d: [] for d in self.pools}  # a permutation of each pool, walked
        self.cursors: dict[str, int] = {d: 0 for d in self.pools}
        self.history: list[dict] = []

    # -- one sequence -----------------------------------------------------------------------------------------

    def sequence_loss(self, s: Sample, rng: np.random.Generator | None = None) -> tuple[torch.Tensor, dict]:
        """rng draws the anchors (default: the training stream)."""
        cfg, bk = self.cfg, self.drafter.cfg.block_size
        taps = torch.from_numpy(np.load(s.taps_path).astype(np.float32)).to(self.device)  # [T-1, m*d]
        tokens = torch.from_numpy(s.tokens).to(self.device)
        t = len(tokens)
        # Anchors are response tokens followed by another response token (reference §6.2).
        cand = np.arange(s.prompt_len, t - 1)
        k = min(cfg.anchors, len(cand))
        draw = self.rng if rng is None else rng
        anchors = torch.from_numpy(np.sort(draw.choice(cand, size=k, replace=False))).to(self.device)
        first = s.prompt_len - 1
        with torch.no_grad():
            hidden_t = self.target.tail(taps[None, :, self.last_tap], self.tail_from)[0, first:]
            target_probs = self._target_probs(s, hidden_t)  # rows = positions first..T-2
        slot = torch.arange(bk, device=self.device)
        pos = anchors[:, None] + slot[None]  # position whose next token slot j predicts
        valid = (pos + 1 < t)
        pos_c = torch.clamp(pos, max=t - 2)
        labels = tokens[pos_c + 1]
        prev = tokens[torch.clamp(pos, max=t - 1)]  # [anchor, y_1 .. y_{Bk-1}], teacher forced
        with torch.autocast(self.device.type, torch.bfloat16, enabled=cfg.precision == "bf16"):
            hidden = self.drafter.packed_blocks(taps, tokens, anchors)  # [A, Bk, d]
            logits, conf = self.drafter.teacher_forced_heads(hidden, prev, self.vocab_ids, self.head_rows)
        weights = valid.float() * torch.exp(-slot.float() / cfg.decay_gamma)[None]
        wsum = weights.sum().clamp(min=1e-6)
        ce_weights = weights
        if self.vocab_ids is not None:  # labels the draft vocabulary cannot propose carry no CE
            labels = self.local[labels]
            ce_weights = weights * (labels >= 0)
            labels = labels.clamp(min=0)
        ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
        ce = (ce.view_as(weights) * ce_weights).sum() / wsum
        p_t = target_probs[(pos_c - first).clamp(min=0)]
        p_d = torch.softmax(logits.float(), dim=-1)
        l1_each = (p_d - p_t).abs().sum(-1)  # [A, Bk], = 2 TV
        if self.vocab_ids is not None:  # + the target mass outside the draft vocabulary (where the draft has 0)
            l1_each = l1_each + (1 - p_t.sum(-1)).clamp(min=0)
        l1 = (l1_each * weights).sum() / wsum
        alpha = (1 - 0.5 * l1_each.detach()).clamp(0, 1)
        loss = cfg.alpha_ce * ce + cfg.alpha_l1 * l1
        bce = torch.zeros((), device=self.device)
        if self.drafter.confidence_head is not None and cfg.alpha_conf > 0:
            bce = F.binary_cross_entropy_with_logits(conf.float(), alpha, reduction="none")
            bce = (bce * weights).sum() / wsum
            loss = loss + cfg.alpha_conf * bce
        acc_at = [(alpha[:, j][valid[:, j]].mean().item() if valid[:, j].any() else float("nan")) for j in range(bk)]
        return loss, {"loss": loss.item(), "ce": ce.item(), "l1": l1.item(), "bce": bce.item(), "accept_at": acc_at}

    def _target_probs(self, s: Sample, hidden_t: torch.Tensor) -> torch.Tensor:
        """Target distributions [T', V], or with a draft vocabulary only its columns [T', V'] (still normalized
        over the whole vocabulary: the log-normalizer is computed once per sample and kept, in memory and beside
        the sample's taps, so later epochs and later runs on the same data skip the full-vocabulary logits)."""
        if self.vocab_ids is None:
            return torch.softmax(self.target.logits(hidden_t).float(), dim=-1)
        lse = self._lse.get(s.index)
        if lse is None:
            path = self._lse_path(s)
            if path.exists():
                lse = torch.from_numpy(np.load(path)).to(self.device)
            else:
                lse = torch.logsumexp(self.target.logits(hidden_t).float(), dim=-1)
                save_shared(path, lse.cpu().numpy())
            self._lse[s.index] = lse
        rows = F.linear(hidden_t, self.target_rows, self.target_bias).float()
        return torch.exp(rows - lse[:, None])

    def _lse_path(self, s: Sample) -> Path:
        """Keyed by the target's LM head as well: another target's normalizers are never read."""
        taps = Path(s.taps_path)
        return taps.with_name(f"{taps.stem}.lse-{self._head_tag}.npy")

    # -- loop -------------------------------------------------------------------------------------------------

    def next_sample(self) -> Sample:
        """Epochs over the samples in random order; with balance_domains, the domain is drawn uniformly first
        (train.jsonl is ~90% math, the dev set is not), so small domains are replayed more often."""
        names = list(self.pools)
        d = names[int(self.rng.integers(len(names)))] if len(names) > 1 else names[0]
        if self.cursors[d] >= len(self.orders[d]):
            self.orders[d] = self.rng.permutation(len(self.pools[d])).tolist()
            self.cursors[d] = 0
        s = self.samples[self.pools[d][self.orders[d][self.cursors[d]]]]
        self.cursors[d] += 1
        return s

    def train_step(self) -> dict:
        cfg = self.cfg
        for g in self.opt.param_groups:
            g["lr"] = lr_at(self.step, cfg)
        self.opt.zero_grad(set_to_none=True)
        stats = []
        for _ in range(cfg.seqs_per_step):
            loss, st = self.sequence_loss(self.next_sample())
            (loss / cfg.seqs_per_step).backward()
            stats.append(st)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip).item()
        self.opt.step()
        self.step += 1
        out = {"step": self.step, "lr": lr_at(self.step - 1, cfg), "grad_norm": grad_norm,
               "loss": float(np.mean([s["loss"] for s in stats])), "ce": float(np.mean([s["ce"] for s in stats])),
               "l1": float(np.mean([s["l1"] for s in stats])), "bce": float(np.mean([s["bce"] for s in stats])),
               **acceptance(stats)}
        self.history.append(out)
        return out

    def evaluate(self, samples: list[Sample], seed: int = 0) -> dict:
        """Loss and teacher-forced acceptance per block position on sequences not trained on (anchors drawn from
        their own seeded stream, so two drafters evaluated on the same samples see the same blocks)."""
        rng = np.random.default_rng(seed)
        with torch.no_grad():
            stats = [self.sequence_loss(s, rng)[1] for s in samples]
        return {"sequences": len(samples), "loss": float(np.mean([st["loss"] for st in stats])), **acceptance(stats)}

    # -- checkpoint / resume ----------------------------------------------------------------------------------

    def save_state(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        state = {"step": self.step, "model": self.drafter.trainable_state_dict(), "opt": self.opt.state_dict(),
                 "rng": json.dumps(self.rng.bit_generator.state), "orders": json.dumps(self.orders),
                 "cursors": json.dumps(self.cursors),
                 "history": json.dumps(self.history), "config": json.dumps(asdict(self.cfg))}
        tmp = self.out / (STATE + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, self.out / STATE)

    def load_state(self) -> bool:
        path = self.out / STATE
        if not path.exists():
            return False
        try:
            state = torch.load(path, weights_only=True, map_location=self.device)  # tensors, lists, strings only
        except Exception as e:  # a damaged or foreign file: torch and pickle raise many types
            raise DSparkError(f"{path} is not a training state `dspark train` can resume ({type(e).__name__}: "
                              f"{first_line(e, 120)}); use a new --output or remove it") from None
        missing = [k for k in ("config", "model", "opt", "step", "rng", "history") if not isinstance(state, dict)
                   or k not in state]
        if missing:
            raise DSparkError(f"{path} is not a training state `dspark train` can resume (no {missing[0]}); use a "
                              f"new --output or remove it")

        def parsed(key: str, kind: type):
            return parse_json(state[key], f"{path}: {key}", kind)

        saved = parsed("config", dict)
        defaults = asdict(TrainConfig())  # a setting added after the state was written had its default then
        saved = {k: saved.get(k, d) for k, d in defaults.items()}
        diff = {k: (saved[k], v) for k, v in asdict(self.cfg).items() if saved[k] != v}
        if diff:
            raise DSparkError(f"{path} was written with other settings {diff}; use a new --output or the same flags")
        self.drafter.load_state_dict(state["model"], strict=False)
        self.opt.load_state_dict(state["opt"])
        self.step = int(state["step"])
        self.rng.bit_generator.state = parsed("rng", dict)
        if "orders" in state and "cursors" in state:
            self.orders, self.cursors = parsed("orders", dict), parsed("cursors", dict)
        else:  # written before domain pools: one pool
            self.orders, self.cursors = {"": list(state["order"])}, {"": int(state["cursor"])}
        if self.orders.keys() != self.pools.keys():
            raise DSparkError(f"{path} was written for domains {sorted(self.orders)}, the data now has "
                              f"{sorted(self.pools)}; use a new --output")
        self.history = parsed("history", list)
        return True

    def run(self, progress: bool = True, log=None) -> list[dict]:
        bar = tqdm(total=self.cfg.steps, initial=self.step, disable=not progress, dynamic_ncols=True)
        t0 = time.perf_counter()
        while self.step < self.cfg.steps:
            st = self.train_step()
            acc = st["accept_at"]
            bar.set_postfix_str(f"loss {st['loss']:.3f} acc@1 {acc[0]:.2f} acc@4 {acc[min(3, len(acc) - 1)]:.2f} "
                                f"tau~{st['tau_prob']:.2f}")
            bar.update(1)
            if log is not None:
                log.write(json.dumps({**st, "elapsed_s": round(time.perf_counter() - t0, 1)}) + "\n")
                log.flush()
            if self.step % self.cfg.save_every == 0 or self.step == self.cfg.steps:
                self.save_state()
        bar.close()
        return self.history
