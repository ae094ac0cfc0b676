"""Gradient surgery on the task Gram matrix: PCGrad and GradSimilarity.

Both act on the concatenated shared gradients `g_t` (all shared tensors together) and
only need their inner products `G = [g_i . g_j]` (`[T, T]`): every projected gradient is
a linear combination of the originals, so the update is `sum_t w_t g_t` with `w` computed
from `G`, and no per-task copy of the parameters is ever built.

* `pcgrad()` (Yu et al., 2020): for each task i, in a random order of the tasks j,
  if `g_i' . g_j < 0` then `g_i' <- g_i' - (g_i' . g_j / ||g_j||^2) g_j`; the update is
  `sum_i g_i'`. `pcgrad(anchor=k)`: the target-anchored variant; only auxiliary
  gradients that conflict with the target's are projected onto the normal plane of
  `g_k`, and `g_k` is unchanged.
* `grad_similarity()` (Du et al., 2018): an auxiliary gradient is used only when its
  cosine with the target's is non-negative (`weighted=True`: scaled by that cosine).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from ktx.optim.num_tasks import check_task_index, task_index
from ktx.optim.task_gradients import (
    combine_with_weights,
    flatten_task_gradients,
    global_gram,
    num_tasks_of,
)

__all__ = ["PCGradState", "pcgrad", "pcgrad_weights", "grad_similarity"]


class PCGradState(NamedTuple):
    """`key`: raw uint32 PRNG key data `[2]` for the random task order."""

    key: jax.Array


def _safe_div(a, b):
    return jnp.where(b > 0, a / jnp.where(b > 0, b, 1.0), 0.0)


def pcgrad_weights(gram: jax.Array, orders: jax.Array | None = None) -> jax.Array:
    """`[T]` weights w with `sum_i g_i' = sum_t w_t g_t` (PCGrad, Yu et al., 2020).

    Args:
      gram: `[T, T]` inner products of the task gradients.
      orders: `[T, T]` int; row i is the order in which task i is projected against the
        others (None: 0..T-1).
    """
    t = gram.shape[0]
    if orders is None:
        orders = jnp.tile(jnp.arange(t), (t, 1))
    coeffs = jnp.eye(t, dtype=jnp.float32)  # g_i' = sum_k coeffs[i, k] g_k
    rows = []
    for i in range(t):
        c = coeffs[i]
        for pos in range(t):
            j = orders[i, pos]
            dot = c @ gram[:, j]
            proj = jnp.where(dot < 0, _safe_div(dot, gram[j, j]), 0.0)
            c = c - proj * jax.nn.one_hot(j, t, dtype=jnp.float32)
        rows.append(c)
    return jnp.stack(rows).sum(axis=0)


def pcgrad(
    anchor: int | None = None, shuffle: bool = True, seed: int = 0
) -> optax.GradientTransformationExtraArgs:
    """PCGrad over the shared parameters (see the module docstring).

    Args:
      anchor: None for PCGrad; a task index for the target-anchored variant.
      shuffle: random projection order per task and step (as Yu et al.); False: 0..T-1.
      seed: seed of the order (the key lives in the state, so resuming is exact).
    """
    anchor = task_index(anchor, "anchor", "pcgrad", allow_none=True)

    def init_fn(params):
        del params
        return PCGradState(jax.random.key_data(jax.random.key(seed)))

    def update_fn(updates, state, params=None, **extra):
        del params, extra
        stacked, _, _ = flatten_task_gradients(updates, "pcgrad")
        t = num_tasks_of(stacked)
        gram = global_gram(stacked)
        key = jax.random.wrap_key_data(state.key)
        key, sub = jax.random.split(key)
        if anchor is not None:
            check_task_index(anchor, t, "anchor", "pcgrad")
            dots = gram[:, anchor]
            coef = jnp.where(dots < 0, _safe_div(dots, gram[anchor, anchor]), 0.0)
            coef = coef.at[anchor].set(0.0)
            w = jnp.ones((t,), jnp.float32).at[anchor].add(-coef.sum())
        else:
            if shuffle:
                orders = jax.vmap(lambda k: jax.random.permutation(k, t))(
                    jax.random.split(sub, t)
                )
            else:
                orders = None
            w = pcgrad_weights(gram, orders)
        return combine_with_weights(updates, w), PCGradState(jax.random.key_data(key))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def grad_similarity(target_task: int = 0, weighted: bool = False) -> optax.GradientTransformationExtraArgs:
    """GradSimilarity (Du et al., 2018): drop auxiliary gradients opposed to the target.

    `w_tar = 1`; `w_k = 1[cos(g_k, g_tar) >= 0]` (or `max(cos, 0)` when `weighted`).
    """
    target_task = task_index(target_task, "target_task", "grad_similarity")

    def init_fn(params):
        del params
        return optax.EmptyState()

    def update_fn(updates, state, params=None, **extra):
        del params, extra
        stacked, _, _ = flatten_task_gradients(updates, "grad_similarity")
        t = num_tasks_of(stacked)
        check_task_index(target_task, t, "target_task", "grad_similarity")
        gram = global_gram(stacked)
        diag = jnp.sqrt(jnp.diagonal(gram))
        cos = _safe_div(gram[:, target_task], diag * diag[target_task])
        w = jnp.maximum(cos, 0.0) if weighted else (cos >= 0).astype(jnp.float32)
        w = w.at[target_task].set(1.0)
        return combine_with_weights(updates, w), state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
