"""The acceptance-collapse alarm (dspark.acceptance) on the demo drafter: quiet on the bundle as converted, firing
on each collapse planted the ways drafters are read wrong in the field, and plain about a random drafter."""
import json
import shutil
import subprocess
import sys

import pytest

from dspark import acceptance
from dspark.bundle import Manifest
from dspark.models.draft_vocab import read_ranking
from dspark.resolve import resolve_draft
from dspark.runtime import DecodeOptions, Runtime
from support import plants

pytestmark = pytest.mark.integration  # the real SmolLM2-135M-Instruct target and the trained demo drafter

PROMPTS = 6  # of the package's demo prompts: enough drafted rounds for a verdict, half the time


@pytest.fixture(scope="module")
def demo_bundle(tmp_path_factory):
    """SmolLM2 with the shipped drafter and its 16K draft vocabulary (as `dspark demo` converts it), fp32."""
    from dspark.export.trace.onnx_export import export_bundle
    from dspark.models.pair import load_pair

    path = tmp_path_factory.mktemp("alarm") / "bundle"
    export_bundle(load_pair("smollm2-135m", "smollm2-135m-dspark", lazy=True), path, quiet=True, draft_vocab=16384)
    return path


def _copy(bundle, tmp_path, name):
    out = tmp_path / name
    shutil.copytree(bundle, out)
    return out


def _verdict(bundle, plant=None):
    with Runtime(bundle) as rt:
        if plant is not None:
            plant(rt)
        texts = [r["prompt"] for r in acceptance.read_prompts(acceptance.DEMO_PROMPTS)][:PROMPTS]
        return acceptance.judge(acceptance.measure(rt, texts), rt.manifest)


@pytest.fixture(scope="module")
def as_converted(demo_bundle):
    return _verdict(demo_bundle)


def test_the_claim_travels_from_the_checkpoint_into_the_manifest(demo_bundle):
    claim = acceptance.claim_of(Manifest.read(demo_bundle))
    assert claim is not None and 0.3 < claim.accept_at[0] < 0.45 and "teacher-forced" in claim.measured


def test_quiet_on_the_demo_drafter_as_converted(as_converted):
    assert as_converted.status == "ok", as_converted.line
    assert as_converted.measured.accept_at[0] > acceptance.CLAIM_RATIO * as_converted.claim.accept_at[0]
    assert as_converted.measured.auc_at_1 > acceptance.MIN_AUC


def test_the_frequency_ordered_map_decodes_the_same(demo_bundle, tmp_path):
    """The planted vocabulary map below starts from an equivalent bundle: greedy tokens unchanged."""
    ordered = _copy(demo_bundle, tmp_path, "ordered")
    plants.rank_ordered_map(ordered, read_ranking(resolve_draft("smollm2-135m-dspark"), 49152))
    texts = [r["prompt"] for r in acceptance.read_prompts(acceptance.DEMO_PROMPTS)][:2]
    outs = []
    for bundle in (demo_bundle, ordered):
        with Runtime(bundle) as rt:
            outs.append([(r.token_ids, r.accepted) for r in rt.generate(texts, DecodeOptions(max_tokens=32))])
    assert outs[0] == outs[1]


def _vocabulary_map_ignored(bundle):
    plants.rank_ordered_map(bundle, read_ranking(resolve_draft("smollm2-135m-dspark"), 49152))
    plants.ignore_vocabulary_map(bundle)


@pytest.mark.parametrize("plant", ["vocabulary map ignored", "LM head untrained", "confidence head untrained"])
def test_fires_on_a_planted_collapse(demo_bundle, tmp_path, plant, as_converted):
    bundle = _copy(demo_bundle, tmp_path, "planted")
    {"vocabulary map ignored": _vocabulary_map_ignored, "LM head untrained": plants.untrained_lm_head,
     "confidence head untrained": plants.untrained_confidence_head}[plant](bundle)
    verdict = _verdict(bundle)
    assert verdict.status == "collapse", (plant, verdict.line)
    assert verdict.failed and "likely causes" in verdict.line or "confidence head" in verdict.line


def test_fires_on_an_anchor_off_by_one(demo_bundle):
    verdict = _verdict(demo_bundle, plants.AnchorOffByOne)
    assert verdict.status == "collapse", verdict.line


def test_without_a_claim_the_floor_judges(demo_bundle, tmp_path, as_converted):
    bundle = _copy(demo_bundle, tmp_path, "no-claim")
    manifest = Manifest.read(bundle)
    del manifest.draft["expected_acceptance"]
    manifest.write(bundle)
    verdict = _verdict(bundle)
    assert verdict.status == "ok" and verdict.claim is None and "floor" in verdict.notes[0]
    planted = _verdict(bundle, plants.AnchorOffByOne)
    assert planted.status == "collapse" and "below 0.15" in planted.line


def test_check_cli_fails_in_one_line_and_records_the_measurement(demo_bundle, tmp_path):
    bundle = _copy(demo_bundle, tmp_path, "cli")
    plants.untrained_lm_head(bundle)
    out = subprocess.run([sys.executable, "-c", "from dspark.cli import export_main; export_main()", "check",
                          str(bundle)], capture_output=True, text=True)
    assert out.returncode == 1, out.stdout + out.stderr
    line = next(x for x in out.stdout.splitlines() if x.startswith("acceptance:"))
    assert "COLLAPSE" in line and "likely causes" in line
    recorded = json.loads((bundle / acceptance.FILE).read_text())
    assert recorded["status"] == "collapse"
    assert acceptance.recorded_position1(bundle) < acceptance.CLAIM_RATIO * recorded["claim"]["accept_at"][0]
