"""Reading and writing `.safetensors` files (the format of Hugging Face checkpoints)
through the `safetensors` package.

`safetensors` validates a file before any tensor is used (a truncated file, a header that
points past the end, a byte count that does not match the shape and dtype); its error is
re-raised as one `ValueError` naming the file. Tensors are read lazily, one at a time
(`safe_open`), so a caller that converts them one by one never holds two copies;
`lazy_safetensors` goes further and gives `ktx.convert.lazy.LazyArray`s that read only the
regions asked for (`safe_open(...).get_slice`). No pickle is ever executed:
`pytorch_model.bin` files are refused by the callers.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Iterator, Mapping

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from ktx.convert.lazy import LazyArray

__all__ = ["lazy_safetensors", "read_safetensors", "write_safetensors"]


class _LazyTensors(Mapping):
    """`{name: np.ndarray | LazyArray}` read on access from an open `safe_open` handle."""

    def __init__(self, path: pathlib.Path, lazy: bool = False):
        self._path = path
        self._lazy = lazy
        self._handle = safe_open(str(path), framework="numpy")
        self._names = tuple(self._handle.keys())

    def __getitem__(self, name: str) -> np.ndarray | LazyArray:
        if name not in self._names:
            raise KeyError(name)
        try:
            if not self._lazy:
                return self._handle.get_tensor(name)
            tensor = self._handle.get_slice(name)
            code = tensor.get_dtype()
            if code not in _DTYPES:
                raise ValueError(f"{self._path}: tensor {name!r} has dtype {code}; accepted: "
                                 f"{', '.join(_DTYPES)}")
        except SafetensorError as e:
            raise ValueError(f"{self._path}: tensor {name!r} cannot be read ({e})") from e
        return LazyArray(lambda region: self._region(name, region), tuple(tensor.get_shape()),
                         _DTYPES[code], name=name)

    def _region(self, name: str, region: tuple[slice, ...]) -> np.ndarray:
        try:
            return self._handle.get_slice(name)[region] if region else \
                self._handle.get_tensor(name)
        except SafetensorError as e:
            raise ValueError(f"{self._path}: tensor {name!r} cannot be read ({e})") from e

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
           "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
           "BOOL": np.bool_}


def read_safetensors(path: str | os.PathLike) -> Mapping[str, np.ndarray]:
    """`{name: array}` of a `.safetensors` file, each tensor read when accessed.

    Raises FileNotFoundError when it does not exist, ValueError naming the file when it is
    truncated or malformed.
    """
    return _open(path, lazy=False)


def lazy_safetensors(path: str | os.PathLike) -> Mapping[str, LazyArray]:
    """`{name: LazyArray}` of a `.safetensors` file: shapes from the header, values read
    region by region when indexed. Errors as `read_safetensors`."""
    return _open(path, lazy=True)


def _open(path: str | os.PathLike, lazy: bool) -> Mapping[str, np.ndarray | LazyArray]:
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"safetensors file {str(path)!r} does not exist")
    try:
        return _LazyTensors(path, lazy)
    except SafetensorError as e:
        size = path.stat().st_size
        raise ValueError(
            f"{path}: truncated or malformed safetensors file ({size} bytes): {e}"
        ) from e


def write_safetensors(
    path: str | os.PathLike, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None
) -> None:
    """Writes `tensors` (C-contiguous copies) as a `.safetensors` file with the
    `safetensors` package."""
    from safetensors.numpy import save_file

    save_file(
        {k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path),
        metadata=dict(metadata) if metadata else None,
    )
