"""`train(steps_per_call=K)`: blocks of K steps in one compiled call (`Trainer.train_steps`)
give the metrics, checkpoints, evaluations and resume of one step per call, plain and
balanced, with counts that change from step to step; the block plan ends a block at every
log, checkpoint and evaluation step."""

from __future__ import annotations

import json

import jax
import numpy as np
import optax
import pytest

from ktx import optim
from ktx.runs.eval import TeacherForcedEvaluator
from ktx.runs.train import Prefetcher, _block_plan, train
from ktx.training import optimizers
from ktx.training import trainer as trainer_lib
from ktx.training.checkpoints import CheckpointManager
from tests.test_trainer import ToyInput, ToyModel


class _VaryingInput(ToyInput):
    """Counts that change every step (as carried mixing quotas do); a pure function of
    the step (the prefetch thread and the evaluators read it concurrently)."""

    SCHEDULE = ((5, 3), (4, 4), (6, 2), (5, 3), (3, 5), (4, 4))

    def task_counts(self, step):
        return self.SCHEDULE[step % len(self.SCHEDULE)]

    def get_batch(self, step):
        rng = np.random.default_rng((self.seed, step))
        x = rng.normal(size=(self.batch_size, self.dim)).astype(np.float32)
        task = np.repeat(np.arange(2), self.task_counts(step)).astype(np.int32)
        label = np.einsum("bd,bdk->bk", x, self._w[task]).argmax(-1).astype(np.int32)
        return {"x": x, "label": label, "task_id": task}


def _records(model_dir):
    rows = [json.loads(x) for x in (model_dir / "metrics.jsonl").read_text().splitlines()]
    drop = ("steps_per_s", "examples_per_s", "input_wait_fraction", "tokens_per_s",
            "nonpad_tokens_per_s", "tflops_per_device", "mfu")  # rates: time-dependent
    return [{k: v for k, v in r.items() if k not in drop} for r in rows]


def _run(model_dir, steps_per_call, train_steps=11, balancer=None, dropout=0.0):
    return train(
        model=ToyModel(dropout=dropout), train_input=_VaryingInput(), model_dir=model_dir,
        optimizer=optax.adam(1e-2), schedule=optimizers.constant_schedule(1e-2),
        balancer=balancer, train_steps=train_steps, log_period=3, checkpoint_period=4,
        eval_period=5, evaluators=[TeacherForcedEvaluator(batch_size=8)],
        steps_per_call=steps_per_call)


def test_block_plan_ends_at_every_due_step():
    due = lambda done: done % 3 == 0 or done % 4 == 0  # noqa: E731
    assert _block_plan(0, 11, 5, due) == [3, 1, 2, 2, 1, 2]  # ends 3 4 6 8 9 11
    assert _block_plan(4, 11, 1, due) == [1] * 7
    assert _block_plan(0, 10, 100, lambda done: False) == [10]


@pytest.mark.parametrize("balanced", [False, True])
def test_blocks_equal_one_step_per_call(tmp_path, balanced):
    balancer = (lambda: optim.metabalance(target_task=0, num_tasks=2)) if balanced else (lambda: None)
    # ToyModel's dropout masks depend on the batch's shape, not on each row (ktx's models
    # key them per row): the balanced blocks, whose static sizes differ between the two
    # runs, are compared without it.
    dropout = 0.0 if balanced else 0.2
    one = _run(tmp_path / "one", 1, balancer=balancer(), dropout=dropout)
    block = _run(tmp_path / "block", 5, balancer=balancer(), dropout=dropout)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                 jax.device_get(block.params), jax.device_get(one.params))
    a, b = _records(tmp_path / "one"), _records(tmp_path / "block")
    assert [(r["step"], r["split"], r["task"]) for r in a] == \
        [(r["step"], r["split"], r["task"]) for r in b]
    for x, y in zip(a, b):
        for key, value in x.items():
            if isinstance(value, float):
                assert y[key] == pytest.approx(value, rel=1e-5, abs=1e-7), (x["step"], key)
    assert CheckpointManager(tmp_path / "block").all_steps() == \
        CheckpointManager(tmp_path / "one").all_steps() == [4, 8, 11]


def test_resume_in_blocks_is_exact(tmp_path):
    _run(tmp_path / "resumed", 5, train_steps=6)  # stops at 6 (a log step), checkpointed
    resumed = _run(tmp_path / "resumed", 5, train_steps=11)
    straight = _run(tmp_path / "straight", 5, train_steps=11)
    assert int(resumed.step) == 11
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-7),
                 jax.device_get(resumed.params), jax.device_get(straight.params))


def test_prefetcher_stacks_a_block_with_its_counts():
    inp = _VaryingInput()
    tr = trainer_lib.Trainer(ToyModel(), optax.sgd(0.1), balancer=optim.vanilla_multi())
    tr.init_state(jax.random.key(0), inp.get_batch(0))
    pre = Prefetcher(inp, tr, 2, 7, plan=[3, 1, 1])
    items = list(pre)
    pre.close()
    assert [i[0] for i in items] == [2, 5, 6]
    step, batch, counts, _ = items[0]
    assert batch["x"].shape == (3, 8, 6) and counts == [inp.task_counts(s) for s in (2, 3, 4)]
    np.testing.assert_array_equal(np.asarray(batch["task_id"][1]),
                                  np.repeat([0, 1], inp.task_counts(3)))
    with pytest.raises(ValueError, match="summing to 5"):
        Prefetcher(inp, tr, 2, 7, plan=[3, 1])
    with pytest.raises(ValueError, match="steps_per_call=0"):
        _run(None, 0)


def test_a_block_with_a_badly_grouped_batch_fails_loudly():
    inp = _VaryingInput()
    tr = trainer_lib.Trainer(ToyModel(), optax.sgd(0.1), balancer=optim.vanilla_multi())
    state = tr.init_state(jax.random.key(0), inp.get_batch(0))
    batches = [inp.get_batch(s) for s in range(3)]
    stacked = {k: np.stack([b[k] for b in batches]) for k in batches[0]}
    counts = [inp.task_counts(s) for s in range(3)]
    tr.train_steps(state, stacked, jax.random.key(1), counts)  # as promised: runs
    state = tr.init_state(jax.random.key(0), inp.get_batch(0))
    with pytest.raises(ValueError):
        tr.train_steps(state, stacked, jax.random.key(1), [counts[1], counts[0], counts[2]])
    with pytest.raises(ValueError, match="2 count tuples for 3 batches"):
        tr.train_steps(state, stacked, jax.random.key(1), counts[:2])
