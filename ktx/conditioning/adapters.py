"""Per-task bottleneck adapters (Houlsby et al., 2019), and the adapter arithmetic shared
with HyperFormer.

An adapter maps a sub-block's output `x` (`[B, L, d]`) to
`x + U relu(D x + b_D) + b_U`, with `D: d -> b`, `U: b -> d` (bottleneck `b`). It sits
after every attention and feed-forward sub-block of every layer, before the residual
addition (Houlsby et al., 2019, "Parameter-Efficient Transfer Learning for NLP"); a
decoder layer has three positions (self-attention, cross-attention, feed-forward), an
encoder layer two. Houlsby et al. initialise near the identity: `U` has a small
standard deviation (1e-2 here), biases are zero.

`TaskAdapters` holds one adapter per (layer, position, task): arrays `[M, A, T, ...]`.
`AdapterWeights.gather(task_id)` picks each example's task once (`[M, A, B, ...]`), and
`apply_adapter` applies one (layer, position) slice to `[B, L, d]`.
"""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from ktx import partitioning as P
from ktx.conditioning.task_embedding import check_positive, gather_by_task

__all__ = ["AdapterWeights", "TaskAdapters", "apply_adapter"]


class AdapterWeights(NamedTuple):
    """Adapter parameters with leading axes `lead` (e.g. `[M, A, T]` or `[B]`).

    down `[*lead, d, b]`, down_bias `[*lead, b]`, up `[*lead, b, d]`, up_bias `[*lead, d]`.
    """

    down: jax.Array
    down_bias: jax.Array
    up: jax.Array
    up_bias: jax.Array

    def gather(self, task_id: jax.Array, axis: int = 2) -> "AdapterWeights":
        """Replaces the task axis (`axis`) by the batch: one gather per array."""
        return AdapterWeights(*(gather_by_task(w, task_id, axis=axis) for w in self))

    def at(self, *index: int) -> "AdapterWeights":
        """The slice `w[index]` of every array (e.g. `.at(layer, position)`)."""
        return AdapterWeights(*(w[index] for w in self))


def apply_adapter(x: jax.Array, w: AdapterWeights) -> jax.Array:
    """`x + U relu(D x + b_D) + b_U` per example: x `[B, L, d]`, w with lead `[B]`."""
    if x.ndim != 3 or w.down.ndim != 3 or w.down.shape[0] != x.shape[0]:
        raise ValueError(
            f"apply_adapter: x {x.shape} must be [batch, length, embed] and the adapter's "
            f"down {w.down.shape} [batch, embed, bottleneck] with the same batch"
        )
    dtype = x.dtype
    h = jnp.einsum("bld,bdk->blk", x, w.down.astype(dtype)) + w.down_bias[:, None].astype(dtype)
    h = nn.relu(h)
    return x + jnp.einsum("blk,bkd->bld", h, w.up.astype(dtype)) + w.up_bias[:, None].astype(dtype)


class TaskAdapters(nn.Module):
    """One Houlsby adapter per (layer, position, task) of one Transformer side.

    `__call__()` returns `AdapterWeights` with lead `[M, A, T]` (A = `num_positions`).
    """

    num_tasks: int
    num_layers: int
    num_positions: int
    emb_dim: int
    bottleneck_dim: int
    up_init_stddev: float = 1e-2
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, layer: int | None = None, position: int | None = None) -> AdapterWeights:
        """All adapters (lead `[M, A, T]`), or with `layer`, `position` that slot's (`[T]`)."""
        check_positive(
            "TaskAdapters",
            num_tasks=self.num_tasks,
            num_layers=self.num_layers,
            num_positions=self.num_positions,
            emb_dim=self.emb_dim,
            bottleneck_dim=self.bottleneck_dim,
        )
        lead = (self.num_layers, self.num_positions, self.num_tasks)
        lead_axes = (P.LAYERS, None, P.TASKS)
        d, b = self.emb_dim, self.bottleneck_dim

        def param(name, init, shape, axes):
            return self.param(
                name, nn.with_logical_partitioning(init, lead_axes + axes), lead + shape,
                self.param_dtype,
            )

        down_init = nn.initializers.variance_scaling(
            1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1
        )
        up_init = nn.initializers.truncated_normal(stddev=self.up_init_stddev)
        weights = AdapterWeights(
            down=param("down", down_init, (d, b), (P.EMBED, P.HYPER_BOTTLENECK)),
            down_bias=param("down_bias", nn.initializers.zeros, (b,), (P.HYPER_BOTTLENECK,)),
            up=param("up", up_init, (b, d), (P.HYPER_BOTTLENECK, P.EMBED)),
            up_bias=param("up_bias", nn.initializers.zeros, (d,), (P.EMBED,)),
        )
        if layer is None and position is None:
            return weights
        if not (isinstance(layer, int) and 0 <= layer < self.num_layers
                and isinstance(position, int) and 0 <= position < self.num_positions):
            raise ValueError(
                f"TaskAdapters: layer={layer!r}, position={position!r}; accepted: both None, "
                f"or ints in [0, {self.num_layers}) and [0, {self.num_positions})"
            )
        return weights.at(layer, position)
