"""ktx checkpoint directories made from other formats, and back (`ktx import` / `ktx export`).

`import_checkpoint("hf:DIR" | "t5x:DIR", OUT)` writes

    OUT/model.gin                 binds MODEL to the matching ktx T5 (include it as a model file)
    OUT/checkpoints/0/state       orbax: step 0, the parameters, no optimizer state
    OUT/checkpoints/0/meta        JSON: step, source, t5_config (the T5Config fields)

which `ktx.training.initial_params.load_initial_params` / `ktx.training.checkpoints.resolve_checkpoint` read like a run
directory (`INITIAL_CHECKPOINT_PATH = 'OUT'`). `export_checkpoint(SRC, "hf:DIR")` reads
the parameters of a ktx run or checkpoint (latest step or `step`) and writes a Hugging
Face T5 or BERT directory; `export_checkpoint(SRC, "t5x:DIR")` a T5X checkpoint.

`camtl:DIR` (the authors' CA-MTL checkpoint, `ktx.convert.camtl`) writes a model.gin
binding MODEL to the matching `ktx.models.camtl.CaMtlClassifierModel`; `pals:DIR` (the
authors' BERT-and-PALs checkpoint, `ktx.convert.pals`) one binding
`ktx.models.pals.PalsClassifierModel`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from ktx.convert import layout
from ktx.convert.atomic import atomic_directory
from ktx.convert.lazy import place
from ktx.convert import hf_bert
from ktx.convert.hf_bert import is_hf_bert, read_hf_bert
from ktx.convert.hf_t5 import Imported, read_hf_t5, write_hf_t5
from ktx.convert.t5x import read_t5x, write_t5x
from ktx.models.t5 import T5Config

__all__ = [
    "SOURCE_PREFIXES",
    "is_source",
    "load_source",
    "model_gin",
    "write_ktx_checkpoint",
    "read_ktx_checkpoint",
    "import_checkpoint",
    "export_checkpoint",
    "EXPORT_PREFIXES",
]

SOURCE_PREFIXES = ("hf", "t5x", "camtl", "pals")


def _split(source: str | os.PathLike) -> tuple[str | None, str]:
    text = os.fspath(source)
    prefix, sep, rest = text.partition(":")
    return (prefix, rest) if sep and prefix in SOURCE_PREFIXES else (None, text)


def is_source(path: Any) -> bool:
    """Whether `path` is an `hf:` / `t5x:` checkpoint source."""
    return isinstance(path, (str, os.PathLike)) and _split(path)[0] is not None


def load_source(source: str | os.PathLike, *, lazy: bool = False) -> Imported:
    """Reads `hf:DIR` (Hugging Face T5 or, by config.json's `model_type`, BERT directory:
    `ktx.convert.hf_bert.BertImported`) or `t5x:DIR` (T5X checkpoint). `lazy=True`: the
    Hugging Face and T5X parameters are `ktx.convert.lazy.LazyArray`s, read shard by shard
    when placed (`ktx.convert.lazy.place`)."""
    prefix, path = _split(source)
    if prefix is None:
        raise ValueError(
            f"checkpoint source {os.fspath(source)!r}: accepted: 'hf:DIR' (a Hugging Face T5 "
            "directory), 't5x:DIR' (a T5X checkpoint_<step> or model directory) or "
            "'camtl:DIR' / 'pals:DIR' (the authors' CA-MTL / PALs checkpoint)"
        )
    if not path:
        raise ValueError(f"checkpoint source {os.fspath(source)!r} names no directory")
    if prefix == "camtl":
        from ktx.convert.camtl import read_camtl

        return read_camtl(path)
    if prefix == "pals":
        from ktx.convert.pals import read_pals

        return read_pals(path)
    if prefix == "hf" and is_hf_bert(path):  # config.json's model_type picks the reader
        return read_hf_bert(path, lazy=lazy)
    return read_hf_t5(path, lazy=lazy) if prefix == "hf" else read_t5x(path, lazy=lazy)


def model_gin(config: T5Config, source: str = "") -> str:
    """A gin model file (the layout of gin/models/t5_1_1_*.gin) binding MODEL to a plain
    ktx T5 of `config`'s shape."""
    acts = tuple(config.mlp_activations)
    return f"""# ktx T5 matching {source or 'an imported checkpoint'} (written by `ktx import`).
# Binds MODEL; include it as a model file, then start a run from the parameters with
#   --gin.INITIAL_CHECKPOINT_PATH="'<this directory>'"
# Conditioning files (gin/conditioning/*.gin) go after it.
from __gin__ import dynamic_registration
import ktx.models.seq2seq as seq2seq
import ktx.models.t5 as t5

NUM_TASKS = 1
VOCAB_SIZE = {config.vocab_size}  # the checkpoint's vocabulary: the tasks must use the same one
DROPOUT_RATE = {float(config.dropout_rate)!r}  # the checkpoint config's rate
ACTIVATION_DTYPE = {config.dtype!r}  # 'bfloat16' trains faster; parameters stay float32
Z_LOSS = 1e-4
LABEL_SMOOTHING = 0.0
INFUSION_BETA = 0.0
LOSS_NORMALIZATION = 'global'

MODEL = @seq2seq.EncoderDecoderModel()
seq2seq.EncoderDecoderModel:
  config = @t5.T5Config()
  num_tasks = %NUM_TASKS
  loss_normalization = %LOSS_NORMALIZATION
  z_loss = %Z_LOSS
  label_smoothing = %LABEL_SMOOTHING
  infusion_beta = %INFUSION_BETA

t5.T5Config:
  vocab_size = %VOCAB_SIZE
  emb_dim = {config.emb_dim}
  num_heads = {config.num_heads}
  num_encoder_layers = {config.num_encoder_layers}
  num_decoder_layers = {config.num_decoder_layers}
  head_dim = {config.head_dim}
  mlp_dim = {config.mlp_dim}
  mlp_activations = {acts!r}
  dropout_rate = %DROPOUT_RATE
  dtype = %ACTIVATION_DTYPE
  relative_attention_num_buckets = {config.relative_attention_num_buckets}
  relative_attention_max_distance = {config.relative_attention_max_distance}
  logits_via_embedding = {bool(config.logits_via_embedding)}
"""


def write_ktx_checkpoint(
    params: Mapping[str, Any], config: Any, out: str | os.PathLike, *, source: str = ""
) -> pathlib.Path:
    """Writes `params` (checked against `config`, a `T5Config` or `BertConfig`) as a ktx
    checkpoint directory (step 0, `model.gin`); all or nothing (`out` must be new or empty)."""
    from ktx.training.checkpoints import CheckpointManager
    from ktx.convert import camtl, pals
    from ktx.training.trainer import TrainState

    flat = dict(layout.flatten(params))  # arrays or LazyArrays: only shapes are checked here
    if isinstance(config, camtl.CaMtlCheckpointConfig):
        camtl.check_params(flat, config, where=source or "the parameters")
        gin_text, meta = camtl.model_gin(config, source), {"camtl_config": camtl.config_to_dict(config)}
    elif isinstance(config, pals.PalsCheckpointConfig):
        pals.check_params(flat, config, where=source or "the parameters")
        gin_text, meta = pals.model_gin(config, source), {"pals_config": pals.config_to_dict(config)}
    elif isinstance(config, hf_bert.BertConfig):
        hf_bert.check_params(flat, config, where=source or "the parameters")
        gin_text, meta = hf_bert.model_gin(config, source), {"bert_config": hf_bert.config_to_dict(config)}
    else:
        layout.check_params(flat, config, where=source or "the parameters")
        gin_text, meta = model_gin(config, source), {"t5_config": layout.config_to_dict(config)}
    # One float32 copy, as host-side jax arrays that orbax writes without another copy;
    # LazyArrays are read tensor by tensor into it.
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    arrays = {k: place(v, cpu, np.float32) for k, v in flat.items()}
    with atomic_directory(out) as tmp:
        (tmp / "model.gin").write_text(gin_text)
        manager = CheckpointManager(tmp, save_period=1)
        state = TrainState(step=np.int32(0), params=layout.unflatten(arrays), opt_state=())
        manager.save(state, force=True, meta={"source": source, **meta})
        manager.close()
    return pathlib.Path(out).expanduser().absolute()


def import_checkpoint(source: str | os.PathLike, out: str | os.PathLike) -> pathlib.Path:
    """`ktx import`: converts `hf:DIR` / `t5x:DIR` into the ktx checkpoint directory
    `out`; returns its absolute path. Nothing is written when reading fails."""
    imported = load_source(source, lazy=True)
    config = getattr(imported, "checkpoint_config", imported.config)  # PALs: backbone + PALs
    return write_ktx_checkpoint(imported.params, config, out, source=imported.source)


def read_ktx_checkpoint(
    path: str | os.PathLike, step: int | None = None
) -> tuple[dict[str, np.ndarray], Any, pathlib.Path]:
    """The parameters (flat `{path: array}`, host numpy) of a ktx run / checkpoints /
    step directory (latest step unless `step`), the `T5Config` or `BertConfig` its
    metadata records (checkpoints written by `ktx import`; None otherwise) and the step
    directory."""
    from ktx.training.checkpoints import host_params, resolve_checkpoint

    step_dir = resolve_checkpoint(path, step)
    params = host_params(step_dir)
    config = None
    meta_file = step_dir / "meta" / "metadata"
    if meta_file.is_file():
        meta = json.loads(meta_file.read_text())
        if isinstance(meta, Mapping) and isinstance(meta.get("t5_config"), Mapping):
            config = layout.config_from_dict(meta["t5_config"])
        elif isinstance(meta, Mapping) and isinstance(meta.get("bert_config"), Mapping):
            from ktx.models.bert import BertConfig

            config = BertConfig(**meta["bert_config"])
    return {k: np.asarray(v) for k, v in layout.flatten(params).items()}, config, step_dir


EXPORT_PREFIXES = ("hf", "t5x")


def export_checkpoint(
    source: str | os.PathLike,
    out: str | os.PathLike,
    *,
    step: int | None = None,
    config: Any = None,
    backbone_only: bool = False,
) -> pathlib.Path:
    """`ktx export`: the parameters of a ktx run / checkpoint directory as `hf:DIR` (a
    Hugging Face T5 or BERT directory) or `t5x:DIR` (a T5X model directory holding
    `checkpoint_<step>`, T5 only).

    `config`: the model's `T5Config` / `BertConfig` (the CLI takes it from the run's gin
    files); default: the one recorded by `ktx import`, else a T5 inferred from the shapes
    (T5.1.1's gated GELU for `wi_0`/`wi_1`, ReLU for `wi`, max distance 128). Parameters
    with no counterpart in the target (task conditioning, task heads, method parameters)
    are a ValueError naming them, unless `backbone_only`: then they are left out and
    named on stdout. Returns the written directory.
    """
    from ktx.models.bert import BertConfig

    from ktx.models import scan_layout

    prefix, path = _split_target(out)
    flat, recorded, step_dir = read_ktx_checkpoint(source, step)
    # A scanned run (T5Config.scan_layers) exports in the unrolled layout both formats use.
    flat = scan_layout.convert_layout(flat, scanned=False)
    config = recorded if config is None else config
    if isinstance(config, T5Config) and config.scan_layers:
        config = dataclasses.replace(config, scan_layers=False)
    if config is None:
        backbone = {k: v for k, v in flat.items() if not k.startswith("conditioning/")}
        config = layout.config_from_params(backbone, where=str(step_dir))
    if isinstance(config, BertConfig):
        if prefix != "hf":
            raise ValueError(f"export target {os.fspath(out)!r}: a BERT model exports to "
                             "'hf:DIR' only (T5X holds T5 models)")
        known = set(hf_bert.expected_shapes(config))
    elif isinstance(config, T5Config):
        known = set(layout.expected_shapes(config))
    else:
        raise ValueError(f"the model of {step_dir} ({type(config).__name__}) has no Hugging Face "
                         "or T5X counterpart; exportable: T5 (T5Config) and BERT (BertConfig) models")
    label = ("Hugging Face " if prefix == "hf" else "T5X ") + (
        "BERT" if isinstance(config, BertConfig) else "T5")
    left_out = sorted(k for k in flat if k not in known)
    if left_out and not backbone_only:
        shown = ", ".join(left_out[:8]) + (f", ... ({len(left_out)} in all)" if len(left_out) > 8 else "")
        raise ValueError(
            f"{len(left_out)} parameters of {step_dir} have no {label} counterpart: {shown}. "
            "Export the backbone alone with --backbone_only (library: backbone_only=True); "
            "the task-conditioned parameters alone go to conditioning:FILE")
    if left_out:
        print(f"left out (no {label} counterpart): {', '.join(left_out)}", flush=True)
    params = layout.unflatten({k: v for k, v in flat.items() if k in known})
    if isinstance(config, BertConfig):
        return hf_bert.write_hf_bert(params, config, path)
    if prefix == "t5x":
        return write_t5x(params, config, path, step=int(step_dir.name)).parent
    return write_hf_t5(params, config, path)


def _split_target(out: str | os.PathLike) -> tuple[str, str]:
    prefix, sep, path = os.fspath(out).partition(":")
    if not sep or prefix not in EXPORT_PREFIXES:
        raise ValueError(
            f"export target {os.fspath(out)!r}: accepted: 'hf:DIR' (a Hugging Face T5 or BERT "
            "directory), 't5x:DIR' (a T5X model directory) or, with `ktx export`, "
            "'conditioning:FILE' (the task-conditioned parameters alone)")
    if not path:
        raise ValueError(f"export target {os.fspath(out)!r} names no directory")
    return prefix, path
