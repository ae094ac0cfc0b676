"""The authors' BERT-and-PALs checkpoints (Stickland & Murray, 2019; their PyTorch
`BertForMultiTask` with `mult` and `pals` on) -> `ktx.models.pals.PalsClassifierModel`.

A checkpoint directory holds the weights as one `.safetensors` file (`weights.safetensors`,
`model.safetensors`, or the directory's only `*.safetensors`; read with the `safetensors`
package, a pickle is never loaded) and the authors' config (the fields of their
`pals_config.json`: `hidden_size`, `num_hidden_layers`, `hidden_size_aug`, ...) in
`config.json`, `pals_config.json`, `bert_config.json`, or under the `config` key of
`reference.json` (the layout of the `pals/` test fixture). The number of tasks and each
head's size come from the `classifier.<t>` tensors (a config's `num_tasks` must agree).

Name mapping (torch `Linear` weights are `[out, in]`, ktx kernels `[in, out]`; LayerNorms
named `gamma`/`beta` or `weight`/`bias`; `<t>` a task, `<l>` a layer, `n` = 6 PAL heads):

    bert.embeddings.{word,position,token_type}_embeddings    embeddings/{...}/embedding
    bert.embeddings.LayerNorm                                embeddings/layer_norm
    bert.encoder.layer.<l>.attention.self.{query,key,value}  layers_<l>/attention/{...}  [E, H, D]
    bert.encoder.layer.<l>.attention.output.dense            layers_<l>/attention/out   [H, D, E]
    bert.encoder.layer.<l>.attention.output.LayerNorm        layers_<l>/attention_layer_norm
    bert.encoder.layer.<l>.intermediate.dense                layers_<l>/intermediate
    bert.encoder.layer.<l>.output.dense                      layers_<l>/output
    bert.encoder.layer.<l>.output.LayerNorm                  layers_<l>/output_layer_norm
    bert.encoder.layer.<l>.multi_layers.<t>.attn.{q,k,v}     conditioning/layers_<l>/{...}[t]  [A, n, A/n]
    bert.encoder.mult_aug_dense.<t>        (V_E)             conditioning/down[t]  [E, A]
    bert.encoder.mult_aug_dense2.<t>       (V_D)             conditioning/up[t]    [A, E]
    bert.pooler.dense                                        pooler
    classifier.<t>                                           task_heads/task_<t>

The authors' modules register V_E / V_D again inside every layer's PAL
(`bert.encoder.layer.<l>.multi_layers.<t>.aug_dense{,2}`): such copies are accepted when
they equal the shared tensor. Anything else (a missing tensor, an unknown one, a wrong
shape) is a ValueError naming every offending tensor with its shape and the expected one.
"""

from __future__ import annotations

import os
import pathlib
import re
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from ktx.convert import layout
from ktx.convert.safetensors_io import read_safetensors
from ktx.models.bert import HIDDEN_ACTS, BertConfig

__all__ = ["PALS_HEADS", "PalsImported", "read_pals", "pals_config_from_authors",
           "expected_tensor_shapes"]

PALS_HEADS = 6  # the authors' BERTPals: BERTSelfAttention(config, 6)
_CONFIG_FILES = ("config.json", "pals_config.json", "bert_config.json", "reference.json")
_WEIGHT_FILES = ("weights.safetensors", "model.safetensors")
_CLASSIFIER = re.compile(r"classifier\.(\d+)\.weight")
_LAYER_COPY = re.compile(r"bert\.encoder\.layer\.(\d+)\.multi_layers\.(\d+)\.(aug_dense2?)\.(weight|bias)")


class PalsCheckpointConfig(NamedTuple):
    """What a PALs checkpoint describes: the backbone's `BertConfig`, each task's head
    size, the PAL width and heads (`ktx import pals:DIR` writes it to the metadata)."""

    bert: BertConfig
    num_labels: tuple[int, ...]
    pals_size: int
    pals_heads: int

    def model(self, **kwargs: Any):
        """The `PalsClassifierModel` these parameters belong to."""
        from ktx.models.pals import PalsClassifierModel

        return PalsClassifierModel(self.bert, num_labels=self.num_labels,
                                   pals_size=self.pals_size, pals_heads=self.pals_heads, **kwargs)


def expected_shapes(config: PalsCheckpointConfig) -> dict[str, tuple[int, ...]]:
    """`{ktx path: shape}` of the config's `PalsClassifierModel` (shapes only)."""
    return layout.model_shapes(config.model(), 8)


def check_params(flat: Mapping[str, Any], config: PalsCheckpointConfig, *, where: str) -> None:
    """ValueError naming every parameter of `flat` that the config's model lacks, misses
    or has with another shape."""
    layout.check_model_params(flat, expected_shapes(config), owner="PalsClassifierModel",
                              config=config, where=where)


def config_to_dict(config: PalsCheckpointConfig) -> dict[str, Any]:
    """JSON-able fields (checkpoint metadata)."""
    import dataclasses

    return {"bert": dataclasses.asdict(config.bert), "num_labels": list(config.num_labels),
            "pals_size": config.pals_size, "pals_heads": config.pals_heads}


def model_gin(config: PalsCheckpointConfig, source: str = "") -> str:
    """A gin model file binding MODEL to the config's `PalsClassifierModel`."""
    from ktx.convert.hf_bert import bert_config_gin

    c = config.bert
    return f"""# ktx PALs matching {source or 'an imported checkpoint'} (written by `ktx import`).
# Binds MODEL; include it as a model file, then start a run from the parameters with
#   --gin.INITIAL_CHECKPOINT_PATH="'<this directory>'"
from __gin__ import dynamic_registration
import ktx.models.bert as bert
import ktx.models.pals as pals

NUM_LABELS = {tuple(config.num_labels)!r}
VOCAB_SIZE = {c.vocab_size}  # the checkpoint's vocabulary: the tasks must use the same one
DROPOUT_RATE = {float(c.dropout_rate)!r}  # the checkpoint config's rate
ACTIVATION_DTYPE = {c.dtype!r}  # 'bfloat16' trains faster; parameters stay float32
LOSS_NORMALIZATION = 'global'

MODEL = @pals.PalsClassifierModel()
pals.PalsClassifierModel:
  config = @bert.BertConfig()
  num_labels = %NUM_LABELS
  loss_normalization = %LOSS_NORMALIZATION
  pals_size = {config.pals_size}
  pals_heads = {config.pals_heads}

{bert_config_gin(c)}"""


class PalsImported(NamedTuple):
    """A converted PALs checkpoint: the backbone's `BertConfig`, each task's head size,
    the PAL width and heads, the `params` of `PalsClassifierModel.module` (nested dicts
    of float32 numpy arrays) and the source directory."""

    config: BertConfig
    num_labels: tuple[int, ...]
    pals_size: int
    pals_heads: int
    params: dict[str, Any]
    source: str

    @property
    def checkpoint_config(self) -> PalsCheckpointConfig:
        """The config `ktx import` records (backbone, heads, PAL width and heads)."""
        return PalsCheckpointConfig(self.config, self.num_labels, self.pals_size, self.pals_heads)

    def model(self, **kwargs: Any):
        """A `PalsClassifierModel` of this checkpoint's shapes (`kwargs`: its other
        arguments, e.g. `loss_normalization`)."""
        return self.checkpoint_config.model(**kwargs)


def pals_config_from_authors(values: Mapping[str, Any], *, where: str) -> tuple[BertConfig, int]:
    """`(BertConfig, hidden_size_aug)` of the authors' config fields; ValueError naming
    the field, its value and what is accepted."""
    for flag in ("mult", "pals"):
        if values.get(flag) is not True:
            raise ValueError(f"{where}: {flag}={values.get(flag)!r}; a PALs checkpoint has "
                             "mult=true and pals=true (their pals_config.json)")
    for flag in ("houlsby", "top", "lhuc", "bert_lay_top"):
        if values.get(flag):
            raise ValueError(f"{where}: {flag}={values[flag]!r}; only PALs (mult + pals) converts")
    act = values.get("hidden_act", "gelu")
    if act not in HIDDEN_ACTS:
        raise ValueError(f"{where}: hidden_act={act!r}; accepted: {sorted(HIDDEN_ACTS)}")
    try:
        config = BertConfig(
            vocab_size=values["vocab_size"], hidden_size=values["hidden_size"],
            num_layers=values["num_hidden_layers"], num_heads=values["num_attention_heads"],
            intermediate_size=values["intermediate_size"],
            max_position=values.get("max_position_embeddings", 512),
            type_vocab_size=values.get("type_vocab_size", 2), hidden_act=act,
            dropout_rate=float(values.get("hidden_dropout_prob", 0.1)),
            attention_dropout_rate=float(values.get("attention_probs_dropout_prob", 0.1)))
        aug = values.get("hidden_size_aug", 204)
    except KeyError as e:
        raise ValueError(f"{where}: field {e.args[0]!r} is missing") from e
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from e
    if isinstance(aug, bool) or not isinstance(aug, int) or aug < 1 or aug % PALS_HEADS:
        raise ValueError(f"{where}: hidden_size_aug={aug!r}; accepted: a positive multiple of "
                         f"{PALS_HEADS} (the PAL heads)")
    return config, aug


def _mapping(config: BertConfig, aug: int, num_labels: tuple[int, ...]) -> dict[str, tuple]:
    """`{reference name: (ktx path, task index or None, reference shape, ktx shape)}`."""
    e, h, d, m = config.hidden_size, config.num_heads, config.head_dim, config.intermediate_size
    n = PALS_HEADS
    out: dict[str, tuple] = {}

    def linear(ref, path, out_shape, in_shape, task=None):
        o, i = int(np.prod(out_shape)), int(np.prod(in_shape))
        out[f"{ref}.weight"] = (f"{path}/kernel", task, (o, i), (*in_shape, *out_shape))
        out[f"{ref}.bias"] = (f"{path}/bias", task, (o,), tuple(out_shape))

    def norm(ref, path):
        out[f"{ref}.gamma"] = (f"{path}/scale", None, (e,), (e,))
        out[f"{ref}.beta"] = (f"{path}/bias", None, (e,), (e,))

    for part, rows in (("word", config.vocab_size), ("position", config.max_position),
                       ("token_type", config.type_vocab_size)):
        out[f"bert.embeddings.{part}_embeddings.weight"] = (
            f"embeddings/{part}_embeddings/embedding", None, (rows, e), (rows, e))
    norm("bert.embeddings.LayerNorm", "embeddings/layer_norm")
    for li in range(config.num_layers):
        ref, path = f"bert.encoder.layer.{li}", f"layers_{li}"
        for name in ("query", "key", "value"):
            linear(f"{ref}.attention.self.{name}", f"{path}/attention/{name}", (h, d), (e,))
        linear(f"{ref}.attention.output.dense", f"{path}/attention/out", (e,), (h, d))
        norm(f"{ref}.attention.output.LayerNorm", f"{path}/attention_layer_norm")
        linear(f"{ref}.intermediate.dense", f"{path}/intermediate", (m,), (e,))
        linear(f"{ref}.output.dense", f"{path}/output", (e,), (m,))
        norm(f"{ref}.output.LayerNorm", f"{path}/output_layer_norm")
        for t in range(len(num_labels)):
            for name in ("query", "key", "value"):
                linear(f"{ref}.multi_layers.{t}.attn.{name}", f"conditioning/{path}/{name}",
                       (n, aug // n), (aug,), task=t)
    for t, labels in enumerate(num_labels):
        linear(f"bert.encoder.mult_aug_dense.{t}", "conditioning/down", (aug,), (e,), task=t)
        linear(f"bert.encoder.mult_aug_dense2.{t}", "conditioning/up", (e,), (aug,), task=t)
        linear(f"classifier.{t}", f"task_heads/task_{t}", (labels,), (e,))
    linear("bert.pooler.dense", "pooler", (e,), (e,))
    return out


def expected_tensor_shapes(config: BertConfig, pals_size: int,
                           num_labels: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """`{reference tensor name: shape}` of a PALs checkpoint of these shapes."""
    return {k: v[2] for k, v in _mapping(config, pals_size, num_labels).items()}


def _weights_file(path: pathlib.Path) -> pathlib.Path:
    for name in _WEIGHT_FILES:
        if (path / name).is_file():
            return path / name
    found = sorted(path.glob("*.safetensors"))
    if len(found) == 1:
        return found[0]
    if found:
        raise ValueError(f"{path}: several .safetensors files {[p.name for p in found]}; name "
                         f"the weights one of {list(_WEIGHT_FILES)}")
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
    hint = (f" ({pickles} are pickles, never loaded: save the state dict with "
            "safetensors.torch.save_file)") if pickles else ""
    raise FileNotFoundError(f"{path}: no .safetensors weights{hint}")


def read_pals(path: str | os.PathLike) -> PalsImported:
    """Reads the authors' PALs checkpoint directory (see the module docstring).

    Raises FileNotFoundError (no directory, config or weights) or ValueError (a config
    that is not PALs, tensors missing, unknown or mis-shaped, layer copies of V_E / V_D
    that differ from the shared ones).
    """
    path = pathlib.Path(path).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"PALs checkpoint directory {str(path)!r} does not exist")
    values, config_file = layout.read_config_file(path, _CONFIG_FILES, "PALs config")
    config, aug = pals_config_from_authors(values, where=str(config_file))
    weights_file = _weights_file(path)
    tensors = dict(read_safetensors(weights_file))
    renamed = {}
    for name, value in tensors.items():
        key = re.sub(r"\.LayerNorm\.weight$", ".LayerNorm.gamma", name)
        key = re.sub(r"\.LayerNorm\.bias$", ".LayerNorm.beta", key)
        if key in renamed:
            raise ValueError(f"{weights_file}: {name} and its alias {key} are both stored")
        renamed[key] = value
    tensors = renamed

    tasks = sorted(int(m.group(1)) for m in map(_CLASSIFIER.fullmatch, tensors) if m)
    if not tasks or tasks != list(range(len(tasks))):
        raise ValueError(f"{weights_file}: classifier.<t>.weight for tasks {tasks}; expected "
                         "tasks 0..T-1, one head each")
    num_labels = tuple(int(tensors[f"classifier.{t}.weight"].shape[0]) for t in tasks)
    if "num_tasks" in values and values["num_tasks"] != len(tasks):
        raise ValueError(f"{config_file}: num_tasks={values['num_tasks']!r} but the weights hold "
                         f"{len(tasks)} classifier heads")

    lines = []
    for name in [n for n in tensors if _LAYER_COPY.fullmatch(n)]:
        _, t, module, kind = _LAYER_COPY.fullmatch(name).groups()
        shared = f"bert.encoder.mult_{module}.{t}.{kind}"
        copy = tensors.pop(name)
        if shared in tensors and not np.array_equal(np.asarray(copy), np.asarray(tensors[shared])):
            lines.append(f"  tensor {name} differs from the shared {shared} (the authors' layers "
                         "share V_E / V_D)")
    mapping = _mapping(config, aug, num_labels)
    lines += layout.tensor_mismatches(tensors, {k: v[2] for k, v in mapping.items()})
    if lines:
        raise ValueError(
            f"{weights_file}: the tensors do not match {config_file.name} (hidden_size="
            f"{config.hidden_size}, num_hidden_layers={config.num_layers}, num_attention_heads="
            f"{config.num_heads}, intermediate_size={config.intermediate_size}, "
            f"hidden_size_aug={aug}, {len(tasks)} tasks with {list(num_labels)} labels):\n"
            + "\n".join(lines))

    flat: dict[str, Any] = {}
    stacks: dict[str, list] = {}
    for name, (p, task, _, shape) in mapping.items():
        a = np.asarray(tensors[name], np.float32)
        a = np.ascontiguousarray((a.T if a.ndim == 2 and not name.endswith("_embeddings.weight")
                                  else a).reshape(shape))
        if task is None:
            flat[p] = a
        else:
            stacks.setdefault(p, [None] * len(num_labels))[task] = a
    for p, per_task in stacks.items():
        flat[p] = np.stack(per_task)
    return PalsImported(config, num_labels, aug, PALS_HEADS, layout.unflatten(flat), f"pals:{path}")
