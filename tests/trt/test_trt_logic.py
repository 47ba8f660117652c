"""TensorRT-path logic that needs neither TensorRT nor a GPU: profiles, version gates, capacity padding."""
import importlib.util

import pytest

from dspark.bundle import Manifest
from dspark.errors import DSparkError
from dspark.trt.profiles import graph_profiles
from dspark.trt.versions import TrtApi


@pytest.fixture(scope="module")
def manifest(tiny_bundle_v6):
    return Manifest.read(tiny_bundle_v6[3])


def test_profiles_cover_every_input_with_static_caches(manifest):
    profs = graph_profiles(manifest, max_batch=4, max_context=64)
    assert [p.name for p in profs["verifier"]] == ["prefill", "verify"]
    bk = manifest.block_size
    for graph, plist in profs.items():
        names = {t.name for t in manifest.graphs[graph].inputs}
        for p in plist:
            assert set(p.shapes) == names
            for lo, opt, hi in p.shapes.values():
                assert all(a <= b <= c for a, b, c in zip(lo, opt, hi))
    verify = profs["verifier"][1].shapes
    assert verify["tokens"][2] == (4, bk + 1)
    lo, opt, hi = verify["past.0.key"]
    assert lo[2] == opt[2] == hi[2] == 64  # capacity fixed: a step is CUDA-graph capturable
    assert (lo[0], hi[0]) == (1, 4)
    assert profs["verifier"][0].shapes["tokens"][2] == (4, 64)
    with pytest.raises(DSparkError, match="exceeds"):
        graph_profiles(manifest, 4, manifest.max_context + 1)


def test_version_gates():
    t10 = TrtApi.parse("10.8.0.43")
    assert t10.plan("fp16") == {"network_flags": [], "builder_flags": ["FP16"], "cast_graph": False}
    assert t10.plan("fp32")["builder_flags"] == []
    t11 = TrtApi.parse("11.0.1")
    assert t11.plan("bf16") == {"network_flags": ["STRONGLY_TYPED"], "builder_flags": [], "cast_graph": True}
    assert t11.plan("fp32")["cast_graph"] is False
    for bad in ("8.6.1", "9.0", "12.0", "x.y"):
        with pytest.raises(DSparkError):
            TrtApi.parse(bad)
    with pytest.raises(DSparkError, match="precision"):
        t10.plan("int4")


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is None, reason="TensorRT is not installed")
def test_real_build_and_plugin_layer(tiny_bundle_v6, tmp_path):
    from dspark.trt.build import build_engines

    out = build_engines(tiny_bundle_v6[3], precision="fp32", max_batch=2, max_context=64, work_dir=tmp_path)
    assert all((tiny_bundle_v6[3] / "engines" / f"{g}.plan").exists() for g in ("verifier", "draft", "heads"))
    assert out["plugin_layers"]["heads"] >= 1


def test_manifest_keeps_the_tensorrt_section_it_is_given(tiny_bundle_v6, tmp_path):
    """`dspark-export build` records its engines in the manifest; the bundle must stay readable afterwards."""
    import shutil

    from dspark.bundle import Manifest
    from dspark.runtime import Runtime

    bundle = tmp_path / "bundle"
    shutil.copytree(tiny_bundle_v6[3], bundle)
    man = Manifest.read(bundle)
    section = {"tensorrt": "10.16.0", "max_batch": 2, "max_context": 64,  # as every build writes them
               "engines": {"verifier": {"file": "engines/verifier.plan"}},
               "plugin": {"library": "engines/libdspark_trt_plugin.so", "name": "ConfidenceTruncate"}}
    man.tensorrt = section
    man.write(bundle)
    assert not (bundle / "manifest.json.tmp").exists()
    assert Manifest.read(bundle).tensorrt == section
    assert Runtime(bundle).manifest.tensorrt == section


def test_recorded_inputs_padded_to_the_engine_capacity_give_the_same_outputs(tiny_bundle_v6, manifest):
    """doctor replays ONNX Runtime's recorded inputs on engines with caches bound at --max-context."""
    import numpy as np

    from dspark.export.check.parity import CAPTURE, CHECK_DIR
    from dspark.runtime.ort_backend import OrtBackend
    from dspark.trt.profiles import pad_capacity

    folder = tiny_bundle_v6[3]
    backend = OrtBackend(folder, manifest)
    checked = 0
    for name, count in CAPTURE.items():
        for i in range(count):
            feeds = dict(np.load(folder / CHECK_DIR / f"{name}_{i}_inputs.npz"))
            padded = pad_capacity(manifest.graphs[name], feeds, 200)
            grown = [k for k in feeds if padded[k].shape != feeds[k].shape]
            if name != "heads":
                assert grown and all(200 in padded[k].shape for k in grown)
            want = getattr(backend, name).run(feeds)
            got = getattr(backend, name).run(padded)
            for k in want:
                np.testing.assert_allclose(got[k].numpy(), want[k].numpy(), atol=1e-5, err_msg=f"{name}.{k}")
            checked += 1
    assert checked == sum(CAPTURE.values())
    with pytest.raises(DSparkError, match="engines 1"):
        pad_capacity(manifest.graphs["verifier"], dict(np.load(folder / CHECK_DIR / "verifier_1_inputs.npz")), 1)
