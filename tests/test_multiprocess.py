"""Multi-host training on one machine: two `ktx train` processes joined by
`jax.distributed` (launch/multiprocess.sh), 4 CPU devices each, give the same losses as
one process with 8 devices, on the same (data=4, model=2) mesh."""

from __future__ import annotations

import pathlib
import subprocess

import pytest
from tests import row_cache
from tests.multiprocess_runs import KTX, REPO, free_port, train_losses
from tests.xla_env import with_devices

from tests.tiny_t5_gin import tiny_t5_gin

pytestmark = pytest.mark.slow  # processes started, killed and relaunched

MODEL_GIN = tiny_t5_gin()


def _flags(model_gin: pathlib.Path, model_dir: pathlib.Path) -> list[str]:
    return [
        "--gin_file=runs/train.gin", f"--gin_file={model_gin}",
        "--gin.NUM_TASKS=4", f"--gin.MODEL_DIR='{model_dir}'",
        "--gin.MIXTURE_OR_TASK_NAME='synthetic_quickstart'",
        "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}",
        "--gin.TRAIN_STEPS=3", "--gin.BATCH_SIZE=16", "--gin.NUM_PARTITIONS=2",
        "--gin.train_script.train.log_period=1",
        "--gin.train_script.train.checkpoint_period=3",
        # Every process reads the whole tasks (the one-process stream, sliced): the two
        # runs see the same rows. Sharded input: tests/test_multiprocess_faults.py.
        "--gin.pipeline.MultiTaskInput.shard_by_process=False",
        row_cache.flag(),
    ]


def _run(cmd: list[str], devices: int, tmp_path: pathlib.Path) -> None:
    env = with_devices(devices)
    env["KTX"] = KTX
    env["KTX_COORDINATOR_PORT"] = str(free_port())
    proc = subprocess.run(
        cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900
    )
    if proc.returncode:
        pytest.fail(f"{' '.join(cmd[:4])} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")


def test_two_processes_match_one(tmp_path):
    model_gin = tmp_path / "model.gin"
    model_gin.write_text(MODEL_GIN)

    single = tmp_path / "single"
    _run([KTX, "train", *_flags(model_gin, single)], 8, tmp_path)
    multi = tmp_path / "multi"
    _run(["bash", "launch/multiprocess.sh", "2", "train", *_flags(model_gin, multi)], 4, tmp_path)

    a, b = train_losses(single), train_losses(multi)
    assert len(a) == 3 and len(b) == 3
    assert a == pytest.approx(b, rel=1e-4, abs=1e-5)
    assert (multi / "checkpoints").is_dir()
