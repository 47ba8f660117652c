"""What an engine decodes with when its options leave the batch size or the policy open: `dspark serve`, the
Triton model and `Engine(runtime)` all start from here, and say what they chose and why.

Policy: schedule+gate (Algorithm 1 over the batch, skipping drafting in rounds where it cannot pay) when the
bundle holds an SPS table, the verifier's measured steps/s the scheduler needs; otherwise ar, which needs none.
Slots: CPU_SLOTS on ONNX Runtime (docs/serving.md says what 16 gained over 8), fewer where the caches
of that many slots would not fit in half the memory available; a device backend's engines fix their own most.
"""
from __future__ import annotations

from dataclasses import dataclass

from dspark.bundle import Manifest
from dspark.errors import DSparkError
from dspark.kv_layout import bytes_per_position
from dspark.runtime.scheduler import VerifyPolicy

CPU_SLOTS = 16
CACHE_SHARE = 0.5  # of the memory available when the engine starts, for the slots' caches
AUTO = "auto"


@dataclass(frozen=True)
class EngineChoice:
    batch_size: int
    policy: VerifyPolicy
    why_batch: str
    why_policy: str

    def summary(self) -> str:
        return f"{self.batch_size} batch slots ({self.why_batch}); policy {self.policy} ({self.why_policy})"


def slot_bytes(manifest: Manifest, capacity: int, itemsize: int = 4) -> int:
    """The target's and the draft's K and V caches of one slot holding `capacity` positions."""
    return sum(bytes_per_position(cfg, itemsize) for cfg in (manifest.target, manifest.draft)) * capacity


def refuse_unfit(slots: int, per_slot: int, available: int | None, fewer: str) -> None:
    """One line, before anything is allocated, where `slots` caches of `per_slot` bytes exceed the memory free."""
    if available is not None and slots * per_slot > available:
        raise DSparkError(f"{slots} batch slots need {slots * per_slot / 2**30:,.1f} GiB of caches "
                          f"({per_slot / 2**20:,.1f} MiB each) and {available / 2**30:,.1f} GiB is available: {fewer}")


def choose_batch(asked: int | None, backend_max: int | None, per_slot: int, available: int | None
                 ) -> tuple[int, str]:
    if asked is not None:
        if backend_max and asked > backend_max:
            return backend_max, f"asked {asked}; the engines are built for at most {backend_max}"
        refuse_unfit(asked, per_slot, available, "ask for fewer slots or a smaller --max-context")
        return asked, "asked"
    if backend_max:
        return backend_max, "the most the engines are built for"
    if available is None:
        return CPU_SLOTS, "the CPU default"
    fit = int(available * CACHE_SHARE) // max(per_slot, 1)
    size = f"{per_slot / 2**20:,.1f} MiB of caches per slot, {available / 2**30:,.1f} GiB available"
    if fit >= CPU_SLOTS:
        return CPU_SLOTS, f"the CPU default; {size}"
    return max(fit, 1), f"as many as fit in half the memory: {size}; --max-context makes slots smaller"


def choose_policy(asked: VerifyPolicy | str | None, sps_table: list[float] | None) -> tuple[VerifyPolicy, str]:
    if asked is not None and asked != AUTO:
        return (asked if isinstance(asked, VerifyPolicy) else VerifyPolicy.parse(asked)), "asked"
    if sps_table:
        return VerifyPolicy.parse("schedule+gate"), f"the bundle's SPS table covers {len(sps_table)} batch tokens"
    return VerifyPolicy.parse("ar"), "the bundle has no SPS table; `dspark calibrate --sps BUNDLE` stores one, " \
                                     "then the default drafts with schedule+gate"


def choose(manifest: Manifest, backend_max: int | None, capacity: int, batch_size: int | None,
           policy: VerifyPolicy | str | None, available: int | None) -> EngineChoice:
    """`batch_size`/`policy` None (or "auto"): chosen here; `available`: bytes of memory free (None: unknown)."""
    batch, why_batch = choose_batch(batch_size, backend_max, slot_bytes(manifest, capacity), available)
    chosen, why_policy = choose_policy(policy, manifest.calibration.get("sps_table"))
    return EngineChoice(batch, chosen, why_batch, why_policy)
