"""Flavor logic without building: version gates per flavor, RTX targets, which GPUs recorded engines run on, the
private library folder of TensorRT for RTX."""
import os

import pytest

from dspark.errors import DSparkError
from dspark.trt import rtx_libs
from dspark.trt.versions import (
    FLAVORS,
    TrtApi,
    compute_targets,
    engines_runnable,
    resolve_flavor,
)


def test_rtx_version_gate_and_plan():
    rtx = TrtApi.parse("1.7.1.116", "rtx")
    assert rtx.strongly_typed_only and not rtx.timing_cache and rtx.aot_targets
    assert rtx.plan("fp16") == {"network_flags": ["STRONGLY_TYPED"], "builder_flags": [], "cast_graph": True}
    assert rtx.plan("fp32")["cast_graph"] is False
    for bad in ("10.8.0", "2.0", "0.9"):
        with pytest.raises(DSparkError, match="tensorrt_rtx .* is not supported \\(supported: 1.x\\)"):
            TrtApi.parse(bad, "rtx")
    with pytest.raises(DSparkError, match="tensorrt 1.7.1.116 is not supported \\(supported: 10.x, 11.x\\)"):
        TrtApi.parse("1.7.1.116", "tensorrt")
    assert TrtApi.parse("10.16.0", "tensorrt").timing_cache and not TrtApi.parse("11.0", "tensorrt").aot_targets
    with pytest.raises(DSparkError, match="unknown TensorRT flavor"):
        resolve_flavor("cuda")


def test_compute_capability_targets():
    assert compute_targets(["75", "8.0", "sm86", "SM_89", "120", "121", "89"]) == [
        "SM75", "SM80", "SM86", "SM89", "SM120", "SM121"]
    with pytest.raises(DSparkError, match="Hopper"):
        compute_targets(["9.0"])
    with pytest.raises(DSparkError, match="unknown compute capability"):
        compute_targets(["70"])
    assert "not Hopper" in FLAVORS["rtx"].runs_on


@pytest.mark.parametrize("section, gpu, ok, words", [
    ({"flavor": "rtx", "targets": ["SM86", "SM89"]}, "8.9", True, "one of the targets"),
    ({"flavor": "rtx", "targets": ["SM86", "SM89"]}, "9.0", False, "Hopper"),
    ({"flavor": "rtx", "targets": ["SM86"]}, "12.0", False, "not among"),
    ({"flavor": "rtx", "targets": ["SM86"]}, None, False, "no CUDA GPU"),
    ({"flavor": "tensorrt", "device": {"compute_capability": "9.0"}}, "9.0", True, "this compute capability"),
    ({"flavor": "tensorrt", "device": {"compute_capability": "9.0"}}, "8.0", False, "rebuild here"),
    ({"tensorrt": "10.16", "device": {"unknown": "ImportError"}}, "8.0", True, "loading the engines will tell"),
])
def test_which_gpus_recorded_engines_run_on(section, gpu, ok, words):
    verdict = engines_runnable(section, gpu)
    assert verdict.ok is ok and words in verdict.reason


def test_private_folder_links_the_unversioned_name_to_the_wheels_library(tmp_path):
    wheel = tmp_path / "wheel"
    wheel.mkdir()
    for name in (rtx_libs.CORE, rtx_libs.PARSER):
        (wheel / name).write_bytes(b"\x7fELF")
    folder = rtx_libs.link_folder(wheel, tmp_path / "cache")
    assert sorted(p.name for p in folder.iterdir()) == sorted([rtx_libs.CORE, rtx_libs.PARSER, rtx_libs.UNVERSIONED])
    assert os.readlink(folder / rtx_libs.UNVERSIONED) == str(wheel / rtx_libs.CORE)
    assert (folder / rtx_libs.PARSER).resolve() == (wheel / rtx_libs.PARSER).resolve()
    (folder / rtx_libs.UNVERSIONED).unlink()
    (folder / rtx_libs.UNVERSIONED).symlink_to(wheel / rtx_libs.PARSER)  # a stale link is put right
    assert rtx_libs.link_folder(wheel, tmp_path / "cache") == folder
    assert os.readlink(folder / rtx_libs.UNVERSIONED) == str(wheel / rtx_libs.CORE)
