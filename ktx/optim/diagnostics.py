"""Per-task gradient diagnostics as a flat dict of scalars the trainer can log.

`diagnostics(task_grads, state)` returns, for every balanced group (each shared tensor,
or the groups declared by regex) and task k:

* `grad_norm/<group>/task<k>`: `||g_k||` of the group,
* `cosine_to_target/<group>/task<k>`: `g_k . g_tar / (||g_k|| ||g_tar||)` (0 if a norm is 0),
* `metabalance_weight/<group>/task<k>`: the multiplier MetaBalance applied to task k's
  gradient at the last step, when `state` (any optax state tree) holds a
  `MetaBalanceState`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from ktx.optim.metabalance import MetaBalanceState
from ktx.optim.selection import group_names
from ktx.optim.task_gradients import (
    flatten_task_gradients,
    leaf_gram,
    num_tasks_of,
)

__all__ = ["diagnostics", "find_metabalance_state"]


def find_metabalance_state(state: Any) -> MetaBalanceState | None:
    """The first `MetaBalanceState` inside an optax state tree (e.g. a chain's tuple)."""
    found = [
        x
        for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, MetaBalanceState))
        if isinstance(x, MetaBalanceState)
    ]
    return found[0] if found else None


def diagnostics(
    task_grads: Any,
    state: Any = None,
    *,
    target_task: int = 0,
    groups: Sequence[str] | None = None,
) -> dict[str, jax.Array]:
    """Flat `{name: float32 scalar}` of norms, cosines and MetaBalance weights.

    Args:
      task_grads: what `compute_task_gradients` returned (or `TaskGradients.from_stacked(tree)`).
      state: the optimizer state (optional); MetaBalance weights come from it.
      target_task: the task cosines are taken against.
      groups: regexes grouping tensors (as `metabalance(groups=...)`); None: per tensor.
    """
    stacked, _, treedef = flatten_task_gradients(task_grads)
    t = num_tasks_of(stacked)
    if not 0 <= target_task < t:
        raise ValueError(f"diagnostics: target_task={target_task!r} but num_tasks={t}")
    names = group_names(treedef.unflatten([0] * len(stacked)), groups)
    grams: dict[str, jax.Array] = {}
    for name, s in zip(names, stacked):
        if s is not None:
            g = leaf_gram(s)
            grams[name] = grams[name] + g if name in grams else g
    out: dict[str, jax.Array] = {}
    for name, gram in grams.items():
        norms = jnp.sqrt(jnp.maximum(jnp.diagonal(gram), 0.0))
        denom = norms * norms[target_task]
        cos = jnp.where(denom > 0, gram[:, target_task] / jnp.where(denom > 0, denom, 1.0), 0.0)
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
    return {k: jnp.asarray(v, jnp.float32) for k, v in out.items()}
