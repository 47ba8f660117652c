"""bench/serve_load.py's report in `vllm bench serve`'s terms, on hand-made request records."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from serve_load import parse_goodput, vllm_fields  # noqa: E402


def record(start, ttft, gaps, prompt_tokens=5):
    stamps = [start + ttft]
    for gap in gaps:
        stamps.append(stamps[-1] + gap)
    return {"ok": True, "start": start, "end": stamps[-1], "ttft": ttft, "e2e": stamps[-1] - start,
            "tokens": len(gaps) + 1, "prompt_tokens": prompt_tokens, "gaps": list(gaps)}


def test_ttft_tpot_itl_e2el_throughput_and_goodput():
    fast = record(0.0, 0.1, [0.02, 0.02, 0.02])  # 4 tokens, TPOT 20 ms, E2EL 160 ms
    slow = record(0.5, 0.4, [0.1, 0.1])  # 3 tokens, TPOT 100 ms, ends at 1.1 s
    out = vllm_fields([fast, slow], failed=1, wall=1.1, goodput={"ttft": 200.0, "tpot": 50.0})
    assert out["completed"] == 2 and out["failed"] == 1 and out["total_output_tokens"] == 7
    assert out["total_input_tokens"] == 10
    assert out["request_throughput"] == pytest.approx(2 / 1.1, abs=1e-4)
    assert out["output_throughput"] == pytest.approx(7 / 1.1, abs=1e-3)
    assert out["total_token_throughput"] == pytest.approx(17 / 1.1, abs=1e-3)
    assert out["mean_ttft_ms"] == pytest.approx(250.0) and out["median_ttft_ms"] == pytest.approx(250.0)
    assert out["mean_tpot_ms"] == pytest.approx(60.0)
    assert out["median_itl_ms"] == pytest.approx(20.0) and out["p99_itl_ms"] == pytest.approx(100.0, abs=0.1)
    assert out["mean_e2el_ms"] == pytest.approx((160 + 600) / 2)
    assert out["request_goodput"] == pytest.approx(1 / 1.1, abs=1e-4)  # only the fast one meets both SLOs
    assert "request_goodput" not in vllm_fields([fast], failed=0, wall=1.0, goodput={})


def test_goodput_flags_parse_as_vllm_takes_them():
    assert parse_goodput(["ttft:500", "tpot:100", "e2el:2000.5"]) == {"ttft": 500.0, "tpot": 100.0, "e2el": 2000.5}
    for bad in ("ttft", "itl:5", "tpot:fast"):
        with pytest.raises(SystemExit, match="--goodput"):
            parse_goodput([bad])
