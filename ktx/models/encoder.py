"""`EncoderClassifierModel`: a BERT encoder with one classification / regression head per
task, and its per-task loss (`ktx.models.base.BaseModel`).

Head of task `t` (`BertClassifier`, parameters `task_heads/task_<t>/{kernel [E, n_t],
bias [n_t]}`): `logits = dense_t(dropout(pooled))`, `pooled = tanh(pooler(h[:, 0]))` the
[CLS] pooled output (transformers' `BertForSequenceClassification`). Loss of row `b` of
task `t = task_id[b]`:

    n_t >= 2 (classification):  -log softmax(logits_t)[label_b]   (label cast to int)
    n_t == 1 (regression):      (logits_t[0] - label_b)^2          (label float32)

Features: `input_ids`, `token_type_ids` (default 0), `attention_mask` (default
`input_ids > 0`), `label` `[B]` float32, `task_id` `[B]`. A row's weight is 1 when it has
at least one attended token, 0 for an all-padding row (eval padding); `task_weights` are
the per-task row counts. Aux `[T]` sums: `loss`, `accuracy` (correct rows of
classification tasks; 0 for regression), `squared_error` (regression tasks; 0 for
classification), `weight`.

Token tagging (`head_kinds[t] == "tagging"`, transformers' `BertForTokenClassification`):
task `t`'s head is `dense_t(dropout(h))` on every token's final hidden state, logits
`[B, L, n_t]`, and the batch has `token_labels` `[B, L]` int (`IGNORE_LABEL` = -100 on
positions without a label: later word pieces, [CLS], [SEP], padding; see
`ktx.data.encoder_features.convert_tagging`). With `M_b` the labelled (and attended)
positions of row `b`, the row's loss is the mean token cross-entropy over them,

    loss_b = 1/|M_b| Σ_{j in M_b} -log softmax(logits_t[b, j])[token_labels[b, j]],

and, as for every head, the task's loss is the sum over its rows (normalised by rows:
`loss_normalization`), so a sentence weighs as much as any other row of the mixture,
whatever its length (transformers instead averages over the batch's labelled tokens). A
tagging row with no labelled token has weight 0. Aux: `accuracy` is the row's share of
correct labelled tokens; `token_correct` and `tokens` (`[T]` sums of correct and of
labelled tokens; only when a head tags) give the token accuracy `token_correct / tokens`.

Cosine head (`head_kinds[t] == "cosine"`, a regression task of pairs; the SlapBERT
study's STS head, sentence-transformers' `CosineSimilarityLoss` up to the scale): the two
texts are encoded alone, `u` = the pooled output of `input_ids` (`[CLS] a [SEP]`), `v` =
that of `input_ids_b` (`[CLS] b [SEP]`, with `attention_mask_b`), and

    prediction_b = cosine_scale * cos(u_b, v_b),   loss_b = (prediction_b - label_b)^2,

no parameters and no dropout after the pooling. A model with a cosine head runs the encoder
a second time, on `input_ids_b`, for every row of the batch (rows of other tasks carry an
all-padding `input_ids_b` whose output no head reads), so a step costs about two forward
and backward passes; its second pass draws dropout from `fold_in(rng, 1)`.

Dropout is drawn per example (`ktx.models.base.dropout_keyed_by_row`, as
`EncoderDecoderModel`), so task blocks and microbatches reproduce the whole batch's masks.

Options every ktx encoder classifier shares (CA-MTL, PALs and TEA subclass this model):
`shared_layers = k` puts k new task-shared BERT layers between the encoder and the pooler
(`bert.SharedTopLayers`, scope `shared_layers`; SlapBERT's shared layer);
`frozen_layers = k` (or "half") freezes BERT's embeddings and layers `0 .. k-1`
(`frozen_patterns`, applied by the Trainer; their gradients are stopped in the loss), in
either layout: a scanned stack freezes rows `0 .. k-1` of its stacked leaves;
`logits(..., embedding_perturbation=δ)` adds `δ [B, L, E]` to the embedding output
(`ktx.models.smart`; not with a cosine head).
Labels outside `[0, n_t)` of a classification task cannot be checked under jit: they are
clipped; validate them in the task's preprocessing.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ktx import treepath
from ktx.models import bert
from ktx.models.base import (
    LOSS_NORMALIZATIONS,
    Batch,
    BaseModel,
    dropout_keyed_by_row,
    row_ids,
    segment_sum_by_task,
)
from ktx.partitioning import EMBED

__all__ = ["TASK_HEADS_SCOPE", "TaskHeads", "BertClassifier", "EncoderClassifierModel",
           "frozen_layer_patterns", "stop_frozen_gradients", "normalised_entropy",
           "row_normalised_entropy", "SEQUENCE", "TAGGING", "COSINE", "HEAD_KINDS", "IGNORE_LABEL",
           "check_head_kinds", "apply_task_heads"]

TASK_HEADS_SCOPE = "task_heads"
WORD_EMBEDDINGS = "embeddings/word_embeddings/embedding"  # BERT's token table
_FEATURES = ("input_ids", "token_type_ids", "attention_mask")
_REQUIRED = ("input_ids", "label", "task_id")
# Head kinds (the same names as `ktx.data.encoder_features`, which the tests check).
SEQUENCE, TAGGING, COSINE = "sequence", "tagging", "cosine"
HEAD_KINDS = (SEQUENCE, TAGGING, COSINE)
_COSINE_FEATURES = ("input_ids_b", "attention_mask_b")
IGNORE_LABEL = -100  # `token_labels` of positions without a label (transformers' value)


def check_head_kinds(owner: str, head_kinds: Any, num_tasks: int) -> tuple[str, ...]:
    """`head_kinds` (None: every head "sequence"; one kind for all; or one per task) as a
    tuple of `num_tasks` kinds; ValueError naming `owner.head_kinds` otherwise."""
    if head_kinds is None:
        return (SEQUENCE,) * num_tasks
    kinds = (head_kinds,) * num_tasks if isinstance(head_kinds, str) else head_kinds
    if isinstance(kinds, Sequence) and len(kinds) == num_tasks \
            and all(isinstance(k, str) and k in HEAD_KINDS for k in kinds):
        return tuple(kinds)
    raise ValueError(
        f"{owner}.head_kinds={head_kinds!r}; accepted: None or one of {HEAD_KINDS} (every "
        f"task), or a sequence of {num_tasks} of them (one per task, as num_labels)")

_ENTROPY_EPS = 1e-5  # the CA-MTL code's epsilon under the maximum entropy


def normalised_entropy(logits: jax.Array) -> jax.Array:
    """`[..., n]` logits -> `[...]` entropy of `softmax(logits)` over `log(n) + 1e-5`
    (0 for a 1-output regression head): what MT-uncertainty sampling ranks rows by
    (Pilault et al., 2021; the authors' `calculate_entropy`). No gradient flows through
    it (the reference detaches the logits)."""
    logits = jax.lax.stop_gradient(jnp.asarray(logits, jnp.float32))
    n = logits.shape[-1]
    if n == 1:
        return jnp.zeros(logits.shape[:-1], jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    p = jnp.exp(logp)
    entropy = -jnp.sum(jnp.where(p > 0, p * logp, 0.0), axis=-1)  # 0 log 0 = 0
    return entropy / (math.log(n) + _ENTROPY_EPS)


def row_normalised_entropy(logits: Sequence[jax.Array], task_id: jax.Array,
                           token_mask: jax.Array | None = None) -> jax.Array:
    """`[B]` normalised entropy of each row's own task head (`logits`: `T` arrays
    `[B, n_t]`, as `EncoderClassifierModel.logits`). A tagging head's `[B, L, n_t]` gives
    the mean over the row's positions where `token_mask` `[B, L]` (its labelled tokens)
    is true: the entropy of a word's tag, averaged over the sentence's words."""
    task_id = jnp.asarray(task_id, jnp.int32)
    out = jnp.zeros(task_id.shape, jnp.float32)
    for t, lg in enumerate(logits):
        h = normalised_entropy(lg)
        if h.ndim == 2:
            if token_mask is None:
                raise ValueError("row_normalised_entropy: a tagging head's [B, L, n] logits "
                                 "need token_mask [B, L] (its labelled tokens)")
            m = jnp.asarray(token_mask, jnp.float32)
            h = jnp.sum(h * m, axis=-1) / jnp.maximum(m.sum(axis=-1), 1.0)
        out = jnp.where(task_id == t, h, out)
    return out


class TaskHeads(nn.Module):
    """One linear head per task: a "sequence" head maps the pooled `[B, E]` to `[B, n_t]`,
    a "tagging" head every token's `[B, L, E]` to `[B, L, n_t]` (float32 logits); a
    "cosine" head has no parameters and returns the pooled output before dropout, `[B, E]`
    float32 (`sentence`), which the model compares with the second text's."""

    num_labels: tuple[int, ...]
    dtype: Any = jnp.float32
    head_kinds: tuple[str, ...] | None = None  # None: every head "sequence"

    @nn.compact
    def __call__(self, x: jax.Array | None, tokens: jax.Array | None = None,
                 sentence: jax.Array | None = None) -> tuple[jax.Array, ...]:
        kinds = self.head_kinds or (SEQUENCE,) * len(self.num_labels)
        return tuple(
            jnp.asarray(sentence, jnp.float32) if kind == COSINE else
            jnp.asarray(bert.DenseGeneral((n,), (EMBED, None), (None,), dtype=self.dtype,
                                          name=f"task_{t}")(tokens if kind == TAGGING else x),
                        jnp.float32)
            for t, (n, kind) in enumerate(zip(self.num_labels, kinds))
        )


def apply_task_heads(heads: TaskHeads, dropout: nn.Dropout, hidden: jax.Array,
                     pooled: jax.Array | None, deterministic: bool) -> tuple[jax.Array, ...]:
    """`heads` on the dropped-out pooled output (sequence heads), the dropped-out last
    hidden states `[B, L, E]` (tagging heads; only when one tags, so a model without
    tagging heads draws the same dropout masks as before) and the pooled output itself
    (cosine heads)."""
    kinds = heads.head_kinds or ()
    tokens = dropout(hidden, deterministic=deterministic) if TAGGING in kinds else None
    sentence = pooled if COSINE in kinds else None
    if pooled is not None and SEQUENCE in (kinds or (SEQUENCE,)):
        pooled = dropout(pooled, deterministic=deterministic)
    return heads(pooled, tokens, sentence)


class BertClassifier(bert.BertEncoder):
    """`BertEncoder` plus per-task heads on the dropped-out pooled output.

    `__call__(input_ids, token_type_ids, attention_mask, *, deterministic)` -> a tuple of
    `T` float32 logits `[B, n_t]` (`[B, L, n_t]` for a tagging head). The backbone's parameters sit at the root, as in
    `BertEncoder`, so a converted BERT checkpoint loads without renaming.
    """

    num_labels: tuple[int, ...] = (2,)
    classifier_dropout: float = 0.1
    head_kinds: tuple[str, ...] | None = None  # None: every head "sequence"

    def setup(self):
        super().setup()
        self.head_dropout = nn.Dropout(self.classifier_dropout)
        self.task_heads = TaskHeads(tuple(self.num_labels), self.config.activation_dtype,
                                    self.head_kinds)

    def __call__(self, input_ids, token_type_ids=None, attention_mask=None, *,
                 deterministic: bool = True, embedding_perturbation=None):
        # No sequence or cosine head: no pooler (transformers' BertForTokenClassification
        # has none).
        pool = needs_pooling(self.head_kinds)
        hidden, pooled = self.encode(input_ids, token_type_ids, attention_mask,
                                     deterministic=deterministic, pool=pool,
                                     embedding_perturbation=embedding_perturbation)
        return apply_task_heads(self.task_heads, self.head_dropout, hidden, pooled,
                                deterministic)


def cosine_similarity(u: jax.Array, v: jax.Array, eps: float = 1e-8) -> jax.Array:
    """`[B]` cosine of `[B, E]` rows (float32), each norm floored at `eps` as torch's
    `cosine_similarity`: an all-zero vector (the mean-pooled all-padding second text of a
    row whose task has no cosine head) gives 0, with a finite gradient."""
    u, v = jnp.asarray(u, jnp.float32), jnp.asarray(v, jnp.float32)
    nu = jnp.sqrt(jnp.maximum(jnp.sum(u * u, axis=-1), eps * eps))
    nv = jnp.sqrt(jnp.maximum(jnp.sum(v * v, axis=-1), eps * eps))
    return jnp.sum(u * v, axis=-1) / (nu * nv)


def needs_pooling(head_kinds: Sequence[str] | None) -> bool:
    """Whether heads of these kinds read the pooled output (a sequence or cosine head)."""
    return bool({SEQUENCE, COSINE} & set(head_kinds or (SEQUENCE,)))


def frozen_layer_patterns(num_layers: int, frozen_layers: int | str = 0, *,
                          scanned: bool = False) -> tuple[str | treepath.Rows, ...]:
    """The parameters that do not train with `frozen_layers = k > 0` (or "half":
    `num_layers // 2`), in the selection format of `ktx.training.optimizers.freeze`
    (regexes fully matching '/'-joined paths, and `treepath.Rows`): BERT's `embeddings/.*`
    and layers `0 .. k-1`, as `layers_<i>/.*` unrolled and as rows `0 .. k-1` of the stacked
    `layers/.*` leaves when `scanned`. Everything else trains: the upper layers, shared top
    layers (`shared_layers/...`), a method's `conditioning/...` parameters (also those of
    frozen layers), the pooler and the heads."""
    if frozen_layers == "half":
        frozen_layers = num_layers // 2
    if isinstance(frozen_layers, bool) or not isinstance(frozen_layers, int) \
            or not 0 <= frozen_layers <= num_layers:
        raise ValueError(
            f"frozen_layers={frozen_layers!r}; accepted: 'half' or an int in 0..{num_layers}")
    if not frozen_layers:
        return ()
    if scanned:
        return ("embeddings/.*", treepath.Rows("layers/.*", 0, frozen_layers))
    layers = "|".join(str(i) for i in range(frozen_layers))
    return ("embeddings/.*", f"layers_(?:{layers})/.*")


def stop_frozen_gradients(params: Any, patterns: treepath.Selection) -> Any:
    """`params` with `lax.stop_gradient` on what `patterns` selects (`treepath.select`):
    whole leaves, and the frozen rows of a scanned stack's leaves (`treepath.Rows`). The
    backward pass skips what the optimizer would zero anyway (a partly frozen stacked leaf
    still computes its whole gradient, whose frozen rows are then zero)."""
    if not patterns:
        return params

    def stop(selected, leaf):
        if selected is True:
            return jax.lax.stop_gradient(leaf)
        if isinstance(selected, np.ndarray):
            return jnp.where(treepath.rows_like(selected, leaf), jax.lax.stop_gradient(leaf),
                             leaf)
        return leaf

    return jax.tree.map(stop, treepath.select(params, patterns, strict=False), params)


class EncoderClassifierModel(BaseModel):
    """BERT with one classification (or regression: `num_labels[t] == 1`) head per task.

    Args:
      config: the encoder's `bert.BertConfig`.
      num_labels: labels of each task's head: one int per task (`T = len(num_labels)`),
        or one int shared by all `num_tasks` tasks; 1 = regression with squared error.
      num_tasks: the number of tasks `T`; with a sequence `num_labels` it must equal its
        length (gin files bind both; default: its length), with an int it is required.
      classifier_dropout: dropout on the pooled output before the heads (default: the
        config's `dropout_rate`, as transformers).
      loss_normalization: "global" (mean over all rows of the batch) or "per_task".
      shared_layers: extra task-shared BERT layers between the encoder and the pooler
        (`bert.SharedTopLayers`, scope `shared_layers`, new parameters; SlapBERT's shared
        layer); 0: none.
      frozen_layers: 0 (train everything), k or "half": BERT's embeddings and layers
        `0 .. k-1` get no update (`frozen_patterns`, applied by the Trainer's
        `TaskOptimizer`) and no gradient (stopped in the loss).
      pooling: the heads' sentence vector (`bert.POOLINGS`): "cls" (BERT's pooler on
        [CLS], transformers' `BertForSequenceClassification`) or "mean" (the mean of the
        attended hidden states, no pooler; sentence-transformers' pooling).
      head_kinds: each task's head (`HEAD_KINDS`): "sequence" (on the pooled output),
        "tagging" (on every token; `num_labels[t]` tags, the batch needs `token_labels`)
        or "cosine" (a regression of pairs, `num_labels[t] == 1`: the cosine of the two
        texts' pooled outputs, the batch needs `input_ids_b`; module docstring); one
        kind for all tasks or one per task; None: every head "sequence". Without a
        sequence or cosine head the model has no pooler.
      cosine_scale: a cosine head predicts `cosine_scale * cos(u, v)` (5: STS scores
        0-5; 1: labels in [0, 1] as sentence-transformers' `CosineSimilarityLoss`).
    """

    def __init__(
        self,
        config: bert.BertConfig | None = None,
        *,
        num_labels: int | Sequence[int] = (2,),
        num_tasks: int | None = None,
        classifier_dropout: float | None = None,
        loss_normalization: str = "global",
        shared_layers: int = 0,
        frozen_layers: int | str = 0,
        pooling: str = "cls",
        head_kinds: str | Sequence[str] | None = None,
        cosine_scale: float = 5.0,
    ):
        config = bert.BertConfig() if config is None else config
        if not isinstance(config, bert.BertConfig):
            raise TypeError(
                f"EncoderClassifierModel.config must be a bert.BertConfig, got {type(config).__name__}")
        if isinstance(num_labels, int) and not isinstance(num_labels, bool):
            if isinstance(num_tasks, bool) or not isinstance(num_tasks, int) or num_tasks < 1:
                raise ValueError(
                    f"EncoderClassifierModel.num_tasks={num_tasks!r}: an int >= 1 is required "
                    f"with a single num_labels={num_labels!r} (one head of that size per task)")
            num_labels = (num_labels,) * num_tasks
        if isinstance(num_labels, (str, bytes)) or not isinstance(num_labels, Sequence) \
                or not num_labels or any(isinstance(n, bool) or not isinstance(n, int) or n < 1
                                         for n in num_labels):
            raise ValueError(
                f"EncoderClassifierModel.num_labels={num_labels!r}: accepted: a non-empty "
                "sequence of ints >= 1, one per task, or one int >= 1 for every task "
                "(1 = regression)")
        if num_tasks is not None and num_tasks != len(num_labels):
            raise ValueError(
                f"EncoderClassifierModel.num_tasks={num_tasks!r} but num_labels={tuple(num_labels)} "
                f"has {len(num_labels)} entries; give one num_labels entry per task")
        if classifier_dropout is None:
            classifier_dropout = config.dropout_rate
        if isinstance(classifier_dropout, bool) or not isinstance(classifier_dropout, (int, float)) \
                or not 0.0 <= classifier_dropout < 1.0:
            raise ValueError(
                f"EncoderClassifierModel.classifier_dropout={classifier_dropout!r}: must be in [0, 1)")
        if loss_normalization not in LOSS_NORMALIZATIONS:
            raise ValueError(
                f"EncoderClassifierModel.loss_normalization={loss_normalization!r}; accepted: "
                f"{LOSS_NORMALIZATIONS}")
        self.config = config
        self.num_labels = tuple(int(n) for n in num_labels)
        self.num_tasks = len(self.num_labels)
        self.classifier_dropout = float(classifier_dropout)
        self.loss_normalization = loss_normalization
        self.shared_layers = bert.check_shared_layers(type(self).__name__, shared_layers)
        try:
            self.frozen_patterns = frozen_layer_patterns(
                config.num_layers, frozen_layers, scanned=config.scan_layers)
        except ValueError as e:
            raise ValueError(f"{type(self).__name__}.{e}") from e
        self.frozen_layers = frozen_layers
        self.pooling = bert.check_pooling(type(self).__name__, pooling)
        self.head_kinds = check_head_kinds(type(self).__name__, head_kinds, self.num_tasks)
        bad = [t for t, (k, n) in enumerate(zip(self.head_kinds, self.num_labels))
               if k == TAGGING and n < 2]
        if bad:
            raise ValueError(
                f"{type(self).__name__}: tasks {bad} have a tagging head of num_labels="
                f"{[self.num_labels[t] for t in bad]}; a tagging head needs >= 2 tags (no "
                "regression tagging)")
        bad = [t for t, (k, n) in enumerate(zip(self.head_kinds, self.num_labels))
               if k == COSINE and n != 1]
        if bad:
            raise ValueError(
                f"{type(self).__name__}: tasks {bad} have a cosine head of num_labels="
                f"{[self.num_labels[t] for t in bad]}; a cosine head is a regression "
                "(accepted: num_labels=1 for those tasks)")
        if isinstance(cosine_scale, bool) or not isinstance(cosine_scale, (int, float)) \
                or not cosine_scale > 0:
            raise ValueError(f"{type(self).__name__}.cosine_scale={cosine_scale!r}; accepted: "
                             "a number > 0")
        self.cosine_scale = float(cosine_scale)
        self.module = BertClassifier(
            config=config, num_shared_layers=self.shared_layers, num_labels=self.num_labels,
            classifier_dropout=self.classifier_dropout, pooling=self.pooling,
            head_kinds=self.head_kinds)

    @property
    def sparse_table_patterns(self) -> tuple[str, ...]:
        """Tables whose per-task gradients the balanced path keeps as looked-up rows
        (`ktx.optim.sparse`; the Trainer's default `sparse_tables`): the word embeddings,
        unless they are frozen (`frozen_layers`: their gradients are stopped in the loss,
        which looked-up rows would not see)."""
        frozen = any(isinstance(p, str) and re.fullmatch(p, WORD_EMBEDDINGS)
                     for p in self.frozen_patterns)
        return () if frozen else (f"^{re.escape(WORD_EMBEDDINGS)}$",)

    @property
    def tagging(self) -> bool:
        """True when some task has a tagging head (the batch then needs `token_labels`)."""
        return TAGGING in self.head_kinds

    @property
    def cosine(self) -> bool:
        """True when some task has a cosine head (the batch then needs `input_ids_b`)."""
        return COSINE in self.head_kinds

    def __repr__(self) -> str:
        return (f"EncoderClassifierModel(config={self.config}, num_labels={self.num_labels}, "
                f"classifier_dropout={self.classifier_dropout}, "
                f"loss_normalization={self.loss_normalization!r}, "
                f"shared_layers={self.shared_layers}, frozen_layers={self.frozen_layers!r}, "
                f"pooling={self.pooling!r}, head_kinds={self.head_kinds})")

    # ---------------------------------------------------------------- inputs

    def _check_batch(self, batch: Batch, required: tuple[str, ...] | None = None) -> None:
        if required is None:
            required = _REQUIRED + (("token_labels",) if self.tagging else ()) + (
                ("input_ids_b",) if self.cosine else ())
        missing = [k for k in required if k not in batch]
        if missing:
            tagging = (f"; with tagging heads (head_kinds={self.head_kinds}) also token_labels"
                       if self.tagging else "")
            if self.cosine:
                tagging += (f"; with cosine heads (head_kinds={self.head_kinds}) also "
                            "input_ids_b (+ optional attention_mask_b)")
            raise ValueError(
                f"batch is missing features {missing}; it has {sorted(batch)}; an encoder "
                f"classification batch needs {list(_REQUIRED)} (+ optional token_type_ids, "
                f"attention_mask){tagging}")

    def input_spec(
        self, batch_size: int, feature_lengths: Mapping[str, int]
    ) -> dict[str, jax.ShapeDtypeStruct]:
        """Features of a batch; the sequence length is `feature_lengths["inputs"]`
        (T5X's key, as the seq2seq model; other keys are ignored)."""
        value = feature_lengths.get("inputs") if isinstance(feature_lengths, Mapping) else None
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"feature_lengths['inputs']={value!r} (in {feature_lengths!r}): a positive int "
                "is required")
        if value > self.config.max_position:
            raise ValueError(
                f"feature_lengths['inputs']={value} exceeds BertConfig.max_position="
                f"{self.config.max_position}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r}: must be a positive integer")
        i32 = jnp.int32
        spec = {
            **{k: jax.ShapeDtypeStruct((batch_size, value), i32) for k in _FEATURES},
            "label": jax.ShapeDtypeStruct((batch_size,), jnp.float32),
            "task_id": jax.ShapeDtypeStruct((batch_size,), i32),
        }
        if self.tagging:
            spec["token_labels"] = jax.ShapeDtypeStruct((batch_size, value), i32)
        if self.cosine:
            spec.update({k: jax.ShapeDtypeStruct((batch_size, value), i32)
                         for k in _COSINE_FEATURES})
        return spec

    def init_variables(self, rng: jax.Array, batch: Batch) -> Any:
        """Variables (`{"params": ...}`, boxed with logical axes) for `batch`'s shapes."""
        ids = jnp.zeros(batch["input_ids"].shape, jnp.int32)
        return self.module.init(rng, ids, ids, jnp.ones_like(ids), deterministic=True)

    # ---------------------------------------------------------------- loss

    def logits(self, params: Any, batch: Batch, rng: jax.Array | None = None,
               train: bool = False, *,
               embedding_perturbation: jax.Array | None = None) -> tuple[jax.Array, ...]:
        """`T` float32 logits `[B, n_t]` (`[B, L, n_t]` for a tagging head; every head on
        every row); `embedding_perturbation` `[B, L, E]` is added to the embedding output
        (`ktx.models.smart`)."""
        self._check_batch(batch, ("input_ids",))
        features = {k: jnp.asarray(batch[k], jnp.int32) for k in _FEATURES if k in batch}
        return self._apply(params, features, batch, rng, train, embedding_perturbation)

    def _apply(self, params, features, batch, rng, train, embedding_perturbation):
        """`self.module` on `features` (+ the perturbation), dropout keyed per row; with a
        cosine head, also on the second texts (`features` with `input_ids_b`), and each
        cosine head's output is `cosine_scale * cos(u, v)` `[B, 1]`."""
        if embedding_perturbation is not None and self.cosine:
            raise ValueError(
                f"{type(self).__name__}(head_kinds={self.head_kinds}): SMART "
                "(ktx.models.smart.SmartModel, gin conditioning/smart.gin) perturbs one "
                "text's embeddings and does not support cosine heads, which encode two texts "
                "apart; accepted: sequence and tagging heads")
        out = self._apply_once(params, features, batch, rng, train, embedding_perturbation)
        if not self.cosine:
            return out
        self._check_batch(batch, ("input_ids_b",))
        ids_b = jnp.asarray(batch["input_ids_b"], jnp.int32)
        second = dict(features, input_ids=ids_b, token_type_ids=jnp.zeros_like(ids_b))
        second["attention_mask"] = jnp.asarray(
            batch["attention_mask_b"] if "attention_mask_b" in batch else ids_b > 0, jnp.int32)
        out_b = self._apply_once(params, second, batch,
                                 None if rng is None else jax.random.fold_in(rng, 1), train, None)
        return tuple(
            self.cosine_scale * cosine_similarity(a, b)[:, None] if kind == COSINE else a
            for kind, a, b in zip(self.head_kinds, out, out_b))

    def _apply_once(self, params, features, batch, rng, train, embedding_perturbation):
        if embedding_perturbation is not None:
            features = dict(features, embedding_perturbation=embedding_perturbation)
        dropout = train and (self.config.dropout_rate > 0 or self.config.attention_dropout_rate > 0
                             or self.classifier_dropout > 0)
        if not dropout:
            return self.module.apply({"params": params}, **features, deterministic=True)
        if rng is None:
            raise ValueError("train=True with dropout needs an rng")

        # Dropout keyed per example: row i's masks depend on (rng, row id) only
        # (`ktx.models.base.dropout_keyed_by_row`); the batch runs through the module at once.
        with dropout_keyed_by_row(row_ids(batch)):
            return self.module.apply({"params": params}, **features, deterministic=False,
                                     rngs={"dropout": rng})

    def normalised_entropy(self, params: Any, batch: Batch) -> jax.Array:
        """`[B]` normalised entropy of each row's own head (deterministic forward, no
        gradient): MT-uncertainty sampling's score (`ktx.training.mt_uncertainty`); a
        tagging row's is the mean over its labelled tokens."""
        return row_normalised_entropy(self.logits(params, batch), batch["task_id"],
                                      self.labelled_tokens(batch) if self.tagging else None)

    def _attended(self, batch: Batch) -> jax.Array:
        return bert.attention_mask_from(jnp.asarray(batch["input_ids"]),
                                        None if "attention_mask" not in batch
                                        else jnp.asarray(batch["attention_mask"]))

    def labelled_tokens(self, batch: Batch) -> jax.Array:
        """`[B, L]` bool: attended positions with a token label (not `IGNORE_LABEL`)."""
        labels = jnp.asarray(batch["token_labels"], jnp.int32)
        return (labels >= 0) & self._attended(batch)

    def row_weights(self, batch: Batch) -> jax.Array:
        """`[B]` 1 for a row with an attended token, 0 for an all-padding row; a row of a
        tagging task needs a labelled token."""
        weight = self._attended(batch).any(axis=-1)
        if self.tagging:
            task_id = jnp.asarray(batch["task_id"], jnp.int32)
            tags = jnp.asarray([k == TAGGING for k in self.head_kinds])[task_id]
            weight = jnp.where(tags, self.labelled_tokens(batch).any(axis=-1), weight)
        return weight.astype(jnp.float32)

    def task_weights(self, batch: Batch) -> jax.Array:
        """`[T]` number of (non-padding) rows of each task."""
        self._check_batch(batch)
        return segment_sum_by_task(self.row_weights(batch), batch["task_id"], self.num_tasks)

    def loss_sums(
        self, params: Any, batch: Batch, rng: jax.Array | None, train: bool
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        self._check_batch(batch)
        params = stop_frozen_gradients(params, self.frozen_patterns)
        return self.loss_sums_from_logits(self.logits(params, batch, rng, train), batch)

    def loss_sums_from_logits(
        self, logits: Sequence[jax.Array], batch: Batch
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """`loss_sums` given the `T` logits `[B, n_t]` (`[B, L, n_t]` tagging) of `batch`
        (`self.logits`)."""
        self._check_batch(batch)
        label = jnp.asarray(batch["label"], jnp.float32)
        task_id = jnp.asarray(batch["task_id"], jnp.int32)
        weight = self.row_weights(batch)
        loss = jnp.zeros_like(label)
        correct = jnp.zeros_like(label)
        squared = jnp.zeros_like(label)
        token_correct = jnp.zeros_like(label)
        tokens = jnp.zeros_like(label)
        if self.tagging:
            labelled = self.labelled_tokens(batch)
            count = labelled.sum(axis=-1).astype(jnp.float32)
        for t, (n, kind, lg) in enumerate(zip(self.num_labels, self.head_kinds, logits)):
            mine = task_id == t
            if kind == TAGGING:
                target = jnp.clip(jnp.asarray(batch["token_labels"], jnp.int32), 0, n - 1)
                logp = jax.nn.log_softmax(lg, axis=-1)
                ce = -jnp.take_along_axis(logp, target[..., None], axis=-1)[..., 0]
                hits = (jnp.argmax(lg, axis=-1) == target) & labelled
                per = jnp.maximum(count, 1.0)
                loss = jnp.where(mine, jnp.where(labelled, ce, 0.0).sum(axis=-1) / per, loss)
                correct = jnp.where(mine, hits.sum(axis=-1) / per, correct)
                token_correct = jnp.where(mine, hits.sum(axis=-1).astype(jnp.float32),
                                          token_correct)
                tokens = jnp.where(mine, count, tokens)
            elif n == 1:
                err = jnp.square(lg[:, 0] - label)
                loss = jnp.where(mine, err, loss)
                squared = jnp.where(mine, err, squared)
            else:
                target = jnp.clip(label.astype(jnp.int32), 0, n - 1)
                logp = jax.nn.log_softmax(lg, axis=-1)
                ce = -jnp.take_along_axis(logp, target[:, None], axis=-1)[:, 0]
                loss = jnp.where(mine, ce, loss)
                hit = (jnp.argmax(lg, axis=-1) == target).astype(jnp.float32)
                correct = jnp.where(mine, hit, correct)

        def by_task(x):
            return segment_sum_by_task(x * weight, task_id, self.num_tasks)

        sums = by_task(loss)
        aux = {"loss": sums, "accuracy": by_task(correct), "squared_error": by_task(squared),
               "weight": by_task(jnp.ones_like(label))}
        if self.tagging:
            aux["token_correct"] = by_task(token_correct)
            aux["tokens"] = by_task(tokens)
        return sums, aux
