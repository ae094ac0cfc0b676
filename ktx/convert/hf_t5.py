"""Hugging Face T5 directories <-> ktx T5 parameters.

A directory as `transformers`' `save_pretrained` writes it: `config.json` and
`model.safetensors` (or shards listed by `model.safetensors.index.json`). Handled:

* original T5 (`feed_forward_proj: relu`, one `DenseReluDense.wi`, tied embeddings, no
  `lm_head.weight`, decoder output scaled by `d_model^-0.5` before the tied projection):
  `T5Config(mlp_activations=("relu",), logits_via_embedding=True)`;
* T5.1.1 and the LM-adapted T5.1.1 (`gated-gelu`, `wi_0`/`wi_1`, own `lm_head.weight`,
  no scaling), and mT5 (`model_type: mt5`, the same network with a 250k vocabulary):
  `T5Config(mlp_activations=("gelu", "linear"), logits_via_embedding=False)`.

`config.json` decides the ktx model (`config_from_hf`); every tensor is then checked
against it and any difference is a ValueError naming the tensor, its shape and the
expected one. `pytorch_model.bin` (a pickle) is never loaded.

Name mapping (torch `Linear` weights are `[out, in]`; ktx kernels are `[in, out]` with
heads split: query/key/value `[E, H, D]`, out `[H, D, E]`):

    shared.weight [V, E]                                  token_embedder/embedding
    {enc,dec}oder.block.0.layer.0.SelfAttention.relative_attention_bias.weight [buckets, H]
                                                          {side}/relpos_bias/rel_embedding (transposed)
    encoder.block.i.layer.0.SelfAttention.{q,k,v,o}       encoder/layers_i/attention/{query,key,value,out}
    encoder.block.i.layer.0.layer_norm                    encoder/layers_i/pre_attention_layer_norm
    encoder.block.i.layer.1.DenseReluDense.{wi,wi_0,wi_1,wo}  encoder/layers_i/mlp/...
    encoder.block.i.layer.1.layer_norm                    encoder/layers_i/pre_mlp_layer_norm
    decoder.block.i.layer.0.SelfAttention / layer_norm    decoder/layers_i/self_attention / pre_self_attention_layer_norm
    decoder.block.i.layer.1.EncDecAttention / layer_norm  .../encoder_decoder_attention / pre_cross_attention_layer_norm
    decoder.block.i.layer.2.DenseReluDense / layer_norm   .../mlp / pre_mlp_layer_norm
    {encoder,decoder}.final_layer_norm.weight             {side}/{side}_norm/scale
    lm_head.weight [V, E]                                 decoder/logits_dense/kernel [E, V]
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from ktx.convert import layout
from ktx.convert.lazy import LazyArray, materialize
from ktx.convert.safetensors_io import lazy_safetensors, write_safetensors
from ktx.models.t5 import T5Config

__all__ = [
    "Imported",
    "FEED_FORWARD_PROJ",
    "config_from_hf",
    "hf_config",
    "hf_tensor_names",
    "read_hf_config",
    "read_hf_t5",
    "read_hf_tensors",
    "write_hf_t5",
]

# HF `feed_forward_proj` -> ktx activations. transformers runs "gated-gelu" with the tanh
# approximation (`gelu_new`), which is ktx's "gelu"; a plain "gelu" is the exact erf GELU,
# which ktx does not have.
FEED_FORWARD_PROJ = {
    "relu": ("relu",),
    "gated-relu": ("relu", "linear"),
    "gated-gelu": ("gelu", "linear"),
    "gelu_new": ("gelu",),
    "gated-gelu_new": ("gelu", "linear"),
    "silu": ("silu",),
    "gated-silu": ("silu", "linear"),
}
_EXPORT_PROJ = {v: k for k, v in FEED_FORWARD_PROJ.items() if k != "gated-gelu_new"}
_MODEL_TYPES = ("t5", "mt5")
_LAYER_NORM_EPSILON = 1e-6  # ktx's RMSNorm
_ATTENTION = {"q": "query", "k": "key", "v": "value", "o": "out"}


class Imported(NamedTuple):
    """A converted checkpoint: the ktx model shape and its parameters (nested dicts of
    float32 numpy arrays, the `params` collection of `t5.Transformer(config)`)."""

    config: T5Config
    params: dict[str, Any]
    source: str


def read_hf_config(path: str | os.PathLike, family: str) -> tuple[pathlib.Path, pathlib.Path, dict]:
    """`(directory, config.json path, its values)` of a Hugging Face checkpoint directory
    of `family` ("T5", "BERT": named in the errors). FileNotFoundError for a missing
    directory or config.json, ValueError for a config that is not JSON."""
    path = pathlib.Path(path).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"Hugging Face checkpoint directory {str(path)!r} does not exist")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{path}: no config.json (a Hugging Face {family} directory holds "
                                "config.json and model.safetensors)")
    try:
        values = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_file}: not valid JSON ({e})") from e
    return path, config_file, values


def config_from_hf(
    values: Mapping[str, Any], *, own_head: bool | None = None, where: str = "config.json"
) -> T5Config:
    """The `T5Config` a transformers T5 / mT5 `config.json` describes.

    The output layer: tied and scaled by `d_model^-0.5` (original T5) or an own, unscaled
    `lm_head` (T5.1.1, mT5). `own_head` (from the tensors: an `lm_head.weight` that is not
    the embedding) decides it when given, and must then agree with the config's
    `scale_decoder_outputs` (transformers 5) or `tie_word_embeddings` (earlier versions);
    otherwise `tie_word_embeddings` decides (default true).
    Raises ValueError naming the field, its value and what is accepted.
    """
    model_type = values.get("model_type")
    if model_type not in _MODEL_TYPES:
        raise ValueError(
            f"{where}: model_type={model_type!r}; accepted: {list(_MODEL_TYPES)} "
            "(T5, T5.1.1, LM-adapted T5.1.1, mT5)"
        )
    proj = values.get("feed_forward_proj", "relu")
    if proj not in FEED_FORWARD_PROJ:
        raise ValueError(
            f"{where}: feed_forward_proj={proj!r} is not supported; accepted: "
            f"{sorted(FEED_FORWARD_PROJ)} (a plain 'gelu' is the exact erf GELU, which ktx's "
            "T5 does not implement)"
        )
    eps = values.get("layer_norm_epsilon", _LAYER_NORM_EPSILON)
    if eps != _LAYER_NORM_EPSILON:
        raise ValueError(f"{where}: layer_norm_epsilon={eps!r}; ktx's T5 uses {_LAYER_NORM_EPSILON}")
    tie = bool(values.get("tie_word_embeddings", True))
    scaled = bool(values.get("scale_decoder_outputs", tie))
    tied = tie if own_head is None else not own_head
    if scaled != tied:
        field = "scale_decoder_outputs" if "scale_decoder_outputs" in values else "tie_word_embeddings"
        raise ValueError(
            f"{where}: {field}={scaled} but the weights have "
            + ("no own lm_head (tied logits)" if tied else "their own lm_head.weight")
            + "; ktx's T5 has tied logits scaled by d_model^-0.5 (original T5) or an untied, "
            "unscaled lm_head (T5.1.1, mT5)"
        )
    try:
        num_layers = values["num_layers"]
        decoder_layers = values.get("num_decoder_layers") or num_layers
        return T5Config(
            vocab_size=values["vocab_size"], emb_dim=values["d_model"],
            num_heads=values["num_heads"], head_dim=values["d_kv"], mlp_dim=values["d_ff"],
            num_encoder_layers=num_layers, num_decoder_layers=decoder_layers,
            mlp_activations=FEED_FORWARD_PROJ[proj],
            dropout_rate=float(values.get("dropout_rate", 0.1)),
            relative_attention_num_buckets=values.get("relative_attention_num_buckets", 32),
            relative_attention_max_distance=values.get("relative_attention_max_distance", 128),
            logits_via_embedding=tied,
        )
    except KeyError as e:
        raise ValueError(f"{where}: field {e.args[0]!r} is missing") from e
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from e


def hf_config(config: T5Config) -> dict[str, Any]:
    """A transformers `config.json` (T5ForConditionalGeneration) for `config`."""
    proj = _EXPORT_PROJ.get(tuple(config.mlp_activations))
    if proj is None:
        raise ValueError(
            f"T5Config.mlp_activations={config.mlp_activations} has no transformers "
            f"feed_forward_proj; exportable: {sorted(map(list, _EXPORT_PROJ))}"
        )
    gated = proj.startswith("gated-")
    act = proj.split("-")[-1]
    tied = bool(config.logits_via_embedding)
    return {
        "architectures": ["T5ForConditionalGeneration"],
        "classifier_dropout": 0.0,
        "d_ff": config.mlp_dim,
        "d_kv": config.head_dim,
        "d_model": config.emb_dim,
        "decoder_start_token_id": 0,
        "dense_act_fn": "gelu_new" if act == "gelu" else act,
        "dropout_rate": float(config.dropout_rate),
        "dtype": "float32",
        "eos_token_id": 1,
        "feed_forward_proj": proj,
        "initializer_factor": 1.0,
        "is_encoder_decoder": True,
        "is_gated_act": gated,
        "layer_norm_epsilon": _LAYER_NORM_EPSILON,
        "model_type": "t5",
        "num_decoder_layers": config.num_decoder_layers,
        "num_heads": config.num_heads,
        "num_layers": config.num_encoder_layers,
        "pad_token_id": 0,
        "relative_attention_max_distance": config.relative_attention_max_distance,
        "relative_attention_num_buckets": config.relative_attention_num_buckets,
        "scale_decoder_outputs": tied,
        "tie_word_embeddings": tied,
        "use_cache": True,
        "vocab_size": config.vocab_size,
    }


def _mapping(config: T5Config) -> dict[str, tuple[str, str]]:
    """`{hf name: (ktx path, kind)}`; kind: "copy", "t" (transpose), "in" (q/k/v:
    transpose, split heads), "out" (o: transpose, split heads)."""
    m: dict[str, tuple[str, str]] = {"shared.weight": ("token_embedder/embedding", "copy")}
    wi = ["wi"] if len(config.mlp_activations) == 1 else [
        f"wi_{i}" for i in range(len(config.mlp_activations))]

    def attention(hf: str, ktx: str) -> None:
        for short, name in _ATTENTION.items():
            m[f"{hf}.{short}.weight"] = (f"{ktx}/{name}/kernel", "out" if short == "o" else "in")

    def mlp(hf: str, ktx: str) -> None:
        for name in [*wi, "wo"]:
            m[f"{hf}.DenseReluDense.{name}.weight"] = (f"{ktx}/mlp/{name}/kernel", "t")
        m[f"{hf}.layer_norm.weight"] = (f"{ktx}/pre_mlp_layer_norm/scale", "copy")

    for i in range(config.num_encoder_layers):
        hf, ktx = f"encoder.block.{i}.layer", f"encoder/layers_{i}"
        attention(f"{hf}.0.SelfAttention", f"{ktx}/attention")
        m[f"{hf}.0.layer_norm.weight"] = (f"{ktx}/pre_attention_layer_norm/scale", "copy")
        mlp(f"{hf}.1", ktx)
    for i in range(config.num_decoder_layers):
        hf, ktx = f"decoder.block.{i}.layer", f"decoder/layers_{i}"
        attention(f"{hf}.0.SelfAttention", f"{ktx}/self_attention")
        m[f"{hf}.0.layer_norm.weight"] = (f"{ktx}/pre_self_attention_layer_norm/scale", "copy")
        attention(f"{hf}.1.EncDecAttention", f"{ktx}/encoder_decoder_attention")
        m[f"{hf}.1.layer_norm.weight"] = (f"{ktx}/pre_cross_attention_layer_norm/scale", "copy")
        mlp(f"{hf}.2", ktx)
    for side in ("encoder", "decoder"):
        m[f"{side}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"] = (
            f"{side}/relpos_bias/rel_embedding", "t")
        m[f"{side}.final_layer_norm.weight"] = (f"{side}/{side}_norm/scale", "copy")
    if not config.logits_via_embedding:
        m["lm_head.weight"] = ("decoder/logits_dense/kernel", "t")
    return m


def hf_tensor_names(config: T5Config) -> dict[str, tuple[int, ...]]:
    """`{transformers tensor name: shape}` of a T5ForConditionalGeneration for `config`."""
    shapes = layout.expected_shapes(config)
    out = {}
    for name, (path, kind) in _mapping(config).items():
        s = shapes[path]
        if kind == "in":
            out[name] = (s[1] * s[2], s[0])
        elif kind == "out":
            out[name] = (s[2], s[0] * s[1])
        else:
            out[name] = s[::-1] if kind == "t" else s
    return out


def _to_ktx(array: np.ndarray | LazyArray, kind: str, shape: tuple[int, ...]
            ) -> np.ndarray | LazyArray:
    if isinstance(array, LazyArray):  # converted region by region when placed
        return array.convert(transpose=kind != "copy", shape=shape)
    a = np.asarray(array, np.float32)
    if kind != "copy":
        a = a.T
    return np.ascontiguousarray(a.reshape(shape))


def _to_hf(array: np.ndarray, kind: str) -> np.ndarray:
    a = np.asarray(array, np.float32)
    if kind == "in":
        a = a.reshape(a.shape[0], -1)
    elif kind == "out":
        a = a.reshape(-1, a.shape[-1])
    return np.ascontiguousarray(a if kind == "copy" else a.T)


_PICKLE_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json")


def _weight_files(path: pathlib.Path) -> dict[str, pathlib.Path]:
    """`{tensor name: safetensors file}` from `model.safetensors` or its shard index."""
    index = path / "model.safetensors.index.json"
    single = path / "model.safetensors"
    if single.is_file():
        return {"": single}
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: not a safetensors index (no 'weight_map' object)") from e
        files = {name: path / file for name, file in weight_map.items()}
        for name, file in files.items():
            if not file.is_file():
                raise FileNotFoundError(f"{index}: shard {file.name} (holding {name!r}) does not exist")
        return files
    pickles = [f for f in _PICKLE_FILES if (path / f).exists()]
    if pickles:
        raise ValueError(
            f"{path} holds only {pickles[0]} (a pickle: ktx does not load pickles, they can "
            "execute code). Convert it to safetensors first, in an environment with "
            "transformers: T5ForConditionalGeneration.from_pretrained(DIR)"
            ".save_pretrained(NEW_DIR, safe_serialization=True)"
        )
    raise FileNotFoundError(
        f"{path}: no model.safetensors or model.safetensors.index.json (a Hugging Face T5 "
        f"directory holds config.json and its weights); found {sorted(p.name for p in path.iterdir())}"
    )


def read_hf_tensors(path: pathlib.Path) -> Mapping[str, LazyArray]:
    """Every tensor of a Hugging Face directory's safetensors weights (one file or an
    index of shards) as `LazyArray`s (nothing is read until indexed); a pickle-only
    directory is refused."""
    files = _weight_files(path)
    if "" in files:
        return lazy_safetensors(files[""])
    tensors: dict[str, LazyArray] = {}
    opened: dict[pathlib.Path, Mapping[str, LazyArray]] = {}
    for name, file in files.items():
        if file not in opened:
            opened[file] = lazy_safetensors(file)
        if name not in opened[file]:
            raise ValueError(f"{file}: tensor {name!r} listed by model.safetensors.index.json is absent")
        tensors[name] = opened[file][name]
    return tensors


def read_hf_t5(path: str | os.PathLike, *, lazy: bool = False) -> Imported:
    """Reads a Hugging Face T5 / T5.1.1 / mT5 directory into ktx parameters (numpy
    float32; `lazy=True`: `ktx.convert.lazy.LazyArray`s, read when placed).

    Raises FileNotFoundError (missing directory, config.json or weights) or ValueError
    (unsupported config, a pickle-only directory, a truncated file, a tensor missing,
    unexpected or of the wrong shape — named with its shape and the expected one).
    """
    path, config_file, values = read_hf_config(path, "T5")
    tensors = dict(read_hf_tensors(path))
    shared = tensors.get("shared.weight")
    # Files converted from pytorch_model.bin may carry copies of the shared embedding, and
    # a tied checkpoint may store lm_head.weight as one.
    for copy in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight"):
        if copy in tensors and shared is not None and tensors[copy].shape == shared.shape \
                and np.array_equal(tensors[copy], shared):
            del tensors[copy]
    own_head = "lm_head.weight" in tensors
    if not own_head and not values.get("tie_word_embeddings", True):
        own_head = None  # the config's untied head: reported below as a missing tensor
    config = config_from_hf(values, own_head=own_head, where=str(config_file))
    expected = hf_tensor_names(config)
    fields = (f"d_model={config.emb_dim}, num_heads={config.num_heads}, d_kv={config.head_dim}, "
              f"d_ff={config.mlp_dim}, vocab_size={config.vocab_size}, "
              f"relative_attention_num_buckets={config.relative_attention_num_buckets}")
    lines = layout.tensor_mismatches(tensors, expected)
    if lines:
        raise ValueError(
            f"{path}: the tensors do not match config.json ({fields}; "
            f"feed_forward_proj={values.get('feed_forward_proj', 'relu')!r}, "
            f"tie_word_embeddings={config.logits_via_embedding}):\n" + "\n".join(lines)
        )
    shapes = layout.expected_shapes(config)
    flat = {p: _to_ktx(tensors[name], kind, shapes[p]) for name, (p, kind) in _mapping(config).items()}
    layout.check_params(flat, config, where=str(path))
    return Imported(config, layout.unflatten(materialize(flat, lazy)), f"hf:{path}")


def write_hf_t5(params: Mapping[str, Any], config: T5Config, path: str | os.PathLike) -> pathlib.Path:
    """Writes ktx T5 parameters as a Hugging Face T5 directory (`config.json`,
    `generation_config.json`, `model.safetensors`, float32).

    `path` must not exist or be empty. The files are written to a temporary sibling and
    moved into place at the end, so a failure leaves nothing behind. Raises ValueError
    naming any parameter with no transformers counterpart (e.g. task conditioning) or of
    the wrong shape.
    """
    from ktx.convert.atomic import atomic_directory

    flat = {k: np.asarray(v) for k, v in layout.flatten(params).items()}
    extra = sorted(p for p in flat if p not in layout.expected_shapes(config))
    if extra:
        shown = ", ".join(extra[:8]) + (f", ... ({len(extra)} in all)" if len(extra) > 8 else "")
        raise ValueError(
            f"{len(extra)} parameters have no Hugging Face T5 counterpart: {shown}. They exist "
            "only in ktx: export them alone to conditioning:FILE, the backbone with "
            "--backbone_only"
        )
    layout.check_params(flat, config, where="the parameters")
    config_json = hf_config(config)
    tensors = {name: _to_hf(flat[p], kind) for name, (p, kind) in _mapping(config).items()}
    with atomic_directory(path) as tmp:
        (tmp / "config.json").write_text(json.dumps(config_json, indent=2, sort_keys=True) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(
            {"decoder_start_token_id": 0, "eos_token_id": 1, "pad_token_id": 0}, indent=2) + "\n")
        write_safetensors(tmp / "model.safetensors", tensors, {"format": "pt"})
    return pathlib.Path(path).expanduser().absolute()
