"""Two real processes with the default (sharded) input: synthetic_quickstart's mixed
task-partitioned batches are process-grouped, and the balanced step (vanilla_multi: the
sum of the per-task gradients from task blocks) regroups them by task in the step; its
losses equal the plain step's on the same batches (the session's uninterrupted plain run,
tests/multiprocess_runs.py), step by step."""

from __future__ import annotations

import pytest
from tests.multiprocess_runs import flags, launch, sharded_reference, train_losses, wait_all

pytestmark = pytest.mark.slow  # processes started, killed and relaunched

STEPS = 6


def test_balanced_step_regroups_process_grouped_batches(tmp_path):
    model_gin, plain = sharded_reference()  # the default (proportional) mixing: unequal
    # blocks, a task absent from some batches, each process's shares of a task differing
    # by a row from step to step
    logs = tmp_path / "logs"
    # Per-task gradients from task blocks, not the loss-weighted shortcut.
    wait_all(launch(flags(model_gin, tmp_path / "run", STEPS, "--gin_file=optim/vanilla_multi.gin",
                          "--gin.train_script.train.weights_from_losses=False"), logs), logs)
    for i in range(2):
        assert f"Input: process {i} of 2 supplies its share of every task" in (
            logs / f"process_{i}.log").read_text()
    balanced = train_losses(tmp_path / "run")
    assert len(balanced) == STEPS
    assert balanced == pytest.approx(plain[:STEPS], rel=1e-5)
    assert plain[STEPS - 1] < plain[0]  # it trains
