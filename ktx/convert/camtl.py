"""The authors' CA-MTL checkpoints (Pilault et al., 2021, github.com/CAMTL/CA-MTL) -> ktx
`ktx.models.camtl.CaMtlClassifierModel` parameters (`ktx import camtl:DIR OUT`).

A directory with `weights.safetensors` or `model.safetensors` (read with the
`safetensors` package; pickles are never loaded) and a config: `config.json`, or a
`reference.json` whose `config` holds the same keys:

    vocab_size, hidden_size, num_hidden_layers, num_attention_heads, intermediate_size,
    max_seq_length, tasks (names), num_labels ({task: n} or a list in task order)
    optional: max_position_embeddings (512), type_vocab_size (2), layer_norm_eps (1e-12),
    hidden_act ("gelu"), dropout (or hidden_dropout_prob / attention_probs_dropout_prob;
    0.1), variant ("base" / "large"; default: "large" when `bert.encoder.adapter_layer.*`
    tensors are present, else "base")

Name mapping (`bert.` prefix; torch `Linear` weights `[out, in]` are transposed, attention
heads split as `ktx.convert.hf_bert`; `L = bert.encoder.layer.i`, and Base's top layer
reads `new_attention`, `new_intermediate`, `new_output` for `attention`, ...):

    task_type_embeddings.weight                    conditioning/task_embeddings/embedding
    conditional_alignment.gb_weights               conditioning/alignment
    embeddings.*                                   embeddings/* (as hf_bert)
    encoder.task_transformation                    conditioning/task_transformation
    L.attention.self.{query,key,value}             layers_i/attention/{query,key,value}
    L.attention.self.random_weight_matrix          conditioning/layers_i/attention_bias/block_matrix
    L.attention.self.cond_block_diag_attn.gb_weights  conditioning/layers_i/attention_bias/film
    L.attention.output.dense                       layers_i/attention/out
    L.attention.output.LayerNorm.{weight,bias}     layers_i/attention_layer_norm/{scale,bias}
    L.attention.output.LayerNorm.ln_weight_modulation.gb_weights
                                                   conditioning/layers_i/attention_layer_norm/scale_film
    L.intermediate.dense / L.output.dense          layers_i/intermediate / layers_i/output
    L.output.LayerNorm (+ ln_weight_modulation)    layers_i/output_layer_norm (+ conditioning/...)
    L.adapter.bottleneck.{emb_transf, hidden_modulation.gb_weights, down_proj_layer,
      up_proj_layer}                               conditioning/layers_i/adapter/bottleneck/
                                                   {task_projection, film, down, up}   (Base, top)
    L.adapter.condlayernorm.{weight,bias}          conditioning/layers_i/adapter/layer_norm
    L.adapter.condlayernorm.ln_weight_modulation.gb_weights
                                                   conditioning/layers_i/adapter/layer_norm_film/scale_film
    encoder.adapter_layer.i.*                      conditioning/layers_i/bottleneck/*   (Large)
    pooler.dense                                   pooler
    decoders.t.model                               task_heads/task_t

Every missing, unexpected or mis-shaped tensor is one line of a ValueError naming the
tensor, its shape and the expected one.
"""

from __future__ import annotations

import math
import pathlib
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from ktx.convert import layout
from ktx.convert.hf_bert import bert_config_gin
from ktx.convert.safetensors_io import read_safetensors
from ktx.models import camtl as camtl_lib
from ktx.models.bert import HIDDEN_ACTS, BertConfig

__all__ = [
    "CaMtlCheckpointConfig",
    "CaMtlImported",
    "WEIGHT_FILES",
    "camtl_tensor_shapes",
    "check_params",
    "config_from_dict",
    "expected_shapes",
    "model_gin",
    "read_camtl",
]

WEIGHT_FILES = ("weights.safetensors", "model.safetensors")
CONFIG_FILES = ("config.json", "reference.json")
_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
             "intermediate_size", "max_seq_length", "tasks", "num_labels")


class CaMtlCheckpointConfig(NamedTuple):
    """What a CA-MTL checkpoint describes: the BERT shapes, the CA-MTL options, each
    task's head size and the task names (in task-id order)."""

    bert: BertConfig
    camtl: camtl_lib.CaMtlConfig
    num_labels: tuple[int, ...]
    tasks: tuple[str, ...]

    def model(self, **kwargs) -> camtl_lib.CaMtlClassifierModel:
        """The `CaMtlClassifierModel` these parameters belong to."""
        return camtl_lib.CaMtlClassifierModel(self.bert, camtl=self.camtl,
                                              num_labels=self.num_labels, **kwargs)


class CaMtlImported(NamedTuple):
    """A converted CA-MTL checkpoint: its config, the `params` of its
    `CaMtlClassifierModel` (nested dicts of float32 numpy arrays) and the source string."""

    config: CaMtlCheckpointConfig
    params: dict[str, Any]
    source: str
    partial_scopes: tuple[str, ...] = ()


def config_from_dict(values: Mapping[str, Any], *, variant: str | None = None,
                     where: str = "config") -> CaMtlCheckpointConfig:
    """The `CaMtlCheckpointConfig` of a config dict (the keys in the module docstring);
    `variant` is used when the dict has none. ValueError naming the field otherwise."""
    if not isinstance(values, Mapping):
        raise ValueError(f"{where}: a JSON object is required, got {type(values).__name__}")
    missing = [k for k in _REQUIRED if k not in values]
    if missing:
        raise ValueError(f"{where}: fields {missing} are missing; required: {list(_REQUIRED)}")
    tasks = values["tasks"]
    if isinstance(tasks, str) or not isinstance(tasks, list) or not tasks \
            or not all(isinstance(t, str) for t in tasks):
        raise ValueError(f"{where}: tasks={tasks!r}; accepted: a non-empty list of task names")
    labels = values["num_labels"]
    if isinstance(labels, Mapping):
        absent = [t for t in tasks if t not in labels]
        if absent:
            raise ValueError(f"{where}: num_labels={dict(labels)!r} has no entry for tasks {absent}")
        labels = [labels[t] for t in tasks]
    if not isinstance(labels, list) or len(labels) != len(tasks) or any(
            isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in labels):
        raise ValueError(f"{where}: num_labels={values['num_labels']!r}; accepted: one int >= 1 "
                         f"per task of {tasks}")
    act = values.get("hidden_act", "gelu")
    if act not in HIDDEN_ACTS:
        raise ValueError(f"{where}: hidden_act={act!r}; accepted: {sorted(HIDDEN_ACTS)}")
    dropout = values.get("dropout", values.get("hidden_dropout_prob", 0.1))
    attention_dropout = values.get("dropout", values.get("attention_probs_dropout_prob", 0.1))
    variant = values.get("variant", variant) or "base"
    try:
        config = BertConfig(
            vocab_size=values["vocab_size"], hidden_size=values["hidden_size"],
            num_layers=values["num_hidden_layers"], num_heads=values["num_attention_heads"],
            intermediate_size=values["intermediate_size"],
            max_position=values.get("max_position_embeddings", 512),
            type_vocab_size=values.get("type_vocab_size", 2), hidden_act=act,
            layer_norm_eps=float(values.get("layer_norm_eps", 1e-12)),
            dropout_rate=float(dropout), attention_dropout_rate=float(attention_dropout))
        options = camtl_lib.CaMtlConfig(variant=variant, max_seq_length=values["max_seq_length"])
        options.check(config)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from e
    return CaMtlCheckpointConfig(config, options, tuple(labels), tuple(tasks))


def expected_shapes(config: CaMtlCheckpointConfig) -> dict[str, tuple[int, ...]]:
    """`{ktx path: shape}` of the config's `CaMtlClassifierModel` (shapes only)."""
    return layout.model_shapes(config.model(), config.camtl.max_seq_length)


def _mapping(config: CaMtlCheckpointConfig) -> dict[str, tuple[str, bool]]:
    """`{torch name: (ktx path, is a Linear weight to transpose)}`."""
    m: dict[str, tuple[str, bool]] = {}

    def copy(torch: str, ktx: str) -> None:
        m[torch] = (ktx, False)

    def linear(torch: str, ktx: str) -> None:
        m[f"{torch}.weight"] = (f"{ktx}/kernel", True)
        m[f"{torch}.bias"] = (f"{ktx}/bias", False)

    def norm(torch: str, ktx: str) -> None:
        copy(f"{torch}.weight", f"{ktx}/scale")
        copy(f"{torch}.bias", f"{ktx}/bias")

    def bottleneck(torch: str, ktx: str) -> None:
        linear(f"{torch}.emb_transf", f"{ktx}/task_projection")
        linear(f"{torch}.hidden_modulation.gb_weights", f"{ktx}/film")
        linear(f"{torch}.down_proj_layer", f"{ktx}/down")
        linear(f"{torch}.up_proj_layer", f"{ktx}/up")

    c, options = config.bert, config.camtl
    n = c.num_layers
    copy("bert.task_type_embeddings.weight", "conditioning/task_embeddings/embedding")
    linear("bert.conditional_alignment.gb_weights", "conditioning/alignment")
    for part in ("word", "position", "token_type"):
        copy(f"bert.embeddings.{part}_embeddings.weight", f"embeddings/{part}_embeddings/embedding")
    norm("bert.embeddings.LayerNorm", "embeddings/layer_norm")
    linear("bert.encoder.task_transformation", "conditioning/task_transformation")
    for i in range(n):
        top = options.variant == "base" and i == n - 1
        new = "new_" if top else ""
        t, k, cond = f"bert.encoder.layer.{i}", f"layers_{i}", f"conditioning/layers_{i}"
        att = f"{t}.{new}attention"
        for name in ("query", "key", "value"):
            linear(f"{att}.self.{name}", f"{k}/attention/{name}")
        copy(f"{att}.self.random_weight_matrix", f"{cond}/attention_bias/block_matrix")
        linear(f"{att}.self.cond_block_diag_attn.gb_weights", f"{cond}/attention_bias/film")
        linear(f"{att}.output.dense", f"{k}/attention/out")
        norm(f"{att}.output.LayerNorm", f"{k}/attention_layer_norm")
        linear(f"{t}.{new}intermediate.dense", f"{k}/intermediate")
        linear(f"{t}.{new}output.dense", f"{k}/output")
        norm(f"{t}.{new}output.LayerNorm", f"{k}/output_layer_norm")
        if options.conditional_layer_norm(i, n):
            for torch, ktx in ((f"{att}.output.LayerNorm", "attention_layer_norm"),
                               (f"{t}.{new}output.LayerNorm", "output_layer_norm")):
                linear(f"{torch}.ln_weight_modulation.gb_weights", f"{cond}/{ktx}/scale_film")
        if top:
            bottleneck(f"{t}.adapter.bottleneck", f"{cond}/adapter/bottleneck")
            norm(f"{t}.adapter.condlayernorm", f"{cond}/adapter/layer_norm")
            linear(f"{t}.adapter.condlayernorm.ln_weight_modulation.gb_weights",
                   f"{cond}/adapter/layer_norm_film/scale_film")
        if options.variant == "large":
            bottleneck(f"bert.encoder.adapter_layer.{i}", f"{cond}/bottleneck")
    linear("bert.pooler.dense", "pooler")
    for task in range(len(config.num_labels)):
        linear(f"decoders.{task}.model", f"task_heads/task_{task}")
    return m


def _torch_shape(path: str, shapes: Mapping[str, tuple[int, ...]], transpose: bool) -> tuple[int, ...]:
    shape = shapes[path]
    if not transpose:
        return (math.prod(shape),) if path.endswith("/bias") else shape
    out = math.prod(shapes[path[: -len("kernel")] + "bias"])
    return (out, math.prod(shape) // out)


def camtl_tensor_shapes(config: CaMtlCheckpointConfig) -> dict[str, tuple[int, ...]]:
    """`{torch tensor name: shape}` of the authors' model for `config`."""
    shapes = expected_shapes(config)
    return {name: _torch_shape(path, shapes, t) for name, (path, t) in _mapping(config).items()}


def read_camtl(path: Any) -> CaMtlImported:
    """Reads an authors' CA-MTL checkpoint directory into ktx parameters.

    Raises FileNotFoundError (no directory, config or weights file) or ValueError (a bad
    config field; the tensors not matching it, each named with its shape and the
    expected one).
    """
    path = pathlib.Path(path).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"CA-MTL checkpoint directory {str(path)!r} does not exist")
    weights = next((path / n for n in WEIGHT_FILES if (path / n).is_file()), None)
    if weights is None:
        pickles = sorted(p.name for p in path.glob("*.bin"))
        hint = f" ({pickles} are pickles, never loaded: save them as safetensors)" if pickles else ""
        raise FileNotFoundError(f"{path}: no {' or '.join(WEIGHT_FILES)}{hint}")
    values, config_file = layout.read_config_file(path, CONFIG_FILES, "CA-MTL config")
    tensors = read_safetensors(weights)
    inferred = "large" if any(n.startswith("bert.encoder.adapter_layer.") for n in tensors) else "base"
    config = config_from_dict(values, variant=inferred, where=str(config_file))
    mapping = _mapping(config)
    shapes = expected_shapes(config)
    expected = {name: _torch_shape(p, shapes, t) for name, (p, t) in mapping.items()}
    lines = layout.tensor_mismatches(tensors, expected)
    if lines:
        c = config.bert
        raise ValueError(
            f"{weights}: the tensors do not match {config_file.name} (variant="
            f"{config.camtl.variant!r}, hidden_size={c.hidden_size}, num_hidden_layers="
            f"{c.num_layers}, max_seq_length={config.camtl.max_seq_length}, num_labels="
            f"{list(config.num_labels)}):\n" + "\n".join(lines))
    flat = {}
    for name, (p, transpose) in mapping.items():
        a = np.asarray(tensors[name], np.float32)
        flat[p] = np.ascontiguousarray((a.T if transpose else a).reshape(shapes[p]))
    return CaMtlImported(config, layout.unflatten(flat), f"camtl:{path}")


def check_params(flat: Mapping[str, Any], config: CaMtlCheckpointConfig, *, where: str) -> None:
    """ValueError naming every parameter of `flat` that the config's model lacks, misses
    or has with another shape."""
    layout.check_model_params(flat, expected_shapes(config), owner="CaMtlClassifierModel",
                              config=config, where=where)


def config_to_dict(config: CaMtlCheckpointConfig) -> dict[str, Any]:
    """JSON-able fields (checkpoint metadata)."""
    import dataclasses

    return {"bert": dataclasses.asdict(config.bert), "camtl": dataclasses.asdict(config.camtl),
            "num_labels": list(config.num_labels), "tasks": list(config.tasks)}


def model_gin(config: CaMtlCheckpointConfig, source: str = "") -> str:
    """A gin model file binding MODEL to the config's `CaMtlClassifierModel`."""
    c, o = config.bert, config.camtl
    return f"""# ktx CA-MTL ({o.variant}) matching {source or 'an imported checkpoint'} (written by `ktx import`).
# Tasks, in task-id order: {', '.join(config.tasks)}.
# Binds MODEL; include it as a model file, then start a run from the parameters with
#   --gin.INITIAL_CHECKPOINT_PATH="'<this directory>'"
from __gin__ import dynamic_registration
import ktx.models.bert as bert
import ktx.models.camtl as camtl

NUM_LABELS = {tuple(config.num_labels)!r}
VOCAB_SIZE = {c.vocab_size}  # the checkpoint's vocabulary: the tasks must use the same one
DROPOUT_RATE = {float(c.dropout_rate)!r}  # the checkpoint config's rate
ACTIVATION_DTYPE = {c.dtype!r}  # 'bfloat16' trains faster; parameters stay float32
LOSS_NORMALIZATION = 'global'
MAX_SEQ_LENGTH = {o.max_seq_length}  # every input is padded to exactly this length
FROZEN_LAYERS = 0  # 'half': BERT's embeddings and bottom half do not train (the paper)

MODEL = @camtl.CaMtlClassifierModel()
camtl.CaMtlClassifierModel:
  config = @bert.BertConfig()
  camtl = @camtl.CaMtlConfig()
  num_labels = %NUM_LABELS
  loss_normalization = %LOSS_NORMALIZATION
  frozen_layers = %FROZEN_LAYERS

camtl.CaMtlConfig:
  variant = {o.variant!r}
  max_seq_length = %MAX_SEQ_LENGTH
  layer_norm_form = {o.layer_norm_form!r}

{bert_config_gin(c)}"""
