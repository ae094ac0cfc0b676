"""A process of a multi-process run killed with SIGKILL: the survivor exits non-zero within
the heartbeat timeout (`--heartbeat_timeout`), never hangs; relaunched, the run resumes
from its last checkpoint and ends with the losses of a run that was never interrupted,
one metrics record per step.

The runs shard their input (the default, `MultiTaskInput(shard_by_process=None)` with two
processes): each process reads only its shard of every task, its share of every task of
synthetic_quickstart's mixed task-partitioned batches (process-grouped), at a position of
its own, which the resumed run recomputes from the checkpoint's step."""

from __future__ import annotations

import collections
import pathlib
import signal
import subprocess
import time

import pytest
from tests.multiprocess_runs import (
    REFERENCE_STEPS, flags, launch, sharded_reference, train_losses, wait_all,
)

from ktx.training.summaries import read_metrics

pytestmark = pytest.mark.slow  # processes started, killed and relaunched

STEPS, CHECKPOINT_PERIOD, HEARTBEAT = REFERENCE_STEPS, 20, 10


def _launch(model_gin: pathlib.Path, model_dir: pathlib.Path, logs: pathlib.Path) -> list:
    return launch(flags(model_gin, model_dir, STEPS,
                        f"--gin.train_script.train.checkpoint_period={CHECKPOINT_PERIOD}"),
                  logs, heartbeat=HEARTBEAT)


def _steps_logged(model_dir: pathlib.Path) -> int:
    """Train steps in metrics.jsonl so far; read while the run writes it, so a last line
    not yet whole is not counted (read_metrics would reject it)."""
    path = model_dir / "metrics.jsonl"
    lines = path.read_text().split("\n")[:-1] if path.is_file() else []
    return sum('"split": "train", "task": "all"' in line for line in lines)


def test_sigkill_exits_within_heartbeat_and_resumes_exactly(tmp_path):
    # One run killed twice: a worker past the first checkpoint, then, in the resumed run,
    # the coordinator past the second; each time the survivor exits within the heartbeat
    # timeout, and the run resumed twice ends with the uninterrupted run's losses. (One
    # run, not one per victim: each launch of two processes costs ~20 s to start.)
    model_gin, reference = sharded_reference()
    run = tmp_path / "run"
    for relaunch, victim in enumerate((1, 0)):
        _kill(model_gin, run, tmp_path / f"logs_killed_{victim}", victim,
              after=(relaunch + 1) * CHECKPOINT_PERIOD + 5)
        if relaunch:
            log = (tmp_path / f"logs_killed_{victim}" / "process_0.log").read_text()
            assert "Resuming from checkpoint step" in log, log[-3000:]

    logs = tmp_path / "logs_resumed"
    wait_all(_launch(model_gin, run, logs), logs)
    assert "Resuming from checkpoint step" in (logs / "process_0.log").read_text()
    rows = read_metrics(run)
    counts = collections.Counter((r["step"], r["split"], r["task"]) for r in rows)
    assert max(counts.values()) == 1, [k for k, n in counts.items() if n > 1][:5]
    losses = train_losses(run)
    assert len(losses) == STEPS
    assert losses == pytest.approx(reference, rel=1e-5, abs=1e-6)


def _kill(model_gin, run, logs, victim, after):
    """Launches the run, SIGKILLs process `victim` once `after` steps are logged; the
    survivor must exit non-zero within the heartbeat timeout."""
    procs = _launch(model_gin, run, logs)
    deadline = time.time() + 600
    while time.time() < deadline:  # past the checkpoint, before the end
        if _steps_logged(run) > after:
            break
        assert all(p.poll() is None for p in procs), "a process ended before the kill"
        time.sleep(0.05)
    assert len(train_losses(run)) < STEPS, "the run ended before it could be killed"
    procs[victim].send_signal(signal.SIGKILL)
    killed_at = time.time()
    survivor = procs[1 - victim]
    try:
        rc = survivor.wait(timeout=HEARTBEAT + 60)
    except subprocess.TimeoutExpired:
        survivor.kill()
        pytest.fail(f"the survivor still runs {HEARTBEAT + 60} s after the kill")
    exit_seconds = time.time() - killed_at
    print(f"survivor of a SIGKILL of process {victim}: exit status {rc} after {exit_seconds:.1f} s "
          f"(--heartbeat_timeout={HEARTBEAT})")
    assert rc != 0 and exit_seconds < HEARTBEAT + 30
    assert len(train_losses(run)) < STEPS
