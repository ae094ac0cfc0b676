"""MGDA (Sener and Koltun, 2018): the min-norm point in the convex hull of task gradients.

    alpha = argmin_{alpha in simplex} || sum_t alpha_t g_t / n_t ||^2,   update = sum_t alpha_t g_t

solved by Frank-Wolfe (the paper's Algorithm 2) on the Gram matrix of the concatenated
shared gradients; `n_t` is the paper's gradient normalisation: 1 (`"none"`), `||g_t||`
(`"l2"`), `L_t` (`"loss"`) or `L_t ||g_t||` (`"loss+"`). As in the authors' code the
normalisation only shapes `alpha`; the update weights the un-normalised task gradients
(equivalently the losses) by `alpha`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from ktx.optim.task_gradients import (
    combine_with_weights,
    flatten_task_gradients,
    global_gram,
    num_tasks_of,
)

__all__ = ["NORMALIZATIONS", "min_norm_weights", "mgda"]

NORMALIZATIONS = ("none", "l2", "loss", "loss+")


def min_norm_weights(gram: jax.Array, num_iters: int = 100) -> jax.Array:
    """`[T]` simplex weights minimising `alpha^T gram alpha` (Frank-Wolfe, exact line search)."""
    t = gram.shape[0]
    gram = gram.astype(jnp.float32)

    def body(_, alpha):
        g_alpha = gram @ alpha  # theta . g_r for every r
        r = jnp.argmin(g_alpha)
        tt = alpha @ g_alpha  # ||theta||^2
        tr = g_alpha[r]
        rr = gram[r, r]
        denom = tt - 2.0 * tr + rr
        gamma = jnp.where(denom > 0, jnp.clip((tt - tr) / jnp.where(denom > 0, denom, 1.0), 0.0, 1.0), 0.0)
        return (1.0 - gamma) * alpha + gamma * jax.nn.one_hot(r, t, dtype=jnp.float32)

    return jax.lax.fori_loop(0, num_iters, body, jnp.full((t,), 1.0 / t, jnp.float32))


def mgda(normalization: str = "none", num_iters: int = 100) -> optax.GradientTransformationExtraArgs:
    """MGDA over the shared parameters; `"loss"`/`"loss+"` need `task_losses=` in update."""
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"mgda: normalization={normalization!r}; accepted: {NORMALIZATIONS}")
    if not isinstance(num_iters, int) or num_iters < 1:
        raise ValueError(f"mgda: num_iters={num_iters!r}; expected a positive int")

    def init_fn(params):
        del params
        return optax.EmptyState()

    def update_fn(updates, state, params=None, *, task_losses=None, **extra):
        del params, extra
        stacked, _, _ = flatten_task_gradients(updates)
        num_tasks_of(stacked)
        gram = global_gram(stacked)
        norms = jnp.sqrt(jnp.diagonal(gram))
        if normalization == "none":
            n = jnp.ones_like(norms)
        elif normalization == "l2":
            n = norms
        else:
            if task_losses is None:
                raise ValueError(f"mgda(normalization={normalization!r}) needs task_losses=")
            n = jnp.asarray(task_losses, jnp.float32)
            if normalization == "loss+":
                n = n * norms
        n = jnp.where(n > 0, n, 1.0)
        alpha = min_norm_weights(gram / (n[:, None] * n[None, :]), num_iters)
        return combine_with_weights(updates, alpha), state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
