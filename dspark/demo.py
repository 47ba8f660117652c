"""`dspark demo`: convert SmolLM2-135M-Instruct + the demo drafter once, then decode dev prompts with DSpark and
autoregressively on ONNX Runtime, methods taking turns prompt by prompt, and report the speedup of this run."""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from dspark.bundle import Manifest, sha256_file
from dspark.errors import DSparkError
from dspark.prompts import dev_prompts_path, read_prompts
from dspark.resolve import DRAFTS, cache_dir
from dspark.runtime import DecodeOptions, RequestResult, Runtime

DEMO_TARGET = "smollm2-135m"
DEMO_DRAFT = "smollm2-135m-dspark"
DEMO_DRAFT_VOCAB = 16384  # heads draft from the 16K most frequent tokens: 2.2x cheaper, same greedy tau


def folder_digest(folder: Path) -> str:
    """Short content hash of a checkpoint folder's files (names and bytes; its documentation aside)."""
    files = sorted(p for p in Path(folder).iterdir() if p.is_file() and p.suffix != ".md")
    return hashlib.sha256("".join(f"{f.name}:{sha256_file(f)}\n" for f in files).encode()).hexdigest()[:10]


def demo_bundle_path(heads: str) -> Path:
    """~/.cache/dspark/bundles/<drafter>-<drafter digest>-v16k-<heads>: a new demo drafter gets a new bundle."""
    folder = DRAFTS[DEMO_DRAFT]()
    if not (folder / "config.json").exists():
        raise DSparkError(f"the demo drafter {DEMO_DRAFT} is missing from this installation")
    return cache_dir() / "bundles" / f"{DEMO_DRAFT}-{folder_digest(folder)}-v{DEMO_DRAFT_VOCAB // 1024}k-{heads}"


def ensure_demo_bundle(bundle: Path, heads: str, say: Callable[[str], None]) -> None:
    """Export (once) and quantize the heads to 8 bits when asked; torch is needed only for the export."""
    if not (bundle / "manifest.json").exists():
        say(f"converting {DEMO_TARGET} + {DEMO_DRAFT} -> {bundle} (once; a few minutes on 2 cores)")
        from dspark.export.onnx_export import Progress, export_bundle
        from dspark.models.pair import load_pair

        progress = Progress(6)
        with progress.step("loading target and draft"):
            pair = load_pair(DEMO_TARGET, DEMO_DRAFT)
        export_bundle(pair, bundle, force=True, progress=progress, draft_vocab=DEMO_DRAFT_VOCAB)
    if heads == "q8" and "heads" not in Manifest.read(bundle).quantized:
        from dspark.export.quantize import quantize_graph

        quantize_graph(bundle, "heads")


def pick_prompts(rows: list[dict], count: int) -> list[dict]:
    """One prompt per domain in turn (math, chat, code, ...), `count` in all."""
    by_domain: dict[str, list[dict]] = {}
    for r in rows:
        by_domain.setdefault(r.get("domain", "all"), []).append(r)
    return [r for group in zip(*by_domain.values()) for r in group][:count]


@dataclass
class DemoTotals:
    tokens: dict[str, int] = field(default_factory=lambda: {"dspark": 0, "ar": 0})
    seconds: dict[str, float] = field(default_factory=lambda: {"dspark": 0.0, "ar": 0.0})
    committed: list[int] = field(default_factory=list)

    def rate(self, mode: str) -> float:
        return self.tokens[mode] / self.seconds[mode] if self.seconds[mode] else 0.0


def decode_both(rt: Runtime, prompt: str, max_new_tokens: int, totals: DemoTotals) -> dict[str, tuple]:
    outs: dict[str, tuple[RequestResult, float]] = {}
    for mode in ("ar", "dspark"):
        t0 = time.perf_counter()
        res = rt.generate([prompt], DecodeOptions(max_new_tokens=max_new_tokens,
                                                  policy="ar" if mode == "ar" else "all"))[0]
        seconds = time.perf_counter() - t0
        totals.tokens[mode] += len(res.token_ids)
        totals.seconds[mode] += seconds
        outs[mode] = (res, seconds)
    totals.committed += outs["dspark"][0].committed
    return outs


def run_demo(bundle: Path | None, num_prompts: int, max_new_tokens: int, heads: str,
             say: Callable[[str], None], show: Callable[[str], None]) -> DemoTotals:
    rows = pick_prompts(read_prompts(dev_prompts_path()), num_prompts)  # before converting anything
    bundle = bundle or demo_bundle_path(heads)
    ensure_demo_bundle(bundle, heads, say)
    totals = DemoTotals()
    with Runtime(bundle) as rt:
        for r in rows:
            outs = decode_both(rt, r["prompt"], max_new_tokens, totals)
            (ds, ds_s), (ar, ar_s) = outs["dspark"], outs["ar"]
            show(f"\n[{r.get('domain')}] {r['prompt'][:200]}\n")
            show(ds.text.strip())
            show(f"\n  DSpark: {len(ds.token_ids)} tokens, tau {ds.tau:.2f}, {len(ds.token_ids) / ds_s:.1f} tok/s"
                 f" | AR: {len(ar.token_ids) / ar_s:.1f} tok/s | identical to AR: "
                 f"{'yes' if ds.token_ids == ar.token_ids else 'NO'}")
    ds_rate, ar_rate = totals.rate("dspark"), totals.rate("ar")
    tau = sum(totals.committed) / max(1, len(totals.committed))
    show(f"\nDSpark {ds_rate:.1f} tok/s vs autoregressive {ar_rate:.1f} tok/s on ONNX Runtime (fp32, batch 1): "
         f"speedup x{ds_rate / ar_rate:.2f}, tau {tau:.2f}")
    return totals
