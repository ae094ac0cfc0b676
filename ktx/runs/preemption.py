"""Preemption: SIGTERM / SIGINT stop `ktx train` at a step boundary with a checkpoint.

What Cloud TPU maintenance, SLURM (`--signal`, `scancel`, preemption) and Kubernetes send
before they kill a job is SIGTERM; an interactive user sends SIGINT. Inside `train()` a
`PreemptionGuard` turns either into a request to stop:

* The signal is noted at once by a watchdog thread (Python's wakeup fd), even while the
  main thread is inside a compile or a device call, and published in `jax.distributed`'s
  key-value store so every process of the run learns it within a second.
* At every step boundary `should_stop(step)` agrees the local flags across processes (one
  `multihost_utils.process_allgather` of an int32; on one process no collective), and also
  asks `multihost_utils.reached_preemption_sync_point` where JAX runs its preemption
  service (Cloud TPU's notices). Every process gets the same answer at the same step.
* The loop then writes a checkpoint of that step synchronously (waiting for an async
  save too) and raises `Preempted`; `ktx train` exits with `EXIT_PREEMPTED` (75,
  sysexits' EX_TEMPFAIL: "try again"), which the launch scripts treat as "resume".
* A step boundary that does not come within `timeout_seconds` of the signal (a long
  evaluation, the first compile) is not waited for: the watchdog exits the process with
  the same status, without a new checkpoint (the run resumes from its latest one).
  Process 0, the coordinator, waits 3 s more, so the other processes exit by their own
  watchdog rather than on losing the coordinator.
* Signals after the first are reported and otherwise ignored: a second SIGTERM during
  the preemption save lets the save finish, then the process exits.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["EXIT_PREEMPTED", "Preempted", "PreemptionGuard"]

EXIT_PREEMPTED = 75
_KEY = "ktx/preempted"
_COORDINATOR_EXTRA_SECONDS = 3.0


class Preempted(Exception):
    """Training stopped on a preemption signal after saving the checkpoint of `step`."""

    def __init__(self, step: int, reason: str, checkpoint_dir: Any):
        self.step, self.reason, self.checkpoint_dir = step, reason, checkpoint_dir
        super().__init__(
            f"stopped by {reason} at step {step}; checkpoint step {step} is saved in "
            f"{checkpoint_dir}; exit status {EXIT_PREEMPTED}: run the same command again to "
            "resume")


def _kv_client() -> Any:
    """`jax.distributed`'s client (its key-value store), or None on one process."""
    import jax

    if jax.process_count() == 1:
        return None
    try:
        from jax._src import distributed
    except ImportError:
        return None
    return distributed.global_state.client


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class PreemptionGuard:
    """Context manager turning `signals` into a stop request agreed at step boundaries.

    Args:
      timeout_seconds: how long after the signal a step boundary may take to come (a
        long evaluation, the first compile) before the watchdog exits the process with
        `EXIT_PREEMPTED` without a new checkpoint; None: wait for it however long.
      check_period: agree the flag across processes at every `check_period`-th step
        boundary (the others answer False without a collective); 1 on one process costs
        nothing.
      signals: the signals handled (SIGTERM and SIGINT).
      stream: where the one-line notices go (stderr).

    The handlers are installed only in the main thread (signals reach no other); from
    another thread the guard still agrees the flags, which then stay False.
    """

    def __init__(self, *, timeout_seconds: float | None = 60.0, check_period: int = 1,
                 signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT), stream: Any = None):
        if timeout_seconds is not None and (isinstance(timeout_seconds, bool) or not isinstance(
                timeout_seconds, (int, float)) or not timeout_seconds > 0):
            raise ValueError(f"preemption_timeout={timeout_seconds!r}; accepted: seconds > 0 "
                             "or None (wait for the next step boundary however long)")
        if isinstance(check_period, bool) or not isinstance(check_period, int) or check_period < 1:
            raise ValueError(f"preemption_check_period={check_period!r}; accepted: an integer >= 1")
        self.timeout_seconds, self.check_period = timeout_seconds, check_period
        self.signals = tuple(signals)
        self.stream = stream
        self.phase = "the start of training"
        self.last_checkpoint: int | None = None
        self.reason: str | None = None
        self._requested = threading.Event()
        self._at_boundary = threading.Event()  # the loop reached a boundary: no forced exit
        self._saving = False
        self._requested_at = 0.0
        self._closed = threading.Event()
        self._boundaries = 0
        self._old_handlers: dict[int, Any] = {}
        self._old_wakeup = -1
        self._pipe: tuple[int, int] | None = None
        self._thread: threading.Thread | None = None
        self._client = None
        self._sync_manager_ok = True
        self._process_index, self._process_count = 0, 1

    # -- installation -------------------------------------------------------------------
    def __enter__(self) -> PreemptionGuard:
        import jax  # here, not at import: `ktx --help` and the CLI's start stay JAX-free

        self._process_index, self._process_count = jax.process_index(), jax.process_count()
        self._client = _kv_client()
        if threading.current_thread() is threading.main_thread():
            r, w = os.pipe()
            os.set_blocking(r, False)
            os.set_blocking(w, False)
            self._pipe = (r, w)
            for s in self.signals:
                self._old_handlers[s] = signal.signal(s, lambda *_: None)  # noted via the fd
            self._old_wakeup = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._watch, name="ktx-preemption", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._pipe is not None:
            signal.set_wakeup_fd(self._old_wakeup)
            for s, old in self._old_handlers.items():
                signal.signal(s, old if old is not None else signal.SIG_DFL)
            for fd in self._pipe:
                os.close(fd)
            self._pipe = None

    # -- the watchdog thread ------------------------------------------------------------
    def _say(self, text: str) -> None:
        print(f"ktx train: {text}", file=self.stream or sys.stderr, flush=True)

    def _note(self, reason: str, remote: bool = False) -> None:
        if not self._requested.is_set():
            self.reason = reason
            self._requested_at = time.monotonic()
            self._requested.set()
            if not remote:
                self._say(f"{reason} received during {self.phase}: stopping at the next step "
                          "boundary with a checkpoint")
                if self._client is not None:
                    try:
                        self._client.key_value_set(_KEY, str(self._process_index))
                    except Exception:  # noqa: BLE001 - already set by another process
                        pass
        elif not remote:
            what = ("finishing the preemption save, then exiting" if self._saving
                    else "already stopping at the next step boundary")
            self._say(f"another {reason} received: {what}")

    def _watch(self) -> None:
        next_poll = 0.0
        while not self._closed.is_set():
            if self._pipe is not None:
                ready, _, _ = select.select([self._pipe[0]], [], [], 0.2)
                if ready:
                    try:
                        data = os.read(self._pipe[0], 64)
                    except (BlockingIOError, OSError):
                        data = b""
                    for signum in data:
                        if signum in self.signals:
                            self._note(_signal_name(signum))
            else:
                self._closed.wait(0.2)
            now = time.monotonic()
            if self._client is not None and not self._requested.is_set() and now >= next_poll:
                next_poll = now + 1.0
                try:
                    who = self._client.key_value_try_get(_KEY)
                except Exception:  # noqa: BLE001 - not set yet (NotFound)
                    who = None
                if who is not None:
                    self._note(f"a preemption signal to process {who}", remote=True)
            if self._requested.is_set() and not self._at_boundary.is_set() \
                    and self.timeout_seconds is not None:
                limit = self.timeout_seconds + (
                    _COORDINATOR_EXTRA_SECONDS if self._process_count > 1
                    and self._process_index == 0 else 0.0)
                if now - self._requested_at > limit:
                    since = ("its start" if self.last_checkpoint is None
                             else f"checkpoint step {self.last_checkpoint}")
                    self._say(
                        f"{self.reason}: no step boundary within {self.timeout_seconds:g} s "
                        f"(train_script.train.preemption_timeout) during {self.phase}; exiting "
                        f"with status {EXIT_PREEMPTED} without a new checkpoint: the run "
                        f"resumes from {since}")
                    sys.stdout.flush()
                    os._exit(EXIT_PREEMPTED)

    # -- the loop's side ----------------------------------------------------------------
    @property
    def requested(self) -> bool:
        """This process's flag (a signal here, or one published by another process)."""
        return self._requested.is_set()

    def should_stop(self, step: int) -> bool:
        """At a step boundary (the same calls on every process): True on every process
        when any process was signalled, or JAX's preemption service says this is the
        sync point. Then the caller saves `step` and raises `Preempted`."""
        self._boundaries += 1
        if self._requested.is_set():
            self._at_boundary.set()  # single process: no forced exit from here on
        if self._process_count == 1:
            return self._requested.is_set()
        import numpy as np
        from jax.experimental import multihost_utils

        stop = False
        reason = None
        if self._sync_manager_ok:
            try:
                if multihost_utils.reached_preemption_sync_point(self._boundaries):
                    stop, reason = True, "JAX's preemption sync point"
            except RuntimeError:  # JAX's preemption service is off
                self._sync_manager_ok = False
        if self._boundaries % self.check_period == 0:
            flags = np.asarray(multihost_utils.process_allgather(
                np.int32(self._requested.is_set()))).reshape(-1)
            if flags.any() and not stop:
                signalled = ", ".join(str(i) for i in np.flatnonzero(flags))
                stop, reason = True, f"a preemption signal to process {signalled}"
        if stop:
            self._at_boundary.set()
            if not self._requested.is_set():
                self._note(reason, remote=True)
        else:
            self._at_boundary.clear()
        return stop

    def saving(self) -> None:
        """The preemption save begins: later signals only say it will finish."""
        self._saving = True
        self._at_boundary.set()
