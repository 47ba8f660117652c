"""The acceptance-collapse alarm: does the drafter's acceptance on a bundle look like a trained drafter's?

A drafter read with the wrong convention (taps from the wrong layers, an anchor off by one, a vocabulary map
ignored, a head left untrained) still decodes losslessly, only with almost every draft rejected. Nothing else
notices, so `dspark-export check` decodes the prompt set shipped in the package with every draft verified and
judges the acceptance it measures:

- against what the drafter claims, when its config carries `expected_acceptance` (`dspark train` records the
  teacher-forced acceptance per position on its held-out sequences: measured in PyTorch on the training
  conventions, so it does not share a conversion's mistakes): a position-1 acceptance below half the claim is a
  collapse;
- without a claim, against a floor: a position-1 acceptance below 0.15 (acceptance length ~1.1, what collapsed
  drafters show in bug reports) is not what any trained drafter reaches on the prompts it was trained for;
- a confidence head whose predicted survival cannot tell accepted from rejected drafts (AUC below 0.6 at
  position 1) is untrained or misread, whatever the acceptance.

An untrained drafter (`--draft random`) is said to be one, not judged. The measurement is written to
check/acceptance.json; `dspark doctor` measures again, `dspark serve` compares its live acceptance with it.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from dspark.bundle import Manifest, check_expected_acceptance
from dspark.errors import DSparkError
from dspark.files import read_json
from dspark.prompts import DEMO_PROMPTS, read_prompts
from dspark.runtime import DecodeOptions, Runtime
from dspark.runtime.decoder import context_limit
from dspark.runtime.room import max_new_tokens
from dspark.runtime.observers import CONFIDENCE, RoundObserver, RoundRecord
from dspark.schema import Fields

FILE = "check/acceptance.json"
TOKENS = 64  # new tokens per prompt
CLAIM_RATIO = 0.5  # a position-1 acceptance below this fraction of the drafter's claim is a collapse
FLOOR = 0.15  # ... and without a claim, below this
MIN_AUC = 0.6  # a confidence head this close to chance (0.5) at position 1 tells nothing
MIN_ROUNDS = 50  # position-1 proposals needed for a verdict
MIN_NEW = 16  # a prompt with room for fewer new tokens in the bundle's context is left out
MIN_CLASS = 20  # accepted and rejected position-1 drafts each needed to judge the confidence head
CAUSES = ("taps from the wrong layers (target_layer_ids off by one), an anchor or position off by one, a draft "
          "vocabulary map ignored, a head left untrained, or a drafter trained for another target")


@dataclass(frozen=True)
class Claim:
    """What a drafter's config says its acceptance is (`expected_acceptance`)."""

    accept_at: tuple[float, ...]  # acceptance per block position, conditional on the positions before
    measured: str = ""  # how, e.g. "teacher-forced on 46 held-out sequences (dspark train)"

    @classmethod
    def parse(cls, raw, where: str, block: int) -> "Claim":
        f = Fields(raw, where)
        check_expected_acceptance(f, block)
        return cls(tuple(f.number_list("accept_at")), f.string("measured", default=""))


@dataclass
class Measured:
    """What one decode of the check prompts showed (greedy, every draft verified)."""

    prompts: int
    max_tokens: int  # new tokens per prompt at most
    tokens: int  # committed by drafted rounds
    rounds: int  # drafted rounds, over all requests
    tau: float  # tokens committed per drafted round, the bonus token included
    accept_at: list[float]  # conditional acceptance per position (nan where no round reached it)
    predicted_at: list[float] | None = None  # mean calibrated survival per position (confidence head)
    auc_at_1: float | None = None  # how well the position-1 confidence separates accepted from rejected


@dataclass
class Verdict:
    status: str  # "ok", "collapse", "untrained" (a random drafter), "inconclusive"
    line: str  # one sentence for a person
    measured: Measured
    claim: Claim | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return self.status == "collapse"

    def to_dict(self) -> dict:
        measured = {k: _finite(v) for k, v in asdict(self.measured).items()}
        out = {"status": self.status, "line": self.line, "measured": measured, "notes": self.notes}
        if self.claim is not None:
            out["claim"] = {"accept_at": list(self.claim.accept_at), "measured": self.claim.measured}
        return out


def _finite(value):
    """NaN (a position no round reached) as null: JSON has no NaN."""
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return None if isinstance(value, float) and value != value else value


class DraftRounds(RoundObserver):
    """Drafts verified and accepted (and confidence logits) per drafting request per round."""

    wants = frozenset({CONFIDENCE})

    def __init__(self):
        self.verified: list[int] = []
        self.accepted: list[int] = []
        self.conf_logits: list[np.ndarray] = []

    def round(self, record: RoundRecord) -> None:
        for r in record.drafting():
            self.verified.append(int(record.verify_len[r]))
            self.accepted.append(int(record.accepted[r]))
            if record.conf_logits is not None:
                self.conf_logits.append(record.conf_logits[r].astype(np.float64))


def claim_of(manifest: Manifest) -> Claim | None:
    raw = manifest.draft.get("expected_acceptance")
    return None if raw is None else Claim.parse(raw, "manifest draft.expected_acceptance", manifest.block_size)


def is_random(manifest: Manifest) -> bool:
    name = (manifest.sources.get("draft") or {}).get("name")
    return isinstance(name, str) and name.startswith("random")


def measure(rt: Runtime, prompts: list[str] | None = None, max_tokens: int = TOKENS) -> Measured:
    """Greedy decode of `prompts` (default: the package's demo set) with every draft verified."""
    texts = prompts if prompts is not None else [r["prompt"] for r in read_prompts(DEMO_PROMPTS)]
    ids, max_tokens = _fitting([rt.encode(t) for t in texts], context_limit(rt.backend, rt.manifest), max_tokens)
    log = DraftRounds()
    if ids:  # a bundle whose context is too small for any of them gets no rounds: an inconclusive verdict
        for _ in rt.decoder(ids, DecodeOptions(max_tokens=max_tokens, policy="all"), observers=[log]):
            pass
    verified, accepted = np.array(log.verified, dtype=np.int64), np.array(log.accepted, dtype=np.int64)
    block = rt.manifest.block_size
    accept_at = conditional_acceptance(verified, accepted, block)
    out = Measured(prompts=len(ids), max_tokens=max_tokens, tokens=int(accepted.sum() + len(accepted)),
                   rounds=len(verified), tau=float(np.mean(accepted + 1)) if len(verified) else 0.0, accept_at=accept_at)
    if rt.manifest.draft.get("confidence_head") and log.conf_logits and len(log.conf_logits) == len(verified):
        temps = np.asarray(rt.manifest.calibration.get("sts_temperatures") or [1.0] * block, dtype=np.float64)
        z = np.stack(log.conf_logits)
        survival = np.cumprod(1.0 / (1.0 + np.exp(-z / temps[None])), axis=1)
        out.predicted_at = [float(survival[verified >= k, k - 1].mean()) if (verified >= k).any() else float("nan")
                            for k in range(1, block + 1)]
        out.auc_at_1 = _auc(survival[:, 0], accepted >= 1)
    return out


def _fitting(prompts: list[list[int]], context: int, max_tokens: int) -> tuple[list[list[int]], int]:
    """The prompts that leave room for at least MIN_NEW tokens in the bundle's context, and the new tokens all of
    them have room for (at most `max_tokens`): a small-context bundle is measured on what fits."""
    room = [max_new_tokens(context, len(p)) for p in prompts]
    kept = [(p, r) for p, r in zip(prompts, room) if r >= MIN_NEW]
    return [p for p, _ in kept], min([max_tokens] + [r for _, r in kept])


def conditional_acceptance(verified: np.ndarray, accepted: np.ndarray, block: int) -> list[float]:
    """Per block position k: of the rounds that verified k drafts and accepted the k-1 before, the share that
    accepted the k-th (nan where no round got there)."""
    out = []
    for k in range(1, block + 1):
        reached = (verified >= k) & (accepted >= k - 1)
        out.append(float((accepted[reached] >= k).mean()) if reached.any() else float("nan"))
    return out


def _auc(score: np.ndarray, label: np.ndarray) -> float | None:
    """Probability that an accepted draft scores above a rejected one (ties count half)."""
    pos, neg = score[label], score[~label]
    if len(pos) < MIN_CLASS or len(neg) < MIN_CLASS:
        return None
    order = np.argsort(np.concatenate([pos, neg]), kind="mergesort")
    ranks = np.empty(len(order))
    values = np.concatenate([pos, neg])[order]
    i = 0
    while i < len(values):  # average ranks over ties
        j = i
        while j + 1 < len(values) and values[j + 1] == values[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return float((ranks[:len(pos)].sum() - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg)))


def judge(m: Measured, manifest: Manifest) -> Verdict:
    claim = claim_of(manifest)
    p1 = m.accept_at[0] if m.accept_at else float("nan")
    summary = (f"acceptance length {m.tau:.2f}, position 1 {p1:.2f} over {m.rounds} drafted rounds "
               f"({m.prompts} prompts x {m.max_tokens} tokens, greedy, every draft verified)")
    if is_random(manifest):
        return Verdict("untrained", f"{summary}: the drafter is random (--draft random), untrained, so it accepts "
                       f"almost nothing; not judged", m, claim)
    if m.rounds < MIN_ROUNDS or np.isnan(p1):
        return Verdict("inconclusive", f"{summary}: too few drafted rounds to judge", m, claim)
    notes = []
    if claim is not None:
        bound, basis = CLAIM_RATIO * claim.accept_at[0], (f"under half the {claim.accept_at[0]:.2f} its drafter "
                                                           f"claims ({claim.measured or 'expected_acceptance'})")
    else:
        bound, basis = FLOOR, f"below {FLOOR}, which no trained drafter shows on prompts like these"
        notes.append("the drafter's config claims no acceptance (expected_acceptance): judged against a floor")
    if m.predicted_at is not None and m.auc_at_1 is not None and m.auc_at_1 < MIN_AUC:
        return Verdict("collapse", f"{summary}; the confidence head cannot tell accepted from rejected drafts "
                       f"(AUC {m.auc_at_1:.2f} at position 1): an untrained or misread confidence head", m, claim, notes)
    if p1 < bound:
        return Verdict("collapse", f"{summary}: position-1 acceptance is {basis}; likely causes: {CAUSES}",
                       m, claim, notes)
    return Verdict("ok", f"{summary}: plausible" + (f" (the drafter claims {claim.accept_at[0]:.2f})"
                                                    if claim else ""), m, claim, notes)


def check_acceptance(bundle: Path, rt: Runtime | None = None) -> Verdict:
    """Measure and judge (opens the bundle when no runtime is given)."""
    own = rt is None
    rt = rt or Runtime(bundle)
    try:
        return judge(measure(rt), rt.manifest)
    finally:
        if own:
            rt.close()


def write(bundle: Path, verdict: Verdict) -> Path:
    path = Path(bundle) / FILE
    path.parent.mkdir(exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(verdict.to_dict(), indent=2) + "\n")
    tmp.replace(path)
    return path


def recorded_position1(bundle: Path) -> float | None:
    """Position-1 acceptance `dspark-export check` measured on this bundle, if it has (None otherwise, or when
    the file is not what check writes)."""
    path = Path(bundle) / FILE
    if not path.is_file():
        return None
    try:
        value = read_json(path, kind=dict)["measured"]["accept_at"][0]
    except (DSparkError, KeyError, IndexError, TypeError):
        return None
    return float(value) if isinstance(value, (int, float)) and 0.0 <= value <= 1.0 else None
