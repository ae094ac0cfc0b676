"""Per-task gradients as one pytree, and the per-tensor algebra balancers need.

`TaskGradients` is what `compute_task_gradients` returns and what every balancing
transform accepts as `updates`:

* `stacked`: params-structured; a shared parameter's leaf is its per-task gradients
  `[T, *param_shape]` (or `SparseRows` for an embedding table gathered sparsely);
  unshared parameters hold `None`.
* `summed`: params-structured; an unshared parameter's leaf is the sum of its task
  gradients `[*param_shape]`; shared parameters hold `None`.

A plain params-structured tree of `[T, *param_shape]` arrays (every parameter shared)
must be wrapped explicitly: `TaskGradients.from_stacked(tree)`. A balancer never infers the
task axis from shapes (a plain gradient tree whose leaves happen to start with T would be
misread), so a tree that is not a `TaskGradients` is a TypeError.

`TaskGradients` is a registered pytree (its leaves are the arrays of `stacked` and
`summed`), so it crosses `jax.jit`, `lax.cond` and `jax.tree.map` like any gradient tree.

`SparseRows` holds a table's per-task gradient as rows: `indices [T, n]` and
`rows [T, n, dim]`, task t's gradient being `scatter_add(indices[t], rows[t])`; an index
may repeat inside a task (one row per lookup, as the engine gives them). So
`table_grad = sum_t scatter(indices[t], w_t * rows[t])` needs one scatter and never a
`[T, vocab, dim]` tensor. Norms and inner products must see each index once: the
functions below either merge a task's duplicates (sort + segment sum, `merge_rows`) or,
on GPUs and for few rows, take every pair of rows with equal indices (one `[n, n]` product:
a couple of kernels where the merge is several). `sorted_unique=True` says the rows are
merged already.
"""

from __future__ import annotations

import math
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
    "sq_norms",
    "leaf_gram",
    "merge_rows",
    "with_merged_rows",
    "unique_rows",
    "sparse_sq_norms",
    "leaf_combine",
    "leaf_dense",
    "num_tasks_of",
    "global_gram",
    "combine_with_weights",
    "nonzero_tasks",
    "task_sum",
    "task_max",
]


@flax.struct.dataclass
class SparseRows:
    """Per-task gradient rows of a `[num_rows, dim]` table (see module docstring)."""

    indices: jax.Array  # int32 [T, n]
    rows: jax.Array  # [T, n, dim]
    num_rows: int = flax.struct.field(pytree_node=False)
    # Each task's indices ascending, duplicates merged, free slots (zero rows) last at
    # index num_rows - 1 (what `merge_rows` gives): nothing left to merge.
    sorted_unique: bool = flax.struct.field(pytree_node=False, default=False)

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

    @classmethod
    def from_stacked(cls, tree: Any) -> "TaskGradients":
        """Every parameter shared: `tree` is params-structured, each leaf `[T, *param_shape]`
        (or `SparseRows`); the leading axis of every leaf is the task axis."""
        if isinstance(tree, TaskGradients):
            raise TypeError("TaskGradients.from_stacked: the argument is already a TaskGradients")
        leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, SparseRows))
        for leaf in leaves:
            if not isinstance(leaf, SparseRows) and getattr(leaf, "ndim", 0) < 1:
                raise ValueError(
                    "TaskGradients.from_stacked: every leaf needs a leading task axis "
                    f"[T, *param_shape]; got a leaf of shape {getattr(leaf, 'shape', leaf)!r}")
        summed = jax.tree.map(lambda _: None, tree, is_leaf=lambda x: isinstance(x, SparseRows))
        return cls(stacked=tree, summed=summed)


def _is_hole(x: Any) -> bool:
    return x is None or isinstance(x, SparseRows)


def as_task_gradients(updates: Any, method: str = "balancer") -> TaskGradients:
    """`updates` if it is a `TaskGradients`; anything else is a TypeError.

    The task axis is never inferred from shapes: wrap a tree of `[T, *param_shape]` arrays
    with `TaskGradients.from_stacked(tree)`.
    """
    if isinstance(updates, TaskGradients):
        return updates
    kind = type(updates).__name__
    raise TypeError(
        f"{method}: updates must be per-task gradients, a ktx.optim.TaskGradients (what "
        f"ktx.optim.compute_task_gradients returns); got a {kind}. Wrap a params-structured "
        "tree of [T, *param_shape] arrays with ktx.optim.TaskGradients.from_stacked(tree); a "
        "plain gradient tree is never taken for stacked per-task gradients"
    )


def flatten_task_gradients(updates: Any, method: str = "balancer") -> tuple[list, list, Any]:
    """`(stacked_leaves, summed_leaves, treedef)`: one entry per parameter, holes are None.

    `treedef.unflatten(list_of_arrays)` builds a params-shaped tree. `updates` must be a
    `TaskGradients` (TypeError otherwise, naming `method`).
    """
    tg = as_task_gradients(updates, method)
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


def task_sum(x: jax.Array) -> jax.Array:
    """`x.sum(axis=0)` over a (static, small) leading task axis, as `x[0] + x[1] + ...`:
    the same left-to-right sum, but XLA:CPU reduces a leading axis element by element
    (~100x slower than these T-1 fused additions on a `[4, 32128, 32]` gradient)."""
    out = x[0]
    for t in range(1, x.shape[0]):
        out = out + x[t]
    return out


def task_max(x: jax.Array) -> jax.Array:
    """`x.max(axis=0)` over a leading task axis, unrolled (see `task_sum`)."""
    out = x[0]
    for t in range(1, x.shape[0]):
        out = jnp.maximum(out, x[t])
    return out


def leaf_sq_norms(x: Any) -> jax.Array:
    """`[T]` squared L2 norm of each task's gradient of one parameter (float32)."""
    if isinstance(x, SparseRows):
        return sparse_sq_norms([x])[0]
    x = x.astype(jnp.float32)
    return jnp.sum(x * x, axis=tuple(range(1, x.ndim)))


# `sq_norms` reduces the dense leaves in chunks of this many elements (the last chunk of
# each leaf zero-padded): one reduction over all of them, then one over each leaf's chunks.
NORM_CHUNK = 512


# `sq_norms` and `global_gram` reduce the dense leaves of at most this many elements per
# task together; a larger one on its own (on a CPU the concatenation is a copy).
BATCH_MAX_ELEMENTS = 1 << 16


def _partitioned() -> bool:
    """Whether the traced computation is split over several devices (a mesh of more than
    one device is set, as the Trainer does). Leaves of different shardings are then never
    concatenated: XLA would reshard them, all-to-alls and permutes every step (87 and 49
    in T5-tiny's MetaBalance step on a 4 x 2 mesh, against 10 and 4 leaf by leaf)."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and math.prod(dict(mesh.shape).values()) > 1


def _batched(x: Any) -> bool:
    return (not isinstance(x, SparseRows) and math.prod(x.shape[1:]) <= BATCH_MAX_ELEMENTS
            and not _partitioned())


def _chunked(leaves: list) -> tuple[jax.Array, list[int]]:
    """Dense `[T, ...]` leaves cut into `NORM_CHUNK`-element chunks (each leaf's last one
    zero-padded) and concatenated: `[T, chunks, NORM_CHUNK]` float32, and the chunk offset
    where each leaf starts (one more at the end). Only ever an operand of a reduction:
    XLA's GPU compiler fuses the padding and the concatenation into it; its CPU compiler
    copies the leaves once (hence `BATCH_MAX_ELEMENTS`)."""
    t = leaves[0].shape[0]
    parts, bounds = [], [0]
    for x in leaves:
        f = x.astype(jnp.float32).reshape(t, -1)
        k = -(-f.shape[1] // NORM_CHUNK)
        f = jnp.pad(f, ((0, 0), (0, k * NORM_CHUNK - f.shape[1])))
        parts.append(f.reshape(t, k, NORM_CHUNK))
        bounds.append(bounds[-1] + k)
    return jnp.concatenate(parts, axis=1), bounds


def sq_norms(leaves: list) -> list:
    """`[T]` squared norms of every leaf of `leaves` (None stays None), computed together.

    Equal to `[leaf_sq_norms(x) for x in leaves]`, but the dense leaves of at most
    `BATCH_MAX_ELEMENTS` elements per task are reduced as one `[T, chunks, NORM_CHUNK]`
    array (`_chunked`), then each leaf's chunk sums are added: a couple of kernels for a
    whole model, where one reduction per parameter is a launch each on a GPU. A larger
    leaf, whose reduction is long enough to pay for its launch, is reduced on its own, and
    the `SparseRows` leaves together (`sparse_sq_norms`)."""
    out = [None if x is None or _batched(x) or isinstance(x, SparseRows) else leaf_sq_norms(x)
           for x in leaves]
    sparse = [i for i, x in enumerate(leaves) if isinstance(x, SparseRows)]
    for i, sq in zip(sparse, sparse_sq_norms([leaves[i] for i in sparse]) if sparse else []):
        out[i] = sq
    dense = [i for i, x in enumerate(leaves) if x is not None and _batched(x)]
    if len(dense) < 2:
        for i in dense:
            out[i] = leaf_sq_norms(leaves[i])
        return out
    chunks, bounds = _chunked([leaves[i] for i in dense])
    per_chunk = jnp.sum(chunks * chunks, axis=2)  # [T, chunks]
    for j, i in enumerate(dense):
        out[i] = jnp.sum(per_chunk[:, bounds[j]:bounds[j + 1]], axis=1)
    return out


def leaf_dense(x: Any) -> jax.Array:
    """`[T, *param_shape]` dense per-task gradients (densifies `SparseRows`)."""
    if not isinstance(x, SparseRows):
        return x
    t, n, d = x.rows.shape

    def one(idx, rows):
        return jnp.zeros((x.num_rows, d), rows.dtype).at[idx].add(rows)

    return jax.vmap(one)(x.indices, x.rows)


def merge_rows(x: SparseRows) -> tuple[jax.Array, jax.Array]:
    """Per task, sorted unique indices `[T, n]` and their summed rows `[T, n, dim]` (float32).

    Duplicate indices of a task are added together; the free slots at the end hold index
    `num_rows - 1` (sorted after, or equal to and after, every real index) and zero rows.
    Never builds a table-sized array.
    """
    rows = x.rows.astype(jnp.float32)
    if x.sorted_unique:
        return x.indices, rows
    n = x.indices.shape[1]

    def one(idx, r):
        order = jnp.argsort(idx)
        s = idx[order]
        first = jnp.concatenate([jnp.ones((1,), bool), s[1:] != s[:-1]])
        seg = jnp.cumsum(first) - 1
        merged = jax.ops.segment_sum(r[order], seg, num_segments=n)
        uniq = jnp.full((n,), x.num_rows - 1, idx.dtype).at[seg].set(s)
        return uniq, merged

    return jax.vmap(one)(x.indices, rows)


def with_merged_rows(x: SparseRows) -> SparseRows:
    """`x` with each task's duplicate indices merged (`merge_rows`)."""
    idx, rows = merge_rows(x)
    return SparseRows(idx, rows.astype(x.dtype), num_rows=x.num_rows, sorted_unique=True)


def unique_rows(x: SparseRows) -> SparseRows:
    """`x` with at most one non-zero row per task and index, which holds the sum of that
    index's rows: so each task's squared norm is the sum of its squared rows, and a
    scatter of `rows ** 2` adds each index's square once. Merged (`merge_rows`), or on
    GPUs while few rows (`PAIRWISE_MAX_ROWS`), by one `[T, n, n]` mask product: each
    row gets the sum of its index's rows, and all but the first of them are zeroed,
    indices unchanged. Since which form is lowered is not static, the result is not
    marked `sorted_unique`."""
    if x.sorted_unique:
        return x

    def by_merge(idx, rows):
        return merge_rows(SparseRows(idx, rows, num_rows=x.num_rows))

    def by_mask(idx, rows):
        eq = idx[:, :, None] == idx[:, None, :]  # [T, n, n]
        summed = jnp.einsum("tnm,tmd->tnd", eq.astype(jnp.float32), rows.astype(jnp.float32),
                            precision=jax.lax.Precision.HIGHEST)
        n = idx.shape[1]
        earlier = jnp.arange(n)[None, :] < jnp.arange(n)[:, None]  # [n (this), n (other)]
        first = ~jnp.any(eq & earlier, axis=2)
        return idx, jnp.where(first[..., None], summed, 0.0)

    if _pairwise_ok([x]):
        idx, rows = jax.lax.platform_dependent(x.indices, x.rows, cuda=by_mask, rocm=by_mask,
                                               default=by_merge)
    else:
        idx, rows = by_merge(x.indices, x.rows)
    return SparseRows(idx, rows.astype(x.dtype), num_rows=x.num_rows)


# On GPUs, while all tables' rows of all tasks number at most this many, norms and Grams
# of `SparseRows` take every pair of rows of equal index (`_pairwise_*`: one
# `[rows, rows]` product, 64 MiB at 4,096 rows, and one masked reduction) instead of a
# merge (sort, scan, gather, scatters: a kernel each). On a CPU the merge is the faster
# from a few hundred rows per task on (1.7 against 0.6 ms for the norms at 1,024).
PAIRWISE_MAX_ROWS = 4096


def _joined(tables: list) -> tuple[jax.Array, jax.Array, list[int]] | None:
    """Several tables' rows as one table's: per task, the indices offset past the previous
    tables' rows and the rows zero-padded to the widest (zero columns add nothing), then
    concatenated; with the row offset where each table starts (one more at the end).
    None when the offset indices would overflow int32, or on several devices
    (`_partitioned`)."""
    if sum(x.num_rows for x in tables) > 2 ** 31 - 1 or _partitioned():
        return None
    width = max(x.rows.shape[2] for x in tables)
    offset, idx, rows, bounds = 0, [], [], [0]
    for x in tables:
        idx.append(x.indices.astype(jnp.int32) + offset)
        r = x.rows.astype(jnp.float32)
        rows.append(jnp.pad(r, ((0, 0), (0, 0), (0, width - r.shape[2]))))
        offset += x.num_rows
        bounds.append(bounds[-1] + r.shape[1])
    return jnp.concatenate(idx, axis=1), jnp.concatenate(rows, axis=1), bounds


def _pairwise_ok(tables: list) -> bool:
    return sum(x.rows.shape[0] * x.rows.shape[1] for x in tables) <= PAIRWISE_MAX_ROWS


def _pairwise_sq_norms(idx: jax.Array, rows: jax.Array) -> jax.Array:
    """`[T, n]`: for each row, the sum of its inner products with the rows of the same task
    and index (itself included); a task's squared norm is the sum of its entries."""
    g = jnp.einsum("tnd,tmd->tnm", rows, rows, precision=jax.lax.Precision.HIGHEST)
    return jnp.sum(jnp.where(idx[:, :, None] == idx[:, None, :], g, 0.0), axis=2)


def _pairwise_gram(idx: jax.Array, rows: jax.Array) -> jax.Array:
    """`[T, T]` Gram from every pair of rows of equal index, whatever the duplicates."""
    t, n, d = rows.shape
    flat, i = rows.reshape(t * n, d), idx.reshape(-1)
    g = jnp.dot(flat, flat.T, precision=jax.lax.Precision.HIGHEST)
    return jnp.sum(jnp.where(i[:, None] == i[None, :], g, 0.0).reshape(t, n, t, n), axis=(1, 3))


def _args(tables: list) -> list:
    return [a for x in tables for a in (x.indices, x.rows)]


def _rebuild(tables: list, args: tuple) -> list:
    return [SparseRows(i, r, num_rows=x.num_rows, sorted_unique=x.sorted_unique)
            for x, i, r in zip(tables, args[::2], args[1::2])]


def sparse_sq_norms(tables: list) -> list:
    """`[T]` squared norm of each task's gradient of each `SparseRows` table (float32).

    Merged rows are summed as they are. Rows that may repeat an index are merged first,
    or on GPUs, while few (`PAIRWISE_MAX_ROWS`), reduced pairwise, all tables at once
    (`lax.platform_dependent`: the lowered program holds one of the two)."""
    out: list = [None] * len(tables)
    for k, x in enumerate(tables):
        if x.sorted_unique:
            r = x.rows.astype(jnp.float32)
            out[k] = jnp.sum(r * r, axis=(1, 2))
    todo = [k for k, x in enumerate(tables) if not x.sorted_unique]
    if not todo:
        return out
    group = [tables[k] for k in todo]

    def by_merge(*args):
        return [jnp.sum(r * r, axis=(1, 2)) for r in (merge_rows(x)[1] for x in _rebuild(group, args))]

    def by_pairs(*args):
        joined = _joined(_rebuild(group, args))
        if joined is None:  # table by table
            return [jnp.sum(_pairwise_sq_norms(x.indices, x.rows.astype(jnp.float32)), axis=1)
                    for x in _rebuild(group, args)]
        idx, rows, bounds = joined
        per_row = _pairwise_sq_norms(idx, rows)
        return [jnp.sum(per_row[:, a:b], axis=1) for a, b in zip(bounds, bounds[1:])]

    if _pairwise_ok(group):
        sq = jax.lax.platform_dependent(*_args(group), cuda=by_pairs, rocm=by_pairs,
                                        default=by_merge)
    else:
        sq = by_merge(*_args(group))
    for k, v in zip(todo, sq):
        out[k] = v
    return out


def _gram_by_search(idx: jax.Array, rows: jax.Array) -> jax.Array:
    """The Gram of merged, per-task sorted rows by binary search: for task i and every
    task j, each of i's rows is matched to j's row of the same index (the first of equal
    indices is the real row; padding rows are zero, so a match with one adds 0); one task
    at a time (`lax.map`), so the peak is `[T, n, dim]`, the size of the rows. The faster
    on a CPU from a few hundred rows per task on; on a GPU each trip of its loops is
    launches of its own."""

    def gram_row(args):
        idx_i, rows_i = args  # [n], [n, dim]
        pos = jax.vmap(lambda s: jnp.searchsorted(s, idx_i))(idx)  # [T, n]
        pos = jnp.minimum(pos, idx.shape[1] - 1)
        match = jnp.take_along_axis(idx, pos, axis=1) == idx_i[None]
        other = jnp.take_along_axis(rows, pos[..., None], axis=1)  # [T, n, dim]
        return jnp.einsum("tnd,nd,tn->t", other, rows_i, match.astype(jnp.float32))

    return jax.lax.map(gram_row, (idx, rows))


def _gram_by_sort(idx: jax.Array, rows: jax.Array) -> jax.Array:
    """The Gram of merged rows without loops: all tasks' rows sorted together by index
    (a zero row gets a key of its own, below every real index), so that the rows of one
    index, at most one per task, lie next to each other; the products of each row with
    the rows 0..T-1 places further on, where the index is the same, are the Gram's terms.
    One sort, `T` shifted products of `[T * n, dim]` and one einsum: a few kernels whatever
    `n`, for a GPU, where each trip of `_gram_by_search`'s loops is launches of its own (on
    a CPU the search is the faster from a few hundred rows per task on)."""
    t, n, d = rows.shape
    flat = rows.reshape(t * n, d)
    zero = jnp.all(flat == 0, axis=1)
    key = jnp.where(zero, -1 - jnp.arange(t * n, dtype=idx.dtype), idx.reshape(-1))
    s_key, perm = jax.lax.sort((key, jnp.arange(t * n, dtype=jnp.int32)), num_keys=1)
    s_rows = flat[perm]
    task = perm // n
    # Row e against row e + k, k = 0..T-1, all at once: the sorted arrays padded with T - 1
    # rows of no index (keys that match nothing) and shifted.
    pad = jnp.pad(s_rows, ((0, t - 1), (0, 0)))
    pad_key = jnp.concatenate([s_key, jnp.full((t - 1,), -1 - t * n, s_key.dtype)])
    pad_task = jnp.pad(task, (0, t - 1))
    ks = range(t)
    prod = jnp.stack([jnp.sum(s_rows * pad[k:k + t * n], axis=1)
                      * (s_key == pad_key[k:k + t * n]) for k in ks])  # [T(k), T*n]
    other = jnp.stack([pad_task[k:k + t * n] for k in ks])  # task of row e + k
    tasks = jnp.arange(t, dtype=jnp.int32)
    g = jnp.einsum("en,ke,kem->knm", (task[:, None] == tasks).astype(jnp.float32), prod,
                   (other[..., None] == tasks).astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)  # [k, row's task, task k on]
    return g[0] + jnp.sum(g[1:] + jnp.swapaxes(g[1:], 1, 2), axis=0)


def _sparse_grams_sum(tables: list) -> jax.Array:
    """`[T, T]` sum of the Grams of `SparseRows` leaves, from their rows: on GPUs pairwise
    while few (`PAIRWISE_MAX_ROWS`), else by one sort over all of them (while their rows
    number fewer than 2^31 together); elsewhere merged per task, then by binary search
    per table (`lax.platform_dependent`: the lowered program holds one of the two). No
    table is ever built."""

    def by_search(*args):
        return sum(_gram_by_search(*merge_rows(x)) for x in _rebuild(tables, args))

    def by_sort(*args):
        merged = [SparseRows(*merge_rows(x), num_rows=x.num_rows, sorted_unique=True)
                  for x in _rebuild(tables, args)]
        joined = _joined(merged) if len(merged) > 1 else None
        if joined is None:  # table by table
            return sum(_gram_by_sort(x.indices, x.rows) for x in merged)
        return _gram_by_sort(*joined[:2])  # all tables in one sort

    def by_pairs(*args):
        joined = _joined(_rebuild(tables, args))
        if joined is None:  # table by table
            return sum(_pairwise_gram(x.indices, x.rows.astype(jnp.float32))
                       for x in _rebuild(tables, args))
        return _pairwise_gram(*joined[:2])

    gpu = by_pairs if _pairwise_ok(tables) else by_sort
    return jax.lax.platform_dependent(*_args(tables), cuda=gpu, rocm=gpu, default=by_search)


def _sparse_gram(x: SparseRows) -> jax.Array:
    """`[T, T]` Gram of one `SparseRows` leaf (see `_sparse_grams_sum`)."""
    return _sparse_grams_sum([x])


def leaf_gram(x: Any) -> jax.Array:
    """`[T, T]` inner products between tasks' gradients of one parameter (float32).

    For `SparseRows` the products are taken over the rows (`_sparse_grams_sum`): no
    `[num_rows, dim]` table is ever built.
    """
    if isinstance(x, SparseRows):
        return _sparse_gram(x)
    # Split over a mesh, reduced over every parameter axis as they lie: a `[T, -1]`
    # reshape of a leaf split over several mesh axes (a per-task gradient shard on a
    # pod) is a gather of the whole leaf on every device. As products summed like
    # `leaf_sq_norms`' squares, not as a contraction: the TPU compiler lays a
    # contraction's operand out for its matrix unit, and the per-task gradients'
    # exchange was then copied whole and padded (T5.1.1-Base on v5e-256, 128 x 2:
    # PCGrad's step 0.393 GiB, 0.207 so, the plain step's 0.206). Each device reduces
    # its shard and one `[T, T]` sum goes over the mesh.
    f = x.astype(jnp.float32)
    if _partitioned():
        return jnp.sum(f[:, None] * f[None, :], axis=tuple(range(2, f.ndim + 1)))
    f = f.reshape(f.shape[0], -1)  # one device: one matrix product
    return f @ f.T


# Up to this many tasks `leaf_combine` writes the weighted sum out term by term.
UNROLLED_COMBINE_MAX_TASKS = 16


def leaf_combine(x: Any, weights: jax.Array) -> jax.Array:
    """`sum_t weights[t] * grad_t` of one parameter, in the gradient's dtype."""
    if isinstance(x, SparseRows):
        w = weights.astype(x.rows.dtype)
        t, n, d = x.rows.shape
        scaled = (x.rows * w[:, None, None]).reshape(t * n, d)
        return jnp.zeros((x.num_rows, d), x.rows.dtype).at[x.indices.reshape(-1)].add(scaled)
    if x.shape[0] <= UNROLLED_COMBINE_MAX_TASKS:
        # Elementwise (in float32), so that XLA fuses it into its consumer, the optimizer's
        # update: a contraction over T is a kernel of its own per parameter on a GPU.
        w = weights.astype(jnp.float32)
        out = x[0].astype(jnp.float32) * w[0]
        for t in range(1, x.shape[0]):
            out = out + x[t].astype(jnp.float32) * w[t]
        return out.astype(x.dtype)
    return jnp.tensordot(weights.astype(x.dtype), x, axes=1)


def global_gram(stacked_leaves: list) -> jax.Array:
    """`[T, T]` inner products of the concatenated shared gradients of all tasks.

    The dense leaves of at most `BATCH_MAX_ELEMENTS` elements per task go in one
    reduction (`_chunked`: one kernel, where a GEMM per parameter is a launch each on a
    GPU); larger leaves get their own `leaf_gram`, and the `SparseRows` leaves one sort
    together on GPUs (`_sparse_grams_sum`)."""
    small, tables, grams = [], [], []
    for x in stacked_leaves:
        if isinstance(x, SparseRows):
            tables.append(x)
        elif x is not None:
            if _batched(x):
                small.append(x)
            else:
                grams.append(leaf_gram(x))
    if tables:
        grams.append(_sparse_grams_sum(tables))
    if len(small) == 1:
        grams.append(leaf_gram(small[0]))
    elif small:
        chunks, _ = _chunked(small)
        grams.append(jnp.sum(chunks[:, None] * chunks[None, :], axis=(2, 3)))
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


def nonzero_tasks(stacked_leaves: list) -> jax.Array:
    """`[T]` bool: tasks with some non-zero shared gradient (the default presence rule:
    a task with no rows in the batch has exactly zero gradients)."""
    sq = [x for x in sq_norms(stacked_leaves) if x is not None]
    return sum(sq[1:], sq[0]) > 0
