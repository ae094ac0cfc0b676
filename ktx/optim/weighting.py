"""Fixed task weightings (the MetaBalance paper's simplest baselines, He et al., 2022).

* `single_loss(target_task)`: Single-Loss, the target's gradient only (w = e_target).
* `vanilla_multi()`: Vanilla-Multi, the sum of all task gradients (w = 1).
* `fixed_weights(weights)`: a hand-set loss weight per task, `sum_t w_t G_t`.

These weight the shared parameters' task gradients; unshared parameters get the summed
gradient of the tasks that touch them (for `fixed_weights` a task-specific parameter is
therefore not scaled by its task's weight; declare it shared to scale it).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import optax

from ktx.optim.num_tasks import check_task_index, task_index
from ktx.optim.task_gradients import (
    combine_with_weights,
    flatten_task_gradients,
    num_tasks_of,
)

__all__ = ["single_loss", "vanilla_multi", "fixed_weights", "weighted_sum"]


def weighted_sum(weights_fn, name: str) -> optax.GradientTransformationExtraArgs:
    """A stateless balancer `update = sum_t w_t G_t` with `w = weights_fn(T)`."""

    def init_fn(params):
        del params
        return optax.EmptyState()

    def update_fn(updates, state, params=None, **extra):
        del params, extra
        stacked, _, _ = flatten_task_gradients(updates, name)
        t = num_tasks_of(stacked)
        return combine_with_weights(updates, weights_fn(t)), state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def single_loss(target_task: int = 0) -> optax.GradientTransformationExtraArgs:
    """Single-Loss: only the target task's gradient updates the shared parameters.

    `target_task`: any integer type (`int`, `np.int64`, a 0-d integer array)."""
    target_task = task_index(target_task, "target_task", "single_loss")

    def weights(t):
        check_task_index(target_task, t, "target_task", "single_loss")
        return jnp.zeros((t,), jnp.float32).at[target_task].set(1.0)

    return weighted_sum(weights, "single_loss")


def vanilla_multi() -> optax.GradientTransformationExtraArgs:
    """Vanilla-Multi: the plain sum of every task's gradient."""
    return weighted_sum(lambda t: jnp.ones((t,), jnp.float32), "vanilla_multi")


def fixed_weights(weights: Sequence[float]) -> optax.GradientTransformationExtraArgs:
    """`sum_t weights[t] * G_t` with one hand-set non-negative weight per task."""
    try:
        w = tuple(float(x) for x in weights)
    except (TypeError, ValueError) as e:
        raise TypeError(f"fixed_weights: weights={weights!r}; expected a list of numbers") from e
    if not w or any(x < 0 for x in w):
        raise ValueError(f"fixed_weights: weights={weights!r}; expected non-negative numbers")

    def weights_fn(t):
        if len(w) != t:
            raise ValueError(f"fixed_weights: {len(w)} weights {w} for {t} tasks")
        return jnp.asarray(w, jnp.float32)

    return weighted_sum(weights_fn, "fixed_weights")
