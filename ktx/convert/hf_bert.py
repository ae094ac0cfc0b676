"""Hugging Face BERT directories <-> ktx BERT parameters (`ktx.models.bert.BertEncoder`).

A directory as transformers' `save_pretrained` (or sentence-transformers) writes it:
`config.json` with `model_type: bert` and `model.safetensors` (or shards listed by
`model.safetensors.index.json`). Other files (tokenizer, sentence-transformers'
`modules.json`, `1_Pooling/config.json`, ...) are ignored; `pytorch_model.bin` (a pickle)
is never loaded.

Tensor names are accepted with the `bert.` prefix (`BertForMaskedLM`, `BertForPreTraining`)
or without it (`BertModel`, sentence-transformers). The pooler (absent from
`BertForMaskedLM`) and the MLM head (absent from `BertModel`) are optional; the NSP head
(`cls.seq_relationship.*`) and the `embeddings.position_ids` buffer are skipped; any other
tensor, a missing one or a wrong shape is a ValueError naming the tensor, its shape and
the expected one.

Name mapping (torch `Linear` weights are `[out, in]`; ktx kernels `[in, out]`, attention
heads split: query/key/value `[E, H, D]`, out `[H, D, E]`):

    embeddings.{word,position,token_type}_embeddings.weight   embeddings/{...}/embedding
    embeddings.LayerNorm.{weight,bias}                        embeddings/layer_norm/{scale,bias}
    encoder.layer.i.attention.self.{query,key,value}          layers_i/attention/{query,key,value}
    encoder.layer.i.attention.output.dense                    layers_i/attention/out
    encoder.layer.i.attention.output.LayerNorm                layers_i/attention_layer_norm
    encoder.layer.i.intermediate.dense                        layers_i/intermediate
    encoder.layer.i.output.dense                              layers_i/output
    encoder.layer.i.output.LayerNorm                          layers_i/output_layer_norm
    pooler.dense                                              pooler
    cls.predictions.transform.dense                           mlm/transform
    cls.predictions.transform.LayerNorm                       mlm/layer_norm
    cls.predictions.bias [V]                                  mlm/bias
    cls.predictions.decoder.weight / .bias                    tied: must equal the word
                                                              embeddings / cls.predictions.bias

`write_hf_bert` writes the same layout back: `BertForMaskedLM` names (`bert.` prefix,
`cls.predictions.*`) when the parameters hold the MLM head, else `BertModel` names (no
prefix, the pooler when present), float32 safetensors and a `config.json` transformers
reads.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from ktx.convert import layout
from ktx.convert.hf_t5 import read_hf_config, read_hf_tensors
from ktx.convert.lazy import materialize
from ktx.models.bert import HIDDEN_ACTS, BertConfig, BertEncoder

__all__ = [
    "BertImported",
    "MODEL_TYPES",
    "PARTIAL_SCOPES",
    "bert_config_from_hf",
    "check_params",
    "config_to_dict",
    "model_gin",
    "expected_shapes",
    "hf_bert_tensor_names",
    "is_hf_bert",
    "read_hf_bert",
    "write_hf_bert",
]

MODEL_TYPES = ("bert",)
# Top-level parameter scopes a model started from a BERT checkpoint may have without the
# checkpoint holding them (task heads; the pooler of an MLM checkpoint) or may leave unused
# (the MLM head of a classifier; the new top layers `shared_layers` of
# `EncoderClassifierModel(shared_layers=k)`): `ktx.training.initial_params.load_initial_params`
# initializes or skips them and reports it.
PARTIAL_SCOPES = ("pooler", "mlm", "task_heads", "shared_layers")
_ACT_ALIASES = {"gelu_pytorch_tanh": "gelu_new", "gelu_fast": "gelu_new"}
_SKIPPED = ("embeddings.position_ids", "cls.seq_relationship.weight", "cls.seq_relationship.bias")


class BertImported(NamedTuple):
    """A converted BERT checkpoint: its `BertConfig`, the `params` of `BertEncoder(config)`
    (nested dicts of float32 numpy arrays; `pooler` / `mlm` only when the checkpoint has
    them) and the source string."""

    config: BertConfig
    params: dict[str, Any]
    source: str
    partial_scopes: tuple[str, ...] = PARTIAL_SCOPES


def bert_config_from_hf(values: Mapping[str, Any], *, where: str = "config.json") -> BertConfig:
    """The `BertConfig` of a transformers BERT `config.json`. Raises ValueError naming the
    field, its value and what is accepted."""
    model_type = values.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"{where}: model_type={model_type!r}; accepted: {list(MODEL_TYPES)}")
    pos = values.get("position_embedding_type", "absolute")
    if pos != "absolute":
        raise ValueError(f"{where}: position_embedding_type={pos!r}; accepted: 'absolute'")
    act = values.get("hidden_act", "gelu")
    act = _ACT_ALIASES.get(act, act)
    if act not in HIDDEN_ACTS:
        raise ValueError(
            f"{where}: hidden_act={values.get('hidden_act')!r}; accepted: "
            f"{sorted([*HIDDEN_ACTS, *_ACT_ALIASES])}"
        )
    if values.get("is_decoder") or values.get("add_cross_attention"):
        raise ValueError(f"{where}: is_decoder/add_cross_attention set; ktx's BERT is an encoder")
    try:
        return BertConfig(
            vocab_size=values["vocab_size"], hidden_size=values["hidden_size"],
            num_layers=values["num_hidden_layers"], num_heads=values["num_attention_heads"],
            intermediate_size=values["intermediate_size"],
            max_position=values.get("max_position_embeddings", 512),
            type_vocab_size=values.get("type_vocab_size", 2), hidden_act=act,
            layer_norm_eps=float(values.get("layer_norm_eps", 1e-12)),
            dropout_rate=float(values.get("hidden_dropout_prob", 0.1)),
            attention_dropout_rate=float(values.get("attention_probs_dropout_prob", 0.1)),
        )
    except KeyError as e:
        raise ValueError(f"{where}: field {e.args[0]!r} is missing") from e
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from e


def expected_shapes(config: BertConfig) -> dict[str, tuple[int, ...]]:
    """`{ktx path: shape}` of `BertEncoder(config)` with pooler and MLM head (shapes only)."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    ids = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    abstract = jax.eval_shape(
        lambda i: BertEncoder(config).init(jax.random.key(0), i, mlm=True), ids)
    flat = layout.flatten(nn.unbox(abstract)["params"])
    return {k: tuple(v.shape) for k, v in flat.items()}


def _mapping(config: BertConfig) -> dict[str, tuple[str, bool]]:
    """`{hf name (unprefixed): (ktx path, transpose)}`."""
    m: dict[str, tuple[str, bool]] = {}
    for part in ("word", "position", "token_type"):
        m[f"embeddings.{part}_embeddings.weight"] = (f"embeddings/{part}_embeddings/embedding", False)

    def dense(hf: str, ktx: str) -> None:
        m[f"{hf}.weight"] = (f"{ktx}/kernel", True)
        m[f"{hf}.bias"] = (f"{ktx}/bias", False)

    def norm(hf: str, ktx: str) -> None:
        m[f"{hf}.weight"] = (f"{ktx}/scale", False)
        m[f"{hf}.bias"] = (f"{ktx}/bias", False)

    norm("embeddings.LayerNorm", "embeddings/layer_norm")
    for i in range(config.num_layers):
        hf, ktx = f"encoder.layer.{i}", f"layers_{i}"
        for name in ("query", "key", "value"):
            dense(f"{hf}.attention.self.{name}", f"{ktx}/attention/{name}")
        dense(f"{hf}.attention.output.dense", f"{ktx}/attention/out")
        norm(f"{hf}.attention.output.LayerNorm", f"{ktx}/attention_layer_norm")
        dense(f"{hf}.intermediate.dense", f"{ktx}/intermediate")
        dense(f"{hf}.output.dense", f"{ktx}/output")
        norm(f"{hf}.output.LayerNorm", f"{ktx}/output_layer_norm")
    dense("pooler.dense", "pooler")
    dense("cls.predictions.transform.dense", "mlm/transform")
    norm("cls.predictions.transform.LayerNorm", "mlm/layer_norm")
    m["cls.predictions.bias"] = ("mlm/bias", False)
    return m


def hf_bert_tensor_names(config: BertConfig) -> dict[str, tuple[int, ...]]:
    """`{transformers tensor name (without `bert.`): shape}` for `config`, pooler and MLM
    head included."""
    shapes = expected_shapes(config)
    out = {}
    for name, (path, transpose) in _mapping(config).items():
        s = shapes[path]
        if transpose:  # torch [out, in]: split axes flattened
            if path.endswith("attention/out/kernel"):
                out[name] = (s[2], s[0] * s[1])
            elif len(s) == 3:
                out[name] = (s[1] * s[2], s[0])
            else:
                out[name] = (s[1], s[0])
        else:
            out[name] = (int(np.prod(s)),) if len(s) == 2 and "bias" in path else s
    return out


def _strip(tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {}
    for name in tensors:
        key = name[len("bert."):] if name.startswith("bert.") else name
        if key in out:
            raise ValueError(f"tensor {key!r} is stored both with and without the 'bert.' prefix")
        out[key] = tensors[name]
    return out


def is_hf_bert(path: str | os.PathLike) -> bool:
    """Whether `path/config.json` declares a BERT `model_type`."""
    config_file = pathlib.Path(path).expanduser() / "config.json"
    try:
        return json.loads(config_file.read_text()).get("model_type") in MODEL_TYPES
    except (OSError, ValueError, AttributeError):
        return False


def read_hf_bert(path: str | os.PathLike, *, lazy: bool = False) -> BertImported:
    """Reads a Hugging Face BERT directory into ktx `BertEncoder` parameters.

    Raises FileNotFoundError (missing directory, config.json or weights) or ValueError
    (unsupported config, pickle-only directory, a tensor missing, unexpected or of the
    wrong shape, an untied MLM decoder).
    """
    path, config_file, values = read_hf_config(path, "BERT")
    config = bert_config_from_hf(values, where=str(config_file))
    tensors = _strip(read_hf_tensors(path))
    for name in _SKIPPED:
        tensors.pop(name, None)
    word = tensors.get("embeddings.word_embeddings.weight")
    for name, same_as in (("cls.predictions.decoder.weight", word),
                          ("cls.predictions.decoder.bias", tensors.get("cls.predictions.bias"))):
        if name in tensors:
            if same_as is None or tensors[name].shape != same_as.shape or not np.array_equal(
                    tensors[name], same_as):
                raise ValueError(
                    f"{path}: tensor {name} {list(tensors[name].shape)} differs from the tensor "
                    "it is tied to (ktx's MLM head is tied to the word embeddings)")
            del tensors[name]
    expected = hf_bert_tensor_names(config)
    optional = {n for n in expected if n.startswith(("pooler.", "cls."))}
    groups = {"pooler.": "pooler", "cls.": "MLM head"}
    lines = []
    for prefix, label in groups.items():
        names = [n for n in expected if n.startswith(prefix)]
        present = [n for n in names if n in tensors]
        if present and len(present) != len(names):
            lines += [f"  tensor {n} is missing (the {label} is partly present; expected shape "
                      f"{list(expected[n])})" for n in names if n not in tensors]
    lines += layout.tensor_mismatches(tensors, expected, optional)
    if lines:
        fields = (f"hidden_size={config.hidden_size}, num_hidden_layers={config.num_layers}, "
                  f"num_attention_heads={config.num_heads}, intermediate_size="
                  f"{config.intermediate_size}, vocab_size={config.vocab_size}, "
                  f"max_position_embeddings={config.max_position}, type_vocab_size="
                  f"{config.type_vocab_size}")
        raise ValueError(f"{path}: the tensors do not match config.json ({fields}):\n"
                         + "\n".join(lines))
    shapes = expected_shapes(config)
    flat = {}
    for name, (p, transpose) in _mapping(config).items():
        if name in tensors:  # LazyArrays: read region by region when placed
            flat[p] = tensors[name].convert(transpose=transpose, shape=shapes[p])
    return BertImported(config, layout.unflatten(materialize(flat, lazy)), f"hf:{path}")


def config_to_dict(config: BertConfig) -> dict[str, Any]:
    """JSON-able fields of a `BertConfig`."""
    import dataclasses

    return dataclasses.asdict(config)


def check_params(flat: Mapping[str, Any], config: BertConfig, *, where: str) -> None:
    """ValueError naming every parameter of `flat` (`{path: array}`) that `BertEncoder(config)`
    lacks, misses (the optional pooler / MLM head aside) or has with another shape."""
    shapes = expected_shapes(config)
    lines = [f"  {p}: shape {list(np.shape(v))}, expected {list(shapes[p])}"
             for p, v in flat.items() if p in shapes and tuple(np.shape(v)) != shapes[p]]
    lines += [f"  {p}: not a parameter of BertEncoder" for p in flat if p not in shapes]
    lines += [f"  {p}: missing (shape {list(s)})" for p, s in shapes.items()
              if p not in flat and p.split("/")[0] not in PARTIAL_SCOPES]
    if lines:
        raise ValueError(f"{where}: the parameters do not match {config}:\n" + "\n".join(lines))


def bert_config_gin(config: BertConfig) -> str:
    """The `bert.BertConfig` bindings of `config`'s shape (vocabulary, dropout and dtype
    left to the macros VOCAB_SIZE, DROPOUT_RATE and ACTIVATION_DTYPE), for model.gin files."""
    return f"""bert.BertConfig:
  vocab_size = %VOCAB_SIZE
  hidden_size = {config.hidden_size}
  num_layers = {config.num_layers}
  num_heads = {config.num_heads}
  intermediate_size = {config.intermediate_size}
  max_position = {config.max_position}
  type_vocab_size = {config.type_vocab_size}
  hidden_act = {config.hidden_act!r}
  layer_norm_eps = {float(config.layer_norm_eps)!r}
  dropout_rate = %DROPOUT_RATE
  attention_dropout_rate = {float(config.attention_dropout_rate)!r}
  dtype = %ACTIVATION_DTYPE
"""


def model_gin(config: BertConfig, source: str = "") -> str:
    """A gin model file (the layout of gin/models/bert_base.gin) binding MODEL to an
    `EncoderClassifierModel` of `config`'s shape."""
    return f"""# ktx BERT encoder matching {source or 'an imported checkpoint'} (written by `ktx import`).
# Binds MODEL; include it as a model file, then start a run from the parameters with
#   --gin.INITIAL_CHECKPOINT_PATH="'<this directory>'"
# (the task heads, and a pooler the checkpoint lacks, start from their initializers).
from __gin__ import dynamic_registration
import ktx.models.bert as bert
import ktx.models.encoder as encoder

NUM_TASKS = 1
NUM_LABELS = 2  # every task's head (1 = regression); or bind num_labels to a tuple
VOCAB_SIZE = {config.vocab_size}  # the checkpoint's vocabulary: the tasks must use the same one
DROPOUT_RATE = {float(config.dropout_rate)!r}  # the checkpoint config's rate
ACTIVATION_DTYPE = {config.dtype!r}  # 'bfloat16' trains faster; parameters stay float32
LOSS_NORMALIZATION = 'global'

MODEL = @encoder.EncoderClassifierModel()
encoder.EncoderClassifierModel:
  config = @bert.BertConfig()
  num_tasks = %NUM_TASKS
  num_labels = %NUM_LABELS
  loss_normalization = %LOSS_NORMALIZATION

{bert_config_gin(config)}"""


def hf_bert_config(config: BertConfig, *, mlm: bool) -> dict[str, Any]:
    """A transformers `config.json` for `config` (`BertForMaskedLM` when `mlm`, else
    `BertModel`)."""
    return {
        "architectures": ["BertForMaskedLM" if mlm else "BertModel"],
        "attention_probs_dropout_prob": float(config.attention_dropout_rate),
        "hidden_act": config.hidden_act,
        "hidden_dropout_prob": float(config.dropout_rate),
        "hidden_size": config.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": config.intermediate_size,
        "layer_norm_eps": float(config.layer_norm_eps),
        "max_position_embeddings": config.max_position,
        "model_type": "bert",
        "num_attention_heads": config.num_heads,
        "num_hidden_layers": config.num_layers,
        "pad_token_id": 0,
        "position_embedding_type": "absolute",
        "tie_word_embeddings": True,
        "type_vocab_size": config.type_vocab_size,
        "vocab_size": config.vocab_size,
    }


def write_hf_bert(params: Mapping[str, Any], config: BertConfig, path: str | os.PathLike
                  ) -> pathlib.Path:
    """Writes ktx BERT parameters (`BertEncoder(config)`'s, the pooler and MLM head when
    present) as a Hugging Face BERT directory; `path` must be new or empty, nothing is
    written on failure. ValueError naming parameters with no transformers counterpart
    (task heads, method parameters) or of the wrong shape."""
    from ktx.convert.atomic import atomic_directory
    from ktx.convert.safetensors_io import write_safetensors

    flat = {k: np.asarray(v, np.float32) for k, v in layout.flatten(params).items()}
    mapping = _mapping(config)
    known = {p for p, _ in mapping.values()}
    extra = sorted(p for p in flat if p not in known)
    if extra:
        shown = ", ".join(extra[:8]) + (f", ... ({len(extra)} in all)" if len(extra) > 8 else "")
        raise ValueError(f"{len(extra)} parameters have no Hugging Face BERT counterpart: {shown}")
    check_params(flat, config, where="the parameters")
    mlm = any(p.startswith("mlm/") for p in flat)
    prefix = "bert." if mlm else ""
    tensors = {}
    for name, (p, transpose) in mapping.items():
        if p not in flat:
            continue  # the optional pooler / MLM head
        a = flat[p]
        if transpose:  # [in, out] (heads split) -> torch Linear [out, in]
            a = a.reshape(-1, a.shape[-1]) if p.endswith("attention/out/kernel") else a.reshape(a.shape[0], -1)
            a = a.T
        else:
            a = a.reshape(-1) if p.endswith("/bias") else a
        tensors[name if name.startswith("cls.") else prefix + name] = a
    with atomic_directory(path) as tmp:
        (tmp / "config.json").write_text(
            json.dumps(hf_bert_config(config, mlm=mlm), indent=2, sort_keys=True) + "\n")
        write_safetensors(tmp / "model.safetensors", tensors, {"format": "pt"})
    return pathlib.Path(path).expanduser().absolute()
