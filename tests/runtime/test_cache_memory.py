"""A serving engine's KV caches are resident from its start (dspark.runtime.kv.HostKV.reserve)."""
from __future__ import annotations

import mmap
import os

import numpy as np

from dspark.runtime.engine import Engine, EngineOptions
from dspark.runtime.kv import HostKV


def test_reserve_makes_the_buffers_resident_and_keeps_them_zero():
    kv = HostKV(layers=4, batch=8, kv_heads=2, capacity=2048, head_dim=64, what="target")
    size = kv._memory[0].nbytes  # every slot's capacity, whatever width the buffers have now
    assert size == 4 * 2 * 8 * 2 * 2048 * 64 * 4
    # the cache's memory fresh anonymous memory, none of it resident yet (numpy's zeros may get heap memory that a
    # long test process has already touched, as in CI)
    kv._memory = [np.frombuffer(mmap.mmap(-1, size), dtype=np.float32)]
    before = _resident()
    kv.reserve()
    grown = _resident() - before
    assert grown > 0.9 * size, (grown, size)
    assert not np.any(kv._memory[0])


def test_an_engine_reserves_every_cache_of_its_slots(runtime, monkeypatch):
    reserved = []
    monkeypatch.setattr(HostKV, "reserve", lambda self: reserved.append(self.what))
    engine = Engine(runtime, EngineOptions(batch_size=3, policy="all"))
    assert sorted(reserved) == ["draft", "target"]
    assert engine.slots.kv.buffer.shape[2] == 3


def _resident() -> int:
    """This process's resident bytes (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
