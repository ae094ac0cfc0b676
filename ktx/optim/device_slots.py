"""Per-task gradients on a mesh at one backward pass: each device differentiates its own rows.

The loss is a sum over rows and every row belongs to one task, so the gradient of task t
is the sum over devices of the gradient of the device's rows of task t. `method="devices"`
of `ktx.optim.compute_task_gradients` computes it that way, inside a `jax.shard_map` that
is manual over the mesh's `data` axis (the `model` axis stays with XLA's partitioner):

1. Each device runs one forward pass over its `B / data` rows and one vector-Jacobian
   product per *slot*: slot j is the j-th task present among the device's rows (its
   cotangent `e_t / normalizer_t`). With the rows grouped by task, a device holds the rows
   of one task, or of two where a task boundary falls inside its rows; `slots` (static)
   is the most any device holds (`device_slots`). With one slot the device does exactly
   what the plain step does: one forward and one backward pass over its rows.
2. The devices' slot gradients `[slots, *shape]` are exchanged with one `all_to_all` over
   `data` along a parameter dimension divisible by the axis (`scatter_dims`): afterwards
   each device holds `1 / data` of every device's slot gradients, `[data * slots, ...,
   shape[k] / data, ...]`, and adds them up by task (a segment sum) into `[T, ...,
   shape[k] / data, ...]`. Per device this moves what the plain step's gradient
   reduce-scatter moves, and keeps `T` gradient shards laid out like the parameters
   (split over `data` along dimension k, the dimension the parameter itself is split
   over `data` along with `parameter_partitioning_dims=2`). A parameter with no such
   dimension (small vectors) is all-gathered and summed: `[T, *shape]` on every device.
3. The per-task sums and aux sums are `psum`med over `data`.

No task block is padded to the `data` axis (the blocks path rounds every block up to a
multiple of it: 16 rows of a task on a 128-way axis computed 128 rows), and no device
holds all T gradients of a whole parameter that is split over `data`. The balancers
then take norms, Grams and the weighted combination of the sharded `[T, ...]` leaves;
XLA reduces the `[T]` / `[T, T]` partial sums over `data`.

Inside the manual region the model's activation constraints lose their `batch -> data`
rule (the rows are already split): the logical axis rules are the caller's with `data`
mapped to None.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from ktx import param_gather
from ktx.partitioning import DATA

__all__ = ["device_slots", "per_device_task_gradients", "default_scatter_dim", "slots_advice"]


def device_slots(counts: Sequence[int], data: int) -> int:
    """The most tasks any device holds rows of, for a batch grouped by task with `counts`
    rows per task and split into `data` equal contiguous row ranges (at least 1)."""
    counts = [int(c) for c in counts]
    rows = sum(counts)
    if data < 1 or rows % data:
        raise ValueError(f"device_slots: {rows} rows do not split over data={data} devices")
    per = rows // data
    ends = np.cumsum(counts)
    starts = ends - np.asarray(counts)
    most = 1
    for d in range(data):
        lo, hi = d * per, (d + 1) * per
        n = sum(1 for s, e, c in zip(starts, ends, counts) if c and s < hi and e > lo)
        most = max(most, n)
    return most


def slots_advice(counts_per_step: Sequence[Sequence[int]], data: int) -> str | None:
    """One line for a balanced run that takes per-task gradients device by device on a
    `data`-way axis, when its task-grouped batches (`counts_per_step`, rows per task of some
    steps) put several tasks' rows on one device, which then runs one backward pass per
    task it holds: the cost (the Trainer's estimate; "auto" takes the task blocks where
    they are cheaper) and the binding that puts one task on each device (rows in blocks
    of `B / data`, `ktx.data.mixing.Mixing.block_rows`). None when every device holds one
    task, or `data` is 1."""
    steps = [tuple(int(c) for c in counts) for counts in counts_per_step]
    if data < 2 or not steps or sum(steps[0]) % data:
        return None
    rows = sum(steps[0])
    slots = max(device_slots(c, data) for c in steps)
    if slots == 1:
        return None
    # The blocks the Trainer would compile instead: each task's most rows, padded to the axis.
    padded = sum(min(-(-max(col) // data) * data, rows) for col in zip(*steps)) / rows
    cost, block = min((1 + 2 * slots) / 3, padded), rows // data
    return (f"Balanced step: up to {slots} tasks' rows on one of the {data} data devices, so "
            f"per-task gradients cost up to ~{cost:.1f}x a plain step; rows in blocks of "
            f"{block} (batch / data) put one task on each device: "
            f"--gin.pipeline.MultiTaskInput.mixing=@mixing.Mixing() "
            f"--gin.mixing.Mixing.block_rows={block}")


def default_scatter_dim(shape: Sequence[int], ways: int, avoid: Sequence[int] = ()) -> int | None:
    """The largest dimension of `shape` divisible by `ways` (not one of `avoid`, the
    dimensions split over `model`), or None."""
    best = None
    for k, n in enumerate(shape):
        if k in avoid or n % ways or n < ways:
            continue
        if best is None or n > shape[best]:
            best = k
    return best


def _rules_without_data() -> tuple:
    rules = nn.get_logical_axis_rules()
    return tuple((name, None if axis == DATA else axis) for name, axis in rules)


def per_device_task_gradients(
    loss_sums_fn,
    normalizer: jax.Array,
    params: Any,
    batch: dict,
    *,
    num_tasks: int,
    slots: int,
    scatter_dims: Sequence[int | None] | None = None,
    split: Sequence[bool] | None = None,
    layouts: Sequence[tuple | None] | None = None,
    dtype: Any = None,
) -> tuple[jax.Array, Any, Any]:
    """`(sums [T], aux, grads)`: the batch's per-task loss sums and aux sums, and the
    params-structured per-task gradients `[T, *shape]` (split over `data` along
    `scatter_dims[i]` for leaf i; see the module docstring). Call inside `jax.jit` under a
    mesh (`jax.set_mesh`) whose `data` axis has more than one device and divides the rows.

    `slots` must be at least the number of distinct tasks among any device's rows
    (`device_slots`); a device's tasks beyond it would be dropped, so callers that do not
    know the layout check it (`check_slots`).

    `split[i]`: leaf i is split over `data` along `scatter_dims[i]` (its sharding, with
    `parameter_partitioning_dims=2`): it enters the region as each device's shard and is
    gathered where it is used, a scanned stack's layer at a time (`ktx.param_gather`),
    its per-task gradient shards made in the gather's backward pass. Needs `slots == 1`
    (one task's rows on each device: `ktx.data.mixing.Mixing.block_rows`).

    `layouts[i]`: leaf i's mesh axes other than `data`, one entry per dimension (its
    `PartitionSpec` with `data` removed), which a gathered parameter, its gradients and
    their exchange keep inside the region (`ktx.param_gather.SplitParam`); None: XLA's
    partitioner makes every collective's operand whole over `model` (a whole token
    table, every head of a layer)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or DATA not in mesh.axis_names:
        raise ValueError("method='devices' needs a mesh with a 'data' axis (jax.set_mesh)")
    ways = dict(mesh.shape)[DATA]
    leaves, treedef = jax.tree.flatten(params)
    if scatter_dims is None:
        scatter_dims = [default_scatter_dim(x.shape, ways) for x in leaves]
    scatter_dims = list(scatter_dims)
    if len(scatter_dims) != len(leaves):
        raise ValueError(f"scatter_dims has {len(scatter_dims)} entries for {len(leaves)} "
                         "parameters")
    for x, k in zip(leaves, scatter_dims):
        if k is not None and (k >= x.ndim or x.shape[k] % ways):
            raise ValueError(f"scatter_dims: dimension {k} of a parameter of shape {x.shape} "
                             f"does not split over data={ways}")
    rows = {v.shape[0] for v in batch.values()}
    if len(rows) != 1 or next(iter(rows)) % ways:
        raise ValueError(f"method='devices': the batch's {rows} rows must split evenly over "
                         f"data={ways} devices")
    rules = _rules_without_data()
    layouts = [None] * len(leaves) if layouts is None else [
        None if lay is None else tuple(lay) for lay in layouts]
    if len(layouts) != len(leaves):
        raise ValueError(f"layouts has {len(layouts)} entries for {len(leaves)} parameters")
    split = [False] * len(leaves) if split is None else list(split)
    if len(split) != len(leaves):
        raise ValueError(f"split has {len(split)} entries for {len(leaves)} parameters")
    if any(s and k is None for s, k in zip(split, scatter_dims)):
        raise ValueError("split: a parameter split over data needs its scatter dimension")
    if any(split):
        if slots != 1:
            raise ValueError(
                f"method='devices' with parameters split over data needs one task's rows on "
                f"each device (slots=1, got {slots}): rows in blocks of batch / data "
                f"(--gin.mixing.Mixing.block_rows), or parameter_partitioning_dims=1")
        return _split_task_gradients(loss_sums_fn, normalizer, params, batch, num_tasks,
                                     scatter_dims, split, layouts, rules, dtype)

    def local(p, b, norm):
        with nn.logical_axis_rules(rules):
            present = jnp.bincount(b["task_id"], length=num_tasks) > 0
            (tasks,) = jnp.nonzero(present, size=slots, fill_value=num_tasks)
            sums, vjp_fn, aux = jax.vjp(lambda q: loss_sums_fn(q, b), p, has_aux=True)
            # Slot j's cotangent: e_{tasks[j]} / normalizer (zero for an unused slot).
            cot = jax.nn.one_hot(tasks, num_tasks, dtype=sums.dtype) / norm.astype(sums.dtype)
            grads = jax.vmap(lambda c: vjp_fn(c)[0])(cot)  # [slots, *shape] per leaf
        all_tasks = jax.lax.all_gather(tasks, DATA, tiled=True)  # [data * slots]
        out = [param_gather.sum_by_task(g, k, all_tasks, num_tasks, dtype, lay)
               for g, k, lay in zip(jax.tree.leaves(grads), scatter_dims, layouts)]
        sums = jax.lax.psum(sums, DATA)
        aux = jax.tree.map(lambda a: jax.lax.psum(a, DATA), aux)
        return sums, aux, treedef.unflatten(out)

    def spec(k, ndim):
        if k is None:
            return PartitionSpec()
        return PartitionSpec(*([None] * (k + 1)), DATA, *([None] * (ndim - k - 1)))

    grad_specs = treedef.unflatten([spec(k, x.ndim) for x, k in zip(leaves, scatter_dims)])
    fn = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(PartitionSpec(), PartitionSpec(DATA), PartitionSpec()),
        out_specs=(PartitionSpec(), PartitionSpec(), grad_specs),
        axis_names={DATA},
        check_vma=False,
    )
    return fn(params, dict(batch), normalizer)


def _spec(k: int | None, ndim: int, lead: int = 0) -> PartitionSpec:
    """`data` on dimension `k` of a `lead`-prefixed array (None: replicated)."""
    if k is None:
        return PartitionSpec()
    return PartitionSpec(*([None] * (k + lead)), DATA, *([None] * (ndim - k - 1)))


def _split_task_gradients(loss_sums_fn, normalizer, params, batch, num_tasks, scatter_dims,
                          split, layouts, rules, dtype=None):
    """`per_device_task_gradients` with some parameters split over `data` (`split`), one
    task on each device: one forward and one backward pass per device, whose split
    parameters are gathered where used (`ktx.param_gather`)."""
    from ktx.treepath import name as path_str

    leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(params)
    leaves = [x for _, x in leaves_with_paths]
    paths = [path_str(p) for p, _ in leaves_with_paths]
    # Which scanned stacks gather their layers, and which parameters their modules read
    # through `param_gather.contract` (one trace of the model, nothing computed): both
    # enter the model as `SplitParam`s, the others are gathered where the region starts.
    # A fresh function: `eval_shape` caches traces by function, and a cached trace of
    # `loss_sums_fn` would run none of the model's Python and record nothing.
    with param_gather.recording() as found:
        jax.eval_shape(lambda p, b: loss_sums_fn(p, b), params, batch)
    prefixes = ["/".join(map(str, s)) + "/" for s in found.stacks]
    stacked = [any(p.startswith(pre) for pre in prefixes) for p in paths]
    contracted = {"/".join(map(str, c)) for c in found.contracted}
    left_split = [st or p in contracted for p, st in zip(paths, stacked)]

    def local(p, b, norm):
        p_leaves = jax.tree.leaves(p)
        tid = b["task_id"]
        present = jnp.bincount(tid, length=num_tasks) > 0
        (task,) = jnp.nonzero(present, size=1, fill_value=num_tasks)
        tasks = jax.lax.all_gather(task, DATA, tiled=True)  # [data]
        whole = [x for x, s in zip(p_leaves, split) if not s]
        accs = [param_gather.split_param(x, k, num_tasks, int(st), dtype, lay).acc
                for x, k, s, st, lay in zip(p_leaves, scatter_dims, split, stacked, layouts)
                if s]

        def loss(whole, accs):
            it_w, it_a, out = iter(whole), iter(accs), []
            for x, k, s, ls, lay in zip(p_leaves, scatter_dims, split, left_split, layouts):
                if not s:
                    out.append(next(it_w))
                    continue
                node = param_gather.SplitParam(x, next(it_a), k - x.ndim, lay)
                out.append(node if ls else param_gather.gather(node))
            return loss_sums_fn(treedef.unflatten(out), b)

        with nn.logical_axis_rules(rules), param_gather.gathering(tasks, num_tasks):
            sums, vjp_fn, aux = jax.vjp(loss, whole, accs, has_aux=True)
            cot = jax.nn.one_hot(task[0], num_tasks, dtype=sums.dtype) / norm.astype(sums.dtype)
            g_whole, g_accs = vjp_fn(cot)
        it_w, it_a, out = iter(g_whole), iter(g_accs), []
        for k, s, st, lay in zip(scatter_dims, split, stacked, layouts):
            if s:
                g = next(it_a)  # [T, *shard], or [L, T, *shard] for a scanned stack's
                out.append(jnp.moveaxis(g, 1, 0) if st else g)
                continue
            out.append(param_gather.sum_by_task(next(it_w)[None], k, tasks, num_tasks, dtype,
                                                lay))
        sums = jax.lax.psum(sums, DATA)
        aux = jax.tree.map(lambda a: jax.lax.psum(a, DATA), aux)
        return sums, aux, treedef.unflatten(out)

    param_specs = treedef.unflatten([_spec(k, x.ndim) if s else PartitionSpec()
                                     for x, k, s in zip(leaves, scatter_dims, split)])
    grad_specs = treedef.unflatten([_spec(k, x.ndim, lead=1)
                                    for x, k in zip(leaves, scatter_dims)])
    fn = jax.shard_map(
        local,
        mesh=jax.sharding.get_abstract_mesh(),
        in_specs=(param_specs, PartitionSpec(DATA), PartitionSpec()),
        out_specs=(PartitionSpec(), PartitionSpec(), grad_specs),
        axis_names={DATA},
        check_vma=False,
    )
    return fn(params, dict(batch), normalizer)
