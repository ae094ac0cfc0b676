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
* a parameter its module only contracts over its leading dimension with a small
  operand (`contract`: HyperPrompt-Global's generators, `[n, t] x [t, ...]` with n the
  device's layers x tasks) is never gathered: each device multiplies every device's
  operand by its shard and an `all_to_all` returns each device its rows of the product;
  its per-task gradient shards are made from the product's cotangent (`[n, ...]` per
  device) rather than from the device's whole `[t, ...]` gradient;
* an embedding table its module only looks rows up in (`take`: T5's token embedder,
  split over `data` along its features) is never gathered either: each device looks up
  every device's ids in its feature shard and an `all_to_all` returns each device its
  rows; the backward pass scatter-adds the rows' cotangents by task into `[T, V, *shard]`
  shards directly;
* a kernel its module contracts over its split dimension with many rows (`project`: T5's
  untied logits) is gathered, and its per-task gradient shards are made a slice at a time;
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

from ktx import linear
from ktx.partitioning import DATA, entry_axes

__all__ = ["SplitParam", "contract", "gather", "gather_layer_params", "gathering",
           "module_param", "project", "recording", "split_param", "stack_hook", "sum_by_task",
           "take"]


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
            # The devices' pieces split out by hand, `[n, ..., data, D / data, ...]`, and
            # exchanged untiled: a TPU copied the tiled form's received `[1, *shape]` once
            # more (T5.1.1-Base's logits kernel on v5e-256, 128 x 2: 47 MiB a device;
            # MGDA's step 0.304 GiB, 0.211 so).
            d = dim + 1
            p = jax.lax.axis_size(DATA)
            x = g.reshape(g.shape[:d] + (p, g.shape[d] // p) + g.shape[d + 1:])
            pieces = jax.lax.all_to_all(x, DATA, split_axis=d, concat_axis=0)  # [p, n, ...]
            pieces = pieces.reshape((p * g.shape[0],) + pieces.shape[2:])
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
    def __init__(self, tasks: Any, num_tasks: int, record: list | None,
                 contracted: list | None = None):
        self.tasks, self.num_tasks, self.record = tasks, num_tasks, record
        self.contracted = contracted


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


class Recorded:
    """What a `recording` trace found: `stacks`, each scanned stack's parameter path
    prefix (`(..., "layers")`) whose layers it gathers; `contracted`, the paths of the
    parameters read through `contract` or `take` (`(..., name)`)."""

    def __init__(self):
        self.stacks: list[tuple] = []
        self.contracted: list[tuple] = []


@contextlib.contextmanager
def recording() -> Iterator[Recorded]:
    """Trace a model under this to learn which scanned stacks gather their layers and
    which parameters are read through `contract` (`Recorded`)."""
    found = Recorded()
    _REGIONS.append(_Region(None, 0, found.stacks, found.contracted))
    try:
        yield found
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


def module_param(module: nn.Module, name: str, declare: Any) -> Any:
    """A module's parameter `name` for `contract` or `take`: inside a device-by-device
    region the `SplitParam` as it is (the parameter's shape check would refuse it),
    anywhere else `declare()` (the module's own `self.param(...)`)."""
    value = module.get_variable("params", name) if module.has_variable("params", name) else None
    return value if isinstance(value, SplitParam) else declare()


def contract(x: jax.Array, w: Any, path: tuple | None = None) -> jax.Array:
    """`x [n, t]` times a parameter `w [t, *rest]` over `t`: `[n, *rest]`, in `x`'s dtype.

    A module reads a parameter through this (with its `path`, the module's scope path and
    the parameter's name) to let a device-by-device region leave it split: inside the
    region `w` is then a `SplitParam` split along one of `rest`. Each device multiplies
    every device's `x` (all-gathered; they differ, as the devices' tasks do) by its shard
    and an `all_to_all` sends each device its rows. The backward pass runs the same
    `all_to_all` the other way on the product's cotangent (`[n, *rest]`, this device's
    task), so that each device holds every device's rows of its shard, and contracts
    them with every device's `x` masked by task: the per-task gradient shards
    `[T, t, *shard]` directly (T times the FLOPs of one gradient, small beside the
    step); `x`'s cotangent is the partial products, reduce-scattered. No device holds
    the whole `[t, *rest]` gradient, which for HyperPrompt-Global's down generators at
    T5.1.1-XXL is 134 MB in float32 each (t = 64, n = 24 layers x 1 task). Anywhere
    else: a plain `tensordot`. A parameter read through `contract` must not be read any
    other way."""
    region = _REGIONS[-1] if _REGIONS else None
    if region is not None and region.contracted is not None and path is not None:
        region.contracted.append(tuple(path))
    if not isinstance(w, SplitParam):
        return jnp.tensordot(x, jnp.asarray(w).astype(x.dtype), axes=((1,), (0,)))
    axis = w.shard.ndim + w.dim
    if axis == 0:  # split along the contracted dimension: gather it whole
        return jnp.tensordot(x, gather(w).astype(x.dtype), axes=((1,), (0,)))
    return _contract(x, w.shard, w.acc, region.tasks, axis, region.num_tasks, w.layout)


def _contract_axes(layout: tuple | None, axis: int) -> tuple:
    """The mesh axes `contract`'s collectives run manual over, besides `data`: `layout`'s
    (see `_local`); none where the contracted dimension or the split one has any."""
    names = set() if layout is None else {a for e in layout for a in entry_axes(e)}
    if not names or layout[axis] is not None or layout[0] is not None:
        return ()
    return tuple(sorted(names))


def _manual_over(fn, names: tuple, in_specs, out_specs):
    """`fn` in a nested `shard_map` manual over the mesh axes `names` (`fn` itself if
    none: `contract`'s and `take`'s collectives); `in_specs` / `out_specs`: each operand's
    `PartitionSpec` there."""
    if not names:
        return fn
    return jax.shard_map(fn, mesh=jax.sharding.get_abstract_mesh(),
                         in_specs=in_specs, out_specs=out_specs, axis_names=set(names),
                         check_vma=False)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _contract(x, shard, acc, tasks, axis, num_tasks, layout):
    del acc, tasks, num_tasks
    rest = () if layout is None else tuple(layout[1:])

    def fn(x, shard):
        # Every device's x against this shard ([D * n, *shard]), each device's rows sent
        # back to it: [n, *rest] (the devices' x differ: their tasks).
        xs = jax.lax.all_gather(x, DATA, tiled=True)
        part = jnp.tensordot(xs, shard.astype(x.dtype), axes=((1,), (0,)))
        return jax.lax.all_to_all(part, DATA, split_axis=0, concat_axis=axis, tiled=True)

    return _manual_over(fn, _contract_axes(layout, axis),
                        (PartitionSpec(), PartitionSpec(*(layout or ()))),
                        PartitionSpec(None, *rest))(x, shard)


def _contract_fwd(x, shard, acc, tasks, axis, num_tasks, layout):
    out = _contract(x, shard, acc, tasks, axis, num_tasks, layout)
    return out, (x, shard, tasks, jnp.zeros((), acc.dtype))


def _contract_bwd(axis, num_tasks, layout, res, ct):
    x, shard, tasks, acc_dtype = res[0], res[1], res[2], res[3].dtype
    rest = () if layout is None else tuple(layout[1:])
    model_axes = _contract_axes(layout, axis)  # the shard's other axes, split in `fn`

    def fn(x, shard, tasks, ct):
        # Every device's rows of this device's shard, by source device: [D * n, *shard].
        pieces = jax.lax.all_to_all(ct, DATA, split_axis=axis, concat_axis=0, tiled=True)
        xs = jax.lax.all_gather(x, DATA, tiled=True)  # [D * n, t], the same order
        n = x.shape[0]
        row_task = jnp.repeat(jax.nn.one_hot(tasks, num_tasks, dtype=xs.dtype), n, axis=0)
        by_task = row_task[:, :, None] * xs[:, None, :]  # [D * n, T, t]
        grads = jnp.tensordot(by_task, pieces, axes=((0,), (0,)),
                              preferred_element_type=jnp.float32).astype(acc_dtype)
        # x's cotangent: every device's rows against this shard, summed over the shards
        # into each device's own rows.
        k = tuple(range(1, pieces.ndim))
        partial = jnp.tensordot(pieces, shard.astype(pieces.dtype), axes=(k, k))
        if model_axes:  # the product also ran over the other axes' slices of `rest`
            partial = jax.lax.psum(partial, model_axes)
        dx = jax.lax.psum_scatter(partial, DATA, scatter_dimension=0, tiled=True)
        return dx.astype(x.dtype), grads

    lay = tuple(layout or ())
    dx, grads = _manual_over(
        fn, model_axes,
        (PartitionSpec(), PartitionSpec(*lay), PartitionSpec(), PartitionSpec(None, *rest)),
        (PartitionSpec(), PartitionSpec(None, *lay)))(x, shard, tasks, ct)
    return dx, None, grads, None


_contract.defvjp(_contract_fwd, _contract_bwd)


# `project`'s per-task gradient is made this many bytes (float32) of the whole gradient at
# a time: a device never holds its whole `[t, *rest]` gradient, nor its exchange's pieces.
PROJECT_CHUNK_BYTES = 16 << 20


def project(x: jax.Array, w: Any, path: tuple | None = None) -> jax.Array:
    """`x [..., t]` times a parameter `w [t, *rest]` over `t`: `[..., *rest]`, in `x`'s
    dtype. An output projection (T5's untied logits, `DenseGeneral(split_input=True)`).

    A module reads its kernel through this (with its `path`, as for `contract`) to let a
    device-by-device region leave it split along `t`. Each device gathers the kernel over
    `data` for its rows' product, and again in the backward pass for `x`'s cotangent; the
    per-task gradient shards `[T, t / data, *rest]` are made a slice of `rest` at a time
    (`PROJECT_CHUNK_BYTES`): the slice's gradient, its exchange and its sum by task
    (`sum_by_task`). Gathered as a whole parameter, a device held its whole gradient and
    as much again for the exchange (T5.1.1-Base's logits kernel: 94 MiB each). Split
    along `rest`, the kernel is gathered whole. Anywhere else: a plain product."""
    region = _REGIONS[-1] if _REGIONS else None
    if region is not None and region.contracted is not None and path is not None:
        region.contracted.append(tuple(path))
    if not isinstance(w, SplitParam):
        return linear.contract(x, jnp.asarray(w).astype(x.dtype))
    if w.shard.ndim + w.dim != 0:  # split along `rest`: gather it whole
        return linear.contract(x, gather(w).astype(x.dtype))
    rows = x.reshape(-1, x.shape[-1])
    out = _project(rows, w.shard, w.acc, region.tasks, region.num_tasks, w.layout)
    return out.reshape(x.shape[:-1] + out.shape[1:])


def _project_axes(layout: tuple | None) -> tuple:
    """The mesh axes other than `data` that split `project`'s `rest` (its collectives run
    manual over them); none where the contracted dimension has any."""
    if layout is None or layout[0] is not None:
        return ()
    return tuple(sorted({a for e in layout[1:] for a in entry_axes(e)}))


def _project_specs(layout: tuple | None) -> tuple[PartitionSpec, PartitionSpec]:
    """The shard's and a `[n, *rest]` product's specs in `_project`'s manual region."""
    return PartitionSpec(*(layout or ())), PartitionSpec(None, *(layout or ())[1:])


def _project_chunks(t: int, size: int) -> int:
    """The fewest even slices of `size` whose `[t, slice]` float32 gradient is at most
    `PROJECT_CHUNK_BYTES` (at most `size`)."""
    for n in range(1, size + 1):
        if size % n == 0 and t * (size // n) * 4 <= PROJECT_CHUNK_BYTES:
            return n
    return size


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _project(x, shard, acc, tasks, num_tasks, layout):
    del acc, tasks, num_tasks
    shard_spec, out_spec = _project_specs(layout)

    def fn(x, shard):
        w = jax.lax.all_gather(shard, DATA, axis=0, tiled=True)  # [t, *rest]
        return jnp.tensordot(x, w.astype(x.dtype), axes=((1,), (0,)))

    return _manual_over(fn, _project_axes(layout), (PartitionSpec(), shard_spec),
                        out_spec)(x, shard)


def _project_fwd(x, shard, acc, tasks, num_tasks, layout):
    out = _project(x, shard, acc, tasks, num_tasks, layout)
    return out, (x, shard, tasks, jnp.zeros((), acc.dtype))


def _project_bwd(num_tasks, layout, res, ct):
    x, shard, tasks, acc_dtype = res[0], res[1], res[2], res[3].dtype
    names = _project_axes(layout)
    shard_spec, out_spec = _project_specs(layout)

    def fn(x, shard, tasks, ct):
        w = jax.lax.all_gather(shard, DATA, axis=0, tiled=True)  # [t, *rest]
        k = tuple(range(1, ct.ndim))
        dx = jnp.tensordot(ct, w.astype(ct.dtype), axes=(k, k))  # [n, t]
        if names:  # the product ran over the other axes' slices of `rest`
            dx = jax.lax.psum(dx, names)
        n, t, rest = x.shape[0], x.shape[1], ct.shape[1:]
        size = functools.reduce(lambda a, b: a * b, rest, 1)
        flat = ct.reshape(n, size)
        chunks = _project_chunks(t, size)
        step = size // chunks

        def one(i, grads):
            part = jax.lax.dynamic_slice_in_dim(flat, i * step, step, axis=1)  # [n, step]
            g = jnp.tensordot(x, part, axes=((0,), (0,)),
                              preferred_element_type=jnp.float32)  # [t, step]
            per_task = sum_by_task(g[None], 0, tasks, num_tasks, acc_dtype)  # [T, t/D, step]
            return jax.lax.dynamic_update_slice_in_dim(grads, per_task, i * step, axis=2)

        tD = t // jax.lax.axis_size(DATA)
        grads = jax.lax.fori_loop(0, chunks, one, jnp.zeros((num_tasks, tD, size), acc_dtype))
        return dx.astype(x.dtype), grads.reshape((num_tasks, tD) + rest)

    dx, grads = _manual_over(
        fn, names, (PartitionSpec(), shard_spec, PartitionSpec(), out_spec),
        (PartitionSpec(), PartitionSpec(None, *shard_spec)))(x, shard, tasks, ct)
    return dx, None, grads, None


_project.defvjp(_project_fwd, _project_bwd)


def take(table: Any, ids: jax.Array, path: tuple | None = None, dtype: Any = None) -> jax.Array:
    """Rows `ids` (int `[...]`) of an embedding table `[V, *features]`: `[..., *features]`,
    in `dtype` (default: the table's).

    A module reads its table through this (with its `path`, as for `contract`) to let a
    device-by-device region leave it split: inside the region the table is then a
    `SplitParam`. Split along a feature dimension, each device looks up every device's
    ids (all-gathered) in its shard and an `all_to_all` sends each device its rows; where
    the table is also split over other mesh axes along `V` (`model`, the vocabulary), each
    looks up the ids in its slice of `V` and the rows are summed over those axes. The
    backward pass runs the `all_to_all` the other way on the rows' cotangent, so that
    each device holds every device's rows of its shard, and scatter-adds them by the
    devices' tasks: the per-task gradient shards `[T, V, *shard]` directly, never the
    whole `[V, *features]` gradient (at T5.1.1-XXL with 16 data devices and 4 model ones,
    `f32[8032, 4096]`, 126 MiB, and as much again for the exchange's pieces). Split along
    `V` itself, the table is gathered whole. Anywhere else: `jnp.take`. A table read
    through `take` may also be read through `gather` (tied logits); the per-task
    gradients of the two uses add up."""
    region = _REGIONS[-1] if _REGIONS else None
    if region is not None and region.contracted is not None and path is not None:
        region.contracted.append(tuple(path))
    w = table
    if not isinstance(w, SplitParam):
        return _rows(jnp.asarray(w), ids, dtype)
    axis = w.shard.ndim + w.dim
    if axis == 0:  # split along the rows looked up: gather the table whole
        return _rows(gather(w), ids, dtype)
    return _take(ids, w.shard, w.acc, region.tasks, axis, region.num_tasks, w.layout,
                 w.shard.dtype if dtype is None else jnp.dtype(dtype))


def _rows(table: jax.Array, ids: jax.Array, dtype: Any, axis: int = 0) -> jax.Array:
    """`table`'s rows `ids` (along `axis`), gathered in the table's dtype and then cast to
    `dtype`: the same values as casting first, but the backward pass scatter-adds the
    rows' cotangent into a gradient of the table's dtype (float32). Cast first, a bfloat16
    step scatter-added into a bfloat16 table: one kernel of 1.2 s in a 1.3 s T5.1.1-Small
    step on an H200 (docs/performance.md), and a running sum that stops at 256."""
    rows = jnp.take(table, ids, axis=axis)
    return rows if dtype is None else rows.astype(dtype)


def _take_axes(layout: tuple | None) -> tuple:
    """The mesh axes other than `data` that split the table's rows (`V`), over which
    `take`'s collectives run manual and its rows are summed; none where any of the
    feature dimensions has one (XLA's partitioner then takes care of them)."""
    if layout is None or any(e is not None for e in layout[1:]):
        return ()
    return tuple(sorted(entry_axes(layout[0])))


def _row_slice(ids: jax.Array, rows: int, names: tuple) -> tuple[jax.Array, jax.Array]:
    """`ids` as indices into this device's slice of `rows` table rows along the axes
    `names` (their devices' slices in order), and whether each falls in it."""
    if not names:
        return ids, jnp.ones(ids.shape, bool)
    index = 0
    for a in names:  # the slice's position, major to minor as PartitionSpec orders them
        index = index * jax.lax.axis_size(a) + jax.lax.axis_index(a)
    local = ids - index * rows
    return local, (local >= 0) & (local < rows)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _take(ids, shard, acc, tasks, axis, num_tasks, layout, dtype):
    del acc, tasks, num_tasks
    names = _take_axes(layout)

    def fn(ids, shard):
        # Every device's ids looked up in this feature shard, features first:
        # [*shard features, D * n, ...]; each device's rows sent back to it with every
        # shard's features, [*features, n...], and the features moved last. Features
        # first, because a TPU tiles an array's last dimension by 128 lanes: with the
        # shard's few features last (T5.1.1-Base's 768 over 128 devices: 6) the exchange's
        # pieces were padded 21-fold (40 MiB for 2 MiB of rows).
        every = jax.lax.all_gather(ids, DATA, tiled=True)
        local, valid = _row_slice(every, shard.shape[0], names)
        nf = shard.ndim - 1
        table = jnp.moveaxis(shard, 0, -1)  # [*shard features, V]
        rows = _rows(table, jnp.where(valid, local, 0), dtype, axis=nf)
        if names:
            rows = jax.lax.psum(jnp.where(valid, rows, 0), names)
        rows = jax.lax.all_to_all(rows, DATA, split_axis=nf, concat_axis=axis - 1, tiled=True)
        return jnp.moveaxis(rows, tuple(range(nf)), tuple(range(ids.ndim, ids.ndim + nf)))

    lay = tuple(layout or ())
    return _manual_over(fn, names, (PartitionSpec(), PartitionSpec(*lay)),
                       PartitionSpec())(ids, shard)


def _take_fwd(ids, shard, acc, tasks, axis, num_tasks, layout, dtype):
    out = _take(ids, shard, acc, tasks, axis, num_tasks, layout, dtype)
    # An empty array carries the accumulator's dtype and the shard's row count.
    return out, (ids, tasks, jnp.zeros((shard.shape[0], 0), acc.dtype))


def _take_bwd(axis, num_tasks, layout, dtype, res, ct):
    ids, tasks, acc_dtype, shape = res[0], res[1], res[2].dtype, res[2].shape
    names = _take_axes(layout)

    def fn(ids, tasks, ct):
        every = jax.lax.all_gather(ids, DATA, tiled=True)  # [D * n, ...]
        # Every device's rows of this device's feature shard, in the same order, features
        # first ([*shard features, D * n, ...]: see the forward pass).
        nf = ct.ndim - ids.ndim
        ct = jnp.moveaxis(ct, tuple(range(ids.ndim, ct.ndim)), tuple(range(nf)))
        moved = jax.lax.all_to_all(ct, DATA, split_axis=axis - 1, concat_axis=nf,
                                   tiled=True).astype(acc_dtype)
        rows = shape[0] // (1 if not names else
                            functools.reduce(lambda a, b: a * b,
                                             (jax.lax.axis_size(n) for n in names)))
        local, valid = _row_slice(every, rows, names)
        row_task = jnp.broadcast_to(
            jnp.repeat(tasks, ids.shape[0])[(slice(None),) + (None,) * (ids.ndim - 1)],
            every.shape)
        # Rows outside this device's slice of V go to an index past the end: dropped.
        # Made features-first, `[*shard, T, V]`, and moved back: the table's rows are the
        # long dimension, so the accumulator is not padded along a short feature shard
        # (a TPU tiles an array's last dimension by 128).
        feats = tuple(moved.shape[:nf])
        grads = jnp.zeros(feats + (num_tasks, rows), acc_dtype)
        index = (slice(None),) * len(feats) + (row_task, jnp.where(valid, local, rows))
        grads = grads.at[index].add(moved, mode="drop")
        return jnp.moveaxis(grads, tuple(range(len(feats))),
                            tuple(range(2, 2 + len(feats))))

    rest = tuple(layout or ())
    grads = _manual_over(fn, names, (PartitionSpec(), PartitionSpec(), PartitionSpec()),
                        PartitionSpec(None, *rest))(ids, tasks, ct)
    return None, None, grads, None


_take.defvjp(_take_fwd, _take_bwd)


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
