"""Per-task bottleneck adapters (Houlsby et al., 2019), and the adapter arithmetic shared
with HyperFormer (Karimi Mahabadi et al., 2021).

An adapter maps a sub-block's output `y` (`[B, L, d]`) to

    adapter(y) = y + N(U act(D y + b_D) + b_U)

with `D: d -> b`, `U: b -> d` (bottleneck `b`), `act` one of `ADAPTER_ACTIVATIONS`
(default `gelu_new`, the tanh approximation of GELU used by the HyperFormer code; `relu`
is available) and `N` either the identity (Houlsby adapters) or a layer norm with
per-task `gamma`, `beta` (`(h - mean) / sqrt(var + eps) * gamma + beta`, `eps = 1e-5`),
which HyperFormer generates. The T5 layer then adds `dropout(adapter(y))` to its residual
stream (`ktx.models.t5`, hook `adapt`). Adapters sit after the self-attention and after
the feed-forward sub-block of every layer (the positions of Houlsby et al. and of the
HyperFormer code); `ConditioningConfig.adapter_positions` can add the decoder's
cross-attention. Houlsby adapters start near the identity: `U` has a small standard
deviation (1e-2), biases are zero.

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

__all__ = [
    "ADAPTER_ACTIVATIONS",
    "ADAPTER_LAYER_NORM_EPSILON",
    "AdapterWeights",
    "TaskAdapters",
    "apply_adapter",
    "check_activation",
    "layer_norm",
]

ADAPTER_ACTIVATIONS = {
    "gelu_new": lambda x: nn.gelu(x, approximate=True),  # tanh approximation
    "relu": nn.relu,
}
ADAPTER_LAYER_NORM_EPSILON = 1e-5  # torch.nn.LayerNorm's default, used by the reference


def check_activation(owner: str, activation: str) -> None:
    """Raises ValueError naming `owner` unless `activation` is in `ADAPTER_ACTIVATIONS`."""
    if activation not in ADAPTER_ACTIVATIONS:
        raise ValueError(
            f"{owner}={activation!r}; accepted: {sorted(ADAPTER_ACTIVATIONS)}"
        )


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, epsilon: float) -> jax.Array:
    """`(x - mean) / sqrt(var + epsilon) * scale + bias` over the last axis, in float32.

    `scale`, `bias` broadcast against `x` (e.g. `[B, 1, d]` for `x` `[B, L, d]`).
    """
    x32 = jnp.asarray(x, jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + epsilon)
    return y * jnp.asarray(scale, jnp.float32) + jnp.asarray(bias, jnp.float32)


class AdapterWeights(NamedTuple):
    """Adapter parameters with leading axes `lead` (e.g. `[M, A, T]` or `[B]`).

    down `[*lead, d, b]`, down_bias `[*lead, b]`, up `[*lead, b, d]`, up_bias `[*lead, d]`;
    norm_scale, norm_bias `[*lead, d]` (the adapter's layer norm, HyperFormer) or None.
    """

    down: jax.Array
    down_bias: jax.Array
    up: jax.Array
    up_bias: jax.Array
    norm_scale: jax.Array | None = None
    norm_bias: jax.Array | None = None

    def _map(self, fn) -> "AdapterWeights":
        return AdapterWeights(*(None if w is None else fn(w) for w in self))

    def gather(self, task_id: jax.Array, axis: int = 2) -> "AdapterWeights":
        """Replaces the task axis (`axis`) by the batch: one gather per array."""
        return self._map(lambda w: gather_by_task(w, task_id, axis=axis))

    def at(self, *index: int) -> "AdapterWeights":
        """The slice `w[index]` of every array (e.g. `.at(layer, position)`)."""
        return self._map(lambda w: w[index])


def apply_adapter(
    x: jax.Array,
    w: AdapterWeights,
    activation: str = "gelu_new",
    layer_norm_epsilon: float = ADAPTER_LAYER_NORM_EPSILON,
) -> jax.Array:
    """`x + N(U act(D x + b_D) + b_U)` per example: x `[B, L, d]`, w with lead `[B]`.

    `N` is the layer norm `(norm_scale, norm_bias)` of `w`, or the identity when `w` has
    none. The layer norm is computed in float32; the result has `x`'s dtype.
    """
    check_activation("apply_adapter: activation", activation)
    if x.ndim != 3 or w.down.ndim != 3 or w.down.shape[0] != x.shape[0]:
        raise ValueError(
            f"apply_adapter: x {x.shape} must be [batch, length, embed] and the adapter's "
            f"down {w.down.shape} [batch, embed, bottleneck] with the same batch"
        )
    if (w.norm_scale is None) != (w.norm_bias is None):
        raise ValueError("apply_adapter: give both norm_scale and norm_bias or neither")
    dtype = x.dtype
    h = jnp.einsum("bld,bdk->blk", x, w.down.astype(dtype)) + w.down_bias[:, None].astype(dtype)
    h = ADAPTER_ACTIVATIONS[activation](h)
    h = jnp.einsum("blk,bkd->bld", h, w.up.astype(dtype)) + w.up_bias[:, None].astype(dtype)
    if w.norm_scale is not None:
        h = layer_norm(h, w.norm_scale[:, None], w.norm_bias[:, None], layer_norm_epsilon)
    return x + h.astype(dtype)


class TaskAdapters(nn.Module):
    """One Houlsby adapter per (layer, position, task) of one Transformer side.

    `__call__()` returns `AdapterWeights` with lead `[M, A, T]` (A = `num_positions`)
    and no layer norm.
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
