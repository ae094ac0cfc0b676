"""Tensors of a checkpoint that are read only where, and when, they are needed.

A converter maps each checkpoint tensor to a ktx parameter by at most a transpose and a
reshape that splits one axis (`[H*D, E]` -> transpose -> `[E, H, D]`). `LazyArray`
records that mapping instead of applying it: `lazy[index]` reads only the region of the
source that the ktx-layout `index` covers (a safetensors slice, a TensorStore region)
and converts it. `jax.make_array_from_callback(shape, sharding, lazy.__getitem__)` then
builds each parameter from the shards this process's devices hold, so a process never
reads, converts or keeps more of a checkpoint than its own shards (plus one shard being
converted): `place(lazy, sharding)`. `np.asarray(lazy)` reads the whole tensor.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["LazyArray", "materialize", "place"]

Index = tuple[slice, ...]


class LazyArray:
    """A tensor of `shape` whose values come from `read(region)` of a source tensor.

    `read` takes a tuple of unit-step slices over the *source* (one per source axis) and
    returns that region. The ktx value is `(source.T if transpose else source)` reshaped
    to `shape` and cast to `dtype`; reshaping may only split an axis of the (transposed)
    source into consecutive axes, as attention kernels' heads are split.
    """

    def __init__(self, read: Callable[[Index], Any], source_shape: tuple[int, ...], dtype: Any,
                 *, transpose: bool = False, shape: tuple[int, ...] | None = None,
                 name: str = ""):
        self._read = read
        self.source_shape = tuple(int(d) for d in source_shape)
        self.transpose = transpose
        view = self.source_shape[::-1] if transpose else self.source_shape
        self.shape = tuple(int(d) for d in (view if shape is None else shape))
        self.dtype = np.dtype(dtype)
        self.name = name
        self._groups = _axis_groups(view, self.shape, name)

    @classmethod
    def of(cls, array: np.ndarray, name: str = "") -> "LazyArray":
        """A LazyArray over an array already in memory (small inline arrays)."""
        array = np.asarray(array)
        return cls(lambda region: array[region], array.shape, array.dtype, name=name)

    def convert(self, *, transpose: bool = False, shape: tuple[int, ...] | None = None,
                dtype: Any = np.float32) -> "LazyArray":
        """This tensor transposed (2-D) and/or reshaped, as a new LazyArray on the same
        source (only valid on a LazyArray that is itself untransformed)."""
        if self.transpose or self.shape != self.source_shape:
            raise ValueError(f"{self.name}: convert() applies to a source tensor only")
        return LazyArray(self._read, self.source_shape, dtype, transpose=transpose,
                         shape=shape, name=self.name)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def __getitem__(self, index: Any) -> np.ndarray:
        """The ktx-layout region `index` (slices with unit step, or `()` for all)."""
        index = _normalize(index, self.shape, self.name)
        view_index, post, block_shape = [], [], []
        for axes in self._groups:
            first = index[axes[0]]
            inner = math.prod(self.shape[a] for a in axes[1:])
            view_index.append(slice(first.start * inner, first.stop * inner))
            block_shape += [first.stop - first.start, *(self.shape[a] for a in axes[1:])]
            post += [slice(None), *(index[a] for a in axes[1:])]
        region = tuple(view_index[::-1]) if self.transpose else tuple(view_index)
        block = np.asarray(self._read(region))
        if self.transpose:
            block = block.T
        block = block.reshape(block_shape)[tuple(post)]
        return np.ascontiguousarray(block, dtype=self.dtype)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        value = self[()]
        return value if dtype is None else value.astype(dtype, copy=False)

    def __repr__(self) -> str:
        return f"LazyArray({self.name or '?'}, shape={list(self.shape)}, dtype={self.dtype})"


def materialize(flat: dict[str, Any], lazy: bool) -> dict[str, Any]:
    """`flat` as it is (`lazy`) or with every LazyArray read into a numpy array."""
    if lazy:
        return flat
    return {k: np.asarray(v) if isinstance(v, LazyArray) else v for k, v in flat.items()}


def place(value: Any, sharding: Any, dtype: Any) -> Any:
    """A `jax.Array` of `value` (a LazyArray or an array) laid out by `sharding`, built
    from the regions this process's devices hold; a LazyArray is read region by region
    (each distinct region once)."""
    import jax

    if not isinstance(value, LazyArray):
        value = np.asarray(value, dtype)
        return jax.device_put(value, sharding) if sharding is not None else jax.numpy.asarray(value)
    if sharding is None:
        return jax.numpy.asarray(np.asarray(value[()], dtype))
    done: dict[tuple, np.ndarray] = {}

    def region(index: Index) -> np.ndarray:
        key = tuple(_normalize(index, value.shape, value.name))
        key = tuple((s.start, s.stop) for s in key)
        if key not in done:  # replicated shards: read once per process
            done[key] = np.asarray(value[index], dtype)
        return done[key]

    return jax.make_array_from_callback(value.shape, sharding, region)


def _axis_groups(view: tuple[int, ...], shape: tuple[int, ...], name: str) -> list[list[int]]:
    """For each axis of `view`, the consecutive axes of `shape` it splits into."""
    groups, axis = [], 0
    for size in view:
        group, product = [], 1
        while axis < len(shape) and (not group or product < size):
            group.append(axis)
            product *= shape[axis]
            axis += 1
        if product != size:
            raise ValueError(f"{name}: shape {list(shape)} is not a split of the axes {list(view)}")
        groups.append(group)
    if axis != len(shape):
        raise ValueError(f"{name}: shape {list(shape)} is not a split of the axes {list(view)}")
    return groups


def _normalize(index: Any, shape: tuple[int, ...], name: str) -> list[slice]:
    if not isinstance(index, tuple):
        index = (index,)
    if len(index) > len(shape):
        raise IndexError(f"{name}: {len(index)} indices for {len(shape)} axes")
    out = []
    for i, dim in enumerate(shape):
        s = index[i] if i < len(index) else slice(None)
        if not isinstance(s, slice):
            raise IndexError(f"{name}: only slices are accepted, got {s!r}")
        start, stop, step = s.indices(dim)
        if step != 1:
            raise IndexError(f"{name}: only unit-step slices are accepted, got {s!r}")
        out.append(slice(start, max(start, stop)))
    return out
