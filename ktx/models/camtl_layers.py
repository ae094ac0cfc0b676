"""The modules of CA-MTL (`ktx.models.camtl` assembles them into the encoder and the
model; its docstring gives the equations): the configuration, FiLM generators, the
task-conditioned block-diagonal attention bias, conditional layer norm, the CA-MTL layer,
the conditional bottleneck / adapter and the per-layer and whole-model conditioning.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from ktx import task_taps
from ktx.models import bert
from ktx.partitioning import (
    BATCH,
    EMBED,
    HYPER_BOTTLENECK,
    LENGTH,
    MLP,
    TASK_EMBED,
    TASKS,
)

VARIANTS = ("base", "large")
LAYER_NORM_FORMS = ("code", "paper")
_MASK_VALUE = -10000.0  # the reference's additive padding mask

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

    @staticmethod
    def identity(rows: int, hidden_size: int, layer_norm_form: str) -> LayerNormFiLM:
        """γ = β = 0 `[rows, E]`: `(1 + 0) ⊙ w + 0 = w`, the plain layer norm exactly. A
        scanned CA-MTL stack gives it to its plain-LN layers, so that every layer takes
        the same inputs."""
        zero = jnp.zeros((rows, hidden_size), jnp.float32)
        film = FiLMCoefficients(zero, zero)
        return LayerNormFiLM(film, film if layer_norm_form == "paper" else None)


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
        tap = task_taps.read(self, "block_matrix")  # each row's task's A under a tap
        if tap is not None:
            matrix = task_taps.rows(matrix, tap, z.shape[0])
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
        # Under task taps (`ktx.task_taps`) each row's task's scale and bias, `[B, E]`.
        tapped = {}
        for name, value in (("scale", scale), ("bias", bias)):
            tap = task_taps.read(self, name)
            tapped[name] = value if tap is None else task_taps.rows(value, tap, x.shape[0])
        scale, bias = tapped["scale"], tapped["bias"]

        def lift(v):  # `[B, E]` per row -> `[B, 1, E]`; `[E]` as it is
            return v[:, None, :] if v.ndim == 2 else v

        x = jnp.asarray(x, jnp.float32)
        mean = x.mean(axis=-1, keepdims=True)
        centred = x - mean
        var = jnp.mean(jnp.square(centred), axis=-1, keepdims=True)
        y = centred * jax.lax.rsqrt(var + self.epsilon)
        if film is None:
            y = y * lift(scale) + lift(bias)
        else:
            s = film.scale.apply(scale)[:, None, :]
            b = lift(bias) if film.bias is None else film.bias.apply(bias)[:, None, :]
            y = y * s + b
        return jnp.asarray(y, self.dtype)


class CaMtlLayer(nn.Module):
    """A post-LayerNorm BERT layer (`bert.BertLayer`'s parameters) with conditional
    attention and, when given `LayerNormFiLM`s, conditional layer norms.

    `(x [B, L, E], mask_bias, task_bias [B, L, L], attention_ln, output_ln)` ->
    `(layer output, attention sub-block output)`, both `[B, L, E]`. As the body of a
    scanned stack (`scanned=True`: the inputs after `mask_bias` are one layer's slice) it
    returns `(layer output, (layer output, attention sub-block output))`: the carry and
    the per-layer outputs.
    """

    num_heads: int
    head_dim: int
    intermediate_size: int
    hidden_act: str = "gelu"
    layer_norm_eps: float = 1e-12
    dropout_rate: float = 0.0
    attention_dropout_rate: float = 0.0
    dtype: Dtype = jnp.float32
    scanned: bool = False

    @nn.compact
    def __call__(self, x, mask_bias, task_bias, attention_ln: LayerNormFiLM | None,
                 output_ln: LayerNormFiLM | None, deterministic: bool) -> tuple[Array, Array]:
        hidden = x.shape[-1]
        # BERT's attention with the conditional bias M(z) (every head) and the authors'
        # additive padding mask `(1 - mask) · -10000` (`mask_bias [B, 1, 1, L]`).
        a = bert.BertAttention(self.num_heads, self.head_dim, self.attention_dropout_rate,
                               self.dtype, name="attention")(
            x, None, deterministic, bias=task_bias[:, None] + mask_bias)
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
        out = nn.with_logical_constraint(out, (BATCH, LENGTH, EMBED))
        return (out, (out, a)) if self.scanned else (out, a)


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
        self.task_embeddings = bert.Embed(  # nn.Embed, looked up through a task tap
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
