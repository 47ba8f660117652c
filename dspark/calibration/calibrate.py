"""`dspark calibrate`: record confidence logits and realised prefix survival from real decoding rounds on a bundle,
fit Sequential Temperature Scaling, and store the temperatures in the bundle manifest (and a draft config)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

import numpy as np

from dspark.acceptance import DraftRounds, conditional_acceptance
from dspark.bundle import Manifest
from dspark.calibration.sts import Rounds, fit_sts, reliability, survival
from dspark.errors import DSparkError
from dspark.files import Temporary, read_json, write_text_atomic
from dspark.lazy import optional_import
from dspark.models.config import WEIGHTS, WEIGHTS_INDEX, DraftConfig
from dspark.runtime import DecodeOptions, Runtime
from dspark.runtime.observers import ConfidenceLog


def collect_rounds(bundle: Path, prompts: list[str], max_tokens: int = 256, temperature: float = 0.0,
                   batch_size: int = 8, seed: int = 0,
                   say: Callable[[str], None] = lambda line: None) -> tuple[Rounds, int]:
    """The rounds, and how many prompts they came from (`say` gets one line on prompts too long to run)."""
    rt = Runtime(bundle)
    if not rt.manifest.draft.get("confidence_head"):
        raise DSparkError(f"{bundle} has no confidence head to calibrate")
    log = ConfidenceLog()
    decoder = rt.decoder(prompts, DecodeOptions(max_tokens=max_tokens, temperature=temperature, seed=seed,
                                                batch_size=batch_size), observers=[log])
    if decoder.skipped():
        say(decoder.skipped())
    for _ in decoder:
        pass
    if not log.rounds:
        raise DSparkError("decoding produced no verification rounds to calibrate on")
    z, proposed, accepted = zip(*log.rounds)
    return Rounds(np.stack(z), np.asarray(proposed), np.asarray(accepted)), len(prompts) - len(decoder.refused)


def write_manifest_calibration(bundle: Path, temps: np.ndarray, meta: dict) -> None:
    manifest = Manifest.read(bundle)
    manifest.calibration["sts_temperatures"] = [float(t) for t in temps]
    manifest.calibration["sts"] = meta
    manifest.write(bundle)


def check_draft_folder(draft_dir: Path, manifest: Manifest) -> dict:
    """The parsed config.json of a DeepSpec draft checkpoint that belongs to this bundle, checked before any
    decoding or writing: any other config.json (an HF target's, a web app's) is refused and left alone."""
    path = Path(draft_dir) / "config.json"
    if not Path(draft_dir).is_dir() or not path.is_file():
        raise DSparkError(f"--draft {draft_dir} is not a DeepSpec draft checkpoint (no config.json)")
    raw = read_json(path, f"draft config {path}")
    if not isinstance(raw, dict):
        raise DSparkError(f"draft config {path} is not a JSON object")
    cfg = DraftConfig.from_dict(raw)
    if not any((Path(draft_dir) / name).is_file() for name in (WEIGHTS, WEIGHTS_INDEX)):
        raise DSparkError(f"--draft {draft_dir} has no {WEIGHTS}: not a DeepSpec draft checkpoint")
    if cfg.block_size != manifest.block_size or not cfg.enable_confidence_head:
        raise DSparkError(f"--draft {draft_dir} is not this bundle's drafter (block_size {cfg.block_size}, "
                          f"confidence head {cfg.enable_confidence_head}; the bundle has block_size "
                          f"{manifest.block_size} and a confidence head)")
    return raw


def write_draft_temperatures(draft_dir: Path, raw: dict, temps: np.ndarray) -> None:
    cfg = dict(raw)
    cfg["confidence_temperatures"] = [float(t) for t in temps]
    write_text_atomic(Path(draft_dir) / "config.json", json.dumps(cfg, indent=2) + "\n")


def check_out_dir(out_dir: Path) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise DSparkError(f"--out {out_dir} exists and is not a folder")


def plot_reliability(rounds: Rounds, before: np.ndarray, after: np.ndarray, path: Path, bins: int = 10) -> None:
    matplotlib = optional_import("matplotlib", "pip install matplotlib, or dspark[export]")
    matplotlib.use("Agg")
    plt = optional_import("matplotlib.pyplot", "pip install matplotlib")
    bk = rounds.conf_logits.shape[1]
    fig, axes = plt.subplots(1, bk, figsize=(2.6 * bk, 2.8), sharey=True)
    axes = np.atleast_1d(axes)
    for k, ax in enumerate(axes, start=1):
        sel, label = rounds.position(k)
        for temps, name, color in ((before, "raw", "tab:red"), (after, "STS", "tab:blue")):
            pred = survival(rounds.conf_logits[sel], temps)[:, k - 1]
            idx = np.minimum((pred * bins).astype(int), bins - 1)
            xs = [pred[idx == b].mean() for b in range(bins) if (idx == b).sum() >= 5]
            ys = [label[idx == b].mean() for b in range(bins) if (idx == b).sum() >= 5]
            ax.plot(xs, ys, "o-", ms=3, color=color, label=name)
        ax.plot([0, 1], [0, 1], ":", color="gray")
        ax.set_title(f"position {k} (n={int(sel.sum())})", fontsize=8)
        ax.set_xlabel("predicted survival", fontsize=7)
    axes[0].set_ylabel("observed survival", fontsize=7)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def calibrate_prior(bundle: Path, prompts: list[str], out_dir: Path, max_tokens: int = 256,
                    temperature: float = 0.0, batch_size: int = 8,
                    say: Callable[[str], None] = lambda line: None) -> dict:
    """A drafter without a confidence head (DFlash): its acceptance per block position, measured with every draft
    verified, stored as the manifest's calibration.acceptance_prior (the policies then decide on its running
    product, dspark.runtime.scheduler) and in OUT/calibration.json. A position no round reached gets 0."""
    check_out_dir(out_dir)
    rt = Runtime(bundle)
    log = DraftRounds()
    decoder = rt.decoder(prompts, DecodeOptions(max_tokens=max_tokens, temperature=temperature, batch_size=batch_size,
                                                policy="all"), observers=[log])
    if decoder.skipped():
        say(decoder.skipped())
    for _ in decoder:
        pass
    rt.close()
    if not log.verified:
        raise DSparkError("decoding produced no drafted rounds to measure acceptance on")
    measured = conditional_acceptance(np.array(log.verified), np.array(log.accepted), rt.manifest.block_size)
    prior = [0.0 if a != a else round(a, 4) for a in measured]
    ran = len(prompts) - len(decoder.refused)
    report = {"bundle": str(bundle), "prompts": ran, "skipped_prompts": len(prompts) - ran,
              "rounds": len(log.verified), "temperature": temperature, "acceptance_prior": prior}
    out_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out_dir / "calibration.json", json.dumps(report, indent=2) + "\n")
    manifest = Manifest.read(bundle)
    manifest.calibration["acceptance_prior"] = prior
    manifest.calibration["prior"] = {"rounds": report["rounds"], "prompts": ran, "decode_temperature": temperature}
    manifest.write(bundle)
    return report


def calibrate(bundle: Path, prompts: list[str], out_dir: Path, draft_dir: Path | None = None,
              max_tokens: int = 256, temperature: float = 0.0, batch_size: int = 8,
              say: Callable[[str], None] = lambda line: None) -> dict:
    """Every input is checked first; then calibration.json and reliability.png, the manifest and the draft's
    config.json are each written atomically (a temporary renamed into place), and only after decoding. The report
    counts the prompts that ran (`say` gets one line on those skipped as too long for the context). A bundle
    without a confidence head gets its acceptance prior instead (calibrate_prior)."""
    manifest = Manifest.read(bundle)
    if not manifest.draft.get("confidence_head"):
        if draft_dir is not None:
            raise DSparkError("--draft stores STS temperatures, and this bundle's drafter has no confidence head")
        return calibrate_prior(bundle, prompts, out_dir, max_tokens, temperature, batch_size, say)
    draft_raw = check_draft_folder(draft_dir, manifest) if draft_dir is not None else None
    check_out_dir(out_dir)
    rounds, ran = collect_rounds(bundle, prompts, max_tokens, temperature, batch_size, say=say)
    bk = rounds.conf_logits.shape[1]
    before = np.ones(bk)
    temps = fit_sts(rounds)
    if not np.all(np.isfinite(temps)) or np.any(temps <= 0):
        raise DSparkError(f"the fitted STS temperatures {temps.tolist()} are not positive numbers; nothing written")
    report = {"bundle": str(bundle), "prompts": ran, "skipped_prompts": len(prompts) - ran,
              "rounds": int(len(rounds.proposed)),
              "temperature": temperature, "sts_temperatures": temps.tolist(),
              "before": reliability(rounds, before), "after": reliability(rounds, temps)}
    out_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out_dir / "calibration.json", json.dumps(report, indent=2) + "\n")
    png = Temporary(out_dir / "reliability.png")
    try:
        plot_reliability(rounds, before, temps, png.path / "reliability.png")
        os.replace(png.path / "reliability.png", out_dir / "reliability.png")
    finally:
        png.remove()
    write_manifest_calibration(bundle, temps, {"rounds": report["rounds"], "prompts": ran,
                                               "decode_temperature": temperature,
                                               "ece_after": [r["ece"] for r in report["after"]]})
    if draft_raw is not None:
        write_draft_temperatures(draft_dir, draft_raw, temps)
    return report
