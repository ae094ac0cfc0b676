"""Methods that weight task *losses*: Uncertainty, DWA, GradNorm.

Weighting loss `L_t` by `w_t` multiplies its gradient by `w_t`, so each method here
applies `update = sum_t w_t G_t` with the weights its paper gives the losses at that
step; the weights' own learning (Uncertainty, GradNorm) runs inside the transformation
with its own optax optimizer, and its state lives in the checkpoint.

* `uncertainty()` (Kendall et al., 2018): objective `sum_t 0.5 exp(-s_t) L_t + 0.5 s_t`
  with learnable `s_t = log sigma_t^2` (the paper's regression form); gradient weights
  `0.5 exp(-s_t)`; `s` takes one optimizer step on `d/ds = 0.5 - 0.5 exp(-s) L`.
* `dwa(temperature)` (Liu et al., 2019): `w_t = T softmax_t(r_t / temperature)` with
  `r_t = L_t(k-1) / L_t(k-2)` the ratio of the last two steps' losses (the paper uses
  epoch averages; set `beta>0` for moving averages of the losses instead of raw steps);
  `w = 1` for the first two steps.
* `gradnorm(alpha)` (Chen et al., 2018): learnable `w` (start 1); with
  `G_t = w_t ||g_t||` on the shared parameters (or those matching `layer`),
  `r_t = (L_t / L_t(0)) / mean(L / L(0))`, `L_grad = sum_t |G_t - mean(G) r_t^alpha|`
  (target held constant); `w` takes one optimizer step on `dL_grad/dw` and is
  renormalised to sum to T.

All need `task_losses=` in `update`.

A task absent from the batch (`task_present=` from the trainer, else its loss and every
shared gradient exactly zero) leaves its state untouched: Uncertainty's `s_t` (its
gradient `0.5 - 0.5 e^{-s} * 0` would push it down) and its inner optimizer slots; DWA's
loss history (no 0 loss enters it; a task's ratio is 1 until it has two observed steps);
GradNorm's weight `w_t` (the other weights are renormalised to keep their total), its
initial loss (`L_t(0)` is the loss of the task's first *present* step), and its inner
optimizer slots; the GradNorm loss averages over the present tasks only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from ktx.optim.num_tasks import (
    check_state_tasks,
    non_negative,
    resolve_num_tasks,
)
from ktx.optim.selection import param_names
from ktx.optim.task_gradients import (
    combine_with_weights,
    flatten_task_gradients,
    num_tasks_of,
    sq_norms,
)
from ktx.optim.weighting import LossWeighting, loss_weighting, presence, task_losses_array

__all__ = [
    "UncertaintyState",
    "uncertainty",
    "DWAState",
    "dwa",
    "GradNormState",
    "gradnorm",
]


def _keep_absent(new: Any, old: Any, present: jax.Array) -> Any:
    """`new` with every per-task `[T]` leaf restored to `old` for absent tasks (an inner
    optimizer's slots of the learnt per-task values)."""
    t = present.shape[0]
    return jax.tree.map(
        lambda n, o: jnp.where(present, n, o) if getattr(n, "shape", None) == (t,) else n,
        new, old)


class UncertaintyState(NamedTuple):
    log_vars: jax.Array  # [T] s_t = log sigma_t^2
    opt_state: Any


def uncertainty(
    learning_rate: float = 1e-3,
    optimizer: optax.GradientTransformation | None = None,
    num_tasks: int | None = None,
) -> LossWeighting:
    """Uncertainty weighting; `optimizer` (default `optax.adam(learning_rate)`) learns `s`."""
    non_negative(learning_rate, "learning_rate", "uncertainty")
    inner = optimizer if optimizer is not None else optax.adam(learning_rate)

    def init_fn(params):
        del params
        t = resolve_num_tasks(num_tasks, "uncertainty")
        s = jnp.zeros((t,), jnp.float32)
        return UncertaintyState(s, inner.init(s))

    def step_fn(state, t, losses, present):
        check_state_tasks("uncertainty", state.log_vars.shape[0], t)
        s = state.log_vars
        w = 0.5 * jnp.exp(-s)
        grad_s = jnp.where(present, 0.5 - 0.5 * jnp.exp(-s) * losses, 0.0)
        step, opt_state = inner.update(grad_s, state.opt_state, s)
        new_s = jnp.where(present, optax.apply_updates(s, step), s)
        opt_state = _keep_absent(opt_state, state.opt_state, present)
        return w, UncertaintyState(new_s, opt_state)

    return loss_weighting(init_fn, step_fn, "uncertainty")


class DWAState(NamedTuple):
    count: jax.Array  # [] steps seen
    last: jax.Array  # [T] L(k-1): the task's last observed (present) loss
    before_last: jax.Array  # [T] L(k-2): the one before
    observed: jax.Array  # [T] int32 steps the task was present


def dwa(
    temperature: float = 2.0, beta: float = 0.0, num_tasks: int | None = None
) -> LossWeighting:
    """Dynamic Weight Average; `beta` in [0, 1) smooths the losses (0: raw steps)."""
    if float(temperature) <= 0:
        raise ValueError(f"dwa: temperature={temperature!r}; expected > 0")
    if not 0.0 <= float(beta) < 1.0:
        raise ValueError(f"dwa: beta={beta!r}; accepted: [0, 1)")

    def init_fn(params):
        del params
        t = resolve_num_tasks(num_tasks, "dwa")
        z = jnp.zeros((t,), jnp.float32)
        return DWAState(jnp.zeros([], jnp.int32), z, z, jnp.zeros((t,), jnp.int32))

    def step_fn(state, t, losses, present):
        check_state_tasks("dwa", state.last.shape[0], t)
        ratio = state.last / jnp.where(state.before_last > 0, state.before_last, 1.0)
        ratio = jnp.where(state.observed >= 2, ratio, 1.0)
        w = t * jax.nn.softmax(ratio / temperature)
        w = jnp.where(state.count >= 2, w, jnp.ones_like(w))
        seen = state.observed > 0
        smoothed = jnp.where(seen, beta * state.last + (1 - beta) * losses, losses)
        new_state = DWAState(
            state.count + 1,
            jnp.where(present, smoothed, state.last),
            jnp.where(present, state.last, state.before_last),
            state.observed + present.astype(jnp.int32),
        )
        return w, new_state

    return loss_weighting(init_fn, step_fn, "dwa")


class GradNormState(NamedTuple):
    count: jax.Array  # []
    weights: jax.Array  # [T]
    initial_losses: jax.Array  # [T] L(0): the loss at the task's first present step
    has_initial: jax.Array  # [T] bool: L(0) is set
    opt_state: Any


def gradnorm(
    alpha: float = 1.5,
    learning_rate: float = 0.025,
    layer: Sequence[str] | None = None,
    optimizer: optax.GradientTransformation | None = None,
    num_tasks: int | None = None,
) -> optax.GradientTransformationExtraArgs:
    """GradNorm; `layer` regexes choose W (default: every shared parameter)."""
    import re

    if float(alpha) < 0:
        raise ValueError(f"gradnorm: alpha={alpha!r}; expected >= 0")
    non_negative(learning_rate, "learning_rate", "gradnorm")
    patterns = [re.compile(p) for p in layer] if layer is not None else None
    inner = optimizer if optimizer is not None else optax.adam(learning_rate)

    def init_fn(params):
        del params
        t = resolve_num_tasks(num_tasks, "gradnorm")
        w = jnp.ones((t,), jnp.float32)
        return GradNormState(jnp.zeros([], jnp.int32), w, jnp.ones((t,), jnp.float32),
                             jnp.zeros((t,), bool), inner.init(w))

    def update_fn(updates, state, params=None, *, task_losses=None, task_present=None, **extra):
        del params, extra
        stacked, _, treedef = flatten_task_gradients(updates, "gradnorm")
        t = num_tasks_of(stacked)
        check_state_tasks("gradnorm", state.weights.shape[0], t)
        losses = task_losses_array(task_losses, t, "gradnorm")
        present = presence(task_present, stacked, losses, t, "gradnorm")
        names = param_names(treedef.unflatten([0] * len(stacked)))
        chosen = [
            s for n, s in zip(names, stacked)
            if s is not None and (patterns is None or any(p.search(n) for p in patterns))
        ]
        if not chosen:
            raise ValueError(f"gradnorm: layer={layer!r} matches no shared parameter of {names}")
        sq = sq_norms(chosen)  # all at once (one reduction for the small leaves)
        norms = jnp.sqrt(sum(sq[1:], sq[0]))  # ||g_t|| on W
        w = state.weights
        fresh = present & ~state.has_initial
        initial = jnp.where(fresh, losses, state.initial_losses)
        n_present = jnp.maximum(present.sum(), 1)

        def mean(x):  # over the present tasks
            return jnp.where(present, x, 0.0).sum() / n_present

        g = w * norms
        ratio = losses / jnp.where(initial > 0, initial, 1.0)
        rel = ratio / jnp.maximum(mean(ratio), 1e-12)
        target = jax.lax.stop_gradient(mean(g) * rel**alpha)
        grad_w = jnp.where(present, jnp.sign(g - target) * norms, 0.0)
        step, opt_state = inner.update(grad_w, state.opt_state, w)
        stepped = jnp.maximum(optax.apply_updates(w, step), 0.0)
        # Present weights are renormalised to keep their total (T when all are present);
        # an absent task's weight is untouched.
        total = jnp.where(present, w, 0.0).sum()
        scale = total / jnp.maximum(jnp.where(present, stepped, 0.0).sum(), 1e-12)
        new_w = jnp.where(present, stepped * scale, w)
        opt_state = _keep_absent(opt_state, state.opt_state, present)
        new_state = GradNormState(state.count + 1, new_w, initial,
                                  state.has_initial | present, opt_state)
        return combine_with_weights(updates, w), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
