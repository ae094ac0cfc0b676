"""The layers of T5.1.1 (`ktx.models.t5` assembles them): dense and embedding layers with
T5X's initialisers and logical axes, the RMS layer norm, the gated MLP, bucketed relative
position biases and multi-head attention with prefixes, packing masks and a decode cache.
Shapes and dropout conventions are those of `ktx.models.t5`'s docstring.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ktx.partitioning import BATCH, EMBED, HEADS, KV, LENGTH, MLP, RELPOS_BUCKETS, VOCAB

__all__ = [
    "DenseGeneral",
    "Embed",
    "RMSNorm",
    "MlpBlock",
    "MultiHeadAttention",
    "RelativePositionBiases",
    "relative_position_bucket",
]

_ACTIVATIONS = {
    "gelu": nn.gelu,  # tanh approximation, as T5X and mesh-tensorflow
    "relu": nn.relu,
    "silu": nn.silu,
    "linear": lambda x: x,
}
_NEG_INF = -1e10
# Leaf layers take explicit fields, no config object.
default_kernel_init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")

Array = jax.Array
Dtype = Any


def _flat_init(init: Callable, n_in: int, n_out: int) -> Callable:
    """Initialises a multi-axis kernel as the `[n_in, n_out]` matrix it contracts as."""

    def f(key, shape, dtype=jnp.float32):
        return init(key, (n_in, n_out), dtype).reshape(shape)

    return f


class DenseGeneral(nn.Module):
    """Bias-free dense layer contracting `axis` of the input with a multi-axis kernel.

    Input `[..., *in_shape]` (the `axis` dims, which must be trailing) -> `[..., *features]`;
    kernel `[*in_shape, *features]` annotated with `kernel_axes`.
    """

    features: tuple[int, ...]
    kernel_axes: tuple[str, ...]
    axis: tuple[int, ...] = (-1,)
    dtype: Dtype = jnp.float32
    kernel_init: Callable = default_kernel_init

    @nn.compact
    def __call__(self, x: Array) -> Array:
        axis = tuple(sorted(a % x.ndim for a in self.axis))
        if axis != tuple(range(x.ndim - len(axis), x.ndim)):
            raise ValueError(f"DenseGeneral.axis={self.axis}: must be the trailing axes")
        in_shape = tuple(x.shape[a] for a in axis)
        kernel_shape = in_shape + tuple(self.features)
        if len(self.kernel_axes) != len(kernel_shape):
            raise ValueError(
                f"DenseGeneral.kernel_axes={self.kernel_axes} has {len(self.kernel_axes)} "
                f"names for a kernel of shape {kernel_shape}"
            )
        init = _flat_init(self.kernel_init, math.prod(in_shape), math.prod(self.features))
        kernel = self.param(
            "kernel",
            nn.with_logical_partitioning(init, self.kernel_axes),
            kernel_shape,
            jnp.float32,
        )
        x = jnp.asarray(x, self.dtype)
        kernel = jnp.asarray(kernel, self.dtype)
        contract = (axis, tuple(range(len(axis))))
        return lax.dot_general(x, kernel, (contract, ((), ())))


class Embed(nn.Module):
    """Token embedding table `[V, E]` (axes `vocab`, `embed`); init N(0, 1) as T5X."""

    num_embeddings: int
    features: int
    dtype: Dtype = jnp.float32
    embedding_init: Callable = nn.initializers.normal(stddev=1.0)

    def setup(self):
        self.embedding = self.param(
            "embedding",
            nn.with_logical_partitioning(self.embedding_init, (VOCAB, EMBED)),
            (self.num_embeddings, self.features),
            jnp.float32,
        )

    def __call__(self, ids: Array) -> Array:
        """`ids` int `[B, L]` -> `[B, L, E]` in `dtype`."""
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise TypeError(f"Embed: token ids must be integers, got dtype {ids.dtype}")
        out = jnp.take(jnp.asarray(self.embedding, self.dtype), ids, axis=0)
        return nn.with_logical_constraint(out, (BATCH, LENGTH, EMBED))

    def attend(self, query: Array, dtype: Dtype | None = None) -> Array:
        """`[..., E]` -> `[..., V]`: dot products with every embedding (tied logits),
        computed in `dtype` (default: the module's)."""
        dtype = self.dtype if dtype is None else dtype
        return jnp.dot(jnp.asarray(query, dtype), jnp.asarray(self.embedding, dtype).T)


class RMSNorm(nn.Module):
    """T5 layer norm: `x / sqrt(mean(x^2) + eps) * scale`, no mean, no bias.

    Computed in float32, then cast to `dtype` before scaling (as T5X).
    """

    epsilon: float = 1e-6
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: Array, scale: Array | None = None) -> Array:
        """`x` `[B, L, E]`; `scale` `None` (learned `[E]` parameter `scale`, axis `embed`)
        or a per-example `[B, E]` (or `[E]`) scale that replaces the learned one."""
        features = x.shape[-1]
        x32 = jnp.asarray(x, jnp.float32)
        var = jnp.mean(lax.square(x32), axis=-1, keepdims=True)
        y = jnp.asarray(x32 * lax.rsqrt(var + self.epsilon), self.dtype)
        if scale is None:
            scale = self.param(
                "scale", nn.with_logical_partitioning(nn.initializers.ones, (EMBED,)),
                (features,), jnp.float32,
            )
        else:
            if scale.shape[-1] != features or scale.ndim not in (1, 2) or (
                scale.ndim == 2 and scale.shape[0] != x.shape[0]
            ):
                raise ValueError(
                    f"RMSNorm: scale shape {scale.shape} does not fit inputs {x.shape}; "
                    f"accepted: [{features}] or [{x.shape[0]}, {features}]"
                )
            if scale.ndim == 2:
                scale = scale.reshape((scale.shape[0],) + (1,) * (x.ndim - 2) + (features,))
        return y * jnp.asarray(scale, self.dtype)


class MlpBlock(nn.Module):
    """Gated feed-forward: `wo(dropout(prod_i act_i(wi_i x)))`, no biases.

    With activations ("gelu", "linear") this is T5.1.1's gated-GELU. `[B, L, E] -> [B, L, E]`.
    """

    intermediate_dim: int
    activations: tuple[str, ...] = ("gelu", "linear")
    dropout_rate: float = 0.0
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: Array, deterministic: bool = True) -> Array:
        hidden = None
        for idx, act in enumerate(self.activations):
            name = "wi" if len(self.activations) == 1 else f"wi_{idx}"
            h = DenseGeneral((self.intermediate_dim,), (EMBED, MLP), dtype=self.dtype, name=name)(x)
            h = _ACTIVATIONS[act](h)
            hidden = h if hidden is None else hidden * h
        hidden = nn.Dropout(self.dropout_rate, broadcast_dims=(-2,))(hidden, deterministic)
        hidden = nn.with_logical_constraint(hidden, (BATCH, LENGTH, MLP))
        out = DenseGeneral((x.shape[-1],), (MLP, EMBED), dtype=self.dtype, name="wo")(hidden)
        return nn.with_logical_constraint(out, (BATCH, LENGTH, EMBED))


def relative_position_bucket(
    relative_position: Array,
    bidirectional: bool = True,
    num_buckets: int = 32,
    max_distance: int = 128,
) -> Array:
    """T5's bucket of each `relative_position = key_pos - query_pos` (int array).

    Half the buckets (per direction when `bidirectional`) hold exact distances
    `0 .. nb/2 - 1`; the rest are logarithmic up to `max_distance`, beyond which every
    distance shares the last bucket. Causal (`bidirectional=False`): keys after the
    query all fall in bucket 0. Same formula as mesh-tensorflow / T5X.

    `max_distance` must exceed the number of exact buckets (`num_buckets // 4`
    bidirectional, `num_buckets // 2` causal); otherwise the logarithmic range is empty
    or negative and the buckets (hence the biases) would be garbage or NaN.
    """
    if isinstance(num_buckets, bool) or not isinstance(num_buckets, int) or num_buckets < 4:
        raise ValueError(f"relative_position_bucket: num_buckets={num_buckets!r}; accepted: int >= 4")
    exact = num_buckets // 4 if bidirectional else num_buckets // 2
    if max_distance <= exact:
        raise ValueError(
            f"relative_position_bucket: max_distance={max_distance} must be > the number of "
            f"exact buckets {exact} (num_buckets={num_buckets}, bidirectional={bidirectional})"
        )
    n = -jnp.asarray(relative_position, jnp.int32)
    ret = jnp.zeros_like(n)
    if bidirectional:
        num_buckets //= 2
        ret = ret + (n < 0).astype(jnp.int32) * num_buckets
        n = jnp.abs(n)
    else:
        n = jnp.maximum(n, 0)
    max_exact = num_buckets // 2
    is_small = n < max_exact
    val_if_large = max_exact + (
        jnp.log(n.astype(jnp.float32) / max_exact + np.finfo(np.float32).eps)
        / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    ).astype(jnp.int32)
    val_if_large = jnp.minimum(val_if_large, num_buckets - 1)
    return ret + jnp.where(is_small, n, val_if_large)


class RelativePositionBiases(nn.Module):
    """Learned per-head bias of each relative position bucket; table `[H, buckets]`."""

    num_buckets: int
    max_distance: int
    num_heads: int
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, query_positions: Array, key_positions: Array, bidirectional: bool) -> Array:
        """`query_positions` `[Lq]`, `key_positions` `[Lk]` (int) -> bias `[1, H, Lq, Lk]`."""
        table = self.param(
            "rel_embedding",
            nn.with_logical_partitioning(
                nn.initializers.variance_scaling(1.0, "fan_avg", "uniform"),
                (HEADS, RELPOS_BUCKETS),
            ),
            (self.num_heads, self.num_buckets),
            jnp.float32,
        )
        relative = key_positions[None, :] - query_positions[:, None]
        buckets = relative_position_bucket(
            relative, bidirectional, self.num_buckets, self.max_distance
        )
        values = jnp.take(jnp.asarray(table, self.dtype), buckets, axis=1)  # [H, Lq, Lk]
        return values[None]


class MultiHeadAttention(nn.Module):
    """Bias-free multi-head dot-product attention without logit scaling (T5): the
    `1/sqrt(D)` factor is folded into the query initialisation, as T5X does.

    Kernels: query/key/value `[E, H, D]` (`embed`, `heads`, `kv`), out `[H, D, E]`.
    """

    num_heads: int
    head_dim: int
    dtype: Dtype = jnp.float32
    dropout_rate: float = 0.0
    float32_logits: bool = True

    @nn.compact
    def __call__(
        self,
        inputs_q: Array,
        inputs_kv: Array,
        mask: Array | None = None,
        bias: Array | None = None,
        *,
        prefix_key: Array | None = None,
        prefix_value: Array | None = None,
        decode: bool = False,
        deterministic: bool = True,
    ) -> Array:
        """`inputs_q` `[B, Lq, E]`, `inputs_kv` `[B, Lk, E]` -> `[B, Lq, E]`.

        `mask` (1 = attend) and `bias` broadcast to `[B, H, Lq, Lk]` (with `decode`,
        `Lk` is the cache length). `prefix_key`/`prefix_value` `[B, P, H, D]` are
        prepended to keys/values, visible to every query, with zero bias. With `decode`
        the keys/values of one new position are written to the cache (collection
        `cache`, variables `cached_key`, `cached_value` `[B, Ld, H, D]`, `cache_index`).
        """
        depth_scaling = math.sqrt(self.head_dim)

        def query_init(*args):
            return default_kernel_init(*args) / depth_scaling

        projection = functools.partial(
            DenseGeneral, features=(self.num_heads, self.head_dim),
            kernel_axes=(EMBED, HEADS, KV), dtype=self.dtype,
        )
        query = projection(kernel_init=query_init, name="query")(inputs_q)
        key = projection(name="key")(inputs_kv)
        value = projection(name="value")(inputs_kv)
        query = nn.with_logical_constraint(query, (BATCH, LENGTH, HEADS, KV))
        key = nn.with_logical_constraint(key, (BATCH, LENGTH, HEADS, KV))
        value = nn.with_logical_constraint(value, (BATCH, LENGTH, HEADS, KV))

        if decode:
            initialized = self.has_variable("cache", "cached_key")
            cached_key = self.variable("cache", "cached_key", jnp.zeros, key.shape, key.dtype)
            cached_value = self.variable("cache", "cached_value", jnp.zeros, value.shape, value.dtype)
            cache_index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
            if initialized:
                if query.shape[1] != 1:
                    raise ValueError(
                        f"MultiHeadAttention: a decode step takes one position, got inputs "
                        f"of length {query.shape[1]}"
                    )
                idx = cache_index.value
                key = lax.dynamic_update_slice(cached_key.value, key, (0, idx, 0, 0))
                value = lax.dynamic_update_slice(cached_value.value, value, (0, idx, 0, 0))
                cached_key.value = key
                cached_value.value = value
                cache_index.value = idx + 1

        if (prefix_key is None) != (prefix_value is None):
            raise ValueError("MultiHeadAttention: give both prefix_key and prefix_value or neither")
        if prefix_key is not None:
            want = (key.shape[0], prefix_key.shape[1], self.num_heads, self.head_dim)
            if prefix_key.shape != want or prefix_value.shape != want:
                raise ValueError(
                    f"MultiHeadAttention: prefix_key {prefix_key.shape} / prefix_value "
                    f"{prefix_value.shape}; accepted: [B, P, H, D] = {want}"
                )
            num_prefix = prefix_key.shape[1]
            key = jnp.concatenate([jnp.asarray(prefix_key, key.dtype), key], axis=1)
            value = jnp.concatenate([jnp.asarray(prefix_value, value.dtype), value], axis=1)
            if mask is not None:
                ones = jnp.ones(mask.shape[:-1] + (num_prefix,), mask.dtype)
                mask = jnp.concatenate([ones, mask], axis=-1)
            if bias is not None:
                zeros = jnp.zeros(bias.shape[:-1] + (num_prefix,), bias.dtype)
                bias = jnp.concatenate([zeros, bias], axis=-1)

        if self.float32_logits:
            query = jnp.asarray(query, jnp.float32)
            key = jnp.asarray(key, jnp.float32)
        logits = jnp.einsum("bqhd,bkhd->bhqk", query, key)
        if mask is not None:
            logits = logits + jnp.where(mask > 0, 0.0, _NEG_INF).astype(logits.dtype)
        if bias is not None:
            logits = logits + jnp.asarray(bias, logits.dtype)
        probs = jax.nn.softmax(logits, axis=-1).astype(self.dtype)
        self.sow("intermediates", "attention_weights", probs)
        # One mask per (example, head, key), broadcast over the queries, as T5X.
        probs = nn.Dropout(self.dropout_rate, broadcast_dims=(-2,))(probs, deterministic)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, jnp.asarray(value, self.dtype))
        out = DenseGeneral(
            features=(inputs_q.shape[-1],), axis=(-2, -1), kernel_axes=(HEADS, KV, EMBED),
            dtype=self.dtype, name="out",
        )(out)
        return nn.with_logical_constraint(out, (BATCH, LENGTH, EMBED))


# ------------------------------------------------------------------------------------
# Masks.
# ------------------------------------------------------------------------------------


def _attention_mask(
    query_valid: Array,
    key_valid: Array,
    query_segments: Array | None = None,
    key_segments: Array | None = None,
    key_always_visible: Array | None = None,
    causal: bool = False,
) -> Array:
    """`[B, 1, Lq, Lk]` float mask (1 = attend) from `[B, L]` validity/segment arrays.

    `key_always_visible` `[B, Lk]` marks keys any valid query may see (prompts).
    """
    mask = query_valid[:, :, None] & key_valid[:, None, :]
    if query_segments is not None:
        same = query_segments[:, :, None] == key_segments[:, None, :]
        if key_always_visible is not None:
            same = same | key_always_visible[:, None, :]
        mask = mask & same
    if causal:
        lq, lk = query_valid.shape[1], key_valid.shape[1]
        mask = mask & (jnp.arange(lk)[None, :] <= jnp.arange(lq)[:, None])[None]
    return mask[:, None].astype(jnp.float32)
