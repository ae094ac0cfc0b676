"""OL-AUX (Lin et al., 2019): auxiliary weights learnt online from gradient alignment.

The objective is `L_tar + sum_k w_k L_k`. Every `horizon` (N) steps the weights take a
gradient step on the target loss after those N steps, which to first order is

    w_k <- w_k + learning_rate * sum_{i in last N steps} g_tar(i) . g_k(i)

(Lin et al.'s update with the model's step size folded into `learning_rate`).
The update applied at every step is `g_tar + sum_k w_k g_k` over the shared parameters.

A step where the target or auxiliary task k is absent from the batch (`task_present=`
from the trainer, else every one of its shared gradients exactly zero) adds nothing to
k's sum: the weight step uses the steps where both had rows.
"""

from __future__ import annotations

import operator
from typing import NamedTuple

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
    combine_with_weights,
    flatten_task_gradients,
    global_gram,
    nonzero_tasks,
    num_tasks_of,
)

__all__ = ["OLAuxState", "olaux"]


class OLAuxState(NamedTuple):
    count: jax.Array  # []
    weights: jax.Array  # [T]; the target's stays 1
    dots: jax.Array  # [T] sum of g_tar . g_k since the last weight update


def olaux(
    learning_rate: float = 1e-3,
    horizon: int = 5,
    target_task: int = 0,
    initial_weight: float = 1.0,
    num_tasks: int | None = None,
) -> optax.GradientTransformationExtraArgs:
    """OL-AUX with weight step `learning_rate` every `horizon` steps."""
    if not isinstance(horizon, jax.core.Tracer):  # traced under optax.inject_hyperparams
        try:
            h = None if isinstance(horizon, bool) else operator.index(horizon)
        except TypeError:
            h = None
        if h is None or h < 1:
            raise ValueError(f"olaux: horizon={horizon!r}; expected a positive int")
        horizon = h
    target_task = task_index(target_task, "target_task", "olaux")
    non_negative(learning_rate, "learning_rate", "olaux")

    def init_fn(params):
        del params
        t = resolve_num_tasks(num_tasks, "olaux")
        check_task_index(target_task, t, "target_task", "olaux")
        w = jnp.full((t,), float(initial_weight), jnp.float32).at[target_task].set(1.0)
        return OLAuxState(jnp.zeros([], jnp.int32), w, jnp.zeros((t,), jnp.float32))

    def update_fn(updates, state, params=None, *, task_present=None, **extra):
        del params, extra
        stacked, _, _ = flatten_task_gradients(updates, "olaux")
        t = num_tasks_of(stacked)
        check_state_tasks("olaux", state.weights.shape[0], t)
        check_task_index(target_task, t, "target_task", "olaux")
        present = present_tasks(task_present, t, "olaux", nonzero_tasks(stacked))
        gram = global_gram(stacked)
        out = combine_with_weights(updates, state.weights)
        both = present & present[target_task]
        dots = state.dots + jnp.where(both, gram[target_task], 0.0)
        count = state.count + 1
        due = count % horizon == 0
        stepped = (state.weights + learning_rate * dots).at[target_task].set(1.0)
        weights = jnp.where(due, stepped, state.weights)
        dots = jnp.where(due, jnp.zeros_like(dots), dots)
        return out, OLAuxState(count, weights, dots)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
