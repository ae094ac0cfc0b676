"""PALs: projected attention layers for multi-task BERT (Stickland & Murray, ICML 2019,
"BERT and PALs: Projected Attention Layers for Efficient Adaptation in Multi-Task
Learning"), and the task-conditioned BERT classifier it shares with TEA-BERT
(`ktx.models.tea`).

Every layer `l` of BERT gets, for each task `t`, a small self-attention in a projected
space of width `A = pals_size` (d_s, 204 for BERT-Base), run on the layer's *input* `h`:

    PAL_t(h) = GELU(V_D^t · MHA_t^l(V_E^t · h))       (erf GELU, as the authors' code)

`V_E^t` `[E -> A]` and `V_D^t` `[A -> E]` are one pair per task shared by all layers;
`MHA_t^l` is `pals_heads`-head self-attention (6 in the paper) with its own query / key /
value projections `[A -> A]`, the same key mask as BERT's attention and its attention
dropout, and no output projection. The PAL joins the feed-forward residual:

    a = LN(h + dropout(Attention(h)))
    layer_out = LN(dropout(FFN(a)) + a + PAL_t(h))

`pal_layers` picks the layers that get a PAL (default: all; the others are plain BERT
layers). Each ROW is conditioned by its own `task_id` `[B]`: the per-task weights are
gathered per row, so a batch may mix tasks.

Parameters (paths of `PalsClassifierModel.module`): the backbone keeps `BertEncoder`'s
names and the heads `EncoderClassifierModel`'s, so a BERT checkpoint or a trained
`EncoderClassifierModel` loads into them; the PALs live under `conditioning` (counted as
task-conditioned by `ktx params`), replicated over the mesh (axes `tasks`,
`hyper_bottleneck`), as every other ktx task-conditioning parameter:

    conditioning/down/{kernel [T, E, A], bias [T, A]}                   V_E, all layers
    conditioning/up/{kernel [T, A, E], bias [T, E]}                     V_D, all layers
    conditioning/layers_l/{query,key,value}/kernel [T, A, n, A/n]       MHA_t^l
    conditioning/layers_l/{query,key,value}/bias   [T, n, A/n]

With `BertConfig.scan_layers` the BERT layers are one `nn.scan` (`layers/...`) and the
per-layer tables are stacked with them, `conditioning/layers/{query,key,value}/...`
`[N, T, ...]` (`ScannedConditionedLayer`, `PalsLayerHook`; every layer must have a PAL).

`ktx.convert.pals.read_pals` loads the authors' checkpoint into this layout; the test
`tests/models/test_pals.py` reproduces their outputs (fixture `pals/`).

Size, counted from shapes by `ktx params` (BERT-Base, d_s = 204, 6 heads, 12 layers, one
two-way head per task):

    ktx params --gin_file=gin/models/bert_base.gin --gin_file=gin/conditioning/pals.gin \\
      --gin.NUM_TASKS=9 --gin.NUM_LABELS=2

9 GLUE tasks: BERT-Base + 9 heads 109,496,082, PALs 16,378,524 (1,819,836 per task:
V_E 156,876, V_D 157,440, 12 x 125,460 per-layer attentions), total 125,874,606 = 1.1496x.
The paper reports 1.13x: that is 8 tasks (their GLUE runs leave out WNLI), which ktx
measures at 1.1330x (`--gin.NUM_TASKS=8`: 124,053,232 / 109,494,544).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from ktx.conditioning.task_embedding import gather_by_task
from ktx.models import bert, encoder
from ktx.models.base import Batch
from ktx.models.t5_stack import gathered_layers, layer_class
from ktx.partitioning import (
    BATCH,
    EMBED,
    HYPER_BOTTLENECK,
    LAYERS,
    LENGTH,
    MLP,
    TASKS,
)

__all__ = [
    "LayerHooks",
    "task_dense",
    "TaskDense",
    "TaskBertEmbeddings",
    "ScannedConditionedLayer",
    "ConditionedBertClassifier",
    "TaskConditionedClassifierModel",
    "projected_attention",
    "ProjectedSelfAttention",
    "PalsLayerHook",
    "Pals",
    "PalsClassifierModel",
    "check_layers",
    "check_every_layer_when_scanned",
]

Array = jax.Array
_NEG_INF = -1e10  # bert.BertAttention's masked score
_FEATURES = ("input_ids", "token_type_ids", "attention_mask", "task_id")
_init = nn.initializers.normal(stddev=0.02)  # BERT's initializer_range


class LayerHooks(NamedTuple):
    """What a task-conditioning module adds to one layer (None: nothing).

    `qkv`: `[B, 3, H, D]` added to the query, key and value projections (TEA-BERT);
    `residual`: `[B, L, E]` added inside the feed-forward residual, before its LayerNorm
    (PALs)."""

    qkv: Array | None = None
    residual: Array | None = None


def task_dense(x: Array, kernel: Array, bias: Array, task_id: Array, dtype: Any) -> Array:
    """`x [B, L, I]` through each row's own task's dense layer: `kernel [T, I, *features]`,
    `bias [T, *features]`, `task_id [B]` -> `[B, L, *features]`, computed in `dtype`."""
    features = kernel.shape[2:]
    n_out = math.prod(features)
    k = gather_by_task(kernel, task_id).reshape(task_id.shape[0], x.shape[-1], n_out)
    b = gather_by_task(bias, task_id).reshape(task_id.shape[0], 1, n_out)
    y = jnp.einsum("bli,bio->blo", jnp.asarray(x, dtype), jnp.asarray(k, dtype))
    y = y + jnp.asarray(b, dtype)
    return y.reshape(*x.shape[:-1], *features)


class TaskDense(nn.Module):
    """One dense layer per task, picked per row: `x [B, L, I]`, `task_id [B]` ->
    `[B, L, *features]` (`task_dense`). Kernel `[T, I, *features]` (axes
    `(tasks, *kernel_axes)`), bias `[T, *features]` (`(tasks, *bias_axes)`), float32;
    computed in `dtype`. `tables()` returns `(kernel, bias)`.

    With `num_layers` set, one such layer per layer of a scanned stack: kernel
    `[N, T, I, *features]`, bias `[N, T, *features]` (leading axis `layers`); only
    `tables()` then (the scan's body applies each layer's slice with `task_dense`)."""

    num_tasks: int
    in_features: int
    features: tuple[int, ...]
    kernel_axes: tuple[str | None, ...]
    bias_axes: tuple[str | None, ...]
    dtype: Any = jnp.float32
    num_layers: int | None = None

    def setup(self):
        features = tuple(self.features)
        lead, axes = ((), ()) if self.num_layers is None else ((self.num_layers,), (LAYERS,))
        self.kernel = self.param(
            "kernel", nn.with_logical_partitioning(_init, (*axes, TASKS, *self.kernel_axes)),
            (*lead, self.num_tasks, self.in_features, *features), jnp.float32)
        self.bias = self.param(
            "bias", nn.with_logical_partitioning(nn.initializers.zeros,
                                                 (*axes, TASKS, *self.bias_axes)),
            (*lead, self.num_tasks, *features), jnp.float32)

    def tables(self) -> tuple[Array, Array]:
        return self.kernel, self.bias

    def __call__(self, x: Array, task_id: Array) -> Array:
        if self.num_layers is not None:
            raise ValueError("TaskDense(num_layers=...) holds a scanned stack's tables; apply "
                             "each layer's slice with task_dense")
        return task_dense(x, self.kernel, self.bias, task_id, self.dtype)


class TaskBertEmbeddings(bert.BertEmbeddings):
    """`bert.BertEmbeddings` (same parameters) with an optional per-row `offset [B, E]`
    added to the word + position + token-type sum before the LayerNorm."""

    def __call__(self, input_ids: Array, token_type_ids: Array, deterministic: bool,
                 offset: Array | None = None) -> Array:
        x = self.summed(input_ids, token_type_ids)
        if offset is not None:
            x = x + jnp.asarray(offset, x.dtype)[:, None, :]
        x = nn.with_logical_constraint(x, (BATCH, LENGTH, EMBED))
        return self.dropout(self.layer_norm(x), deterministic=deterministic)


class ScannedConditionedLayer(nn.Module):
    """The body of a scanned conditioned stack: `bert.BertLayer` (its parameters in this
    module's own scope, so the stack's are `layers/...` as `bert.BertEncoder`'s) given
    the hooks that `hook` (a parameter-free module, None: none) computes from the layer's
    input and its slice of the conditioning's tables. Returns `(x, x)`: the carry and
    the layer's output, which the scan stacks."""

    num_heads: int
    head_dim: int
    intermediate_size: int
    hidden_act: str = "gelu"
    layer_norm_eps: float = 1e-12
    dropout_rate: float = 0.0
    attention_dropout_rate: float = 0.0
    dtype: Any = jnp.float32
    hook: nn.Module | None = None

    def setup(self):
        self.layer = bert.BertLayer(self.num_heads, self.head_dim, self.intermediate_size,
                                    self.hidden_act, self.layer_norm_eps, self.dropout_rate,
                                    self.attention_dropout_rate, self.dtype)
        nn.share_scope(self, self.layer)

    def __call__(self, x: Array, mask: Array, deterministic: bool, task_id: Array,
                 shared: Any, per_layer: Any) -> tuple[Array, Array]:
        hooks = (LayerHooks() if self.hook is None else
                 self.hook(x, mask, task_id, shared, per_layer, deterministic))
        x = self.layer(x, mask, deterministic, qkv=hooks.qkv, residual=hooks.residual)
        return x, x


class ConditionedBertClassifier(nn.Module):
    """`encoder.BertClassifier` whose rows are conditioned by their `task_id`.

    `conditioning` (scope `conditioning`; None = plain BERT) provides
    `input_offset(task_id) -> [B, E] | None` (added to the input embeddings) and
    `layer_hooks(index, x, mask, task_id, deterministic) -> LayerHooks`; with
    `BertConfig.scan_layers`, `scan_inputs(task_id) -> (shared, per_layer [N, ...])` and
    `layer_hook_module()` instead, which the scanned stack (`ScannedConditionedLayer`,
    scope `layers`) applies layer by layer.

    `__call__(input_ids, token_type_ids, attention_mask, task_id, *, deterministic)` ->
    a tuple of `T` float32 logits `[B, n_t]` (`[B, L, n_t]` for a tagging head, on every
    token's last hidden state); `encode(...)` -> (every layer's output, a tuple of
    `[B, L, E]`, and the pooled output `[B, E]`, None without a sequence head).
    """

    config: bert.BertConfig = bert.BertConfig()
    num_labels: tuple[int, ...] = (2,)
    classifier_dropout: float = 0.1
    conditioning: nn.Module | None = None
    num_shared_layers: int = 0
    pooling: str = "cls"
    head_kinds: tuple[str, ...] | None = None

    def setup(self):
        c = self.config
        dtype = c.activation_dtype
        self.embeddings = TaskBertEmbeddings(
            c.vocab_size, c.hidden_size, c.max_position, c.type_vocab_size, c.layer_norm_eps,
            c.dropout_rate, dtype)
        fields = (c.num_heads, c.head_dim, c.intermediate_size, c.hidden_act,
                  c.layer_norm_eps, c.dropout_rate, c.attention_dropout_rate, dtype)
        # `deterministic` is argument 3 of both layers' __call__ (self = 0); hooks as keywords.
        if c.scan_layers:
            body = layer_class(gathered_layers(ScannedConditionedLayer, self.scope.path),
                               c.remat_policy, (3,), scanned=True)
            hook = None if self.conditioning is None else self.conditioning.layer_hook_module()
            self.layers = nn.scan(
                body, variable_axes={"params": 0, "intermediates": 0},
                split_rngs={"params": True, "dropout": True},
                in_axes=(nn.broadcast,) * 4 + (0,), length=c.num_layers,
                metadata_params={nn.PARTITION_NAME: LAYERS},
            )(*fields, hook=hook, name="layers")
        else:
            layer_cls = layer_class(bert.BertLayer, c.remat_policy, (3,), scanned=False)
            self.layers = [layer_cls(*fields, name=f"layers_{i}") for i in range(c.num_layers)]
        self.pooler = bert.DenseGeneral((c.hidden_size,), (EMBED, MLP), (MLP,), dtype=dtype)
        self.head_dropout = nn.Dropout(self.classifier_dropout)
        self.task_heads = encoder.TaskHeads(tuple(self.num_labels), dtype, self.head_kinds)
        self.shared_layers = (bert.SharedTopLayers(c, self.num_shared_layers)
                              if self.num_shared_layers else None)

    def encode(self, input_ids: Array, token_type_ids: Array | None = None,
               attention_mask: Array | None = None, task_id: Array | None = None, *,
               deterministic: bool = True,
               embedding_perturbation: Array | None = None) -> tuple[tuple[Array, ...], Array]:
        outputs, _, pooled = self._forward(input_ids, token_type_ids, attention_mask, task_id,
                                           deterministic, embedding_perturbation)
        return outputs, pooled

    def _forward(self, input_ids, token_type_ids, attention_mask, task_id, deterministic,
                 embedding_perturbation):
        """(every layer's output, the last hidden state after shared layers, pooled)."""
        if input_ids.ndim != 2 or not jnp.issubdtype(input_ids.dtype, jnp.integer):
            raise ValueError(
                f"input_ids: shape {input_ids.shape} dtype {input_ids.dtype}; accepted: int [B, L]")
        if token_type_ids is None:
            token_type_ids = jnp.zeros_like(input_ids)
        elif token_type_ids.shape != input_ids.shape:
            raise ValueError(f"token_type_ids has shape {token_type_ids.shape}; accepted: "
                             f"input_ids' shape {input_ids.shape}")
        if task_id is None:
            raise ValueError("task_id [B] is required: every row is conditioned by its task")
        task_id = jnp.asarray(task_id, jnp.int32)
        if task_id.shape != input_ids.shape[:1]:
            raise ValueError(f"task_id has shape {task_id.shape}; accepted: [B] = "
                             f"{input_ids.shape[:1]}")
        mask = bert.attention_mask_from(input_ids, attention_mask)
        cond = self.conditioning
        offset = None if cond is None else cond.input_offset(task_id)
        x = bert.add_perturbation(self.embeddings(input_ids, token_type_ids, deterministic, offset),
                                  embedding_perturbation)
        outputs = []
        if self.config.scan_layers:
            shared, per_layer = (None, None) if cond is None else cond.scan_inputs(task_id)
            x, stacked = self.layers(x, mask, deterministic, task_id, shared, per_layer)
            outputs = [stacked[i] for i in range(self.config.num_layers)]
        else:
            for i, layer in enumerate(self.layers):
                hooks = LayerHooks() if cond is None else cond.layer_hooks(i, x, mask, task_id,
                                                                           deterministic)
                x = layer(x, mask, deterministic, qkv=hooks.qkv, residual=hooks.residual)
                outputs.append(x)
        if self.shared_layers is not None:
            x = self.shared_layers(x, mask, deterministic)
        pool = encoder.needs_pooling(self.head_kinds)
        pooled = bert.pool_hidden(x, mask, self.pooler, self.pooling) if pool else None
        return tuple(outputs), x, pooled

    def __call__(self, input_ids, token_type_ids=None, attention_mask=None, task_id=None, *,
                 deterministic: bool = True, embedding_perturbation=None) -> tuple[Array, ...]:
        _, hidden, pooled = self._forward(input_ids, token_type_ids, attention_mask, task_id,
                                          deterministic, embedding_perturbation)
        return encoder.apply_task_heads(self.task_heads, self.head_dropout, hidden, pooled,
                                        deterministic)


class TaskConditionedClassifierModel(encoder.EncoderClassifierModel):
    """`encoder.EncoderClassifierModel` (same arguments, features, loss and metrics) whose
    module is a `ConditionedBertClassifier` fed each row's `task_id`; subclasses build the
    `conditioning` module (`_conditioning()`)."""

    def __init__(self, config: bert.BertConfig | None = None, *,
                 num_labels: int | Sequence[int] = (2,), num_tasks: int | None = None,
                 classifier_dropout: float | None = None, loss_normalization: str = "global",
                 shared_layers: int = 0, frozen_layers: int | str = 0, pooling: str = "cls",
                 head_kinds: str | Sequence[str] | None = None, cosine_scale: float = 5.0):
        super().__init__(config, num_labels=num_labels, num_tasks=num_tasks,
                         classifier_dropout=classifier_dropout,
                         loss_normalization=loss_normalization, shared_layers=shared_layers,
                         frozen_layers=frozen_layers, pooling=pooling, head_kinds=head_kinds,
                         cosine_scale=cosine_scale)
        self.module = ConditionedBertClassifier(
            config=self.config, num_labels=self.num_labels,
            classifier_dropout=self.classifier_dropout, conditioning=self._conditioning(),
            num_shared_layers=self.shared_layers, pooling=self.pooling,
            head_kinds=self.head_kinds)

    def _conditioning(self) -> nn.Module | None:
        return None

    def init_variables(self, rng: jax.Array, batch: Batch) -> Any:
        ids = jnp.zeros(batch["input_ids"].shape, jnp.int32)
        return self.module.init(rng, ids, ids, jnp.ones_like(ids), jnp.zeros(ids.shape[:1], jnp.int32),
                                deterministic=True)

    def logits(self, params: Any, batch: Batch, rng: jax.Array | None = None,
               train: bool = False, *,
               embedding_perturbation: Array | None = None) -> tuple[jax.Array, ...]:
        """`T` float32 logits `[B, n_t]` (every head on every row; each row's encoder
        conditioned by its own `task_id`; dropout keyed per row, as EncoderClassifierModel;
        `embedding_perturbation` `[B, L, E]` joins the embedding output)."""
        self._check_batch(batch, ("input_ids", "task_id"))
        features = {k: jnp.asarray(batch[k], jnp.int32) for k in _FEATURES if k in batch}
        return self._apply(params, features, batch, rng, train, embedding_perturbation)

    def encode(self, params: Any, batch: Batch) -> tuple[tuple[Array, ...], Array]:
        """Deterministic `(every layer's output [B, L, E], pooled [B, E])` of `batch`."""
        features = {k: jnp.asarray(batch[k], jnp.int32) for k in _FEATURES if k in batch}
        return self.module.apply({"params": params}, **features, deterministic=True,
                                 method=ConditionedBertClassifier.encode)


def projected_attention(q: Array, k: Array, v: Array, mask: Array, dropout: nn.Module,
                        deterministic: bool, dtype: Any) -> Array:
    """Multi-head self-attention without an output projection (a PAL's `MHA`): `q`, `k`,
    `v` `[B, L, n, A/n]`, key mask `[B, L]` -> `[B, L, A]` (heads concatenated). Scores
    and softmax in float32; `dropout` (an `nn.Dropout`) on the probabilities."""
    head_dim = q.shape[-1]
    scores = jnp.einsum("bqhd,bkhd->bhqk", jnp.asarray(q, jnp.float32),
                        jnp.asarray(k, jnp.float32)) / math.sqrt(head_dim)
    scores = jnp.where(mask[:, None, None, :], scores, _NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = dropout(probs, deterministic=deterministic)
    out = jnp.einsum("bhqk,bkhd->bqhd", jnp.asarray(probs, dtype), v)
    return out.reshape(*q.shape[:-2], -1)


class ProjectedSelfAttention(nn.Module):
    """The per-task query / key / value tables of a PAL's attention (`MHA_t^l`), width
    `A`, `num_heads` heads: `__call__()` -> `{"query" | "key" | "value": (kernel
    [T, A, n, A/n], bias [T, n, A/n])}`; with `num_layers`, every layer's stacked on a
    leading `layers` axis (a scanned stack's)."""

    num_tasks: int
    width: int
    num_heads: int
    dtype: Any = jnp.float32
    num_layers: int | None = None

    def setup(self):
        dense = lambda: TaskDense(self.num_tasks, self.width,
                                  (self.num_heads, self.width // self.num_heads),
                                  (HYPER_BOTTLENECK, None, None), (None, None), self.dtype,
                                  self.num_layers)
        self.query, self.key, self.value = dense(), dense(), dense()

    def __call__(self) -> dict[str, tuple[Array, Array]]:
        return {"query": self.query.tables(), "key": self.key.tables(),
                "value": self.value.tables()}


class PalsLayerHook(nn.Module):
    """One layer's PAL from its tables (no parameters of its own, so a scanned stack's
    body can hold it): `x [B, L, E]`, key mask, `task_id [B]`, `shared = (V_E, V_D)` (each
    `(kernel, bias)`), `per_layer` (`ProjectedSelfAttention()`'s tables) ->
    `LayerHooks(residual=GELU(V_D MHA(V_E x)))`."""

    num_heads: int
    attention_dropout_rate: float = 0.0
    dtype: Any = jnp.float32

    def setup(self):
        self.dropout = nn.Dropout(self.attention_dropout_rate)

    def __call__(self, x: Array, mask: Array, task_id: Array, shared: Any, per_layer: Any,
                 deterministic: bool) -> LayerHooks:
        (down_k, down_b), (up_k, up_b) = shared
        z = task_dense(x, down_k, down_b, task_id, self.dtype)
        q, k, v = (task_dense(z, *per_layer[name], task_id, self.dtype)
                   for name in ("query", "key", "value"))
        z = projected_attention(q, k, v, mask, self.dropout, deterministic, self.dtype)
        up = task_dense(z, up_k, up_b, task_id, self.dtype)
        return LayerHooks(residual=bert.HIDDEN_ACTS["gelu"](up))


class Pals(nn.Module):
    """The PALs of every task (scope `conditioning`): `layer_hooks(l, h, mask, task_id,
    deterministic)` puts `GELU(V_D MHA^l(V_E h))` `[B, L, E]` in the feed-forward
    residual of layer `l` (when in `layers`), each row with its own task's weights.

    `scanned`: the per-layer attentions' tables are stacked (`conditioning/layers/...`,
    `[N, T, ...]`) for a scanned stack, whose body applies `layer_hook_module()` to
    `scan_inputs(task_id)`; `layers` must then be every layer."""

    num_tasks: int
    hidden_size: int
    pals_size: int = 204
    num_heads: int = 6
    layers: tuple[int, ...] = ()
    attention_dropout_rate: float = 0.0
    dtype: Any = jnp.float32
    scanned: bool = False

    def setup(self):
        t, width = self.num_tasks, self.pals_size
        self.down = TaskDense(t, self.hidden_size, (width,), (EMBED, HYPER_BOTTLENECK),
                              (HYPER_BOTTLENECK,), self.dtype)
        self.up = TaskDense(t, width, (self.hidden_size,), (HYPER_BOTTLENECK, EMBED), (EMBED,),
                            self.dtype)
        if self.scanned:
            self.stack = ProjectedSelfAttention(t, width, self.num_heads, self.dtype,
                                                len(self.layers), name="layers")
        else:
            self.attention = [ProjectedSelfAttention(t, width, self.num_heads, self.dtype,
                                                     name=f"layers_{i}") for i in self.layers]
        self.hook = self.layer_hook_module()

    @nn.nowrap
    def layer_hook_module(self) -> PalsLayerHook:
        return PalsLayerHook(self.num_heads, self.attention_dropout_rate, self.dtype, parent=None)

    def input_offset(self, task_id: Array) -> None:
        return None

    def scan_inputs(self, task_id: Array) -> tuple[Any, Any]:
        """`(shared, per_layer)` of a scanned stack: V_E and V_D for every layer, and the
        attentions' tables stacked `[N, ...]`, sliced per layer by the scan."""
        return (self.down.tables(), self.up.tables()), self.stack()

    def layer_hooks(self, index: int, x: Array, mask: Array, task_id: Array,
                    deterministic: bool) -> LayerHooks:
        if index not in self.layers:
            return LayerHooks()
        per_layer = self.attention[self.layers.index(index)]()
        return self.hook(x, mask, task_id, (self.down.tables(), self.up.tables()), per_layer,
                         deterministic)


def _check_int(owner: str, name: str, value: Any, low: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{owner}.{name}={value!r}: must be an int >= {low}")


def check_layers(owner: str, name: str, layers: Sequence[int] | None,
                 num_layers: int) -> tuple[int, ...]:
    """`layers` as a sorted tuple of distinct layer indices in `[0, num_layers)` (None:
    every layer); ValueError naming `owner.name` otherwise."""
    if layers is None:
        return tuple(range(num_layers))
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence) or any(
            isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers
            for i in layers) or len(set(layers)) != len(layers):
        raise ValueError(f"{owner}.{name}={layers!r}; accepted: None (every layer) or distinct "
                         f"layer indices in [0, {num_layers})")
    return tuple(sorted(layers))


def check_every_layer_when_scanned(owner: str, name: str, layers: tuple[int, ...],
                                   config: bert.BertConfig) -> None:
    """A scanned stack runs one layer definition `num_layers` times, so a method's
    per-layer modules must be on every layer; ValueError naming `owner.name` otherwise."""
    if config.scan_layers and layers != tuple(range(config.num_layers)):
        raise ValueError(
            f"{owner}.{name}={layers} with BertConfig.scan_layers=True (gin macro SCAN_LAYERS): "
            "a scanned stack runs one layer definition on every layer; accepted: None (every "
            "layer), or SCAN_LAYERS = False for a subset")


class PalsClassifierModel(TaskConditionedClassifierModel):
    """BERT with PALs and one classification / regression head per task.

    Args (the rest as `encoder.EncoderClassifierModel`):
      pals_size: the projected width `A` (d_s; 204 in the paper for BERT-Base).
      pals_heads: heads of each PAL's attention (6 in the paper); must divide `pals_size`.
      pal_layers: indices of the layers with a PAL (default None: every layer).
      shared_layers, frozen_layers: as `encoder.EncoderClassifierModel` (frozen layers
        keep their PALs trainable).
    """

    def __init__(self, config: bert.BertConfig | None = None, *,
                 num_labels: int | Sequence[int] = (2,), num_tasks: int | None = None,
                 classifier_dropout: float | None = None, loss_normalization: str = "global",
                 pals_size: int = 204, pals_heads: int = 6,
                 pal_layers: Sequence[int] | None = None, shared_layers: int = 0,
                 frozen_layers: int | str = 0, pooling: str = "cls",
                 head_kinds: str | Sequence[str] | None = None, cosine_scale: float = 5.0):
        _check_int("PalsClassifierModel", "pals_size", pals_size)
        _check_int("PalsClassifierModel", "pals_heads", pals_heads)
        if pals_size % pals_heads:
            raise ValueError(f"PalsClassifierModel.pals_size={pals_size} is not a multiple of "
                             f"pals_heads={pals_heads}")
        self.pals_size, self.pals_heads = pals_size, pals_heads
        self._pal_layers = pal_layers
        super().__init__(config, num_labels=num_labels, num_tasks=num_tasks,
                         classifier_dropout=classifier_dropout,
                         loss_normalization=loss_normalization, shared_layers=shared_layers,
                         frozen_layers=frozen_layers, pooling=pooling, head_kinds=head_kinds,
                         cosine_scale=cosine_scale)

    def _conditioning(self) -> nn.Module:
        c = self.config
        self.pal_layers = check_layers("PalsClassifierModel", "pal_layers", self._pal_layers,
                                       c.num_layers)
        check_every_layer_when_scanned("PalsClassifierModel", "pal_layers", self.pal_layers, c)
        return Pals(self.num_tasks, c.hidden_size, self.pals_size, self.pals_heads,
                    self.pal_layers, c.attention_dropout_rate, c.activation_dtype,
                    scanned=c.scan_layers)

    def __repr__(self) -> str:
        return (f"PalsClassifierModel(config={self.config}, num_labels={self.num_labels}, "
                f"classifier_dropout={self.classifier_dropout}, "
                f"loss_normalization={self.loss_normalization!r}, pals_size={self.pals_size}, "
                f"pals_heads={self.pals_heads}, pal_layers={self.pal_layers}, "
                f"shared_layers={self.shared_layers}, frozen_layers={self.frozen_layers!r}, "
                f"pooling={self.pooling!r}, head_kinds={self.head_kinds})")
