"""Polling with a bound, for tests that wait on a thread or a process."""
from __future__ import annotations

import time


def wait_until(condition, timeout: float = 60.0, every: float = 0.05) -> bool:
    """Poll `condition` until it holds or `timeout` seconds pass (a bound on waiting, not a timed assertion)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(every)
    return condition()
