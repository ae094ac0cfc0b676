"""BERT-layout Transformer encoder in flax.linen (Devlin et al., 2019, "BERT: Pre-training
of Deep Bidirectional Transformers for Language Understanding").

Layout: learned absolute position embeddings and token-type embeddings added to the word
embeddings, then LayerNorm and dropout; `num_layers` post-LayerNorm layers (self-attention
with biases -> dropout -> LayerNorm(x + attention); dense -> GELU -> dense -> dropout ->
LayerNorm(x + mlp)); a pooled output `tanh(dense(h[:, 0]))` on the first ([CLS]) token
(or, `pooling="mean"`, the mean of the attended hidden states: `pool_hidden`);
an MLM head (dense -> GELU -> LayerNorm -> logits through the transposed word embeddings
plus a bias of `[V]`).

Attention mask: `attention_mask` `[B, L]` (1 = attend) when given, else `input_ids > 0`
(BERT vocabularies put `[PAD]` at id 0). As in transformers, only *keys* are masked:
padded positions still get (meaningless) hidden states, computed the same way as there.

Shapes: `B` batch, `L` length (<= `max_position`), `E` hidden, `H` heads, `D = E / H`,
`M` intermediate, `V` vocabulary.

Parameters (flat paths; each maps one to one to a transformers `BertModel` /
`BertForMaskedLM` tensor, see `ktx.convert.hf_bert`), with logical axes from
`ktx.partitioning` so the model shards on the (data, model) mesh as T5 does:

    embeddings/word_embeddings/embedding            [V, E]     (vocab, embed)
    embeddings/position_embeddings/embedding        [P, E]     (None, embed)
    embeddings/token_type_embeddings/embedding      [T, E]     (None, embed)
    embeddings/layer_norm/{scale,bias}              [E]        (embed,)
    layers_i/attention/{query,key,value}/kernel     [E, H, D]  (embed, heads, kv)
    layers_i/attention/{query,key,value}/bias       [H, D]     (heads, kv)
    layers_i/attention/out/kernel                   [H, D, E]  (heads, kv, embed)
    layers_i/attention/out/bias                     [E]        (embed,)
    layers_i/attention_layer_norm/{scale,bias}      [E]
    layers_i/intermediate/{kernel [E, M], bias [M]} (embed, mlp) / (mlp,)
    layers_i/output/{kernel [M, E], bias [E]}       (mlp, embed) / (embed,)
    layers_i/output_layer_norm/{scale,bias}         [E]
    pooler/{kernel [E, E], bias [E]}                (embed, mlp) / (mlp,)
    mlm/transform/{kernel [E, E], bias [E]}         (embed, mlp) / (mlp,)
    mlm/layer_norm/{scale,bias}                     [E]
    mlm/bias                                        [V]        (vocab,)
    shared_layers/layers_j/...                      as layers_i (optional extra top layers)

The pooler's and MLM transform's output axis is named `mlp` (sharded over `model`), as a
square `[E, E]` matrix needs one sharded side.

Precision: activations in `BertConfig.dtype`; parameters, attention scores, softmax,
layer norms and the MLM logits in float32.

Dropout (`dropout_rate`, transformers' `hidden_dropout_prob`) on the embedding output and
on both sub-block outputs before the residual sum; `attention_dropout_rate`
(`attention_probs_dropout_prob`) on the attention probabilities. Masks come from the
`dropout` rng; the models draw them per example (`ktx.models.base.dropout_keyed_by_row`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from ktx import task_taps
from ktx.models.t5 import ACTIVATION_DTYPES
from ktx.models.t5_stack import check_remat_policy, gathered_layers, layer_class
from ktx.partitioning import BATCH, EMBED, HEADS, KV, LAYERS, LENGTH, MLP, VOCAB

__all__ = [
    "HIDDEN_ACTS",
    "BertConfig",
    "BertOutput",
    "DenseGeneral",
    "BertEmbeddings",
    "Embed",
    "BertAttention",
    "BertLayer",
    "BertMLMHead",
    "SHARED_LAYERS_SCOPE",
    "SharedTopLayers",
    "BertEncoder",
    "attention_mask_from",
    "add_perturbation",
    "check_shared_layers",
    "POOLINGS",
    "check_pooling",
    "pool_hidden",
]

# transformers' `hidden_act` names: "gelu" is the exact erf GELU, "gelu_new" (alias
# "gelu_pytorch_tanh") the tanh approximation.
HIDDEN_ACTS = {
    "gelu": lambda x: nn.gelu(x, approximate=False),
    "gelu_new": lambda x: nn.gelu(x, approximate=True),
    "relu": nn.relu,
}
_NEG_INF = -1e10

Array = jax.Array
Dtype = Any

# How a sentence vector `[B, E]` is made from the last hidden states `[B, L, E]`:
# "cls" = BERT's pooler `tanh(W h[:, 0] + b)` (transformers' `pooler_output`); "mean" =
# the mean of the attended positions' hidden states, no parameters (sentence-transformers'
# mean pooling, which all-MiniLM-L6-v2 was trained with).
POOLINGS = ("cls", "mean")


def check_pooling(owner: str, value: Any) -> str:
    if value not in POOLINGS:
        raise ValueError(f"{owner}.pooling={value!r}; accepted: {POOLINGS}")
    return value


def pool_hidden(hidden: Array, mask: Array, pooler: nn.Module, pooling: str = "cls") -> Array:
    """The sentence vector `[B, E]` of `hidden [B, L, E]` (`POOLINGS`); `mask [B, L]`
    (1 = attended token) weighs the mean; `pooler` is only called for "cls" (so a "mean"
    model has no pooler parameters)."""
    if pooling == "cls":
        return jnp.tanh(pooler(hidden[:, 0]))
    if pooling == "mean":
        weights = mask.astype(jnp.float32)[..., None]
        total = jnp.sum(hidden.astype(jnp.float32) * weights, axis=1)
        return (total / jnp.maximum(weights.sum(axis=1), 1.0)).astype(hidden.dtype)
    raise ValueError(f"pooling={pooling!r}; accepted: {POOLINGS}")


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """Shapes and options of a BERT encoder (defaults: BERT-Base, uncased vocabulary).

    `dropout_rate` / `attention_dropout_rate` are transformers' `hidden_dropout_prob` /
    `attention_probs_dropout_prob` (0.1 in every BERT checkpoint). `dtype` is the
    activation dtype ("float32" or "bfloat16"); parameters stay float32. `remat_policy`
    rematerialises each layer of `BertEncoder` and `SharedTopLayers` as T5's does
    (`ktx.models.t5_stack`: "none" | "minimal" | "dots" | "full", same numbers), and the encoder
    methods' own layers (CA-MTL, PALs, TEA) alike. `scan_layers` runs the
    `num_layers` layers of `BertEncoder` as one `nn.scan` (parameters stacked on a leading
    `layers` axis under the root scope `layers`; `ktx.models.scan_layout` converts trees
    between the layouts), as `T5Config.scan_layers`; PALs and TEA-BERT scan too (their
    per-layer tables stacked under `conditioning/layers`), and so does CA-MTL (its
    per-layer conditioning, which differs from layer to layer, stays under
    `conditioning/layers_<i>`).
    """

    vocab_size: int = 30522
    hidden_size: int = 768
    num_layers: int = 12
    num_heads: int = 12
    intermediate_size: int = 3072
    max_position: int = 512
    type_vocab_size: int = 2
    hidden_act: str = "gelu"
    layer_norm_eps: float = 1e-12
    dropout_rate: float = 0.1
    attention_dropout_rate: float = 0.1
    dtype: str = "float32"
    remat_policy: str = "none"
    scan_layers: bool = False

    def __post_init__(self):
        if not isinstance(self.scan_layers, bool):
            raise ValueError(f"BertConfig.scan_layers={self.scan_layers!r}; accepted: True or False")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads",
                     "intermediate_size", "max_position", "type_vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"BertConfig.{name}={value!r}: must be a positive integer")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"BertConfig.hidden_size={self.hidden_size} is not a multiple of "
                f"num_heads={self.num_heads}"
            )
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(
                f"BertConfig.hidden_act={self.hidden_act!r}; accepted: {sorted(HIDDEN_ACTS)}"
            )
        if not isinstance(self.layer_norm_eps, (int, float)) or self.layer_norm_eps <= 0:
            raise ValueError(f"BertConfig.layer_norm_eps={self.layer_norm_eps!r}: must be > 0")
        for name in ("dropout_rate", "attention_dropout_rate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
                raise ValueError(f"BertConfig.{name}={value!r}: must be in [0, 1)")
        check_remat_policy(self.remat_policy, "BertConfig.remat_policy")
        if self.dtype not in ACTIVATION_DTYPES:
            raise ValueError(f"BertConfig.dtype={self.dtype!r}; accepted: {sorted(ACTIVATION_DTYPES)}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def activation_dtype(self) -> Dtype:
        return ACTIVATION_DTYPES[self.dtype]


class BertOutput(NamedTuple):
    """`last_hidden_state [B, L, E]`, `pooled_output [B, E]` (None with `pool=False`) and,
    when asked for,
    `mlm_logits [B, L, V]` (float32; else None)."""

    last_hidden_state: Array
    pooled_output: Array
    mlm_logits: Array | None = None


_kernel_init = nn.initializers.normal(stddev=0.02)  # BERT's initializer_range


class DenseGeneral(nn.Module):
    """Dense layer with bias contracting the trailing `axis` dims of the input with a
    multi-axis kernel: `[..., *in_shape]` -> `[..., *features]`; kernel
    `[*in_shape, *features]` (axes `kernel_axes`), bias `[*features]` (axes `bias_axes`),
    both float32; computed in `dtype`."""

    features: tuple[int, ...]
    kernel_axes: tuple[str | None, ...]
    bias_axes: tuple[str | None, ...]
    axis: tuple[int, ...] = (-1,)
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: Array) -> Array:
        axis = tuple(sorted(a % x.ndim for a in self.axis))
        if axis != tuple(range(x.ndim - len(axis), x.ndim)):
            raise ValueError(f"DenseGeneral.axis={self.axis}: must be the trailing axes")
        in_shape = tuple(x.shape[a] for a in axis)
        features = tuple(self.features)
        n_in, n_out = math.prod(in_shape), math.prod(features)

        def kernel_init(key, shape, dtype=jnp.float32):
            return _kernel_init(key, (n_in, n_out), dtype).reshape(shape)

        kernel = self.param("kernel", nn.with_logical_partitioning(kernel_init, self.kernel_axes),
                            in_shape + features, jnp.float32)
        bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, self.bias_axes),
                          features, jnp.float32)
        # Under task taps (`ktx.task_taps`): per-task gradients in one backward pass.
        y = task_taps.param_contract(self, "kernel", jnp.asarray(x, self.dtype),
                                     jnp.asarray(kernel, self.dtype), len(axis))
        return y + jnp.asarray(task_taps.param_rows(self, "bias", bias, y), self.dtype)


def _dense(features, kernel_axes, bias_axes, *, axis=-1, dtype=jnp.float32, name=None):
    features = (features,) if isinstance(features, int) else tuple(features)
    axis = (axis,) if isinstance(axis, int) else tuple(axis)
    return DenseGeneral(features, tuple(kernel_axes), tuple(bias_axes), axis, dtype, name=name)


class LayerNorm(nn.LayerNorm):
    """`nn.LayerNorm` (same parameters, same values) whose scale and bias are read through
    task taps where the engine gives them (`ktx.task_taps`): each example's task's scale
    and bias, so that their gradients come per task from one backward pass."""

    @nn.compact
    def __call__(self, x, *, mask=None):
        taps = [task_taps.read(self, name) for name in ("scale", "bias")]
        if all(t is None for t in taps):
            return super().__call__(x, mask=mask)
        if mask is not None or self.reduction_axes != -1 or self.feature_axes != -1 \
                or not (self.use_scale and self.use_bias):
            raise ValueError(f"{self.name}: a tapped LayerNorm normalizes the last axis, "
                             "with scale and bias and no mask")
        features = x.shape[-1]
        scale = self.param("scale", self.scale_init, (features,), self.param_dtype)
        bias = self.param("bias", self.bias_init, (features,), self.param_dtype)
        # nn.LayerNorm's arithmetic (`flax.linen.normalization`: `_compute_stats`, then
        # `_normalize`) in float32, the scale and bias each example's task's.
        dtype = jnp.promote_types(jnp.promote_types(x.dtype, self.param_dtype), jnp.float32)
        y = jnp.asarray(x, dtype)
        mean = y.mean(-1, keepdims=True)
        if self.use_fast_variance:
            var = jnp.maximum((y * y).mean(-1, keepdims=True) - mean * mean, 0.0)
        else:
            var = jnp.square(y - mean).mean(-1, keepdims=True)
        mul = jax.lax.rsqrt(var + self.epsilon) * jnp.asarray(
            task_taps.param_rows(self, "scale", scale, x), dtype)
        out = (y - mean) * mul + jnp.asarray(task_taps.param_rows(self, "bias", bias, x), dtype)
        return jnp.asarray(out, self.dtype or jnp.result_type(x, scale, bias))


def _layer_norm(eps: float, dtype: Dtype, name: str) -> nn.LayerNorm:
    # Two-pass variance (E[(x - mean)^2], as torch) for float32 parity; computed in float32.
    return LayerNorm(
        epsilon=eps, dtype=dtype, param_dtype=jnp.float32, use_fast_variance=False, name=name,
        scale_init=nn.with_logical_partitioning(nn.initializers.ones, (EMBED,)),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (EMBED,)),
    )


def attention_mask_from(input_ids: Array, attention_mask: Array | None) -> Array:
    """Boolean `[B, L]` keys to attend: `attention_mask > 0` if given, else `input_ids > 0`."""
    if attention_mask is None:
        return input_ids > 0
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask has shape {attention_mask.shape}; accepted: input_ids' shape "
            f"{input_ids.shape}"
        )
    return attention_mask > 0


class BertEmbeddings(nn.Module):
    """`input_ids`, `token_type_ids` int `[B, L]` -> `LayerNorm(word + position + type)`
    `[B, L, E]` with dropout; `attend(x [..., E]) -> [..., V]` against the word table."""

    vocab_size: int
    hidden_size: int
    max_position: int
    type_vocab_size: int
    layer_norm_eps: float = 1e-12
    dropout_rate: float = 0.0
    dtype: Dtype = jnp.float32

    def setup(self):
        init = nn.initializers.normal(stddev=0.02)
        self.word_embeddings = Embed(
            self.vocab_size, self.hidden_size, dtype=self.dtype, param_dtype=jnp.float32,
            embedding_init=nn.with_logical_partitioning(init, (VOCAB, EMBED)))
        self.position_embeddings = Embed(
            self.max_position, self.hidden_size, dtype=self.dtype, param_dtype=jnp.float32,
            embedding_init=nn.with_logical_partitioning(init, (None, EMBED)))
        self.token_type_embeddings = Embed(
            self.type_vocab_size, self.hidden_size, dtype=self.dtype, param_dtype=jnp.float32,
            embedding_init=nn.with_logical_partitioning(init, (None, EMBED)))
        self.layer_norm = _layer_norm(self.layer_norm_eps, self.dtype, "layer_norm")
        self.dropout = nn.Dropout(self.dropout_rate)

    def __call__(self, input_ids: Array, token_type_ids: Array, deterministic: bool) -> Array:
        x = nn.with_logical_constraint(self.summed(input_ids, token_type_ids),
                                       (BATCH, LENGTH, EMBED))
        return self.dropout(self.layer_norm(x), deterministic=deterministic)

    def summed(self, input_ids: Array, token_type_ids: Array) -> Array:
        """word + position + token-type embeddings `[B, L, E]`, before the LayerNorm."""
        length = input_ids.shape[1]
        if length > self.max_position:
            raise ValueError(
                f"input length {length} exceeds max_position={self.max_position} (the "
                "learned position table); truncate the inputs"
            )
        positions = jnp.arange(length, dtype=jnp.int32)[None]
        # Under task taps the position rows may come per task (`task_taps.add`).
        x = task_taps.add(self.word_embeddings(input_ids), self.position_embeddings(positions))
        return x + self.token_type_embeddings(token_type_ids)

    def attend(self, x: Array) -> Array:
        """`[..., E] -> [..., V]` dot products with every word embedding, in the module's
        `dtype` (`nn.Embed.attend` casts the query and the table to it)."""
        task_taps.read_directly(self.word_embeddings, "embedding")
        return self.word_embeddings.attend(jnp.asarray(x, jnp.float32))


class Embed(nn.Embed):
    """`nn.Embed` whose rows are gathered in float32 and then cast to `dtype`: the same
    values, but the table's gradient is scatter-added in float32 (in bfloat16 it is
    slow on a GPU and inexact; see `ktx.param_gather._rows`)."""

    def __call__(self, inputs: Array) -> Array | task_taps.PerTask:
        """`inputs` int `[N, ...]` -> `[N, ..., E]`. Under a tap (`ktx.task_taps`) each
        example looks its ids up in its task's table; ids `[1, ...]` shared by a batch of
        N > 1 examples (positions) give each task's rows, `PerTask` `[T, ..., E]`."""
        if not jnp.issubdtype(inputs.dtype, jnp.integer):
            raise ValueError(f"{self.name}: token ids must be integers, got dtype {inputs.dtype}")
        tap = task_taps.read(self, "embedding")
        if tap is None:
            return jnp.asarray(jnp.take(self.embedding, inputs, axis=0), self.dtype)
        sizes = task_taps.sizes()
        if inputs.shape[0] == 1 and sum(sizes) != 1:
            tables = task_taps.per_task(self.embedding, tap)
            return task_taps.PerTask(jnp.take(tables, inputs[0], axis=1), sizes).astype(
                self.dtype)
        task = task_taps.expand(jnp.arange(len(sizes), dtype=jnp.int32), inputs.shape[0])
        task = task.reshape(task.shape + (1,) * (inputs.ndim - 1))
        rows = jnp.take(self.embedding, inputs, axis=0) + tap[task, inputs].astype(
            self.embedding.dtype)
        return jnp.asarray(rows, self.dtype)


class BertAttention(nn.Module):
    """Bidirectional multi-head self-attention with biases: `[B, L, E]` and a boolean key
    mask `[B, L]` -> `[B, L, E]` (before the residual and layer norm). Scores and softmax
    in float32; `dropout_rate` applies to the attention probabilities.

    The encoder methods' hooks (same parameters, same computation when absent):
    `qkv [B, 3, H, D]` is added to each row's query, key and value projections (TEA-BERT);
    `bias` (broadcast to `[B, H, L, L]`) is added to the scaled scores before the key mask
    (CA-MTL's conditional bias, with its additive padding mask; `mask=None` then).
    """

    num_heads: int
    head_dim: int
    dropout_rate: float = 0.0
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: Array, mask: Array | None, deterministic: bool, *,
                 qkv: Array | None = None, bias: Array | None = None) -> Array:
        proj = []
        for i, name in enumerate(("query", "key", "value")):
            y = _dense((self.num_heads, self.head_dim), (EMBED, HEADS, KV), (HEADS, KV),
                       dtype=self.dtype, name=name)(x)
            if qkv is not None:
                y = y + jnp.asarray(qkv[:, i], self.dtype)[:, None]
            proj.append(nn.with_logical_constraint(y, (BATCH, LENGTH, HEADS, KV)))
        q, k, v = proj
        scores = jnp.einsum("bqhd,bkhd->bhqk", jnp.asarray(q, jnp.float32),
                            jnp.asarray(k, jnp.float32)) / math.sqrt(self.head_dim)
        if bias is not None:
            scores = scores + bias
        if mask is not None:
            scores = jnp.where(mask[:, None, None, :], scores, _NEG_INF)
        probs = jax.nn.softmax(scores, axis=-1)
        probs = nn.Dropout(self.dropout_rate)(probs, deterministic=deterministic)
        out = jnp.einsum("bhqk,bkhd->bqhd", jnp.asarray(probs, self.dtype), v)
        out = _dense(x.shape[-1], (HEADS, KV, EMBED), (EMBED,), axis=(-2, -1),
                     dtype=self.dtype, name="out")(out)
        return nn.with_logical_constraint(out, (BATCH, LENGTH, EMBED))


class BertLayer(nn.Module):
    """One post-LayerNorm encoder layer: `[B, L, E]`, key mask `[B, L]` -> `[B, L, E]`."""

    num_heads: int
    head_dim: int
    intermediate_size: int
    hidden_act: str = "gelu"
    layer_norm_eps: float = 1e-12
    dropout_rate: float = 0.0
    attention_dropout_rate: float = 0.0
    dtype: Dtype = jnp.float32
    scanned: bool = False  # the body of a scanned stack: returns `(x, None)`

    @nn.compact
    def __call__(self, x: Array, mask: Array, deterministic: bool, layer_inputs: Any = None, *,
                 qkv: Array | None = None, residual: Array | None = None):
        """`layer_inputs`: a scanned stack's per-layer slice (BERT layers take none). The
        encoder methods' hooks (None: plain BERT, bit for bit): `qkv [B, 3, H, D]` joins
        the attention's projections (TEA-BERT); `residual [B, L, E]` joins the
        feed-forward residual before its LayerNorm, `LN(FFN(a) + (a + residual))` (the
        PALs authors' summation order)."""
        del layer_inputs
        hidden = x.shape[-1]
        a = BertAttention(self.num_heads, self.head_dim, self.attention_dropout_rate,
                          self.dtype, name="attention")(x, mask, deterministic, qkv=qkv)
        a = nn.Dropout(self.dropout_rate)(a, deterministic=deterministic)
        x = _layer_norm(self.layer_norm_eps, self.dtype, "attention_layer_norm")(x + a)
        h = _dense(self.intermediate_size, (EMBED, MLP), (MLP,), dtype=self.dtype,
                   name="intermediate")(x)
        h = HIDDEN_ACTS[self.hidden_act](h)
        h = nn.with_logical_constraint(h, (BATCH, LENGTH, MLP))
        h = _dense(hidden, (MLP, EMBED), (EMBED,), dtype=self.dtype, name="output")(h)
        h = nn.Dropout(self.dropout_rate)(h, deterministic=deterministic)
        if residual is not None:
            x = x + jnp.asarray(residual, x.dtype)
        x = _layer_norm(self.layer_norm_eps, self.dtype, "output_layer_norm")(h + x)
        x = nn.with_logical_constraint(x, (BATCH, LENGTH, EMBED))
        return (x, None) if self.scanned else x


class BertMLMHead(nn.Module):
    """`[B, L, E]` -> transform (dense, activation, LayerNorm) `[B, L, E]`, float32; the
    encoder turns it into logits with the tied word embeddings plus `bias` `[V]`."""

    vocab_size: int
    hidden_act: str = "gelu"
    layer_norm_eps: float = 1e-12
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: Array, attend) -> Array:
        h = _dense(x.shape[-1], (EMBED, MLP), (MLP,), dtype=self.dtype, name="transform")(x)
        h = HIDDEN_ACTS[self.hidden_act](h)
        h = _layer_norm(self.layer_norm_eps, jnp.float32, "layer_norm")(h)
        bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, (VOCAB,)),
                          (self.vocab_size,), jnp.float32)
        logits = attend(h) + bias
        return nn.with_logical_constraint(logits, (BATCH, LENGTH, VOCAB))


SHARED_LAYERS_SCOPE = "shared_layers"
_STATIC_ARGNUMS = (3,)  # BertLayer.__call__'s `deterministic` (self = 0), for nn.remat


class SharedTopLayers(nn.Module):
    """`num_layers` extra task-shared BERT layers on top of an encoder (SlapBERT's shared
    layer): `[B, L, E]`, key mask `[B, L]` -> `[B, L, E]`. New parameters
    `layers_<i>/...` (a `BertLayer` each, BERT's initialisation), trained from scratch:
    no BERT checkpoint has them."""

    config: BertConfig
    num_layers: int = 1

    @nn.compact
    def __call__(self, x: Array, mask: Array, deterministic: bool) -> Array:
        c = self.config
        layer_cls = layer_class(BertLayer, c.remat_policy, _STATIC_ARGNUMS, scanned=False)
        for i in range(self.num_layers):
            x = layer_cls(c.num_heads, c.head_dim, c.intermediate_size, c.hidden_act,
                          c.layer_norm_eps, c.dropout_rate, c.attention_dropout_rate,
                          c.activation_dtype, name=f"layers_{i}")(x, mask, deterministic)
        return x


def check_shared_layers(owner: str, value: Any) -> int:
    """`value` as a number of shared top layers (an int >= 0); ValueError naming `owner`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{owner}.shared_layers={value!r}: must be an int >= 0")
    return value


def add_perturbation(x: Array, perturbation: Array | None) -> Array:
    """`x [B, L, E] + perturbation` (None: `x`), the embedding perturbation of
    adversarial training (`ktx.models.smart`); shapes must match."""
    if perturbation is None:
        return x
    if perturbation.shape != x.shape:
        raise ValueError(f"embedding_perturbation has shape {perturbation.shape}; accepted: the "
                         f"embedding output's {x.shape}")
    return x + jnp.asarray(perturbation, x.dtype)


class BertEncoder(nn.Module):
    """The BERT encoder with its pooler and (on request) MLM head.

    `__call__(input_ids, token_type_ids=None, attention_mask=None, *, deterministic=True,
    mlm=False) -> BertOutput`: int `[B, L]` inputs (token types default to 0, the mask to
    `input_ids > 0`); `mlm=True` adds `mlm_logits [B, L, V]` (and creates the `mlm`
    parameters at init); `pool=False` leaves out the pooler (`pooled_output` None). Subclasses (task heads) call `encode` and add modules in `setup`.

    `num_shared_layers > 0` puts that many new task-shared layers (`SharedTopLayers`, scope
    `shared_layers`) between the last BERT layer and the pooler. `embedding_perturbation`
    `[B, L, E]` is added to the embedding output (after its LayerNorm and dropout), the
    input of the first layer (SMART's perturbed embeddings).
    """

    config: BertConfig = BertConfig()
    num_shared_layers: int = 0
    pooling: str = "cls"

    def setup(self):
        c = self.config
        dtype = c.activation_dtype
        self.embeddings = BertEmbeddings(
            c.vocab_size, c.hidden_size, c.max_position, c.type_vocab_size, c.layer_norm_eps,
            c.dropout_rate, dtype)
        fields = (c.num_heads, c.head_dim, c.intermediate_size, c.hidden_act,
                  c.layer_norm_eps, c.dropout_rate, c.attention_dropout_rate, dtype)
        if c.scan_layers:
            body = layer_class(gathered_layers(BertLayer, self.scope.path), c.remat_policy,
                               _STATIC_ARGNUMS, scanned=True)
            self.layers = nn.scan(
                body, variable_axes={"params": 0, "intermediates": 0},
                split_rngs={"params": True, "dropout": True},
                in_axes=(nn.broadcast, nn.broadcast, 0), length=c.num_layers,
                metadata_params={nn.PARTITION_NAME: LAYERS},
            )(*fields, scanned=True, name="layers")
        else:
            layer_cls = layer_class(BertLayer, c.remat_policy, _STATIC_ARGNUMS, scanned=False)
            self.layers = [layer_cls(*fields, name=f"layers_{i}") for i in range(c.num_layers)]
        self.pooler = _dense(c.hidden_size, (EMBED, MLP), (MLP,), dtype=dtype)
        self.mlm = BertMLMHead(c.vocab_size, c.hidden_act, c.layer_norm_eps, dtype)
        self.shared_layers = (SharedTopLayers(c, self.num_shared_layers)
                              if self.num_shared_layers else None)

    def encode(
        self, input_ids: Array, token_type_ids: Array | None = None,
        attention_mask: Array | None = None, *, deterministic: bool = True, pool: bool = True,
        embedding_perturbation: Array | None = None,
    ) -> tuple[Array, Array | None]:
        """`(last_hidden_state [B, L, E], pooled_output [B, E])`; `pool=False` skips the
        pooler (None; a checkpoint without one, e.g. transformers' `BertForMaskedLM`)."""
        if input_ids.ndim != 2 or not jnp.issubdtype(input_ids.dtype, jnp.integer):
            raise ValueError(
                f"input_ids: shape {input_ids.shape} dtype {input_ids.dtype}; accepted: int [B, L]"
            )
        if token_type_ids is None:
            token_type_ids = jnp.zeros_like(input_ids)
        elif token_type_ids.shape != input_ids.shape:
            raise ValueError(
                f"token_type_ids has shape {token_type_ids.shape}; accepted: input_ids' shape "
                f"{input_ids.shape}"
            )
        mask = attention_mask_from(input_ids, attention_mask)
        x = add_perturbation(self.embeddings(input_ids, token_type_ids, deterministic),
                             embedding_perturbation)
        if self.config.scan_layers:
            x, _ = self.layers(x, mask, deterministic, None)
        else:
            for layer in self.layers:
                x = layer(x, mask, deterministic)
        if self.shared_layers is not None:
            x = self.shared_layers(x, mask, deterministic)
        pooled = pool_hidden(x, mask, self.pooler, self.pooling) if pool else None
        return x, pooled

    def mlm_logits(self, hidden: Array) -> Array:
        """`[B, L, E]` hidden states -> float32 MLM logits `[B, L, V]`."""
        return self.mlm(hidden, self.embeddings.attend)

    def __call__(
        self, input_ids: Array, token_type_ids: Array | None = None,
        attention_mask: Array | None = None, *, deterministic: bool = True, mlm: bool = False,
        pool: bool = True,
    ) -> BertOutput:
        hidden, pooled = self.encode(input_ids, token_type_ids, attention_mask,
                                     deterministic=deterministic, pool=pool)
        return BertOutput(hidden, pooled, self.mlm_logits(hidden) if mlm else None)
