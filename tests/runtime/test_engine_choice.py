"""The engine's defaults: batch slots and policy chosen from the bundle, the backend and the memory available;
what a user names is kept (tests/serve/test_serve_choice.py: what the server says and passes on)."""
import pytest

from dspark.errors import DSparkError
from dspark.runtime import Runtime
from dspark.runtime.engine import Engine, EngineOptions
from dspark.runtime.engine_choice import CPU_SLOTS, choose_batch, choose_policy, slot_bytes
from dspark.runtime.scheduler import VerifyPolicy

GIB = 1 << 30


def test_slot_bytes_are_what_a_slot_allocates(runtime):
    """(at most: host caches are as wide as the longest request needs, here the whole capacity)"""
    engine = Engine(runtime, EngineOptions(batch_size=1, policy="all"))
    for kv in (engine.slots.kv, engine.slots.draft_kv):
        kv.commit(0, engine.capacity)
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



def test_a_decode_whose_caches_cannot_fit_is_refused_before_allocating(tiny_bundle_v6, monkeypatch):
    """dspark run/bench: a batch of huge slots was a MemoryError reported as an internal error."""
    import dspark.runtime.decoder as decoder
    from dspark.errors import DSparkError
    from dspark.runtime import DecodeOptions, Runtime

    with Runtime(tiny_bundle_v6[3], threads=1) as rt:
        prompts = [[1, 2, 3]] * 4
        monkeypatch.setattr(decoder, "available_memory", lambda: 1024)
        with pytest.raises(DSparkError, match=r"4 batch slots need .* GiB is available: give fewer prompts"):
            rt.generate(prompts, DecodeOptions(max_tokens=8))
        monkeypatch.setattr(decoder, "available_memory", lambda: None)  # unknown: decodes as before
        assert len(rt.generate(prompts, DecodeOptions(max_tokens=8))) == 4
