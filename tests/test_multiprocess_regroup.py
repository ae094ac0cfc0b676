"""Two real processes with the default (sharded) input: synthetic_quickstart's mixed
task-partitioned batches are process-grouped, and the balanced step (vanilla_multi: the
sum of the per-task gradients from task blocks) regroups them by task in the step; its
losses equal the plain step's on the same batches, step by step."""

from __future__ import annotations

import pathlib
import subprocess

import pytest
from tests import row_cache
from tests.xla_env import with_devices

from tests.test_multiprocess_faults import KTX, REPO, _free_port, _train_rows, _wait_all
from tests.tiny_t5_gin import tiny_t5_gin

pytestmark = pytest.mark.slow  # processes started, killed and relaunched

STEPS = 6


def _run(tmp: pathlib.Path, balanced: bool) -> list[float]:
    tmp.mkdir(parents=True)
    model_gin = tmp / "model.gin"
    model_gin.write_text(tiny_t5_gin())
    flags = [
        "--gin_file=runs/train.gin", f"--gin_file={model_gin}",
        # Per-task gradients from task blocks, not the loss-weighted shortcut.
        *(["--gin_file=optim/vanilla_multi.gin",
           "--gin.train_script.train.weights_from_losses=False"] if balanced else []),
        "--gin.NUM_TASKS=4", f"--gin.MODEL_DIR='{tmp / 'run'}'",
        "--gin.MIXTURE_OR_TASK_NAME='synthetic_quickstart'",
        "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}",
        # The default (proportional) mixing: unequal blocks, a task absent from some
        # batches, each process's shares of a task differing by a row from step to step.
        f"--gin.TRAIN_STEPS={STEPS}", "--gin.BATCH_SIZE=16", "--gin.NUM_PARTITIONS=2",
        "--gin.train_script.train.log_period=1",
        row_cache.flag(),
    ]
    port = _free_port()
    env = with_devices(4)
    logs = [tmp / f"process_{i}.log" for i in range(2)]
    procs = [subprocess.Popen(
        [KTX, "train", *flags, "--multihost", f"--coordinator_address=localhost:{port}",
         "--num_processes=2", f"--process_id={i}"],
        cwd=REPO, env=env, stdout=open(logs[i], "w"), stderr=subprocess.STDOUT) for i in range(2)]
    _wait_all(procs, tmp)
    for i in range(2):
        assert f"Input: process {i} of 2 supplies its share of every task" in logs[i].read_text()
    return [r["loss"] for r in sorted(_train_rows(tmp / "run"), key=lambda r: r["step"])]


def test_balanced_step_regroups_process_grouped_batches(tmp_path):
    balanced = _run(tmp_path / "balanced", True)
    plain = _run(tmp_path / "plain", False)
    assert len(balanced) == len(plain) == STEPS
    assert balanced == pytest.approx(plain, rel=1e-5)
    assert plain[-1] < plain[0]  # it trains
