"""Checkpoint conversion: Hugging Face T5 and T5X checkpoints <-> ktx.

* `read_hf_t5(dir)`, `read_t5x(dir)`: a converted checkpoint (`Imported`: the `T5Config`
  the checkpoint describes and its parameters as the `params` of `t5.Transformer`).
* `write_hf_t5(params, config, dir)`: a Hugging Face T5 directory.
* `read_hf_bert(dir)`: a Hugging Face BERT directory (`BertImported`, `ktx.models.bert`).
* `load_source("hf:DIR" | "t5x:DIR")`: a reader by prefix (`hf:` by config.json's
  `model_type`: T5 / mT5 or BERT).
* `import_checkpoint(src, out)` / `export_checkpoint(src, out)`: what `ktx import` and
  `ktx export` run: a ktx checkpoint directory (orbax step + `model.gin`) from a source,
  and a Hugging Face directory from a ktx run or checkpoint.

docs/checkpoints.md walks through the commands.
"""

from ktx.convert.hf_bert import BertImported, read_hf_bert
from ktx.convert.hf_t5 import Imported, config_from_hf, hf_config, read_hf_t5, write_hf_t5
from ktx.convert.ktx_dir import (
    SOURCE_PREFIXES,
    export_checkpoint,
    import_checkpoint,
    is_source,
    load_source,
    model_gin,
    read_ktx_checkpoint,
    write_ktx_checkpoint,
)
from ktx.convert.layout import (
    check_params,
    config_from_params,
    expected_shapes,
    flatten,
    unflatten,
)
from ktx.convert.t5x import read_t5x, resolve_t5x_checkpoint

__all__ = [
    "BertImported",
    "Imported",
    "SOURCE_PREFIXES",
    "check_params",
    "config_from_hf",
    "config_from_params",
    "expected_shapes",
    "export_checkpoint",
    "flatten",
    "hf_config",
    "import_checkpoint",
    "is_source",
    "load_source",
    "model_gin",
    "read_hf_bert",
    "read_hf_t5",
    "read_ktx_checkpoint",
    "read_t5x",
    "resolve_t5x_checkpoint",
    "unflatten",
    "write_hf_t5",
    "write_ktx_checkpoint",
]
