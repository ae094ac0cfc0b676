"""T5.1.1 encoder-decoder Transformer in flax.linen (Raffel et al., 2020, "Exploring the
Limits of Transfer Learning with a Unified Text-to-Text Transformer", T5.1.1 variant).

T5.1.1 = pre-norm RMS layer norm without bias or mean subtraction, gated-GELU feed-forward
(Shazeer, 2020, "GLU Variants Improve Transformer"), bucketed relative position biases
shared by all layers of a stack (bidirectional in the encoder, causal in the decoder), no
biases anywhere, input embedding shared by encoder and decoder, untied output logits,
dropout. Parameter names follow T5X's `network.py`, so T5X checkpoints map one-to-one.

Every parameter carries logical axis names (`ktx.partitioning`) through
`nn.with_logical_partitioning`; activations are constrained with
`nn.with_logical_constraint` (a no-op outside a mesh / axis-rules context). The layers
(dense, embedding, RMS norm, MLP, relative position biases, attention) are in
`ktx.models.t5_layers`; this module holds the configuration, the layer stacks and the model.

Shapes: `B` batch, `Le`/`Ld` encoder/decoder length, `E` embed, `H` heads, `D` head dim,
`V` vocabulary, `P` prefix (or prompt) length.

Packing: a packed row holds several examples one after another. Attention is masked to
equal `*_segment_ids`; relative positions are computed from in-row offsets, which equal
the per-segment offsets for every pair of tokens of one (contiguous) segment, and pairs
across segments are masked, so `*_positions` do not change the result. They are accepted
for interface compatibility and validated for shape only. Input prompts (below) are
refused with packed inputs: prompts prepended once per row would be shared by the row's
segments, and since the prompts' own encoder states attend to every token of the row,
one segment would see another through them.

Precision: activations use `T5Config.dtype`; attention logits and softmax (with
`float32_attention_logits`), layer norms, the output logits and the loss are float32
whatever the activation dtype, as in T5X.

Dropout (`T5Config.dropout_rate`), as T5X's T5.1.1: on the embeddings, every sub-block
output and the final norm's output, with one mask per example and embedding channel
broadcast over the sequence (`broadcast_dims=(-2,)`); inside the gated MLP likewise; on
the attention probabilities `[B, H, Lq, Lk]` with one mask per (example, head, key)
broadcast over the queries, as T5X's `dot_product_attention` (`dropout_shape[-2] = 1`;
flax's `nn.dot_product_attention(broadcast_dropout=True)` instead shares one `[Lq, Lk]`
mask across the batch and heads, which is not what T5X does).

Extension points (task conditioning; when unused, the model is exactly plain T5.1.1):

* `Transformer.__call__/encode/decode` take `task_id` `[B]` and hand it to every layer
  (plain T5 ignores it).
* `Transformer.encoder_cls / decoder_cls / encoder_layer_cls / decoder_layer_cls` are
  module fields: subclass `Encoder`, `Decoder`, `EncoderLayer` or `DecoderLayer` and pass
  the subclass. `Encoder.make_layer(index)` / `Decoder.make_layer(index)` build layer
  `index` of an unrolled stack with `layer_fields()` (override that to hand shared modules
  to the layers). A scanned stack (`T5Config.scan_layers`, `ktx.models.t5_stack`) builds
  one layer module with `scan_fields()` and hands layer `i`'s slice of
  `layer_inputs(task_id)` (leaves `[L, ...]`, computed outside the scan) to the hooks as
  the keyword `layer_inputs`; unrolled hooks are called without it.
* Hook methods on the layers, called inside their compact `__call__` (so they may create
  sub-modules and parameters):
    - `layer_norm(x, task_id, *, name)`: the pre-sub-block RMS norm; `RMSNorm.__call__`
      accepts a per-example `scale` `[B, E]` that replaces the learned one (task-conditional
      layer norm).
    - `attention_prefix(x, task_id, *, name) -> None | (key, value)`: per-example prefix
      keys/values `[B, P, H, D]` prepended to the self-attention keys/values; every query
      (causal ones included) attends all `P` prefix positions, which get no relative
      position bias. Works with the decode cache (prefixes are not cached).
    - `adapt(y, task_id, *, name, deterministic)`: transforms the output of the sub-block
      `name` (`"attention"`, `"cross_attention"`, `"mlp"`) before dropout and the residual
      sum (adapters).
* `Encoder.input_prompt(x, task_id) -> None | [B, P, E]`: embeddings prepended to the
  encoder input (prompt tuning); the encoded sequence is then `[B, P + Le, E]`, prompt
  positions are visible to every query (self and cross attention). Not with packed
  inputs (ValueError).
* Attention probabilities `[B, H, Lq, P + Lk]` are sown as
  `intermediates/.../attention_weights` when the `intermediates` collection is mutable.

Decoding uses a key/value cache (collection `"cache"`): call `decode(..., decode=True)`
once with full-length `[B, Ld]` decoder inputs and `mutable=["cache"]` to create it (or
`jax.eval_shape` that call), then once per step with `[B, 1]` inputs. With
`T5Config.scan_layers` the layers' cache variables are stacked `[L, B, ...]` (the batch is
axis 1: `decoding.beam_search(cache_batch_axis=1)`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from ktx.models.t5_layers import (
    _ACTIVATIONS,
    DecoderLayer,
    DenseGeneral,
    Embed,
    EncoderLayer,
    MlpBlock,
    MultiHeadAttention,
    RelativePositionBiases,
    RMSNorm,
    _attention_mask,
    relative_position_bucket,
)
from ktx.models.t5_stack import REMAT_POLICIES, check_remat_policy, layer_class, run_stack
from ktx.partitioning import BATCH, EMBED, LENGTH, VOCAB

__all__ = [
    "ACTIVATION_DTYPES",
    "REMAT_POLICIES",
    "T5Config",
    "DenseGeneral",
    "Embed",
    "RMSNorm",
    "MlpBlock",
    "MultiHeadAttention",
    "RelativePositionBiases",
    "relative_position_bucket",
    "EncoderLayer",
    "DecoderLayer",
    "Encoder",
    "Decoder",
    "Transformer",
]

ACTIVATION_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
_PROMPT_PACKING_ERROR = (
    "input prompts (Prompt-Tuning, ConditioningConfig.method='prompt_tuning') cannot be used "
    "with packed inputs (encoder_segment_ids given): prompts prepended once per row would "
    "be shared by the row's segments, which would then attend to each other through the "
    "prompts' encoder states. Train unpacked: MultiTaskInput.pack = False (the default)."
)

Array = jax.Array
Dtype = Any


@dataclasses.dataclass(frozen=True)
class T5Config:
    """Shapes and options of a T5.1.1 Transformer (defaults: T5.1.1 small).

    `dropout_rate` defaults to 0.1, the usual fine-tuning rate (T5X's fine-tuning gin
    files); T5.1.1 was pre-trained without dropout (0.0).
    `dtype` is the activation dtype ("float32" or "bfloat16"); parameters, attention
    logits, logits and the loss are float32.
    `remat_policy` ("none" | "minimal" | "dots" | "full") and `scan_layers` choose how the layer
    stacks run (`ktx.models.t5_stack`); neither changes the numbers, `scan_layers` changes
    the parameter layout (`ktx.models.scan_layout` converts).
    `relative_attention_max_distance` must exceed `relative_attention_num_buckets // 2`,
    the number of exact buckets of the causal decoder (the bidirectional encoder has
    `num_buckets // 4` per direction): the logarithmic buckets span the distances from
    there to `max_distance`.
    """

    vocab_size: int = 32128
    emb_dim: int = 512
    num_heads: int = 6
    num_encoder_layers: int = 8
    num_decoder_layers: int = 8
    head_dim: int = 64
    mlp_dim: int = 1024
    mlp_activations: tuple[str, ...] = ("gelu", "linear")
    dropout_rate: float = 0.1
    dtype: str = "float32"
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    logits_via_embedding: bool = False
    float32_attention_logits: bool = True
    remat_policy: str = "none"
    scan_layers: bool = False

    def __post_init__(self):
        for name in (
            "vocab_size",
            "emb_dim",
            "num_heads",
            "num_encoder_layers",
            "num_decoder_layers",
            "head_dim",
            "mlp_dim",
            "relative_attention_num_buckets",
            "relative_attention_max_distance",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"T5Config.{name}={value!r}: must be a positive integer")
        if self.relative_attention_num_buckets < 4:
            raise ValueError(
                f"T5Config.relative_attention_num_buckets={self.relative_attention_num_buckets}"
                ": must be >= 4 (half exact, half logarithmic, per direction)"
            )
        exact = self.relative_attention_num_buckets // 2
        if self.relative_attention_max_distance <= exact:
            raise ValueError(
                f"T5Config.relative_attention_max_distance={self.relative_attention_max_distance}"
                f" must be > relative_attention_num_buckets // 2 = {exact} (with "
                f"relative_attention_num_buckets={self.relative_attention_num_buckets}, the "
                f"causal decoder's {exact} exact buckets cover distances 0..{exact - 1} and "
                "the logarithmic buckets start there and end at max_distance)"
            )
        acts = self.mlp_activations
        if isinstance(acts, str) or not isinstance(acts, Sequence) or not acts:
            raise ValueError(
                f"T5Config.mlp_activations={acts!r}: must be a non-empty sequence of names "
                f"from {sorted(_ACTIVATIONS)}"
            )
        for a in acts:
            if a not in _ACTIVATIONS:
                raise ValueError(
                    f"T5Config.mlp_activations: {a!r} unknown; accepted: {sorted(_ACTIVATIONS)}"
                )
        object.__setattr__(self, "mlp_activations", tuple(acts))
        if not isinstance(self.dropout_rate, (int, float)) or not 0.0 <= self.dropout_rate < 1.0:
            raise ValueError(f"T5Config.dropout_rate={self.dropout_rate!r}: must be in [0, 1)")
        check_remat_policy(self.remat_policy, "T5Config.remat_policy")
        if not isinstance(self.scan_layers, bool):
            raise ValueError(
                f"T5Config.scan_layers={self.scan_layers!r}; accepted: True or False")
        if self.dtype not in ACTIVATION_DTYPES:
            raise ValueError(
                f"T5Config.dtype={self.dtype!r}; accepted: {sorted(ACTIVATION_DTYPES)}"
            )

    @property
    def activation_dtype(self) -> Dtype:
        return ACTIVATION_DTYPES[self.dtype]


def _check_feature(name: str, value: Array | None, shape: tuple[int, ...]) -> None:
    if value is not None and tuple(value.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(value.shape)}; expected {tuple(shape)}")


# ------------------------------------------------------------------------------------
# Stacks (take the structural T5Config; see module docstring for hooks). The layers are
# in `ktx.models.t5_layers`; `ktx.models.t5_stack` runs them unrolled or scanned.
# ------------------------------------------------------------------------------------


class _LayerStack:
    """The layer stack of an `Encoder` / `Decoder` (unrolled or scanned, `t5_stack`)."""

    config: T5Config
    layer_cls: type
    _STATIC_ARGNUMS: tuple[int, ...] = ()
    _decoder = False

    def layer_fields(self) -> dict[str, Any]:
        """Extra fields of every layer module (override: shared modules)."""
        return {}

    def scan_fields(self) -> dict[str, Any]:
        """Extra fields of the scanned layer module (`T5Config.scan_layers`)."""
        return {}

    def layer_inputs(self, task_id: Array) -> Any:
        """Scanned stacks: per-layer inputs (leaves `[L, ...]`) for the hooks, or None."""
        return None

    def make_layer(self, index: int) -> nn.Module:
        cls = layer_class(self.layer_cls, self.config.remat_policy, self._STATIC_ARGNUMS,
                          scanned=False)
        return cls(config=self.config, layer_index=index, name=f"layers_{index}",
                   **self.layer_fields())

    def _stack(self, x: Array, args: tuple, task_id: Array) -> Array:
        cfg = self.config
        n = cfg.num_decoder_layers if self._decoder else cfg.num_encoder_layers
        return run_stack(
            self.make_layer, self.layer_cls, {"config": cfg, **self.scan_fields()},
            num_layers=n, scan=cfg.scan_layers, remat=cfg.remat_policy,
            static_argnums=self._STATIC_ARGNUMS, x=x, args=args,
            layer_inputs=self.layer_inputs(task_id) if cfg.scan_layers else None,
            scope_path=self.scope.path,
        )


class Encoder(_LayerStack, nn.Module):
    """Token ids `[B, Le]` -> encoded `[B, P + Le, E]` (P = 0 without an input prompt)."""

    config: T5Config
    shared_embedding: nn.Module
    layer_cls: type = EncoderLayer

    _STATIC_ARGNUMS = (5,)  # EncoderLayer.__call__'s `deterministic` (self = 0)

    def input_prompt(self, x: Array, task_id: Array) -> Array | None:
        """Embeddings `[B, P, E]` to prepend to the input embeddings `x`, or None."""
        return None

    @nn.compact
    def __call__(
        self,
        encoder_input_tokens: Array,
        task_id: Array,
        encoder_segment_ids: Array | None = None,
        *,
        deterministic: bool,
    ) -> Array:
        cfg = self.config
        dtype = cfg.activation_dtype
        valid = encoder_input_tokens > 0
        x = self.shared_embedding(encoder_input_tokens).astype(dtype)
        prompt = self.input_prompt(x, task_id)
        segments = encoder_segment_ids
        visible = None
        if prompt is not None:
            if segments is not None:
                raise ValueError(_PROMPT_PACKING_ERROR)
            b, p = prompt.shape[0], prompt.shape[1]
            if prompt.ndim != 3 or b != x.shape[0] or prompt.shape[2] != x.shape[2]:
                raise ValueError(
                    f"Encoder.input_prompt returned shape {prompt.shape}; accepted: "
                    f"[{x.shape[0]}, P, {x.shape[2]}]"
                )
            x = jnp.concatenate([jnp.asarray(prompt, dtype), x], axis=1)
            valid = jnp.concatenate([jnp.ones((b, p), bool), valid], axis=1)
            visible = jnp.concatenate([jnp.ones((b, p), bool), jnp.zeros_like(valid[:, p:])], 1)
        mask = _attention_mask(valid, valid, segments, segments, visible)
        if visible is not None:  # prompt queries see every valid key
            mask = jnp.maximum(mask, (visible[:, None, :, None] & valid[:, None, None, :]))
        length = x.shape[1]
        positions = jnp.arange(length)
        bias = RelativePositionBiases(
            cfg.relative_attention_num_buckets, cfg.relative_attention_max_distance,
            cfg.num_heads, dtype=dtype, name="relpos_bias",
        )(positions, positions, bidirectional=True)
        x = nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))(x, deterministic)
        x = nn.with_logical_constraint(x, (BATCH, LENGTH, EMBED))
        x = self._stack(x, (mask, bias, task_id, deterministic), task_id)
        x = RMSNorm(dtype=dtype, name="encoder_norm")(x)
        x = nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))(x, deterministic)
        return nn.with_logical_constraint(x, (BATCH, LENGTH, EMBED))


class Decoder(_LayerStack, nn.Module):
    """Decoder input ids `[B, Ld]` and encoded `[B, Lk, E]` -> logits `[B, Ld, V]`."""

    config: T5Config
    shared_embedding: nn.Module
    layer_cls: type = DecoderLayer

    _STATIC_ARGNUMS = (7, 8)  # DecoderLayer.__call__'s `deterministic`, `decode`
    _decoder = True

    @nn.compact
    def __call__(
        self,
        encoded: Array,
        decoder_input_tokens: Array,
        cross_mask: Array,
        task_id: Array,
        decoder_target_tokens: Array | None = None,
        decoder_segment_ids: Array | None = None,
        *,
        deterministic: bool,
        decode: bool = False,
        max_decode_length: int | None = None,
    ) -> Array:
        cfg = self.config
        dtype = cfg.activation_dtype
        batch, length = decoder_input_tokens.shape
        if decode and self.has_variable("cache", "position"):
            # One decode step: the query is at the cached position.
            if length != 1:
                raise ValueError(f"Decoder: a decode step takes [B, 1] inputs, got {(batch, length)}")
            if max_decode_length is None:
                raise ValueError("Decoder: max_decode_length is required for a decode step")
            position = self.variable("cache", "position", lambda: jnp.array(0, jnp.int32))
            pos = position.value
            query_positions = pos[None]
            key_positions = jnp.arange(max_decode_length)
            self_mask = (key_positions <= pos)[None, None, None, :].astype(jnp.float32)
            position.value = pos + 1
        else:
            if decode:  # cache-creating pass
                self.variable("cache", "position", lambda: jnp.array(0, jnp.int32))
            query_positions = key_positions = jnp.arange(length)
            if decoder_target_tokens is not None:
                valid = decoder_target_tokens > 0
            else:
                valid = jnp.ones((batch, length), bool)
            self_mask = _attention_mask(
                valid, valid, decoder_segment_ids, decoder_segment_ids, causal=True
            )
        bias = RelativePositionBiases(
            cfg.relative_attention_num_buckets, cfg.relative_attention_max_distance,
            cfg.num_heads, dtype=dtype, name="relpos_bias",
        )(query_positions, key_positions, bidirectional=False)

        x = self.shared_embedding(decoder_input_tokens).astype(dtype)
        x = nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))(x, deterministic)
        x = nn.with_logical_constraint(x, (BATCH, LENGTH, EMBED))
        x = self._stack(
            x, (encoded, self_mask, bias, cross_mask, task_id, deterministic, decode), task_id
        )
        x = RMSNorm(dtype=dtype, name="decoder_norm")(x)
        x = nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))(x, deterministic)
        # Logits in float32 whatever the activation dtype (T5X's `logits_dense` too).
        x = jnp.asarray(x, jnp.float32)
        if cfg.logits_via_embedding:
            logits = self.shared_embedding.attend(x, jnp.float32) / jnp.sqrt(
                jnp.float32(x.shape[-1]))
        else:
            logits = DenseGeneral(
                (cfg.vocab_size,), (EMBED, VOCAB), dtype=jnp.float32, split_input=True,
                name="logits_dense")(x)
        return nn.with_logical_constraint(logits, (BATCH, LENGTH, VOCAB))


class Transformer(nn.Module):
    """The T5.1.1 encoder-decoder. See the module docstring for shapes and hooks."""

    config: T5Config
    encoder_cls: type = Encoder
    decoder_cls: type = Decoder
    encoder_layer_cls: type = EncoderLayer
    decoder_layer_cls: type = DecoderLayer

    def setup(self):
        cfg = self.config
        if not isinstance(cfg, T5Config):
            raise TypeError(f"Transformer.config must be a T5Config, got {type(cfg).__name__}")
        self.token_embedder = Embed(cfg.vocab_size, cfg.emb_dim, dtype=cfg.activation_dtype)
        self.encoder = self.encoder_cls(
            config=cfg, shared_embedding=self.token_embedder, layer_cls=self.encoder_layer_cls
        )
        self.decoder = self.decoder_cls(
            config=cfg, shared_embedding=self.token_embedder, layer_cls=self.decoder_layer_cls
        )

    @staticmethod
    def _task_id(task_id: Array | None, batch: int) -> Array:
        if task_id is None:
            return jnp.zeros((batch,), jnp.int32)
        _check_feature("task_id", task_id, (batch,))
        return jnp.asarray(task_id, jnp.int32)

    def encode(
        self,
        encoder_input_tokens: Array,
        task_id: Array | None = None,
        encoder_segment_ids: Array | None = None,
        encoder_positions: Array | None = None,
        *,
        enable_dropout: bool = True,
    ) -> Array:
        """`[B, Le]` int -> encoded `[B, P + Le, E]`."""
        if encoder_input_tokens.ndim != 2:
            raise ValueError(
                f"encoder_input_tokens has shape {encoder_input_tokens.shape}; expected [B, Le]"
            )
        _check_feature("encoder_segment_ids", encoder_segment_ids, encoder_input_tokens.shape)
        _check_feature("encoder_positions", encoder_positions, encoder_input_tokens.shape)
        task_id = self._task_id(task_id, encoder_input_tokens.shape[0])
        return self.encoder(
            encoder_input_tokens, task_id, encoder_segment_ids, deterministic=not enable_dropout
        )

    def decode(
        self,
        encoded: Array,
        encoder_input_tokens: Array,
        decoder_input_tokens: Array,
        decoder_target_tokens: Array | None = None,
        task_id: Array | None = None,
        encoder_segment_ids: Array | None = None,
        decoder_segment_ids: Array | None = None,
        decoder_positions: Array | None = None,
        *,
        enable_dropout: bool = True,
        decode: bool = False,
        max_decode_length: int | None = None,
    ) -> Array:
        """Logits `[B, Ld, V]` of the decoder given `encoded` `[B, P + Le, E]`.

        `encoder_input_tokens` `[B, Le]` gives the valid encoder positions (ids > 0);
        with `decode=True` (cached, one position per call) segment ids are not used.
        """
        if decoder_input_tokens.ndim != 2:
            raise ValueError(
                f"decoder_input_tokens has shape {decoder_input_tokens.shape}; expected [B, Ld]"
            )
        batch, dec_len = decoder_input_tokens.shape
        _check_feature("decoder_target_tokens", decoder_target_tokens, (batch, dec_len))
        _check_feature("decoder_segment_ids", decoder_segment_ids, (batch, dec_len))
        _check_feature("decoder_positions", decoder_positions, (batch, dec_len))
        if (encoder_segment_ids is None) != (decoder_segment_ids is None):
            raise ValueError(
                "packed inputs need both encoder_segment_ids and decoder_segment_ids; got "
                f"encoder_segment_ids={'set' if encoder_segment_ids is not None else None}, "
                f"decoder_segment_ids={'set' if decoder_segment_ids is not None else None}"
            )
        task_id = self._task_id(task_id, batch)
        enc_valid = encoder_input_tokens > 0
        num_prompt = encoded.shape[1] - encoder_input_tokens.shape[1]
        visible = None
        if num_prompt < 0:
            raise ValueError(
                f"encoded length {encoded.shape[1]} < encoder_input_tokens length "
                f"{encoder_input_tokens.shape[1]}"
            )
        if num_prompt:
            if encoder_segment_ids is not None:
                raise ValueError(_PROMPT_PACKING_ERROR)
            ones = jnp.ones((batch, num_prompt), bool)
            visible = jnp.concatenate([ones, jnp.zeros_like(enc_valid)], axis=1)
            enc_valid = jnp.concatenate([ones, enc_valid], axis=1)
        if decode:
            cross_mask = enc_valid[:, None, None, :].astype(jnp.float32)
        else:
            dec_valid = (
                decoder_target_tokens > 0
                if decoder_target_tokens is not None
                else jnp.ones((batch, dec_len), bool)
            )
            cross_mask = _attention_mask(
                dec_valid, enc_valid, decoder_segment_ids, encoder_segment_ids, visible
            )
        return self.decoder(
            encoded, decoder_input_tokens, cross_mask, task_id, decoder_target_tokens,
            decoder_segment_ids, deterministic=not enable_dropout, decode=decode,
            max_decode_length=max_decode_length,
        )

    def __call__(
        self,
        encoder_input_tokens: Array,
        decoder_input_tokens: Array,
        decoder_target_tokens: Array | None = None,
        task_id: Array | None = None,
        encoder_segment_ids: Array | None = None,
        decoder_segment_ids: Array | None = None,
        encoder_positions: Array | None = None,
        decoder_positions: Array | None = None,
        *,
        enable_dropout: bool = True,
        decode: bool = False,
        max_decode_length: int | None = None,
    ) -> Array:
        """Teacher-forced logits `[B, Ld, V]` (float32 whatever the activation dtype)."""
        encoded = self.encode(
            encoder_input_tokens, task_id, encoder_segment_ids, encoder_positions,
            enable_dropout=enable_dropout,
        )
        return self.decode(
            encoded, encoder_input_tokens, decoder_input_tokens, decoder_target_tokens,
            task_id, encoder_segment_ids, decoder_segment_ids, decoder_positions,
            enable_dropout=enable_dropout, decode=decode, max_decode_length=max_decode_length,
        )
