"""MTAdam (Malkiel and Wolf, 2021): Adam with per-loss moments, anchored on one loss.

What the authors' PyTorch `MTAdam` computes, per parameter tensor and task t, at step k
(`r_t` the per-loss weight, the reference's `ranks`; `lambda` the weight decay):

    n_t  = ||g_t||                                   at the task's first step
    n_t <- b3 n_t + (1 - b3) ||g_t||                 afterwards
    a    = the anchor if n_anchor > 1e-10, else the first task (by index) with n > 1e-10
    h_t  = r_t n_a g_t / n_t  if n_t > 1e-10,  else g_t;   h_t <- h_t + lambda * param
    m_t <- b1 m_t + (1 - b1) h_t ;  v_t <- b2 v_t + (1 - b2) h_t^2
    d_t  = sqrt(v_t) / sqrt(1 - b2^k) + eps
    direction = sum_t m_t / (1 - b1^k) / max_t d_t          (element-wise max over tasks)

MTAdam is itself the optimizer: chain it with a learning rate only, e.g.
`optax.chain(ktx.optim.mtadam(), optax.scale_by_learning_rate(1e-3))` (the reference's
step is `-lr * direction`). Its state holds `[T, *param]` moments per parameter (the
method's cost). Unshared parameters take one Adam step on their summed gradient (moments
in task slot 0).

A task absent from the batch (`task_present=` from the trainer, else every one of its
shared gradients exactly zero) keeps its running norms: a zero norm says nothing about
the scale of its gradients, and averaging it in would inflate `n_a / n_t` when the task
comes back. Its moments advance as the reference's would with a zero gradient (Adam's
momentum decays; weight decay still applies), and it stays a candidate anchor with the
norm it had. A task's norm starts at its first *present* step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from ktx.optim.num_tasks import (
    check_state_tasks,
    check_task_index,
    non_negative,
    present_tasks,
    resolve_num_tasks,
    task_index,
)
from ktx.optim.task_gradients import (
    flatten_task_gradients,
    leaf_dense,
    nonzero_tasks,
    num_tasks_of,
)

__all__ = ["MTAdamState", "mtadam", "ANCHOR_THRESHOLD"]

# The reference treats a running norm at or below this as zero (no anchor, no scaling).
ANCHOR_THRESHOLD = 1e-10


class MTAdamState(NamedTuple):
    count: jax.Array  # [] steps taken
    seen: jax.Array  # [T] int32 steps each task was present (its norm starts at the first)
    norms: Any  # params-structured [T] running gradient norms
    mu: Any  # params-structured [T, *param]
    nu: Any  # params-structured [T, *param]


def _bias_correction(beta: float, count: jax.Array) -> jax.Array:
    """`1 - beta^count` without float32 cancellation (`1 - 0.999f` is 1.3e-5 off; the
    reference computes it in double): `-expm1(count * log(beta))`."""
    if isinstance(beta, jax.core.Tracer):  # optax.inject_hyperparams
        log_beta = jnp.log(jnp.asarray(beta, jnp.float32))
    elif float(beta) == 0.0:
        return jnp.ones([], jnp.float32)
    else:
        log_beta = math.log(float(beta))
    return -jnp.where(count > 0, jnp.expm1(count.astype(jnp.float32) * log_beta), -1.0)


def _check_weights(weights: Sequence[float] | None) -> tuple[float, ...] | None:
    if weights is None:
        return None
    try:
        w = tuple(float(x) for x in weights)
    except (TypeError, ValueError) as e:
        raise TypeError(f"mtadam: weights={weights!r}; expected a list of numbers") from e
    if not w or any(not x >= 0 for x in w):
        raise ValueError(f"mtadam: weights={weights!r}; expected numbers >= 0, one per task")
    return w


def mtadam(
    b1: float = 0.9,
    b2: float = 0.999,
    b3: float = 0.9,
    eps: float = 1e-8,
    anchor: int = 0,
    weights: Sequence[float] | None = None,
    weight_decay: float = 0.0,
    num_tasks: int | None = None,
) -> optax.GradientTransformationExtraArgs:
    """MTAdam's direction (before the learning rate); see the module docstring.

    Args:
      b1, b2: Adam's moment decays; b3: decay of the running gradient norms.
      eps: added to each task's denominator.
      anchor: the task whose running norm every other task is scaled to (when its norm
        is ~0 the first task, by index, with a norm above 1e-10 takes its place).
      weights: per-loss weights `r_t` (the reference's `ranks`), one per task; None: 1.
      weight_decay: `lambda` (L2, added to every task's normalised gradient); needs
        `params` in `update`.
      num_tasks: T; required by `init` (gin: `%NUM_TASKS`).
    """
    for name, v in (("b1", b1), ("b2", b2), ("b3", b3)):
        if not isinstance(v, jax.core.Tracer) and not 0.0 <= float(v) < 1.0:
            raise ValueError(f"mtadam: {name}={v!r}; accepted: [0, 1)")
    non_negative(eps, "eps", "mtadam")
    non_negative(weight_decay, "weight_decay", "mtadam")
    anchor = task_index(anchor, "anchor", "mtadam")
    ranks = _check_weights(weights)

    def _ranks(t: int) -> jax.Array:
        if ranks is None:
            return jnp.ones((t,), jnp.float32)
        if len(ranks) != t:
            raise ValueError(f"mtadam: {len(ranks)} weights {list(ranks)} but num_tasks={t}")
        return jnp.asarray(ranks, jnp.float32)

    def init_fn(params):
        t = resolve_num_tasks(num_tasks, "mtadam")
        params = nn.meta.unbox(params)  # [T]-shaped state takes no logical axes
        check_task_index(anchor, t, "anchor", "mtadam")
        _ranks(t)
        moments = lambda p: jnp.zeros((t,) + p.shape, p.dtype)  # noqa: E731
        return MTAdamState(
            jnp.zeros([], jnp.int32),
            jnp.zeros((t,), jnp.int32),
            jax.tree.map(lambda _: jnp.zeros((t,), jnp.float32), params),
            jax.tree.map(moments, params),
            jax.tree.map(moments, params),
        )

    def update_fn(updates, state, params=None, *, task_present=None, **extra):
        del extra
        stacked, summed, treedef = flatten_task_gradients(updates, "mtadam")
        t = num_tasks_of(stacked)
        check_state_tasks("mtadam", state.seen.shape[0], t)
        check_task_index(anchor, t, "anchor", "mtadam")
        r = _ranks(t)
        decay = isinstance(weight_decay, jax.core.Tracer) or float(weight_decay) != 0.0
        if decay:
            if params is None:
                raise ValueError("mtadam: weight_decay needs params= in update")
            p_leaves = jax.tree.leaves(nn.meta.unbox(params))
        else:
            p_leaves = [None] * len(stacked)
        present = present_tasks(task_present, t, "mtadam", nonzero_tasks(stacked))
        first = state.seen == 0
        count = state.count + 1
        bc1 = _bias_correction(b1, count)
        bc2 = _bias_correction(b2, count)
        # Anchor candidates in order: the anchor, then the others by index.
        ids = jnp.arange(t)
        order = jnp.argsort(jnp.where(ids == anchor, -1, ids))
        norms_l, mu_l, nu_l = (jax.tree.leaves(x) for x in (state.norms, state.mu, state.nu))
        out, n_out, m_out, v_out = [], [], [], []
        for s, u, n, m, v, p in zip(stacked, summed, norms_l, mu_l, nu_l, p_leaves):
            shape = (t,) + (1,) * (m.ndim - 1)
            if s is None:  # unshared: plain Adam in slot 0
                g0 = u.astype(jnp.float32)
                if decay:
                    g0 = g0 + weight_decay * p.astype(jnp.float32)
                h = jnp.zeros(m.shape, jnp.float32).at[0].set(g0)
                new_n = n
            else:
                g = leaf_dense(s).astype(jnp.float32)
                norm = jnp.sqrt(jnp.sum(jnp.square(g).reshape(t, -1), axis=1))
                running = jnp.where(first, norm, b3 * n + (1.0 - b3) * norm)
                new_n = jnp.where(present, running, n)  # an absent task keeps its norm
                valid = new_n > ANCHOR_THRESHOLD
                a = order[jnp.argmax(valid[order])]
                coef = r * new_n[a]
                safe_n = jnp.where(valid, new_n, 1.0)
                h = jnp.where(valid.reshape(shape),
                              coef.reshape(shape) * g / safe_n.reshape(shape), g)
                if decay:
                    h = h + weight_decay * p.astype(jnp.float32)[None]
            new_m = b1 * m.astype(jnp.float32) + (1.0 - b1) * h
            new_v = b2 * v.astype(jnp.float32) + (1.0 - b2) * h * h
            denom = jnp.sqrt(new_v) / jnp.sqrt(bc2) + eps
            direction = jnp.sum(new_m, axis=0) / jnp.max(denom, axis=0) / bc1
            out.append(direction.astype(m.dtype))
            n_out.append(new_n)
            m_out.append(new_m.astype(m.dtype))
            v_out.append(new_v.astype(v.dtype))
        sdef = jax.tree.structure(state.norms)
        new_state = MTAdamState(
            count, state.seen + present.astype(jnp.int32), sdef.unflatten(n_out),
            sdef.unflatten(m_out), sdef.unflatten(v_out),
        )
        return treedef.unflatten(out), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
