"""MetaBalance (He et al., WWW 2022, Algorithm 2) as an optax transformation.

For every parameter tensor (or declared group of tensors) `p` and task `t`:

    m_t   <- beta * m_t + (1 - beta) * ||G_t||        (m_t starts at 0)
    w_t    = (m_tar / (m_t + eps)) * r + (1 - r)       if the strategy applies to t
           = 1                                         otherwise, and for the target
    update = sum_t w_t * G_t

with relax factor `r`; the strategy applies to an auxiliary task when
`m_t > m_tar` (`"reduce"`), `m_t < m_tar` (`"enlarge"`) or always (`"both"`, the only
one the authors' implementation has). `use_moving_average=False` uses `||G_t||` of the
current step instead of `m_t`. Unshared parameters get the sum of their task gradients.

A task with no rows in the batch (`task_present=` from the trainer, else every one of
its gradients exactly zero) leaves its moving average untouched and gets weight 1 (its
gradient is zero); while the target has no average yet, auxiliary weights are 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from ktx.optim.num_tasks import check_task_index, resolve_num_tasks, task_index
from ktx.optim.selection import group_names
from ktx.optim.task_gradients import (
    flatten_task_gradients,
    leaf_combine,
    num_tasks_of,
    sq_norms,
)

__all__ = ["STRATEGIES", "MetaBalanceState", "metabalance"]

STRATEGIES = ("reduce", "enlarge", "both")


class MetaBalanceState(NamedTuple):
    """`count []`; `moving_norms`, `weights`: params-structured, `[T]` float32 per leaf.

    `weights` is the multiplier applied to each task's gradient at the last step (1 for
    the target and for unshared parameters): it is what `ktx.optim.diagnostics` logs.
    """

    count: jax.Array
    moving_norms: Any
    weights: Any


def _check_unit(name: str, value: float, closed_right: bool = True) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError) as e:
        raise TypeError(f"metabalance: {name}={value!r} is not a number") from e
    if not (0.0 <= v <= 1.0 if closed_right else 0.0 <= v < 1.0):
        raise ValueError(f"metabalance: {name}={value!r}; accepted: [0, 1{']' if closed_right else ')'}")
    return v


def metabalance(
    relax_factor: float = 0.7,
    beta: float = 0.9,
    strategy: str = "both",
    target_task: int = 0,
    eps: float = 1e-8,
    groups: Sequence[str] | None = None,
    use_moving_average: bool = True,
    num_tasks: int | None = None,
) -> optax.GradientTransformationExtraArgs:
    """MetaBalance over per-task gradients (see the module docstring).

    Args:
      relax_factor: r in [0, 1]; 0 is plain summation, 1 matches magnitudes fully.
      beta: moving-average decay in [0, 1).
      strategy: one of `STRATEGIES`.
      target_task: index of the target task.
      eps: added to the auxiliary magnitude in the ratio.
      groups: regexes on parameter paths; tensors matching the same regex share one
        magnitude (the norm of their concatenation). None: per tensor.
      use_moving_average: False uses the current step's norms instead of `m`.
      num_tasks: T; required by `init` (gin: `%NUM_TASKS`).
    """
    r = _check_unit("relax_factor", relax_factor)
    b = _check_unit("beta", beta, closed_right=False)
    if strategy not in STRATEGIES:
        raise ValueError(f"metabalance: strategy={strategy!r}; accepted: {STRATEGIES}")
    target_task = task_index(target_task, "target_task", "metabalance")
    if float(eps) < 0:
        raise ValueError(f"metabalance: eps={eps!r}; expected >= 0")

    def init_fn(params):
        t = resolve_num_tasks(num_tasks, "metabalance")
        params = nn.meta.unbox(params)  # [T]-shaped state takes no logical axes
        check_task_index(target_task, t, "target_task", "metabalance")
        zeros = jax.tree.map(lambda _: jnp.zeros((t,), jnp.float32), params)
        ones = jax.tree.map(lambda _: jnp.ones((t,), jnp.float32), params)
        return MetaBalanceState(jnp.zeros([], jnp.int32), zeros, ones)

    def update_fn(updates, state, params=None, *, task_present=None, **extra):
        del params, extra
        stacked, summed, treedef = flatten_task_gradients(updates, "metabalance")
        t = num_tasks_of(stacked)
        m_leaves = jax.tree.leaves(state.moving_norms)
        if len(m_leaves) != len(stacked) or m_leaves[0].shape != (t,):
            raise ValueError(
                f"metabalance: state holds {len(m_leaves)} leaves of shape "
                f"{m_leaves[0].shape if m_leaves else None} but the gradients have "
                f"{len(stacked)} parameters and {t} tasks (was init given num_tasks={t}?)"
            )
        names = group_names(state.moving_norms, groups)
        # Norm of each group: sqrt of the sum of its members' squared norms.
        group_sq: dict[str, jax.Array] = {}
        for name, sq in zip(names, sq_norms(stacked)):
            if sq is not None:
                group_sq[name] = group_sq[name] + sq if name in group_sq else sq
        new_m: dict[str, jax.Array] = {}
        weights: dict[str, jax.Array] = {}
        aux_mask = jnp.arange(t) != target_task
        if task_present is None:
            present = sum(group_sq.values()) > 0
        else:
            present = jnp.asarray(task_present).astype(bool).reshape(t)
        for name, sq in group_sq.items():
            norm = jnp.sqrt(sq)
            idx = names.index(name)
            m = b * m_leaves[idx] + (1.0 - b) * norm if use_moving_average else norm
            m = jnp.where(present, m, m_leaves[idx])  # an absent task keeps its average
            m_tar = m[target_task]
            if strategy == "reduce":
                applies = m > m_tar
            elif strategy == "enlarge":
                applies = m < m_tar
            else:
                applies = jnp.ones_like(aux_mask)
            applies = applies & aux_mask & present & (m_tar > 0)
            scaled = m_tar / (m + eps) * r + (1.0 - r)
            new_m[name] = m
            weights[name] = jnp.where(applies, scaled, 1.0).astype(jnp.float32)
        out, m_out, w_out = [], [], []
        for name, s, u, m_old in zip(names, stacked, summed, m_leaves):
            if s is None:
                out.append(u)
                m_out.append(m_old)
                w_out.append(jnp.ones((t,), jnp.float32))
            else:
                out.append(leaf_combine(s, weights[name]))
                m_out.append(new_m[name])
                w_out.append(weights[name])
        mdef = jax.tree.structure(state.moving_norms)
        new_state = MetaBalanceState(
            state.count + 1, mdef.unflatten(m_out), mdef.unflatten(w_out)
        )
        return treedef.unflatten(out), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
