"""Optimizers, learning-rate schedules, parameter freezing, and `TaskOptimizer`: the one
object the train step updates parameters with.

The factories return plain optax objects, so gin can compose them:

    schedule = rsqrt_schedule(base_learning_rate=1.0, warmup_steps=10_000)
    tx = adafactor(learning_rate=schedule)                  # T5X's default optimizer
    tx = freeze(tx, frozen=[r"encoder/.*"])                 # frozen params get 0 updates

`TaskOptimizer(tx, balancer=None, schedule=None, frozen=())` is what `ktx.training.trainer` holds:
the optimizer, an optional `ktx.optim` balancer in front of it (per-task gradients -> one
gradient), the schedule (only to report the learning rate) and the frozen patterns.
Its state is the optimizer's, or `(balancer_state, optimizer_state)` with a balancer
(the state of `optax.chain(balancer, tx)`; `as_optax()` returns that chain).

Gradient accumulation over microbatches lives in the train step (`ktx.training.trainer`): it
sums exact per-microbatch loss gradients normalized by the whole batch, which matches
the full-batch gradient for every loss normalization.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ktx import treepath
from ktx.training.factoring import as_matrices

__all__ = [
    "Schedule",
    "constant_schedule",
    "rsqrt_schedule",
    "linear_decay_schedule",
    "adafactor",
    "scale_by_param_rms",
    "adamw",
    "sgd",
    "frozen_mask",
    "freeze",
    "delay",
    "TASK_MODULES",
    "task_module_warmup",
    "TaskOptimizer",
]

Schedule = Callable[[jax.Array | int], jax.Array]


def _check_positive(name: str, value: Any, allow_zero: bool = False) -> None:
    ok = isinstance(value, (int, float)) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        kind = "a non-negative number" if allow_zero else "a positive number"
        raise ValueError(f"{name}={value!r}; accepted: {kind}")


def constant_schedule(value: float) -> Schedule:
    """`lr(step) = value`."""
    _check_positive("value", value, allow_zero=True)
    return optax.constant_schedule(float(value))


def rsqrt_schedule(base_learning_rate: float = 1.0, warmup_steps: int = 10_000) -> Schedule:
    """T5's inverse square root schedule (Raffel et al., 2020).

    `lr(step) = base_learning_rate / sqrt(max(step, warmup_steps))`: constant
    `base / sqrt(warmup_steps)` during warmup, then decaying as `1 / sqrt(step)`.
    """
    _check_positive("base_learning_rate", base_learning_rate)
    if not isinstance(warmup_steps, int) or warmup_steps < 1:
        raise ValueError(f"warmup_steps={warmup_steps!r}; accepted: an integer >= 1")

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        return base_learning_rate * jax.lax.rsqrt(jnp.maximum(step, float(warmup_steps)))

    return schedule


def linear_decay_schedule(
    peak_learning_rate: float,
    decay_steps: int,
    warmup_steps: int = 0,
    end_learning_rate: float = 0.0,
) -> Schedule:
    """Linear warmup from 0 to the peak over `warmup_steps`, then linear decay to
    `end_learning_rate` at step `warmup_steps + decay_steps`, constant afterwards."""
    _check_positive("peak_learning_rate", peak_learning_rate)
    _check_positive("end_learning_rate", end_learning_rate, allow_zero=True)
    if not isinstance(decay_steps, int) or decay_steps < 1:
        raise ValueError(f"decay_steps={decay_steps!r}; accepted: an integer >= 1")
    if not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"warmup_steps={warmup_steps!r}; accepted: an integer >= 0")
    decay = optax.linear_schedule(peak_learning_rate, end_learning_rate, decay_steps)
    if warmup_steps == 0:
        return decay
    warmup = optax.linear_schedule(0.0, peak_learning_rate, warmup_steps)
    return optax.join_schedules([warmup, decay], [warmup_steps])


def scale_by_param_rms(min_scale: float = 1e-3) -> optax.GradientTransformation:
    """Updates times `max(rms(param), min_scale)`, one read of each parameter (Adafactor's
    parameter scale). `optax.scale_by_param_block_rms` computes the same value through
    `optax.safe_root_mean_squares`, whose gradient-safe form reads every parameter twice
    and writes a masked copy of it: on T5.1.1-Small 3 extra passes over every kernel per
    step. No gradient is taken through an optimizer update, so the plain form is exact.
    Its state is `optax.EmptyState()`, as optax's."""

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("scale_by_param_rms needs params= (Adafactor's parameter scale)")

        def scale(u, p):
            rms = jnp.sqrt(jnp.mean(jnp.square(p)))
            return u * jnp.maximum(rms, min_scale)

        return jax.tree.map(scale, updates, params), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def adafactor(
    learning_rate: float | Schedule = 1e-3,
    *,
    decay_rate: float = 0.8,
    clipping_threshold: float | None = 1.0,
    multiply_by_parameter_scale: bool = True,
    factored: bool = True,
    min_dim_size_to_factor: int = 128,
    momentum: float | None = None,
    epsilon1: float = 1e-30,
    weight_decay_rate: float | None = None,
) -> optax.GradientTransformation:
    """Adafactor (Shazeer & Stern, 2018) with T5X's defaults: factored second moments,
    decay rate 0.8, update clipping at 1.0, updates scaled by the parameter RMS, no
    momentum. `learning_rate` is a float or a schedule (T5X pairs it with
    `rsqrt_schedule`). Kernels of rank > 2 (attention heads split) are factored as the
    matrices T5X stores (`ktx.training.factoring.as_matrices`), so a step equals T5X's.

    The chain is `optax.adafactor`'s, transform for transform (so its state, and
    checkpoints of it, are optax's), with the parameter scale read once
    (`scale_by_param_rms`)."""
    if not callable(learning_rate):
        _check_positive("learning_rate", learning_rate)
    chain = [optax.scale_by_factored_rms(factored, decay_rate, 0, min_dim_size_to_factor,
                                         epsilon1)]
    if clipping_threshold is not None:
        chain.append(optax.clip_by_block_rms(clipping_threshold))
    chain.append(optax.scale_by_learning_rate(learning_rate, flip_sign=False))
    if multiply_by_parameter_scale:
        chain.append(scale_by_param_rms())
    if momentum is not None:
        chain.append(optax.ema(momentum, debias=False, accumulator_dtype=jnp.float32))
    if weight_decay_rate is not None:
        chain.append(optax.add_decayed_weights(weight_decay_rate))
    chain.append(optax.scale(-1))
    return as_matrices(optax.chain(*chain))


def adamw(
    learning_rate: float | Schedule = 1e-3,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    grad_clip_norm: float | None = None,
) -> optax.GradientTransformation:
    """AdamW (Loshchilov & Hutter, 2019); optional global-norm gradient clipping first."""
    if not callable(learning_rate):
        _check_positive("learning_rate", learning_rate)
    _check_positive("weight_decay", weight_decay, allow_zero=True)
    tx = optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
    if grad_clip_norm is not None:
        _check_positive("grad_clip_norm", grad_clip_norm)
        tx = optax.chain(optax.clip_by_global_norm(grad_clip_norm), tx)
    return tx


def sgd(learning_rate: float | Schedule = 1e-2, momentum: float | None = None):
    """Plain SGD (used by tests and by recommendation baselines)."""
    if not callable(learning_rate):
        _check_positive("learning_rate", learning_rate)
    return optax.sgd(learning_rate, momentum=momentum)


def frozen_mask(params: Any, frozen: treepath.Selection) -> Any:
    """A pytree like `params` of what `frozen` names (`ktx.treepath.select`): `True` where a
    path fully matches a regex, `False` where nothing does, and a bool vector over the
    leading axis where `treepath.Rows` entries freeze some rows of a stacked (scanned) leaf.

    Raises ValueError naming an entry that is not a valid regex, matches nothing (a typo
    would otherwise silently train everything) or has rows outside a leaf.
    """
    if isinstance(frozen, str):
        raise TypeError(f"frozen={frozen!r} must be a list of regexes, not a string")
    return treepath.select(params, frozen, what="frozen pattern")


def _zero_frozen_rows(frozen: tuple) -> optax.GradientTransformation:
    """Zeroes the frozen rows (`treepath.Rows`) of partly frozen leaves' updates, after the
    optimizer: weight decay and momentum never move a frozen row."""

    def update(updates, state, params=None):
        del params
        mask = frozen_mask(updates, frozen)

        def zero(rows, u):
            if not isinstance(rows, np.ndarray):
                return u
            return jnp.where(treepath.rows_like(rows, u), jnp.zeros_like(u), u)

        return jax.tree.map(zero, mask, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def freeze(tx: optax.GradientTransformation, frozen: treepath.Selection = ()) -> Any:
    """`tx` for trainable parameters; zero updates (and no optimizer state) for the
    parameters whose '/'-joined path fully matches one of the `frozen` regexes. A
    `treepath.Rows` entry freezes rows of a scanned stack's leaves: those leaves keep `tx`'s
    state whole (their frozen rows' gradients are zero), and their frozen rows' updates are
    zeroed after `tx` (so decoupled weight decay does not move them)."""
    if not frozen:
        return tx
    frozen = tuple(frozen)

    def labels(params):
        mask = frozen_mask(params, frozen)
        return jax.tree.map(lambda m: "frozen" if m is True else "trainable", mask)

    tx = optax.multi_transform({"trainable": tx, "frozen": optax.set_to_zero()}, labels)
    if any(isinstance(entry, treepath.Rows) for entry in frozen):
        tx = optax.chain(tx, _zero_frozen_rows(frozen))
    return tx


class DelayState(NamedTuple):
    count: jax.Array  # steps seen, saturating at `steps`
    inner: Any


def delay(tx: optax.GradientTransformation, steps: int) -> optax.GradientTransformation:
    """`tx` that starts at step `steps`: zero updates before, and `tx`'s state untouched
    (its step count, moments and schedule start afresh when it starts)."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps={steps!r}; accepted: an int >= 0")

    def init(params):
        return DelayState(jnp.zeros((), jnp.int32), tx.init(params))

    def update(updates, state, params=None):
        def wait():
            return jax.tree.map(jnp.zeros_like, updates), state.inner

        def run():
            return tx.update(updates, state.inner, params)

        new_updates, inner = jax.lax.cond(state.count < steps, wait, run)
        return new_updates, DelayState(jnp.minimum(state.count + 1, steps), inner)

    return optax.GradientTransformation(init, update)


# Task-specific modules of the encoder models: the per-task heads and a method's
# conditioning parameters (PALs, TEA embeddings, CA-MTL's modules).
TASK_MODULES = (r"task_heads/.*", r"conditioning/.*")


def task_module_warmup(optimizer: optax.GradientTransformation, warmup_steps: int,
                       task_modules: Sequence[str] = TASK_MODULES) -> optax.GradientTransformation:
    """Single-task warm-up of the task-specific modules before multi-task training (the
    SlapBERT study): for the first `warmup_steps` steps only the parameters whose path
    fully matches `task_modules` train (each task's modules see only its own rows' loss,
    so this is every task's single-task warm-up at once); the rest (the shared backbone)
    starts then, with `optimizer`'s state fresh (`delay`). Both parts use `optimizer`,
    each with its own state."""
    if isinstance(task_modules, str):
        raise TypeError(f"task_modules={task_modules!r} must be a list of regexes")
    task_modules = tuple(task_modules)

    def labels(params):
        names = treepath.names(params)
        mask = jax.tree_util.tree_map_with_path(
            lambda p, _: any(re.fullmatch(rx, treepath.name(p)) for rx in task_modules), params)
        if not any(jax.tree.leaves(mask)):
            raise ValueError(f"task_module_warmup: task_modules={task_modules} match no "
                             f"parameter; parameter paths look like {names[:5]}")
        return jax.tree.map(lambda m: "task" if m else "backbone", mask)

    return optax.multi_transform(
        {"task": optimizer, "backbone": delay(optimizer, warmup_steps)}, labels)


@dataclasses.dataclass(frozen=True, eq=False)
class TaskOptimizer:
    """The optimizer of a multi-task train step.

    Args:
      optimizer: an optax transformation (a `ktx.training.optimizers` factory's result).
      balancer: an optional `ktx.optim` balancer (a `GradientTransformationExtraArgs`
        taking a `TaskGradients` and `task_losses=`, `task_present=`). With one, the step
        computes per-task gradients and `update` combines them before `optimizer`.
      schedule: the learning-rate schedule (or a number), reported as `learning_rate`.
      frozen: regexes of parameter names (`ktx.treepath`) that get no update and no
        optimizer state (`freeze`), e.g. a model's `frozen_patterns`.
    """

    optimizer: optax.GradientTransformation
    balancer: Any = None
    schedule: Any = None
    frozen: tuple[str, ...] = ()

    def __post_init__(self):
        if not hasattr(self.optimizer, "init") or not hasattr(self.optimizer, "update"):
            raise TypeError(f"optimizer={self.optimizer!r} is not an optax GradientTransformation")
        if self.balancer is not None and not (
                hasattr(self.balancer, "init") and hasattr(self.balancer, "update")):
            raise TypeError(f"balancer={self.balancer!r} is not a ktx.optim balancer "
                            "(an optax GradientTransformationExtraArgs)")
        if isinstance(self.frozen, str):
            raise TypeError(f"frozen={self.frozen!r} must be a list of regexes, not a string")
        object.__setattr__(self, "frozen", tuple(self.frozen or ()))
        # A learning rate given as a number (optax accepts one) is reported as constant.
        if self.schedule is not None and not callable(self.schedule):
            object.__setattr__(self, "schedule", optax.constant_schedule(float(self.schedule)))
        object.__setattr__(self, "_frozen_tx", freeze(self.optimizer, self.frozen))

    @property
    def balanced(self) -> bool:
        """Whether the step computes per-task gradients (a balancer is set)."""
        return self.balancer is not None

    @property
    def _tx(self) -> optax.GradientTransformation:
        return self._frozen_tx

    @property
    def weights_from_losses(self) -> bool:
        """Whether the balancer's weights depend on the losses only (a
        `ktx.optim.LossWeighting`): the step can then skip per-task gradients
        (`ktx.optim.loss_weighted_gradient`, then `apply_balanced`)."""
        from ktx.optim.weighting import LossWeighting

        return isinstance(self.balancer, LossWeighting)

    def as_optax(self) -> optax.GradientTransformation:
        """The whole update as one optax transformation (`chain(balancer, optimizer)`)."""
        return optax.chain(self.balancer, self._tx) if self.balanced else self._tx

    def init(self, params: Any) -> Any:
        """The optimizer state: `optimizer.init(params)`, or `(balancer_state,
        optimizer_state)` with a balancer (the layout of `as_optax().init`)."""
        if self.balanced:
            return (self.balancer.init(params), self._tx.init(params))
        return self._tx.init(params)

    def update(
        self, gradients: Any, state: Any, params: Any, *,
        task_losses: jax.Array | None = None, task_present: jax.Array | None = None,
    ) -> tuple[Any, Any, Any]:
        """`(gradient, updates, state)`: the gradient the optimizer saw (the balanced one
        for per-task `gradients`, which a balanced optimizer requires), the parameter
        updates, and the new state."""
        if not self.balanced:
            updates, state = self._tx.update(gradients, state, params)
            return gradients, updates, state
        grads, balancer_state = self.balancer.update(
            gradients, state[0], params, task_losses=task_losses, task_present=task_present)
        return self.apply_balanced(grads, balancer_state, state, params)

    def apply_balanced(
        self, gradient: Any, balancer_state: Any, state: Any, params: Any
    ) -> tuple[Any, Any, Any]:
        """`update`'s second half: `gradient` is what the balancer made of the per-task
        gradients (or `ktx.optim.loss_weighted_gradient`'s, for a `LossWeighting`), and
        `balancer_state` its new state; `(gradient, updates, new_state)` as `update`
        returns them."""
        if not self.balanced:
            raise TypeError("apply_balanced needs a TaskOptimizer with a balancer")
        updates, optimizer_state = self._tx.update(gradient, state[1], params)
        return gradient, updates, (balancer_state, optimizer_state)

    def learning_rate(self, step: jax.Array) -> jax.Array:
        """The scheduled learning rate at `step`. Without a schedule the rate is inside
        the optax optimizer, out of reach: an error (the trainer then logs none)."""
        if self.schedule is None:
            raise ValueError("TaskOptimizer.learning_rate: no schedule was given; pass "
                             "`schedule=` to report the learning rate")
        return jnp.asarray(self.schedule(step), jnp.float32)
