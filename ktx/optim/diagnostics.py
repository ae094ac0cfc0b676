"""Per-task gradient diagnostics as a flat dict of scalars the trainer can log.

`diagnostics(task_grads, state)` returns, for every balanced group (each shared tensor,
or the groups declared by regex) and task k:

* `grad_norm/<group>/task<k>`: `||g_k||` of the group,
* `cosine_to_target/<group>/task<k>`: `g_k . g_tar / (||g_k|| ||g_tar||)` (0 if a norm is 0),
* `metabalance_weight/<group>/task<k>`: the multiplier MetaBalance applied to task k's
  gradient at the last step, when `state` (any optax state tree) holds a
  `MetaBalanceState`.

A compiled step returns them packed (`diagnostics(..., packed=True)`): one `[n]` array
under static names (`PackedScalars`), not n scalar outputs, each a buffer the step
writes and the host allocates.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from ktx.optim.metabalance import MetaBalanceState
from ktx.optim.selection import group_names
from ktx.optim.task_gradients import (
    SparseRows,
    flatten_task_gradients,
    leaf_gram,
    leaf_sq_norms,
    num_tasks_of,
)

__all__ = ["PackedScalars", "diagnostics", "find_metabalance_state"]


@jax.tree_util.register_pytree_node_class
class PackedScalars(Mapping):
    """A read-only `{name: scalar}` mapping held as one array: `array[..., i]` is
    `names[i]`'s value (a leading axis, e.g. the steps of a `train_steps` block, is kept).
    A pytree whose only leaf is `array`; the names travel as static data, so `jax.jit`
    outputs, `jax.device_get` and `jax.tree.map` see one array."""

    def __init__(self, names: Sequence[str], array: Any):
        self.names = tuple(names)
        self.array = array
        self._index = {n: i for i, n in enumerate(self.names)}

    @classmethod
    def pack(cls, scalars: Mapping[str, Any]) -> "PackedScalars":
        """`scalars`' values (float32 scalars) stacked in their order."""
        names = tuple(scalars)
        if not names:
            return cls((), jnp.zeros((0,), jnp.float32))
        return cls(names, jnp.stack([jnp.asarray(scalars[n], jnp.float32) for n in names]))

    def tree_flatten(self):
        return (self.array,), self.names

    @classmethod
    def tree_unflatten(cls, names, children):
        return cls(names, children[0])

    def __getitem__(self, name: str) -> Any:
        return self.array[..., self._index[name]]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __repr__(self) -> str:
        return f"PackedScalars({len(self.names)} names, array={self.array!r})"


def find_metabalance_state(state: Any) -> MetaBalanceState | None:
    """The first `MetaBalanceState` inside an optax state tree (e.g. a chain's tuple)."""
    found = [
        x
        for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, MetaBalanceState))
        if isinstance(x, MetaBalanceState)
    ]
    return found[0] if found else None


def _norm_and_target_products(x: Any, target_task: int) -> tuple[jax.Array, jax.Array]:
    """`[T]` squared norms of one parameter's per-task gradients and `[T]` inner products
    with the target task's (float32). A `SparseRows` leaf's come from its Gram (products
    over the rows, no table built); a dense leaf's are two sums of products reduced over
    every parameter axis as it lies, so a leaf split over a mesh is reduced shard by shard
    (the squares by `leaf_sq_norms`)."""
    if isinstance(x, SparseRows):
        gram = leaf_gram(x)
        return jnp.diagonal(gram), gram[:, target_task]
    f = x.astype(jnp.float32)
    return leaf_sq_norms(f), jnp.sum(f * f[target_task], axis=tuple(range(1, f.ndim)))


def diagnostics(
    task_grads: Any,
    state: Any = None,
    *,
    target_task: int = 0,
    groups: Sequence[str] | None = None,
    packed: bool = False,
) -> dict[str, jax.Array] | PackedScalars:
    """Flat `{name: float32 scalar}` of norms, cosines and MetaBalance weights.

    Args:
      task_grads: what `compute_task_gradients` returned (or `TaskGradients.from_stacked(tree)`).
      state: the optimizer state (optional); MetaBalance weights come from it.
      target_task: the task cosines are taken against.
      groups: regexes grouping tensors (as `metabalance(groups=...)`); None: per tensor.
      packed: return them as one `PackedScalars` (what a compiled step outputs).
    """
    stacked, _, treedef = flatten_task_gradients(task_grads)
    t = num_tasks_of(stacked)
    if not 0 <= target_task < t:
        raise ValueError(f"diagnostics: target_task={target_task!r} but num_tasks={t}")
    names = group_names(treedef.unflatten([0] * len(stacked)), groups)
    # Per group, each task's squared norm and inner product with the target: 2T sums of
    # products, not a [T, T] Gram (T5.1.1-Base + MetaBalance on v4-32 with 2-D dims: the
    # step with the diagnostics' cond 1.296 -> 1.291 GiB; packed, 1.290).
    sums: dict[str, tuple[jax.Array, jax.Array]] = {}
    for name, s in zip(names, stacked):
        if s is not None:
            sq, dot = _norm_and_target_products(s, target_task)
            if name in sums:
                sq, dot = sums[name][0] + sq, sums[name][1] + dot
            sums[name] = (sq, dot)
    out: dict[str, jax.Array] = {}
    for name, (sq, dot) in sums.items():
        norms = jnp.sqrt(jnp.maximum(sq, 0.0))
        denom = norms * norms[target_task]
        cos = jnp.where(denom > 0, dot / jnp.where(denom > 0, denom, 1.0), 0.0)
        for k in range(t):
            out[f"grad_norm/{name}/task{k}"] = norms[k]
            out[f"cosine_to_target/{name}/task{k}"] = cos[k]
    mb = find_metabalance_state(state) if state is not None else None
    if mb is not None:
        weights = jax.tree.leaves(mb.weights)
        if len(weights) == len(names):
            for name, s, w in zip(names, stacked, weights):
                if s is not None:
                    for k in range(t):
                        out[f"metabalance_weight/{name}/task{k}"] = w[k]
    out = {k: jnp.asarray(v, jnp.float32) for k, v in out.items()}
    return PackedScalars.pack(out) if packed else out
