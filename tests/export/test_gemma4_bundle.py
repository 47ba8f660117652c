"""A tiny random Gemma-4 pair (sliding and full layers, k_eq_v, soft-cap, a 5-position window) through the export
and the torch-free runtime: the manifest's per-group target cache, no fused verifier, and decoding equal to the
PyTorch reference at batch 1 and 3, greedy and sampled, well past the sliding window."""
import json

import numpy as np
import pytest
import torch

from dspark.bundle import Manifest
from dspark.errors import DSparkError
from dspark.export.check.parity import check_bundle, format_report
from dspark.export.twins.catalog import possible_twins, unfusable
from dspark.kv_layout import bytes_per_position, kv_groups
from dspark.models.pair import Pair
from dspark.models.reference import generate_ar, generate_dspark
from dspark.runtime import DecodeOptions, Runtime
from dspark.runtime.backend import Backend
from dspark.runtime.engine_choice import slot_bytes
from dspark.runtime.slots import Slots
from dspark.runtime.scheduler import VerifyPolicy
from dspark.trt.buildable import not_buildable
from support.gemma4 import F, S, tiny_gemma4_pair
from support.tiny import TinyLoaded, tiny_tokenizer_folder

V, WINDOW, N = 96, 5, 14


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """(target, drafter, bundle): exported once, with the check data `dspark-export check` reads."""
    from dspark.export.trace.onnx_export import export_bundle

    hf, target, drafter = tiny_gemma4_pair()
    root = tmp_path_factory.mktemp("gemma4")
    pair = Pair(loaded=TinyLoaded(hf, tiny_tokenizer_folder(root / "tok", V)), target=target, drafter=drafter,
                draft_source="random")
    return target, drafter, export_bundle(pair, root / "bundle", max_context=256, force=True, quiet=True)


def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, V - 1, (n,), generator=g).tolist() for n in (3, 7, 2)]


def test_manifest_describes_the_cache_by_kv_group(gemma):
    target, _, path = gemma
    man = Manifest.read_checked(path)
    t = man.target
    assert t["kv_groups"] == [{"kind": S, "num_kv_heads": 2, "head_dim": 8, "layers": [0, 2]},
                              {"kind": F, "num_kv_heads": 1, "head_dim": 16, "layers": [1, 3]}]
    assert (t["layer_types"], t["sliding_window"], t["final_logit_softcapping"]) == ([S, F, S, F], WINDOW, 30.0)
    outputs = {o.name: o.shape for o in man.graphs["verifier"].outputs}
    assert outputs["new_kv.0"] == [2, 2, "batch", 2, "seq", 8] and outputs["new_kv.1"] == [2, 2, "batch", 1, "seq", 16]
    assert "new_kv" not in outputs
    past = {i.name: i.shape for i in man.graphs["verifier"].inputs if i.name.startswith("past.")}
    assert past["past.1.key"] == ["batch", 1, "capacity", 16] and past["past.2.value"] == ["batch", 2, "capacity", 8]
    # the PyTorch cache groups its layers the same way
    assert [tuple(g.shape) for g in target.new_cache(3, 9).groups] == [
        (len(g.layers), 2, 3, g.num_kv_heads, 9, g.head_dim) for g in kv_groups(t)]
    # no fused verifier (GroupQueryAttention has no proportional RoPE), the greedy heads twin is there
    assert "verifier_fused" not in man.graphs and "heads_greedy" in man.graphs
    assert "proportional RoPE" in unfusable(t) and possible_twins(man) == ["heads_greedy"]
    assert (man.draft["num_kv_heads"], man.draft["head_dim"]) == (1, 16)  # the draft cache stays uniform


def test_runtime_cache_is_one_buffer_per_group(gemma):
    _, _, path = gemma
    rt = Runtime(path)
    slots = Slots(rt.backend, rt.manifest, VerifyPolicy.parse("ar"), batch=3, capacity=20)
    assert [b.shape for b in slots.kv.buffers] == [(2, 2, 3, 2, 20, 8), (2, 2, 3, 1, 20, 16)]
    assert np.shares_memory(slots.kv.feeds["past.3.value"], slots.kv.buffers[1])
    with pytest.raises(DSparkError, match="2 KV groups"):
        slots.kv.buffer
    per_position = 2 * (2 * 2 * 8 + 2 * 1 * 16) * 4
    assert bytes_per_position(rt.manifest.target) == per_position
    assert slot_bytes(rt.manifest, 20) == (per_position + 2 * 2 * 1 * 16 * 4) * 20  # + the draft's 2 layers


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_runtime_equals_reference_past_the_window(gemma, temperature):
    target, drafter, path = gemma
    rt = Runtime(path)
    stop, ps = tuple(rt.manifest.stop_token_ids), prompts()
    ref_ds = [r.token_ids for r in generate_dspark(target, drafter, ps, N, temperature, 3, stop)]
    ref_ar = [r.token_ids for r in generate_ar(target, ps, N, temperature, 3, stop)]
    assert min(len(p) + len(r) for p, r in zip(ps, ref_ds)) > 2 * WINDOW
    for batch in (1, 3):
        options = DecodeOptions(max_tokens=N, temperature=temperature, seed=3, batch_size=batch)
        ds = rt.generate(ps, options)
        assert [r.token_ids for r in ds] == ref_ds
        if temperature == 0.0 or batch == 3:
            assert [r.token_ids for r in rt.generate(ps, options.replace(policy="ar"))] == ref_ar
    assert any(a > 0 for r in ds for a in r.accepted)


def test_check_passes(gemma):
    report = check_bundle(gemma[2])
    assert report.passed, format_report(report)
    assert {r.output for r in report.rows if r.graph == "verifier"} >= {"new_kv.0", "new_kv.1"}


def test_backends_with_one_cache_buffer_refuse_groups(gemma):
    class OneBuffer(Backend):
        kind = "one-buffer"

        def kv_cache(self, *args, **kw):
            raise AssertionError("not reached")

        def context_rows(self, batch, features):
            raise AssertionError("not reached")

        def zeros(self, shape, dtype=np.float32):
            return np.zeros(shape, dtype)

    with pytest.raises(DSparkError, match=r"one-buffer backend .* \(2 KV groups\); run it on onnxruntime"):
        OneBuffer().grouped_kv_cache(kv_groups(Manifest.read(gemma[2]).target), 1, 8)
    assert "2 KV groups" in not_buildable(Manifest.read(gemma[2]))  # TensorRT says so before it builds


def test_a_quantized_gemma4_bundle_decodes_as_its_own_ar(gemma, tmp_path):
    """4-bit verifier and draft backbone (the portable verifier: fp32 activations for its 4-bit layers, no fused
    twin to rebuild); per-group caches in the agreement run; greedy DSpark equals the quantized verifier's AR."""
    import shutil

    from dspark.export.quantize.bundle import QuantizeOptions, quantize_bundle

    bundle = tmp_path / "q"
    shutil.copytree(gemma[2], bundle)
    records = quantize_bundle(bundle, ["verifier", "draft"], QuantizeOptions(
        bits=4, block_size=16, min_elements=0, agreement_prompts=2, agreement_tokens=8))
    assert records["verifier"]["layer_accuracy_levels"] == [0]
    assert records["verifier"]["agreement"]["positions"] == 16
    assert "verifier_fused" not in Manifest.read_checked(bundle).graphs
    with Runtime(bundle, threads=1) as rt:
        ps = prompts()
        ar = [r.token_ids for r in rt.generate(ps, DecodeOptions(max_tokens=N, policy="ar"))]
        assert [r.token_ids for r in rt.generate(ps, DecodeOptions(max_tokens=N, policy="all"))] == ar


@pytest.mark.parametrize("edit, says", [
    (lambda t: t["kv_groups"][0]["layers"].remove(2), "every layer 0..3 once"),
    (lambda t: t["kv_groups"][1].update(head_dim=8), "head_dim"),
    (lambda t: t["kv_groups"][1].update(num_kv_heads=2, head_dim=8), "two groups of one geometry"),
])
def test_manifest_with_wrong_kv_groups_is_refused(gemma, tmp_path, edit, says):
    raw = json.loads((gemma[2] / "manifest.json").read_text())
    edit(raw["target"])
    (tmp_path / "manifest.json").write_text(json.dumps(raw))
    for spec in raw["graphs"].values():
        (tmp_path / spec["file"]).write_bytes(b"")
    with pytest.raises(DSparkError, match=says) as err:
        Manifest.read(tmp_path)
    assert "\n" not in str(err.value)


def test_lazy_bf16_export_checks(tmp_path):
    """The way a real checkpoint converts: a bf16 folder loaded lazily (meta modules, layer_scalar read from the
    checkpoint), the bundle stored at its precision, and `dspark-export check` (fp32 arithmetic on the rounded
    weights, the embedding scaled in fp32 on both sides) passes."""
    from dspark.export.trace.onnx_export import export_bundle
    from dspark.models.pair import load_pair
    from support.gemma4 import tiny_gemma4

    tiny_gemma4(seed=2).to(torch.bfloat16).save_pretrained(tmp_path / "gemma")
    tiny_tokenizer_folder(tmp_path / "gemma", 90)  # ids 90..95 unused: the random drafter's mask token
    pair = load_pair(str(tmp_path / "gemma"), "random", lazy=True)
    bundle = export_bundle(pair, tmp_path / "bundle", max_context=128, quiet=True, precision="auto")
    assert Manifest.read(bundle).precision == "bf16"
    report = check_bundle(bundle)
    assert report.passed, format_report(report)
