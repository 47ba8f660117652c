"""The collapse alarm (dspark.acceptance) on the demo drafter: its verdict on the bundle as converted and on each
collapse planted the ways drafters are read wrong (the plants of tests/support/plants.py), with the measured
acceptance per position. Also two misreadings the alarm is not meant to catch on this drafter, measured to say
how much they cost: target features one position late, and the Markov head left at DeepSpec's initialisation.

  python bench/collapse_alarm.py [--bundle SMOLLM2_V16K_FP32_BUNDLE]

Without --bundle it converts SmolLM2 with the shipped drafter and its 16K draft vocabulary (fp32, no check data).
Writes bench/results/collapse_alarm.json.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

from common import ROOT, machine, write_json

sys.path.insert(0, str(ROOT / "tests"))
from support import plants  # noqa: E402

from dspark import acceptance  # noqa: E402
from dspark.models.draft_vocab import read_ranking  # noqa: E402
from dspark.resolve import resolve_draft  # noqa: E402
from dspark.runtime import Runtime  # noqa: E402


def _ranked():
    return read_ranking(resolve_draft("smollm2-135m-dspark"), 49152)


def _map_ignored(bundle):
    plants.rank_ordered_map(bundle, _ranked())
    plants.ignore_vocabulary_map(bundle)


def _markov_untrained(bundle, seed: int = 0):
    rng = np.random.default_rng(seed)
    values = {}
    for name in ("drafter.markov_head.markov_w1.weight", "drafter.draft_markov_w2"):
        shape = plants.initializer(bundle, name).shape
        values[name] = (rng.standard_normal(shape) * 0.02).astype(np.float32)
    plants.set_initializers(bundle, values)


BUNDLE_PLANTS = {"vocabulary map ignored (frequency-ordered map)": _map_ignored,
                 "LM head untrained": plants.untrained_lm_head,
                 "confidence head untrained": plants.untrained_confidence_head,
                 "Markov head untrained (not a collapse)": _markov_untrained}
RUNTIME_PLANTS = {"anchor off by one": plants.AnchorOffByOne,
                  "target features one position late (not a collapse)": plants.LateFeatures}


def verdict(bundle: Path, wrap=None) -> dict:
    with Runtime(bundle) as rt:
        if wrap is not None:
            wrap(rt)
        v = acceptance.judge(acceptance.measure(rt), rt.manifest)
    out = v.to_dict()
    out["measured"] = {k: out["measured"][k] for k in ("rounds", "tau", "accept_at", "predicted_at", "auc_at_1")}
    print(f"{v.status:>12}  {v.line[:150]}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", type=Path)
    ap.add_argument("--out", default="bench/results/collapse_alarm.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        bundle = args.bundle
        if bundle is None:
            from dspark.export.trace.onnx_export import export_bundle
            from dspark.models.pair import load_pair

            bundle = Path(tmp) / "bundle"
            export_bundle(load_pair("smollm2-135m", "smollm2-135m-dspark", lazy=True), bundle, quiet=True,
                          check_data=False, draft_vocab=16384)
        results = {"as converted": verdict(bundle)}
        for name, wrap in RUNTIME_PLANTS.items():
            results[name] = verdict(bundle, wrap)
        for name, plant in BUNDLE_PLANTS.items():
            planted = Path(tmp) / "planted"
            shutil.copytree(bundle, planted)
            plant(planted)
            results[name] = verdict(planted)
            shutil.rmtree(planted)
    write_json(args.out, {"machine": machine(), "prompts": "the package's 12 demo prompts x 64 tokens, greedy, "
                          "every draft verified", "rules": {"claim_ratio": acceptance.CLAIM_RATIO,
                                                            "floor": acceptance.FLOOR, "min_auc": acceptance.MIN_AUC},
                          "results": results})


if __name__ == "__main__":
    main()
