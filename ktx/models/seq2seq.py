"""`EncoderDecoderModel`: a T5.1.1 Transformer with its per-task loss and decoding.

Loss per target token (weight `decoder_loss_weights > 0`), as T5X's
`compute_weighted_cross_entropy`:

    ce      = -sum_v q_v log softmax(logits)_v - c     (q: one-hot target smoothed by
              `label_smoothing`, c: the entropy of q, so a perfect model scores 0)
    z_loss  = z_loss * logsumexp(logits)^2             (T5X's auxiliary z-loss, which
              keeps the softmax normaliser near 1)

Optional knowledge-infusion term (He et al., 2020, "Infusing Disease Knowledge into
BERT for Health Question Answering, Medical Inference and Disease Name Recognition"):
`infusion_beta / S_b`, with `S_b` the sum over example `b`'s target tokens (weight > 0) of
the raw logit of the target token (the paper uses beta = 10). It is added to every target
token of the example (weighted like the cross-entropy), so that after normalisation by
the token count it is the token-weighted mean of the per-example terms. Examples without
target tokens, or with `S_b == 0`, get no term. 0 turns it off.

Per-task sums use the per-row `task_id` (`ktx.models.base.segment_sum_by_task`); aux
sums: `loss` (total), `cross_entropy`, `z_loss`, `accuracy` (correct target tokens),
`weight` (target tokens), plus `infusion` when `infusion_beta != 0`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from ktx.models import decoding
from ktx.models import t5
from ktx.models.base import (
    LOSS_NORMALIZATIONS,
    Batch,
    BaseModel,
    dropout_keyed_by_row,
    row_ids,
    segment_sum_by_task,
)

__all__ = ["EncoderDecoderModel", "weighted_cross_entropy", "infusion_term", "DECODE_METHODS"]

DECODE_METHODS = ("greedy", "beam", "sample")
_REQUIRED = ("encoder_input_tokens", "decoder_input_tokens", "decoder_target_tokens",
             "decoder_loss_weights", "task_id")
_PACKING = ("encoder_segment_ids", "encoder_positions", "decoder_segment_ids", "decoder_positions")


def weighted_cross_entropy(
    logits: jax.Array,
    targets: jax.Array,
    weights: jax.Array,
    *,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
) -> tuple[jax.Array, jax.Array]:
    """Per-token weighted cross-entropy and z-loss (T5X's formulation).

    Args:
      logits: `[B, L, V]` (any float dtype; computed in float32).
      targets: int `[B, L]`.
      weights: `[B, L]` loss weights (0 = padding).
    Returns:
      `(cross_entropy [B, L], z_loss [B, L])`, both already multiplied by `weights`;
      the total per-token loss is their sum.

    The gradient with respect to the logits is written in one pass,
    `(softmax - q) * g_ce + 2 z_loss log_z softmax * g_z` (a `jax.custom_vjp`): autodiff
    of the forward formula scattered the target's cotangent into a zero `[B, L, V]` array
    and reduced it again, three more passes over the logits, the largest activation of a
    T5 step. Forward-mode differentiation (`jax.jvp`) of it is not supported.
    """
    logits = jnp.asarray(logits, jnp.float32)
    weights = jnp.asarray(weights, jnp.float32)
    # On rows, `[B L, V]`: the logits' cotangent is then made in the shape the logits
    # layer's two backward products take it (`ktx.linear.contract`). Made `[B, L, V]`,
    # per-task blocks (the products vmapped over tasks: one batched `[T, B L, V]`, one
    # over `[T B L, V]`) had XLA:CPU compute it once per shape, its `exp` materialised
    # between them: T5-tiny's balanced step accessed 450 MB, 384 this way (plain: 318).
    ce, z = _cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           weights.reshape(-1), float(label_smoothing), float(z_loss))
    return ce.reshape(targets.shape), z.reshape(targets.shape)


def first_argmax(x: jax.Array) -> jax.Array:
    """`jnp.argmax(x, axis=-1)` for finite `x`: the first index of the row's maximum.

    Computed as the smallest of `index + V * sign(max - x)` (`index` where `x` is the
    maximum, above `V` elsewhere): the maximum is the one the loss's `logsumexp` takes, and
    the rest is one more vectorised float reduction. XLA:CPU runs `argmax`'s (value, index)
    reduction element by element; over T5-tiny's `[8, 32, 32128]` logits it took 20.7 ms
    against 7.6 for this, the loss's own `logsumexp` 3.0. A row whose maximum is infinite,
    or that holds a NaN, gives an undefined index (`argmax` gives the first of them).
    """
    x = jnp.asarray(x, jnp.float32)
    vocab = x.shape[-1]
    top = jnp.max(x, axis=-1, keepdims=True)
    if 2 * vocab > 2 ** 24:  # float32 indices exact below 2^24
        index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
        return jnp.min(jnp.where(x == top, index, vocab), axis=-1)
    index = jax.lax.broadcasted_iota(jnp.float32, x.shape, x.ndim - 1)
    return jnp.min(index + vocab * jnp.sign(top - x), axis=-1).astype(jnp.int32)


def _smoothing(vocab: int, label_smoothing: float) -> tuple[float, float, float]:
    """`(confidence, low_confidence, normalizing_constant)` of the smoothed target `q`."""
    confidence = 1.0 - label_smoothing
    low_confidence = (1.0 - confidence) / (vocab - 1)
    normalizing_constant = -(
        confidence * math.log(confidence)
        + (vocab - 1) * low_confidence * math.log(low_confidence + 1e-20)
    ) if label_smoothing > 0 else 0.0
    return confidence, low_confidence, normalizing_constant


def _cross_entropy_fwd(logits, targets, weights, label_smoothing, z_loss):
    vocab = logits.shape[-1]
    confidence, low_confidence, normalizing_constant = _smoothing(vocab, label_smoothing)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logits = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    target_log_probs = target_logits - log_z
    if label_smoothing > 0:
        # sum_v q_v log p_v with q = low everywhere, confidence at the target.
        sum_log_probs = logits.sum(axis=-1) - vocab * log_z
        ce = -(
            low_confidence * (sum_log_probs - target_log_probs)
            + confidence * target_log_probs
        ) - normalizing_constant
    else:
        ce = -target_log_probs
    z = z_loss * jnp.square(log_z)
    return (ce * weights, z * weights), (logits, targets, weights, log_z, ce, z)


def _cross_entropy_bwd(label_smoothing, z_loss, residuals, cotangents):
    logits, targets, weights, log_z, ce, z = residuals
    g_ce, g_z = cotangents
    confidence, low_confidence, _ = _smoothing(logits.shape[-1], label_smoothing)
    # d ce / d logits = softmax - q (q sums to 1); d z / d logits = 2 z_loss log_z softmax.
    at_target = targets[..., None] == jax.lax.broadcasted_iota(targets.dtype, logits.shape,
                                                               logits.ndim - 1)
    q = jnp.where(at_target, confidence, low_confidence) if label_smoothing > 0 \
        else at_target.astype(logits.dtype)
    g_ce_w = g_ce * weights
    p_coef = g_ce_w + g_z * weights * (2.0 * z_loss) * log_z
    probs = jnp.exp(logits - log_z[..., None])
    d_logits = probs * p_coef[..., None] - q * g_ce_w[..., None]
    d_weights = g_ce * ce + g_z * z
    return d_logits, None, d_weights


_cross_entropy = jax.custom_vjp(lambda logits, targets, weights, label_smoothing, z_loss:
                                _cross_entropy_fwd(logits, targets, weights, label_smoothing,
                                                   z_loss)[0], nondiff_argnums=(3, 4))
_cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


def infusion_term(
    logits: jax.Array, targets: jax.Array, weights: jax.Array, beta: float, *,
    positive_only: bool = False,
) -> jax.Array:
    """Per-token knowledge-infusion loss `[B, L]` (He et al., 2020), weighted.

    `beta / S_b` on every weighted token of example `b`, `S_b` = sum over target tokens
    with weight > 0 of the raw logit of the target token; 0 where `S_b == 0`
    (`positive_only`: 0 where `S_b <= 0`, the side of the pole where the term would
    reward pushing `S_b` towards 0 from below without bound).
    """
    logits = jnp.asarray(logits, jnp.float32)
    target_logits = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    mask = (jnp.asarray(weights) > 0).astype(jnp.float32)
    total = (target_logits * mask).sum(axis=-1)  # [B]
    off = total <= 0 if positive_only else total == 0
    safe = jnp.where(off, 1.0, total)
    per_example = jnp.where(off, 0.0, beta / safe)
    return per_example[:, None] * jnp.asarray(weights, jnp.float32)


class EncoderDecoderModel(BaseModel):
    """T5.1.1 encoder-decoder with per-task losses, greedy/beam decoding and scoring.

    Args:
      config: the Transformer's shapes (`t5.T5Config`); with `module`, it must be
        None or equal to `module.config`.
      module: a `t5.Transformer` (or subclass, e.g. task-conditioned); default
        `t5.Transformer(config)`.
      num_tasks: number of tasks `T` in the mixture (rows carry `task_id` in [0, T)).
      loss_normalization: "global" (mean over all target tokens) or "per_task".
      z_loss: T5X z-loss coefficient (T5X default 1e-4).
      label_smoothing: in [0, 1).
      infusion_beta: knowledge-infusion coefficient (He et al., 2020: 10); 0 = off.
      eos_id, decoder_start_id: vocabulary ids (T5: 1 and 0).
    """

    def __init__(
        self,
        config: t5.T5Config | None = None,
        *,
        module: nn.Module | None = None,
        num_tasks: int = 1,
        loss_normalization: str = "global",
        z_loss: float = 1e-4,
        label_smoothing: float = 0.0,
        infusion_beta: float = 0.0,
        eos_id: int = 1,
        decoder_start_id: int = 0,
    ):
        if module is None:
            if config is None:
                config = t5.T5Config()
            if not isinstance(config, t5.T5Config):
                raise TypeError(
                    f"EncoderDecoderModel.config must be a t5.T5Config, got {type(config).__name__}"
                )
            module = t5.Transformer(config)
        elif not isinstance(module, t5.Transformer):
            raise TypeError(
                f"EncoderDecoderModel.module must be a t5.Transformer (or subclass), got "
                f"{type(module).__name__}"
            )
        elif config is not None and config != module.config:
            raise ValueError(
                f"EncoderDecoderModel: config={config} differs from module.config="
                f"{module.config}; give one of them (or the same config to both)"
            )
        if isinstance(num_tasks, bool) or not isinstance(num_tasks, int) or num_tasks < 1:
            raise ValueError(f"EncoderDecoderModel.num_tasks={num_tasks!r}: must be an int >= 1")
        if loss_normalization not in LOSS_NORMALIZATIONS:
            raise ValueError(
                f"EncoderDecoderModel.loss_normalization={loss_normalization!r}; accepted: "
                f"{LOSS_NORMALIZATIONS}"
            )
        if not isinstance(z_loss, (int, float)) or z_loss < 0:
            raise ValueError(f"EncoderDecoderModel.z_loss={z_loss!r}: must be a float >= 0")
        if not isinstance(label_smoothing, (int, float)) or not 0.0 <= label_smoothing < 1.0:
            raise ValueError(
                f"EncoderDecoderModel.label_smoothing={label_smoothing!r}: must be in [0, 1)"
            )
        if not isinstance(infusion_beta, (int, float)):
            raise ValueError(
                f"EncoderDecoderModel.infusion_beta={infusion_beta!r}: must be a float (0 = off)"
            )
        self.module = module
        self.config: t5.T5Config = module.config
        self.num_tasks = num_tasks
        self.loss_normalization = loss_normalization
        self.z_loss = float(z_loss)
        self.label_smoothing = float(label_smoothing)
        self.infusion_beta = float(infusion_beta)
        self.eos_id = int(eos_id)
        self.decoder_start_id = int(decoder_start_id)

    @property
    def sparse_table_patterns(self) -> tuple[str, ...]:
        """Tables whose per-task gradients the balanced path keeps as looked-up rows
        (`ktx.optim.sparse`; the Trainer's default `sparse_tables`): the token embedding,
        unless the logits are tied to it (`logits_via_embedding`, a dense gradient)."""
        return () if self.config.logits_via_embedding else (r"^token_embedder/embedding$",)

    def __repr__(self) -> str:
        return (
            f"EncoderDecoderModel(module={type(self.module).__name__}, config={self.config}, "
            f"num_tasks={self.num_tasks}, loss_normalization={self.loss_normalization!r}, "
            f"z_loss={self.z_loss}, label_smoothing={self.label_smoothing}, "
            f"infusion_beta={self.infusion_beta})"
        )

    # ---------------------------------------------------------------- inputs

    @staticmethod
    def _check_batch(batch: Batch, required: tuple[str, ...] = _REQUIRED) -> None:
        missing = [k for k in required if k not in batch]
        if missing:
            raise ValueError(
                f"batch is missing features {missing}; it has {sorted(batch)}; a seq2seq "
                f"batch needs {list(_REQUIRED)} (+ {list(_PACKING)} when packed)"
            )
        packed = [k for k in _PACKING if k in batch]
        if packed and len(packed) != len(_PACKING):
            raise ValueError(
                f"batch has packing features {packed} but not "
                f"{[k for k in _PACKING if k not in batch]}; give all four or none"
            )

    def input_spec(
        self, batch_size: int, feature_lengths: Mapping[str, int], packed: bool = False
    ) -> dict[str, jax.ShapeDtypeStruct]:
        """Features of a batch; `feature_lengths` uses T5X's keys `inputs` and `targets`."""
        for key in ("inputs", "targets"):
            value = feature_lengths.get(key) if isinstance(feature_lengths, Mapping) else None
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"feature_lengths[{key!r}]={value!r} (in {feature_lengths!r}): a positive "
                    "int is required for 'inputs' and 'targets'"
                )
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r}: must be a positive integer")
        le, ld = feature_lengths["inputs"], feature_lengths["targets"]
        i32 = jnp.int32
        spec = {
            "encoder_input_tokens": jax.ShapeDtypeStruct((batch_size, le), i32),
            "decoder_input_tokens": jax.ShapeDtypeStruct((batch_size, ld), i32),
            "decoder_target_tokens": jax.ShapeDtypeStruct((batch_size, ld), i32),
            "decoder_loss_weights": jax.ShapeDtypeStruct((batch_size, ld), jnp.float32),
            "task_id": jax.ShapeDtypeStruct((batch_size,), i32),
        }
        if packed:
            for prefix, length in (("encoder", le), ("decoder", ld)):
                spec[f"{prefix}_segment_ids"] = jax.ShapeDtypeStruct((batch_size, length), i32)
                spec[f"{prefix}_positions"] = jax.ShapeDtypeStruct((batch_size, length), i32)
        return spec

    def init_variables(self, rng: jax.Array, batch: Batch) -> Any:
        """Variables (`{"params": ...}`, leaves boxed as `nn.Partitioned` with logical axes;
        `nn.unbox` gives plain arrays) for the shapes of `batch` (arrays or
        `ShapeDtypeStruct`s, e.g. `input_spec(...)`)."""
        self._check_batch({**batch, "decoder_loss_weights": None, "task_id": None})
        names = ("encoder_input_tokens", "decoder_input_tokens", "decoder_target_tokens",
                 "task_id") + _PACKING
        inputs = {k: jnp.zeros(batch[k].shape, batch[k].dtype) for k in names if k in batch}
        return self.module.init(rng, **inputs, enable_dropout=False)

    # ---------------------------------------------------------------- loss

    def logits(
        self, params: Any, batch: Batch, rng: jax.Array | None = None, train: bool = False,
        mutable: Any = False,
    ) -> Any:
        """Teacher-forced logits `[B, Ld, V]` (plus mutated collections if `mutable`)."""
        self._check_batch(batch)
        dropout = train and self.config.dropout_rate > 0
        if dropout and rng is None:
            raise ValueError(
                f"train=True with dropout_rate={self.config.dropout_rate} needs an rng"
            )
        features = {k: batch[k] for k in _REQUIRED[:4] if k != "decoder_loss_weights"}
        features["task_id"] = batch["task_id"]
        for k in _PACKING:
            if k in batch:
                features[k] = batch[k]
        if not dropout:
            return self.module.apply(
                {"params": params}, **features, enable_dropout=False, mutable=mutable)
        if mutable:
            raise ValueError("logits(mutable=...) needs train=False (or dropout_rate=0)")

        # Dropout keyed per example (`ktx.models.base.dropout_keyed_by_row`): row i's masks
        # depend on (rng, row id) only, so task blocks and microbatches draw the whole
        # batch's masks; the batch still runs through the module at once.
        with dropout_keyed_by_row(row_ids(batch)):
            return self.module.apply(
                {"params": params}, **features, enable_dropout=True, rngs={"dropout": rng})

    def task_weights(self, batch: Batch) -> jax.Array:
        """`[T]` number of (weighted) target tokens of each task."""
        self._check_batch(batch)
        return segment_sum_by_task(
            jnp.asarray(batch["decoder_loss_weights"], jnp.float32), batch["task_id"], self.num_tasks
        )

    def loss_sums(
        self, params: Any, batch: Batch, rng: jax.Array | None, train: bool
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        logits = self.logits(params, batch, rng, train)
        targets = batch["decoder_target_tokens"]
        weights = jnp.asarray(batch["decoder_loss_weights"], jnp.float32)
        ce, z = weighted_cross_entropy(
            logits, targets, weights, label_smoothing=self.label_smoothing, z_loss=self.z_loss
        )
        total = ce + z
        task_id = batch["task_id"]

        def by_task(x):
            return segment_sum_by_task(x, task_id, self.num_tasks)

        aux = {"cross_entropy": by_task(ce), "z_loss": by_task(z)}
        if self.infusion_beta != 0.0:
            inf = infusion_term(logits, targets, weights, self.infusion_beta)
            total = total + inf
            aux["infusion"] = by_task(inf)
        correct = (first_argmax(logits) == targets).astype(jnp.float32) * weights
        sums = by_task(total)
        aux.update(loss=sums, accuracy=by_task(correct), weight=by_task(weights))
        return sums, aux

    def score_batch(self, params: Any, batch: Batch) -> jax.Array:
        """`[B]` log-likelihood of each row's targets (sum over weighted tokens, no
        dropout, no z-loss or smoothing)."""
        logits = jnp.asarray(self.logits(params, batch, None, False), jnp.float32)
        log_probs = jax.nn.log_softmax(logits, axis=-1)
        token = jnp.take_along_axis(log_probs, batch["decoder_target_tokens"][..., None], -1)[..., 0]
        return (token * jnp.asarray(batch["decoder_loss_weights"], jnp.float32)).sum(axis=-1)

    # ---------------------------------------------------------------- decoding

    def predict_batch(
        self,
        params: Any,
        batch: Batch,
        *,
        decode_method: str = "greedy",
        num_beams: int = 4,
        alpha: float = 0.6,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float = 1.0,
        seed: int = 0,
        max_decode_length: int | None = None,
        return_scores: bool = False,
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        """Decodes `[B, Ld]` token ids (no start token; EOS and after replaced by 0).

        Uses `encoder_input_tokens` and `task_id` (default 0) of `batch`; `Ld` is
        `max_decode_length`, else the length of `decoder_input_tokens` or
        `decoder_target_tokens`. With `return_scores`, also `[B]` scores (greedy: sum of
        log-probs; beam: length-penalised, see `ktx.models.decoding.beam_search`).
        `decode_method="sample"`: `temperature`, `top_k`, `top_p` and `seed`
        (`ktx.models.decoding.temperature_sample`; row `i` draws with the key of
        `batch["decode_row"][i]`, default its position in the batch).
        Jit-able (all keyword arguments are static).
        """
        sequences, scores = self.decode_batch(
            params, batch, decode_method=decode_method, num_beams=num_beams, alpha=alpha,
            temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
            max_decode_length=max_decode_length,
        )
        tokens = sequences[:, 0]
        after_eos = jnp.cumsum(tokens == self.eos_id, axis=-1) > 0
        tokens = jnp.where(after_eos, 0, tokens)
        return (tokens, scores[:, 0]) if return_scores else tokens

    def decode_batch(
        self,
        params: Any,
        batch: Batch,
        *,
        decode_method: str = "greedy",
        num_beams: int = 4,
        alpha: float = 0.6,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float = 1.0,
        seed: int = 0,
        max_decode_length: int | None = None,
    ) -> tuple[jax.Array, jax.Array]:
        """Raw decoder output: `(sequences [B, K, Ld], scores [B, K])`, best first, EOS
        kept (0 after it); `K = 1` for greedy and sampling, `num_beams` for beam search."""
        if decode_method not in DECODE_METHODS:
            raise ValueError(f"decode_method={decode_method!r}; accepted: {DECODE_METHODS}")
        if decode_method == "sample":
            decoding.check_sampling(temperature, top_k, top_p)
        if "encoder_input_tokens" not in batch:
            raise ValueError(f"batch needs 'encoder_input_tokens'; it has {sorted(batch)}")
        if max_decode_length is None:
            for key in ("decoder_input_tokens", "decoder_target_tokens"):
                if key in batch:
                    max_decode_length = int(batch[key].shape[1])
                    break
            else:
                raise ValueError(
                    "predict_batch: give max_decode_length or a batch with "
                    "decoder_input_tokens / decoder_target_tokens"
                )
        enc_tokens = jnp.asarray(batch["encoder_input_tokens"], jnp.int32)
        bsz = enc_tokens.shape[0]
        task_id = jnp.asarray(batch.get("task_id", jnp.zeros((bsz,), jnp.int32)), jnp.int32)
        variables = {"params": params}
        encoded = self.module.apply(
            variables, enc_tokens, task_id, enable_dropout=False, method=t5.Transformer.encode
        )
        repeats = num_beams if decode_method == "beam" else 1
        enc_tokens_r, encoded_r, task_id_r = (
            jnp.repeat(x, repeats, axis=0) for x in (enc_tokens, encoded, task_id)
        )

        def decode_step(ids, cache, enc_tok, enc, tid):
            logits, new_vars = self.module.apply(
                {**variables, "cache": cache} if cache is not None else variables,
                enc, enc_tok, ids, None, tid, enable_dropout=False, decode=True,
                max_decode_length=max_decode_length, mutable=["cache"],
                method=t5.Transformer.decode,
            )
            return logits, new_vars["cache"]

        # Cache shapes from the cache-creating full-length pass, traced only.
        dummy = jnp.zeros((bsz, max_decode_length), jnp.int32)
        cache_shapes = jax.eval_shape(
            lambda: decode_step(dummy, None, enc_tokens, encoded, task_id)[1]
        )
        cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), cache_shapes)

        def tokens_to_logits(ids, cache):
            logits, cache = decode_step(ids, cache, enc_tokens_r, encoded_r, task_id_r)
            return logits[:, -1, :], cache

        if decode_method == "greedy":
            tokens, scores = decoding.greedy_decode(
                tokens_to_logits, cache, bsz, max_decode_length,
                eos_id=self.eos_id, decoder_start_id=self.decoder_start_id,
            )
            return tokens[:, None], scores[:, None]
        if decode_method == "sample":
            tokens, scores = decoding.temperature_sample(
                tokens_to_logits, cache, bsz, max_decode_length, rng=jax.random.key(seed),
                row_ids=batch.get("decode_row"), temperature=temperature, top_k=top_k,
                top_p=top_p, eos_id=self.eos_id, decoder_start_id=self.decoder_start_id,
            )
            return tokens[:, None], scores[:, None]
        return decoding.beam_search(
            tokens_to_logits, cache, bsz, max_decode_length, num_beams=num_beams,
            alpha=alpha, eos_id=self.eos_id, decoder_start_id=self.decoder_start_id,
            cache_batch_axis=1 if self.config.scan_layers else 0,
        )
