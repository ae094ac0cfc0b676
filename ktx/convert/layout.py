"""The ktx T5 parameter layout: names and shapes from a `T5Config`, and back.

Parameters are handled here as flat `{'/'-joined path: np.ndarray}` dicts (the paths of
`ktx.treepath.name`, e.g. `encoder/layers_0/attention/query/kernel`); `unflatten`
gives the nested dict a flax `Transformer` takes as `{"params": ...}`.

`expected_shapes(config)` is what `ktx.models.t5.Transformer(config)` creates (checked by
a test against `jax.eval_shape` of its `init`); `check_params` compares a converted tree
with it and names every missing, unexpected or mis-shaped tensor.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from ktx.models.t5 import T5Config
from ktx.treepath import flatten, unflatten  # noqa: F401 - part of this module's API

__all__ = [
    "read_config_file",
    "flatten",
    "unflatten",
    "expected_shapes",
    "check_params",
    "model_shapes",
    "check_model_params",
    "config_from_params",
    "config_to_dict",
    "config_from_dict",
]


def model_shapes(model: Any, length: int) -> dict[str, tuple[int, ...]]:
    """`{path: shape}` of an encoder model's parameters (shapes only: `jax.eval_shape` of
    its `init_variables` on inputs of `length` tokens)."""
    import flax.linen as nn
    import jax

    abstract = jax.eval_shape(model.init_variables, jax.random.key(0),
                              model.input_spec(1, {"inputs": length}))
    return {k: tuple(v.shape) for k, v in flatten(nn.unbox(abstract)["params"]).items()}


def check_model_params(flat: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], *,
                       owner: str, config: Any, where: str) -> None:
    """ValueError naming every parameter of `flat` that `owner` (the model class, shapes
    `shapes`) lacks, misses or has with another shape."""
    lines = [f"  {p}: shape {list(np.shape(v))}, expected {list(shapes[p])}"
             for p, v in flat.items() if p in shapes and tuple(np.shape(v)) != shapes[p]]
    lines += [f"  {p}: not a parameter of {owner}" for p in flat if p not in shapes]
    lines += [f"  {p}: missing (shape {list(s)})" for p, s in shapes.items() if p not in flat]
    if lines:
        raise ValueError(f"{where}: the parameters do not match {config}:\n" + "\n".join(lines))


def _mlp_names(config: T5Config) -> list[str]:
    n = len(config.mlp_activations)
    return ["wi"] if n == 1 else [f"wi_{i}" for i in range(n)]


def expected_shapes(config: T5Config) -> dict[str, tuple[int, ...]]:
    """`{path: shape}` of every parameter of `t5.Transformer(config)` (all float32)."""
    e, h, d, f = config.emb_dim, config.num_heads, config.head_dim, config.mlp_dim
    shapes: dict[str, tuple[int, ...]] = {"token_embedder/embedding": (config.vocab_size, e)}

    def attention(prefix: str) -> None:
        for name in ("query", "key", "value"):
            shapes[f"{prefix}/{name}/kernel"] = (e, h, d)
        shapes[f"{prefix}/out/kernel"] = (h, d, e)

    def mlp(prefix: str) -> None:
        for name in _mlp_names(config):
            shapes[f"{prefix}/mlp/{name}/kernel"] = (e, f)
        shapes[f"{prefix}/mlp/wo/kernel"] = (f, e)

    for side, layers in (("encoder", config.num_encoder_layers), ("decoder", config.num_decoder_layers)):
        shapes[f"{side}/relpos_bias/rel_embedding"] = (h, config.relative_attention_num_buckets)
        for i in range(layers):
            prefix = f"{side}/layers_{i}"
            if side == "encoder":
                norms = ("pre_attention_layer_norm", "pre_mlp_layer_norm")
                attention(f"{prefix}/attention")
            else:
                norms = ("pre_self_attention_layer_norm", "pre_cross_attention_layer_norm",
                         "pre_mlp_layer_norm")
                attention(f"{prefix}/self_attention")
                attention(f"{prefix}/encoder_decoder_attention")
            for norm in norms:
                shapes[f"{prefix}/{norm}/scale"] = (e,)
            mlp(prefix)
        shapes[f"{side}/{side}_norm/scale"] = (e,)
    if not config.logits_via_embedding:
        shapes["decoder/logits_dense/kernel"] = (e, config.vocab_size)
    return shapes


def check_params(flat: Mapping[str, Any], config: T5Config, *, where: str) -> None:
    """Raises ValueError naming every parameter of `flat` that is missing, unexpected or
    of another shape than `config` says (`where`: the source, for the message)."""
    expected = expected_shapes(config)
    lines = []
    for path, shape in expected.items():
        if path not in flat:
            lines.append(f"  {path}: missing (expected shape {list(shape)})")
        elif tuple(np.shape(flat[path])) != shape:
            lines.append(f"  {path}: shape {list(np.shape(flat[path]))}, expected {list(shape)}")
    lines += [f"  {path}: not a parameter of this T5 model" for path in flat if path not in expected]
    if lines:
        raise ValueError(f"{where} does not match the T5 model its config describes "
                         f"({len(lines)} tensors):\n" + "\n".join(lines))


def config_from_params(
    flat: Mapping[str, Any],
    *,
    mlp_activations: tuple[str, ...] | None = None,
    relative_attention_max_distance: int = 128,
    dropout_rate: float = 0.0,
    where: str = "params",
) -> T5Config:
    """The `T5Config` whose parameters have `flat`'s shapes.

    Shapes give every size; they do not give the MLP activations (default: T5.1.1's
    gated GELU with `wi_0`/`wi_1`, original T5's ReLU with one `wi`) nor the relative
    position max distance (default 128, every public T5). Raises ValueError naming what
    is not a T5 parameter layout.
    """
    def shape(path: str) -> tuple[int, ...]:
        if path not in flat:
            raise ValueError(
                f"{where} is not a T5 encoder-decoder: no {path!r} (it has "
                f"{len(flat)} tensors, e.g. {sorted(flat)[:5]})"
            )
        return tuple(np.shape(flat[path]))

    vocab, emb = shape("token_embedder/embedding")
    _, heads, head_dim = shape("encoder/layers_0/attention/query/kernel")
    _, buckets = shape("encoder/relpos_bias/rel_embedding")

    def count(side: str) -> int:
        n = 0
        while any(p.startswith(f"{side}/layers_{n}/") for p in flat):
            n += 1
        return n

    wi = sorted(p.rsplit("/", 2)[1] for p in flat
                if p.startswith("encoder/layers_0/mlp/wi") and p.endswith("/kernel"))
    if wi == ["wi"]:
        default_acts: tuple[str, ...] = ("relu",)
    elif wi == [f"wi_{i}" for i in range(len(wi))] and wi:
        default_acts = ("gelu",) + ("linear",) * (len(wi) - 1)
    else:
        raise ValueError(f"{where}: encoder/layers_0/mlp has kernels {wi}; expected wi or wi_0, wi_1")
    acts = tuple(mlp_activations) if mlp_activations is not None else default_acts
    if len(acts) != len(wi):
        raise ValueError(f"{where}: mlp_activations={acts} needs {len(acts)} wi kernels, found {wi}")
    mlp_dim = shape(f"encoder/layers_0/mlp/{wi[0]}/kernel")[1]
    config = T5Config(
        vocab_size=vocab, emb_dim=emb, num_heads=heads, head_dim=head_dim, mlp_dim=mlp_dim,
        num_encoder_layers=count("encoder"), num_decoder_layers=count("decoder"),
        mlp_activations=acts, dropout_rate=dropout_rate,
        relative_attention_num_buckets=buckets,
        relative_attention_max_distance=relative_attention_max_distance,
        logits_via_embedding="decoder/logits_dense/kernel" not in flat,
    )
    check_params(flat, config, where=where)
    return config


_CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(T5Config))


def config_to_dict(config: T5Config) -> dict[str, Any]:
    """JSON-able fields of a `T5Config`."""
    out = dataclasses.asdict(config)
    out["mlp_activations"] = list(config.mlp_activations)
    return out


def config_from_dict(values: Mapping[str, Any]) -> T5Config:
    """Inverse of `config_to_dict`; unknown keys are a ValueError naming them."""
    unknown = sorted(set(values) - set(_CONFIG_FIELDS))
    if unknown:
        raise ValueError(f"T5Config fields {unknown} unknown; accepted: {list(_CONFIG_FIELDS)}")
    values = dict(values)
    if "mlp_activations" in values:
        values["mlp_activations"] = tuple(values["mlp_activations"])
    return T5Config(**values)


def tensor_mismatches(
    tensors: Mapping[str, Any], expected: Mapping[str, tuple[int, ...]], optional: Any = ()
) -> list[str]:
    """One line per checkpoint tensor that is missing (unless in `optional`), of the wrong
    shape, or not part of the model, each naming the tensor and both shapes."""
    lines = []
    for name, shape in expected.items():
        if name not in tensors:
            if name not in optional:
                lines.append(f"  tensor {name} is missing (expected shape {list(shape)})")
        elif tuple(tensors[name].shape) != shape:
            lines.append(f"  tensor {name} has shape {list(tensors[name].shape)}, expected {list(shape)}")
    lines += [f"  tensor {name} {list(tensors[name].shape)} is not part of this model"
              for name in tensors if name not in expected]
    return lines


def read_config_file(path: pathlib.Path, names: tuple[str, ...], what: str
                     ) -> tuple[dict[str, Any], pathlib.Path]:
    """`(config values, file)` from the first of `names` in folder `path`; in a
    `reference.json` (the shared fixtures' layout) the values are its `config` object.

    Raises FileNotFoundError naming `what` and the names looked for, or ValueError naming
    a file that is not JSON or a reference.json without a `config` object.
    """
    for name in names:
        file = path / name
        if file.is_file():
            try:
                values = json.loads(file.read_text())
            except ValueError as e:
                raise ValueError(f"{file}: not valid JSON ({e})") from e
            if name == "reference.json":
                values = values.get("config") if isinstance(values, Mapping) else None
                if not isinstance(values, Mapping):
                    raise ValueError(f"{file}: no 'config' object (the fixture layout)")
            return dict(values), file
    raise FileNotFoundError(f"{path}: no {what}; looked for {list(names)}")

