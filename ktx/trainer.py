"""Pure train/eval steps and a thin `Trainer` that partitions and compiles them.

`train_step(state, batch, rng) -> (state, metrics)` is a pure function (T5X style):
the dropout key is `fold_in(rng, state.step)`, so a run restarted from a checkpoint at
step s draws exactly the keys it would have drawn; the rows of the batch are numbered
(`ROW_ID`) before any split, and models key dropout per row, so the plain, blocked,
one-hot VJP and microbatched paths compute the same gradient.

Two gradient paths, one compiled step each:

* plain: `jax.value_and_grad` of the model's normalized loss, then `optimizer`;
* balanced (a `ktx.optim` balancer is given): `ktx.optim.compute_task_gradients`
  builds per-task gradients and `optax.chain(balancer, optimizer)` combines them,
  called as `tx.update(task_grads, opt_state, params, task_losses=task_losses)`.

Gradient accumulation splits the batch `[B, ...]` into `num_microbatches` slices of
`[B / M, ...]` (a `lax.scan`); each slice's loss sums are divided by the normalizer of
the *whole* batch, so the accumulated gradient equals the full-batch gradient.

The `Trainer` creates the state already sharded: `jax.eval_shape` of the model init
-> `nn.get_partition_spec` -> `NamedSharding`s on the (data, model) mesh; optimizer
state leaves take the sharding of the parameter whose path they end with (same shape),
other leaves (counters, factored Adafactor moments) are replicated.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ktx import optimizers, partitioning
from ktx.models.base import BaseModel, with_row_ids

__all__ = [
    "TrainState",
    "train_step",
    "eval_step",
    "Trainer",
    "split_microbatches",
    "opt_state_shardings",
]


@struct.dataclass
class TrainState:
    """`step` (int32 scalar), `params` (the model's "params" collection), `opt_state`."""

    step: jax.Array
    params: Any
    opt_state: Any


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


def _rows_per_task(batch: Mapping[str, jax.Array], num_tasks: int) -> jax.Array:
    task_id = batch["task_id"]
    return jax.ops.segment_sum(jnp.ones(task_id.shape, jnp.float32), task_id, num_tasks)


def train_step(
    state: TrainState,
    batch: Mapping[str, jax.Array],
    rng: jax.Array,
    *,
    model: BaseModel,
    tx: optax.GradientTransformation,
    balanced: bool = False,
    num_microbatches: int = 1,
    task_counts: tuple[int, ...] | None = None,
    grad_method: str = "auto",
    shared: Sequence[str] | None = None,
    schedule: Any = None,
    task_capacity: tuple[int, ...] | None = None,
    tx_parts: tuple[Any, Any] | None = None,
    diagnostics_period: int = 1,
    target_task: int = 0,
    host_checked_layout: bool = False,
    sparse_tables: Sequence[str] | None = None,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step on a global batch.

    Returns the new state and metrics: `loss` (scalar, the training objective),
    `task_losses` `[T]` (normalized, summing to `loss`), `aux` (dict of `[T]` sums from
    the model, e.g. `loss`, `accuracy`, `weight`), `examples` `[T]` (rows per task),
    `grad_norm`, `update_norm`, `param_norm`, `learning_rate` (scalars).

    With `balanced=True`, `tx_parts=(balancer, optimizer)` and `tx` is their chain
    (state `(balancer_state, optimizer_state)`); `grad_norm` is the norm of the
    balanced gradient, and `diagnostics` holds `ktx.optim.diagnostics(task_grads,
    balancer_state, target_task=target_task)` (per-group gradient norms, cosines to the
    target, MetaBalance weights) on the steps where `(step + 1) % diagnostics_period == 0`
    (a `lax.cond`: other steps pay nothing; zeros there, and `diagnostics_logged` says
    which), never with `diagnostics_period=0`; it is `{}` on the plain path.
    """
    if balanced and tx_parts is None:
        raise ValueError("balanced=True needs tx_parts=(balancer, optimizer)")
    if sparse_tables and num_microbatches > 1:
        raise ValueError(
            f"sparse_tables={tuple(sparse_tables)!r} needs num_microbatches=1 (got "
            f"{num_microbatches}): sparse per-task rows are not accumulated over microbatches"
        )
    num_tasks = model.num_tasks
    step_rng = jax.random.fold_in(rng, state.step)
    # Rows are numbered before the batch is cut into task blocks or microbatches: dropout
    # is keyed per row (ktx.models.base.row_keys), so every path draws the same masks.
    batch = with_row_ids(batch)
    normalizer = model.normalizer(batch)
    params = state.params

    if balanced:
        from ktx import optim  # the balancing engine is optional for plain training

        def task_grads_fn(mb, key, counts, method, capacity=None):
            def loss_sums_fn(p, b):
                return model.loss_sums(p, b, key, True)

            return optim.compute_task_gradients(
                loss_sums_fn, normalizer, params, mb, num_tasks=num_tasks,
                task_counts=counts, method=method, shared=shared,
                sparse_tables=tuple(sparse_tables) if sparse_tables else None,
                task_capacity=capacity, check_layout=not host_checked_layout,
            )

        if num_microbatches == 1:
            task_losses, aux, task_grads = task_grads_fn(
                batch, step_rng, task_counts, grad_method, task_capacity)
        else:
            # Microbatches cut across task blocks, so they use the one-hot VJP engine.
            mbs = split_microbatches(batch, num_microbatches)
            first = jax.tree.map(lambda x: x[0], mbs)
            shapes = jax.eval_shape(
                lambda: task_grads_fn(first, step_rng, None, "vjp")
            )
            init = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

            def body(carry, xs):
                i, mb = xs
                del i
                out = task_grads_fn(mb, step_rng, None, "vjp")
                return jax.tree.map(jnp.add, carry, out), None

            (task_losses, aux, task_grads), _ = jax.lax.scan(
                body, init, (jnp.arange(num_microbatches), mbs)
            )
        # `tx` is `optax.chain(balancer, optimizer)`: applying its two parts in turn is
        # the same update, and exposes the balanced gradient for `grad_norm`.
        balancer, optimizer = tx_parts
        balancer_state, optimizer_state = state.opt_state
        grads, balancer_state = balancer.update(
            task_grads, balancer_state, params, task_losses=task_losses,
            task_present=_rows_per_task(batch, num_tasks) > 0,
        )
        grad_norm = optax.tree.norm(grads)
        updates, optimizer_state = optimizer.update(grads, optimizer_state, params)
        opt_state = (balancer_state, optimizer_state)
        diagnostics, logged = {}, jnp.zeros((), bool)
        if diagnostics_period:
            def diag():
                return optim.diagnostics(task_grads, balancer_state, target_task=target_task)

            zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(diag))
            logged = (state.step + 1) % diagnostics_period == 0
            diagnostics = jax.lax.cond(logged, diag, lambda: zeros)
    else:
        diagnostics, logged = {}, jnp.zeros((), bool)

        def loss(p, mb, key):
            losses, aux = model.task_losses(p, mb, key, True, normalizer=normalizer)
            return losses.sum(), (losses, aux)

        grad_fn = jax.grad(loss, has_aux=True)
        if num_microbatches == 1:
            grads, (task_losses, aux) = grad_fn(params, batch, step_rng)
        else:
            mbs = split_microbatches(batch, num_microbatches)
            first = jax.tree.map(lambda x: x[0], mbs)
            shapes = jax.eval_shape(grad_fn, params, first, step_rng)
            init = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

            def body(carry, xs):
                i, mb = xs
                del i
                out = grad_fn(params, mb, step_rng)
                return jax.tree.map(jnp.add, carry, out), None

            (grads, (task_losses, aux)), _ = jax.lax.scan(
                body, init, (jnp.arange(num_microbatches), mbs)
            )
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, state.opt_state, params)

    new_params = optax.apply_updates(params, updates)
    metrics = {
        "diagnostics": diagnostics,
        "diagnostics_logged": logged,
        "loss": task_losses.sum(),
        "task_losses": task_losses,
        "aux": aux,
        "examples": _rows_per_task(batch, num_tasks),
        "grad_norm": grad_norm,
        "update_norm": optax.tree.norm(updates),
        "param_norm": optax.tree.norm(new_params),
        "learning_rate": (
            jnp.asarray(schedule(state.step), jnp.float32)
            if schedule is not None
            else jnp.zeros((), jnp.float32)
        ),
    }
    new_state = state.replace(step=state.step + 1, params=new_params, opt_state=opt_state)
    return new_state, metrics


def eval_step(
    params: Any, batch: Mapping[str, jax.Array], *, model: BaseModel
) -> dict[str, jax.Array]:
    """Teacher-forced evaluation: the model's `[T]` aux sums (no dropout), plus
    `loss_sum` (`[T]` un-normalized loss) and `examples` (`[T]` rows, padding included)."""
    sums, aux = model.loss_sums(params, batch, None, False)
    out = dict(aux)
    out["loss_sum"] = sums
    out["examples"] = _rows_per_task(batch, model.num_tasks)
    return out


def _path_key(path) -> tuple[str, ...]:
    names = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                names.append(str(getattr(k, attr)))
                break
        else:
            names.append(str(k))
    return tuple(names)


def opt_state_shardings(
    abstract_opt_state: Any, abstract_params: Any, param_shardings: Any, mesh: Mesh
) -> Any:
    """Shardings for optimizer state: a leaf whose tree path ends with a parameter's
    path and has that parameter's shape takes its sharding; the rest is replicated."""
    by_path = {}
    for (path, leaf), sharding in zip(
        jax.tree_util.tree_flatten_with_path(abstract_params)[0],
        jax.tree.leaves(param_shardings, is_leaf=lambda x: isinstance(x, NamedSharding)),
    ):
        by_path[_path_key(path)] = (tuple(leaf.shape), sharding)
    replicated = NamedSharding(mesh, PartitionSpec())

    def pick(path, leaf):
        key = _path_key(path)
        for start in range(len(key)):
            hit = by_path.get(key[start:])
            if hit is not None and hit[0] == tuple(getattr(leaf, "shape", ())):
                return hit[1]
        return replicated

    return jax.tree_util.tree_map_with_path(pick, abstract_opt_state)


def _zeros_batch(batch: Mapping[str, Any]) -> dict[str, jax.Array]:
    return {k: jnp.zeros(v.shape, v.dtype) for k, v in batch.items()}


class Trainer:
    """Builds the sharded `TrainState` and compiles `train_step`/`eval_step` on a mesh.

    Args:
      model: a `ktx.models.base.BaseModel`.
      optimizer: an optax transformation (see `ktx.optimizers`).
      mesh: a (data, model) mesh from `ktx.partitioning.create_mesh` (default: all
        devices, `num_partitions=1`).
      rules: logical axis rules (default `partitioning.standard_logical_axis_rules()`).
      balancer: an optional `ktx.optim` balancer (GradientTransformationExtraArgs);
        when given, the step computes per-task gradients and uses
        `optax.chain(balancer, optimizer)`.
      schedule: the learning-rate schedule (or a number), only to report `learning_rate`.
      num_microbatches: gradient accumulation factor (divides the global batch).
      grad_method: "auto" | "blocks" | "vjp", passed to `compute_task_gradients`.
      shared: regexes of balanced parameters (None: the engine's default).
      sparse_tables: regexes of `nn.Embed` tables whose per-task gradients stay sparse
        on the balanced path (looked-up rows only; recommendation tables).
      diagnostics_period: balanced path: per-task gradient diagnostics every this many
        steps (the trainer's log period; 0: never).
      target_task: the task the diagnostics' cosines are taken against (the balancer's
        target).
    """

    def __init__(
        self,
        model: BaseModel,
        optimizer: optax.GradientTransformation,
        *,
        mesh: Mesh | None = None,
        rules: Sequence[tuple[str, str | None]] | None = None,
        balancer: Any = None,
        schedule: Any = None,
        num_microbatches: int = 1,
        grad_method: str = "auto",
        shared: Sequence[str] | None = None,
        sparse_tables: Sequence[str] | None = None,
        diagnostics_period: int = 1,
        target_task: int = 0,
    ):
        if not isinstance(model, BaseModel):
            raise TypeError(f"model={model!r} must be a ktx.models.base.BaseModel")
        if not hasattr(optimizer, "init") or not hasattr(optimizer, "update"):
            raise TypeError(f"optimizer={optimizer!r} is not an optax GradientTransformation")
        if not isinstance(num_microbatches, int) or num_microbatches < 1:
            raise ValueError(f"num_microbatches={num_microbatches!r}; accepted: an integer >= 1")
        if isinstance(diagnostics_period, bool) or not isinstance(diagnostics_period, int) \
                or diagnostics_period < 0:
            raise ValueError(f"diagnostics_period={diagnostics_period!r}; accepted: an int >= 0 "
                             "(0: never)")
        if not 0 <= int(target_task) < model.num_tasks:
            raise ValueError(f"target_task={target_task!r}; accepted: 0..{model.num_tasks - 1}")
        if grad_method not in ("auto", "blocks", "vjp"):
            raise ValueError(f"grad_method={grad_method!r}; accepted: 'auto', 'blocks', 'vjp'")
        self.model = model
        self.mesh = mesh if mesh is not None else partitioning.create_mesh(1)
        self.rules = tuple(rules) if rules is not None else partitioning.standard_logical_axis_rules()
        self.balancer = balancer
        # Frozen parameters (the model's `frozen_patterns`) get no update at all: zero
        # updates and no optimizer state, whatever the optimizer adds to the gradient.
        frozen = tuple(getattr(model, "frozen_patterns", ()) or ())
        if frozen:
            optimizer = optimizers.freeze(optimizer, frozen)
        self.optimizer = optimizer
        self.tx = optax.chain(balancer, optimizer) if balancer is not None else optimizer
        self.tx_parts = (balancer, optimizer) if balancer is not None else None
        # A learning rate given as a number (optax accepts one) is reported as constant.
        if schedule is not None and not callable(schedule):
            schedule = optax.constant_schedule(float(schedule))
        self.schedule = schedule
        self.num_microbatches = num_microbatches
        self.grad_method = grad_method
        self.diagnostics_period = diagnostics_period
        self.target_task = int(target_task)
        self.shared = None if shared is None else tuple(shared)
        if isinstance(sparse_tables, str):
            sparse_tables = (sparse_tables,)
        self.sparse_tables = tuple(sparse_tables) if sparse_tables else None
        if self.sparse_tables and num_microbatches > 1:
            raise ValueError(
                f"sparse_tables={self.sparse_tables!r} needs num_microbatches=1 (got "
                f"{num_microbatches})"
            )
        self._compiled: dict[Any, Any] = {}
        self._capacity: tuple[int, ...] | None = None  # per-task block sizes seen so far
        self._eval_compiled = None
        self.state_shardings = None
        self.abstract_state = None

    # -- state --------------------------------------------------------------------------

    def _context(self):
        return _MeshRules(self.mesh, self.rules)

    def _init_fn(self, batch):
        def init(rng):
            variables = self.model.init_variables(rng, _zeros_batch(batch))
            if "params" not in variables:
                raise ValueError(
                    f"model.init_variables returned collections {list(variables)}; "
                    f"a 'params' collection is required"
                )
            params = nn.meta.unbox(variables["params"])
            return TrainState(
                step=jnp.zeros((), jnp.int32), params=params, opt_state=self.init_opt_state(params)
            )

        return init

    def init_opt_state(self, params: Any) -> Any:
        """`tx.init(params)`; balancers read the number of tasks from
        `ktx.optim.num_tasks_scope`."""
        if self.balancer is None:
            return self.tx.init(params)
        from ktx import optim

        with optim.num_tasks_scope(self.model.num_tasks):
            return self.tx.init(params)

    def create_abstract_state(self, batch: Mapping[str, Any]) -> tuple[TrainState, TrainState]:
        """`(abstract_state, shardings)`: ShapeDtypeStructs (with `.sharding` set) and
        NamedShardings of the train state, computed without allocating it."""
        rng = jax.random.key(0)
        with self._context():
            boxed = jax.eval_shape(
                lambda r: self.model.init_variables(r, _zeros_batch(batch)), rng
            )["params"]
            param_shardings = partitioning.logical_to_shardings(
                nn.get_partition_spec(boxed), self.mesh, self.rules
            )
            abstract = jax.eval_shape(self._init_fn(batch), rng)
        opt_sh = opt_state_shardings(abstract.opt_state, abstract.params, param_shardings, self.mesh)
        shardings = TrainState(
            step=partitioning.replicated_sharding(self.mesh),
            params=param_shardings,
            opt_state=opt_sh,
        )
        abstract = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
        )
        self.abstract_state, self.state_shardings = abstract, shardings
        return abstract, shardings

    def init_state(self, rng: jax.Array, batch: Mapping[str, Any]) -> TrainState:
        """A freshly initialized, sharded `TrainState` (`batch` gives feature shapes)."""
        if self.state_shardings is None:
            self.create_abstract_state(batch)
        with self._context():
            return jax.jit(self._init_fn(batch), out_shardings=self.state_shardings)(rng)

    # -- steps --------------------------------------------------------------------------

    def global_batch(
        self, batch: Mapping[str, np.ndarray], task_counts: Sequence[int] | None = None
    ) -> dict[str, jax.Array]:
        """This process's rows -> global arrays split over the `data` mesh axis.

        With `task_counts` (balanced path), this process's `task_id` rows are checked
        against the blocks the counts describe (numpy, before sharding); a batch that is
        not grouped as promised raises here instead of silently mixing tasks' gradients.
        """
        task_id = batch.get("task_id") if task_counts is not None and self.balancer is not None \
            else None
        if isinstance(task_id, jax.Array) and task_id.is_fully_addressable \
                and jax.process_count() == 1:
            task_id = np.asarray(task_id)  # B ints: cheap, and the step needs them anyway
        if isinstance(task_id, np.ndarray):
            from ktx.optim import engine

            engine.check_host_layout(task_id, task_counts, jax.process_index(),
                                     jax.process_count())
        data_size = self.mesh.shape[partitioning.DATA]
        for k, v in batch.items():
            rows = np.shape(v)[0] * jax.process_count()
            if rows % data_size:
                raise ValueError(
                    f"global batch size {rows} (feature {k!r}) must be divisible by the "
                    f"data-parallel size {data_size} (devices / NUM_PARTITIONS)"
                )
        if all(isinstance(v, jax.Array) and not isinstance(v, np.ndarray) and
               getattr(v, "sharding", None) == partitioning.data_sharding(self.mesh)
               for v in batch.values()):
            return dict(batch)
        return partitioning.host_local_to_global(batch, self.mesh)

    def _compiled_train_step(self, task_capacity):
        key = task_capacity
        if key not in self._compiled:
            fn = functools.partial(
                train_step,
                model=self.model,
                tx=self.tx,
                balanced=self.balancer is not None,
                num_microbatches=self.num_microbatches,
                task_capacity=task_capacity,
                diagnostics_period=self.diagnostics_period,
                target_task=self.target_task,
                host_checked_layout=True,
                grad_method=self.grad_method,
                shared=self.shared,
                schedule=self.schedule,
                tx_parts=self.tx_parts,
                sparse_tables=self.sparse_tables,
            )
            data = partitioning.data_sharding(self.mesh)
            rep = partitioning.replicated_sharding(self.mesh)
            self._compiled[key] = jax.jit(
                fn,
                in_shardings=(self.state_shardings, data, rep),
                out_shardings=(self.state_shardings, rep),
                donate_argnums=(0,),
            )
        return self._compiled[key]

    def train_step(
        self,
        state: TrainState,
        batch: Mapping[str, Any],
        rng: jax.Array,
        task_counts: Sequence[int] | None = None,
    ) -> tuple[TrainState, dict[str, jax.Array]]:
        """Runs the compiled step on this process's rows of the global batch.

        `task_counts` (the task-partitioned layout of interface §3) locates the task
        blocks of the balanced path; it is ignored on the plain path. The compiled step
        depends only on the block sizes, the most rows each task has had so far (the
        counts themselves are read from `task_id` inside the step), so a mixture whose
        counts vary by a row or two from step to step compiles a handful of times at the
        start and never again.
        """
        if self.state_shardings is None:
            raise ValueError("Trainer.train_step before init_state/create_abstract_state")
        capacity = None
        if self.balancer is not None and task_counts is not None and self.num_microbatches == 1:
            counts = tuple(int(c) for c in task_counts)
            if self._capacity is None or len(self._capacity) != len(counts):
                self._capacity = counts
            else:
                self._capacity = tuple(max(a, b) for a, b in zip(self._capacity, counts))
            capacity = self._capacity
        global_batch = self.global_batch(batch, task_counts)
        with self._context():
            return self._compiled_train_step(capacity)(state, global_batch, rng)

    def lower_train_step(
        self, state: Any, batch: Mapping[str, Any], rng: Any,
        task_capacity: Sequence[int] | None = None,
    ) -> Any:
        """The train step lowered for `state`, `batch` and `rng` (arrays or
        `ShapeDtypeStruct`s with shardings, e.g. for another platform's devices): call
        `.compile()` on it for XLA's memory and cost analyses (`ktx.precompile`)."""
        if self.state_shardings is None:
            raise ValueError("Trainer.lower_train_step before create_abstract_state")
        capacity = None if task_capacity is None else tuple(int(c) for c in task_capacity)
        with self._context():
            return self._compiled_train_step(capacity).lower(state, batch, rng)

    def eval_step(self, params: Any, batch: Mapping[str, Any]) -> dict[str, jax.Array]:
        """Compiled `eval_step` on this process's rows; returns replicated `[T]` sums."""
        if self.state_shardings is None:
            raise ValueError("Trainer.eval_step before init_state/create_abstract_state")
        if self._eval_compiled is None:
            self._eval_compiled = jax.jit(
                functools.partial(eval_step, model=self.model),
                in_shardings=(self.state_shardings.params, partitioning.data_sharding(self.mesh)),
                out_shardings=partitioning.replicated_sharding(self.mesh),
            )
        global_batch = self.global_batch(batch)
        with self._context():
            return self._eval_compiled(params, global_batch)


class _MeshRules:
    """`with mesh, nn.logical_axis_rules(rules):` as one context manager."""

    def __init__(self, mesh: Mesh, rules):
        self.mesh, self.rules = mesh, rules
        self._rules_cm = None

    def __enter__(self):
        self._mesh_cm = jax.set_mesh(self.mesh)
        self._mesh_cm.__enter__()
        self._rules_cm = nn.logical_axis_rules(self.rules)
        self._rules_cm.__enter__()
        return self

    def __exit__(self, *exc):
        self._rules_cm.__exit__(*exc)
        self._mesh_cm.__exit__(*exc)
        return False
