"""Optimizers, learning-rate schedules and parameter freezing for the ktx trainer.

Everything here returns plain optax objects, so gin can compose them and the trainer
only ever sees an `optax.GradientTransformation` plus a schedule (for logging):

    schedule = rsqrt_schedule(base_learning_rate=1.0, warmup_steps=10_000)
    tx = adafactor(learning_rate=schedule)                  # T5X's default optimizer
    tx = freeze(tx, frozen=[r"encoder/.*"])                 # frozen params get 0 updates

Gradient accumulation over microbatches lives in the train step (`ktx.trainer`): it
sums exact per-microbatch loss gradients normalized by the whole batch, which matches
the full-batch gradient for every loss normalization.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

__all__ = [
    "Schedule",
    "constant_schedule",
    "rsqrt_schedule",
    "linear_decay_schedule",
    "adafactor",
    "adamw",
    "sgd",
    "param_path",
    "param_paths",
    "frozen_mask",
    "freeze",
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
    `rsqrt_schedule`)."""
    if not callable(learning_rate):
        _check_positive("learning_rate", learning_rate)
    return optax.adafactor(
        learning_rate=learning_rate,
        min_dim_size_to_factor=min_dim_size_to_factor,
        decay_rate=decay_rate,
        multiply_by_parameter_scale=multiply_by_parameter_scale,
        clipping_threshold=clipping_threshold,
        momentum=momentum,
        eps=epsilon1,
        factored=factored,
        weight_decay_rate=weight_decay_rate,
    )


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


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def param_path(path: Sequence[Any]) -> str:
    """A tree path as a '/'-joined string, e.g. `encoder/layers_0/mlp/wi_0/kernel`."""
    return "/".join(_key_name(k) for k in path)


def param_paths(params: Any) -> list[str]:
    """'/'-joined paths of every leaf of `params`, in tree order."""
    return [param_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]


def frozen_mask(params: Any, frozen: Sequence[str]) -> Any:
    """A pytree of bools like `params`: True where a path fully matches a pattern.

    Raises ValueError naming a pattern that is not a valid regex or matches nothing
    (a typo would otherwise silently train everything).
    """
    if isinstance(frozen, str):
        raise TypeError(f"frozen={frozen!r} must be a list of regexes, not a string")
    compiled = []
    for pattern in frozen:
        try:
            compiled.append(re.compile(pattern))
        except re.error as e:
            raise ValueError(f"frozen pattern {pattern!r} is not a valid regex: {e}") from e
    paths = param_paths(params)
    for pattern, rx in zip(frozen, compiled):
        if not any(rx.fullmatch(p) for p in paths):
            raise ValueError(
                f"frozen pattern {pattern!r} matches no parameter; parameter paths "
                f"look like {paths[:5]}"
            )
    return jax.tree_util.tree_map_with_path(
        lambda p, _: any(rx.fullmatch(param_path(p)) for rx in compiled), params
    )


def freeze(tx: optax.GradientTransformation, frozen: Sequence[str] = ()) -> Any:
    """`tx` for trainable parameters; zero updates (and no optimizer state) for the
    parameters whose '/'-joined path fully matches one of the `frozen` regexes."""
    if not frozen:
        return tx
    frozen = tuple(frozen)

    def labels(params):
        mask = frozen_mask(params, frozen)
        return jax.tree.map(lambda m: "frozen" if m else "trainable", mask)

    return optax.multi_transform({"trainable": tx, "frozen": optax.set_to_zero()}, labels)
