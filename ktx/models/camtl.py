"""CA-MTL (Pilault et al., ICLR 2021, "Conditionally Adaptive Multi-Task Learning: Improving
Transfer Learning in NLP Using Fewer Parameters & Less Data") on ktx's BERT encoder.

A BERT whose every layer is conditioned on the row's task. Equations (docs/encoders.md,
"CA-MTL"); `z0 = E_task[task_id]` `[B, E]`, FiLM `(1 + γ) ⊙ x + β` with `[γ, β] = W z + b`:

    conditional alignment   h_emb = (1 + γ(z0)) ⊙ BertEmbeddings(x) + β(z0)      `CaMtlConditioning`
    layer conditioning      z = W_t z0 + b_t   (every layer uses z)               `CaMtlConditioning`
    conditional attention   softmax(Q Kᵀ / √d + M(z) + (1 − mask) · −10000) V      `CaMtlAttention`
                            M(z) [L, L] block-diagonal: N = E / L blocks cut from
                            (1 + γ(z)) ⊙ A + β(z), A [L, c] learned, c = ⌈L / N⌉   `BlockDiagonalBias`
    conditional layer norm  code: LN with scale (1 + γ(z)) ⊙ w + β(z), bias b       `CaMtlLayerNorm`
                            paper: bias also FiLMed, (1 + γ'(z)) ⊙ b + β'(z)
    conditional bottleneck  up(down((1 + γ(z')) ⊙ h + β(z'))), z' = W_e z + b_e     `ConditionalBottleneck`
    Base (n layers)         layers < n/2 plain LN; n/2 .. n-2 conditional LN; the top layer
                            CLN_a(bottleneck(z, layer_out) + attention_out)        `ConditionalAdapter`
    Large                   layers < ⌈n/2⌉ plain LN, the rest conditional LN; beside every
                            layer f_i = bottleneck_i(z, h_i + f_{i-1}), f_{-1} = 0; the
                            encoder's output (and the pooler's input) is f_{n-1}
    normalised entropy      H(softmax(logits)) / (log n + 1e-5), 0 for n = 1     `normalised_entropy`

Every parameter of plain BERT keeps `ktx.models.bert.BertEncoder`'s name and shape (a
converted BERT checkpoint loads into the backbone as is); everything CA-MTL adds lives in
the top-level `conditioning` scope, which `ktx params` counts as task-conditioned:

    conditioning/task_embeddings/embedding                        [T, E]
    conditioning/alignment/{kernel [E, 2E], bias [2E]}
    conditioning/task_transformation/{kernel [E, E], bias [E]}
    conditioning/layers_i/attention_bias/block_matrix             [L, c]
    conditioning/layers_i/attention_bias/film/{kernel [E, 2c], bias [2c]}
    conditioning/layers_i/{attention,output}_layer_norm/scale_film/{kernel [E, 2E], bias}
        (+ bias_film with layer_norm_form="paper"), conditional-LN layers only
    conditioning/layers_{n-1}/adapter/bottleneck/...              Base: the top layer's adapter
    conditioning/layers_{n-1}/adapter/layer_norm/{scale, bias} (+ layer_norm_film/...)
    conditioning/layers_i/bottleneck/{task_projection [E, E], film [E, 2E],
        down [E, E//3], up [E//3, E]} (kernels, biases)           Large: every layer

With the Base variant the top layer (`layers_{n-1}`) is the authors' `new_*` layer, trained
from scratch in their code; here it has BERT's names, so a BERT checkpoint fills it too.

The sequence length must equal `CaMtlConfig.max_seq_length` (the bias is `[L, L]`) and
`hidden_size` must be a multiple of it (N = E / L blocks), as in the authors' code.

Parameters (measured with `ktx params`, shapes only): BERT-Base, 9 GLUE tasks,
`max_seq_length = 128`, Base variant, code layer norm:

    .venv/bin/ktx params --gin_file=gin/models/bert_base.gin \
      --gin_file=gin/conditioning/ca_mtl.gin --gin.NUM_TASKS=9 \
      --gin.NUM_LABELS="(2, 2, 2, 1, 2, 3, 2, 2, 2)"

    backbone (BERT-Base + pooler + 9 heads) 109,496,082; task-conditioned 19,741,456;
    total 129,237,538: 1.1803x plain BERT-Base + 9 heads (paper, Table 2: 1.12x).
    Trainable with the bottom half frozen (FROZEN_LAYERS = 'half': embeddings + layers
    0-5, 66,364,416 frozen): 62,873,122 = 48.65% of the total, 5.41% per task (/ 9)
    (paper, Table 2: 5.6% trained parameters per task). `trainable_parameters(model)`
    counts them. Most of the difference to 1.12x is the conditional layer norms' FiLM
    generators (E x 2E each, 12 of them: 14.2M) and the alignment (1.2M).

Dropout (BERT's rates) is keyed per row (`ktx.models.base.row_keys`), as
`ktx.models.encoder.EncoderClassifierModel`; the bottleneck has none (as the reference).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from ktx.models import bert, encoder
from ktx.models.base import Batch
from ktx.analysis.params import CONDITIONING_SCOPE
from ktx.partitioning import (
    BATCH,
    EMBED,
    HEADS,
    HYPER_BOTTLENECK,
    KV,
    LENGTH,
    MLP,
    TASK_EMBED,
    TASKS,
)

__all__ = [
    "VARIANTS",
    "LAYER_NORM_FORMS",
    "CaMtlConfig",
    "CaMtlOutput",
    "FiLMCoefficients",
    "LayerNormFiLM",
    "BlockDiagonalBias",
    "CaMtlLayerNorm",
    "CaMtlAttention",
    "CaMtlLayer",
    "ConditionalBottleneck",
    "ConditionalAdapter",
    "CaMtlLayerConditioning",
    "CaMtlConditioning",
    "CaMtlEncoder",
    "CaMtlClassifier",
    "CaMtlClassifierModel",
    "ca_mtl_model",
    "frozen_patterns",
    "normalised_entropy",
    "row_normalised_entropy",
    "trainable_parameters",
]

VARIANTS = ("base", "large")
LAYER_NORM_FORMS = ("code", "paper")
_MASK_VALUE = -10000.0  # the reference's additive padding mask
_ENTROPY_EPS = 1e-5

Array = jax.Array
Dtype = Any

_kernel_init = nn.initializers.normal(stddev=0.02)


@dataclasses.dataclass(frozen=True)
class CaMtlConfig:
    """What CA-MTL adds to a `bert.BertConfig`.

    variant: "base" (conditional adapter on the top layer) or "large" (a conditional
      bottleneck chain beside every layer; the encoder outputs its last link).
    max_seq_length: `L`, the only accepted input length; `hidden_size` must be a multiple.
    layer_norm_form: "code" (the authors' code: only the layer norm's scale is FiLMed by
      z) or "paper" (scale and bias both generated from z).
    """

    variant: str = "base"
    max_seq_length: int = 128
    layer_norm_form: str = "code"

    def __post_init__(self):
        if self.variant not in VARIANTS:
            raise ValueError(f"CaMtlConfig.variant={self.variant!r}; accepted: {VARIANTS}")
        if self.layer_norm_form not in LAYER_NORM_FORMS:
            raise ValueError(
                f"CaMtlConfig.layer_norm_form={self.layer_norm_form!r}; accepted: {LAYER_NORM_FORMS}")
        value = self.max_seq_length
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"CaMtlConfig.max_seq_length={value!r}: must be a positive integer")

    def check(self, config: bert.BertConfig) -> None:
        """ValueError naming the field when `config` cannot carry this CA-MTL."""
        if config.hidden_size % self.max_seq_length:
            raise ValueError(
                f"BertConfig.hidden_size={config.hidden_size} is not a multiple of "
                f"CaMtlConfig.max_seq_length={self.max_seq_length}: the conditional attention "
                "cuts its [L, L] bias into hidden_size / max_seq_length diagonal blocks")
        if self.max_seq_length > config.max_position:
            raise ValueError(
                f"CaMtlConfig.max_seq_length={self.max_seq_length} exceeds "
                f"BertConfig.max_position={config.max_position}")
        if self.variant == "base" and config.num_layers < 2:
            raise ValueError(
                f"BertConfig.num_layers={config.num_layers}: CA-MTL Base needs >= 2 layers "
                "(a plain bottom half and the adapter layer on top)")

    def num_blocks(self, hidden_size: int) -> int:
        """`N = E / L`, the number of diagonal blocks."""
        return hidden_size // self.max_seq_length

    def block_size(self, hidden_size: int) -> int:
        """`c = ⌈L / N⌉`, the width of the learned block matrix."""
        return math.ceil(self.max_seq_length / self.num_blocks(hidden_size))

    def conditional_layer_norm(self, layer: int, num_layers: int) -> bool:
        """Whether layer `layer` (0-based) of `num_layers` has conditional layer norms."""
        first = num_layers // 2 if self.variant == "base" else num_layers - num_layers // 2
        return layer >= first


class CaMtlOutput(NamedTuple):
    """`last_hidden_state [B, L, E]` (Large: the bottleneck chain's `f_{n-1}`),
    `pooled_output [B, E]` and `hidden_states`: the aligned embedding output and each
    layer's output (`n + 1` arrays `[B, L, E]`)."""

    last_hidden_state: Array
    pooled_output: Array
    hidden_states: tuple[Array, ...]


class FiLMCoefficients(NamedTuple):
    """Per-row FiLM `(1 + gamma) ⊙ x + beta`: `gamma`, `beta` `[B, ...]`."""

    gamma: Array
    beta: Array

    def apply(self, x: Array) -> Array:
        return (1.0 + self.gamma) * x + self.beta


class LayerNormFiLM(NamedTuple):
    """FiLM of a layer norm's scale and (paper form; else None) of its bias."""

    scale: FiLMCoefficients
    bias: FiLMCoefficients | None = None


def _dense(features: int, kernel_axes, bias_axes, dtype, name: str | None) -> bert.DenseGeneral:
    return bert.DenseGeneral((features,), tuple(kernel_axes), tuple(bias_axes), (-1,), dtype,
                             name=name)


def _film(z: Array, features: int, dtype: Dtype, name: str, axes=(EMBED, None)) -> FiLMCoefficients:
    """`[γ, β] = Dense(2 * features)(z)`: the reference's `FiLM.gb_weights` (γ first)."""
    gb = _dense(2 * features, axes, (axes[1],), dtype, name)(z)
    gamma, beta = jnp.split(jnp.asarray(gb, jnp.float32), 2, axis=-1)
    return FiLMCoefficients(gamma, beta)


class LayerNormFiLMGenerator(nn.Module):
    """`z [B, E]` -> `LayerNormFiLM` of a conditional layer norm (`[B, E]` coefficients)."""

    hidden_size: int
    layer_norm_form: str = "code"
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, z: Array) -> LayerNormFiLM:
        scale = _film(z, self.hidden_size, self.dtype, "scale_film")
        bias = (_film(z, self.hidden_size, self.dtype, "bias_film")
                if self.layer_norm_form == "paper" else None)
        return LayerNormFiLM(scale, bias)


class BlockDiagonalBias(nn.Module):
    """Conditional attention bias: `z [B, E]` -> `M(z) [B, L, L]`.

    `A` (`block_matrix [L, c]`, the reference's `random_weight_matrix`) is FiLMed by z
    (`film`, the reference's `cond_block_diag_attn.gb_weights`), cut into row blocks of
    `c` rows, and block `j` is placed at rows and columns `j c ...`:
    `M[q, k] = A'[q, k - c ⌊q / c⌋]` when `⌊q / c⌋ = ⌊k / c⌋`, else 0 (torch's
    `block_diag` of `chunk(A', N)` cut to `L` columns).
    """

    max_seq_length: int
    block_size: int
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, z: Array) -> Array:
        length, c = self.max_seq_length, self.block_size
        matrix = self.param("block_matrix", nn.with_logical_partitioning(
            nn.initializers.zeros, (LENGTH, None)), (length, c), jnp.float32)
        film = _film(z, c, self.dtype, "film")
        modulated = (1.0 + film.gamma[:, None, :]) * matrix + film.beta[:, None, :]  # [B, L, c]
        q = jnp.arange(length)[:, None]
        k = jnp.arange(length)[None, :]
        same_block = (q // c) == (k // c)
        column = jnp.clip(k - (q // c) * c, 0, c - 1)  # [L, L]
        gathered = jnp.take_along_axis(
            modulated, jnp.broadcast_to(column, (modulated.shape[0], length, length)), axis=2)
        return jnp.where(same_block, gathered, 0.0)


class CaMtlLayerNorm(nn.Module):
    """LayerNorm over the last axis (two-pass variance, float32) with BERT's `scale`,
    `bias` `[E]`; with `film` (per row) the scale is `(1 + γ) ⊙ scale + β` and, paper
    form, the bias `(1 + γ') ⊙ bias + β'`. `[B, L, E] -> [B, L, E]` in `dtype`."""

    epsilon: float = 1e-12
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: Array, film: LayerNormFiLM | None = None) -> Array:
        hidden = x.shape[-1]
        scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, (EMBED,)),
                           (hidden,), jnp.float32)
        bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, (EMBED,)),
                          (hidden,), jnp.float32)
        x = jnp.asarray(x, jnp.float32)
        mean = x.mean(axis=-1, keepdims=True)
        centred = x - mean
        var = jnp.mean(jnp.square(centred), axis=-1, keepdims=True)
        y = centred * jax.lax.rsqrt(var + self.epsilon)
        if film is None:
            y = y * scale + bias
        else:
            s = film.scale.apply(scale)[:, None, :]
            b = bias if film.bias is None else film.bias.apply(bias)[:, None, :]
            y = y * s + b
        return jnp.asarray(y, self.dtype)


class CaMtlAttention(nn.Module):
    """BERT self-attention (`bert.BertAttention`'s parameters) whose scaled scores get
    the conditional bias `M(z) [B, L, L]` (every head) before the additive padding mask
    `(1 - mask) · -10000` (`mask_bias [B, 1, 1, L]`). `[B, L, E] -> [B, L, E]`."""

    num_heads: int
    head_dim: int
    dropout_rate: float = 0.0
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: Array, mask_bias: Array, task_bias: Array, deterministic: bool) -> Array:
        proj = {
            name: bert.DenseGeneral((self.num_heads, self.head_dim), (EMBED, HEADS, KV),
                                    (HEADS, KV), (-1,), self.dtype, name=name)(x)
            for name in ("query", "key", "value")
        }
        q, k, v = (nn.with_logical_constraint(proj[n], (BATCH, LENGTH, HEADS, KV))
                   for n in ("query", "key", "value"))
        scores = jnp.einsum("bqhd,bkhd->bhqk", jnp.asarray(q, jnp.float32),
                            jnp.asarray(k, jnp.float32)) / math.sqrt(self.head_dim)
        scores = scores + task_bias[:, None] + mask_bias
        probs = jax.nn.softmax(scores, axis=-1)
        probs = nn.Dropout(self.dropout_rate)(probs, deterministic=deterministic)
        out = jnp.einsum("bhqk,bkhd->bqhd", jnp.asarray(probs, self.dtype), v)
        out = bert.DenseGeneral((x.shape[-1],), (HEADS, KV, EMBED), (EMBED,), (-2, -1),
                                self.dtype, name="out")(out)
        return nn.with_logical_constraint(out, (BATCH, LENGTH, EMBED))


class CaMtlLayer(nn.Module):
    """A post-LayerNorm BERT layer (`bert.BertLayer`'s parameters) with conditional
    attention and, when given `LayerNormFiLM`s, conditional layer norms.

    `(x [B, L, E], mask_bias, task_bias [B, L, L], attention_ln, output_ln)` ->
    `(layer output, attention sub-block output)`, both `[B, L, E]`.
    """

    num_heads: int
    head_dim: int
    intermediate_size: int
    hidden_act: str = "gelu"
    layer_norm_eps: float = 1e-12
    dropout_rate: float = 0.0
    attention_dropout_rate: float = 0.0
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x, mask_bias, task_bias, attention_ln: LayerNormFiLM | None,
                 output_ln: LayerNormFiLM | None, deterministic: bool) -> tuple[Array, Array]:
        hidden = x.shape[-1]
        a = CaMtlAttention(self.num_heads, self.head_dim, self.attention_dropout_rate,
                           self.dtype, name="attention")(x, mask_bias, task_bias, deterministic)
        a = nn.Dropout(self.dropout_rate)(a, deterministic=deterministic)
        a = CaMtlLayerNorm(self.layer_norm_eps, self.dtype, name="attention_layer_norm")(
            x + a, attention_ln)
        h = _dense(self.intermediate_size, (EMBED, MLP), (MLP,), self.dtype, "intermediate")(a)
        h = bert.HIDDEN_ACTS[self.hidden_act](h)
        h = nn.with_logical_constraint(h, (BATCH, LENGTH, MLP))
        h = _dense(hidden, (MLP, EMBED), (EMBED,), self.dtype, "output")(h)
        h = nn.Dropout(self.dropout_rate)(h, deterministic=deterministic)
        out = CaMtlLayerNorm(self.layer_norm_eps, self.dtype, name="output_layer_norm")(
            a + h, output_ln)
        return nn.with_logical_constraint(out, (BATCH, LENGTH, EMBED)), a


class ConditionalBottleneck(nn.Module):
    """`(z [B, E], h [B, L, E]) -> up(down((1 + γ(z')) ⊙ h + β(z'))) [B, L, E]`,
    `z' = task_projection(z)`, down `E -> E // 3`, no nonlinearity (the reference's
    `ConditionalBottleNeck`)."""

    hidden_size: int
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, z: Array, h: Array) -> Array:
        e = self.hidden_size
        z = _dense(e, (EMBED, TASK_EMBED), (TASK_EMBED,), self.dtype, "task_projection")(z)
        film = _film(z, e, self.dtype, "film", axes=(TASK_EMBED, None))
        h = jnp.asarray(film.gamma[:, None, :] + 1.0, self.dtype) * h + jnp.asarray(
            film.beta[:, None, :], self.dtype)
        h = _dense(e // 3, (EMBED, HYPER_BOTTLENECK), (HYPER_BOTTLENECK,), self.dtype, "down")(h)
        h = _dense(e, (HYPER_BOTTLENECK, EMBED), (EMBED,), self.dtype, "up")(h)
        return nn.with_logical_constraint(h, (BATCH, LENGTH, EMBED))


class ConditionalAdapter(nn.Module):
    """Base's top-layer adapter: `CLN(bottleneck(z, layer_out) + attention_out)`."""

    hidden_size: int
    layer_norm_eps: float = 1e-12
    layer_norm_form: str = "code"
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, z: Array, layer_out: Array, attention_out: Array) -> Array:
        h = ConditionalBottleneck(self.hidden_size, self.dtype, name="bottleneck")(z, layer_out)
        film = LayerNormFiLMGenerator(self.hidden_size, self.layer_norm_form, self.dtype,
                                      name="layer_norm_film")(z)
        return CaMtlLayerNorm(self.layer_norm_eps, self.dtype, name="layer_norm")(
            h + attention_out, film)


class CaMtlLayerConditioning(nn.Module):
    """Layer `i`'s task-conditioned parameters (`conditioning/layers_i`): the attention
    bias, the layer-norm FiLMs (conditional-LN layers), Base's adapter (top layer) or
    Large's bottleneck."""

    hidden_size: int
    max_seq_length: int
    block_size: int
    conditional_layer_norm: bool
    has_adapter: bool = False
    has_bottleneck: bool = False
    layer_norm_eps: float = 1e-12
    layer_norm_form: str = "code"
    dtype: Dtype = jnp.float32

    def setup(self):
        self.attention_bias = BlockDiagonalBias(self.max_seq_length, self.block_size, self.dtype)
        if self.conditional_layer_norm:
            self.attention_layer_norm = LayerNormFiLMGenerator(
                self.hidden_size, self.layer_norm_form, self.dtype)
            self.output_layer_norm = LayerNormFiLMGenerator(
                self.hidden_size, self.layer_norm_form, self.dtype)
        if self.has_adapter:
            self.adapter = ConditionalAdapter(
                self.hidden_size, self.layer_norm_eps, self.layer_norm_form, self.dtype)
        if self.has_bottleneck:
            self.bottleneck = ConditionalBottleneck(self.hidden_size, self.dtype)

    def __call__(self, z: Array) -> tuple[Array, LayerNormFiLM | None, LayerNormFiLM | None]:
        """`(attention bias [B, L, L], attention LN FiLM, output LN FiLM)`."""
        if self.conditional_layer_norm:
            return (self.attention_bias(z), self.attention_layer_norm(z),
                    self.output_layer_norm(z))
        return self.attention_bias(z), None, None

    def adapt(self, z: Array, layer_out: Array, attention_out: Array) -> Array:
        return self.adapter(z, layer_out, attention_out)

    def chain(self, z: Array, h: Array) -> Array:
        return self.bottleneck(z, h)


class CaMtlConditioning(nn.Module):
    """Every task-conditioned parameter (scope `conditioning`): the task embeddings, the
    conditional alignment, the task transformation and one `CaMtlLayerConditioning` per
    layer."""

    num_tasks: int
    hidden_size: int
    num_layers: int
    camtl: CaMtlConfig
    layer_norm_eps: float = 1e-12
    dtype: Dtype = jnp.float32

    def setup(self):
        e, c = self.hidden_size, self.camtl
        self.task_embeddings = nn.Embed(
            self.num_tasks, e, dtype=jnp.float32, param_dtype=jnp.float32,
            embedding_init=nn.with_logical_partitioning(_kernel_init, (TASKS, TASK_EMBED)))
        self.alignment = _dense(2 * e, (TASK_EMBED, None), (None,), self.dtype, None)
        self.task_transformation = _dense(e, (TASK_EMBED, EMBED), (EMBED,), self.dtype, None)
        n = self.num_layers
        self.layers = [
            CaMtlLayerConditioning(
                e, c.max_seq_length, c.block_size(e), c.conditional_layer_norm(i, n),
                has_adapter=c.variant == "base" and i == n - 1, has_bottleneck=c.variant == "large",
                layer_norm_eps=self.layer_norm_eps, layer_norm_form=c.layer_norm_form,
                dtype=self.dtype, name=f"layers_{i}")
            for i in range(n)
        ]

    def __call__(self, task_id: Array, embedded: Array) -> tuple[Array, Array]:
        """`(aligned embedding output [B, L, E], z [B, E])` for int `task_id [B]`."""
        z0 = self.task_embeddings(task_id)
        gamma, beta = jnp.split(jnp.asarray(self.alignment(z0), jnp.float32), 2, axis=-1)
        aligned = FiLMCoefficients(gamma[:, None, :], beta[:, None, :]).apply(
            jnp.asarray(embedded, jnp.float32))
        return jnp.asarray(aligned, embedded.dtype), self.task_transformation(z0)

    def layer(self, i: int, z: Array):
        return self.layers[i](z)

    def adapt(self, i: int, z: Array, layer_out: Array, attention_out: Array) -> Array:
        return self.layers[i].adapt(z, layer_out, attention_out)

    def chain(self, i: int, z: Array, h: Array) -> Array:
        return self.layers[i].chain(z, h)


class CaMtlEncoder(nn.Module):
    """The CA-MTL encoder and its pooler.

    `__call__(input_ids, token_type_ids, attention_mask, task_id, *, deterministic)` ->
    `CaMtlOutput`; int `[B, L]` inputs with `L = camtl.max_seq_length` (token types
    default to 0, the mask to `input_ids > 0`), `task_id [B]` picks each row's task.
    """

    config: bert.BertConfig = bert.BertConfig()
    camtl: CaMtlConfig = CaMtlConfig()
    num_tasks: int = 1
    num_shared_layers: int = 0

    def setup(self):
        c = self.config
        self.camtl.check(c)
        dtype = c.activation_dtype
        self.embeddings = bert.BertEmbeddings(
            c.vocab_size, c.hidden_size, c.max_position, c.type_vocab_size, c.layer_norm_eps,
            c.dropout_rate, dtype)
        self.conditioning = CaMtlConditioning(
            self.num_tasks, c.hidden_size, c.num_layers, self.camtl, c.layer_norm_eps, dtype,
            name=CONDITIONING_SCOPE)
        self.layers = [
            CaMtlLayer(c.num_heads, c.head_dim, c.intermediate_size, c.hidden_act,
                       c.layer_norm_eps, c.dropout_rate, c.attention_dropout_rate, dtype,
                       name=f"layers_{i}")
            for i in range(c.num_layers)
        ]
        self.pooler = _dense(c.hidden_size, (EMBED, MLP), (MLP,), dtype, None)
        self.shared_layers = (bert.SharedTopLayers(c, self.num_shared_layers)
                              if self.num_shared_layers else None)

    def _check(self, input_ids, token_type_ids, attention_mask, task_id):
        if input_ids.ndim != 2 or not jnp.issubdtype(input_ids.dtype, jnp.integer):
            raise ValueError(
                f"input_ids: shape {input_ids.shape} dtype {input_ids.dtype}; accepted: int [B, L]")
        length = input_ids.shape[1]
        if length != self.camtl.max_seq_length:
            raise ValueError(
                f"input length {length} != CaMtlConfig.max_seq_length="
                f"{self.camtl.max_seq_length}: CA-MTL's block-diagonal attention bias is "
                "[max_seq_length, max_seq_length]; pad every input to exactly that length")
        for name, value in (("token_type_ids", token_type_ids), ("attention_mask", attention_mask)):
            if value is not None and value.shape != input_ids.shape:
                raise ValueError(f"{name} has shape {value.shape}; accepted: input_ids' shape "
                                 f"{input_ids.shape}")
        if task_id is None or task_id.shape != input_ids.shape[:1]:
            raise ValueError(
                f"task_id has shape {None if task_id is None else task_id.shape}; accepted: "
                f"[B] = {input_ids.shape[:1]}")

    def __call__(self, input_ids: Array, token_type_ids: Array | None = None,
                 attention_mask: Array | None = None, task_id: Array | None = None, *,
                 deterministic: bool = True,
                 embedding_perturbation: Array | None = None) -> CaMtlOutput:
        self._check(input_ids, token_type_ids, attention_mask, task_id)
        if token_type_ids is None:
            token_type_ids = jnp.zeros_like(input_ids)
        mask = bert.attention_mask_from(input_ids, attention_mask)
        mask_bias = jnp.where(mask, 0.0, _MASK_VALUE)[:, None, None, :].astype(jnp.float32)
        x = bert.add_perturbation(self.embeddings(input_ids, token_type_ids, deterministic),
                                  embedding_perturbation)
        x, z = self.conditioning(jnp.asarray(task_id, jnp.int32), x)
        hidden = [x]
        n = self.config.num_layers
        chain = jnp.zeros_like(x) if self.camtl.variant == "large" else None
        for i, layer in enumerate(self.layers):
            task_bias, attention_ln, output_ln = self.conditioning.layer(i, z)
            x, attention_out = layer(x, mask_bias, task_bias, attention_ln, output_ln,
                                     deterministic)
            if self.camtl.variant == "base" and i == n - 1:
                x = self.conditioning.adapt(i, z, x, attention_out)
            hidden.append(x)
            if chain is not None:
                chain = self.conditioning.chain(i, z, x + chain)
        last = x if chain is None else chain
        if self.shared_layers is not None:
            last = self.shared_layers(last, mask, deterministic)
        pooled = jnp.tanh(self.pooler(last[:, 0]))
        return CaMtlOutput(last, pooled, tuple(hidden))


class CaMtlClassifier(CaMtlEncoder):
    """`CaMtlEncoder` plus one linear head per task (`encoder.TaskHeads`, scope
    `task_heads`) on the dropped-out pooled output: a tuple of `T` float32 `[B, n_t]`."""

    num_labels: tuple[int, ...] = (2,)
    classifier_dropout: float = 0.1

    def setup(self):
        super().setup()
        self.head_dropout = nn.Dropout(self.classifier_dropout)
        self.task_heads = encoder.TaskHeads(tuple(self.num_labels), self.config.activation_dtype)

    def __call__(self, input_ids, token_type_ids=None, attention_mask=None, task_id=None, *,
                 deterministic: bool = True, embedding_perturbation=None):
        out = super().__call__(input_ids, token_type_ids, attention_mask, task_id,
                               deterministic=deterministic,
                               embedding_perturbation=embedding_perturbation)
        return self.task_heads(self.head_dropout(out.pooled_output, deterministic=deterministic))

    def encode(self, input_ids, token_type_ids=None, attention_mask=None, task_id=None, *,
               deterministic: bool = True) -> CaMtlOutput:
        """The encoder's `CaMtlOutput` (no heads)."""
        return CaMtlEncoder.__call__(self, input_ids, token_type_ids, attention_mask, task_id,
                                     deterministic=deterministic)


# -------------------------------------------------------------------- frozen parameters


def frozen_patterns(num_layers: int, frozen_layers: int | str = 0) -> tuple[str, ...]:
    """Regexes (full match on '/'-joined paths, as `ktx.training.optimizers.freeze`) of the
    parameters that do not train (`encoder.frozen_layer_patterns`): with `frozen_layers =
    k > 0` (or "half": `num_layers // 2`), BERT's embeddings and layers `0 .. k-1`. Their
    task-conditioned parameters (in `conditioning/`), the upper layers, the pooler and the
    heads train (the paper's setting: the bottom half and the embeddings frozen; the
    authors' run freezes layers 0-4 of Base and 0-11 of Large).
    """
    return encoder.frozen_layer_patterns(num_layers, frozen_layers)


def _path_name(path) -> str:
    return jax.tree_util.keystr(tuple(path), simple=True, separator="/")


def _frozen_mask(params: Any, patterns: Sequence[str]) -> Any:
    compiled = [re.compile(p) for p in patterns]
    return jax.tree_util.tree_map_with_path(
        lambda path, _: any(rx.fullmatch(_path_name(path)) for rx in compiled), params)


def trainable_parameters(model: CaMtlClassifierModel) -> dict[str, int]:
    """`{"total", "frozen", "trainable"}` parameter counts of `model` from shapes only."""
    spec = model.input_spec(1, {"inputs": model.camtl.max_seq_length})
    abstract = nn.unbox(jax.eval_shape(model.init_variables, jax.random.key(0), spec)["params"])
    mask = _frozen_mask(abstract, model.frozen_patterns)
    sizes = jax.tree.map(lambda a: math.prod(a.shape), abstract)
    total = sum(jax.tree.leaves(sizes))
    frozen = sum(s for s, m in zip(jax.tree.leaves(sizes), jax.tree.leaves(mask)) if m)
    return {"total": total, "frozen": frozen, "trainable": total - frozen}


# -------------------------------------------------------------------- uncertainty


def normalised_entropy(logits: Array) -> Array:
    """`[..., n]` logits -> `[...]` entropy of `softmax(logits)` over `log(n) + 1e-5`
    (0 for a 1-output regression head): what MT-uncertainty sampling ranks rows by. No
    gradient flows through it (the reference detaches the logits)."""
    logits = jax.lax.stop_gradient(jnp.asarray(logits, jnp.float32))  # a score, as the reference
    n = logits.shape[-1]
    if n == 1:
        return jnp.zeros(logits.shape[:-1], jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    p = jnp.exp(logp)
    entropy = -jnp.sum(jnp.where(p > 0, p * logp, 0.0), axis=-1)  # 0 log 0 = 0
    return entropy / (math.log(n) + _ENTROPY_EPS)


def row_normalised_entropy(logits: Sequence[Array], task_id: Array) -> Array:
    """`[B]` normalised entropy of each row's own task head (`logits`: `T` arrays
    `[B, n_t]`, as `CaMtlClassifierModel.logits`)."""
    task_id = jnp.asarray(task_id, jnp.int32)
    out = jnp.zeros(task_id.shape, jnp.float32)
    for t, lg in enumerate(logits):
        out = jnp.where(task_id == t, normalised_entropy(lg), out)
    return out


# -------------------------------------------------------------------- model


class CaMtlClassifierModel(encoder.EncoderClassifierModel):
    """`encoder.EncoderClassifierModel` (same heads, loss and metrics) on a CA-MTL encoder
    whose every row is conditioned on `batch["task_id"]`.

    Args (besides `EncoderClassifierModel`'s):
      camtl: the `CaMtlConfig` (variant, max_seq_length, layer_norm_form).
      frozen_layers: 0 (train everything), k or "half": BERT's embeddings and bottom `k`
        layers do not train (`frozen_patterns`; their gradients are stopped in the loss
        too).
    """

    def __init__(
        self,
        config: bert.BertConfig | None = None,
        *,
        camtl: CaMtlConfig | None = None,
        frozen_layers: int | str = 0,
        **kwargs,
    ):
        super().__init__(config, frozen_layers=frozen_layers, **kwargs)
        camtl = CaMtlConfig() if camtl is None else camtl
        if not isinstance(camtl, CaMtlConfig):
            raise TypeError(f"CaMtlClassifierModel.camtl must be a CaMtlConfig, got "
                            f"{type(camtl).__name__}")
        camtl.check(self.config)
        self.camtl = camtl
        self.module = CaMtlClassifier(
            config=self.config, camtl=camtl, num_tasks=self.num_tasks,
            num_shared_layers=self.shared_layers, num_labels=self.num_labels,
            classifier_dropout=self.classifier_dropout)

    def __repr__(self) -> str:
        return (f"CaMtlClassifierModel(config={self.config}, camtl={self.camtl}, "
                f"num_labels={self.num_labels}, classifier_dropout={self.classifier_dropout}, "
                f"loss_normalization={self.loss_normalization!r}, "
                f"shared_layers={self.shared_layers}, frozen_layers={self.frozen_layers!r})")

    def input_spec(self, batch_size: int, feature_lengths: Mapping[str, int]
                   ) -> dict[str, jax.ShapeDtypeStruct]:
        """`EncoderClassifierModel.input_spec` at length `max_seq_length`, the only one the
        model takes (`feature_lengths["inputs"]` is checked as there; set the tasks'
        input length to `max_seq_length`)."""
        spec = super().input_spec(batch_size, feature_lengths)
        shape = (batch_size, self.camtl.max_seq_length)
        return {k: jax.ShapeDtypeStruct(shape, v.dtype) if v.ndim == 2 else v
                for k, v in spec.items()}

    def init_variables(self, rng: jax.Array, batch: Batch) -> Any:
        """Variables for `batch`'s batch size at length `max_seq_length`."""
        ids = jnp.zeros((batch["input_ids"].shape[0], self.camtl.max_seq_length), jnp.int32)
        return self.module.init(rng, ids, ids, jnp.ones_like(ids), ids[:, 0], deterministic=True)

    def _features(self, batch: Batch) -> dict[str, Array]:
        self._check_batch(batch, ("input_ids", "task_id"))
        names = ("input_ids", "token_type_ids", "attention_mask", "task_id")
        return {k: jnp.asarray(batch[k], jnp.int32) for k in names if k in batch}

    def encode(self, params: Any, batch: Batch) -> CaMtlOutput:
        """The deterministic `CaMtlOutput` of `batch` (hidden states, pooled output)."""
        return self.module.apply({"params": params}, **self._features(batch),
                                 deterministic=True, method=CaMtlClassifier.encode)

    def logits(self, params: Any, batch: Batch, rng: jax.Array | None = None,
               train: bool = False, *,
               embedding_perturbation: Array | None = None) -> tuple[Array, ...]:
        """`T` float32 logits `[B, n_t]` (every head on every row; the encoder is
        conditioned on each row's `task_id`; dropout keyed per row, as
        EncoderClassifierModel; `embedding_perturbation` `[B, L, E]` joins the embedding
        output)."""
        return self._apply(params, self._features(batch), batch, rng, train,
                           embedding_perturbation)

    def normalised_entropy(self, params: Any, batch: Batch) -> Array:
        """`[B]` normalised entropy of each row's own head (deterministic forward)."""
        return row_normalised_entropy(self.logits(params, batch), batch["task_id"])



def ca_mtl_model(
    base: encoder.EncoderClassifierModel,
    camtl: CaMtlConfig | None = None,
    *,
    frozen_layers: int | str = 0,
) -> CaMtlClassifierModel:
    """`base` (a configured plain BERT classifier, gin/models/bert_*.gin) as CA-MTL; its
    BERT shapes, tasks, heads and loss options are kept, so a gin file that overrides only
    `MODEL = @camtl.ca_mtl_model()` switches the method (gin/conditioning/ca_mtl.gin)."""
    if not isinstance(base, encoder.EncoderClassifierModel):
        raise TypeError(f"ca_mtl_model: base={type(base).__name__}; accepted: a "
                        "ktx.models.encoder.EncoderClassifierModel")
    return CaMtlClassifierModel(
        base.config, camtl=camtl, frozen_layers=frozen_layers, num_labels=base.num_labels,
        classifier_dropout=base.classifier_dropout, loss_normalization=base.loss_normalization,
        shared_layers=base.shared_layers)
