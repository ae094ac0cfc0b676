"""`compute_task_gradients(method="taps")`: per-task gradients in one backward pass.

Every balanced parameter gets a zero tap `[T, *shape]` beside it (`ktx.task_taps`); the
model runs once over the whole batch, its examples grouped by task in static blocks, and
one backward pass gives the plain gradient of the unbalanced parameters and, as the taps'
gradients, every task's gradient of the balanced ones. The blocks method differentiates
the model under `vmap` over the task blocks instead, so that every activation's cotangent
carries the task axis too; the two give the same gradients (tests/optim/test_taps.py).

It applies where every balanced parameter is read through a tap (T5's, BERT's, CA-MTL's
and the recommendation model's layers; an `nn.Embed` table of `sparse_tables` through its looked-up
rows, `ktx.optim.sparse`) and the examples per task are static; a parameter also read
without its tap (`task_taps.read_directly`) gets none. `plan` says whether it
does: a shape-only trace of the model under `task_taps.recording` lists the parameters
read through a tap.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ktx import task_taps, treepath
from ktx.optim.selection import param_names, shared_mask
from ktx.optim.sparse import SparseLookups
from ktx.optim.task_gradients import SparseRows, TaskGradients, leaf_combine

__all__ = ["Plan", "plan", "task_gradients"]


class Plan:
    """Which parameters get a tap: `taps`, `{leaf index: stacked layer dims}` of the
    balanced ones read through a tap; `missing`, the names of balanced parameters (sparse
    tables aside) that are not, which rule the method out."""

    def __init__(self, names: list[str], shared: list[bool], taps: dict[int, int],
                 missing: list[str]):
        self.names, self.shared, self.taps, self.missing = names, shared, taps, missing


def plan(loss_sums_fn: Callable, params: Any, batch: Mapping, sizes: Sequence[int],
         shared: Any, sparse_tables: Sequence[str] | None) -> Plan:
    """Traces `loss_sums_fn` (shapes only) to find the parameters read through taps."""
    names = param_names(params)
    leaves = jax.tree.leaves(params)
    flags = [bool(f) for f in jax.tree.leaves(shared_mask(params, shared))]
    tables = SparseLookups(loss_sums_fn, params, sparse_tables).table_ids if sparse_tables else []
    found: list = []

    def probe(p, b):
        with task_taps.recording(sizes) as record:
            loss_sums_fn(p, b)
        found.extend(record)
        return 0

    jax.eval_shape(probe, params, dict(batch))
    index = {n: i for i, n in enumerate(names)}
    # Parameters also read without their tap (`task_taps.read_directly`) get none.
    direct = {index.get("/".join(str(p) for p in path)) for path, seen in found if seen is None}
    taps: dict[int, int] = {}
    for path, seen in found:
        i = index.get("/".join(str(p) for p in path))
        if i is None or not flags[i] or i in tables or i in direct:
            continue
        lead = np.ndim(leaves[i]) - len(seen)
        if lead < 0 or tuple(np.shape(leaves[i])[lead:]) != tuple(seen):
            raise ValueError(f"task taps: {names[i]} of shape {np.shape(leaves[i])} was read "
                             f"with shape {seen}")
        taps[i] = lead
    missing = [names[i] for i, f in enumerate(flags)
               if f and i not in tables and i not in taps]
    return Plan(names, flags, taps, missing)


def _zeros(leaf: Any, lead: int, num_tasks: int) -> jax.Array:
    shape = tuple(np.shape(leaf))
    return jnp.zeros(shape[:lead] + (num_tasks,) + shape[lead:], leaf.dtype)


def _with_taps(params: Any, taps: dict[str, jax.Array]) -> dict:
    """`params` (nested mappings) with every tap beside its parameter."""
    flat = treepath.flatten(params)
    flat.update({name + task_taps.SUFFIX: tap for name, tap in taps.items()})
    return treepath.unflatten(flat)


def _per_task_lookups(values: list, sizes: tuple[int, ...]) -> list:
    """Each lookup's `[N, ...]` ids or row gradients as `[T, K, ...]`: a task's examples
    (`sizes`), padded with zeros (id 0, zero rows: they add nothing) to the most."""
    out = []
    for v in values:
        if len(set(sizes)) == 1:
            out.append(v.reshape((len(sizes), -1) + v.shape[1:]))
            continue
        most = max(sizes)
        pieces, start = [], 0
        for k in sizes:
            part = v[start:start + k]
            pad = [(0, most - k)] + [(0, 0)] * (v.ndim - 1)
            pieces.append(jnp.pad(part, pad))
            start += k
        out.append(jnp.stack(pieces))
    return out


def task_gradients(loss_sums_fn: Callable, normalizer: jax.Array, params: Any,
                   batch: Mapping, num_tasks: int, sizes: tuple[int, ...], the_plan: Plan,
                   sparse_tables: Sequence[str] | None) -> tuple[jax.Array, Any, TaskGradients]:
    """`(sums [T], aux, TaskGradients)` of the whole batch (see the module docstring)."""
    leaves, treedef = jax.tree.flatten(params)
    names = the_plan.names
    taps = {names[i]: _zeros(leaves[i], lead, num_tasks) for i, lead in the_plan.taps.items()}
    # The objective's weights; a task without rows (normalizer 0) adds nothing.
    inverse = jnp.where(normalizer > 0, 1.0 / jnp.where(normalizer > 0, normalizer, 1.0), 0.0)

    def per_task(i):
        g = tap_grads[names[i]]
        return jnp.moveaxis(g, the_plan.taps[i], 0)

    if not sparse_tables:
        def f(p, tp):
            with task_taps.by_task(sizes):
                sums, aux = loss_sums_fn(_with_taps(p, tp), batch)
            return jnp.sum(sums * inverse.astype(sums.dtype)), (sums, aux)

        (_, (sums, aux)), (plain, tap_grads) = jax.value_and_grad(
            f, argnums=(0, 1), has_aux=True)(params, taps)
        plain = jax.tree.leaves(plain)
        table_rows: dict = {}
    else:
        sl = SparseLookups(loss_sums_fn, params, sparse_tables)
        sl.call_names_for(params, dict(batch))
        deltas = [jnp.zeros(s.shape, s.dtype) for s in sl.delta_specs(params, dict(batch))]

        def g(dense, d, tp):
            fn = sl.fn(params, wrap=lambda full: _with_taps(full, tp))
            with task_taps.by_task(sizes):
                sums, (aux, idx) = fn(dense, d, batch)
            return jnp.sum(sums * inverse.astype(sums.dtype)), (sums, aux, idx)

        (_, (sums, aux, idx)), (dense_grads, row_grads, tap_grads) = jax.value_and_grad(
            g, argnums=(0, 1, 2), has_aux=True)(sl.split(params), deltas, taps)
        it = iter(dense_grads)
        plain = [None if i in sl.table_ids else next(it) for i in range(len(leaves))]
        table_rows = sl.table_rows(_per_task_lookups(row_grads, sizes),
                                   _per_task_lookups(idx, sizes), num_tasks)

    stacked, summed = [], []
    for i, name in enumerate(names):
        if name in table_rows:
            rows = table_rows[name]
            if the_plan.shared[i]:
                stacked.append(rows)
                summed.append(None)
            else:
                stacked.append(None)
                summed.append(leaf_combine(rows, jnp.ones((num_tasks,), jnp.float32))
                              if isinstance(rows, SparseRows) else rows.sum(0))
        elif the_plan.shared[i]:
            stacked.append(per_task(i))
            summed.append(None)
        else:
            stacked.append(None)
            summed.append(plain[i])
    return sums, aux, TaskGradients(stacked=treedef.unflatten(stacked),
                                    summed=treedef.unflatten(summed))
