"""Integration: the exported SmolLM2-135M-Instruct bundle (demo drafter) on ONNX Runtime."""
import json
import subprocess
import sys

import numpy as np
import pytest

from support.prompts import dev_prompts
from dspark.models.reference import generate_ar
from dspark.runtime import DecodeOptions, Runtime

pytestmark = pytest.mark.integration  # the real SmolLM2-135M-Instruct target

N_PROMPTS, NEW_TOKENS = 10, 128


@pytest.fixture(scope="session")
def smollm2_bundle(tmp_path_factory):
    """SmolLM2 with the demo drafter shipped in the package (its target is the same as the reference's)."""
    from dspark.export.trace.onnx_export import export_bundle
    from dspark.models.pair import load_pair

    pair = load_pair("smollm2-135m", "smollm2-135m-dspark")
    path = tmp_path_factory.mktemp("smollm2") / "bundle"
    export_bundle(pair, path, quiet=True)
    return path


def test_ort_dspark_equals_ort_ar_equals_pytorch_reference(smollm2, smollm2_bundle):
    pair, tok = smollm2
    rt = Runtime(smollm2_bundle)
    ids = [rt.encode(p) for p in dev_prompts(N_PROMPTS, stride=10)]
    assert len(ids) == N_PROMPTS
    ds = rt.generate(ids, DecodeOptions(max_tokens=NEW_TOKENS, batch_size=N_PROMPTS))
    ar = rt.generate(ids, DecodeOptions(max_tokens=NEW_TOKENS, batch_size=N_PROMPTS, policy="ar"))
    ref = generate_ar(pair.target, ids, NEW_TOKENS, stop_ids=tuple(rt.manifest.stop_token_ids))
    for d, a, r in zip(ds, ar, ref):
        assert a.token_ids == r.token_ids
        assert d.token_ids == a.token_ids
    assert sum(len(r.token_ids) for r in ds) > 5 * NEW_TOKENS
    # The shipped drafter is trained: drafts get accepted (a random one: ~0.1 per round, tau 1.09).
    assert np.mean([a for r in ds for a in r.accepted]) > 0.15


def test_check_and_trt_lint_pass(smollm2_bundle):
    from dspark.export.check.parity import check_bundle, format_report

    rep = check_bundle(smollm2_bundle, trt_lint=True)
    assert rep.passed, format_report(rep)


def test_run_cli_streams_and_reports(smollm2_bundle):
    prompt = dev_prompts(1)[0]
    out = subprocess.run([sys.executable, "-m", "dspark.cli", "run", str(smollm2_bundle), "--prompt", prompt,
                          "--max-new-tokens", "24", "--json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    obj = json.loads(out.stdout)
    assert len(obj["token_ids"]) == 24 and obj["tau"] >= 1.0 and obj["tokens_per_s"] > 0
    streamed = subprocess.run([sys.executable, "-m", "dspark.cli", "run", str(smollm2_bundle), "--prompt", prompt,
                               "--max-new-tokens", "24"], capture_output=True, text=True)
    assert streamed.returncode == 0 and streamed.stdout.strip() == obj["text"].strip()
    assert "tau" in streamed.stderr and "tokens/s" in streamed.stderr


def test_the_fused_verifier_at_batch_1_fp32_and_gguf_blocks(smollm2, smollm2_bundle, tmp_path):
    """Batch 1 runs every step on the fused verifier (GroupQueryAttention, SkipSimplifiedLayerNormalization,
    concatenated MatMulNBits): greedy DSpark equals its own AR, and the fp32 one equals PyTorch."""
    from dspark.bundle import Manifest
    from dspark.export.quantize.bundle import QuantizeOptions, quantize_bundle
    from dspark.files import linked_copy
    from dspark.runtime.fused_verifier import FusedVerifier
    from dspark.runtime.ort_backend import OrtBackend

    pair, _ = smollm2
    gguf = tmp_path / "gguf"
    linked_copy(smollm2_bundle, gguf)
    quantize_bundle(gguf, ["verifier"], QuantizeOptions(agreement_prompts=0))
    ids = None
    for bundle in (smollm2_bundle, gguf):
        man = Manifest.read(bundle)
        assert "verifier_fused" in man.graphs
        rt = Runtime(bundle, backend=OrtBackend(bundle, man, verifier="fused"))
        assert isinstance(rt.backend.verifier, FusedVerifier)
        ids = ids or [rt.encode(p) for p in dev_prompts(3, stride=17)]
        options = DecodeOptions(max_tokens=48, batch_size=1, policy="all")
        ds = [r.token_ids for r in rt.generate(ids, options)]
        ar = [r.token_ids for r in rt.generate(ids, options.replace(policy="ar"))]
        assert ds == ar
        assert rt.backend.verifier.steps["portable"] == 0 and rt.backend.verifier.steps["fused"] > 0
        if bundle == smollm2_bundle:
            ref = generate_ar(pair.target, ids, 48, stop_ids=tuple(man.stop_token_ids))
            assert ar == [r.token_ids for r in ref]
