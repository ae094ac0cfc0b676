"""Progress lines of long evaluations (full ranking of users, decoding of examples).

    ranking validation at step 4096: 12,288/49,152 users | 35.2 users/s | elapsed 5:49 | eta 17:26

`EvalProgress.update(done)` is called as work completes (from any thread: the ranking
reports each chunk of users from a device callback); a line is printed at most every
`every` seconds (30 by default) and only on process 0, so a short evaluation prints
nothing and a long one is never silent for long.

The rate and ETA count from the first report on: the time before it is the first
chunk's compilation and start-up, which the rest does not pay again (a full ranking of
29,310 users once read 31 users/s and an ETA of 15 minutes at 30 s, and took 1:42).
Until a second report arrives the line says `warming up` and gives no ETA.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

import jax

from ktx.training.summaries import _duration  # the progress line's own format

__all__ = ["EvalProgress", "PROGRESS_EVERY_SECONDS"]

PROGRESS_EVERY_SECONDS = 30.0


class EvalProgress:
    """Counts `unit`s done out of `total` and prints `what: done/total unit | rate | elapsed | eta`.

    Args:
      what: names the evaluation ("ranking validation at step 4096").
      total: the units to do (users, examples); 0 or None: unknown (no ETA).
      unit: what is counted ("users", "examples").
      every: seconds between lines (the first comes `every` seconds after the start).
      stream: where lines go (default: stdout at each line).
    """

    def __init__(self, what: str, total: int | None, unit: str, *,
                 every: float = PROGRESS_EVERY_SECONDS, stream: TextIO | None = None):
        if not every > 0:
            raise ValueError(f"EvalProgress(every={every!r}); accepted: seconds > 0")
        self.what, self.total, self.unit, self.every = what, total or 0, unit, float(every)
        self.stream = stream
        self.done = 0
        self.lines = 0
        self._start = self._last_line = time.perf_counter()
        self._first: tuple[float, int] | None = None  # (time, done) of the first report
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        """`n` more units done."""
        with self._lock:
            self.done += int(n)
            self._reported()

    def update(self, done: int) -> None:
        """`done` units done in all."""
        with self._lock:
            self.done = int(done)
            self._reported()

    def _reported(self) -> None:
        if self._first is None and self.done > 0:
            self._first = (time.perf_counter(), self.done)
        self._maybe_print()

    def rate(self, now: float | None = None) -> float | None:
        """Units per second since the first report (None before a second one)."""
        now = time.perf_counter() if now is None else now
        if self._first is None or self.done <= self._first[1] or now <= self._first[0]:
            return None
        return (self.done - self._first[1]) / (now - self._first[0])

    def line(self, now: float | None = None) -> str:
        now = time.perf_counter() if now is None else now
        elapsed = max(now - self._start, 1e-9)
        rate = self.rate(now)
        of = f"/{self.total:,}" if self.total else ""
        speed = "warming up" if rate is None else f"{rate:.1f} {self.unit}/s"
        eta = f" | eta {_duration((self.total - self.done) / rate)}" \
            if self.total and rate is not None else ""
        return f"{self.what}: {self.done:,}{of} {self.unit} | {speed} | elapsed {_duration(elapsed)}{eta}"

    def _maybe_print(self) -> None:
        now = time.perf_counter()
        if now - self._last_line < self.every or jax.process_index() != 0:
            return
        self._last_line = now
        self.lines += 1
        print(self.line(now), file=self.stream or sys.stdout, flush=True)
