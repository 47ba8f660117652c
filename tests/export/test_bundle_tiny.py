"""ONNX bundle + torch-free runtime on a tiny random pair: exactness vs the PyTorch reference, lossless sampling
through the graphs (with a negative test), check and TensorRT lint, and the no-torch guarantee."""
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import dspark.export.graphs as graphs
from dspark.export.check.parity import check_bundle
from dspark.export.trace.onnx_export import export_graph, verifier_example
from dspark.export.check.trt_lint import lint_bundle
from dspark.models.pair import Pair
from dspark.models.reference import generate_ar, generate_dspark
from dspark.runtime import DecodeOptions, Runtime
from support.stats import chi_square_pvalue, exact_joint
from support.faults import wrong_verify_logits
from support.tiny import TinyLoaded, restamp

V = 6


@pytest.fixture(scope="module")
def tiny(tiny_bundle_v6):
    return tiny_bundle_v6


def prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_runtime_equals_reference_at_any_batch_size(tiny, temperature):
    hf, target, drafter, path = tiny
    rt = Runtime(path)
    stop = tuple(rt.manifest.stop_token_ids)
    ps = prompts(10)
    ref_ds = [r.token_ids for r in generate_dspark(target, drafter, ps, 24, temperature, 3, stop)]
    ref_ar = [r.token_ids for r in generate_ar(target, ps, 24, temperature, 3, stop)]
    if temperature == 0.0:
        assert ref_ds == ref_ar
    for batch in (None, 4, 1):
        options = DecodeOptions(max_tokens=24, temperature=temperature, seed=3, batch_size=batch)
        ds = rt.generate(ps, options)
        ar = rt.generate(ps, options.replace(policy="ar"))
        assert [r.token_ids for r in ds] == ref_ds
        assert [r.token_ids for r in ar] == ref_ar
    assert any(a > 0 for r in ds for a in r.accepted)


SAMPLES = 24000
PROMPT = [1, 4, 2, 0]


def _bundle_samples(path, seed, n=SAMPLES):
    rt = Runtime(path)
    res = rt.generate([PROMPT] * n, DecodeOptions(max_tokens=3, temperature=1.0, seed=seed, batch_size=4000))
    return [tuple(r.token_ids) for r in res if len(r.token_ids) == 3], [r for r in res]


def test_bundle_sampling_is_lossless(tiny):
    hf, target, drafter, path = tiny
    rt = Runtime(path)
    assert not rt.manifest.stop_token_ids or max(rt.manifest.stop_token_ids) >= V - 1
    expected = exact_joint(hf, PROMPT, 3, V)
    stop = set(rt.manifest.stop_token_ids)
    samples, results = _bundle_samples(path, 2024)
    # Condition on paths that do not stop early: expected mass of those paths, renormalised.
    keep = {k: p for k, p in expected.items() if not stop.intersection(k[:2])}
    assert len(samples) > 0.5 * SAMPLES
    assert chi_square_pvalue(samples, keep) > 1e-3
    assert np.mean([a for r in results for a in r.accepted]) > 0.1  # drafts do get accepted


def test_bundle_with_wrong_acceptance_rule_is_detected(tiny, tmp_path, monkeypatch):
    hf, target, drafter, path = tiny
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    monkeypatch.setattr(graphs, "verify_logits", wrong_verify_logits)
    pair = Pair(TinyLoaded(hf, path), target, drafter, "random")
    export_graph(verifier_example(pair), bad / "verifier.onnx")
    restamp(bad)
    expected = exact_joint(hf, PROMPT, 3, V)
    stop = set(Runtime(bad).manifest.stop_token_ids)
    keep = {k: p for k, p in expected.items() if not stop.intersection(k[:2])}
    samples, _ = _bundle_samples(bad, 2024, SAMPLES // 4)  # far off: p ~1e-73 from 3,000 samples, ~1e-155 at 6,000
    assert chi_square_pvalue(samples, keep) < 1e-6


def test_check_passes_and_catches_a_swapped_graph(tiny, tmp_path):
    hf, target, drafter, path = tiny
    rep = check_bundle(path, trt_lint=True)
    assert rep.passed, [r for r in rep.rows if not r.passed]
    assert {r.graph for r in rep.rows} == {"verifier", "draft", "heads", "heads_greedy", "sampler"}
    assert {r.output for r in rep.rows if r.graph == "verifier"} >= {"logits", "accepted", "next_token"}
    assert rep.e2e["dspark"]["passed"] and rep.e2e["ar"]["passed"]
    import onnx
    from onnx import numpy_helper

    swapped = tmp_path / "swapped"
    shutil.copytree(path, swapped)
    heads = onnx.load(str(swapped / "heads.onnx"))
    for init in heads.graph.initializer:  # a subtly different drafter: one weight nudged
        if "confidence_head.proj.weight" in init.name:
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) + 0.5, init.name))
    onnx.save(heads, str(swapped / "heads.onnx"))
    restamp(swapped)
    bad = check_bundle(swapped)
    assert not bad.passed
    failed = {(r.graph, r.output) for r in bad.rows if not r.passed}
    assert ("heads", "conf_logits") in failed and ("heads", "survival") in failed


def test_check_catches_a_sampler_that_skips_top_k_and_top_p(tiny, tmp_path, monkeypatch):
    from dspark.export.trace.onnx_export import sampler_example
    from dspark.models.sampling import token_probs

    hf, target, drafter, path = tiny
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    monkeypatch.setattr(graphs, "filtered_probs", lambda x, temperature, *rest: token_probs(x, temperature))
    export_graph(sampler_example(Pair(TinyLoaded(hf, path), target, drafter, "random")), bad / "sampler.onnx")
    restamp(bad)
    rep = check_bundle(bad)
    assert not rep.passed and {r.graph for r in rep.rows if not r.passed} == {"sampler"}


def test_trt_lint_is_clean_and_flags_unsupported_graphs(tiny, tmp_path):
    from onnx import TensorProto, helper

    from dspark.export.check.trt_lint import lint_model

    assert lint_bundle(tiny[3]) == []
    x = helper.make_tensor_value_info("x", TensorProto.INT64, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.INT64, [2, 3])
    axis = helper.make_tensor_value_info("axis", TensorProto.INT64, [])
    g = helper.make_graph([helper.make_node("CumSum", ["x", "axis"], ["c"]),
                           helper.make_node("Multinomial", ["c"], ["y"]),
                           helper.make_node("MatMulNBits", ["x"], ["z"], domain="com.microsoft")],
                          "bad", [x, axis], [y])
    findings = lint_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)]), "bad")
    problems = {(f.op, f.problem.split(" (")[0].split(":")[0]) for f in findings}
    assert ("CumSum", "input type INT64 not supported") in problems
    assert any(f.op == "CumSum" and "build-time constant" in f.problem for f in findings)
    assert any(f.op == "Multinomial" for f in findings)
    assert any(f.op == "com.microsoft::MatMulNBits" for f in findings)


def test_runtime_imports_neither_torch_nor_transformers(tiny):
    code = ("import sys; from dspark.runtime import DecodeOptions, Runtime; rt = Runtime(sys.argv[1]); "
            "rt.generate([[1, 2, 3]], DecodeOptions(max_tokens=5)); "
            "list(rt.stream([1, 2], DecodeOptions(max_tokens=3))); "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')); "
            "assert not bad, bad; print('clean')")
    out = subprocess.run([sys.executable, "-c", code, str(tiny[3])], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "clean" in out.stdout


def test_kv_rollback_is_a_length_change():
    from dspark.runtime.kv import HostKV

    kv = HostKV(2, 2, 1, 8, 4)
    new = np.arange(2 * 2 * 2 * 1 * 3 * 4, dtype=np.float32).reshape(2, 2, 2, 1, 3, 4)
    kv.write(new, 1, 3)
    kv.commit(1, 3)
    assert kv.past_mask()[1].tolist() == [1, 1, 1, 0, 0, 0, 0, 0] and kv.past_mask()[0].sum() == 0
    np.testing.assert_array_equal(kv.buffer[:, :, 1, :, :3], new[:, :, 1])
    before = kv.buffer.copy()
    kv.commit(1, 1)  # reject two positions
    assert kv.past_mask()[1].tolist() == [1, 0, 0, 0, 0, 0, 0, 0]
    np.testing.assert_array_equal(kv.buffer, before)  # nothing moved
    assert np.shares_memory(kv.feeds["past.0.key"], kv.buffer)  # graphs read the buffer in place
