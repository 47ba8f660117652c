"""The collapse alarm's rules (dspark.acceptance) and the server's live watch, on made-up measurements."""
import json
from types import SimpleNamespace

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from dspark import acceptance
from dspark.acceptance import Measured, judge
from dspark.errors import DSparkError
from dspark.models.config import DraftConfig, with_claim
from dspark.serve.acceptance_watch import WINDOW, AcceptanceWatch
from support.tiny import tiny_pair


def manifest(claim=None, draft_name="smollm2-135m-dspark", block=7):
    draft = {} if claim is None else {"expected_acceptance": {"accept_at": claim, "measured": "teacher-forced"}}
    return SimpleNamespace(draft=draft, block_size=block, sources={"draft": {"name": draft_name}})


def measured(p1, rounds=400, auc=None):
    return Measured(prompts=12, max_tokens=64, tokens=int(rounds * (1 + p1)), rounds=rounds, tau=1 + p1,
                    accept_at=[p1] + [0.3] * 6, predicted_at=None if auc is None else [0.3] * 7, auc_at_1=auc)


@pytest.mark.parametrize("p1, claim, status", [
    (0.30, [0.37], "ok"), (0.19, [0.37], "ok"), (0.18, [0.37], "collapse"), (0.02, [0.9], "collapse"),
    (0.40, [0.9], "collapse"),  # a strong drafter's claim: 0.40 is under half of it
    (0.16, None, "ok"), (0.14, None, "collapse"),  # no claim: the floor
])
def test_position_1_against_the_claim_or_the_floor(p1, claim, status):
    verdict = judge(measured(p1), manifest(claim))
    assert verdict.status == status, verdict.line
    assert verdict.failed == (status == "collapse")
    if status == "collapse":
        assert "likely causes" in verdict.line and ("claims" in verdict.line or "below 0.15" in verdict.line)


def test_a_confidence_head_at_chance_fires_whatever_the_acceptance():
    assert judge(measured(0.35, auc=0.52), manifest([0.37])).status == "collapse"
    assert judge(measured(0.35, auc=0.75), manifest([0.37])).status == "ok"
    assert "confidence head" in judge(measured(0.35, auc=0.52), manifest([0.37])).line


def test_a_random_drafter_is_said_to_be_one_and_few_rounds_are_not_judged():
    verdict = judge(measured(0.05), manifest(None, draft_name="random:3"))
    assert verdict.status == "untrained" and not verdict.failed and "random" in verdict.line
    assert judge(measured(0.0, rounds=10), manifest([0.9])).status == "inconclusive"


def test_auc_counts_ties_half_and_needs_both_classes():
    rng = np.random.default_rng(0)
    score = rng.random(200)
    assert acceptance._auc(score, score > 0.5) == 1.0
    assert acceptance._auc(score, score < 0.5) == 0.0
    assert acceptance._auc(np.ones(100), np.arange(100) % 2 == 0) == 0.5
    assert acceptance._auc(score, score > 0.95) is None  # 10 positives: too few


def test_the_verdict_is_json_without_nan(tmp_path):
    m = measured(0.3)
    m.accept_at[-1] = float("nan")
    verdict = judge(m, manifest([0.37]))
    (tmp_path / "check").mkdir()
    acceptance.write(tmp_path, verdict)
    raw = (tmp_path / acceptance.FILE).read_text()
    assert "NaN" not in raw and json.loads(raw)["measured"]["accept_at"][-1] is None
    assert acceptance.recorded_position1(tmp_path) == 0.3
    (tmp_path / acceptance.FILE).write_text('{"measured": {"accept_at": ["x"]}}')
    assert acceptance.recorded_position1(tmp_path) is None


@pytest.mark.parametrize("claim", [[], [1.5], [0.3] * 8, "0.3", [None]])
def test_a_bad_claim_is_refused_in_one_line(claim):
    _, _, drafter = tiny_pair("qwen3", vocab=16, block_size=7)
    cfg = drafter.cfg.to_dict()
    cfg["expected_acceptance"] = {"accept_at": claim}
    with pytest.raises(DSparkError, match="expected_acceptance"):
        DraftConfig.from_dict(cfg)


def test_a_claim_round_trips_through_the_config_and_a_new_one_replaces_it():
    _, _, drafter = tiny_pair("qwen3", vocab=16, block_size=7)
    cfg = with_claim(drafter.cfg, [0.5, 0.4, float("nan"), 0.2], "teacher-forced on 3 held-out sequences")
    assert cfg.extra["expected_acceptance"]["accept_at"] == [0.5, 0.4]  # cut at the first position never reached
    again = DraftConfig.from_dict(cfg.to_dict())
    assert again.extra["expected_acceptance"] == cfg.extra["expected_acceptance"]
    assert "expected_acceptance" not in with_claim(again, (), "").to_dict()


def test_the_server_watch_exports_live_figures_and_warns_once():
    lines = []
    watch = AcceptanceWatch(CollectorRegistry(), "m", 0.4, lines.append)
    watch.observe([3, 3, 0], [3, 0, 0])
    assert watch.length_gauge.labels("m")._value.get() == pytest.approx((4 + 1 + 1) / 3)
    assert watch.position1_gauge.labels("m")._value.get() == 0.5  # the round that verified none does not count
    for _ in range(WINDOW):
        watch.observe([2], [0])
    assert len(lines) == 1 and "under half the 0.40" in lines[0]
    for _ in range(WINDOW):
        watch.observe([2], [0])
    assert len(lines) == 1


def test_the_server_watch_stays_quiet_near_the_checked_figure_or_without_one():
    lines = []
    near = AcceptanceWatch(CollectorRegistry(), "m", 0.4, lines.append)
    unknown = AcceptanceWatch(CollectorRegistry(), "m", None, lines.append)
    for i in range(2 * WINDOW):
        near.observe([2], [1 if i % 3 == 0 else 0])  # 0.33
        unknown.observe([2], [0])
    assert lines == []


def test_a_small_context_is_measured_on_what_fits():
    kept, new = acceptance._fitting([[1] * 19, [1] * 60, [1] * 30], 64, 64)
    assert [len(p) for p in kept] == [19, 30] and new == 34  # 60 leaves room for 4 (< MIN_NEW): left out
    assert acceptance._fitting([[1] * 60], 64, 64) == ([], 64)
    assert acceptance._fitting([[1] * 10], 2048, 64) == ([[1] * 10], 64)
