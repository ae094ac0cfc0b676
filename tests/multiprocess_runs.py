"""Two-process `ktx train` runs on synthetic_quickstart for the slow tests, and the one
uninterrupted run several of them compare against.

Every run here has the same flags but its length, checkpointing and timeouts: a tiny T5
on synthetic_quickstart's mixed task-partitioned batches, sharded input (each process reads
its own share of every task), rsqrt learning rate (no dependence on the run's length). So
the first N losses of any of these runs equal those of an uninterrupted run of N or more
steps, and the tests that need such a reference (a killed and relaunched run, a preempted
one, the balanced step's regrouping) read one: `sharded_reference()`, trained once per test
session and shared by the xdist workers (a file lock in the session's folder, made by
tests/conftest.py; the worker that comes second waits for the first). Each two-process
launch costs ~20 s of the 2-core machine, mostly starting the processes.
"""

from __future__ import annotations

import fcntl
import os
import pathlib
import shutil
import socket
import subprocess
import sys

import pytest
from tests import row_cache
from tests.tiny_t5_gin import tiny_t5_gin
from tests.xla_env import with_devices

from ktx.training.summaries import read_metrics

REPO = pathlib.Path(__file__).resolve().parent.parent
KTX = str(pathlib.Path(sys.executable).parent / "ktx")
REFERENCE_STEPS = 80  # the longest run compared against it (tests/test_multiprocess_faults.py)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def flags(model_gin: pathlib.Path, model_dir: pathlib.Path, steps: int, *extra: str) -> list[str]:
    """`ktx train` flags of a two-process run of `steps` steps, then `extra`."""
    return [
        "--gin_file=runs/train.gin", f"--gin_file={model_gin}", "--gin.NUM_TASKS=4",
        f"--gin.MODEL_DIR='{model_dir}'", "--gin.MIXTURE_OR_TASK_NAME='synthetic_quickstart'",
        "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}",
        f"--gin.TRAIN_STEPS={steps}", "--gin.BATCH_SIZE=16", "--gin.NUM_PARTITIONS=2",
        "--gin.train_script.train.log_period=1",
        row_cache.flag(), *extra,
    ]


def launch(train_flags: list[str], logs: pathlib.Path, *,
           heartbeat: int | None = None) -> list[subprocess.Popen]:
    """Starts `ktx train` as processes 0 and 1 of one run (4 CPU devices each); process i
    writes `logs/process_i.log`."""
    port = free_port()
    logs.mkdir(parents=True, exist_ok=True)
    beat = [] if heartbeat is None else [f"--heartbeat_timeout={heartbeat}"]
    return [subprocess.Popen(
        [KTX, "train", *train_flags, "--multihost", f"--coordinator_address=localhost:{port}",
         "--num_processes=2", f"--process_id={i}", *beat],
        cwd=REPO, env=with_devices(4), stdout=open(logs / f"process_{i}.log", "w"),
        stderr=subprocess.STDOUT,
    ) for i in range(2)]


def wait_all(procs: list[subprocess.Popen], logs: pathlib.Path, expected: int = 0) -> None:
    """Waits for every process; fails the test (with the log's end) on another exit status."""
    for i, p in enumerate(procs):
        try:
            rc = p.wait(timeout=900)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"process {i} did not finish in 900 s")
        if rc != expected:
            pytest.fail(f"process {i}: exit status {rc}, expected {expected}:\n"
                        f"{(logs / f'process_{i}.log').read_text()[-3000:]}")


def train_losses(model_dir: pathlib.Path) -> list[float]:
    """The run's train losses (all tasks), step by step."""
    rows = [r for r in read_metrics(model_dir) if r["split"] == "train" and r["task"] == "all"]
    return [r["loss"] for r in sorted(rows, key=lambda r: r["step"])]


def sharded_reference() -> tuple[pathlib.Path, list[float]]:
    """`(model gin, losses)` of the uninterrupted two-process run of `REFERENCE_STEPS` steps;
    trained by the first test of the session that asks, read by the others."""
    folder = pathlib.Path(os.environ["KTX_TEST_SHARED_RUNS"]) / f"sharded_{REFERENCE_STEPS}"
    with open(f"{folder}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        model_gin, done = folder / "model.gin", folder / "DONE"
        if not done.is_file():
            shutil.rmtree(folder, ignore_errors=True)  # a failed attempt's leftovers
            folder.mkdir(parents=True)
            model_gin.write_text(tiny_t5_gin())
            logs = folder / "logs"
            wait_all(launch(flags(model_gin, folder / "run", REFERENCE_STEPS), logs), logs)
            for i in range(2):  # each process read its share of every task from its own shards
                log = (logs / f"process_{i}.log").read_text()
                assert f"Input: process {i} of 2 supplies its share of every task" in log, log[-3000:]
            done.touch()
    losses = train_losses(folder / "run")
    assert len(losses) == REFERENCE_STEPS
    return model_gin, losses
