"""Shared helpers for the benchmark scripts (prompt selection, stats, JSON output)."""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from types import ModuleType

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dspark.lazy import optional_import  # noqa: E402  (after the path to this checkout)
from dspark.prompts import dev_prompts_path, read_prompts  # noqa: E402


def dev_rows(path: str | None, per_domain: int | None = None, limit: int | None = None) -> list[dict]:
    rows = read_prompts(Path(path) if path else dev_prompts_path())
    if per_domain:
        seen: dict[str, int] = {}
        picked = []
        for r in rows:
            d = r.get("domain", "all")
            if seen.get(d, 0) < per_domain:
                picked.append(r)
                seen[d] = seen.get(d, 0) + 1
        rows = picked
    return rows[:limit] if limit else rows


def position_acceptance(results, block: int) -> dict:
    """Unconditional survival accept_rate@k = #rounds with a >= k / #rounds with proposal >= k, and the
    conditional acceptance (the paper's Fig. 2) = survival@k / survival@k-1."""
    acc = np.concatenate([np.asarray(r.accepted) for r in results if r.accepted]) if results else np.zeros(0)
    prop = np.concatenate([np.asarray(r.proposed) for r in results if r.proposed]) if results else np.zeros(0)
    surv, cond = [], []
    for k in range(1, block + 1):
        reached = prop >= k
        s = float((acc[reached] >= k).mean()) if reached.any() else float("nan")
        surv.append(s)
        prev_sel = (prop >= k) & (acc >= k - 1)
        cond.append(float((acc[prev_sel] >= k).mean()) if prev_sel.any() else float("nan"))
    return {"survival_at": surv, "conditional_at": cond}


def machine() -> dict:
    return {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
            "processor": platform.processor() or "unknown", "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def write_json(path: str | Path, obj: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2) + "\n")
    return path


def earlier_rows(path: str | Path, key: str, redone: list[str], merge: bool) -> list[dict]:
    """With merge: the rows of an earlier run's JSON at `path` whose `key` is not among `redone` (else none)."""
    if not merge or not Path(path).exists():
        return []
    return [r for r in json.loads(Path(path).read_text())["rows"] if r[key] not in redone]


def pyplot() -> ModuleType:
    """matplotlib.pyplot drawing to files only (the Agg backend)."""
    optional_import("matplotlib", "pip install matplotlib").use("Agg")
    return optional_import("matplotlib.pyplot", "pip install matplotlib")


# The training benches' inputs. Their imports stay inside: the runtime benches share this module and must not load
# torch (cpu_decode measures the torch-free runtime).
def training_inputs(target_name: str, data: str | Path, seed: int = 42, **drafter_kw):
    """What the training benches start from, as `dspark train` builds it: the target, a random drafter over it, and
    the response cache split into training and held-out samples (the trainer's seeded split)."""
    from dspark.models.pair import random_drafter
    from dspark.models.target import load_target
    from dspark.train.trainer import TrainConfig, load_samples, split_samples

    loaded = load_target(target_name)
    drafter = random_drafter(loaded, seed=seed, **drafter_kw)
    train, held = split_samples(load_samples(Path(data), drafter.cfg.target_layer_ids), TrainConfig().holdout)
    return loaded, loaded.wrapper(drafter.cfg.target_layer_ids), drafter, train, held


def draft_vocab_ids(loaded, drafter, samples, size: int) -> np.ndarray | None:
    """The `size` most frequent response tokens of samples (plus the stop tokens), as `dspark train --draft-vocab`."""
    if not size:
        return None
    from dspark.models.draft_vocab import rank_tokens, shortlist
    from dspark.tokenizer import ChatTokenizer

    vocab = drafter.cfg.vocab_size
    ranked, _ = rank_tokens([s.tokens[s.prompt_len:] for s in samples], vocab)
    return shortlist(ranked, size, vocab, ChatTokenizer(loaded.folder).stop_ids)


def bandwidth_gb_s() -> float:
    """Best of 5 copies of 256 MB (read + write bytes per second): this machine's memory bandwidth."""
    a = np.ones(256 << 20 >> 2, dtype=np.float32)
    b = np.empty_like(a)
    best = 0.0
    for _ in range(5):
        t = time.perf_counter()
        np.copyto(b, a)
        best = max(best, 2 * a.nbytes / (time.perf_counter() - t) / 1e9)
    return best


def demo_parser(doc: str, out: str, prompts: int, max_tokens: int) -> argparse.ArgumentParser:
    """The options of a benchmark on a bundle (the demo's by default) over a few dev prompts."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", help="default: the demo bundle (`dspark demo` makes it)")
    ap.add_argument("--prompts", type=int, default=prompts)
    ap.add_argument("--max-tokens", type=int, default=max_tokens)
    ap.add_argument("--out", default=out)
    return ap
