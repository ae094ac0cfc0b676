"""Fixed task weightings (the MetaBalance paper's simplest baselines, He et al., 2022),
and `LossWeighting`, the kind of balancer whose weights depend on the losses only.

* `single_loss(target_task)`: Single-Loss, the target's gradient only (w = e_target).
* `vanilla_multi()`: Vanilla-Multi, the sum of all task gradients (w = 1).
* `fixed_weights(weights)`: a hand-set loss weight per task, `sum_t w_t G_t`.

These weight the shared parameters' task gradients; unshared parameters get the summed
gradient of the tasks that touch them (for `fixed_weights` a task-specific parameter is
therefore not scaled by its task's weight; declare it shared to scale it).

A `LossWeighting` balancer (these three, `uncertainty`, `dwa`) computes its weights from
its state and the step's losses, never from the gradients: `tx.weights(state,
task_losses, task_present) -> (w [T], new_state)`. Knowing `w` before any gradient, the
train step needs no per-task gradients: one backward pass of `sum_t w_t L_t` gives the
shared parameters' update, and one of `sum_t L_t` (through the unshared parameters only;
XLA drops the rest) gives the unshared ones, which is `update` on the per-task gradients
of the same step (`ktx.optim.loss_weighted_gradient`, used by the `Trainer`). Wrapping
one (`optax.chain`, `optax.inject_hyperparams`) makes it an ordinary balancer again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from ktx.optim.num_tasks import check_task_index, present_tasks, task_index
from ktx.optim.task_gradients import (
    combine_with_weights,
    flatten_task_gradients,
    nonzero_tasks,
    num_tasks_of,
)

__all__ = [
    "LossWeighting",
    "loss_weighting",
    "task_losses_array",
    "presence",
    "single_loss",
    "vanilla_multi",
    "fixed_weights",
    "weighted_sum",
]

# step_fn(state, num_tasks, losses, present) -> (w [T], new_state); losses and present are
# None for a balancer that does not read them (`uses_losses=False`).
StepFn = Callable[[Any, int, Any, Any], tuple[jax.Array, Any]]


class LossWeighting(optax.GradientTransformationExtraArgs):
    """A balancer `update = sum_t w_t G_t` (shared parameters; unshared ones summed) whose
    weights are a function of its state and the step's losses only.

    Besides optax's `init` and `update`, an instance has
    `weights(state, task_losses, task_present=None) -> (w [T] float32, new_state)`:
    the weights `update` would apply at this step and the state it would return
    (`task_present` defaults to "the task's loss is not 0").
    """

    weights: Callable[..., tuple[jax.Array, Any]]


def task_losses_array(task_losses: Any, num_tasks: int, method: str) -> jax.Array:
    """`task_losses` as a `[T]` float32 constant; ValueError when missing or misshapen."""
    if task_losses is None:
        raise ValueError(f"{method}: update needs task_losses= (the [T] per-task losses)")
    losses = jax.lax.stop_gradient(jnp.asarray(task_losses, jnp.float32))
    if losses.shape != (num_tasks,):
        raise ValueError(f"{method}: task_losses has shape {losses.shape}; expected ({num_tasks},)")
    return losses


def presence(task_present: Any, stacked: list, losses: jax.Array, t: int,
             method: str) -> jax.Array:
    """`[T]` bool: `task_present` when given, else a task is absent when its loss and its
    shared gradients (`stacked` leaves) are all exactly 0."""
    if task_present is None:
        return nonzero_tasks(stacked) | (losses != 0)
    return present_tasks(task_present, t, method, None)


def loss_weighting(init_fn: Callable[[Any], Any], step_fn: StepFn, name: str,
                   uses_losses: bool = True) -> LossWeighting:
    """A `LossWeighting` from `init_fn(params) -> state` and `step_fn(state, T, losses,
    present) -> (w, new_state)`. In `update` a task is absent when `task_present` says so,
    else when its loss and every shared gradient are exactly 0; in `weights` (no
    gradients) when its loss is 0."""

    def update_fn(updates, state, params=None, *, task_losses=None, task_present=None, **extra):
        del params, extra
        stacked, _, _ = flatten_task_gradients(updates, name)
        t = num_tasks_of(stacked)
        losses = present = None
        if uses_losses:
            losses = task_losses_array(task_losses, t, name)
            present = presence(task_present, stacked, losses, t, name)
        w, state = step_fn(state, t, losses, present)
        return combine_with_weights(updates, w), state

    def weights_fn(state, task_losses, task_present=None):
        if task_losses is None:
            raise ValueError(f"{name}.weights needs task_losses (the [T] per-task losses)")
        if jnp.ndim(task_losses) != 1:
            raise ValueError(f"{name}.weights: task_losses has shape {jnp.shape(task_losses)}; "
                             "expected [T], one loss per task")
        t = jnp.shape(task_losses)[0]
        losses = task_losses_array(task_losses, t, name)
        present = present_tasks(task_present, t, name, losses != 0) if uses_losses else None
        return step_fn(state, t, losses if uses_losses else None, present)

    tx = LossWeighting(init_fn, update_fn)
    tx.weights = weights_fn
    return tx


def weighted_sum(weights_fn, name: str) -> LossWeighting:
    """A stateless balancer `update = sum_t w_t G_t` with `w = weights_fn(T)`."""

    def init_fn(params):
        del params
        return optax.EmptyState()

    def step_fn(state, t, losses, present):
        del losses, present
        return weights_fn(t), state

    return loss_weighting(init_fn, step_fn, name, uses_losses=False)


def single_loss(target_task: int = 0) -> LossWeighting:
    """Single-Loss: only the target task's gradient updates the shared parameters.

    `target_task`: any integer type (`int`, `np.int64`, a 0-d integer array)."""
    target_task = task_index(target_task, "target_task", "single_loss")

    def weights(t):
        check_task_index(target_task, t, "target_task", "single_loss")
        return jnp.zeros((t,), jnp.float32).at[target_task].set(1.0)

    return weighted_sum(weights, "single_loss")


def vanilla_multi() -> LossWeighting:
    """Vanilla-Multi: the plain sum of every task's gradient."""
    return weighted_sum(lambda t: jnp.ones((t,), jnp.float32), "vanilla_multi")


def fixed_weights(weights: Sequence[float]) -> LossWeighting:
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
