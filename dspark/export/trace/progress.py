"""What runs around the export's steps: progress lines on stderr, and work on a background thread."""
from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable

from tqdm import tqdm


class Progress:
    """A line on stderr when a step starts, an elapsed-time line every `every` s while it runs past `after` s, and
    its duration when it ends: written with tqdm.write, so they never land inside the tqdm bars of the libraries
    a step calls (GGUF dequantization, weight loading). quiet=True prints nothing."""

    def __init__(self, total: int, quiet: bool = False, after: float = 5.0, every: float | None = None):
        self.total, self.quiet, self.i = total, quiet, 0
        self.after = after
        self.every = every or (10.0 if sys.stderr.isatty() else 30.0)

    def say(self, line: str) -> None:
        if not self.quiet:
            tqdm.write(line, file=sys.stderr)

    def _tick(self, label: str, t0: float, done: threading.Event) -> None:
        wait = self.after
        while not done.wait(wait):
            self.say(f"{label} ... {time.perf_counter() - t0:.0f}s")
            wait = self.every

    @contextmanager
    def step(self, what: str):
        self.i += 1
        label = f"[{self.i}/{self.total}] {what}"
        self.say(label)
        t0 = time.perf_counter()
        done = threading.Event()
        ticker = threading.Thread(target=self._tick, args=(label, t0, done), daemon=True)
        if not self.quiet:
            ticker.start()
        try:
            yield
        finally:
            done.set()
        self.say(f"{label}: done in {time.perf_counter() - t0:.1f}s")


class Background:
    """fn() on a daemon thread, so an export that fails does not wait for it: hashing the checkpoints (which
    releases the GIL) while the graphs are traced."""

    def __init__(self, fn: Callable[[], object]):
        self.value: object = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self.thread.start()

    def _run(self, fn) -> None:
        try:
            self.value = fn()
        except BaseException as e:  # re-raised in the caller's thread by result()
            self.error = e

    def result(self):
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.value
