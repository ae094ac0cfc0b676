"""Tests of the T5.1.1 module: hand-checked layers, masks, packing, hooks, sharding."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ktx import partitioning
from ktx.models import t5

TINY = t5.T5Config(
    vocab_size=40, emb_dim=32, num_heads=2, num_encoder_layers=2, num_decoder_layers=2,
    head_dim=16, mlp_dim=64, dropout_rate=0.0,
)
ENC = jnp.array([[5, 6, 7, 1, 0, 0], [8, 9, 1, 0, 0, 0]], jnp.int32)
DEC_IN = jnp.array([[0, 11, 12, 13, 0], [0, 14, 15, 0, 0]], jnp.int32)
DEC_TGT = jnp.array([[11, 12, 13, 1, 0], [14, 15, 1, 0, 0]], jnp.int32)


@pytest.fixture(scope="module")
def tiny():
    module = t5.Transformer(TINY)
    variables = module.init(jax.random.key(0), ENC, DEC_IN, DEC_TGT, enable_dropout=False)
    return module, nn.unbox(variables)["params"]


_STATIC = ("enable_dropout", "decode", "max_decode_length", "mutable", "method")


def _apply(module):
    """A jitted `module.apply` (eager op-by-op dispatch is much slower on CPU)."""
    return jax.jit(module.apply, static_argnames=_STATIC)


def _logits(module, params, enc=ENC, dec_in=DEC_IN, tgt=DEC_TGT, **kw):
    return _apply(module)({"params": params}, enc, dec_in, tgt, enable_dropout=False, **kw)


def test_rms_norm_hand_values():
    norm = t5.RMSNorm()
    x = jnp.array([[[3.0, 4.0]]])
    variables = norm.init(jax.random.key(0), x)
    y = norm.apply(variables, x)
    # mean(x^2) = 12.5 -> x / sqrt(12.5)
    np.testing.assert_allclose(y, [[[0.8485281, 1.1313709]]], rtol=1e-5)
    # A per-example scale replaces the learned one (task-conditional layer norm).
    y2 = norm.apply({}, x, scale=jnp.array([[2.0, -1.0]]))
    np.testing.assert_allclose(y2, [[[1.6970563, -1.1313709]]], rtol=1e-5)
    with pytest.raises(ValueError, match="scale shape"):
        norm.apply({}, x, scale=jnp.ones((3,)))


def test_relative_position_buckets_match_hand_tables():
    # Bidirectional, 8 buckets, max distance 16: per direction 4 buckets, 2 exact.
    # n = query - key; keys after the query (n < 0) use buckets 4..7.
    n = np.arange(-8, 9)
    got = t5.relative_position_bucket(-n, bidirectional=True, num_buckets=8, max_distance=16)
    table = {0: 0, 1: 1, 2: 2, 3: 2, 4: 2, 5: 2, 6: 3, 7: 3, 8: 3}
    want = [table[abs(v)] + (4 if v < 0 else 0) for v in n]
    np.testing.assert_array_equal(got, want)
    # Causal, 8 buckets, max distance 16: 4 exact, 4 logarithmic; future keys -> 0.
    n = np.array([-3, -1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 15, 16, 100])
    got = t5.relative_position_bucket(-n, bidirectional=False, num_buckets=8, max_distance=16)
    want = [0, 0, 0, 1, 2, 3, 4, 4, 5, 5, 6, 6, 7, 7, 7, 7]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_bucket_biases_gradient_is_the_lookups(dtype):
    """`t5_layers.bucket_biases`: the lookup's values, and a gradient (each bucket's
    cotangents summed, in float32) equal to autodiff of the plain lookup's."""
    from ktx.models.t5_layers import bucket_biases

    rng = np.random.default_rng(0)
    table = jnp.asarray(rng.normal(size=(3, 8)), jnp.float32)
    buckets = t5.relative_position_bucket(
        jnp.arange(6)[None, :] - jnp.arange(5)[:, None], True, 8, 16)  # [Lq = 5, Lk = 6]
    cot = jnp.asarray(rng.normal(size=(3, 5, 6)), dtype)

    def plain(w):
        return jnp.take(w, buckets, axis=1).astype(dtype)

    np.testing.assert_array_equal(bucket_biases(table, buckets, jnp.dtype(dtype)), plain(table))
    got = jax.vjp(lambda w: bucket_biases(w, buckets, jnp.dtype(dtype)), table)[1](cot)[0]
    want = jax.vjp(plain, table)[1](cot)[0]
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    by_hand = np.zeros((3, 8))
    np.add.at(by_hand.T, np.asarray(buckets), np.moveaxis(np.asarray(cot, np.float64), 0, -1))
    np.testing.assert_allclose(got, by_hand, rtol=1e-6, atol=1e-6)


def test_gated_gelu_hand_value():
    mlp = t5.MlpBlock(intermediate_dim=1, activations=("gelu", "linear"))
    x = jnp.ones((1, 1, 1))
    params = {"wi_0": {"kernel": jnp.array([[1.0]])}, "wi_1": {"kernel": jnp.array([[2.0]])},
              "wo": {"kernel": jnp.array([[1.0]])}}
    y = mlp.apply({"params": params}, x)
    # gelu_tanh(1) * 2 = 0.5 * (1 + tanh(sqrt(2/pi) * 1.044715)) * 2
    np.testing.assert_allclose(y, [[[1.6823840]]], rtol=1e-5)


def test_every_param_has_logical_axes(tiny):
    module, _ = tiny
    boxed = module.init(jax.random.key(0), ENC, DEC_IN, DEC_TGT, enable_dropout=False)
    specs = nn.get_partition_spec(boxed)["params"]
    shapes = jax.tree.map(jnp.shape, nn.unbox(boxed))["params"]
    known = {"vocab", "embed", "mlp", "heads", "kv", "relpos_buckets"}
    flat_specs = jax.tree_util.tree_leaves_with_path(
        specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)
    )
    flat_shapes = dict(jax.tree_util.tree_leaves_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple)))
    assert len(flat_specs) == len(flat_shapes) > 50
    for path, spec in flat_specs:
        assert isinstance(spec, jax.sharding.PartitionSpec), path
        assert len(spec) == len(flat_shapes[path]), (path, spec)
        assert set(spec) <= known, (path, spec)


def test_causal_decoder_future_token_does_not_change_past(tiny):
    module, params = tiny
    base = _logits(module, params)
    changed = _logits(module, params, dec_in=DEC_IN.at[0, 3].set(30))
    np.testing.assert_allclose(base[0, :3], changed[0, :3], atol=1e-6)
    assert not np.allclose(base[0, 3], changed[0, 3])
    np.testing.assert_allclose(base[1], changed[1], atol=1e-6)


def test_encoder_padding_is_ignored(tiny):
    module, params = tiny
    base = _logits(module, params)
    longer = _logits(module, params, enc=jnp.pad(ENC, ((0, 0), (0, 3))))
    # Valid decoder positions are unchanged (fully padded queries attend uniformly).
    valid = np.asarray(DEC_TGT > 0)
    np.testing.assert_allclose(np.asarray(base)[valid], np.asarray(longer)[valid], atol=1e-5)


def test_packed_row_equals_separate_rows(tiny):
    module, params = tiny
    sep = _logits(module, params)
    # Row 0 then row 1 packed into one row (lengths 4+3 encoder, 4+3 decoder).
    enc = jnp.array([[5, 6, 7, 1, 8, 9, 1, 0]])
    enc_seg = jnp.array([[1, 1, 1, 1, 2, 2, 2, 0]])
    dec_in = jnp.array([[0, 11, 12, 13, 0, 14, 15, 0]])
    tgt = jnp.array([[11, 12, 13, 1, 14, 15, 1, 0]])
    dec_seg = jnp.array([[1, 1, 1, 1, 2, 2, 2, 0]])
    pos = jnp.array([[0, 1, 2, 3, 0, 1, 2, 0]])
    packed = _logits(
        module, params, enc=enc, dec_in=dec_in, tgt=tgt, encoder_segment_ids=enc_seg,
        decoder_segment_ids=dec_seg, encoder_positions=pos, decoder_positions=pos,
    )
    np.testing.assert_allclose(packed[0, :4], sep[0, :4], atol=1e-5)
    np.testing.assert_allclose(packed[0, 4:7], sep[1, :3], atol=1e-5)
    with pytest.raises(ValueError, match="both encoder_segment_ids and decoder_segment_ids"):
        _logits(module, params, enc=enc, dec_in=dec_in, tgt=tgt, encoder_segment_ids=enc_seg)


def test_bfloat16_activations_run(tiny):
    _, params = tiny
    module = t5.Transformer(dataclasses.replace(TINY, dtype="bfloat16"))
    logits = _logits(module, params)
    assert logits.dtype == jnp.float32  # logits in float32 whatever the activations
    assert np.all(np.isfinite(np.asarray(logits)))
    ref = _logits(t5.Transformer(TINY), params)
    np.testing.assert_allclose(np.asarray(logits), ref, atol=0.15)


@pytest.mark.parametrize("tied", [False, True])
def test_logits_are_float32_with_bfloat16_activations(tied):
    cfg = dataclasses.replace(TINY, dtype="bfloat16", logits_via_embedding=tied)
    module = t5.Transformer(cfg)
    params = nn.unbox(module.init(jax.random.key(0), ENC, DEC_IN, DEC_TGT,
                                  enable_dropout=False))["params"]
    logits = _logits(module, params)
    assert logits.dtype == jnp.float32
    # The output projection runs in float32 on the (bfloat16) final activations: the
    # logits are not bfloat16-rounded (a bfloat16 matmul has 8 mantissa bits).
    rounded = np.asarray(logits.astype(jnp.bfloat16).astype(jnp.float32))
    assert np.any(np.asarray(logits) != rounded)


def test_attention_dropout_is_broadcast_over_queries_as_t5x():
    # T5X's dot_product_attention draws one keep-mask per (batch, head, key) and
    # broadcasts it over the queries (dropout_shape[-2] = 1). With identical queries
    # and no mask or bias, every query's output is then identical; examples and heads
    # get different masks.
    attn = t5.MultiHeadAttention(num_heads=2, head_dim=4, dropout_rate=0.5)
    rng = np.random.default_rng(0)
    kv = jnp.asarray(rng.normal(size=(1, 6, 8)), jnp.float32)
    kv = jnp.concatenate([kv, kv], axis=0)  # two identical examples
    q = jnp.broadcast_to(jnp.asarray(rng.normal(size=(1, 1, 8)), jnp.float32), (2, 5, 8))
    variables = attn.init(jax.random.key(0), q, kv)
    out, state = attn.apply(variables, q, kv, deterministic=False,
                            rngs={"dropout": jax.random.key(3)}, mutable=["intermediates"])
    out = np.asarray(out)
    np.testing.assert_allclose(out, np.broadcast_to(out[:, :1], out.shape), rtol=1e-6)
    assert not np.allclose(out[0], out[1])  # a different mask per example
    clean = np.asarray(attn.apply(variables, q, kv))
    assert not np.allclose(out, clean)


def test_relative_position_config_without_log_buckets_is_rejected():
    # num_buckets 32: the causal decoder has 16 exact buckets, so max_distance must be > 16
    # (with <= 16 the logarithmic buckets divide by log(max_distance / 16) <= 0: NaN).
    with pytest.raises(ValueError, match=r"relative_attention_max_distance=16 must be > "
                                         r"relative_attention_num_buckets // 2 = 16"):
        t5.T5Config(relative_attention_num_buckets=32, relative_attention_max_distance=16)
    with pytest.raises(ValueError, match="relative_attention_max_distance=8"):
        t5.T5Config(relative_attention_num_buckets=32, relative_attention_max_distance=8)
    cfg = t5.T5Config(relative_attention_num_buckets=32, relative_attention_max_distance=17)
    assert cfg.relative_attention_max_distance == 17
    with pytest.raises(ValueError, match="max_distance=4 must be > the number of exact "
                                         "buckets 4"):
        t5.relative_position_bucket(jnp.arange(10), bidirectional=False, num_buckets=8,
                                    max_distance=4)
    # The smallest accepted configuration gives finite biases at every distance.
    small = dataclasses.replace(TINY, relative_attention_num_buckets=8,
                                relative_attention_max_distance=5)
    module = t5.Transformer(small)
    enc = jnp.tile(ENC, (1, 3))
    params = nn.unbox(module.init(jax.random.key(0), enc, DEC_IN, DEC_TGT,
                                  enable_dropout=False))["params"]
    assert np.all(np.isfinite(np.asarray(_logits(module, params, enc=enc))))


def test_config_validation():
    with pytest.raises(ValueError, match="T5Config.dtype='float16'"):
        t5.T5Config(dtype="float16")
    with pytest.raises(ValueError, match="mlp_activations"):
        t5.T5Config(mlp_activations=("swish",))
    with pytest.raises(ValueError, match="num_heads=0"):
        t5.T5Config(num_heads=0)
    assert t5.T5Config(mlp_activations=["gelu", "linear"]).mlp_activations == ("gelu", "linear")


def test_incremental_decode_matches_full_forward(tiny):
    module, params = tiny
    full = _logits(module, params, tgt=None)
    encoded = _apply(module)({"params": params}, ENC, enable_dropout=False, method=t5.Transformer.encode)
    length = DEC_IN.shape[1]

    def step(ids, cache):
        variables = {"params": params} if cache is None else {"params": params, "cache": cache}
        return _apply(module)(
            variables, encoded, ENC, ids, enable_dropout=False, decode=True,
            max_decode_length=length, mutable=("cache",), method=t5.Transformer.decode,
        )

    _, created = step(DEC_IN, None)
    cache = jax.tree.map(jnp.zeros_like, created["cache"])
    for i in range(length):
        logits, mutated = step(DEC_IN[:, i : i + 1], cache)
        cache = mutated["cache"]
        np.testing.assert_allclose(logits[:, 0], full[:, i], atol=1e-5)


class _PrefixAdapterLayer(t5.DecoderLayer):
    """Test subclass: constant per-example prefixes, an additive adapter."""

    def attention_prefix(self, x, task_id, *, name):
        table = self.param(f"{name}_prefix", nn.initializers.normal(1.0), (3, 2, 2, 2, 16))
        kv = table[task_id]  # [B, P=2, 2, H, D]
        return kv[:, :, 0], kv[:, :, 1]

    def adapt(self, y, task_id, *, name, deterministic):
        return y + nn.Dense(y.shape[-1], name=f"{name}_adapter")(y)


def test_hooks_prefix_and_adapter_with_decode_cache(tiny):
    module, params = tiny
    cond = t5.Transformer(TINY, decoder_layer_cls=_PrefixAdapterLayer)
    task_id = jnp.array([0, 2])
    init = cond.init(jax.random.key(1), ENC, DEC_IN, DEC_TGT, task_id, enable_dropout=False)
    cparams = nn.unbox(init)["params"]
    assert "self_attention_prefix" in cparams["decoder"]["layers_0"]
    assert "mlp_adapter" in cparams["decoder"]["layers_1"]
    # The plain parameters are unchanged in structure.
    plain_keys = set(jax.tree_util.tree_structure(params).node_data()[1])
    assert plain_keys <= set(cparams)
    logits, state = _apply(cond)(
        {"params": cparams}, ENC, DEC_IN, DEC_TGT, task_id, enable_dropout=False,
        mutable=("intermediates",),
    )
    probs = state["intermediates"]["decoder"]["layers_0"]["self_attention"]["attention_weights"][0]
    assert probs.shape == (2, 2, 5, 2 + 5)
    # The first (causal) query sees both prefix positions and itself only.
    assert np.all(probs[:, :, 0, :2] > 0)
    np.testing.assert_allclose(probs[:, :, 0, :3].sum(-1), 1.0, rtol=1e-5)
    assert np.all(probs[:, :, 0, 3:] < 1e-6)
    # Cached decoding agrees with the full forward pass, prefixes included.
    full = _apply(cond)({"params": cparams}, ENC, DEC_IN, None, task_id, enable_dropout=False)
    encoded = _apply(cond)({"params": cparams}, ENC, task_id, enable_dropout=False,
                         method=t5.Transformer.encode)
    kw = dict(enable_dropout=False, decode=True, max_decode_length=5, mutable=("cache",),
              method=t5.Transformer.decode)
    _, created = _apply(cond)({"params": cparams}, encoded, ENC, DEC_IN, None, task_id, **kw)
    cache = created["cache"]
    cache = jax.tree.map(jnp.zeros_like, cache)
    for i in range(5):
        step, mutated = _apply(cond)({"params": cparams, "cache": cache}, encoded, ENC,
                                   DEC_IN[:, i : i + 1], None, task_id, **kw)
        cache = mutated["cache"]
        np.testing.assert_allclose(step[:, 0], full[:, i], atol=1e-5)


class _PromptEncoder(t5.Encoder):
    def input_prompt(self, x, task_id):
        table = self.param("prompt", nn.initializers.normal(1.0), (3, 4, x.shape[-1]))
        return table[task_id]


def test_encoder_input_prompt_is_prepended(tiny):
    cond = t5.Transformer(TINY, encoder_cls=_PromptEncoder)
    task_id = jnp.array([1, 2])
    variables = cond.init(jax.random.key(2), ENC, DEC_IN, DEC_TGT, task_id, enable_dropout=False)
    encoded = _apply(cond)(variables, ENC, task_id, enable_dropout=False, method=t5.Transformer.encode)
    assert encoded.shape == (2, 4 + 6, 32)
    logits = _apply(cond)(variables, ENC, DEC_IN, DEC_TGT, task_id, enable_dropout=False)
    other = _apply(cond)(variables, ENC, DEC_IN, DEC_TGT, jnp.array([0, 2]), enable_dropout=False)
    assert not np.allclose(logits[0], other[0])
    np.testing.assert_allclose(logits[1], other[1], atol=1e-6)


def test_input_prompts_refuse_packed_inputs(tiny):
    # Prompts prepended once per row would be shared by a packed row's segments, whose
    # encoder states would then mix through the prompts' states: refused, naming the option.
    cond = t5.Transformer(TINY, encoder_cls=_PromptEncoder)
    task_id = jnp.array([1])
    enc = jnp.array([[5, 6, 7, 1, 8, 9, 1, 0]])
    seg = jnp.array([[1, 1, 1, 1, 2, 2, 2, 0]])
    dec_in = jnp.array([[0, 11, 12, 13, 0, 14, 15, 0]])
    variables = cond.init(jax.random.key(2), enc, dec_in, dec_in, task_id, enable_dropout=False)
    with pytest.raises(ValueError, match=r"packed inputs.*MultiTaskInput\.pack = False"):
        cond.apply(variables, enc, dec_in, dec_in, task_id, seg, seg, enable_dropout=False)
    encoded = cond.apply(variables, enc, task_id, enable_dropout=False,
                         method=t5.Transformer.encode)
    with pytest.raises(ValueError, match="packed inputs"):
        cond.apply(variables, encoded, enc, dec_in, dec_in, task_id, seg, seg,
                   enable_dropout=False, method=t5.Transformer.decode)


def test_sharded_forward_on_2x4_mesh(tiny):
    module, params = tiny
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices")
    mesh = partitioning.create_mesh(num_partitions=2)
    rules = partitioning.standard_logical_axis_rules()
    boxed = module.init(jax.random.key(0), ENC, DEC_IN, DEC_TGT, enable_dropout=False)
    shardings = partitioning.abstract_shardings(boxed, mesh, rules)["params"]
    sharded = jax.device_put(params, shardings)
    assert sharded["decoder"]["logits_dense"]["kernel"].sharding.spec == jax.sharding.PartitionSpec(
        None, "model"
    )
    batch = jnp.concatenate([ENC] * 4), jnp.concatenate([DEC_IN] * 4), jnp.concatenate([DEC_TGT] * 4)

    @jax.jit
    def fwd(p, e, d, t):
        return module.apply({"params": p}, e, d, t, enable_dropout=False)

    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        out = fwd(sharded, *batch)
    np.testing.assert_allclose(out[:2], _logits(module, params), atol=1e-5)
