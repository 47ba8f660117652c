"""The SPS profile's timing: shapes are timed in turn, so a machine that drifts does not skew their ratios."""
from types import SimpleNamespace

import numpy as np
import pytest

import dspark.calibration.sps as sps


def test_step_timing_interleaves_positions_so_drift_cancels(monkeypatch):
    now, calls = [0.0], []

    def run(feeds):  # an 8-position step truly costs 1.5x a 1-position step; the machine slows 5% per call
        n = feeds["tokens"].shape[1]
        calls.append(n)
        now[0] += (1.5 if n == 8 else 1.0) * (1 + 0.05 * len(calls))

    monkeypatch.setattr(sps, "clock", lambda: now[0])
    rt = SimpleNamespace(manifest=SimpleNamespace(block_size=7, target={"vocab_size": 5}),
                         backend=SimpleNamespace(zeros=np.zeros, verifier=SimpleNamespace(run=run)))
    cache = SimpleNamespace(lengths=np.zeros(2), past_mask=lambda: np.ones((2, 4), np.int64), feeds={},
                            fit=lambda positions: None)
    seconds = sps.verifier_step_seconds(rt, cache, [1, 8], reps=9, warmup=2)
    assert calls == [1, 8] * 11
    assert seconds[8] / seconds[1] == pytest.approx(1.5, rel=0.04)
