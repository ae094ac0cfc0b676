"""Per-task gradients in one compiled step.

`compute_task_gradients` returns the gradient of every task's loss with respect to the
parameters, stacked on a leading task axis, from inside a jitted train step:

* `method="blocks"` (task-partitioned batches, `ktx.runs.train.TrainInput.task_counts`): rows of task `t` are the
  contiguous block `[sum(counts[:t]), sum(counts[:t+1]))`. Task `t`'s loss is evaluated
  on its own block only and divided by the *whole* batch's normalizer, so all `T`
  gradients together cost one backward pass over the batch, and they add up exactly to
  the gradient of the summed loss. `task_counts` gives the exact counts (static);
  `task_capacity` gives static block sizes `>=` the counts, which are then read from the
  rows' `task_id` inside the step: a mixture whose counts vary from step to step (carried
  quotas) compiles once. A block holds task `t`'s rows and possibly a few rows of its
  neighbours, which cost compute but add nothing: only entry `t` of the block's `[T]`
  sums is kept. Equal blocks are vmapped; unequal ones are traced one after another
  (still one compiled program).
* `method="vjp"` (any batch): one forward pass, then a vmapped vector-Jacobian product
  over the one-hot task cotangents `e_t / normalizer_t`.
* `method="devices"` (under a mesh whose `data` axis has several devices): every device
  differentiates its own rows, once per task among them (`slots`), and the devices'
  gradients are added up by task into `[T, ...]` shards split over `data`
  (`ktx.optim.device_slots`): one backward pass of FLOPs with rows grouped by task, no
  block padded to the `data` axis, and `T` gradient shards per device.
* `method="taps"` (task-partitioned batches with static counts: `task_counts`, or a
  `task_capacity` whose blocks fill the batch): one forward and one backward pass over
  the whole batch, every balanced parameter read through a tap whose gradient is its
  per-task gradients (`ktx.task_taps`, `ktx.optim.tapped`): the activations' cotangents
  are the plain step's, only the parameters' gradients carry the task axis. The model's
  layers must read every balanced parameter through a tap (T5's, BERT's, CA-MTL's and the
  recommendation model's do); a parameter that is not is an error naming it.
* `method="auto"`: taps when the counts are static and every balanced parameter has a
  tap, blocks when `task_counts` or `task_capacity` is given, vjp otherwise.

`loss_weighted_gradient` is the shortcut for balancers whose weights depend on the losses
only (`ktx.optim.LossWeighting`): the weighted sum of the task gradients from one forward
and one backward pass, as a plain step costs, without the task gradients themselves.

Only shared parameters (see `ktx.optim.selection`) keep a task axis; the task
gradients of the others are summed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ktx.optim import tapped
from ktx.optim.selection import shared_mask
from ktx.optim.sparse import SparseLookups
from ktx.optim.task_gradients import SparseRows, TaskGradients, leaf_combine, task_sum
from ktx.partitioning import DATA

__all__ = [
    "METHODS",
    "check_host_layout",
    "compute_task_gradients",
    "loss_weighted_gradient",
    "split_shared",
]

METHODS = ("auto", "taps", "blocks", "vjp", "devices")

LossSumsFn = Callable[[Any, Mapping[str, jax.Array]], tuple[jax.Array, dict[str, jax.Array]]]


def split_shared(stacked_grads: Any, params: Any, shared: Sequence[str] | str | None) -> TaskGradients:
    """Keeps the task axis of shared parameters, sums it away for the others."""
    mask = shared_mask(params, shared)

    def total(g):
        if isinstance(g, SparseRows):
            return leaf_combine(g, jnp.ones((g.num_tasks,), jnp.float32))
        return task_sum(g)

    stacked = jax.tree.map(lambda m, g: g if m else None, mask, stacked_grads)
    summed = jax.tree.map(lambda m, g: None if m else total(g), mask, stacked_grads)
    return TaskGradients(stacked=stacked, summed=summed)


def _validate_counts(
    task_counts: Sequence[int], num_tasks: int, batch: Mapping, check_layout: bool = True
) -> tuple[int, ...]:
    try:
        counts = tuple(int(c) for c in task_counts)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"task_counts={task_counts!r}: expected a static sequence of ints (one per task)"
        ) from e
    if len(counts) != num_tasks or any(c < 0 for c in counts):
        raise ValueError(
            f"task_counts={counts!r}: expected {num_tasks} non-negative counts (num_tasks)"
        )
    rows = {k: v.shape[0] for k, v in batch.items()}
    if len(set(rows.values())) != 1:
        raise ValueError(f"batch features disagree on the number of rows: {rows}")
    n = next(iter(rows.values()))
    if sum(counts) != n:
        raise ValueError(
            f"task_counts={counts!r} sum to {sum(counts)} but the batch has {n} rows; with "
            "method='blocks' the batch must be task-partitioned (ktx.runs.train.TrainInput)"
        )
    if check_layout and "task_id" in batch:
        _check_layout(batch["task_id"], counts)
    return counts


def _validate_capacity(task_capacity: Sequence[int], num_tasks: int, batch: Mapping) -> tuple[int, ...]:
    try:
        capacity = tuple(int(c) for c in task_capacity)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"task_capacity={task_capacity!r}: expected a static sequence of ints (one per task)"
        ) from e
    n = next(iter(batch.values())).shape[0]
    if len(capacity) != num_tasks or any(c < 0 or c > n for c in capacity):
        raise ValueError(
            f"task_capacity={capacity!r}: expected {num_tasks} block sizes in [0, {n}] "
            "(the most rows each task has in a batch)"
        )
    if "task_id" not in batch:
        raise ValueError("task_capacity needs the batch's task_id to locate the task blocks")
    return capacity


def _dynamic_counts(
    task_id: jax.Array, capacity: tuple[int, ...], check_layout: bool = True
) -> tuple[jax.Array, jax.Array]:
    """`(counts [T], starts [T])` of a task-grouped batch, checked inside the step (a host
    callback that raises): rows sorted by task and every count within its capacity."""
    t = len(capacity)
    task_id = jnp.asarray(task_id)
    counts = jnp.bincount(task_id, length=t)
    starts = jnp.cumsum(counts) - counts
    unsorted = jnp.any(task_id[1:] < task_id[:-1])
    over = counts > jnp.asarray(capacity)

    def fail_if(bad_order, bad_count, counts_now):
        if bool(bad_order):
            raise ValueError("task_capacity needs rows grouped by task in task order "
                             "(ktx.runs.train.TrainInput); this batch's task_id is not sorted")
        if bool(bad_count.any()):
            raise ValueError(f"task_capacity={capacity!r} but this batch has "
                             f"{tuple(int(c) for c in counts_now)} rows per task")

    if check_layout:
        jax.debug.callback(fail_if, unsorted, over, counts)
    return counts, starts


def _layout_error(counts: tuple[int, ...], first_bad: int, got: int) -> ValueError:
    return ValueError(
        f"task_counts={counts!r} say rows are grouped by task (task t in rows "
        f"[sum(counts[:t]), sum(counts[:t+1])) ), but row {first_bad} has task_id {got}; "
        "give a task-partitioned batch or no task_counts (the VJP path takes any batch)"
    )


def check_host_layout(task_id: Any, counts: Sequence[int], process_index: int = 0,
                      process_count: int = 1) -> None:
    """Host-side check of one process's rows of a task-partitioned global batch: its
    `task_id` (numpy, `[B / process_count]`) must be its slice of the blocks `counts`
    (global) describe. ValueError naming the first wrong row (global index) otherwise."""
    counts = tuple(int(c) for c in counts)
    got = np.asarray(task_id)
    n = got.shape[0]
    expected = np.repeat(np.arange(len(counts), dtype=np.int32), counts)
    if expected.shape[0] != n * process_count:
        raise ValueError(f"task_counts={counts!r} sum to {expected.shape[0]} but the global batch "
                         f"has {n * process_count} rows ({n} on each of {process_count} processes)")
    local = expected[process_index * n:(process_index + 1) * n]
    bad = np.flatnonzero(got != local)
    if bad.size:
        raise _layout_error(counts, process_index * n + int(bad[0]), int(got[bad[0]]))


def _check_layout(task_id: Any, counts: tuple[int, ...]) -> None:
    """The rows' `task_id` must match the blocks `counts` describe: checked now for a
    concrete array, inside the compiled step (a host callback that raises, O(B)) for a
    traced one."""
    expected = np.repeat(np.arange(len(counts), dtype=np.int32), counts)
    if not isinstance(task_id, jax.core.Tracer):
        got = np.asarray(task_id)
        bad = np.flatnonzero(got != expected)
        if bad.size:
            raise _layout_error(counts, int(bad[0]), int(got[bad[0]]))
        return
    mismatch = jnp.asarray(task_id) != jnp.asarray(expected)
    first = jnp.argmax(mismatch)

    def fail_if(any_bad, index, value):
        if bool(any_bad):
            raise _layout_error(counts, int(index), int(value))

    jax.debug.callback(fail_if, mismatch.any(), first, jnp.asarray(task_id)[first])


def _data_ways() -> int:
    """The size of the `data` axis of the mesh being traced under (1 without one)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else dict(mesh.shape).get(DATA, 1)


def _check_slots(task_id: Any, slots: int) -> None:
    """Every device's rows (`task_id` split into the mesh's `data` equal ranges) hold at
    most `slots` distinct tasks: checked now for a concrete array, in the step (a host
    callback that raises) for a traced one."""
    ways = _data_ways()

    def most(ids):
        ids = np.asarray(ids).reshape(ways, -1)
        return max(len(np.unique(r)) for r in ids)

    def message(n):
        return (f"slots={slots} but a device holds rows of {n} tasks; the batch must be "
                "grouped by task (ktx.runs.train.TrainInput) with at most `slots` tasks "
                "per device (ktx.optim.device_slots.device_slots)")

    if not isinstance(task_id, jax.core.Tracer):
        n = most(task_id)
        if n > slots:
            raise ValueError(message(n))
        return

    def fail_if(ids):
        n = most(ids)
        if n > slots:
            raise ValueError(message(n))

    jax.debug.callback(fail_if, task_id)


def _in_dtype(grads: Any, dtype: Any) -> Any:
    """The dense per-task gradients of `grads` in `dtype` (`SparseRows` as they are)."""
    return jax.tree.map(lambda g: g if isinstance(g, SparseRows) else g.astype(dtype),
                        grads, is_leaf=lambda x: isinstance(x, SparseRows))


def _own_entries(per_block: Any, present: Sequence[int], num_tasks: int) -> Any:
    """`[T]` sums whose entry t comes from task t's block (`per_block` stacks the blocks'
    `[T]` sums in the order of `present`); absent tasks get 0."""
    sel = np.zeros((len(present), num_tasks), np.float32)
    for i, t in enumerate(present):
        sel[i, t] = 1.0
    return jax.tree.map(lambda a: jnp.einsum("bt,bt->t", jnp.asarray(sel, a.dtype), a), per_block)


def _slice_block(batch: Mapping, start: Any, size: int) -> dict:
    """Rows `[start, start + size)` of every feature, split over the mesh's `data` axis
    as the batch is. XLA cannot tell how the rows of a dynamic slice at a traced start
    lie, and left alone it may compute every block on every device: a model without its
    own activation constraints (the recommendation model) then repeats the whole batch
    per data shard. Under `vmap` (equal blocks) the task axis stays unconstrained. No
    constraint without a mesh, or when the data axis does not divide `size` (the Trainer
    rounds blocks up so that it does)."""
    ways = _data_ways()

    def one(v):
        x = jax.lax.dynamic_slice_in_dim(v, start, size)
        if ways == 1 or size % ways:
            return x
        spec = jax.sharding.PartitionSpec(DATA, *([None] * (x.ndim - 1)))
        return jax.lax.with_sharding_constraint(x, spec)

    return {k: one(v) for k, v in batch.items()}


def _block_starts(sizes: tuple[int, ...], starts: Any, n: int) -> Any:
    """Block starts clamped so that every static-size block lies inside the batch (a
    block at the end then also holds rows before its task's, which add nothing)."""
    return jnp.minimum(jnp.asarray(starts), n - jnp.asarray(sizes))


def _blocks(loss_sums_fn, normalizer, params, batch, num_tasks, sizes, starts):
    """Per-task gradients over static-size blocks at (static or traced) `starts`."""
    n = next(iter(batch.values())).shape[0]
    starts = _block_starts(sizes, starts, n)

    def task_value_and_grad(t, block):
        def f(p):
            sums, aux = loss_sums_fn(p, block)
            return sums[t] / normalizer[t], (sums, aux)

        (_, (sums, aux)), grads = jax.value_and_grad(f, has_aux=True)(params)
        return sums, aux, grads

    present = [t for t in range(num_tasks) if sizes[t] > 0]
    if not present:
        raise ValueError("task block sizes are all zero: the batch has no rows")
    if len({sizes[t] for t in present}) == 1:
        c = sizes[present[0]]
        ts = jnp.asarray(present)
        blocks = jax.vmap(lambda s: _slice_block(batch, s, c))(starts[ts])
        sums, aux, grads = jax.vmap(task_value_and_grad)(ts, blocks)
        if len(present) < num_tasks:
            grads = jax.tree.map(lambda g: jnp.zeros((num_tasks,) + g.shape[1:], g.dtype).at[ts].set(g), grads)
        return _own_entries(sums, present, num_tasks), _own_entries(aux, present, num_tasks), grads

    per_task = {}
    for t in present:
        per_task[t] = task_value_and_grad(t, _slice_block(batch, starts[t], sizes[t]))
    zeros = jax.tree.map(jnp.zeros_like, params)
    sums = _own_entries(jnp.stack([per_task[t][0] for t in present]), present, num_tasks)
    aux = _own_entries(jax.tree.map(lambda *a: jnp.stack(a), *[per_task[t][1] for t in present]),
                       present, num_tasks)
    grads = jax.tree.map(
        lambda *g: jnp.stack(g), *[per_task[t][2] if t in per_task else zeros for t in range(num_tasks)]
    )
    return sums, aux, grads


def _vjp(loss_sums_fn, normalizer, params, batch, num_tasks):
    sums, vjp_fn, aux = jax.vjp(lambda p: loss_sums_fn(p, batch), params, has_aux=True)
    if sums.shape != (num_tasks,):
        raise ValueError(
            f"loss_sums_fn returned sums of shape {sums.shape}; expected ({num_tasks},)"
        )
    cotangents = jnp.eye(num_tasks, dtype=sums.dtype) / normalizer.astype(sums.dtype)[:, None]
    grads = jax.vmap(lambda c: vjp_fn(c)[0])(cotangents)
    return sums, aux, grads


def _pad_to(x: jax.Array, n: int) -> jax.Array:
    pad = [(0, n - x.shape[0])] + [(0, 0)] * (x.ndim - 1)
    return jnp.pad(x, pad)


def _sparse_blocks(sl, loss_sums_fn, normalizer, params, batch, num_tasks, sizes, starts):
    f = sl.fn(params)
    dense = sl.split(params)
    n = next(iter(batch.values())).shape[0]
    starts = _block_starts(sizes, starts, n)

    def task_value_and_grad(t, block, deltas):
        def g(d, z):
            sums, (aux, idx) = f(d, z, block)
            return sums[t] / normalizer[t], (sums, aux, idx)

        (_, (sums, aux, idx)), (gd, gz) = jax.value_and_grad(
            g, argnums=(0, 1), has_aux=True)(dense, deltas)
        return sums, aux, idx, gd, gz

    def zeros_for(block):
        return [jnp.zeros(s.shape, s.dtype) for s in sl.delta_specs(params, block)]

    present = [t for t in range(num_tasks) if sizes[t] > 0]
    if not present:
        raise ValueError("task block sizes are all zero: the batch has no rows")
    sl.call_names_for(params, jax.tree.map(lambda x: x[: max(sizes)], dict(batch)))
    if len({sizes[t] for t in present}) == 1 and len(present) == num_tasks:
        c = sizes[0]
        blocks = jax.vmap(lambda s0: _slice_block(batch, s0, c))(starts)
        deltas = zeros_for(jax.tree.map(lambda x: x[0], blocks))
        sums, aux, idx, gd, gz = jax.vmap(task_value_and_grad, in_axes=(0, 0, None))(
            jnp.arange(num_tasks), blocks, deltas)
        grads = sl.assemble(params, gd, gz, idx, num_tasks)
        return (_own_entries(sums, present, num_tasks), _own_entries(aux, present, num_tasks),
                grads)
    results = {}
    for t in present:
        block = _slice_block(batch, starts[t], sizes[t])
        results[t] = task_value_and_grad(t, block, zeros_for(block))
    sums = _own_entries(jnp.stack([results[t][0] for t in present]), present, num_tasks)
    aux = _own_entries(jax.tree.map(lambda *a: jnp.stack(a), *[results[t][1] for t in present]),
                       present, num_tasks)
    zero_dense = [jnp.zeros_like(x) for x in sl.split(params)]
    gd = [jnp.stack(g) for g in zip(*[results[t][3] if t in results else zero_dense
                                      for t in range(num_tasks)])]
    idx, gz = [], []
    for k in range(len(sl.call_names)):
        flat_idx = [results[t][2][k].reshape(-1) if t in results else None for t in range(num_tasks)]
        flat_rows = [results[t][4][k].reshape(-1, results[t][4][k].shape[-1]) if t in results else None
                     for t in range(num_tasks)]
        m = max(x.shape[0] for x in flat_idx if x is not None)
        d = next(x.shape[-1] for x in flat_rows if x is not None)
        dt = next(x.dtype for x in flat_rows if x is not None)
        idx.append(jnp.stack([jnp.zeros((m,), jnp.int32) if x is None else _pad_to(x, m) for x in flat_idx]))
        gz.append(jnp.stack([jnp.zeros((m, d), dt) if x is None else _pad_to(x, m) for x in flat_rows]))
    return sums, aux, sl.assemble(params, gd, gz, idx, num_tasks)


def _sparse_forward(sl, params, batch):
    """One forward pass with `sl`'s tables held constant: `(sums, vjp_fn, aux, indices)`,
    `vjp_fn(cotangent) -> (dense leaf grads, row grads per lookup)`."""
    sl.call_names_for(params, batch)
    deltas = [jnp.zeros(s.shape, s.dtype) for s in sl.delta_specs(params, batch)]
    f = sl.fn(params)
    sums, vjp_fn, (aux, indices) = jax.vjp(
        lambda d, z: f(d, z, batch), sl.split(params), deltas, has_aux=True)
    return sums, vjp_fn, aux, indices


def _sparse_vjp(sl, loss_sums_fn, normalizer, params, batch, num_tasks):
    sums, vjp_fn, aux, idx = _sparse_forward(sl, params, batch)
    cotangents = jnp.eye(num_tasks, dtype=sums.dtype) / normalizer.astype(sums.dtype)[:, None]
    gd, gz = jax.vmap(vjp_fn)(cotangents)
    idx = [jnp.broadcast_to(i, (num_tasks,) + i.shape) for i in idx]
    return sums, aux, sl.assemble(params, gd, gz, idx, num_tasks)


def compute_task_gradients(
    loss_sums_fn: LossSumsFn,
    normalizer: jax.Array,
    params: Any,
    batch: Mapping[str, jax.Array],
    *,
    num_tasks: int,
    task_counts: Sequence[int] | None = None,
    method: str = "auto",
    shared: Sequence[str] | str | None = None,
    sparse_tables: Sequence[str] | None = None,
    task_capacity: Sequence[int] | None = None,
    check_layout: bool = True,
    slots: int | None = None,
    scatter_dims: Sequence[int | None] | None = None,
    split: Sequence[bool] | None = None,
    layouts: Sequence[tuple | None] | None = None,
    dtype: Any = None,
) -> tuple[jax.Array, dict[str, jax.Array], TaskGradients]:
    """Per-task losses and gradients (call inside `jax.jit`).

    Args:
      loss_sums_fn: `(params, batch) -> (sums [T], aux)`, the model's `loss_sums` with
        rng/train closed over.
      normalizer: `[T]` divisors of the WHOLE batch (`model.normalizer(batch)`).
      params: the parameter tree.
      batch: dict of `[B, ...]` arrays with `task_id [B]`.
      num_tasks: T.
      task_counts: static per-task row counts of a task-partitioned batch, or None.
      method: one of `METHODS`.
      task_capacity: instead of `task_counts`, static per-task block sizes at least the
        counts; the counts are read from `batch["task_id"]` inside the step.
      check_layout: check that the rows' `task_id` are grouped as the blocks assume (for
        traced batches, a host callback in the step that raises). The `Trainer` checks
        each batch on the host before it is sharded and passes False: a per-step
        callback costs as much as the rest of the balanced overhead on small steps.
      slots: `method="devices"`: the most tasks among any device's rows (static;
        `ktx.optim.device_slots.device_slots` of the counts). With `check_layout`, a
        batch with more is an error raised from the step.
      scatter_dims: `method="devices"`: per parameter leaf, the dimension its per-task
        gradients are split over `data` along (None: kept whole); default: the largest
        dimension divisible by the `data` axis.
      split: `method="devices"`, `slots=1`: per parameter leaf, whether it is split over
        `data` along its scatter dimension; such parameters enter the per-device region
        as shards and are gathered where used (`ktx.param_gather`). None: all whole.
      layouts: `method="devices"`: per parameter leaf, its mesh axes other than `data`
        (its `PartitionSpec` without `data`, one entry per dimension), kept by a gathered
        parameter, its gradients and their exchange (None: XLA's partitioner makes those
        collectives' operands whole over `model`).
      shared: which parameters keep a task axis (see `ktx.optim.selection.shared_mask`).
      sparse_tables: regexes selecting `nn.Embed` tables (e.g. `r"_embedding/embedding$"`)
        whose per-task gradients are kept as `SparseRows` (see `ktx.optim.sparse`);
        None: every table is differentiated densely.
      dtype: the dtype of the dense per-task gradients (`TaskGradients.stacked`), e.g.
        `jnp.bfloat16` to hold them in half the memory; None: the parameters'. With
        `method="devices"` they are made in it (a parameter split over `data` gets its
        per-task gradient shards in it from the gather's backward pass); the other
        methods round theirs to it.

    Returns:
      `(task_losses [T], aux, task_grads)`: `task_losses = sums / normalizer`, aux the
      `[T]` sums of the whole batch, `task_grads` a `TaskGradients`.
    """
    if not isinstance(num_tasks, int) or num_tasks < 1:
        raise ValueError(f"num_tasks={num_tasks!r}: expected a positive int")
    if method not in METHODS:
        raise ValueError(f"method={method!r}; accepted: {METHODS}")
    if task_counts is not None and task_capacity is not None:
        raise ValueError("give task_counts (exact, static) or task_capacity (block sizes), not both")
    auto = method == "auto"
    if auto:
        method = "blocks" if (task_counts is not None or task_capacity is not None) else "vjp"
    normalizer = jax.lax.stop_gradient(jnp.asarray(normalizer))
    if normalizer.shape != (num_tasks,):
        raise ValueError(f"normalizer has shape {normalizer.shape}; expected ({num_tasks},)")
    if method == "devices":
        from ktx.optim.device_slots import per_device_task_gradients

        if not isinstance(slots, int) or isinstance(slots, bool) or not 1 <= slots <= num_tasks:
            raise ValueError(f"method='devices' needs slots in [1, {num_tasks}] (the most tasks "
                             f"among any device's rows); got {slots!r}")
        if "task_id" not in batch:
            raise ValueError("method='devices' needs the batch's task_id")
        if check_layout:
            _check_slots(batch["task_id"], slots)
        sums, aux, grads = per_device_task_gradients(
            loss_sums_fn, normalizer, params, batch, num_tasks=num_tasks, slots=slots,
            scatter_dims=scatter_dims, split=split, layouts=layouts, dtype=dtype)
        return sums / normalizer, aux, split_shared(grads, params, shared)
    if method in ("blocks", "taps"):
        if task_counts is None and task_capacity is None:
            raise ValueError(
                f"method={method!r} needs task_counts or task_capacity (a task-partitioned "
                "batch); use method='vjp' or 'auto' for sampled batches"
            )
        if task_counts is not None:
            sizes = _validate_counts(task_counts, num_tasks, batch, check_layout)
            starts = np.cumsum((0,) + sizes[:-1])
        else:
            sizes = _validate_capacity(task_capacity, num_tasks, batch)
            _, starts = _dynamic_counts(batch["task_id"], sizes, check_layout)
        n = next(iter(batch.values())).shape[0]
        if method == "taps" and sum(sizes) != n:
            raise ValueError(
                f"method='taps' needs static rows per task: task_counts, or a task_capacity "
                f"that fills the batch (capacity {sizes} sums to {sum(sizes)}, the batch has "
                f"{n} rows); use method='blocks' or 'auto' (StepOptions.grad_method; gin: "
                "train_script.train.grad_method)")
        if method == "taps" or (auto and sum(sizes) == n and _data_ways() == 1):
            # Static counts (capacities that fill the batch are the counts).
            plan = tapped.plan(loss_sums_fn, params, batch, sizes, shared, sparse_tables)
            if plan.missing and not auto:
                raise ValueError(
                    f"method='taps': the balanced parameters {plan.missing[:5]} "
                    f"({len(plan.missing)} in all) are not read through a task tap "
                    "(ktx.task_taps); use method='blocks' or 'auto' (StepOptions.grad_method; "
                    "gin: train_script.train.grad_method), or balance fewer parameters "
                    "(shared=)")
            if not plan.missing:
                sums, aux, task_grads = tapped.task_gradients(
                    loss_sums_fn, normalizer, params, batch, num_tasks, sizes, plan,
                    sparse_tables)
                if dtype is not None:
                    task_grads = TaskGradients(stacked=_in_dtype(task_grads.stacked, dtype),
                                               summed=task_grads.summed)
                return sums / normalizer, aux, task_grads
        if sparse_tables:
            sl = SparseLookups(loss_sums_fn, params, sparse_tables)
            sums, aux, grads = _sparse_blocks(
                sl, loss_sums_fn, normalizer, params, batch, num_tasks, sizes, starts)
        else:
            sums, aux, grads = _blocks(
                loss_sums_fn, normalizer, params, batch, num_tasks, sizes, starts)
    elif sparse_tables:
        sl = SparseLookups(loss_sums_fn, params, sparse_tables)
        sums, aux, grads = _sparse_vjp(sl, loss_sums_fn, normalizer, params, batch, num_tasks)
    else:
        sums, aux, grads = _vjp(loss_sums_fn, normalizer, params, batch, num_tasks)
    if dtype is not None:
        grads = _in_dtype(grads, dtype)
    return sums / normalizer, aux, split_shared(grads, params, shared)


def loss_weighted_gradient(
    loss_sums_fn: LossSumsFn,
    normalizer: jax.Array,
    params: Any,
    batch: Mapping[str, jax.Array],
    weights_fn: Callable[[jax.Array], tuple[jax.Array, Any]],
    *,
    num_tasks: int,
    shared: Sequence[str] | str | None = None,
    sparse_tables: Sequence[str] | None = None,
) -> tuple[jax.Array, dict[str, jax.Array], Any, Any]:
    """The update of a balancer whose weights depend on the losses only (a
    `ktx.optim.LossWeighting`), without per-task gradients (call inside `jax.jit`).

    One forward pass gives the `[T]` losses, `weights_fn(losses) -> (w, out)` the weights
    (e.g. `lambda l: tx.weights(state, l, present)`), and two vector-Jacobian products of
    the same forward pass the gradient: cotangent `w / normalizer` for the shared
    parameters, `1 / normalizer` for the unshared ones (skipped when every parameter is
    shared; XLA drops each product's unused half). Any batch layout works. With
    `sparse_tables` (as in `compute_task_gradients`) the selected tables are held constant
    and their gradient is the looked-up rows' gradients scattered into the table once.

    Returns:
      `(task_losses [T], aux, grad, out)` with `grad` params-shaped and equal to
      `combine_with_weights(task_grads, w)` on what `compute_task_gradients` returns for
      the same arguments and `shared`.
    """
    if not isinstance(num_tasks, int) or num_tasks < 1:
        raise ValueError(f"num_tasks={num_tasks!r}: expected a positive int")
    normalizer = jax.lax.stop_gradient(jnp.asarray(normalizer))
    if normalizer.shape != (num_tasks,):
        raise ValueError(f"normalizer has shape {normalizer.shape}; expected ({num_tasks},)")
    if sparse_tables:
        sl = SparseLookups(loss_sums_fn, params, sparse_tables)
        sums, vjp_fn, aux, indices = _sparse_forward(sl, params, batch)
    else:
        sums, vjp_fn, aux = jax.vjp(lambda p: loss_sums_fn(p, batch), params, has_aux=True)
    if sums.shape != (num_tasks,):
        raise ValueError(
            f"loss_sums_fn returned sums of shape {sums.shape}; expected ({num_tasks},)")
    inverse = 1.0 / normalizer.astype(sums.dtype)
    losses = sums * inverse
    w, out = weights_fn(jax.lax.stop_gradient(losses))
    w = jax.lax.stop_gradient(jnp.asarray(w, sums.dtype))
    if w.shape != (num_tasks,):
        raise ValueError(f"weights_fn returned weights of shape {w.shape}; expected ({num_tasks},)")
    def gradient(cotangent):
        g = vjp_fn(cotangent)
        return _scatter_rows(sl, g, indices) if sparse_tables else g[0]

    mask = shared_mask(params, shared)
    weighted = gradient(w * inverse)
    if all(jax.tree.leaves(mask)):
        return losses, aux, weighted, out
    summed = gradient(inverse)
    grad = jax.tree.map(lambda m, a, b: a if m else b, mask, weighted, summed)
    return losses, aux, grad, out


def _scatter_rows(sl: SparseLookups, grads: tuple, indices: list) -> Any:
    """A params-shaped gradient from `(dense leaf grads, row grads per lookup)`: each
    table's looked-up rows scattered (added) into a zero table."""
    dense, rows = grads
    tables = {}
    for name, g, idx in zip(sl.call_names, rows, indices):
        leaf = sl.leaves[sl.names.index(name)]
        base = tables.get(name, jnp.zeros(leaf.shape, leaf.dtype))
        tables[name] = base.at[idx.reshape(-1)].add(g.reshape(-1, g.shape[-1]).astype(leaf.dtype))
    it = iter(dense)
    out = []
    for i, leaf in enumerate(sl.leaves):
        if i in sl.table_ids:
            out.append(tables.get(sl.names[i], jnp.zeros(leaf.shape, leaf.dtype)))
        else:
            out.append(next(it))
    return sl.treedef.unflatten(out)
