"""MGDA (Sener and Koltun, 2018): the min-norm point in the convex hull of task gradients.

    alpha = argmin_{alpha in simplex} || sum_t alpha_t g_t / n_t ||^2,   update = sum_t alpha_t g_t

solved exactly on the Gram matrix of the concatenated shared gradients (`min_norm_weights`:
every support's KKT system for up to `EXACT_MAX_TASKS` tasks, accelerated projected gradient
to a tolerance above; the paper's Frank-Wolfe from the uniform point stops well short of the
minimum in a fixed iteration budget); `n_t` is the paper's gradient normalisation: 1 (`"none"`), `||g_t||`
(`"l2"`), `L_t` (`"loss"`) or `L_t ||g_t||` (`"loss+"`). As in the authors' code the
normalisation only shapes `alpha`; the update weights the un-normalised task gradients
(equivalently the losses) by `alpha`.

A task absent from the batch (`task_present=` from the trainer, else every one of its
shared gradients exactly zero) is left out of the simplex: its zero gradient would be the
min-norm point and stop every shared parameter.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ktx.optim.num_tasks import present_tasks
from ktx.optim.task_gradients import (
    combine_with_weights,
    flatten_task_gradients,
    global_gram,
    nonzero_tasks,
    num_tasks_of,
)

__all__ = ["EXACT_MAX_TASKS", "NORMALIZATIONS", "min_norm_weights", "mgda"]

NORMALIZATIONS = ("none", "l2", "loss", "loss+")


# Up to this many tasks the min-norm problem is solved exactly by enumerating supports
# (2^T - 1 small KKT systems, one batched solve); beyond it by accelerated projected
# gradient to a tolerance.
EXACT_MAX_TASKS = 10


def _exact_min_norm(gram: jax.Array, allowed: jax.Array) -> jax.Array:
    """The exact minimiser: for every support S, the KKT system of
    `min a_S^T G_S a_S s.t. sum(a_S) = 1`; the best candidate that is a simplex point.

    The min-norm point has an affinely independent support (Caratheodory), whose KKT
    matrix is invertible; any other candidate that passes the feasibility check is a
    simplex point too, so its objective is an upper bound: the argmin is exact."""
    t = gram.shape[0]
    masks = np.array([[(m >> i) & 1 for i in range(t)] for m in range(1, 2 ** t)], np.float32)

    def solve(m):
        a_block = gram * m[:, None] * m[None, :] + jnp.diag(1.0 - m)
        kkt = jnp.block([[a_block, m[:, None]], [m[None, :], jnp.zeros((1, 1), gram.dtype)]])
        rhs = jnp.concatenate([jnp.zeros((t,), gram.dtype), jnp.ones((1,), gram.dtype)])
        return jnp.linalg.solve(kkt, rhs)[:t] * m

    alphas = jax.vmap(solve)(jnp.asarray(masks))  # [S, T]
    ok = (jnp.all(jnp.isfinite(alphas), axis=1) & jnp.all(alphas >= -1e-6, axis=1)
          & (jnp.abs(alphas.sum(axis=1) - 1.0) < 1e-4)
          & jnp.all(jnp.asarray(masks) <= allowed[None, :], axis=1))
    objective = jnp.einsum("st,tu,su->s", alphas, gram, alphas)
    best = jnp.argmin(jnp.where(ok, objective, jnp.inf))
    alpha = jnp.clip(alphas[best], 0.0, None)
    return alpha / alpha.sum()


def _project_to_simplex(v: jax.Array) -> jax.Array:
    """Euclidean projection onto the probability simplex (sort-based)."""
    t = v.shape[0]
    u = jnp.sort(v)[::-1]
    css = jnp.cumsum(u) - 1.0
    k = jnp.arange(1, t + 1, dtype=v.dtype)
    rho = jnp.max(jnp.where(u - css / k > 0, k, 0.0))
    theta = css[rho.astype(jnp.int32) - 1] / rho
    return jnp.maximum(v - theta, 0.0)


def _iterative_min_norm(gram: jax.Array, allowed: jax.Array, max_iters: int, tol: float
                        ) -> jax.Array:
    """FISTA (accelerated projected gradient, step 1/L with L = trace(G) >= lambda_max)
    from the uniform point, until the iterate moves less than `tol`."""
    step = 1.0 / (2.0 * jnp.maximum(jnp.trace(gram), 1e-30))
    x0 = allowed / allowed.sum()

    def cond(c):
        i, _, _, _, delta = c
        return (i < max_iters) & (delta > tol)

    def body(c):
        i, x, y, s, _ = c
        x_new = _project_to_simplex(jnp.where(allowed > 0, y - step * 2.0 * (gram @ y), -1e30))
        s_new = (1.0 + jnp.sqrt(1.0 + 4.0 * s * s)) / 2.0
        y_new = x_new + ((s - 1.0) / s_new) * (x_new - x)
        return i + 1, x_new, y_new, s_new, jnp.max(jnp.abs(x_new - x))

    _, x, _, _, _ = jax.lax.while_loop(cond, body, (0, x0, x0, jnp.ones((), gram.dtype), jnp.inf))
    return x


def min_norm_weights(gram: jax.Array, max_iters: int = 2000, tol: float = 1e-7,
                     allowed: jax.Array | None = None) -> jax.Array:
    """`[T]` simplex weights minimising `alpha^T gram alpha` (MGDA's min-norm problem).

    `allowed` (`[T]` bool, optional): only these tasks may get weight (all if none is).

    Exact for T <= `EXACT_MAX_TASKS` (enumerated supports); above, accelerated projected
    gradient to `tol` (at most `max_iters` iterations). The Gram matrix is scaled by its
    largest diagonal entry first, which leaves the minimiser unchanged."""
    gram = jnp.asarray(gram, jnp.float32)
    t = gram.shape[0]
    if t == 1:
        return jnp.ones((1,), jnp.float32)
    gram = gram / jnp.maximum(jnp.max(jnp.diagonal(gram)), 1e-30)
    allowed = jnp.ones((t,), bool) if allowed is None else jnp.asarray(allowed, bool)
    allowed = jnp.where(allowed.any(), allowed, True).astype(jnp.float32)
    if t <= EXACT_MAX_TASKS:
        return _exact_min_norm(gram, allowed)
    return _iterative_min_norm(gram, allowed, max_iters, tol)


def mgda(normalization: str = "none", max_iters: int = 2000) -> optax.GradientTransformationExtraArgs:
    """MGDA over the shared parameters; `"loss"`/`"loss+"` need `task_losses=` in update.
    `max_iters` bounds the iterative solver (more than `EXACT_MAX_TASKS` tasks)."""
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"mgda: normalization={normalization!r}; accepted: {NORMALIZATIONS}")
    if isinstance(max_iters, bool) or not isinstance(max_iters, int) or max_iters < 1:
        raise ValueError(f"mgda: max_iters={max_iters!r}; accepted: an int >= 1")

    def init_fn(params):
        del params
        return optax.EmptyState()

    def update_fn(updates, state, params=None, *, task_losses=None, task_present=None, **extra):
        del params, extra
        stacked, _, _ = flatten_task_gradients(updates, "mgda")
        t = num_tasks_of(stacked)
        present = present_tasks(task_present, t, "mgda", nonzero_tasks(stacked))
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
        alpha = min_norm_weights(gram / (n[:, None] * n[None, :]), max_iters, allowed=present)
        return combine_with_weights(updates, alpha), state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
