"""Embedding tables of bfloat16 models accumulate their gradients in float32.

A table is looked up in float32 and the rows cast to the activation dtype, so the
backward pass scatter-adds each row's cotangent into a float32 gradient. Cast first, the
scatter-add ran in bfloat16: it rounds once a row's sum passes 256 (8 significant bits),
and on a GPU its one kernel took 1.2 s of a 1.3 s T5.1.1-Small step on an H200
(docs/performance.md).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ktx.models import bert, t5_layers

# 1,000 lookups of row 0: exactly 1000.0 in float32; a bfloat16 running sum stops at 256.
N = 1000


def test_t5_embed_gradient_accumulates_in_float32():
    embed = t5_layers.Embed(num_embeddings=8, features=4, dtype=jnp.bfloat16)
    ids = jnp.zeros((1, N), jnp.int32)
    variables = nn.unbox(embed.init(jax.random.key(0), ids))
    grads = jax.grad(lambda p: jnp.sum(
        embed.apply({"params": p}, ids).astype(jnp.float32)))(variables["params"])
    g = np.asarray(grads["embedding"])
    assert g.dtype == np.float32
    np.testing.assert_array_equal(g[0], np.full(4, N, np.float32))
    np.testing.assert_array_equal(g[1:], 0)


def test_relative_position_bias_gradient_accumulates_in_float32():
    bias = t5_layers.RelativePositionBiases(num_buckets=32, max_distance=128, num_heads=2,
                                            dtype=jnp.bfloat16)
    q = k = jnp.arange(300)
    variables = nn.unbox(bias.init(jax.random.key(0), q, k, True))
    out = bias.apply(variables, q, k, True)
    assert out.dtype == jnp.bfloat16
    grads = jax.grad(lambda p: jnp.sum(
        bias.apply({"params": p}, q, k, True).astype(jnp.float32)))(variables["params"])
    g = np.asarray(grads["rel_embedding"])
    # Each bucket's gradient is the number of (query, key) pairs that fall in it.
    buckets = np.asarray(t5_layers.relative_position_bucket(
        np.asarray(k)[None, :] - np.asarray(q)[:, None], True, 32, 128))
    counts = np.bincount(buckets.ravel(), minlength=32).astype(np.float32)
    assert counts.max() > 256  # past bfloat16's exact integers
    np.testing.assert_array_equal(g, np.stack([counts, counts]))


@pytest.mark.parametrize("table", ["word_embeddings", "position_embeddings",
                                   "token_type_embeddings"])
def test_bert_embeddings_gradient_accumulates_in_float32(table):
    emb = bert.BertEmbeddings(vocab_size=16, hidden_size=4, max_position=N,
                              type_vocab_size=2, dtype=jnp.bfloat16)
    ids = jnp.zeros((1, N), jnp.int32)
    variables = nn.unbox(emb.init(jax.random.key(0), ids, ids, True))

    def loss(p):
        out = emb.apply({"params": p}, ids, method=lambda m, i: getattr(m, table)(i))
        assert out.dtype == jnp.bfloat16
        return jnp.sum(out.astype(jnp.float32))

    g = np.asarray(jax.grad(loss)(variables["params"])[table]["embedding"])
    assert g.dtype == np.float32
    np.testing.assert_array_equal(g[0], np.full(4, N, np.float32))
    np.testing.assert_array_equal(g[1:], 0)


def test_bert_embed_rejects_float_ids():
    emb = bert.BertEmbeddings(vocab_size=16, hidden_size=4, max_position=8,
                              type_vocab_size=2)
    ids = jnp.zeros((1, 4), jnp.int32)
    variables = emb.init(jax.random.key(0), ids, ids, True)
    with pytest.raises(ValueError, match="word_embeddings: token ids must be integers"):
        emb.apply(variables, ids.astype(jnp.float32), ids, True)
