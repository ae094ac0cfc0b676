"""The layers of T5.1.1 (`ktx.models.t5` assembles them): dense and embedding layers with
T5X's initialisers and logical axes, the RMS layer norm, the gated MLP, bucketed relative
position biases, multi-head attention with prefixes, packing masks and a decode cache, and
the encoder and decoder layers (with their task-conditioning hooks).
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

from ktx import linear, param_gather, task_taps
from ktx.models.t5_stack import recompute_elementwise
from ktx.partitioning import BATCH, EMBED, HEADS, KV, LENGTH, MLP, RELPOS_BUCKETS, VOCAB

__all__ = [
    "EncoderLayer",
    "DecoderLayer",
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
    kernel `[*in_shape, *features]` annotated with `kernel_axes`. `split_input` (one axis):
    the kernel is read through `param_gather.project` (T5's untied logits).
    """

    features: tuple[int, ...]
    kernel_axes: tuple[str, ...]
    axis: tuple[int, ...] = (-1,)
    dtype: Dtype = jnp.float32
    kernel_init: Callable = default_kernel_init
    split_input: bool = False

    @nn.compact
    def __call__(self, x: Array) -> Array:
        axis = tuple(sorted(a % x.ndim for a in self.axis))
        if axis != tuple(range(x.ndim - len(axis), x.ndim)):
            raise ValueError(f"DenseGeneral.axis={self.axis}: must be the trailing axes")
        in_shape = tuple(x.shape[a] for a in axis)
        kernel_shape = in_shape + tuple(self.features)
        if len(self.kernel_axes) != len(kernel_shape):
            raise ValueError(f"DenseGeneral.kernel_axes={self.kernel_axes} has "
                             f"{len(self.kernel_axes)} names for a kernel of shape {kernel_shape}")
        init = _flat_init(self.kernel_init, math.prod(in_shape), math.prod(self.features))
        declare = functools.partial(self.param, "kernel", nn.with_logical_partitioning(
            init, self.kernel_axes), kernel_shape, jnp.float32)
        x = jnp.asarray(x, self.dtype)
        tap = task_taps.read(self, "kernel")
        if tap is not None:  # per-task kernel gradients in one backward pass
            return task_taps.contract(x, jnp.asarray(declare(), self.dtype), len(axis), tap)
        if self.split_input and len(axis) == 1:  # a `SplitParam` in a balanced region
            kernel = param_gather.module_param(self, "kernel", declare)
            return param_gather.project(x, kernel, self.scope.path + ("kernel",))
        return linear.contract(x, jnp.asarray(declare(), self.dtype), len(axis))


class Embed(nn.Module):
    """Token embedding table `[V, E]` (axes `vocab`, `embed`); init N(0, 1) as T5X."""

    num_embeddings: int
    features: int
    dtype: Dtype = jnp.float32
    embedding_init: Callable = nn.initializers.normal(stddev=1.0)

    def setup(self):
        # Inside a balanced step's device-by-device region: a `param_gather.SplitParam`,
        # read through `param_gather.take`.
        self.embedding = param_gather.module_param(self, "embedding", lambda: self.param(
            "embedding",
            nn.with_logical_partitioning(self.embedding_init, (VOCAB, EMBED)),
            (self.num_embeddings, self.features),
            jnp.float32,
        ))

    def __call__(self, ids: Array) -> Array:
        """`ids` int `[B, L]` -> `[B, L, E]` in `dtype`."""
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise TypeError(f"Embed: token ids must be integers, got dtype {ids.dtype}")
        out = param_gather.take(self.embedding, ids, self.scope.path + ("embedding",),
                                self.dtype)
        return nn.with_logical_constraint(out, (BATCH, LENGTH, EMBED))

    def attend(self, query: Array, dtype: Dtype | None = None) -> Array:
        """`[..., E]` -> `[..., V]`: dot products with every embedding (tied logits),
        computed in `dtype` (default: the module's)."""
        dtype = self.dtype if dtype is None else dtype
        table = param_gather.gather(self.embedding)
        return jnp.dot(jnp.asarray(query, dtype), jnp.asarray(table, dtype).T)


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
        if scale is None:
            scale = self.param(
                "scale", nn.with_logical_partitioning(nn.initializers.ones, (EMBED,)),
                (features,), jnp.float32,
            )
            # Under a tap each example's task's scale (per-task gradients).
            scale = task_taps.param_rows(self, "scale", scale, x)
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

        def normalise(x, scale):
            x32 = jnp.asarray(x, jnp.float32)
            var = jnp.mean(lax.square(x32), axis=-1, keepdims=True)
            y = jnp.asarray(x32 * lax.rsqrt(var + self.epsilon), self.dtype)
            return y * jnp.asarray(scale, self.dtype)

        return recompute_elementwise(normalise)(x, scale)


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
        names = ["wi"] if len(self.activations) == 1 else \
            [f"wi_{idx}" for idx in range(len(self.activations))]
        projected = [DenseGeneral((self.intermediate_dim,), (EMBED, MLP), dtype=self.dtype,
                                  name=name)(x) for name in names]

        def gated(*projected):
            hidden = None
            for act, h in zip(self.activations, projected):
                h = _ACTIVATIONS[act](h)
                hidden = h if hidden is None else hidden * h
            return hidden

        hidden = recompute_elementwise(gated)(*projected)
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
        """`query_positions` `[Lq]`, `key_positions` `[Lk]` (int) -> bias `[1, H, Lq, Lk]`
        (with a tap, `ktx.task_taps`: each task's, `task_taps.PerTask` of `[T, H, Lq, Lk]`,
        which `MultiHeadAttention` adds by task)."""
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
        tap = task_taps.read(self, "rel_embedding")
        if tap is not None:  # each task's biases, [T, H, Lq, Lk], added by task
            dtype = jnp.dtype(self.dtype)
            tables = task_taps.per_task(table, tap)
            return task_taps.PerTask(
                jax.vmap(lambda t: bucket_biases(t, buckets, dtype))(tables), task_taps.sizes())
        return bucket_biases(table, buckets, jnp.dtype(self.dtype))[None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def bucket_biases(table: Array, buckets: Array, dtype: Any) -> Array:
    """`table[:, buckets]` (`[H, B]` float32, int `[Lq, Lk]`) cast to `dtype`: `[H, Lq, Lk]`.

    The gradient is the cotangent summed by bucket as a contraction with the buckets'
    one-hot (`[H, Lq*Lk] x [Lq*Lk, B]`, accumulated in float32, as T5X computes the
    biases themselves), not the lookup's scatter-add: that scatter takes its update rows
    heads-minor, which a TPU pads from H to 128 lanes (T5.1.1-Base at 512 tokens with 6
    heads per device: a 128 MiB float32 buffer for a 6 MiB cotangent)."""
    return jnp.take(table, buckets, axis=1).astype(dtype)


def _bucket_biases_fwd(table, buckets, dtype):
    return bucket_biases(table, buckets, dtype), (buckets, table.shape[1])


def _bucket_biases_bwd(dtype, residuals, cot):
    buckets, num_buckets = residuals
    one_hot = (buckets[None] == jnp.arange(num_buckets)[:, None, None]).astype(cot.dtype)
    grad = jnp.einsum("hqk,bqk->hb", cot, one_hot, preferred_element_type=jnp.float32,
                      precision=jax.lax.Precision.HIGHEST)
    return grad, np.zeros(buckets.shape, jax.dtypes.float0)


bucket_biases.defvjp(_bucket_biases_fwd, _bucket_biases_bwd)


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
    # The backward pass recomputes the attention probabilities (softmax and dropout) from
    # the raw scores, so a layer keeps one `[B, H, Lq, Lk]` array for it instead of two
    # (the probabilities and the dropped ones); the value product is not recomputed. Off
    # under the 'dots' remat policy, which saves that product's output and would then
    # recompute it (a policy cannot see inside this nested checkpoint).
    recompute_probabilities: bool = True

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
                if isinstance(bias, task_taps.PerTask):
                    bias = bias.dense()
                zeros = jnp.zeros(bias.shape[:-1] + (num_prefix,), bias.dtype)
                bias = jnp.concatenate([zeros, bias], axis=-1)

        if self.float32_logits:
            query = jnp.asarray(query, jnp.float32)
            key = jnp.asarray(key, jnp.float32)
        logits = jnp.einsum("bqhd,bkhd->bhqk", query, key)
        if mask is not None:
            mask = jnp.where(mask > 0, 0.0, _NEG_INF).astype(logits.dtype)
        if bias is not None:
            bias = (bias.astype(logits.dtype) if isinstance(bias, task_taps.PerTask)
                    else jnp.asarray(bias, logits.dtype))

        def scores(logits, mask, bias):
            if mask is not None:
                logits = logits + mask
            if bias is not None:
                logits = task_taps.add(logits, bias)  # a `PerTask` bias by task
            return jax.nn.softmax(logits, axis=-1).astype(self.dtype)

        value = jnp.asarray(value, self.dtype)
        # One dropout mask per (example, head, key), shared by the queries, as T5X.
        dropout = nn.Dropout(self.dropout_rate, broadcast_dims=(-2,))
        if not self.recompute_probabilities:
            probs = scores(logits, mask, bias)
            self.sow("intermediates", "attention_weights", probs)
            out = jnp.einsum("bhqk,bkhd->bqhd", dropout(probs, deterministic), value)
        else:
            if self.is_mutable_collection("intermediates"):
                self.sow("intermediates", "attention_weights", scores(logits, mask, bias))
            keep = None
            if not deterministic and self.dropout_rate > 0.0:
                # The mask's bits drawn on a `[B, H, 1, Lk]` stand-in are those the
                # `[B, H, Lq, Lk]` probabilities would get (row-keyed alike under
                # `base.dropout_keyed_by_row`).
                keep = dropout(jnp.ones(logits.shape[:2] + (1,) + logits.shape[3:]), False) > 0
            rate = self.dropout_rate

            def attend(logits, mask, bias, keep, value):
                probs = scores(logits, mask, bias)
                if keep is not None:
                    probs = lax.select(jnp.broadcast_to(keep, probs.shape),
                                       probs / (1.0 - rate), jnp.zeros_like(probs))
                return jnp.einsum("bhqk,bkhd->bqhd", probs, value)

            out = recompute_elementwise(attend)(logits, mask, bias, keep, value)
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


# ------------------------------------------------------------------------------------
# Encoder and decoder layers (`config` is a `ktx.models.t5.T5Config`; see its module
# docstring for the hooks). `deterministic` and `decode` may be given by position, as the
# rematerialised (`nn.remat` static arguments) and scanned stacks do. `layer_inputs` is
# None in an unrolled stack; in a scanned one (`T5Config.scan_layers`) it is this layer's
# slice of the stack's per-layer inputs (`Encoder.layer_inputs`), handed to the hooks.
# ------------------------------------------------------------------------------------


def _scanned(layer_inputs: Any) -> dict[str, Any]:
    """Hook keywords: `layer_inputs` only in a scanned stack (unrolled hooks may omit it)."""
    return {} if layer_inputs is None else {"layer_inputs": layer_inputs}


class _LayerHooks:
    """Default (plain T5) hooks shared by encoder and decoder layers."""

    config: Any

    def layer_norm(self, x: Array, task_id: Array, *, name: str) -> Array:
        """Pre-sub-block norm `[B, L, E] -> [B, L, E]` (override: conditional norm)."""
        return RMSNorm(dtype=self.config.activation_dtype, name=name)(x)

    def attention_prefix(
        self, x: Array, task_id: Array, *, name: str, layer_inputs: Any = None
    ) -> tuple[Array, Array] | None:
        """Prefix keys/values `[B, P, H, D]` for self-attention `name`, or None."""
        return None

    def adapt(
        self, y: Array, task_id: Array, *, name: str, deterministic: bool, layer_inputs: Any = None
    ) -> Array:
        """Transforms the output `[B, L, E]` of sub-block `name` (override: adapters)."""
        return y

    def _attention(self, name: str) -> MultiHeadAttention:
        cfg = self.config
        return MultiHeadAttention(
            num_heads=cfg.num_heads, head_dim=cfg.head_dim, dtype=cfg.activation_dtype,
            dropout_rate=cfg.dropout_rate, float32_logits=cfg.float32_attention_logits,
            recompute_probabilities=cfg.remat_policy != "dots", name=name,
        )

    def _mlp(self, x: Array, task_id: Array, deterministic: bool, layer_inputs: Any) -> Array:
        cfg = self.config
        h = self.layer_norm(x, task_id, name="pre_mlp_layer_norm")
        h = MlpBlock(
            intermediate_dim=cfg.mlp_dim, activations=cfg.mlp_activations,
            dropout_rate=cfg.dropout_rate, dtype=cfg.activation_dtype, name="mlp",
        )(h, deterministic)
        h = self.adapt(h, task_id, name="mlp", deterministic=deterministic,
                       **_scanned(layer_inputs))
        h = nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))(h, deterministic)
        return nn.with_logical_constraint(x + h, (BATCH, LENGTH, EMBED))

    def _out(self, x: Array) -> Any:
        """A scanned layer returns `(carry, None)` (`nn.scan`'s body contract)."""
        return (x, None) if self.scanned else x


class EncoderLayer(_LayerHooks, nn.Module):
    """Pre-norm self-attention + gated MLP block. `[B, Le, E] -> [B, Le, E]`."""

    config: Any
    layer_index: int = 0
    scanned: bool = False

    @nn.compact
    def __call__(
        self, x: Array, mask: Array, bias: Array, task_id: Array, deterministic: bool,
        layer_inputs: Any = None,
    ) -> Any:
        cfg = self.config
        h = self.layer_norm(x, task_id, name="pre_attention_layer_norm")
        prefix = self.attention_prefix(h, task_id, name="attention", **_scanned(layer_inputs))
        pk, pv = prefix if prefix is not None else (None, None)
        h = self._attention("attention")(
            h, h, mask, bias, prefix_key=pk, prefix_value=pv, deterministic=deterministic
        )
        h = self.adapt(h, task_id, name="attention", deterministic=deterministic,
                       **_scanned(layer_inputs))
        h = nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))(h, deterministic)
        x = nn.with_logical_constraint(x + h, (BATCH, LENGTH, EMBED))
        return self._out(self._mlp(x, task_id, deterministic, layer_inputs))


class DecoderLayer(_LayerHooks, nn.Module):
    """Pre-norm causal self-attention, cross-attention, gated MLP. `[B, Ld, E]` out."""

    config: Any
    layer_index: int = 0
    scanned: bool = False

    @nn.compact
    def __call__(
        self,
        x: Array,
        encoded: Array,
        self_mask: Array,
        self_bias: Array,
        cross_mask: Array,
        task_id: Array,
        deterministic: bool,
        decode: bool = False,
        layer_inputs: Any = None,
    ) -> Any:
        cfg = self.config
        drop = functools.partial(
            nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,)), deterministic=deterministic
        )
        h = self.layer_norm(x, task_id, name="pre_self_attention_layer_norm")
        prefix = self.attention_prefix(h, task_id, name="self_attention",
                                       **_scanned(layer_inputs))
        pk, pv = prefix if prefix is not None else (None, None)
        h = self._attention("self_attention")(
            h, h, self_mask, self_bias, prefix_key=pk, prefix_value=pv, decode=decode,
            deterministic=deterministic,
        )
        h = self.adapt(h, task_id, name="attention", deterministic=deterministic,
                       **_scanned(layer_inputs))
        x = nn.with_logical_constraint(x + drop(h), (BATCH, LENGTH, EMBED))
        h = self.layer_norm(x, task_id, name="pre_cross_attention_layer_norm")
        h = self._attention("encoder_decoder_attention")(
            h, encoded, cross_mask, None, deterministic=deterministic
        )
        h = self.adapt(h, task_id, name="cross_attention", deterministic=deterministic,
                       **_scanned(layer_inputs))
        x = nn.with_logical_constraint(x + drop(h), (BATCH, LENGTH, EMBED))
        return self._out(self._mlp(x, task_id, deterministic, layer_inputs))
