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
import socket
import subprocess
import sys
import time

import pytest
from tests import row_cache
from tests.xla_env import with_devices

from ktx.training.summaries import read_metrics
from tests.tiny_t5_gin import tiny_t5_gin

pytestmark = pytest.mark.slow  # processes started, killed and relaunched

REPO = pathlib.Path(__file__).resolve().parent.parent
KTX = str(pathlib.Path(sys.executable).parent / "ktx")
STEPS, CHECKPOINT_PERIOD, HEARTBEAT = 80, 20, 10


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _launch(model_gin: pathlib.Path, model_dir: pathlib.Path, logs: pathlib.Path) -> list:
    flags = [
        "--gin_file=runs/train.gin", f"--gin_file={model_gin}", "--gin.NUM_TASKS=4",
        f"--gin.MODEL_DIR='{model_dir}'", "--gin.MIXTURE_OR_TASK_NAME='synthetic_quickstart'",
        "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}",
        f"--gin.TRAIN_STEPS={STEPS}", "--gin.BATCH_SIZE=16", "--gin.NUM_PARTITIONS=2",
        "--gin.train_script.train.log_period=1",
        f"--gin.train_script.train.checkpoint_period={CHECKPOINT_PERIOD}",
        row_cache.flag(),
    ]
    port = _free_port()
    env = with_devices(4)
    logs.mkdir(parents=True, exist_ok=True)
    return [subprocess.Popen(
        [KTX, "train", *flags, "--multihost", f"--coordinator_address=localhost:{port}",
         "--num_processes=2", f"--process_id={i}", f"--heartbeat_timeout={HEARTBEAT}"],
        cwd=REPO, env=env, stdout=open(logs / f"process_{i}.log", "w"), stderr=subprocess.STDOUT,
    ) for i in range(2)]


def _wait_all(procs, logs: pathlib.Path) -> None:
    for i, p in enumerate(procs):
        try:
            rc = p.wait(timeout=900)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"process {i} did not finish in 900 s")
        if rc:
            pytest.fail(f"process {i} failed ({rc}):\n{(logs / f'process_{i}.log').read_text()[-3000:]}")


def _steps_logged(model_dir: pathlib.Path) -> int:
    """Train steps in metrics.jsonl so far; read while the run writes it, so a last line
    not yet whole is not counted (read_metrics would reject it)."""
    path = model_dir / "metrics.jsonl"
    lines = path.read_text().split("\n")[:-1] if path.is_file() else []
    return sum('"split": "train", "task": "all"' in line for line in lines)


def _train_rows(model_dir: pathlib.Path) -> list[dict]:
    return [r for r in read_metrics(model_dir) if r["split"] == "train" and r["task"] == "all"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """`(model gin, run directory)` of the same 2-process run, never interrupted."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    model_gin = tmp / "model.gin"
    model_gin.write_text(tiny_t5_gin())
    _wait_all(_launch(model_gin, tmp / "run", tmp / "logs"), tmp / "logs")
    for i in range(2):  # each process read its share of every task from its own shards
        log = (tmp / "logs" / f"process_{i}.log").read_text()
        assert f"Input: process {i} of 2 supplies its share of every task" in log, log[-3000:]
    return model_gin, tmp / "run"


def test_sigkill_exits_within_heartbeat_and_resumes_exactly(tmp_path, uninterrupted):
    # One run killed twice: a worker past the first checkpoint, then, in the resumed run,
    # the coordinator past the second; each time the survivor exits within the heartbeat
    # timeout, and the run resumed twice ends with the uninterrupted run's losses. (One
    # run, not one per victim: each launch of two processes costs ~25 s to start.)
    model_gin, reference = uninterrupted
    run = tmp_path / "run"
    for relaunch, victim in enumerate((1, 0)):
        _kill(model_gin, run, tmp_path / f"logs_killed_{victim}", victim,
              after=(relaunch + 1) * CHECKPOINT_PERIOD + 5)
        if relaunch:
            log = (tmp_path / f"logs_killed_{victim}" / "process_0.log").read_text()
            assert "Resuming from checkpoint step" in log, log[-3000:]

    logs = tmp_path / "logs_resumed"
    _wait_all(_launch(model_gin, run, logs), logs)
    assert "Resuming from checkpoint step" in (logs / "process_0.log").read_text()
    rows = read_metrics(run)
    counts = collections.Counter((r["step"], r["split"], r["task"]) for r in rows)
    assert max(counts.values()) == 1, [k for k, n in counts.items() if n > 1][:5]
    a = [r["loss"] for r in sorted(_train_rows(reference), key=lambda r: r["step"])]
    b = [r["loss"] for r in sorted(_train_rows(run), key=lambda r: r["step"])]
    assert len(a) == len(b) == STEPS
    assert a == pytest.approx(b, rel=1e-5, abs=1e-6)


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
    assert len(_train_rows(run)) < STEPS, "the run ended before it could be killed"
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
    assert len(_train_rows(run)) < STEPS
