"""The train step of every ktx model (`ktx.training.trainer.Trainer` partitions and compiles it).

`train_step(state, batch, rng, *, model, optimizer, options) -> (state, metrics)` is a
pure function (T5X style): the dropout key is `fold_in(rng, state.step)`, so a run
restarted from a checkpoint at step s draws exactly the keys it would have drawn; the
rows of the batch are numbered (`ROW_ID`) before any split, and models key dropout per
row, so the plain, blocked, one-hot VJP and microbatched paths compute the same gradient.

It is the only training step in ktx (T5, encoders, recommendation): its variants are
options, not copies.

* plain (`optimizer.balanced` false): `jax.grad` of the model's normalized loss, then the
  optimizer;
* balanced (a `ktx.optim` balancer in the `TaskOptimizer`):
  `ktx.optim.compute_task_gradients` builds per-task gradients (task blocks, one-hot VJP,
  sparse embedding-table rows) and the balancer combines them before the optimizer; a
  process-grouped batch (a sharded input's, `StepOptions.regroup_by_task`) is sorted by
  task in the step first, for the task blocks; a balancer whose weights depend on the
  losses only (`ktx.optim.LossWeighting`) skips the per-task gradients: one backward pass
  of the weighted loss (`ktx.optim.loss_weighted_gradient`) gives its update;
* microbatched (`StepOptions.num_microbatches = M`): the batch `[B, ...]` is cut into M
  slices `[B / M, ...]` accumulated by one `lax.scan` (`accumulate`); each slice's loss
  sums are divided by the normalizer of the *whole* batch, so the accumulated gradient
  equals the full-batch gradient;
* multi-step (`train_steps`): K consecutive steps in one call (a `lax.scan` over a
  `[K, B, ...]` block of batches), so the host neither dispatches nor syncs per step.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from ktx.models.base import BaseModel, with_row_ids
from ktx.optim.task_gradients import sq_norms
from ktx.training.optimizers import TaskOptimizer

__all__ = [
    "TrainState",
    "StepOptions",
    "train_step",
    "train_steps",
    "eval_step",
    "accumulate",
    "split_microbatches",
    "group_rows_by_task",
    "check_process_grouped",
    "per_step_counts",
    "rows_per_task",
]


@struct.dataclass
class TrainState:
    """`step` (int32 scalar), `params` (the model's "params" collection), `opt_state`
    (`TaskOptimizer.init`'s layout), `model_state` (what the model carries from step to
    step, `BaseModel.init_model_state(params)`: e.g. SMART's momentum teacher; None for
    a model without one, so its state, compiled step and checkpoints are as before).

    `model_state` is read by the loss on every gradient path without receiving a
    gradient, and replaced by `model.update_model_state(model_state, new_params, step)`
    after the optimizer step."""

    step: jax.Array
    params: Any
    opt_state: Any
    model_state: Any = None


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """Static options of the compiled train step (each distinct value compiles once).

    Attributes:
      num_microbatches: gradient accumulation factor M (divides the batch).
      grad_method: balanced path: "auto" | "taps" | "blocks" | "vjp" | "devices"
        (`compute_task_gradients`; "auto" takes the taps on one device where the model
        has them). The `Trainer` turns "auto" into "devices" on a mesh
        whose `data` axis has several devices and no parameter split over it
        (task-partitioned batches, one microbatch): each device differentiates its own
        rows, and no task block is padded to the `data` axis (`ktx.optim.device_slots`).
      shared: balanced path: regexes of balanced parameters (None: the engine's default).
      sparse_tables: balanced path: regexes of embedding tables whose per-task gradients
        stay sparse (looked-up rows only, `ktx.optim.sparse`). Needs M = 1. None (the
        default): the model's `sparse_table_patterns` (T5's untied token embedding, the
        recommendation tables) where M = 1 and rows are not uncertainty-selected; `()`:
        none.
      task_capacity: balanced path: static rows per task block (the most each task has
        had); the counts themselves are read from `task_id` in the step.
      device_slots: balanced path, `grad_method="devices"`: the most tasks among any
        device's rows (static; the `Trainer` tracks the most seen, as for blocks).
      scatter_dims: with `device_slots`: per parameter leaf, the dimension its per-task
        gradients are split over `data` along (None: whole); the `Trainer` takes the
        dimension the parameter is split over `data` along, else the largest one the
        axis divides that is not split over `model`.
      split_params: with `device_slots == 1`: per parameter leaf, whether the parameter
        is split over `data` along its scatter dimension (`parameter_partitioning_dims=2`):
        it enters the per-device region as a shard and is gathered where used, a scanned
        stack's layer at a time (`ktx.param_gather`). None: every parameter enters whole.
      param_layouts: with `device_slots`: per parameter leaf, its mesh axes other than
        `data`, one entry per dimension (its `PartitionSpec` without `data`), which a
        gathered parameter, its gradients and their exchange keep inside the per-device
        region; the `Trainer` reads them from the parameters' shardings. None: XLA's
        partitioner makes those collectives' operands whole over `model`.
      task_grad_dtype: balanced path: "bfloat16" holds the per-task gradients in bfloat16,
        half the memory of float32 parameters' (device by device they are made in it,
        `compute_task_gradients(dtype=)`); the balancer reads them as float32. None: the
        parameters' dtype.
      check_layout: balanced path: check in the step that the rows are grouped by task as
        the blocks promise (False when the host already checked, `Trainer.global_batch`).
      regroup_by_task: the global batch is process-grouped (`[p0: t0 t1 ..][p1: t0 t1 ..]
        ..`: each process's rows grouped by task, `ktx.data.process_layout`; a sharded
        `MultiTaskInput`'s `process_grouped`), not grouped by task: the task-block path
        sorts the rows by `task_id` in the step (a stable argsort and a gather of every
        feature, after the rows are numbered, so dropout follows the rows) and
        `Trainer.global_batch` checks each process's rows against its shares instead of
        its slice of the blocks. Not needed elsewhere (the plain path's loss and the VJP
        path's per-task sums are sums over rows), so not done there.
      diagnostics_period: balanced path: per-task gradient diagnostics on the steps where
        `(step + 1) % diagnostics_period == 0` (0: never).
      log_diagnostics: whether this compiled step logs them: None (the default) decides
        in the step, a `lax.cond` on the step number; True / False: the caller knows (the
        `Trainer` mirrors the step on the host and compiles both), so the step holds no
        cond. A cond costs its steps: on XLA:CPU a recommendation step with MetaBalance
        took 1.14x the plain step with the diagnostics in a cond, 0.95x without.
      target_task: the task the diagnostics' cosines are taken against.
      norm_metrics: also report `grad_norm`, `update_norm` and `param_norm`. Off by
        default, as T5X's weight metrics are (`weight_metrics_computer=None`): they read
        the gradient, the update and the new parameters again every step (at
        T5.1.1-Small on XLA:CPU 2.2 GB of the step's 12.7, `docs/performance.md`).
      uncertainty_rows: MT-uncertainty sampling (`ktx.training.mt_uncertainty`): the
        batch holds candidates, the step trains on the `uncertainty_rows` rows its
        current parameters are least certain of (0: off, train on every row). The
        balanced path then uses the VJP engine (the selected rows are not task blocks).
      uncertainty_proxies: `(regression task, classification task)` index pairs: a
        regression task's rows borrow the classification task's entropies.
      weights_from_losses: balanced path: a balancer whose weights depend on the losses
        only (`ktx.optim.LossWeighting`: Single-Loss, Vanilla-Multi, fixed weights,
        Uncertainty, DWA) gets its combined gradient from one backward pass of the
        weighted loss (`ktx.optim.loss_weighted_gradient`), the same update as from
        per-task gradients at a plain step's cost (per-task gradients are then built on
        the diagnostics' steps only). Needs M = 1; False: per-task gradients every step.
    """

    num_microbatches: int = 1
    grad_method: str = "auto"
    shared: tuple[str, ...] | None = None
    sparse_tables: tuple[str, ...] | None = None
    task_capacity: tuple[int, ...] | None = None
    device_slots: int | None = None
    scatter_dims: tuple[int | None, ...] | None = None
    split_params: tuple[bool, ...] | None = None
    param_layouts: tuple[tuple | None, ...] | None = None
    task_grad_dtype: str | None = None
    check_layout: bool = True
    regroup_by_task: bool = False
    diagnostics_period: int = 1
    log_diagnostics: bool | None = None
    target_task: int = 0
    norm_metrics: bool = False
    uncertainty_rows: int = 0
    uncertainty_proxies: tuple[tuple[int, int], ...] | None = None
    weights_from_losses: bool = True

    def __post_init__(self):
        m = self.num_microbatches
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"num_microbatches={m!r}; accepted: an integer >= 1")
        if self.grad_method not in ("auto", "taps", "blocks", "vjp", "devices"):
            raise ValueError(f"grad_method={self.grad_method!r}; accepted: 'auto', 'taps', "
                             "'blocks', 'vjp', 'devices'")
        if self.task_grad_dtype not in (None, "bfloat16", "float32"):
            raise ValueError(f"task_grad_dtype={self.task_grad_dtype!r}; accepted: None (the "
                             "parameters' dtype), 'bfloat16' or 'float32'")
        d = self.diagnostics_period
        if isinstance(d, bool) or not isinstance(d, int) or d < 0:
            raise ValueError(f"diagnostics_period={d!r}; accepted: an int >= 0 (0: never)")
        for name in ("shared", "sparse_tables", "task_capacity"):
            value = getattr(self, name)
            if isinstance(value, str):
                value = (value,)
            if name == "sparse_tables" and value is not None:
                object.__setattr__(self, name, tuple(value))  # () (none) is not None (default)
                continue
            object.__setattr__(self, name, tuple(value) if value else None)
        if not isinstance(self.weights_from_losses, (bool, np.bool_)):
            raise TypeError(f"weights_from_losses={self.weights_from_losses!r}; accepted: "
                            "True or False")
        if self.log_diagnostics is not None and not isinstance(self.log_diagnostics,
                                                               (bool, np.bool_)):
            raise TypeError(f"log_diagnostics={self.log_diagnostics!r}; accepted: None, True "
                            "or False")
        if not isinstance(self.regroup_by_task, (bool, np.bool_)):
            raise TypeError(f"regroup_by_task={self.regroup_by_task!r}; accepted: True or False")
        u = self.uncertainty_rows
        if isinstance(u, bool) or not isinstance(u, int) or u < 0:
            raise ValueError(f"uncertainty_rows={u!r}; accepted: an int >= 0 (0: off)")
        if u and self.grad_method in ("taps", "blocks", "devices"):
            raise ValueError("grad_method='blocks' with MT-uncertainty sampling "
                             f"(uncertainty_rows={u}): the selected rows are not task blocks; "
                             "accepted: 'auto' or 'vjp'")
        if u and self.sparse_tables:
            raise ValueError("sparse_tables with MT-uncertainty sampling: sparse per-task rows "
                             "need task blocks; accepted: one of the two")
        pairs = tuple((int(a), int(b)) for a, b in (self.uncertainty_proxies or ()))
        object.__setattr__(self, "uncertainty_proxies", pairs or None)
        if self.sparse_tables and m > 1:
            raise ValueError(
                f"sparse_tables={self.sparse_tables!r} needs num_microbatches=1 (got {m}): "
                "sparse per-task rows are not accumulated over microbatches")


def split_microbatches(batch: Mapping[str, jax.Array], num_microbatches: int) -> dict:
    """`[B, ...]` -> `[M, B / M, ...]` for every feature."""
    out = {}
    for k, v in batch.items():
        if v.shape[0] % num_microbatches:
            raise ValueError(
                f"num_microbatches={num_microbatches} must divide the batch size; feature "
                f"{k!r} has {v.shape[0]} rows"
            )
        out[k] = v.reshape((num_microbatches, v.shape[0] // num_microbatches) + v.shape[1:])
    return out


def _zeros_like_tree(shapes: Any) -> Any:
    """Zeros of every `ShapeDtypeStruct` in `shapes` (a `jax.eval_shape` result)."""
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)


def accumulate(fn: Callable[[Mapping[str, jax.Array]], Any], batch: Mapping[str, jax.Array],
               num_microbatches: int) -> Any:
    """`fn(batch)` for M = 1, else the sum of `fn` over the M microbatches (a `lax.scan`
    with a zero-initialised carry of `fn`'s output structure)."""
    if num_microbatches == 1:
        return fn(batch)
    mbs = split_microbatches(batch, num_microbatches)
    shapes = jax.eval_shape(fn, jax.tree.map(lambda x: x[0], mbs))
    init = _zeros_like_tree(shapes)

    def body(carry, mb):
        return jax.tree.map(jnp.add, carry, fn(mb)), None

    return jax.lax.scan(body, init, mbs)[0]


def rows_per_task(batch: Mapping[str, jax.Array], num_tasks: int) -> jax.Array:
    """`[T]` float32: rows of each task in the batch (padding rows included)."""
    task_id = batch["task_id"]
    return jax.ops.segment_sum(jnp.ones(task_id.shape, jnp.float32), task_id, num_tasks)


def _task_blocks(options: StepOptions) -> bool:
    """Whether the balanced path may use task blocks: microbatches cut across them, and
    uncertainty-selected rows are in score order, so both take the one-hot VJP engine."""
    return options.num_microbatches == 1 and not options.uncertainty_rows


def _weights_from_losses(optimizer: TaskOptimizer, options: StepOptions) -> bool:
    """Whether the balanced step takes the loss-weighted shortcut
    (`ktx.optim.loss_weighted_gradient`): a `LossWeighting` balancer, the option on, one
    microbatch (the weights need the whole batch's losses before any backward pass)."""
    return (optimizer.weights_from_losses and options.weights_from_losses
            and options.num_microbatches == 1)


def group_rows_by_task(batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """`batch` with its rows in task order, rows of one task in their given order (a stable
    argsort of `task_id`, then a gather of every feature, `ROW_ID` included)."""
    order = jnp.argsort(batch["task_id"], stable=True)
    return {k: jnp.take(v, order, axis=0) for k, v in batch.items()}


def check_process_grouped(task_id: Any, counts: Sequence[int], process_index: int = 0,
                          process_count: int = 1) -> None:
    """Host-side check of one process's rows of a process-grouped global batch
    (`StepOptions.regroup_by_task`): its `task_id` (numpy, `[B / process_count]`) must be
    grouped by task in task order, with `floor` or `ceil` of `counts[t] / process_count`
    rows of task `t` (its share, `ktx.data.process_layout.process_shares`; `counts`
    global). ValueError naming the first wrong row or task otherwise."""
    counts = np.asarray([int(c) for c in counts], np.int64)
    got = np.asarray(task_id)
    n, p = got.shape[0], int(process_count)
    if counts.sum() != n * p:
        raise ValueError(f"task_counts={tuple(counts.tolist())} sum to {int(counts.sum())} but the "
                         f"global batch has {n * p} rows ({n} on each of {p} processes)")
    outside = np.flatnonzero((got < 0) | (got >= counts.size))
    if outside.size:
        raise ValueError(f"process {process_index}'s row {int(outside[0])} has task_id "
                         f"{int(got[outside[0]])}; accepted: 0..{counts.size - 1}")
    unsorted = np.flatnonzero(got[1:] < got[:-1])
    if unsorted.size:
        i = int(unsorted[0]) + 1
        raise ValueError(
            f"regroup_by_task: process {process_index}'s rows must be grouped by task in task "
            f"order, but its row {i} has task_id {int(got[i])} after task {int(got[i - 1])}")
    local = np.bincount(got, minlength=counts.size)
    low, high = counts // p, -(-counts // p)
    wrong = np.flatnonzero((local < low) | (local > high))
    if wrong.size:
        t = int(wrong[0])
        raise ValueError(
            f"regroup_by_task: process {process_index} of {p} has {int(local[t])} rows of task "
            f"{t}; its share of the global {int(counts[t])} is {int(low[t])} or {int(high[t])}")


def _param_norm(new_params: Any) -> jax.Array:
    """`optax.tree.norm(new_params)`; on GPUs behind an optimization barrier, the small
    leaves in one chunked reduction on one device (`ktx.optim.task_gradients.sq_norms`;
    leaf by leaf on a mesh of several, which would reshard them). Fused into
    the parameters' update, the reduction turned each update fusion into a reduction
    whose outputs (the new parameter and the optimizer's moments) XLA:GPU copied into the
    donated state buffers, two copies per parameter; apart, it was one reduction per
    parameter, hence the batching. The plain step's kernels went from 136 to 121 on the
    recommendation model and from 610 to 530 on T5-tiny (`tests/benchmarks/gpu_launches.py`).
    On other platforms the fused form is kept."""

    def apart(*leaves):
        sq = sq_norms([x[None] for x in jax.lax.optimization_barrier(list(leaves))])
        return jnp.sqrt(sum(x[0] for x in sq))

    leaves = jax.tree.leaves(new_params)
    return jax.lax.platform_dependent(*leaves, cuda=apart, rocm=apart,
                                      default=lambda *x: optax.tree.norm(list(x)))


def train_step(
    state: TrainState,
    batch: Mapping[str, jax.Array],
    rng: jax.Array,
    *,
    model: BaseModel,
    optimizer: TaskOptimizer,
    options: StepOptions = StepOptions(),
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step on a global batch.

    Returns the new state and metrics: `loss` (scalar, the training objective),
    `task_losses` `[T]` (normalized, summing to `loss`), `aux` (dict of `[T]` sums from
    the model, e.g. `loss`, `accuracy`, `weight`), `examples` `[T]` (rows per task),
    `learning_rate` (only when the optimizer has a schedule), and with
    `options.norm_metrics` `grad_norm` (of the gradient the optimizer saw: the balanced
    one on the balanced path), `update_norm`, `param_norm`.
    `diagnostics` holds `ktx.optim.diagnostics(task_grads, balancer_state,
    target_task=..., packed=True)` (per-group gradient norms, cosines to the target,
    MetaBalance weights: a `PackedScalars` mapping, one array) on the balanced path's
    logged steps; on its other steps zeros in a step compiled with the diagnostics'
    `lax.cond` (`options.log_diagnostics` None: every step of a scanned block has one
    structure) and `{}` in a step compiled not to log (`diagnostics_logged` says which
    steps logged); `{}` on the plain path.
    """
    num_tasks = model.num_tasks
    step_rng = jax.random.fold_in(rng, state.step)
    params = state.params
    # The model's carried state (SMART's teacher) is closed over by every loss below: a
    # constant of the differentiated functions, so no gradient reaches it.
    model_state = state.model_state
    if options.uncertainty_rows:
        from ktx.training.mt_uncertainty import select_uncertain_rows

        batch, _ = select_uncertain_rows(model, params, batch, options.uncertainty_rows,
                                         options.uncertainty_proxies or ())
    # Rows are numbered before the batch is cut into task blocks or microbatches: dropout
    # is keyed per row (ktx.models.base.row_keys), so every path draws the same masks.
    batch = with_row_ids(batch)
    normalizer = model.normalizer(batch)
    present = rows_per_task(batch, num_tasks)
    diagnostics, logged = {}, jnp.zeros((), bool)

    if optimizer.balanced:
        from ktx import optim  # the balancing engine is optional for plain training

        # Microbatches cut across task blocks, and uncertainty-selected rows are in score
        # order, so both use the one-hot VJP engine.
        blocked = _task_blocks(options)

        def loss_sums_of(m):
            def loss_sums(p, b):
                return m.loss_sums_with_state(p, model_state, b, step_rng, True)
            return loss_sums

        loss_sums = loss_sums_of(model)

        def per_task_gradients():
            rows = batch
            if options.regroup_by_task and blocked:
                rows = group_rows_by_task(rows)  # process-grouped -> the blocks' task order

            def task_grads(mb):
                if blocked and options.device_slots:
                    # A device's rows hold at most `device_slots` tasks: the model's
                    # per-task quantities (hyper-prompts) for those only.
                    device_loss_sums = loss_sums_of(model.for_batch_tasks(options.device_slots))
                    return optim.compute_task_gradients(
                        device_loss_sums, normalizer, params, mb, num_tasks=num_tasks,
                        shared=options.shared, method="devices", slots=options.device_slots,
                        scatter_dims=options.scatter_dims, split=options.split_params,
                        layouts=options.param_layouts,
                        check_layout=options.check_layout, dtype=options.task_grad_dtype)
                return optim.compute_task_gradients(
                    loss_sums, normalizer, params, mb,
                    num_tasks=num_tasks, shared=options.shared,
                    sparse_tables=options.sparse_tables,
                    method=options.grad_method if blocked else "vjp",
                    task_capacity=options.task_capacity if blocked else None,
                    check_layout=options.check_layout, dtype=options.task_grad_dtype,
                )

            losses, aux, per_task = accumulate(task_grads, rows, options.num_microbatches)
            if options.task_grad_dtype is not None:  # the balancer computes in float32
                per_task = jax.tree.map(
                    lambda g: g.astype(jnp.float32) if jnp.issubdtype(g.dtype, jnp.floating)
                    else g, per_task)
            return losses, aux, per_task

        balancer_state = state.opt_state[0]
        # `static`: whether this step logs the diagnostics, when known at compile time
        # (None: a `lax.cond` on `logged` decides).
        static = options.log_diagnostics if options.diagnostics_period else False
        if static is None:
            logged = (state.step + 1) % options.diagnostics_period == 0
        elif static:
            logged = jnp.ones((), bool)

        def per_task_step():
            """Per-task gradients and the balancer's update of them."""
            task_losses, aux, per_task = per_task_gradients()
            grads, new_balancer_state = optimizer.balancer.update(
                per_task, balancer_state, params, task_losses=task_losses,
                task_present=present > 0)
            return task_losses, aux, grads, new_balancer_state, per_task

        def diagnostics_of(per_task, new_balancer_state):
            return optim.diagnostics(per_task, new_balancer_state, target_task=options.target_task,
                                     packed=True)

        if _weights_from_losses(optimizer, options):
            # Weights known from the losses: one backward pass of the weighted loss; the
            # per-task path on the diagnostics' steps. Both branches of the cond compute
            # the gradient: a cond reading the (donated) parameters beside the gradient
            # would make XLA copy them every step.
            def logged_step():
                *out, per_task = per_task_step()
                return (*out, diagnostics_of(per_task, out[3]))

            def shortcut_step():
                def weights(losses):
                    return optimizer.balancer.weights(balancer_state, losses, present > 0)

                out = optim.loss_weighted_gradient(
                    loss_sums, normalizer, params, batch, weights, num_tasks=num_tasks,
                    shared=options.shared, sparse_tables=options.sparse_tables)
                # zeros only where a cond needs both branches alike: a step compiled
                # not to log returns none (hundreds of scalar outputs otherwise, each a
                # buffer the step writes and the host allocates, every step)
                no_diagnostics = (_zeros_like_tree(jax.eval_shape(logged_step)[4])
                                  if static is None else {})
                return (*out, no_diagnostics)

            if static is None:
                step_out = jax.lax.cond(logged, logged_step, shortcut_step)
            else:
                step_out = logged_step() if static else shortcut_step()
            task_losses, aux, grads, balancer_state, diagnostics = step_out
        else:
            task_losses, aux, grads, balancer_state, per_task = per_task_step()
            if static:
                diagnostics = diagnostics_of(per_task, balancer_state)
            elif static is None:
                zeros = _zeros_like_tree(jax.eval_shape(diagnostics_of, per_task, balancer_state))
                diagnostics = jax.lax.cond(
                    logged, lambda: diagnostics_of(per_task, balancer_state), lambda: zeros)
        grads, updates, opt_state = optimizer.apply_balanced(
            grads, balancer_state, state.opt_state, params)
    else:
        def loss(p, mb):
            losses, aux = model.task_losses(p, mb, step_rng, True, normalizer=normalizer,
                                            model_state=model_state)
            return losses.sum(), (losses, aux)

        grads, (task_losses, aux) = accumulate(
            functools.partial(jax.grad(loss, has_aux=True), params), batch,
            options.num_microbatches)
        grads, updates, opt_state = optimizer.update(grads, state.opt_state, params)

    new_params = optax.apply_updates(params, updates)
    metrics = {
        "diagnostics": diagnostics,
        "diagnostics_logged": logged,
        "loss": task_losses.sum(),
        "task_losses": task_losses,
        "aux": aux,
        "examples": present,
    }
    if optimizer.schedule is not None:
        # Without a schedule the rate lives inside the optax optimizer, out of reach:
        # logging none beats logging a made-up one.
        metrics["learning_rate"] = optimizer.learning_rate(state.step)
    if options.norm_metrics:
        metrics["grad_norm"] = optax.tree.norm(grads)
        metrics["update_norm"] = optax.tree.norm(updates)
        metrics["param_norm"] = _param_norm(new_params)
    new_state = state.replace(
        step=state.step + 1, params=new_params, opt_state=opt_state,
        model_state=model.update_model_state(model_state, new_params, state.step))
    return new_state, metrics


def per_step_counts(task_counts: Any, steps: int | None = None) -> list[tuple[int, ...]]:
    """`task_counts` as one count tuple per batch: a sequence of tuples stays as it is
    (`steps` of them when given), a single tuple is repeated `steps` times (once without
    `steps`)."""
    first = task_counts[0] if len(task_counts) else None
    if isinstance(first, (Sequence, np.ndarray)) and not isinstance(first, (str, bytes)):
        out = [tuple(int(c) for c in counts) for counts in task_counts]
        if steps is not None and len(out) != steps:
            raise ValueError(f"task_counts has {len(out)} count tuples for {steps} batches; "
                             "give one per batch of the [K, B, ...] block, or one for all")
        return out
    return [tuple(int(c) for c in task_counts)] * (1 if steps is None else steps)


def train_steps(
    state: TrainState, batches: Mapping[str, jax.Array], rng: jax.Array, **step_kwargs: Any
) -> tuple[TrainState, dict[str, jax.Array]]:
    """`K` consecutive `train_step`s in one call: `batches` holds every feature stacked
    `[K, B, ...]` (step `state.step + k` in row k); returns the state after K steps and
    the metrics stacked `[K, ...]`, identical to K calls of `train_step`."""

    def body(s, batch):
        return train_step(s, batch, rng, **step_kwargs)

    return jax.lax.scan(body, state, dict(batches))


def eval_step(
    params: Any, batch: Mapping[str, jax.Array], *, model: BaseModel
) -> dict[str, jax.Array]:
    """Teacher-forced evaluation: the model's `[T]` aux sums (no dropout), plus
    `loss_sum` (`[T]` un-normalized loss) and `examples` (`[T]` rows, padding included)."""
    sums, aux = model.loss_sums(params, batch, None, False)
    out = dict(aux)
    out["loss_sum"] = sums
    out["examples"] = rows_per_task(batch, model.num_tasks)
    return out
