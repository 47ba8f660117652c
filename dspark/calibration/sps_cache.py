"""SPS tables profiled for a run (`dspark bench`, `dspark run --gate`) kept in the user's cache, so the next run on
the same bundle and machine reuses them instead of profiling again, and the bundle itself is never written.

An entry is keyed by what the verifier's speed depends on: the verifier graphs' sha256, the backend and its weights
mode, the thread count, and the CPU (model name and core count)."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from dspark.errors import DSparkError
from dspark.files import read_json, write_text_atomic
from dspark.resolve import CacheUnwritable, cache_dir

KIND = "sps"


def _cpu() -> str:
    try:
        model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), "")
    except OSError:
        model = ""
    return f"{model}|{os.cpu_count()}"


def entry_path(rt) -> Path:
    graphs = rt.manifest.graphs
    parts = [graphs[name].sha256 for name in ("verifier", "verifier_fused") if name in graphs]
    parts += [rt.backend.kind, str(getattr(rt.backend, "weights", "")), str(rt.threads), _cpu()]
    key = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]
    return cache_dir() / KIND / f"{key}.json"


def load(rt) -> dict | None:
    """The cached profile of this bundle on this machine, or None (none yet, or unreadable)."""
    try:
        path = entry_path(rt)  # a DSPARK_CACHE naming a file is said (DSparkError), not ignored
    except CacheUnwritable:
        return None
    try:
        raw = read_json(path)
    except DSparkError:  # none yet, or damaged: profiled again
        return None
    table = raw.get("sps_table") if isinstance(raw, dict) else None
    if not isinstance(table, list) or not table or not all(isinstance(x, (int, float)) and x > 0 for x in table):
        return None
    return raw


def store(rt, result: dict) -> None:
    """Keep `result` (dspark.calibration.sps.profile's) for the next run; a read-only cache only costs a profile."""
    try:
        path = entry_path(rt)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(result))
    except (OSError, CacheUnwritable):
        pass
