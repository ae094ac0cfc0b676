"""T5X checkpoints (the legacy layout T5X's `checkpoints.Checkpointer` writes) -> ktx.

A T5X step directory `checkpoint_<N>/` holds a `checkpoint` file, msgpack (flax's
serialization, arrays as msgpack extension types: no pickle) of
`{version, optimizer: {target: <params>, state: {step, param_states}}}`, plus one
TensorStore (zarr) folder per partitioned array, named by its dotted path. In the msgpack,
small arrays are stored inline and the others are TensorStore specs
(`{driver: "zarr", kvstore: {driver: "file", path: "<relative folder>"}, ...}`).

T5X's T5.1.1 (`t5x/examples/t5/network.py`) uses the parameter names ktx uses; its
attention kernels may be stored with heads flattened (`[E, H*D]`, `[H*D, E]`): the number
of heads is read from the relative position table `[H, buckets]`. The checkpoint holds no
model config: the sizes come from the shapes, the MLP activations from the kernel names
(`wi_0`/`wi_1`: T5.1.1's gated GELU; `wi`: original T5's ReLU; `mlp_activations=`
overrides). Only the parameters (`optimizer/target`) are read; the optimizer state is not.
Nothing is read until a parameter is placed: the arrays are `ktx.convert.lazy.LazyArray`s
over the TensorStore folders, read shard by shard.
"""

from __future__ import annotations

import os
import pathlib
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from ktx.convert import layout
from ktx.convert.hf_t5 import Imported
from ktx.convert.lazy import LazyArray, materialize

__all__ = ["read_t5x", "resolve_t5x_checkpoint"]

_STEP_DIR = re.compile(r"^checkpoint_(\d+)$")


def resolve_t5x_checkpoint(path: str | os.PathLike) -> pathlib.Path:
    """The T5X step directory for `path`: a `checkpoint_<N>` folder, its `checkpoint`
    file, or a model directory (its newest `checkpoint_<N>`)."""
    p = pathlib.Path(path).expanduser().absolute()
    if p.is_file() and p.name == "checkpoint":
        return p.parent
    if not p.is_dir():
        raise FileNotFoundError(f"T5X checkpoint {str(path)!r} does not exist")
    if (p / "checkpoint").is_file():
        return p
    steps = sorted((int(m.group(1)), c) for c in p.iterdir()
                   if (m := _STEP_DIR.match(c.name)) and (c / "checkpoint").is_file())
    if not steps:
        raise FileNotFoundError(
            f"{str(path)!r} is not a T5X checkpoint: expected a checkpoint_<step> directory "
            "holding a `checkpoint` msgpack file, or a model directory holding such folders"
        )
    return steps[-1][1]


def _is_spec(value: Any) -> bool:
    return isinstance(value, Mapping) and "driver" in value and "kvstore" in value


def _lazy_array(step_dir: pathlib.Path, name: str, value: Any) -> LazyArray:
    """The array `name` of a T5X step directory (inline in the msgpack, or a TensorStore
    spec) as a LazyArray: TensorStore arrays are read region by region when indexed."""
    if not _is_spec(value):
        return LazyArray.of(np.asarray(value), name)
    import tensorstore as ts

    kvstore = dict(value["kvstore"])
    if kvstore.get("driver") != "file":
        raise ValueError(
            f"{step_dir}: {name} is stored with the {kvstore.get('driver')!r} kvstore driver; "
            "copy the checkpoint to a local directory first"
        )
    folder = pathlib.Path(kvstore["path"])
    folder = folder if folder.is_absolute() else step_dir / folder
    if not folder.is_dir():
        raise FileNotFoundError(f"{step_dir}: the array folder of {name} ({folder}) does not exist")
    spec = {"driver": value["driver"], "kvstore": {"driver": "file", "path": str(folder)}}
    try:
        store = ts.open(spec, open=True, read=True).result()
    except Exception as e:  # noqa: BLE001 - tensorstore raises its own error types
        raise ValueError(f"{step_dir}: cannot open {name} in {folder}: {e}") from e

    def read(region: tuple[slice, ...]) -> np.ndarray:
        try:
            return np.asarray(store[region].read().result())
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"{step_dir}: cannot read {name} from {folder}: {e}") from e

    return LazyArray(read, tuple(store.shape), store.dtype.numpy_dtype, name=name)


def read_t5x(path: str | os.PathLike, *, mlp_activations: tuple[str, ...] | None = None,
             relative_attention_max_distance: int = 128, lazy: bool = False) -> Imported:
    """Reads the parameters of a T5X T5 / T5.1.1 checkpoint into ktx parameters (numpy
    float32; `lazy=True`: `ktx.convert.lazy.LazyArray`s, read when placed).

    Raises FileNotFoundError (no such checkpoint, a missing array folder) or ValueError
    (not msgpack, not a T5 encoder-decoder — naming the parameters that do not fit).
    """
    from flax import serialization

    step_dir = resolve_t5x_checkpoint(path)
    file = step_dir / "checkpoint"
    try:
        tree = serialization.msgpack_restore(file.read_bytes())
    except Exception as e:  # noqa: BLE001 - msgpack raises several types
        raise ValueError(f"{file}: not a T5X msgpack checkpoint ({type(e).__name__}: {e})") from e
    target = tree.get("optimizer", {}).get("target") if isinstance(tree, Mapping) else None
    if not isinstance(target, Mapping):
        raise ValueError(
            f"{file}: no optimizer/target parameters (top-level keys "
            f"{sorted(tree) if isinstance(tree, Mapping) else type(tree).__name__}); "
            "expected T5X's legacy layout {version, optimizer: {target, state}}"
        )
    flat: dict[str, Any] = {}
    for p, value in _flatten_specs(target).items():
        flat[p] = value
    where = f"T5X checkpoint {step_dir}"
    if "encoder/relpos_bias/rel_embedding" not in flat:
        raise ValueError(
            f"{where} is not a T5 encoder-decoder (T5X's t5/network.py): no "
            f"encoder/relpos_bias/rel_embedding among its {len(flat)} parameters "
            f"(e.g. {sorted(flat)[:6]})"
        )
    sources = {p: _lazy_array(step_dir, p, v) for p, v in flat.items()}
    heads = sources["encoder/relpos_bias/rel_embedding"].shape[0]
    arrays = {}
    for p, a in sources.items():
        shape = a.shape
        if re.search(r"(attention|encoder_decoder_attention)/(query|key|value)/kernel$", p) and a.ndim == 2:
            if a.shape[1] % heads:
                raise ValueError(f"{where}: {p} has shape {list(a.shape)}, not divisible into {heads} heads")
            shape = (a.shape[0], heads, a.shape[1] // heads)
        elif re.search(r"attention/out/kernel$", p) and a.ndim == 2:
            if a.shape[0] % heads:
                raise ValueError(f"{where}: {p} has shape {list(a.shape)}, not divisible into {heads} heads")
            shape = (heads, a.shape[0] // heads, a.shape[1])
        arrays[p] = a.convert(shape=shape)  # float32, read region by region when placed
    config = layout.config_from_params(
        arrays, mlp_activations=mlp_activations,
        relative_attention_max_distance=relative_attention_max_distance, where=where,
    )
    return Imported(config, layout.unflatten(materialize(arrays, lazy)), f"t5x:{step_dir}")


def _flatten_specs(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """`layout.flatten` that keeps TensorStore specs (dicts) as leaves."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, Mapping) and not _is_spec(value):
            out.update(_flatten_specs(value, path))
        else:
            out[path] = value
    return out
