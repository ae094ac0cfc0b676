"""MTAdam (Malkiel and Wolf, 2021): Adam with per-loss moments, anchored on one loss.

Per parameter tensor and task t (the anchor is the target):

    n_t <- beta3 n_t + (1 - beta3) ||g_t||
    h_t  = g_t * n_anchor / (n_t + eps)            (h_anchor = g_anchor)
    m_t <- beta1 m_t + (1 - beta1) h_t ;  v_t <- beta2 v_t + (1 - beta2) h_t^2
    direction = sum_t m_t_hat / (sqrt(v_t_hat) + eps)

MTAdam is itself the optimizer: chain it with a learning rate only, e.g.
`optax.chain(ktx.optim.mtadam(), optax.scale_by_learning_rate(1e-3))`. Its state holds
`[T, *param]` moments per parameter (the method's cost). Unshared parameters take one
Adam step on their summed gradient (moments in task slot 0).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from ktx.optim.num_tasks import resolve_num_tasks
from ktx.optim.task_gradients import flatten_task_gradients, leaf_dense, num_tasks_of

__all__ = ["MTAdamState", "mtadam"]


class MTAdamState(NamedTuple):
    count: jax.Array  # []
    norms: Any  # params-structured [T]
    mu: Any  # params-structured [T, *param]
    nu: Any  # params-structured [T, *param]


def mtadam(
    b1: float = 0.9,
    b2: float = 0.999,
    b3: float = 0.9,
    eps: float = 1e-8,
    anchor: int = 0,
    num_tasks: int | None = None,
) -> optax.GradientTransformationExtraArgs:
    """MTAdam's direction (before the learning rate); see the module docstring."""
    for name, v in (("b1", b1), ("b2", b2), ("b3", b3)):
        if not 0.0 <= float(v) < 1.0:
            raise ValueError(f"mtadam: {name}={v!r}; accepted: [0, 1)")

    def init_fn(params):
        t = resolve_num_tasks(num_tasks, "mtadam")
        params = nn.meta.unbox(params)  # [T]-shaped state takes no logical axes
        if not 0 <= anchor < t:
            raise ValueError(f"mtadam: anchor={anchor!r} but num_tasks={t}")
        moments = lambda p: jnp.zeros((t,) + p.shape, p.dtype)  # noqa: E731
        return MTAdamState(
            jnp.zeros([], jnp.int32),
            jax.tree.map(lambda _: jnp.zeros((t,), jnp.float32), params),
            jax.tree.map(moments, params),
            jax.tree.map(moments, params),
        )

    def update_fn(updates, state, params=None, **extra):
        del params, extra
        stacked, summed, treedef = flatten_task_gradients(updates)
        t = num_tasks_of(stacked)
        count = state.count + 1
        bc1 = 1.0 - b1 ** count.astype(jnp.float32)
        bc2 = 1.0 - b2 ** count.astype(jnp.float32)
        norms_l, mu_l, nu_l = (jax.tree.leaves(x) for x in (state.norms, state.mu, state.nu))
        out, n_out, m_out, v_out = [], [], [], []
        for s, u, n, m, v in zip(stacked, summed, norms_l, mu_l, nu_l):
            if s is None:  # unshared: plain Adam in slot 0
                h = jnp.zeros_like(m).at[0].set(u)
                new_n = n
            else:
                g = leaf_dense(s)
                norm = jnp.sqrt(jnp.sum(jnp.square(g.astype(jnp.float32)).reshape(t, -1), axis=1))
                new_n = b3 * n + (1.0 - b3) * norm
                scale = (new_n[anchor] / (new_n + eps)).at[anchor].set(1.0)
                h = g * scale.reshape((t,) + (1,) * (g.ndim - 1)).astype(g.dtype)
            new_m = b1 * m + (1.0 - b1) * h
            new_v = b2 * v + (1.0 - b2) * h * h
            direction = (new_m / bc1) / (jnp.sqrt(new_v / bc2) + eps)
            if s is None:
                direction = direction[:1]
            out.append(direction.sum(axis=0).astype(m.dtype))
            n_out.append(new_n)
            m_out.append(new_m)
            v_out.append(new_v)
        sdef = jax.tree.structure(state.norms)
        new_state = MTAdamState(
            count, sdef.unflatten(n_out), sdef.unflatten(m_out), sdef.unflatten(v_out)
        )
        return treedef.unflatten(out), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
