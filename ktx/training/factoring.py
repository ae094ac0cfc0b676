"""Optimizers that see every parameter as the matrix T5X stores.

ktx keeps attention kernels with their heads split (`[E, H, D]` for query/key/value,
`[H, D, E]` for the output), which the partitioning rules need. T5X's T5.1.1 stores the
same kernels flattened (`[E, H*D]`, `[H*D, E]`), and Adafactor decides what to factor
from the shape: the two largest axes, when the second reaches `min_dim_size_to_factor`.
On the split layout optax's Adafactor would pick `E` and `D` (or `H`), find the smaller
below the threshold (D = 64 in every T5.1.1 size) and keep a full second moment — a
different update from T5X's and, for XXL, 4.8B more optimizer floats than T5X holds.

`as_matrices(tx)` runs `tx` on every parameter of rank > 2 reshaped to a matrix (the
split of its axes that is closest to square: `[E, H, D]` -> `[E, H*D]`, `[H, D, E]` ->
`[H*D, E]`) and reshapes the updates back; rank <= 2 parameters pass unchanged. With
`tx = optax.adafactor(...)` one step on the T5X fixture equals T5X's own step
(tests/convert/test_t5x_optimizer_step.py). The optimizer state lives in the matrix view.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import optax

__all__ = ["as_matrices", "matrix_shape"]


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """`shape` as a matrix: axes `[:k]` and `[k:]` merged, `k` making the two sides
    closest to equal (the first such `k`); `shape` itself when its rank is <= 2."""
    if len(shape) <= 2:
        return tuple(shape)
    best = max(range(1, len(shape)),
               key=lambda k: (min(math.prod(shape[:k]), math.prod(shape[k:])), -k))
    return math.prod(shape[:best]), math.prod(shape[best:])


def _view(x: Any) -> Any:
    return x if x is None or x.ndim <= 2 else x.reshape(matrix_shape(x.shape))


def as_matrices(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """`tx` applied to the matrix view of each parameter (see the module docstring)."""

    tx = optax.with_extra_args_support(tx)

    def init(params):
        return tx.init(jax.tree.map(_view, params))

    def update(updates, state, params=None, **extra):
        viewed = jax.tree.map(_view, updates)
        params_viewed = None if params is None else jax.tree.map(_view, params)
        new, state = tx.update(viewed, state, params_viewed, **extra)
        return jax.tree.map(lambda u, like: u.reshape(like.shape), new, updates), state

    return optax.GradientTransformationExtraArgs(init, update)
