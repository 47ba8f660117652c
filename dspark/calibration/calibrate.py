"""`dspark calibrate`: record confidence logits and realised prefix survival from real decoding rounds on a bundle,
fit Sequential Temperature Scaling, and store the temperatures in the bundle manifest (and a draft config)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from dspark.bundle import Manifest
from dspark.calibration.sts import Rounds, fit_sts, reliability, survival
from dspark.errors import DSparkError
from dspark.lazy import optional_import
from dspark.runtime import DecodeOptions, Runtime


def collect_rounds(bundle: Path, prompts: list[str], max_new_tokens: int = 256, temperature: float = 0.0,
                   batch_size: int = 8, seed: int = 0) -> Rounds:
    rt = Runtime(bundle)
    if not rt.manifest.draft.get("confidence_head"):
        raise DSparkError(f"{bundle} has no confidence head to calibrate")
    dec = rt.decoder(prompts, DecodeOptions(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                                            batch_size=batch_size, record_confidence=True))
    for _ in dec:
        pass
    if not dec.confidence_log:
        raise DSparkError("decoding produced no verification rounds to calibrate on")
    z, proposed, accepted = zip(*dec.confidence_log)
    return Rounds(np.stack(z), np.asarray(proposed), np.asarray(accepted))


def write_manifest_calibration(bundle: Path, temps: np.ndarray, meta: dict) -> None:
    manifest = Manifest.read(bundle)
    manifest.calibration["sts_temperatures"] = [float(t) for t in temps]
    manifest.calibration["sts"] = meta
    manifest.write(bundle)


def write_draft_temperatures(draft_dir: Path, temps: np.ndarray) -> None:
    path = draft_dir / "config.json"
    cfg = json.loads(path.read_text())
    cfg["confidence_temperatures"] = [float(t) for t in temps]
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(cfg, indent=2) + "\n")
    os.replace(tmp, path)


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


def calibrate(bundle: Path, prompts: list[str], out_dir: Path, draft_dir: Path | None = None,
              max_new_tokens: int = 256, temperature: float = 0.0, batch_size: int = 8) -> dict:
    rounds = collect_rounds(bundle, prompts, max_new_tokens, temperature, batch_size)
    bk = rounds.conf_logits.shape[1]
    before = np.ones(bk)
    temps = fit_sts(rounds)
    report = {"bundle": str(bundle), "prompts": len(prompts), "rounds": int(len(rounds.proposed)),
              "temperature": temperature, "sts_temperatures": temps.tolist(),
              "before": reliability(rounds, before), "after": reliability(rounds, temps)}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "calibration.json").write_text(json.dumps(report, indent=2) + "\n")
    plot_reliability(rounds, before, temps, out_dir / "reliability.png")
    write_manifest_calibration(bundle, temps, {"rounds": report["rounds"], "decode_temperature": temperature,
                                               "ece_after": [r["ece"] for r in report["after"]]})
    if draft_dir is not None:
        write_draft_temperatures(draft_dir, temps)
    return report
