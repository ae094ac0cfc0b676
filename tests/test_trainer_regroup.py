"""A process-grouped global batch (a sharded `MultiTaskInput`'s, `[p0: t0 t1 ..][p1: ..]`)
regrouped by task in the step (`StepOptions.regroup_by_task`) trains exactly as the same
rows given grouped by task with the same row ids, on the task-block path under dropout."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ktx import optim
from ktx.data import process_layout
from ktx.models import seq2seq, t5
from ktx.models.base import ROW_ID, with_row_ids
from ktx.optim import compute_task_gradients
from ktx.training import trainer as trainer_lib
from ktx.training.optimizers import TaskOptimizer
from tests.models.t5_batches import random_t5_batch

COUNTS = (5, 3, 0, 8)  # 16 rows, one absent task
PROCESSES = 4
STEP = 7


@pytest.fixture(scope="module", autouse=True)
def _clear_caches():
    """The file's cached model, parameters, initial state and jitted gradients, dropped
    after its tests."""
    yield
    for fn in (_model, _params, _grads_fn, _initial_state):
        fn.cache_clear()


@functools.cache
def _model():
    return seq2seq.EncoderDecoderModel(
        config=t5.T5Config(vocab_size=64, emb_dim=16, num_heads=2, head_dim=8, mlp_dim=32,
                           num_encoder_layers=1, num_decoder_layers=1, dropout_rate=0.1),
        num_tasks=len(COUNTS))


def _batches():
    """`(process_grouped, task_grouped)`: the same 16 rows; `task_grouped` is sorted by task
    and carries each row's position in `process_grouped` as its `ROW_ID`."""
    n = sum(COUNTS)
    grouped = random_t5_batch(COUNTS)
    shares = process_layout.process_shares(COUNTS, PROCESSES, [STEP])  # [P, T]
    starts = np.cumsum((0,) + COUNTS[:-1])
    order = []  # process p's rows of task t: the next shares[p, t] rows of t's block
    for p in range(PROCESSES):
        for t in range(len(COUNTS)):
            order += list(range(starts[t], starts[t] + shares[p, t]))
            starts[t] += shares[p, t]
    order = np.asarray(order)
    assert sorted(order) == list(range(n))
    process_grouped = {k: v[order] for k, v in grouped.items()}
    assert not (np.diff(process_grouped["task_id"]) >= 0).all()  # not grouped by task
    grouped[ROW_ID] = np.argsort(order).astype(np.int32)  # each row's process-grouped position
    return process_grouped, grouped


@functools.cache
def _params():
    """`_model()`'s unboxed parameters, initialized (jitted) on the task-grouped rows."""
    model = _model()
    batch = with_row_ids({k: jnp.asarray(v) for k, v in _batches()[1].items()})
    return jax.jit(lambda r, b: jax.tree.map(
        lambda x: getattr(x, "value", x), model.init_variables(r, b)["params"],
        is_leaf=lambda x: hasattr(x, "value")))(jax.random.key(0), batch)


@functools.cache
def _grads_fn(method, regroup, sparse):
    """Jitted `(params, batch, rng) -> compute_task_gradients(...)` of `_model()` under
    dropout: one compile per configuration, shared by batches of one structure."""
    model = _model()

    def grads(params, batch, rng):
        if regroup:
            batch = trainer_lib.group_rows_by_task(batch)
        return compute_task_gradients(
            lambda q, b: model.loss_sums(q, b, rng, True), model.normalizer(batch), params,
            batch, num_tasks=model.num_tasks, shared="all", method=method,
            task_capacity=COUNTS if method == "blocks" else None,
            sparse_tables=model.sparse_table_patterns if sparse else None)

    return jax.jit(grads)


def test_group_rows_by_task_is_a_stable_sort_that_keeps_row_ids():
    process_grouped, grouped = _batches()
    out = jax.jit(lambda b: trainer_lib.group_rows_by_task(with_row_ids(b)))(process_grouped)
    for k, v in grouped.items():
        np.testing.assert_array_equal(out[k], v, err_msg=k)


@pytest.mark.parametrize("sparse", [False, True])
def test_regrouped_per_task_gradients_equal_the_task_grouped_ones(sparse):
    """Per-task losses and gradients (task blocks) of the regrouped process-grouped batch
    equal those of the task-grouped rows and the one-hot VJP of the unsorted batch."""
    process_grouped, grouped = _batches()
    params = _params()
    rng = jax.random.key(3)

    def grads(batch, method, regroup):
        batch = with_row_ids({k: jnp.asarray(v) for k, v in batch.items()})
        return _grads_fn(method, regroup, sparse)(params, batch, rng)

    def dense(tg):
        return jax.tree.map(
            lambda g: jnp.stack([jnp.zeros((g.num_rows, g.rows.shape[-1])).at[g.indices[t]].add(
                g.rows[t]) for t in range(len(COUNTS))]) if isinstance(g, optim.SparseRows) else g,
            tg.stacked, is_leaf=lambda x: isinstance(x, optim.SparseRows))

    want_losses, _, want = grads(grouped, "blocks", False)
    assert np.isfinite(want_losses).all()
    for method, batch in (("blocks", process_grouped), ("vjp", process_grouped)):
        losses, _, got = grads(batch, method, method == "blocks")
        np.testing.assert_allclose(losses, want_losses, rtol=1e-5, atol=1e-7, err_msg=method)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
                     dense(got), dense(want))
    assert float(jnp.abs(want_losses).sum()) > 0
    # Row ids matter (dropout): the task-grouped rows numbered by their own positions differ.
    renumbered = {k: v for k, v in grouped.items() if k != ROW_ID}
    other, _, _ = grads(renumbered, "blocks", False)
    assert not np.allclose(other, want_losses)


def _optimizer():
    return TaskOptimizer(optax.adam(1e-2), balancer=optim.vanilla_multi())


@functools.cache
def _initial_state():
    """The `Trainer`'s initial state of `_model()` and `_optimizer()` (the step below does
    not donate it: every `_step` starts from it)."""
    batch = {k: v for k, v in _batches()[0].items() if k != ROW_ID}
    return trainer_lib.Trainer(_model(), _optimizer()).init_state(jax.random.key(0), batch)


def _step(batch, regroup: bool, check_layout: bool = True):
    model = _model()
    optimizer = _optimizer()
    state = _initial_state()
    options = trainer_lib.StepOptions(grad_method="blocks", task_capacity=COUNTS,
                                      regroup_by_task=regroup, sparse_tables=(),
                                      check_layout=check_layout, weights_from_losses=False)
    step = jax.jit(functools.partial(trainer_lib.train_step, model=model, optimizer=optimizer,
                                     options=options))
    metrics = []
    for _ in range(2):
        state, m = step(state, batch, jax.random.key(5))
        metrics.append(jax.device_get(m))
    return metrics, jax.device_get(state.params)


def test_train_step_regroups_a_process_grouped_batch():
    """Two balanced steps (vanilla_multi, task blocks, dropout 0.1): the regrouped
    process-grouped batch gives the losses, per-task gradient norms and parameters of the
    task-grouped rows; without `regroup_by_task` (and the in-step layout check) the blocks
    read other tasks' rows."""
    process_grouped, grouped = _batches()
    got, p_got = _step(process_grouped, True)
    # The reference compiles the same program as the unsorted run below (no regrouping, no
    # layout check), read from the session's compilation cache the second time.
    want, p_want = _step(grouped, False, check_layout=False)
    for a, b in zip(got, want):
        assert np.isfinite(b["task_losses"]).all() and b["loss"] > 0
        np.testing.assert_allclose(a["task_losses"], b["task_losses"], rtol=1e-5, atol=1e-7)
        np.testing.assert_array_equal(a["examples"], COUNTS)
        jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6),
                     a["diagnostics"], b["diagnostics"])
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-4, atol=5e-5), p_got, p_want)
    unsorted, _ = _step(process_grouped, False, check_layout=False)
    assert not np.allclose(unsorted[0]["task_losses"], want[0]["task_losses"], rtol=1e-3)


def test_host_check_takes_each_process_rows_with_its_shares():
    counts = (5, 3, 0, 8)
    shares = process_layout.process_shares(counts, PROCESSES, [STEP])
    for p in range(PROCESSES):
        trainer_lib.check_process_grouped(np.repeat(np.arange(4), shares[p]), counts, p, PROCESSES)
    with pytest.raises(ValueError, match="process 1's rows must be grouped by task in task order"):
        trainer_lib.check_process_grouped(np.array([0, 3, 1, 3]), counts, 1, PROCESSES)
    with pytest.raises(ValueError, match="process 2 of 4 has 3 rows of task 0; its share of the "
                                         "global 5 is 1 or 2"):
        trainer_lib.check_process_grouped(np.array([0, 0, 0, 3]), counts, 2, PROCESSES)
    with pytest.raises(ValueError, match="sum to 16 but the global batch has 12 rows"):
        trainer_lib.check_process_grouped(np.array([0, 1, 3]), counts, 0, PROCESSES)
    with pytest.raises(ValueError, match="task_id 7; accepted: 0..3"):
        trainer_lib.check_process_grouped(np.array([0, 1, 3, 7]), counts, 0, PROCESSES)
    with pytest.raises(TypeError, match="regroup_by_task='yes'"):
        trainer_lib.StepOptions(regroup_by_task="yes")


def test_trainer_checks_process_grouped_rows_on_the_host():
    """`Trainer.global_batch` with `regroup_by_task` checks the rows against the shares
    (one process here: all its rows grouped by task) instead of the task blocks."""
    _, grouped = _batches()
    batch = {k: v for k, v in grouped.items() if k != ROW_ID}
    trainer = trainer_lib.Trainer(_model(), optax.sgd(0.1), balancer=optim.vanilla_multi(),
                                  regroup_by_task=True)
    trainer.global_batch(batch, COUNTS)
    shuffled = {k: v[::-1] for k, v in batch.items()}
    with pytest.raises(ValueError, match="regroup_by_task: process 0's rows must be grouped"):
        trainer.global_batch(shuffled, COUNTS)
