"""LazyArray: region reads equal the eagerly converted tensor; placing reads only shards."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ktx import convert
from ktx.convert.lazy import LazyArray, place
from tests.convert.conftest import checkpoint_fixture


def _counting(array: np.ndarray, reads: list):
    def read(region):
        reads.append(tuple((s.start, s.stop) for s in region))
        return array[region]

    return read


@pytest.mark.parametrize("transpose,source_shape,shape", [
    (False, (6, 8), (6, 8)),          # copy
    (True, (8, 6), (6, 8)),           # "t": a torch Linear weight -> kernel
    (True, (12, 6), (6, 3, 4)),       # "in": q/k/v [H*D, E] -> [E, H, D]
    (True, (6, 12), (3, 4, 6)),       # "out": o [E, H*D] -> [H, D, E]
    (False, (6, 12), (6, 3, 4)),      # T5X's flattened heads, no transpose
])
def test_regions_equal_the_eager_conversion(transpose, source_shape, shape):
    rng = np.random.default_rng(0)
    source = rng.normal(size=source_shape).astype(np.float32)
    eager = (source.T if transpose else source).reshape(shape)
    lazy = LazyArray.of(source, "w").convert(transpose=transpose, shape=shape)
    assert lazy.shape == shape and np.array_equal(np.asarray(lazy), eager)
    for _ in range(20):
        index = []
        for dim in shape:
            a, b = sorted(rng.integers(0, dim + 1, size=2))
            index.append(slice(int(a), int(b)))
        np.testing.assert_array_equal(lazy[tuple(index)], eager[tuple(index)])


def test_bad_shapes_and_indices_are_named():
    source = LazyArray.of(np.zeros((4, 6), np.float32), "enc/q")
    with pytest.raises(ValueError, match="enc/q: shape \\[5, 5\\]"):
        source.convert(shape=(5, 5))
    with pytest.raises(IndexError, match="unit-step"):
        source[::2]
    with pytest.raises(IndexError, match="only slices"):
        source[1]


def test_place_reads_only_each_shard_once():
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))  # conftest: 8 CPU devices
    model = mesh.shape["model"]
    source = np.arange(16 * 8 * model, dtype=np.float32).reshape(8 * model, 16)  # [H*D, E]
    reads: list = []
    lazy = LazyArray(_counting(source, reads), source.shape, np.float32, transpose=True,
                     shape=(16, model, 8))
    placed = place(lazy, NamedSharding(mesh, P(None, "model", None)), np.float32)
    np.testing.assert_array_equal(np.asarray(placed), source.T.reshape(16, model, 8))
    # One read per distinct shard (the data axis replicates), each of a shard's size.
    assert len(reads) == model
    assert all((stop - start) == 8 for (start, stop), _ in reads)


@pytest.mark.parametrize("source", ["hf:hf_t5_v1_1_tiny", "hf:hf_t5_v1_0_tiny", "hf:hf_bert_tiny",
                                    "t5x:t5x_t5_1_1_tiny/checkpoint_1"])
def test_lazy_reader_equals_the_eager_one(source):
    prefix, name = source.split(":")
    folder, _, step = name.partition("/")
    path = checkpoint_fixture(folder) / step
    eager = convert.load_source(f"{prefix}:{path}")
    lazy = convert.load_source(f"{prefix}:{path}", lazy=True)
    eager_flat, lazy_flat = convert.flatten(eager.params), convert.flatten(lazy.params)
    assert eager_flat.keys() == lazy_flat.keys()
    for k, v in lazy_flat.items():
        assert isinstance(v, LazyArray), k
        got = np.asarray(v)
        assert got.dtype == np.float32 and np.array_equal(got, eager_flat[k]), k
