"""The engine's defaults: batch slots and policy chosen from the bundle, the backend and the memory available,
and said at startup; what a user names is kept."""
import shutil

import pytest

from dspark.bundle import Manifest
from dspark.errors import DSparkError
from dspark.runtime import Runtime
from dspark.runtime.engine import Engine, EngineOptions
from dspark.runtime.engine_choice import CPU_SLOTS, choose_batch, choose_policy, slot_bytes
from dspark.runtime.scheduler import VerifyPolicy
from dspark.serve.triton import TritonModel

from serve_support import start_server

GIB = 1 << 30


@pytest.fixture(scope="module")
def calibrated(tiny_bundle_v6, tmp_path_factory):
    """A copy of the tiny bundle whose manifest holds an SPS table."""
    folder = tmp_path_factory.mktemp("calibrated") / "bundle"
    shutil.copytree(tiny_bundle_v6[3], folder)
    manifest = Manifest.read(folder)
    manifest.calibration["sps_table"] = [100.0 - i for i in range(8)]
    manifest.write(folder)
    return folder


def test_slot_bytes_are_what_a_slot_allocates(runtime):
    engine = Engine(runtime, EngineOptions(batch_size=1, policy="all"))
    allocated = engine.slots.kv.buffer.nbytes + engine.slots.draft_kv.buffer.nbytes
    assert slot_bytes(runtime.manifest, engine.capacity) == allocated


def test_a_bundle_without_sps_table_decodes_autoregressively_by_default(runtime):
    engine = Engine(runtime)
    assert engine.policy.is_ar and engine.choice.policy.is_ar
    assert "calibrate --sps" in engine.choice.why_policy
    assert engine.batch == CPU_SLOTS  # a tiny bundle's caches fit anywhere
    assert engine.choice.summary().startswith(f"{CPU_SLOTS} batch slots (the CPU default")


def test_a_calibrated_bundle_drafts_with_schedule_and_gate(calibrated):
    rt = Runtime(calibrated, threads=1)
    try:
        engine = Engine(rt, EngineOptions(batch_size=3))
        assert str(engine.policy) == "schedule+gate" and "8 batch tokens" in engine.choice.why_policy
        assert (engine.batch, engine.choice.why_batch) == (3, "asked")
        asked = Engine(rt, EngineOptions(policy="all"))
        assert str(asked.policy) == "all" and asked.choice.why_policy == "asked"
    finally:
        rt.close()


def test_slots_shrink_to_what_half_the_memory_holds():
    per_slot = GIB // 4
    assert choose_batch(None, None, per_slot, 64 * GIB)[0] == CPU_SLOTS
    slots, why = choose_batch(None, None, per_slot, 1 * GIB)  # half a GiB: 2 slots
    assert slots == 2 and "--max-context" in why
    assert choose_batch(None, None, per_slot, GIB // 8)[0] == 1  # never fewer than one
    assert choose_batch(None, 4, per_slot, 64 * GIB) == (4, "the most the engines are built for")
    assert choose_batch(6, 4, per_slot, 64 * GIB)[0] == 4
    assert choose_batch(3, None, per_slot, 1 * GIB) == (3, "asked")  # a user's number is kept where it fits
    with pytest.raises(DSparkError, match="5 batch slots need 1.2 GiB"):
        choose_batch(5, None, per_slot, 1 * GIB)  # refused before anything is allocated


def test_policy_text_auto_and_objects():
    assert choose_policy("auto", None)[0] == VerifyPolicy.parse("ar")
    assert choose_policy(None, [1.0])[0] == VerifyPolicy.parse("schedule+gate")
    assert choose_policy(VerifyPolicy.parse("fixed:2"), None)[0].gamma == 2
    with pytest.raises(DSparkError):
        choose_policy("sometimes", None)
    with pytest.raises(DSparkError, match="batch_size"):
        EngineOptions(batch_size=0)


def test_triton_parameters_leave_the_choice_to_the_model_by_default(tmp_path):
    params = TritonModel(bundle=tmp_path).parameters()
    assert (params["batch_size"], params["policy"]) == ("auto", "auto")
    named = TritonModel(bundle=tmp_path, batch_size=2, policy="schedule+gate").parameters()
    assert (named["batch_size"], named["policy"]) == ("2", "schedule+gate")
    with pytest.raises(DSparkError):
        TritonModel(bundle=tmp_path, policy="sometimes").parameters()


def test_serve_says_what_it_chose_at_startup(calibrated, tmp_path):
    server = start_server(calibrated, tmp_path / "server.log", "--model-name", "tiny")
    try:
        metrics = server.get("/metrics").text
    finally:
        assert server.stop() == 0
    log = server.log.read_text()
    assert f"dspark serve: {CPU_SLOTS} batch slots (the CPU default" in log
    assert "policy schedule+gate (the bundle's SPS table covers 8 batch tokens)" in log
    assert f"dspark_slots {CPU_SLOTS:.1f}" in metrics
