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

`write_t5x` writes the same layout back: `checkpoint_<step>/` with every parameter in its
own gzip zarr folder (`target.<dotted path>`, chunks of at most 64 MiB chosen as T5X
chooses them, heads flattened as T5X's T5.1.1 network stores them) and the optimizer state
T5X's default Adafactor starts from (`adafactor.Adafactor(min_dim_size_to_factor=128)`,
no momentum: zeros, `v_row`/`v_col` for matrices whose two largest dimensions reach
`min_dim_size_to_factor`, a full `v` otherwise), so T5X restores it with its standard
T5.1.1 configuration.
"""

from __future__ import annotations

import math
import os
import pathlib
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from ktx.convert import layout
from ktx.convert.hf_t5 import Imported
from ktx.convert.lazy import LazyArray, materialize

__all__ = ["read_t5x", "resolve_t5x_checkpoint", "write_t5x"]

_STEP_DIR = re.compile(r"^checkpoint_(\d+)$")
_VERSION = 3  # T5X's legacy checkpoint format version
_CHUNK_BYTES = 64 * 1024 * 1024  # T5X's desired zarr chunk size


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
    # normalized: TensorStore refuses paths with "..", as a relative source gives them
    folder = pathlib.Path(os.path.normpath(folder if folder.is_absolute() else step_dir / folder))
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


def write_t5x(params: Mapping[str, Any], config: Any, path: str | os.PathLike, *, step: int = 0,
              min_dim_size_to_factor: int = 128) -> pathlib.Path:
    """Writes ktx T5 parameters as a T5X model directory holding `checkpoint_<step>/`
    (T5X's legacy layout, see the module docstring); returns the step directory.

    `path` must be new or empty (nothing is written when anything fails). Raises
    ValueError naming parameters that T5X's T5 has no place for (task conditioning) or of
    the wrong shape for `config`.
    """
    import tensorstore as ts
    from flax import serialization

    from ktx.convert.atomic import atomic_directory

    flat = {k: np.asarray(v, np.float32) for k, v in layout.flatten(params).items()}
    extra = sorted(p for p in flat if p not in layout.expected_shapes(config))
    if extra:
        raise ValueError(f"{len(extra)} parameters have no place in T5X's T5: "
                         f"{', '.join(extra[:8])}{', ...' if len(extra) > 8 else ''}")
    layout.check_params(flat, config, where="the parameters")
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step={step!r}; accepted: an integer >= 0")

    def stored(name: str, a: np.ndarray) -> np.ndarray:  # T5X keeps heads flattened
        if re.search(r"(attention|encoder_decoder_attention)/(query|key|value)/kernel$", name):
            return a.reshape(a.shape[0], -1)
        if re.search(r"attention/out/kernel$", name):
            return a.reshape(-1, a.shape[-1])
        return a

    def spec(folder: str, shape: tuple[int, ...]) -> dict[str, Any]:
        return {"driver": "zarr", "dtype": "float32",
                "kvstore": {"driver": "file", "path": f"{folder}/"},
                "metadata": {"chunks": _chunk_shape(shape, _CHUNK_BYTES // 4),
                             "compressor": {"id": "gzip", "level": 1}, "shape": list(shape)}}

    out = pathlib.Path(path).expanduser().absolute()
    with atomic_directory(out) as tmp:
        step_dir = tmp / f"checkpoint_{step}"
        step_dir.mkdir()

        def write(folder: str, a: np.ndarray) -> dict[str, Any]:
            s = spec(folder, a.shape)
            target = dict(s, kvstore={"driver": "file", "path": str(step_dir / folder)})
            ts.open(target, create=True, open=True).result().write(a).result()
            return s

        target, states = {}, {}
        for name, value in flat.items():
            dotted = name.replace("/", ".")
            a = stored(name, value)
            target[name] = write(f"target.{dotted}", a)
            state = {k: np.zeros((1,), np.float32) for k in ("m", "v", "v_col", "v_row")}
            factored = _factored_dims(a.shape, min_dim_size_to_factor)
            if factored is None:
                state["v"] = write(f"state.param_states.{dotted}.v", np.zeros(a.shape, np.float32))
            else:
                row, col = factored
                state["v_row"] = np.zeros(np.delete(a.shape, col), np.float32)
                state["v_col"] = np.zeros(np.delete(a.shape, row), np.float32)
            states[name] = state
        tree = {"version": _VERSION, "optimizer": {
            "state": {"param_states": layout.unflatten(states), "step": np.asarray(step, np.int32)},
            "target": layout.unflatten(target)}}
        (step_dir / "checkpoint").write_bytes(serialization.msgpack_serialize(tree))
    return out / f"checkpoint_{step}"


def _factored_dims(shape: tuple[int, ...], min_dim_size_to_factor: int) -> tuple[int, int] | None:
    """T5X Adafactor's heuristic: `(row, col)` = the second largest and the largest axis
    when there are two axes of at least `min_dim_size_to_factor`; None otherwise."""
    if len(shape) < 2:
        return None
    order = np.argsort(shape)
    if shape[order[-2]] < min_dim_size_to_factor:
        return None
    return int(order[-2]), int(order[-1])


def _chunk_shape(shape: tuple[int, ...], target_elements: int) -> list[int]:
    """T5X's chunk choice: divisors of each axis, the largest axis reduced first, until a
    chunk holds at most `target_elements`."""
    factors = [[d for d in range(1, n + 1) if n % d == 0] or [1] for n in shape]
    while math.prod(f[-1] for f in factors) > target_elements:
        axis = max(range(len(shape)), key=lambda i: (factors[i][-1], -i))
        if factors[axis][-1] == 1:
            break
        factors[axis].pop()
    return [f[-1] for f in factors]
