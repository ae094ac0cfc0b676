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

A scanned layer stack (`T5Config.scan_layers`: `encoder/layers/...` parameters stacked on
a leading `[L]` axis) is L parameters to the optimizer, as T5X's Adafactor treats its
`layers` axis (`FactorDim.BATCH`): `tx` runs on each layer's slice (`jax.vmap` over the
leading axis: its own factoring, parameter scale and update clipping, as unrolled), so a
scanned run takes the unrolled run's steps.
"""

from __future__ import annotations

import math
import re
from typing import Any

import jax
import optax

from ktx import treepath

__all__ = ["STACKED_LAYERS", "as_matrices", "matrix_shape"]

# Parameters of a scanned layer stack (`ktx.models.scan_layout`): a leading `[L]` axis.
STACKED_LAYERS = re.compile(r"(^|/)(encoder|decoder)/layers/")


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


def _on_matrices(tx: optax.GradientTransformationExtraArgs) -> optax.GradientTransformationExtraArgs:
    def init(params):
        return tx.init(jax.tree.map(_view, params))

    def update(updates, state, params=None, **extra):
        viewed = jax.tree.map(_view, updates)
        params_viewed = None if params is None else jax.tree.map(_view, params)
        new, state = tx.update(viewed, state, params_viewed, **extra)
        return jax.tree.map(lambda u, like: u.reshape(like.shape), new, updates), state

    return optax.GradientTransformationExtraArgs(init, update)


def _per_layer(tx: optax.GradientTransformationExtraArgs) -> optax.GradientTransformationExtraArgs:
    """`tx` on each slice of the leading axis of every leaf, the leaves grouped by that
    axis's size (an encoder and a decoder stack of different depths are vmapped apart);
    the state is one stacked `tx` state per group."""
    masked = optax.MaskedNode()

    def group(tree, size):
        return jax.tree.map(lambda x: x if x.shape[0] == size else masked, tree)

    def sizes(tree):
        return sorted({x.shape[0] for x in jax.tree.leaves(tree)})

    def init(params):
        return {n: jax.vmap(tx.init)(group(params, n)) for n in sizes(params)}

    def update(updates, state, params=None, **extra):
        out, new_state = updates, {}
        for n in sizes(updates):
            u = group(updates, n)
            if params is None:
                new, new_state[n] = jax.vmap(lambda a, b: tx.update(a, b, None, **extra))(u, state[n])
            else:
                new, new_state[n] = jax.vmap(lambda a, b, c: tx.update(a, b, c, **extra))(
                    u, state[n], group(params, n))
            out = jax.tree.map(lambda old, x: old if isinstance(x, optax.MaskedNode) else x, out, new,
                               is_leaf=lambda x: isinstance(x, optax.MaskedNode))
        return out, new_state

    return optax.GradientTransformationExtraArgs(init, update)


def as_matrices(tx: optax.GradientTransformation, *, stacked: re.Pattern | None = STACKED_LAYERS
                ) -> optax.GradientTransformationExtraArgs:
    """`tx` applied to the matrix view of each parameter, each layer of a scanned stack
    (paths matching `stacked`; None: no stacks) on its own (see the module docstring)."""
    inner = _on_matrices(optax.with_extra_args_support(tx))
    if stacked is None:
        return inner

    def mask(params, want):
        return jax.tree_util.tree_map_with_path(
            lambda path, _: bool(stacked.search(treepath.name(path))) == want, params)

    return optax.chain(
        optax.masked(inner, lambda params: mask(params, False)),
        optax.masked(_per_layer(inner), lambda params: mask(params, True)),
    )
