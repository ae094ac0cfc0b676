"""Parameters split over `data` inside a manual `data` region, gathered layer by layer.

The device-by-device per-task gradients (`ktx.optim.device_slots`) run the model inside a
`jax.shard_map` that is manual over the mesh's `data` axis. With parameters split over
`data` (`parameter_partitioning_dims=2`) a parameter entering that region whole would be
all-gathered in full on every device before the forward pass, which is what the plain
step with 1-D partitioning costs. Instead, a parameter enters as this device's shard, as a
`SplitParam`, and is all-gathered where it is used:

* a scanned layer stack gathers one layer's parameters at a time inside the scan's body
  (`gather_layer_params`, installed by `ktx.models.t5_stack.gathered_layers` in T5's,
  BERT's, PALs' and CA-MTL's scanned stacks), so a device
  holds one layer whole, as XLA's partitioner does for the plain step; under
  rematerialisation the backward pass gathers the layer again;
* any other split parameter is gathered once where the region starts.

The gather's backward pass is where the per-task gradients are made: its cotangent is the
device's gradient of the gathered parameter, all of it of one task (the device's rows
belong to one task: `slots == 1`). An `all_to_all` over `data` along the split dimension
gives each device its shard of every device's gradient, `[data, *shard]`, and a segment
sum by the devices' tasks gives `[T, *shard]`: each task's gradient shard, laid out like
the parameter shard. This cotangent is returned for the `SplitParam`'s accumulator (zeros
of that shape, never read), so the vector-Jacobian product of the loss with respect to
the accumulators is the per-task gradients, split over `data` as the parameters are.
Per layer it moves what the plain step's gradient reduce-scatter moves.

The region is manual over `data` only, and XLA's partitioner makes the operand of a
collective over `data` whole over the mesh's other axes first. So each gather and each
exchange runs in a nested `shard_map` manual over the parameter's own axes other than
`data` (`SplitParam.layout`, from its `PartitionSpec`): a layer split over `model` is
gathered over `data` only, and its per-task gradient shards stay split over `model`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from ktx.partitioning import DATA, entry_axes

__all__ = ["SplitParam", "gather", "gather_layer_params", "gathering", "recording",
           "split_param", "stack_hook", "sum_by_task"]


@jax.tree_util.register_pytree_node_class
class SplitParam:
    """A parameter split over `data` inside the manual region.

    `shard`: this device's slice, split along dimension `dim` (counted from the end, so a
    scan that slices leading layer axes keeps it right); `acc`: zeros shaped like the
    shard with the task axis `T` inserted `ndim_from_end` dimensions from the end (before
    the parameter's own dimensions: `[L, T, ...]` for a scanned stack's parameter), whose
    cotangent is the per-task gradient shards. `layout`: the mesh axes other than `data`
    of each of the parameter's dimensions (its `PartitionSpec` without `data`, one entry
    per dimension, read from the end like `dim`), which the gathered parameter, its
    gradient and its per-task gradient shards keep; None: left to XLA's partitioner."""

    def __init__(self, shard: Any, acc: Any, dim: int, layout: tuple | None = None):
        self.shard, self.acc, self.dim, self.layout = shard, acc, dim, layout

    def tree_flatten(self):
        return (self.shard, self.acc), (self.dim, self.layout)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)


def sum_by_task(grads: jax.Array, dim: int | None, tasks: jax.Array, num_tasks: int,
                dtype: Any = None, layout: tuple | None = None) -> jax.Array:
    """Inside a manual `data` region: `grads` `[n, *shape]`, this device's gradients of
    the tasks `tasks` names for every device's n (all devices' `[data * n]`, the task count
    for none), to `[T, *shape]` per-task sums split over `data` along `dim` (an
    `all_to_all`; None: whole, an `all_gather`), in `dtype` (None: as they are). `layout`:
    the parameter's mesh axes other than `data` (see `SplitParam`), kept by the exchange."""

    def exchange(g, t):
        if dim is None:
            pieces = jax.lax.all_gather(g, DATA, tiled=True)
        else:
            pieces = jax.lax.all_to_all(g, DATA, split_axis=dim + 1, concat_axis=0, tiled=True)
        per_task = jax.ops.segment_sum(pieces, t, num_segments=num_tasks)
        return per_task if dtype is None else per_task.astype(dtype)

    return _local(exchange, grads, tasks, None if dim is None else dim - (grads.ndim - 1),
                  layout, 1, 1)


def _local(fn, x: jax.Array, tasks: jax.Array, axis: int | None, layout: tuple | None,
           lead_in: int, lead_out: int) -> jax.Array:
    """`fn(x, tasks)`, a collective over `data` along the parameter's dimension `axis`
    (counted from the end; None: none), in a nested `shard_map` manual over the axes that
    `layout` gives `x`'s last dimensions (its first `lead_in` whole; the output's first
    `lead_out`): see the module docstring. Without a layout, or where another axis shares
    the collective's dimension, `fn` runs on `x` as it is."""
    ndim = x.ndim - lead_in
    tail = () if layout is None else tuple(layout[len(layout) - ndim:])
    names = {a for e in tail for a in entry_axes(e)}
    if not names or (axis is not None and tail[axis] is not None):
        return fn(x, tasks)
    return jax.shard_map(
        fn, mesh=jax.sharding.get_abstract_mesh(),
        in_specs=(PartitionSpec(*((None,) * lead_in + tail)), PartitionSpec()),
        out_specs=PartitionSpec(*((None,) * lead_out + tail)),
        axis_names=names, check_vma=False)(x, tasks)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _gather(shard: jax.Array, acc: jax.Array, tasks: jax.Array, axis: int,
            num_tasks: int, layout: tuple | None) -> jax.Array:
    del acc, num_tasks
    return _local(lambda x, _: jax.lax.all_gather(x, DATA, axis=axis, tiled=True),
                  shard, tasks, axis - shard.ndim, layout, 0, 0)


def _gather_fwd(shard, acc, tasks, axis, num_tasks, layout):
    # The accumulator's dtype (that of the per-task gradients), kept as a scalar.
    return (_gather(shard, acc, tasks, axis, num_tasks, layout),
            (tasks, jnp.zeros((), acc.dtype)))


def _gather_bwd(axis, num_tasks, layout, res, ct):
    # ct: this device's gradient of the whole parameter (its rows' task).
    tasks, acc_dtype = res[0], res[1].dtype
    return None, sum_by_task(ct[None], axis, tasks, num_tasks, acc_dtype, layout), None


_gather.defvjp(_gather_fwd, _gather_bwd)


class _Region:
    def __init__(self, tasks: Any, num_tasks: int, record: list | None):
        self.tasks, self.num_tasks, self.record = tasks, num_tasks, record


_REGIONS: list[_Region] = []


@contextlib.contextmanager
def gathering(tasks: jax.Array, num_tasks: int) -> Iterator[None]:
    """Inside a manual `data` region: `SplitParam`s are gathered by `gather`, whose backward
    pass sums the devices' gradients by `tasks` (`[data]`, the task of each device's rows)."""
    _REGIONS.append(_Region(tasks, num_tasks, None))
    try:
        yield
    finally:
        _REGIONS.pop()


@contextlib.contextmanager
def recording() -> Iterator[list]:
    """Trace a model under this to learn which scanned stacks gather their layers: the
    yielded list receives each stack's parameter path prefix (`(..., "layers")`)."""
    paths: list = []
    _REGIONS.append(_Region(None, 0, paths))
    try:
        yield paths
    finally:
        _REGIONS.pop()


def gather(x: Any) -> Any:
    """The whole parameter of a `SplitParam` (anything else as it is)."""
    if not isinstance(x, SplitParam):
        return x
    region = _REGIONS[-1]
    axis = x.shard.ndim + x.dim
    return _gather(x.shard, x.acc, region.tasks, axis, region.num_tasks, x.layout)


def _gather_tree(variables: Any) -> Any:
    return jax.tree.map(gather, variables, is_leaf=lambda v: isinstance(v, SplitParam))


def gather_layer_params(cls: type) -> type:
    """`cls` reading its `params` through `gather` (a scanned stack's body, before remat)."""
    return nn.map_variables(cls, "params", trans_in_fn=_gather_tree, init=False)


def stack_hook(scope_path: tuple | None) -> bool:
    """Whether a scanned stack whose parent module is at `scope_path` gathers its layers'
    parameters (`gather_layer_params`): inside a `gathering` region. Under `recording` it
    records `(*scope_path, "layers")` and answers False."""
    if not _REGIONS or scope_path is None:
        return False
    region = _REGIONS[-1]
    if region.record is not None:
        region.record.append(tuple(scope_path) + ("layers",))
        return False
    return True


def split_param(shard: jax.Array, dim: int, num_tasks: int, lead: int,
                dtype: Any = None, layout: tuple | None = None) -> SplitParam:
    """A `SplitParam` of `shard` (split along its dimension `dim`) whose first `lead`
    dimensions are stacked layers: the accumulator is `[*lead dims, T, *rest]`, of `dtype`
    (default: the shard's), the dtype its per-task gradient shards are made in. `layout`:
    see `SplitParam` (one entry per dimension of `shard`)."""
    acc = jnp.zeros(shard.shape[:lead] + (num_tasks,) + shard.shape[lead:],
                    shard.dtype if dtype is None else dtype)
    if layout is not None:
        layout = tuple(layout)
        if len(layout) != shard.ndim:
            raise ValueError(f"split_param: layout {layout} has {len(layout)} entries for a "
                             f"{shard.ndim}-D parameter")
    return SplitParam(shard, acc, dim - shard.ndim, layout)
