"""Reading and writing `.safetensors` files (the format of Hugging Face checkpoints).

The format (huggingface/safetensors README): an 8-byte little-endian header size `N`,
`N` bytes of JSON `{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__":
{...}}`, then the raw little-endian tensor bytes, offsets relative to the end of the
header. Reading is memory-mapped: a tensor is read from disk when it is converted.

Everything is validated before any tensor is used: a truncated file, a header that
points past the end, or a byte count that does not match the shape and dtype raises
`ValueError` naming the file and the tensor. No pickle is ever executed: `pytorch_model.bin`
files are refused by the callers.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import struct
from collections.abc import Mapping

import ml_dtypes
import numpy as np

__all__ = ["read_safetensors", "write_safetensors", "SAFETENSORS_DTYPES"]

SAFETENSORS_DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U8": np.dtype("u1"), "BOOL": np.dtype("bool"),
}
_MAX_HEADER = 100_000_000  # the format's own limit


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """`{name: read-only memory-mapped array}` of a `.safetensors` file.

    Raises FileNotFoundError when it does not exist, ValueError (naming the file and
    tensor) when it is truncated or malformed.
    """
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"safetensors file {str(path)!r} does not exist")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER or 8 + n > size:
            raise ValueError(
                f"{path}: truncated or not a safetensors file (header of {n} bytes declared, "
                f"file has {size} bytes)"
            )
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: safetensors header is not valid JSON ({e})") from e
    if not isinstance(header, dict):
        raise ValueError(f"{path}: safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    data_size = size - 8 - n
    specs = {}
    for name, spec in header.items():
        try:
            dtype_name, shape, (begin, end) = spec["dtype"], tuple(spec["shape"]), spec["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: tensor {name!r} has a malformed header entry {spec!r}") from e
        if dtype_name not in SAFETENSORS_DTYPES:
            raise ValueError(
                f"{path}: tensor {name!r} has dtype {dtype_name}; accepted: {sorted(SAFETENSORS_DTYPES)}"
            )
        dtype = SAFETENSORS_DTYPES[dtype_name]
        nbytes = math.prod(shape) * dtype.itemsize
        if end - begin != nbytes or begin < 0:
            raise ValueError(
                f"{path}: tensor {name!r} ({dtype_name} {list(shape)}) has {end - begin} bytes "
                f"in the header, {nbytes} expected"
            )
        if end > data_size:
            raise ValueError(
                f"{path}: truncated safetensors file: tensor {name!r} ends at byte "
                f"{8 + n + end}, the file has {size} bytes"
            )
        specs[name] = (dtype, shape, begin)
    if not specs:
        return {}
    buffer = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n, shape=(data_size,)) \
        if data_size else np.zeros((0,), np.uint8)
    out = {}
    for name, (dtype, shape, begin) in specs.items():
        count = math.prod(shape)
        out[name] = np.frombuffer(buffer, dtype=dtype, count=count, offset=begin).reshape(shape)
    return out


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
