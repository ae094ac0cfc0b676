"""Per-task gradients as one pytree, and the per-tensor algebra balancers need.

`TaskGradients` is what `compute_task_gradients` returns and what every balancing
transform accepts as `updates`:

* `stacked`: params-structured; a shared parameter's leaf is its per-task gradients
  `[T, *param_shape]` (or `SparseRows` for an embedding table gathered sparsely);
  unshared parameters hold `None`.
* `summed`: params-structured; an unshared parameter's leaf is the sum of its task
  gradients `[*param_shape]`; shared parameters hold `None`.

A plain params-structured tree of `[T, *param_shape]` arrays is accepted too (every
parameter shared); `as_task_gradients` converts it.

`SparseRows` holds a table's per-task gradient as rows: `indices [T, n]` and
`rows [T, n, dim]`, with duplicate indices already merged inside each task (merged
duplicates leave zero rows behind), so each task's gradient norm is the norm of its
rows and `table_grad = sum_t scatter(indices[t], w_t * rows[t])` needs one scatter and
never a `[T, vocab, dim]` tensor.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

__all__ = [
    "TaskGradients",
    "SparseRows",
    "as_task_gradients",
    "flatten_task_gradients",
    "leaf_sq_norms",
    "leaf_gram",
    "leaf_combine",
    "leaf_dense",
    "num_tasks_of",
    "global_gram",
    "combine_with_weights",
]


@flax.struct.dataclass
class SparseRows:
    """Per-task gradient rows of a `[num_rows, dim]` table (see module docstring)."""

    indices: jax.Array  # int32 [T, n]
    rows: jax.Array  # [T, n, dim]
    num_rows: int = flax.struct.field(pytree_node=False)

    @property
    def num_tasks(self) -> int:
        return self.rows.shape[0]

    @property
    def dtype(self):
        return self.rows.dtype


@flax.struct.dataclass
class TaskGradients:
    """Stacked per-task gradients of shared params, summed gradients of the rest."""

    stacked: Any
    summed: Any


def _is_hole(x: Any) -> bool:
    return x is None or isinstance(x, SparseRows)


def as_task_gradients(updates: Any) -> TaskGradients:
    """`updates` itself if it is a `TaskGradients`, else every leaf is stacked `[T, ...]`."""
    if isinstance(updates, TaskGradients):
        return updates
    summed = jax.tree.map(lambda _: None, updates, is_leaf=lambda x: isinstance(x, SparseRows))
    return TaskGradients(stacked=updates, summed=summed)


def flatten_task_gradients(updates: Any) -> tuple[list, list, Any]:
    """`(stacked_leaves, summed_leaves, treedef)`: one entry per parameter, holes are None.

    `treedef.unflatten(list_of_arrays)` builds a params-shaped tree.
    """
    tg = as_task_gradients(updates)
    stacked, treedef = jax.tree.flatten(tg.stacked, is_leaf=_is_hole)
    summed, treedef2 = jax.tree.flatten(tg.summed, is_leaf=_is_hole)
    if treedef != treedef2 or len(stacked) != len(summed):
        raise ValueError(
            "TaskGradients.stacked and .summed must have the same params structure; got "
            f"{treedef} and {treedef2}"
        )
    for i, (s, u) in enumerate(zip(stacked, summed)):
        if (s is None) == (u is None):
            raise ValueError(
                f"TaskGradients leaf {i}: exactly one of stacked/summed must be set, got "
                f"stacked={type(s).__name__}, summed={type(u).__name__}"
            )
    return stacked, summed, treedef


def num_tasks_of(stacked_leaves: list) -> int:
    """The task count T shared by every stacked leaf (ValueError if they disagree)."""
    sizes = {x.num_tasks if isinstance(x, SparseRows) else x.shape[0]
             for x in stacked_leaves if x is not None}
    if len(sizes) != 1:
        raise ValueError(
            f"per-task gradients must all have the same leading task axis; got sizes {sizes}"
            if sizes else "per-task gradients hold no stacked (shared) parameter"
        )
    return sizes.pop()


def leaf_sq_norms(x: Any) -> jax.Array:
    """`[T]` squared L2 norm of each task's gradient of one parameter (float32)."""
    if isinstance(x, SparseRows):
        r = x.rows.astype(jnp.float32)
        return jnp.sum(r * r, axis=tuple(range(1, r.ndim)))
    x = x.astype(jnp.float32)
    return jnp.sum(x * x, axis=tuple(range(1, x.ndim)))


def leaf_dense(x: Any) -> jax.Array:
    """`[T, *param_shape]` dense per-task gradients (densifies `SparseRows`)."""
    if not isinstance(x, SparseRows):
        return x
    t, n, d = x.rows.shape

    def one(idx, rows):
        return jnp.zeros((x.num_rows, d), rows.dtype).at[idx].add(rows)

    return jax.vmap(one)(x.indices, x.rows)


def leaf_gram(x: Any) -> jax.Array:
    """`[T, T]` inner products between tasks' gradients of one parameter (float32).

    For `SparseRows` the tables are densified one task at a time (`lax.map`), so the
    peak is one table, never `[T, vocab, dim]`.
    """
    if isinstance(x, SparseRows):
        rows = x.rows.astype(jnp.float32)

        def row_of_gram(args):
            idx, r = args
            dense = jnp.zeros((x.num_rows, rows.shape[-1]), jnp.float32).at[idx].add(r)
            gathered = dense[x.indices]  # [T, n, dim]
            return jnp.einsum("tnd,tnd->t", gathered, rows)

        return jax.lax.map(row_of_gram, (x.indices, rows))
    f = x.astype(jnp.float32).reshape(x.shape[0], -1)
    return f @ f.T


def leaf_combine(x: Any, weights: jax.Array) -> jax.Array:
    """`sum_t weights[t] * grad_t` of one parameter, in the gradient's dtype."""
    if isinstance(x, SparseRows):
        w = weights.astype(x.rows.dtype)
        t, n, d = x.rows.shape
        scaled = (x.rows * w[:, None, None]).reshape(t * n, d)
        return jnp.zeros((x.num_rows, d), x.rows.dtype).at[x.indices.reshape(-1)].add(scaled)
    w = weights.astype(x.dtype)
    return jnp.tensordot(w, x, axes=1)


def global_gram(stacked_leaves: list) -> jax.Array:
    """`[T, T]` inner products of the concatenated shared gradients of all tasks."""
    grams = [leaf_gram(x) for x in stacked_leaves if x is not None]
    return sum(grams[1:], grams[0])


def combine_with_weights(updates: Any, weights: Any) -> Any:
    """Params-shaped `sum_t w_t g_t` for shared params plus the summed unshared ones.

    `weights` is one `[T]` array (used for every shared parameter) or a list with one
    `[T]` array (or None for unshared) per parameter in `jax.tree.leaves` order.
    """
    stacked, summed, treedef = flatten_task_gradients(updates)
    if not isinstance(weights, (list, tuple)):
        weights = [weights] * len(stacked)
    out = []
    for s, u, w in zip(stacked, summed, weights):
        out.append(u if s is None else leaf_combine(s, w))
    return treedef.unflatten(out)
