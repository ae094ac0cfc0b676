"""Tests of EncoderDecoderModel: loss terms, per-task sums, scoring, gin files, overfitting."""

import functools
import math
import pathlib

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ktx.models import seq2seq, t5
from tests.models.t5_batches import tiny_t5_batch

REPO = pathlib.Path(__file__).resolve().parents[2]
SMALL = t5.T5Config(
    vocab_size=24, emb_dim=16, num_heads=2, num_encoder_layers=1, num_decoder_layers=1,
    head_dim=8, mlp_dim=32, dropout_rate=0.0,
)


def _batch():
    return tiny_t5_batch((0, 1, 0, 2))


@functools.lru_cache(maxsize=None)
def _model_and_params(**kw):
    model = seq2seq.EncoderDecoderModel(SMALL, num_tasks=3, **kw)
    params = nn.unbox(model.init_variables(jax.random.key(0), _batch()))["params"]
    return model, params


@gin.configurable("seq2seq_test_model")
def _model_from_gin(model):
    return model


def _sub(batch, rows):
    return {k: v[rows] for k, v in batch.items()}


def test_weighted_cross_entropy_hand_values():
    logits = jnp.array([[[0.0, 0.0, math.log(2.0)]]])  # p = (1/4, 1/4, 1/2)
    targets = jnp.array([[2]])
    ce, z = seq2seq.weighted_cross_entropy(logits, targets, jnp.ones((1, 1)), z_loss=1e-2)
    np.testing.assert_allclose(ce, [[math.log(2.0)]], rtol=1e-6)
    np.testing.assert_allclose(z, [[1e-2 * math.log(4.0) ** 2]], rtol=1e-6)
    # Label smoothing 0.1: q = (0.05, 0.05, 0.9); -sum q log p = 0.7624618, minus the
    # entropy of q (0.3943973) -> 0.3680645.
    ce, _ = seq2seq.weighted_cross_entropy(logits, targets, jnp.ones((1, 1)), label_smoothing=0.1)
    np.testing.assert_allclose(ce, [[0.3680645]], rtol=1e-5)
    # Weights scale (and zero out) the loss.
    ce, z = seq2seq.weighted_cross_entropy(logits, targets, jnp.zeros((1, 1)), z_loss=1.0)
    assert float(ce.sum()) == 0.0 and float(z.sum()) == 0.0


def test_weighted_cross_entropy_gradient_by_hand_and_autodiff():
    # p = (1/4, 1/4, 1/2), target 2, log_z = log 4: d ce / d logits = p - onehot,
    # d z / d logits = 2 z_loss log_z p (the one-pass custom VJP).
    logits = jnp.array([[[0.0, 0.0, math.log(2.0)]]])
    targets, weights = jnp.array([[2]]), jnp.ones((1, 1))

    def total(lg, w, fn=seq2seq.weighted_cross_entropy, **kw):
        ce, z = fn(lg, targets, w, **kw)
        return ce.sum() + 3.0 * z.sum()

    p = np.array([0.25, 0.25, 0.5])
    got = jax.jit(jax.grad(functools.partial(total, z_loss=1e-2)))(logits, weights)
    want = p - [0, 0, 1] + 3.0 * 2 * 1e-2 * math.log(4.0) * p
    np.testing.assert_allclose(got[0, 0], want, rtol=1e-6)

    def formula(lg, tg, w, label_smoothing=0.0, z_loss=0.0):  # autodiff of the formula
        vocab = lg.shape[-1]
        low = label_smoothing / (vocab - 1)
        log_z = jax.nn.logsumexp(lg, axis=-1)
        log_probs = lg - log_z[..., None]
        q = jnp.where(jax.nn.one_hot(tg, vocab) > 0, 1.0 - label_smoothing, low)
        return -(q * log_probs).sum(-1) * w, z_loss * jnp.square(log_z) * w

    rs = np.random.RandomState(0)
    lg = jnp.asarray(3 * rs.randn(2, 3, 7), jnp.float32)
    w = jnp.asarray(rs.rand(2, 3), jnp.float32)
    tg = jnp.asarray(rs.randint(0, 7, (2, 3)))
    targets = tg
    for kw in ({}, {"z_loss": 0.3}, {"label_smoothing": 0.1, "z_loss": 1e-4}):
        got = jax.jit(jax.grad(functools.partial(total, **kw), argnums=(0, 1)))(lg, w)
        want = jax.grad(functools.partial(total, fn=formula, **kw), argnums=(0, 1))(lg, w)
        np.testing.assert_allclose(got[0], want[0], atol=2e-6)
        # the weights' gradient is the per-token loss (minus q's entropy, a constant)
        if "label_smoothing" not in kw:
            np.testing.assert_allclose(got[1], want[1], rtol=1e-5)
    # per-row VJPs (the balanced step's vmapped engine) see the same gradient
    rows = jax.vmap(jax.grad(lambda x: total(x, w, z_loss=0.3)))(jnp.stack([lg, 2 * lg]))
    np.testing.assert_allclose(rows[1], jax.grad(lambda x: total(x, w, z_loss=0.3))(2 * lg),
                               atol=1e-6)


def test_first_argmax_is_argmax_with_ties():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 5, 97)).astype(np.float32)
    x[0, 0, [4, 60]] = 9.0  # a tie: the first index, as argmax
    x[0, 1, :] = 0.0  # every logit equal: index 0
    x[1, 2, :] = -1e30
    x[1, 2, [3, 7]] = -1e-30  # tiny differences still count
    x[1, 2, 7] = -1e-30 * 0.5
    x[2, 3, :] = -np.inf
    x[2, 3, 96] = -1.0  # the maximum at the last index, -inf around it
    got = jax.jit(seq2seq.first_argmax)(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(got), np.argmax(x, axis=-1))
    assert got.dtype == jnp.int32 and got[0, 0] == 4 and got[0, 1] == 0
    assert got[1, 2] == 7 and got[2, 3] == 96
    # bfloat16 logits: the argmax of the same values
    np.testing.assert_array_equal(
        np.asarray(seq2seq.first_argmax(jnp.asarray(x[:2], jnp.bfloat16))),
        np.argmax(np.asarray(jnp.asarray(x[:2], jnp.bfloat16), np.float32), axis=-1))
    # Rows too long for exact float32 indices take the integer path.
    wide = np.zeros((2, 2 ** 23 + 3), np.float32)
    wide[0, [2 ** 23 + 1, 2 ** 23 + 2]] = 1.0
    np.testing.assert_array_equal(np.asarray(jax.jit(seq2seq.first_argmax)(wide)), [2 ** 23 + 1, 0])


def test_infusion_term_hand_values():
    logits = jnp.zeros((2, 3, 4)).at[0, 0, 2].set(3.0).at[0, 1, 1].set(2.0).at[0, 2, 3].set(9.0)
    targets = jnp.array([[2, 1, 3], [0, 0, 0]])
    weights = jnp.array([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    # Example 0: targets with weight > 0 have raw logits 3 and 2 -> beta / 5 per token.
    got = seq2seq.infusion_term(logits, targets, weights, beta=10.0)
    np.testing.assert_allclose(got, [[2.0, 2.0, 0.0], [0.0, 0.0, 0.0]], rtol=1e-6)


def test_loss_fn_is_token_mean_and_task_losses_add_up():
    model, params = _model_and_params()
    batch = _batch()
    loss, aux = model.loss_fn(params, batch, None, False)
    task_losses, _ = model.task_losses(params, batch, None, False)
    np.testing.assert_allclose(task_losses.sum(), loss, rtol=1e-6)
    # By hand: mean over target tokens of -log p(target) + z_loss * logZ^2.
    logits = np.asarray(model.logits(params, batch), np.float64)
    log_z = np.log(np.exp(logits).sum(-1))
    logp = np.take_along_axis(logits, batch["decoder_target_tokens"][..., None], -1)[..., 0] - log_z
    w = batch["decoder_loss_weights"]
    want = ((-logp + 1e-4 * log_z**2) * w).sum() / w.sum()
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    np.testing.assert_allclose(aux["weight"], [3 + 4, 2, 2])
    np.testing.assert_allclose(model.task_weights(batch), [7, 2, 2])
    assert set(aux) == {"loss", "cross_entropy", "z_loss", "accuracy", "weight"}


def test_per_task_sums_equal_each_task_alone():
    model, params = _model_and_params()
    batch = _batch()
    sums, aux = model.loss_sums(params, batch, None, False)
    for task, rows in ((0, [0, 2]), (1, [1]), (2, [3])):
        alone, alone_aux = model.loss_sums(params, _sub(batch, rows), None, False)
        np.testing.assert_allclose(sums[task], alone[task], rtol=1e-5)
        assert float(alone.sum() - alone[task]) == 0.0
        for key in aux:
            np.testing.assert_allclose(aux[key][task], alone_aux[key][task], rtol=1e-5)


def test_per_task_normalization_averages_each_task():
    model, params = _model_and_params(loss_normalization="per_task")
    batch = _batch()
    losses, aux = model.task_losses(params, batch, None, False)
    np.testing.assert_allclose(losses, aux["loss"] / aux["weight"], rtol=1e-6)


def test_padding_is_ignored():
    model, params = _model_and_params()
    batch = _batch()
    loss, _ = model.loss_fn(params, batch, None, False)
    # Garbage in padded target / input positions (weight 0) changes nothing.
    noisy = dict(batch)
    pad = batch["decoder_loss_weights"] == 0
    noisy["decoder_target_tokens"] = np.where(pad, 7, batch["decoder_target_tokens"])
    noisy["decoder_input_tokens"] = np.where(pad, 9, batch["decoder_input_tokens"])
    np.testing.assert_allclose(model.loss_fn(params, noisy, None, False)[0], loss, rtol=1e-6)


def test_z_loss_and_label_smoothing_change_the_loss_as_expected():
    batch = _batch()
    plain, params = _model_and_params(z_loss=0.0)
    with_z, _ = _model_and_params(z_loss=0.5)
    base, base_aux = plain.loss_sums(params, batch, None, False)
    z, z_aux = with_z.loss_sums(params, batch, None, False)
    np.testing.assert_allclose(z - base, z_aux["z_loss"], rtol=1e-5)
    assert np.all(np.asarray(z_aux["z_loss"]) > 0)
    np.testing.assert_allclose(base_aux["z_loss"], 0.0)
    smooth, _ = _model_and_params(z_loss=0.0, label_smoothing=0.1)
    s, _ = smooth.loss_sums(params, batch, None, False)
    logits = smooth.logits(params, batch)
    ce, _ = seq2seq.weighted_cross_entropy(
        logits, batch["decoder_target_tokens"], batch["decoder_loss_weights"], label_smoothing=0.1
    )
    np.testing.assert_allclose(s.sum(), ce.sum(), rtol=1e-5)
    assert not np.allclose(s, base)


def test_infusion_beta_adds_its_term():
    batch = _batch()
    plain, params = _model_and_params(z_loss=0.0)
    infused, _ = _model_and_params(z_loss=0.0, infusion_beta=10.0)
    base, _ = plain.loss_sums(params, batch, None, False)
    total, aux = infused.loss_sums(params, batch, None, False)
    np.testing.assert_allclose(total - base, aux["infusion"], rtol=1e-4, atol=1e-4)
    logits = np.asarray(plain.logits(params, batch))
    tl = np.take_along_axis(logits, batch["decoder_target_tokens"][..., None], -1)[..., 0]
    w = batch["decoder_loss_weights"]
    per_example = 10.0 / (tl * w).sum(-1) * w.sum(-1)
    np.testing.assert_allclose(aux["infusion"], [per_example[0] + per_example[2], per_example[1],
                                                 per_example[3]], rtol=1e-4)


def test_score_batch_is_row_log_likelihood():
    model, params = _model_and_params(z_loss=0.0)
    batch = _batch()
    scores = model.score_batch(params, batch)
    _, aux = model.loss_sums(params, batch, None, False)
    assert scores.shape == (4,)
    np.testing.assert_allclose(-scores.sum(), aux["cross_entropy"].sum(), rtol=1e-5)
    alone = model.score_batch(params, _sub(batch, [1]))
    np.testing.assert_allclose(alone[0], scores[1], rtol=1e-5)


def test_dropout_needs_rng_and_changes_training_loss():
    import dataclasses

    model = seq2seq.EncoderDecoderModel(dataclasses.replace(SMALL, dropout_rate=0.3), num_tasks=3)
    _, params = _model_and_params()
    batch = _batch()
    with pytest.raises(ValueError, match="needs an rng"):
        model.loss_fn(params, batch, None, True)
    train, _ = model.loss_fn(params, batch, jax.random.key(1), True)
    evaluation, _ = model.loss_fn(params, batch, None, False)
    assert not np.allclose(train, evaluation)


def test_bfloat16_activations_give_float32_logits_and_loss():
    import dataclasses

    model = seq2seq.EncoderDecoderModel(dataclasses.replace(SMALL, dtype="bfloat16"), num_tasks=3)
    _, params = _model_and_params()
    batch = _batch()
    logits = model.logits(params, batch)
    assert logits.dtype == jnp.float32
    loss, aux = model.loss_fn(params, batch, None, False)
    assert loss.dtype == jnp.float32
    assert all(v.dtype == jnp.float32 for v in aux.values()), {k: v.dtype for k, v in aux.items()}
    # The loss is the float32 cross-entropy of those float32 logits.
    ce, z = seq2seq.weighted_cross_entropy(
        logits, batch["decoder_target_tokens"], batch["decoder_loss_weights"], z_loss=1e-4)
    np.testing.assert_allclose(aux["loss"].sum(), (ce + z).sum(), rtol=1e-6)


def test_input_spec_and_validation():
    model, _ = _model_and_params()
    spec = model.input_spec(4, {"inputs": 7, "targets": 5}, packed=True)
    assert spec["encoder_input_tokens"].shape == (4, 7)
    assert spec["decoder_loss_weights"].dtype == jnp.float32
    assert spec["task_id"].shape == (4,) and spec["decoder_positions"].shape == (4, 5)
    variables = jax.eval_shape(lambda: model.init_variables(jax.random.key(0), spec))
    assert "params" in variables
    with pytest.raises(ValueError, match="'targets'"):
        model.input_spec(4, {"inputs": 7})
    batch = _batch()
    del batch["task_id"]
    with pytest.raises(ValueError, match=r"missing features \['task_id'\]"):
        model.task_weights(batch)
    with pytest.raises(ValueError, match="loss_normalization='mean'"):
        seq2seq.EncoderDecoderModel(SMALL, loss_normalization="mean")
    with pytest.raises(ValueError, match="differs from module.config"):
        seq2seq.EncoderDecoderModel(t5.T5Config(), module=t5.Transformer(SMALL))
    same = seq2seq.EncoderDecoderModel(SMALL, module=t5.Transformer(SMALL))
    assert same.config is SMALL
    with pytest.raises(ValueError, match="num_tasks=0"):
        seq2seq.EncoderDecoderModel(SMALL, num_tasks=0)


@pytest.mark.parametrize("name", ["tiny", "small", "base", "large", "xl", "xxl"])
def test_model_gin_files_build_published_shapes(name):
    gin.clear_config()
    try:
        gin.parse_config_files_and_bindings(
            [str(REPO / "gin" / "models" / f"t5_1_1_{name}.gin")],
            ["seq2seq_test_model.model = %MODEL", "NUM_TASKS = 3"],
        )
        model = _model_from_gin()
    finally:
        gin.clear_config()
    assert isinstance(model, seq2seq.EncoderDecoderModel) and model.num_tasks == 3
    # Published T5.1.1 parameter counts (vocabulary 32,128).
    published = {"small": 76_961_152, "base": 247_577_856, "large": 783_150_080,
                 "xl": 2_849_757_184, "xxl": 11_135_332_352, "tiny": 2_105_856}
    if name in ("tiny", "small", "base"):
        spec = model.input_spec(1, {"inputs": 4, "targets": 4})
        shapes = jax.eval_shape(lambda: model.init_variables(jax.random.key(0), spec))
        count = sum(math.prod(x.shape) for x in jax.tree.leaves(nn.unbox(shapes)))
        assert count == published[name]
    else:
        cfg = model.config
        per_layer_enc = 4 * cfg.emb_dim * cfg.num_heads * cfg.head_dim + 3 * cfg.emb_dim * cfg.mlp_dim + 2 * cfg.emb_dim
        per_layer_dec = per_layer_enc + 4 * cfg.emb_dim * cfg.num_heads * cfg.head_dim + cfg.emb_dim
        count = (2 * cfg.vocab_size * cfg.emb_dim + 2 * cfg.num_heads * 32 + 2 * cfg.emb_dim
                 + cfg.num_encoder_layers * per_layer_enc + cfg.num_decoder_layers * per_layer_dec)
        assert count == published[name]


def test_tiny_model_overfits_two_examples_and_decodes_them():
    cfg = t5.T5Config(
        vocab_size=20, emb_dim=32, num_heads=2, num_encoder_layers=1, num_decoder_layers=1,
        head_dim=16, mlp_dim=64, dropout_rate=0.0,
    )
    model = seq2seq.EncoderDecoderModel(cfg, num_tasks=2, z_loss=0.0)
    tgt = np.array([[4, 5, 6, 1], [7, 8, 1, 0]], np.int32)
    batch = {
        "encoder_input_tokens": np.array([[3, 9, 1], [10, 11, 1]], np.int32),
        "decoder_input_tokens": np.array([[0, 4, 5, 6], [0, 7, 8, 0]], np.int32),
        "decoder_target_tokens": tgt,
        "decoder_loss_weights": (tgt > 0).astype(np.float32),
        "task_id": np.array([0, 1], np.int32),
    }
    params = nn.unbox(model.init_variables(jax.random.key(3), batch))["params"]
    tx = optax.adam(3e-2)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state):
        (loss, _), grads = jax.value_and_grad(model.loss_fn, has_aux=True)(params, batch, None, False)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    for _ in range(40):
        params, opt_state, loss = step(params, opt_state)
    assert float(loss) < 0.05
    want = np.where(tgt == 1, 0, tgt)  # EOS and after replaced by 0
    predict = jax.jit(functools.partial(model.predict_batch, max_decode_length=5))
    got = predict(params, batch)
    np.testing.assert_array_equal(got, np.pad(want, ((0, 0), (0, 1))))
    beam = jax.jit(functools.partial(model.predict_batch, decode_method="beam", num_beams=3))
    np.testing.assert_array_equal(beam(params, batch), want)
