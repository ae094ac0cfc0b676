"""Sparse per-task gradients of embedding tables (`flax.linen.Embed` lookups, or any
module whose `embedding` parameter is read through `__call__(ids)`, as T5's `Embed`).

A task's gradient of a gathered table touches only the rows it looked up. Instead of a
`[T, vocab, dim]` gradient, the engine differentiates with respect to the *looked-up
rows*: the table is held constant, and every lookup `table[idx]` of a selected table is
intercept-ed (`flax.linen.intercept_methods`) and returned as `table[idx] + delta`,
with `delta` a zero input of the lookup's shape. The gradient with respect to `delta` is
each occurrence's row gradient: `SparseRows` with one row per lookup (an index may
repeat inside a task; the norms and Grams of `ktx.optim.task_gradients` see each index
once, merging or pairing the duplicates only where they are needed), which a balancer
scatters once into the table's update.

A selected table must only be used through its module's `__call__`; `attend` (tied
output embeddings) raises, since its gradient is dense.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from ktx.optim.selection import param_names
from ktx.optim.task_gradients import SparseRows

__all__ = ["SparseLookups"]


class SparseLookups:
    """Rewrites `loss_sums_fn` so selected tables are differentiated through their rows.

    Args:
      loss_sums_fn: `(params, batch) -> (sums [T], aux)`.
      params: the parameter tree.
      patterns: regexes on parameter paths selecting tables (the `embedding` leaf of an
        `nn.Embed`, e.g. `r"_embedding/embedding$"`).
    """

    def __init__(self, loss_sums_fn: Callable, params: Any, patterns: Sequence[str]):
        compiled = [re.compile(p) for p in patterns]
        self.names = param_names(params)
        self.leaves, self.treedef = jax.tree.flatten(params)
        self.table_ids = [i for i, n in enumerate(self.names) if any(p.search(n) for p in compiled)]
        if not self.table_ids:
            raise ValueError(
                f"sparse_tables={list(patterns)!r} matches no parameter; names: {self.names[:20]}"
            )
        self.table_names = [self.names[i] for i in self.table_ids]
        self.loss_sums_fn = loss_sums_fn

    def _interceptor(self, deltas: list | None, record: list):
        def intercept(next_fun, args, kwargs, context):
            module = context.module
            name = "/".join(tuple(str(p) for p in module.path) + ("embedding",))
            if name not in self.table_names:
                return next_fun(*args, **kwargs)
            if context.method_name == "attend":
                raise ValueError(
                    f"sparse_tables: {name} is also used by {type(module).__name__}.attend (a "
                    "dense gradient, e.g. tied output embeddings); leave it out of sparse_tables"
                )
            if context.method_name != "__call__":
                return next_fun(*args, **kwargs)
            idx = jnp.asarray(args[0] if args else kwargs["inputs"])
            # The table is a constant of `fn`'s differentiated function, so the lookup
            # itself (with the module's dtype and sharding constraints) gives no table
            # gradient; `delta` carries the rows'.
            out = next_fun(*args, **kwargs)
            k = len(record)
            record.append((name, idx))
            if deltas is not None:
                out = out + deltas[k].astype(out.dtype)
            return out

        return intercept

    def split(self, params: Any) -> list:
        """The non-table leaves of `params` (what is differentiated densely)."""
        leaves = jax.tree.leaves(params)
        return [x for i, x in enumerate(leaves) if i not in self.table_ids]

    def _full(self, dense: list, tables: list) -> Any:
        it_d, it_t = iter(dense), iter(tables)
        return self.treedef.unflatten(
            [next(it_t) if i in self.table_ids else next(it_d) for i in range(len(self.leaves))]
        )

    def delta_specs(self, params: Any, batch: Any) -> list[jax.ShapeDtypeStruct]:
        """Shapes of every selected lookup's output for `batch` (in call order)."""
        specs: list = []

        def probe(p, b):
            record: list = []
            with nn.intercept_methods(self._interceptor(None, record)):
                self.loss_sums_fn(p, b)
            return [jnp.zeros(idx.shape + (self.leaves[self.names.index(n)].shape[-1],),
                              self.leaves[self.names.index(n)].dtype) for n, idx in record]

        specs = jax.eval_shape(probe, params, batch)
        if not specs:
            raise ValueError(
                f"sparse_tables {self.table_names}: no nn.Embed lookup of them happened in "
                "loss_sums_fn"
            )
        return specs

    def fn(self, params: Any, wrap: Callable | None = None) -> Callable:
        """`(dense_leaves, deltas, batch) -> (sums, (aux, indices))`; `wrap`, if given,
        maps the whole parameter tree before `loss_sums_fn` reads it."""
        tables = [jax.tree.leaves(params)[i] for i in self.table_ids]

        def f(dense, deltas, batch):
            record: list = []
            full = self._full(dense, tables)
            with nn.intercept_methods(self._interceptor(deltas, record)):
                sums, aux = self.loss_sums_fn(full if wrap is None else wrap(full), batch)
            return sums, (aux, [idx for _, idx in record])

        return f

    def assemble(
        self, params: Any, dense_grads: list, delta_grads: list, indices: list, num_tasks: int
    ) -> Any:
        """A params tree: stacked dense grads, and `SparseRows` for every table.

        `delta_grads[k]`: `[T, *idx_shape, dim]`; `indices[k]`: `[T, *idx_shape]`.
        """
        tables = self.table_rows(delta_grads, indices, num_tasks)
        it_d = iter(dense_grads)
        out = [tables[self.names[i]] if i in self.table_ids else next(it_d)
               for i in range(len(self.leaves))]
        return self.treedef.unflatten(out)

    def table_rows(self, delta_grads: list, indices: list, num_tasks: int) -> dict[str, Any]:
        """Every table's per-task gradient by name: `SparseRows` of its lookups' rows
        (`delta_grads[k]` `[T, *idx_shape, dim]`, `indices[k]` `[T, *idx_shape]`, in call
        order), or zeros `[T, *table_shape]` for a table no lookup read."""
        per_table: dict[str, tuple[list, list]] = {n: ([], []) for n in self.table_names}
        for name, g, idx in zip(self.call_names, delta_grads, indices):
            d = g.shape[-1]
            per_table[name][0].append(idx.reshape(num_tasks, -1))
            per_table[name][1].append(g.reshape(num_tasks, -1, d))
        out = {}
        for i in self.table_ids:
            name, leaf = self.names[i], self.leaves[i]
            idx_l, rows_l = per_table[name]
            if not idx_l:
                out[name] = jnp.zeros((num_tasks,) + leaf.shape, leaf.dtype)
                continue
            idx = jnp.concatenate(idx_l, axis=1).astype(jnp.int32)
            rows = jnp.concatenate(rows_l, axis=1)
            out[name] = SparseRows(idx, rows.astype(leaf.dtype), num_rows=leaf.shape[0])
        return out

    def call_names_for(self, params: Any, batch: Any) -> None:
        """Records which table each lookup (in call order) reads."""
        names: list = []

        def probe(p, b):
            record: list = []
            with nn.intercept_methods(self._interceptor(None, record)):
                self.loss_sums_fn(p, b)
            names.extend(n for n, _ in record)
            return 0

        jax.eval_shape(probe, params, batch)
        self.call_names = names
