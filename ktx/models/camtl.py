"""CA-MTL (Pilault et al., ICLR 2021, "Conditionally Adaptive Multi-Task Learning: Improving
Transfer Learning in NLP Using Fewer Parameters & Less Data") on ktx's BERT encoder.

A BERT whose every layer is conditioned on the row's task. Equations (docs/encoders.md,
"CA-MTL"); `z0 = E_task[task_id]` `[B, E]`, FiLM `(1 + γ) ⊙ x + β` with `[γ, β] = W z + b`:

    conditional alignment   h_emb = (1 + γ(z0)) ⊙ BertEmbeddings(x) + β(z0)      `CaMtlConditioning`
    layer conditioning      z = W_t z0 + b_t   (every layer uses z)               `CaMtlConditioning`
    conditional attention   softmax(Q Kᵀ / √d + M(z) + (1 − mask) · −10000) V      `bert.BertAttention(bias=)`
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

With `BertConfig.scan_layers` the BERT layers are one `nn.scan` (`layers/...` `[n, ...]`,
body `CaMtlLayer`); `conditioning/layers_i` stays per layer (its layers differ), each
layer's bias and FiLMs computed before the scan and given to it stacked, plain-LN layers
with the identity FiLM (`LayerNormFiLM.identity`); Base's adapter and Large's chain run
after it on its per-layer outputs (`CaMtlEncoder._scanned_layers`). Same numbers as
unrolled (tests/models/test_bert_scan.py).

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

Dropout (BERT's rates) is keyed per row (`ktx.models.base.dropout_keyed_by_row`), as
`ktx.models.encoder.EncoderClassifierModel`; the bottleneck has none (as the reference).

The modules (configuration, FiLM generators, attention bias, conditional layer norm,
layers, bottleneck, conditioning) are in `ktx.models.camtl_layers`; this module holds the
encoder, the classifier, the model and the entropy used by MT-uncertainty sampling.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from ktx import treepath
from ktx.analysis.params import CONDITIONING_SCOPE, count_parameters
from ktx.models import bert, encoder
from ktx.models.encoder import normalised_entropy, row_normalised_entropy
from ktx.models.base import Batch
from ktx.models.t5_stack import gathered_layers, layer_class
from ktx.models.camtl_layers import (
    Array,
    BlockDiagonalBias,
    CaMtlConditioning,
    CaMtlConfig,
    CaMtlLayer,
    CaMtlLayerConditioning,
    CaMtlLayerNorm,
    CaMtlOutput,
    ConditionalAdapter,
    ConditionalBottleneck,
    FiLMCoefficients,
    LAYER_NORM_FORMS,
    LayerNormFiLM,
    VARIANTS,
    _MASK_VALUE,
    _dense,
)
from ktx.partitioning import EMBED, LAYERS, MLP

__all__ = [
    "VARIANTS",
    "LAYER_NORM_FORMS",
    "CaMtlConfig",
    "CaMtlOutput",
    "FiLMCoefficients",
    "LayerNormFiLM",
    "BlockDiagonalBias",
    "CaMtlLayerNorm",
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
    pooling: str = "cls"
    pool: bool = True  # False: no pooler (a model with tagging heads only)

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
        fields = (c.num_heads, c.head_dim, c.intermediate_size, c.hidden_act,
                  c.layer_norm_eps, c.dropout_rate, c.attention_dropout_rate, dtype)
        if c.scan_layers:
            # One CaMtlLayer definition over every layer: x is the carry, each layer's
            # task bias and layer-norm FiLMs its slice, the padding mask and
            # `deterministic` (argument 6, self = 0, static under remat) broadcast.
            body = layer_class(gathered_layers(CaMtlLayer, self.scope.path), c.remat_policy, (6,),
                               scanned=True)
            self.layers = nn.scan(
                body, variable_axes={"params": 0, "intermediates": 0},
                split_rngs={"params": True, "dropout": True},
                in_axes=(nn.broadcast, 0, 0, 0, nn.broadcast), length=c.num_layers,
                metadata_params={nn.PARTITION_NAME: LAYERS},
            )(*fields, scanned=True, name="layers")
        else:
            layer_cls = layer_class(CaMtlLayer, c.remat_policy, (6,), scanned=False)
            self.layers = [layer_cls(*fields, name=f"layers_{i}") for i in range(c.num_layers)]
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
        base = self.camtl.variant == "base"
        if self.config.scan_layers:
            outputs, top_attention = self._scanned_layers(x, z, mask_bias, deterministic)
            hidden.extend(outputs)
            if base:  # the top layer's adapter, after the scan (it is the last step)
                hidden[n] = self.conditioning.adapt(n - 1, z, hidden[n], top_attention)
            x = hidden[n]
        else:
            for i, layer in enumerate(self.layers):
                task_bias, attention_ln, output_ln = self.conditioning.layer(i, z)
                x, attention_out = layer(x, mask_bias, task_bias, attention_ln, output_ln,
                                         deterministic)
                if base and i == n - 1:
                    x = self.conditioning.adapt(i, z, x, attention_out)
                hidden.append(x)
        chain = None
        if not base:  # Large: f_i = bottleneck_i(z, h_i + f_{i-1}), beside the layers
            chain = jnp.zeros_like(x)
            for i in range(n):
                chain = self.conditioning.chain(i, z, hidden[i + 1] + chain)
        last = x if chain is None else chain
        if self.shared_layers is not None:
            last = self.shared_layers(last, mask, deterministic)
        pooled = bert.pool_hidden(last, mask, self.pooler, self.pooling) if self.pool else None
        return CaMtlOutput(last, pooled, tuple(hidden))

    def _scanned_layers(self, x, z, mask_bias, deterministic) -> tuple[list, Array]:
        """The scanned stack: each layer's conditioning (attention bias, layer-norm FiLMs:
        `conditioning/layers_<i>`, per layer in both layouts) computed first and stacked
        `[n, ...]`, plain-LN layers given the identity FiLM (`LayerNormFiLM.identity`:
        the same numbers); returns every layer's output `[B, L, E]` and the top layer's
        attention sub-block output (Base's adapter takes it)."""
        n = self.config.num_layers
        identity = LayerNormFiLM.identity(x.shape[0], self.config.hidden_size,
                                          self.camtl.layer_norm_form)
        per_layer = []
        for i in range(n):
            task_bias, attention_ln, output_ln = self.conditioning.layer(i, z)
            per_layer.append((task_bias, identity if attention_ln is None else attention_ln,
                              identity if output_ln is None else output_ln))
        task_bias, attention_ln, output_ln = jax.tree.map(lambda *a: jnp.stack(a), *per_layer)
        _, (outputs, attention) = self.layers(x, mask_bias, task_bias, attention_ln, output_ln,
                                              deterministic)
        return [outputs[i] for i in range(n)], attention[n - 1]


class CaMtlClassifier(CaMtlEncoder):
    """`CaMtlEncoder` plus one linear head per task (`encoder.TaskHeads`, scope
    `task_heads`) on the dropped-out pooled output (tagging heads: on every token's last
    hidden state): a tuple of `T` float32 `[B, n_t]` (`[B, L, n_t]`)."""

    num_labels: tuple[int, ...] = (2,)
    classifier_dropout: float = 0.1
    head_kinds: tuple[str, ...] | None = None

    def setup(self):
        super().setup()
        self.head_dropout = nn.Dropout(self.classifier_dropout)
        self.task_heads = encoder.TaskHeads(tuple(self.num_labels), self.config.activation_dtype,
                                            self.head_kinds)

    def __call__(self, input_ids, token_type_ids=None, attention_mask=None, task_id=None, *,
                 deterministic: bool = True, embedding_perturbation=None):
        out = super().__call__(input_ids, token_type_ids, attention_mask, task_id,
                               deterministic=deterministic,
                               embedding_perturbation=embedding_perturbation)
        return encoder.apply_task_heads(self.task_heads, self.head_dropout,
                                        out.last_hidden_state, out.pooled_output, deterministic)

    def encode(self, input_ids, token_type_ids=None, attention_mask=None, task_id=None, *,
               deterministic: bool = True) -> CaMtlOutput:
        """The encoder's `CaMtlOutput` (no heads)."""
        return CaMtlEncoder.__call__(self, input_ids, token_type_ids, attention_mask, task_id,
                                     deterministic=deterministic)


# -------------------------------------------------------------------- frozen parameters


def frozen_patterns(num_layers: int, frozen_layers: int | str = 0, *,
                    scanned: bool = False) -> tuple[str | treepath.Rows, ...]:
    """The parameters that do not train (`encoder.frozen_layer_patterns`): with
    `frozen_layers = k > 0` (or "half": `num_layers // 2`), BERT's embeddings and layers
    `0 .. k-1` (rows `0 .. k-1` of the stacked leaves when `scanned`). Their task-conditioned
    parameters (in `conditioning/`), the upper layers, the pooler and the heads train (the
    paper's setting: the bottom half and the embeddings frozen; the authors' run freezes
    layers 0-4 of Base and 0-11 of Large).
    """
    return encoder.frozen_layer_patterns(num_layers, frozen_layers, scanned=scanned)


def trainable_parameters(model: CaMtlClassifierModel) -> dict[str, int]:
    """`{"total", "frozen", "trainable"}` parameter counts of `model` from shapes only."""
    report = count_parameters(model, feature_lengths={"inputs": model.camtl.max_seq_length})
    return {k: report[k] for k in ("total", "frozen", "trainable")}


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
            classifier_dropout=self.classifier_dropout, pooling=self.pooling,
            head_kinds=self.head_kinds, pool=encoder.needs_pooling(self.head_kinds))

    def __repr__(self) -> str:
        return (f"CaMtlClassifierModel(config={self.config}, camtl={self.camtl}, "
                f"num_labels={self.num_labels}, classifier_dropout={self.classifier_dropout}, "
                f"loss_normalization={self.loss_normalization!r}, "
                f"shared_layers={self.shared_layers}, frozen_layers={self.frozen_layers!r}, "
                f"pooling={self.pooling!r}, head_kinds={self.head_kinds})")

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
        shared_layers=base.shared_layers, pooling=base.pooling, head_kinds=base.head_kinds)
