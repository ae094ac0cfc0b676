"""A thin `Trainer` that partitions and compiles the train step (`ktx.training.step`).

The `Trainer` creates the state already sharded: `jax.eval_shape` of the model init
-> `nn.get_partition_spec` -> `NamedSharding`s on the (data, model) mesh; optimizer
state leaves take the sharding of the parameter whose path they end with (same shape),
other leaves (counters, factored Adafactor moments) are replicated. The model's own
state (`BaseModel.init_model_state`, e.g. SMART's teacher θ̃) is sharded by the same rule.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ktx import treepath
from ktx import partitioning
from ktx.models.base import BaseModel
from ktx.training import hlo_cost
from ktx.training.optimizers import TaskOptimizer
# The step, re-exported: `ktx.training.trainer` has been its home, and callers use both.
from ktx.training.step import (  # noqa: F401
    StepOptions,
    TrainState,
    _param_norm,
    _task_blocks,
    _weights_from_losses,
    accumulate,
    check_process_grouped,
    eval_step,
    group_rows_by_task,
    per_step_counts,
    rows_per_task,
    split_microbatches,
    train_step,
    train_steps,
)

__all__ = [
    "TrainState",
    "StepOptions",
    "train_step",
    "train_steps",
    "eval_step",
    "accumulate",
    "Trainer",
    "split_microbatches",
    "opt_state_shardings",
    "group_rows_by_task",
    "check_process_grouped",
]


def opt_state_shardings(
    abstract_opt_state: Any, abstract_params: Any, param_shardings: Any, mesh: Mesh
) -> Any:
    """Shardings for optimizer state (and the model's carried state): a leaf whose tree
    path ends with a parameter's path and has that parameter's shape takes its sharding;
    the rest is replicated."""
    by_path = {}
    for (path, leaf), sharding in zip(
        jax.tree_util.tree_flatten_with_path(abstract_params)[0],
        jax.tree.leaves(param_shardings, is_leaf=lambda x: isinstance(x, NamedSharding)),
    ):
        by_path[tuple(treepath.name(path).split("/"))] = (tuple(leaf.shape), sharding)
    replicated = NamedSharding(mesh, PartitionSpec())

    def pick(path, leaf):
        key = tuple(treepath.name(path).split("/"))
        for start in range(len(key)):
            hit = by_path.get(key[start:])
            if hit is not None and hit[0] == tuple(getattr(leaf, "shape", ())):
                return hit[1]
        return replicated

    return jax.tree_util.tree_map_with_path(pick, abstract_opt_state)


def _flat_by_name(tree: Any) -> dict[str, Any]:
    return {treepath.name(p): v for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _zeros_batch(batch: Mapping[str, Any]) -> dict[str, jax.Array]:
    return {k: jnp.zeros(v.shape, v.dtype) for k, v in batch.items()}


class Trainer:
    """Builds the sharded `TrainState` and compiles `train_step` / `train_steps` /
    `eval_step` on a mesh.

    Args:
      model: a `ktx.models.base.BaseModel`.
      optimizer: a `ktx.training.optimizers.TaskOptimizer`, or a bare optax transformation (then
        `balancer` and `schedule` complete it). The model's `frozen_patterns`, if any,
        are added to its frozen patterns: frozen parameters get no update at all.
      mesh: a (data, model) mesh from `ktx.partitioning.create_mesh` (default: all
        devices, `num_partitions=1`).
      rules: logical axis rules (default `partitioning.standard_logical_axis_rules()`).
      balancer, schedule: with a bare optax `optimizer` only (see `TaskOptimizer`).
      options: the step's `StepOptions`; or give its fields as keywords
        (`num_microbatches=2, grad_method="vjp", ...`).
    """

    def __init__(
        self,
        model: BaseModel,
        optimizer: TaskOptimizer | optax.GradientTransformation,
        *,
        mesh: Mesh | None = None,
        rules: Sequence[tuple[str, str | None]] | None = None,
        balancer: Any = None,
        schedule: Any = None,
        options: StepOptions | None = None,
        **option_fields: Any,
    ):
        if not isinstance(model, BaseModel):
            raise TypeError(f"model={model!r} must be a ktx.models.base.BaseModel")
        if isinstance(optimizer, TaskOptimizer):
            if balancer is not None or schedule is not None:
                raise ValueError("Trainer: give balancer/schedule inside the TaskOptimizer, "
                                 "not beside it")
        else:
            optimizer = TaskOptimizer(optimizer, balancer=balancer, schedule=schedule)
        frozen = tuple(getattr(model, "frozen_patterns", ()) or ())
        if frozen:
            optimizer = dataclasses.replace(optimizer, frozen=optimizer.frozen + frozen)
        if options is not None and option_fields:
            raise ValueError(f"Trainer: give options= or its fields {sorted(option_fields)}, "
                             "not both")
        unknown = set(option_fields) - {f.name for f in dataclasses.fields(StepOptions)}
        if unknown:
            raise TypeError(f"Trainer: unknown arguments {sorted(unknown)}; step options are "
                            f"{[f.name for f in dataclasses.fields(StepOptions)]}")
        options = options if options is not None else StepOptions(**option_fields)
        if options.sparse_tables is None:
            default = tuple(getattr(model, "sparse_table_patterns", ()) or ())
            usable = optimizer.balanced and _task_blocks(options)
            options = dataclasses.replace(options, sparse_tables=default if usable else ())
        if not 0 <= int(options.target_task) < model.num_tasks:
            raise ValueError(
                f"target_task={options.target_task!r}; accepted: 0..{model.num_tasks - 1}")
        if options.uncertainty_rows:
            from ktx.training.mt_uncertainty import check_proxies

            check_proxies(model, options.uncertainty_proxies)
        self.model = model
        self.optimizer = optimizer
        self.options = options
        self.mesh = mesh if mesh is not None else partitioning.create_mesh(1)
        self.rules = tuple(rules) if rules is not None else partitioning.standard_logical_axis_rules()
        self._compiled: dict[Any, Any] = {}
        # XLA's FLOPs per device of one step of each compiled variant (`last_step_flops`).
        self._step_flops: dict[Any, float | None] = {}
        self.last_step_flops: float | None = None
        self._capacity: tuple[int, ...] | None = None  # per-task block sizes seen so far
        self._slots: int | None = None  # the most tasks on one device seen so far
        self._step_mirror: tuple[Any, int] | None = None  # (the last returned step, its value)
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
                step=jnp.zeros((), jnp.int32), params=params, opt_state=self.init_opt_state(params),
                model_state=self.model.init_model_state(params),
            )

        return init

    def init_params(self, rng: jax.Array, batch: Mapping[str, Any], names: Any) -> dict[str, jax.Array]:
        """`{path: array}` of the freshly initialized parameters named in `names` (the
        values `init_state(rng, batch)` would give them), sharded; the other parameters'
        initializers are not run (XLA drops them), so a run that takes most parameters
        from a checkpoint never holds a second, random copy of them."""
        if self.state_shardings is None:
            self.create_abstract_state(batch)
        names = set(names)
        shardings = {k: v for k, v in _flat_by_name(self.state_shardings.params).items() if k in names}

        def init(r):
            params = nn.meta.unbox(self.model.init_variables(r, _zeros_batch(batch))["params"])
            return {k: v for k, v in _flat_by_name(params).items() if k in names}

        with self._context():
            return jax.jit(init, out_shardings=shardings)(rng)

    def init_opt_state(self, params: Any) -> Any:
        """The optimizer state of `params` (`TaskOptimizer.init`)."""
        return self.optimizer.init(params)

    def init_rest_of_state(self, params: Any) -> TrainState:
        """The step-0 `TrainState` of `params` (e.g. restored from
        INITIAL_CHECKPOINT_PATH): step 0, `init_opt_state(params)` and the model's
        `init_model_state(params)`, placed on the state's shardings; `params` are kept
        as given (not copied)."""
        if self.state_shardings is None:
            raise ValueError("Trainer.init_rest_of_state before create_abstract_state")
        sh = self.state_shardings
        with self._context():
            opt_state, model_state = jax.jit(
                lambda p: (self.init_opt_state(p), self.model.init_model_state(p)),
                out_shardings=(sh.opt_state, sh.model_state))(params)
        step = jax.device_put(np.zeros((), np.int32), sh.step)
        return TrainState(step=step, params=params, opt_state=opt_state, model_state=model_state)

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
            partitioning.check_divisible(boxed, param_shardings)
            abstract = jax.eval_shape(self._init_fn(batch), rng)
        opt_sh = opt_state_shardings(abstract.opt_state, abstract.params, param_shardings, self.mesh)
        # The model's state follows the parameters by the same rule (a teacher copy of a
        # parameter, under any prefix, is sharded as that parameter).
        model_sh = opt_state_shardings(abstract.model_state, abstract.params, param_shardings,
                                       self.mesh)
        shardings = TrainState(
            step=partitioning.replicated_sharding(self.mesh),
            params=param_shardings,
            opt_state=opt_sh,
            model_state=model_sh,
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
        self, batch: Mapping[str, np.ndarray], task_counts: Sequence[int] | None = None,
        batch_axis: int = 0,
    ) -> dict[str, jax.Array]:
        """This process's rows -> global arrays split over the `data` mesh axis (axis
        `batch_axis` of every feature: 1 for a `[K, B, ...]` block of K steps).

        With `task_counts` (balanced path), this process's `task_id` rows are checked
        against the blocks the counts describe (numpy, before sharding), or, with
        `StepOptions.regroup_by_task`, against its shares of them
        (`check_process_grouped`); a batch that is not grouped as promised raises here
        instead of silently mixing tasks' gradients.
        A `[K, B, ...]` block takes one count tuple for all K batches or one per batch
        (`per_step_counts`).
        """
        task_id = batch.get("task_id") if task_counts is not None and self.optimizer.balanced \
            else None
        if isinstance(task_id, jax.Array) and task_id.is_fully_addressable \
                and jax.process_count() == 1:
            task_id = np.asarray(task_id)  # B ints: cheap, and the step needs them anyway
        if isinstance(task_id, np.ndarray):
            from ktx.optim import engine

            rows = task_id.reshape((-1, task_id.shape[-1]) if batch_axis else (1, -1))
            check = check_process_grouped if self.options.regroup_by_task \
                else engine.check_host_layout
            for one, counts in zip(rows, per_step_counts(task_counts, rows.shape[0])):
                check(one, counts, jax.process_index(), jax.process_count())
        data_size = self.mesh.shape[partitioning.DATA]
        for k, v in batch.items():
            rows = np.shape(v)[batch_axis] * jax.process_count()
            if rows % data_size:
                raise ValueError(
                    f"global batch size {rows} (feature {k!r}) must be divisible by the "
                    f"data-parallel size {data_size} (devices / NUM_PARTITIONS)"
                )
        sharding = NamedSharding(self.mesh, PartitionSpec(*([None] * batch_axis), partitioning.DATA))
        if all(isinstance(v, jax.Array) and not isinstance(v, np.ndarray) and
               getattr(v, "sharding", None) == sharding for v in batch.values()):
            return dict(batch)
        return partitioning.host_local_to_global(batch, self.mesh, batch_axis)

    @property
    def task_gradients_by_device(self) -> bool:
        """Whether this Trainer's balanced steps take per-task gradients and may take them
        device by device (`_devices_method`): False for a plain step and for the
        loss-weighted shortcut (`_weights_from_losses`)."""
        return (self.optimizer.balanced and self._devices_method()
                and not _weights_from_losses(self.optimizer, self.options))

    def _devices_method(self) -> bool:
        """Whether balanced steps take per-task gradients device by device
        (`ktx.optim.device_slots`): on a mesh whose `data` axis has several devices, with
        task blocks usable (one microbatch, no uncertainty sampling), for
        `grad_method` "devices" and "auto" (which may still take the blocks:
        `_capacity_for`). One device keeps the task blocks, which are exact there."""
        data = int(self.mesh.shape[partitioning.DATA])
        if data == 1 or not _task_blocks(self.options):
            return False
        return self.options.grad_method in ("devices", "auto")

    def _params_split_over_data(self) -> bool:
        """Whether some parameter is split over `data` (`parameter_partitioning_dims=2`).
        With one task on each device such parameters enter the per-device region as
        shards, gathered layer by layer (`split_params`); with several, they enter whole,
        where the plain step works on `1 / data` shards: XL at 16 x 16 took 1.89x the
        plain step's FLOPs and 5.1x its memory that way, against 1.18x and 1.46x with
        task blocks (docs/scale.md), so "auto" keeps the blocks there."""
        return any(self._split_params())

    def _split_params(self) -> tuple[bool, ...]:
        """Per parameter leaf, whether it is split over `data` along its scatter dimension
        (`_scatter_dims`)."""
        if self.state_shardings is None:
            return ()
        out = []
        for sh, k in zip(jax.tree.leaves(self.state_shardings.params), self._scatter_dims()):
            spec = tuple(sh.spec)
            entry = spec[k] if k is not None and k < len(spec) else None
            out.append(partitioning.DATA in partitioning.entry_axes(entry))
        return tuple(out)

    def _param_layouts(self) -> tuple[tuple, ...]:
        """Per parameter leaf, its layout over the mesh's axes other than `data`, which its
        gathers and gradient exchanges keep in the per-device region."""
        return tuple(partitioning.without_data(sh.spec, leaf.ndim) for leaf, sh in zip(
            jax.tree.leaves(self.abstract_state.params),
            jax.tree.leaves(self.state_shardings.params)))

    def _scatter_dims(self) -> tuple[int | None, ...]:
        """Per parameter leaf, the dimension its per-task gradients are split over `data`
        along: the one the parameter itself is split over `data` along
        (`parameter_partitioning_dims=2`), else the largest one the axis divides that is
        not split over `model`, else None (kept whole: small vectors)."""
        from ktx.optim.device_slots import default_scatter_dim

        data = int(self.mesh.shape[partitioning.DATA])
        out = []
        for leaf, sh in zip(jax.tree.leaves(self.abstract_state.params),
                            jax.tree.leaves(self.state_shardings.params)):
            spec = tuple(sh.spec) + (None,) * (leaf.ndim - len(tuple(sh.spec)))
            axes = [partitioning.entry_axes(e) for e in spec]
            on_data = [k for k, a in enumerate(axes) if partitioning.DATA in a]
            on_model = [k for k, a in enumerate(axes) if partitioning.MODEL in a]
            if on_data and not set(on_data) & set(on_model):
                out.append(on_data[0])
            else:
                out.append(default_scatter_dim(leaf.shape, data, avoid=on_model))
        return tuple(out)

    def _capacity_for(self, task_counts: Any, log: bool | None = None) -> Any:
        """The static shape of the balanced step's per-task gradients, the key of its
        compile: on a mesh with several `data` devices (`_devices_method`), `("devices",
        slots)`, the most tasks any device has held rows of (`ktx.optim.device_slots`),
        where that costs no more than the blocks (one forward and `slots` backward passes
        against the blocks' padded rows); else per-task block sizes, the most rows each task has had so far (one count
        tuple, or one per batch of a `[K, B, ...]` block), rounded up to a multiple of the
        mesh's `data` axis. None when the step builds no task blocks (plain; the
        loss-weighted shortcut without diagnostics, or in a step compiled without them,
        `log` False): one compiled step for every count. The sizes are tracked on every
        call, so a step with diagnostics gets the most rows seen."""
        if not self.optimizer.balanced or task_counts is None or not _task_blocks(self.options):
            return None
        if _weights_from_losses(self.optimizer, self.options) and not self.options.diagnostics_period:
            return None
        steps = per_step_counts(task_counts)
        data = int(self.mesh.shape[partitioning.DATA])
        counts = tuple(max(int(c[t]) for c in steps) for t in range(len(steps[0])))
        # Each block is rounded up to a multiple of the `data` axis (at most the batch):
        # a block that does not divide evenly over it gave NaN losses under XLA's SPMD
        # partitioner with a 2-way `model` axis (ktx train, 4 x 2 mesh, blocks of 5 and 6
        # rows); the extra rows are neighbours' rows, which the engine computes and drops.
        rows = sum(int(c) for c in steps[0])
        if self.options.grad_method != "taps":  # the taps cut no blocks: the counts
            counts = tuple(min(-(-c // data) * data, rows) for c in counts)
        if self._capacity is None or len(self._capacity) != len(counts):
            self._capacity = counts
        else:
            self._capacity = tuple(max(a, b) for a, b in zip(self._capacity, counts))
        if self._devices_method():
            from ktx.optim.device_slots import device_slots

            slots = max(device_slots(c, data) for c in steps)
            self._slots = max(self._slots or 1, slots)
            # Device by device a step costs one forward and `slots` backward passes over
            # the batch (a backward pass ~ two forwards); blocks cost their padded rows.
            # "auto" takes the cheaper ("devices" always the first): blocks win where task
            # boundaries fall inside devices' rows and padding is little (512 rows over 3
            # tasks on 8 devices: 528 rows against 2 backward passes).
            by_devices = (1 + 2 * self._slots) / 3
            by_blocks = sum(self._capacity) / rows
            if self.options.grad_method == "auto" and self._slots > 1 \
                    and self._params_split_over_data():
                by_devices = float("inf")  # parameters would enter the region whole
            if self.options.grad_method == "devices" or by_devices <= by_blocks:
                if log is False and _weights_from_losses(self.optimizer, self.options):
                    return None
                return ("devices", self._slots)
        if log is False and _weights_from_losses(self.optimizer, self.options):
            return None
        return self._capacity

    def _host_step(self, state: TrainState) -> int:
        """`state.step` on the host: the mirror of the step this Trainer returned last
        (consecutive calls never wait for the device), read once for another state."""
        mirror = self._step_mirror
        if mirror is not None and mirror[0] is state.step:
            return mirror[1]
        step = state.step
        if isinstance(step, jax.Array) and not step.is_fully_addressable:
            step = step.addressable_data(0)  # replicated: every process holds the value
        return int(jax.device_get(step))

    def _run(self, state: TrainState, batch: Any, rng: jax.Array, task_counts: Any,
             steps: int | None) -> tuple[TrainState, dict[str, jax.Array]]:
        """One compiled call of `steps` stacked steps (None: one `train_step`). A balanced
        step with diagnostics is compiled twice, with and without them, and the host picks
        (`StepOptions.log_diagnostics`): False when no step of the call logs, else None (a
        `lax.cond` in the step), for a single step as for a block: the cond's variant is
        the one `ktx precompile` measures, and it holds no more memory than the step
        without (T5.1.1-Base + MetaBalance on v4-32 with 2-D dims: 1.290 GiB, where
        computing the diagnostics unconditionally took 1.294)."""
        log, step = self.options.log_diagnostics, None
        period = self.options.diagnostics_period
        if not (self.optimizer.balanced and period):
            log = False
        elif log is None:
            step = self._host_step(state)
            log = None if any((step + k + 1) % period == 0 for k in range(steps or 1)) else False
        capacity = self._capacity_for(task_counts, log)
        global_batch = self.global_batch(batch, task_counts, batch_axis=0 if steps is None else 1)
        key = (capacity, steps is not None, log)
        with self._context():
            fn = self._compiled_step(*key)
            new_state, metrics = fn(state, global_batch, rng)
            if key not in self._step_flops:
                self._step_flops[key] = hlo_cost.flops_per_step(fn, new_state, global_batch, rng,
                                                        steps)
        self.last_step_flops = self._step_flops[key]
        if step is not None:
            self._step_mirror = (new_state.step, step + (steps or 1))
        return new_state, metrics

    def _compiled_step(self, task_capacity, stacked: bool, log: bool | None = None):
        key = (task_capacity, stacked, log)
        if key not in self._compiled:
            if task_capacity is not None and task_capacity[0] == "devices":
                split = self._split_params() if task_capacity[1] == 1 else ()
                fields = dict(task_capacity=None, device_slots=task_capacity[1],
                              scatter_dims=self._scatter_dims(),
                              split_params=split if any(split) else None,
                              param_layouts=self._param_layouts())
            else:
                fields = dict(task_capacity=task_capacity)
            options = dataclasses.replace(self.options, **fields, check_layout=False,
                                          log_diagnostics=log)
            fn = functools.partial(train_steps if stacked else train_step, model=self.model,
                                   optimizer=self.optimizer, options=options)
            batch_sharding = NamedSharding(
                self.mesh, PartitionSpec(*([None] if stacked else []), partitioning.DATA))
            rep = partitioning.replicated_sharding(self.mesh)
            self._compiled[key] = jax.jit(
                fn,
                in_shardings=(self.state_shardings, batch_sharding, rep),
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

        `task_counts` (a `ktx.data.pipeline.TrainInput`'s `task_counts(step)`: rows per
        task of a task-partitioned batch) locates the task blocks of the balanced path; it
        is ignored on the plain path. The compiled step depends only on the block sizes,
        the most rows each task has had so far (the counts themselves are read from
        `task_id` inside the step), so a mixture whose counts vary by a row or two from
        step to step compiles a handful of times at the start and never again.
        """
        if self.state_shardings is None:
            raise ValueError("Trainer.train_step before init_state/create_abstract_state")
        return self._run(state, batch, rng, task_counts, None)

    def train_steps(
        self,
        state: TrainState,
        batches: Mapping[str, Any],
        rng: jax.Array,
        task_counts: Sequence[int] | None = None,
    ) -> tuple[TrainState, dict[str, jax.Array]]:
        """K steps in one compiled call (`train_steps`): `batches` holds this process's
        rows of K consecutive global batches, every feature stacked `[K, B, ...]`;
        `task_counts` is one count tuple for every batch or a sequence of K (one per
        batch: a mixture's counts vary from step to step). Metrics come back `[K, ...]`;
        the result equals K `train_step` calls (each distinct K compiles once; a balanced
        run with diagnostics also once with a `lax.cond` for the blocks that log)."""
        if self.state_shardings is None:
            raise ValueError("Trainer.train_steps before init_state/create_abstract_state")
        steps = int(np.shape(next(iter(batches.values())))[0])
        return self._run(state, batches, rng, task_counts, steps)

    def lower_train_step(
        self, state: Any, batch: Mapping[str, Any], rng: Any,
        task_capacity: Sequence[int] | None = None, task_counts: Sequence[int] | None = None,
        log_diagnostics: bool | None = None,
    ) -> Any:
        """The train step lowered for `state`, `batch` and `rng` (arrays or
        `ShapeDtypeStruct`s with shardings, e.g. for another platform's devices): call
        `.compile()` on it for XLA's memory and cost analyses (`ktx.training.precompile`).

        `task_counts` (a balanced step): the batch's rows per task, as `train_step` takes
        them; its per-task gradients are then computed as `train_step` computes them
        (device by device on a mesh with several `data` devices, else task blocks rounded
        up to the `data` axis). `task_capacity` gives block sizes as they are instead.
        `log_diagnostics` picks the variant (`StepOptions.log_diagnostics`; None, the
        default: the step with the diagnostics' `lax.cond`, what a block of steps runs)."""
        if self.state_shardings is None:
            raise ValueError("Trainer.lower_train_step before create_abstract_state")
        if task_counts is not None:
            if task_capacity is not None:
                raise ValueError("lower_train_step: give task_counts or task_capacity, not both")
            task_capacity = self._capacity_for(tuple(int(c) for c in task_counts),
                                               log_diagnostics)
        if task_capacity is None or task_capacity[0] == "devices":
            capacity = task_capacity
        else:
            capacity = tuple(int(c) for c in task_capacity)
        with self._context():
            return self._compiled_step(capacity, False, log_diagnostics).lower(state, batch, rng)

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
