"""`EncoderMlmModel`: masked language modelling on a BERT encoder, per task, with the
disease knowledge infusion term (He et al., EMNLP 2020, "Infusing Disease Knowledge into
BERT for Health Question Answering, Medical Inference and Disease Name Recognition").

Features: `input_ids`, `token_type_ids` (default 0), `attention_mask` (default
`input_ids > 0`), `mlm_targets` `[B, L]` int32 (the vocabulary id to predict at a masked
position, anything elsewhere), `mlm_weights` `[B, L]` float32 (1 at a position to predict,
0 elsewhere), `task_id` `[B]`. The logits are BERT's MLM head on the last hidden states
(`bert.BertEncoder.mlm_logits`: dense -> activation -> LayerNorm -> the transposed word
embeddings + a bias `[V]`, float32), as transformers' `BertForMaskedLM`.

Loss of task `t` (sums over its rows `b` and positions `l`):

    mlm_t      = Σ_{b: task(b)=t} Σ_l w_bl · −log softmax(z_bl)[y_bl]
    infusion_t = Σ_{b: task(b)=t} Σ_l w_bl · β / S_b,     S_b = Σ_l w_bl · z_bl[y_bl]

`z_bl` the raw logits, `y_bl` the target, `w_bl` the weight; `task_weights` are the
masked-position counts, so with `loss_normalization="global"` the objective is the mean
token cross-entropy of transformers' MLM loss plus, averaged over positions, each row's
`β / S_b`: the paper's term that raises the raw logits of the masked disease and aspect
tokens (section 3.3: with a 30k-way softmax the probabilities alone are tiny), β = 10 in
the paper. It is `ktx.models.seq2seq.infusion_term`, the term the T5 side uses, with
`positive_only`: a row with `S_b <= 0` adds nothing. A pretrained MLM head gives the
targets positive logits, where this is the paper's term; a fresh head (all-MiniLM-L6-v2
ships none) starts with sums near 0 of either sign, where `β / S_b` has its pole and, below
it, would reward driving `S_b` towards 0 from below without bound (a 4-step run from a
random tiny BERT reached a loss of −88 that way); there the cross-entropy alone raises the
target logits until `S_b > 0`. The authors' script computes it once per
batch, `10 · B / (1 + Σ_b Σ_{disease positions} z)`, over the disease positions only;
that batch-level form couples the rows of a batch, which the per-task gradients
(`ktx.optim`) cannot decompose, so ktx keeps the per-row form of the paper (docs/encoders.md,
"Disease knowledge infusion").

Aux `[T]` sums: `loss` (the MLM part), `infusion` (β/S_b spread over the row's positions),
`accuracy` (masked positions whose argmax is the target), `weight` (masked positions).
Dropout is drawn per example (`ktx.models.base.dropout_keyed_by_row`), so task blocks and microbatches
reproduce the whole batch's masks. Parameters: `bert.BertEncoder` with its pooler (kept
so that a fine-tuning run started from this checkpoint finds a pretrained pooler; it gets
no gradient here) and `mlm/...`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from ktx.models import bert
from ktx.models.base import (
    LOSS_NORMALIZATIONS,
    Batch,
    BaseModel,
    dropout_keyed_by_row,
    row_ids,
    segment_sum_by_task,
)
from ktx.models.seq2seq import first_argmax, infusion_term

__all__ = ["EncoderMlmModel", "MLM_FEATURES"]

_INPUTS = ("input_ids", "token_type_ids", "attention_mask")
MLM_FEATURES = (*_INPUTS, "mlm_targets", "mlm_weights")
_REQUIRED = ("input_ids", "mlm_targets", "mlm_weights", "task_id")


class EncoderMlmModel(BaseModel):
    """BERT with its MLM head, one loss per task (see the module docstring).

    Args:
      config: the encoder's `bert.BertConfig`.
      num_tasks: the number of tasks `T` (rows carry `task_id` in [0, T)).
      infusion_beta: β of the knowledge-infusion term (He et al., 2020: 10); 0 = plain MLM.
      loss_normalization: "global" (mean over the batch's masked positions) or "per_task".
    """

    def __init__(self, config: bert.BertConfig | None = None, *, num_tasks: int = 1,
                 infusion_beta: float = 0.0, loss_normalization: str = "global"):
        config = bert.BertConfig() if config is None else config
        if not isinstance(config, bert.BertConfig):
            raise TypeError(
                f"EncoderMlmModel.config must be a bert.BertConfig, got {type(config).__name__}")
        if isinstance(num_tasks, bool) or not isinstance(num_tasks, int) or num_tasks < 1:
            raise ValueError(f"EncoderMlmModel.num_tasks={num_tasks!r}: an int >= 1 is required")
        if isinstance(infusion_beta, bool) or not isinstance(infusion_beta, (int, float)) \
                or not infusion_beta >= 0.0:
            raise ValueError(
                f"EncoderMlmModel.infusion_beta={infusion_beta!r}: a float >= 0 (0 = off; "
                "He et al., 2020 use 10)")
        if loss_normalization not in LOSS_NORMALIZATIONS:
            raise ValueError(
                f"EncoderMlmModel.loss_normalization={loss_normalization!r}; accepted: "
                f"{LOSS_NORMALIZATIONS}")
        self.config = config
        self.num_tasks = num_tasks
        self.infusion_beta = float(infusion_beta)
        self.loss_normalization = loss_normalization
        self.module = bert.BertEncoder(config=config)

    def __repr__(self) -> str:
        return (f"EncoderMlmModel(config={self.config}, num_tasks={self.num_tasks}, "
                f"infusion_beta={self.infusion_beta}, "
                f"loss_normalization={self.loss_normalization!r})")

    @staticmethod
    def _check_batch(batch: Batch, required: tuple[str, ...] = _REQUIRED) -> None:
        missing = [k for k in required if k not in batch]
        if missing:
            raise ValueError(
                f"batch is missing features {missing}; it has {sorted(batch)}; a masked-LM "
                f"batch needs {list(_REQUIRED)} (+ optional token_type_ids, attention_mask)")

    def input_spec(self, batch_size: int, feature_lengths: Mapping[str, int]
                   ) -> dict[str, jax.ShapeDtypeStruct]:
        """Features of a batch; the sequence length is `feature_lengths["inputs"]`."""
        value = feature_lengths.get("inputs") if isinstance(feature_lengths, Mapping) else None
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"feature_lengths['inputs']={value!r} (in {feature_lengths!r}): a "
                             "positive int is required")
        if value > self.config.max_position:
            raise ValueError(f"feature_lengths['inputs']={value} exceeds BertConfig.max_position="
                             f"{self.config.max_position}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r}: must be a positive integer")
        shape, i32 = (batch_size, value), jnp.int32
        return {**{k: jax.ShapeDtypeStruct(shape, i32) for k in (*_INPUTS, "mlm_targets")},
                "mlm_weights": jax.ShapeDtypeStruct(shape, jnp.float32),
                "task_id": jax.ShapeDtypeStruct((batch_size,), i32)}

    def init_variables(self, rng: jax.Array, batch: Batch) -> Any:
        """Variables (`{"params": ...}`, boxed with logical axes): encoder, pooler, MLM head."""
        ids = jnp.zeros(batch["input_ids"].shape, jnp.int32)
        return self.module.init(rng, ids, ids, jnp.ones_like(ids), deterministic=True, mlm=True)

    def logits(self, params: Any, batch: Batch, rng: jax.Array | None = None,
               train: bool = False) -> jax.Array:
        """Float32 MLM logits `[B, L, V]`; with `train` and dropout, masks keyed per row."""
        self._check_batch(batch, ("input_ids",))
        features = {k: jnp.asarray(batch[k], jnp.int32) for k in _INPUTS if k in batch}
        c = self.config
        if not (train and (c.dropout_rate > 0 or c.attention_dropout_rate > 0)):
            return self.module.apply({"params": params}, **features, deterministic=True,
                                     mlm=True, pool=False).mlm_logits
        if rng is None:
            raise ValueError("train=True with dropout needs an rng")

        with dropout_keyed_by_row(row_ids(batch)):  # row i's masks: (rng, row id) only
            return self.module.apply({"params": params}, **features, deterministic=False,
                                     mlm=True, pool=False, rngs={"dropout": rng}).mlm_logits

    def task_weights(self, batch: Batch) -> jax.Array:
        """`[T]` masked positions of each task."""
        self._check_batch(batch)
        return segment_sum_by_task(jnp.asarray(batch["mlm_weights"], jnp.float32),
                                   batch["task_id"], self.num_tasks)

    def loss_sums(self, params: Any, batch: Batch, rng: jax.Array | None, train: bool
                  ) -> tuple[jax.Array, dict[str, jax.Array]]:
        self._check_batch(batch)
        return self.loss_sums_from_logits(self.logits(params, batch, rng, train), batch)

    def loss_sums_from_logits(self, logits: jax.Array, batch: Batch
                              ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """`loss_sums` given the MLM logits `[B, L, V]` of `batch`."""
        self._check_batch(batch)
        targets = jnp.clip(jnp.asarray(batch["mlm_targets"], jnp.int32), 0, logits.shape[-1] - 1)
        weights = jnp.asarray(batch["mlm_weights"], jnp.float32)
        task_id = jnp.asarray(batch["task_id"], jnp.int32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        ce = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0] * weights
        hit = (first_argmax(logits) == targets).astype(jnp.float32) * weights

        def by_task(x):
            return segment_sum_by_task(x, task_id, self.num_tasks)

        mlm = by_task(ce)
        aux = {"loss": mlm, "accuracy": by_task(hit), "weight": by_task(weights)}
        sums = mlm
        if self.infusion_beta != 0.0:
            inf = by_task(infusion_term(logits, targets, weights, self.infusion_beta,
                                        positive_only=True))
            aux["infusion"] = inf
            sums = mlm + inf
        return sums, aux
