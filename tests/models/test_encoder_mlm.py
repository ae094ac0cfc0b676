"""`ktx.models.encoder_mlm.EncoderMlmModel`: the masked-LM loss and the knowledge-infusion
term against NumPy, the per-task contract under dropout (task blocks = whole batch, per-task
gradients sum to the plain one), training through the Trainer, and bad arguments."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ktx import optim
from ktx.models import bert
from ktx.models.base import with_row_ids
from ktx.models.encoder_mlm import EncoderMlmModel
from ktx.optim import compute_task_gradients
from ktx.training import trainer as trainer_lib

TINY = bert.BertConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                       intermediate_size=64, max_position=16)
COUNTS = (3, 5)


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    n = sum(COUNTS)
    ids = rng.integers(5, 64, (n, 10)).astype(np.int32)
    ids[::3, 7:] = 0
    weights = (rng.random((n, 10)) < 0.3).astype(np.float32) * (ids > 0)
    weights[0] = 0.0  # a row with nothing to predict: no loss, no infusion term
    return {
        "input_ids": ids,
        "token_type_ids": np.zeros_like(ids),
        "attention_mask": (ids > 0).astype(np.int32),
        "mlm_targets": np.where(weights > 0, rng.integers(5, 64, (n, 10)), 0).astype(np.int32),
        "mlm_weights": weights,
        "task_id": np.repeat(np.arange(len(COUNTS)), COUNTS).astype(np.int32),
    }


def _params(model, batch):
    return nn.unbox(model.init_variables(jax.random.key(0), batch)["params"])


def test_loss_and_infusion_term_by_hand():
    beta = 10.0
    model = EncoderMlmModel(TINY, num_tasks=2, infusion_beta=beta)
    batch = _batch()
    params = _params(model, batch)
    assert {"mlm", "pooler", "embeddings"} <= set(params)
    z = np.asarray(model.logits(params, batch), np.float64)  # [B, L, V]
    sums, aux = model.loss_sums(params, batch, None, False)
    y, w, task = batch["mlm_targets"], batch["mlm_weights"], batch["task_id"]
    logp = z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) - z.max(-1, keepdims=True)
    ce = -np.take_along_axis(logp, y[..., None], -1)[..., 0] * w
    zy = np.take_along_axis(z, y[..., None], -1)[..., 0]
    s = (zy * w).sum(-1)
    assert (s > 0).any() and (s < 0).any()  # both sides of the pole are exercised
    inf = np.where(s <= 0, 0.0, beta / np.where(s <= 0, 1.0, s))[:, None] * w
    hit = (z.argmax(-1) == y) * w
    for t in range(2):
        rows = task == t
        np.testing.assert_allclose(aux["loss"][t], ce[rows].sum(), rtol=1e-5)
        np.testing.assert_allclose(aux["infusion"][t], inf[rows].sum(), rtol=1e-4)
        np.testing.assert_allclose(sums[t], ce[rows].sum() + inf[rows].sum(), rtol=1e-4)
        np.testing.assert_allclose(aux["weight"][t], w[rows].sum())
        np.testing.assert_allclose(aux["accuracy"][t], hit[rows].sum())
    np.testing.assert_allclose(model.task_weights(batch), [w[task == t].sum() for t in range(2)])
    # beta = 0: the plain masked-LM loss, no infusion entry.
    plain = EncoderMlmModel(TINY, num_tasks=2)
    p_sums, p_aux = plain.loss_sums(params, batch, None, False)
    np.testing.assert_allclose(p_sums, aux["loss"], rtol=1e-6)
    assert "infusion" not in p_aux


def test_task_blocks_and_gradients_match_the_whole_batch_under_dropout():
    model = EncoderMlmModel(TINY, num_tasks=2, infusion_beta=10.0)
    batch = with_row_ids({k: jnp.asarray(v) for k, v in _batch().items()})
    params = _params(model, batch)
    rng = jax.random.key(3)
    normalizer = model.normalizer(batch)
    # Each computation compiled whole (jit): eagerly, every op of it compiles on its own.
    loss_sums = jax.jit(lambda p, b: model.loss_sums(p, b, rng, True)[0])
    sums = loss_sums(params, batch)
    assert not np.allclose(sums, jax.jit(lambda p, b: model.loss_sums(p, b, None, False)[0])(
        params, batch))  # dropout on
    for t, rows in enumerate((slice(0, 3), slice(3, 8))):
        block = {k: v[rows] for k, v in batch.items()}
        np.testing.assert_allclose(loss_sums(params, block)[t], sums[t], rtol=1e-5)
    plain = jax.jit(jax.grad(
        lambda p: model.task_losses(p, batch, rng, True, normalizer=normalizer)[0].sum()))(params)
    for method in ("blocks", "vjp"):
        _, _, tg = jax.jit(lambda p, method=method: compute_task_gradients(
            lambda q, b: model.loss_sums(q, b, rng, True), normalizer, p, batch,
            num_tasks=2, task_counts=COUNTS if method == "blocks" else None, method=method,
            shared="all"))(params)
        # float32 sums in another order: tolerance scaled by the largest gradient entry
        scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(plain))
        jax.tree.map(lambda a, b: np.testing.assert_allclose(
            a.sum(0), b, rtol=1e-4, atol=1e-6 * scale), tg.stacked, plain)


def test_trains_plain_and_balanced():
    model = EncoderMlmModel(TINY, num_tasks=2, infusion_beta=10.0)
    batch = _batch()
    for balancer in (None, optim.metabalance(target_task=0, num_tasks=2)):
        tr = trainer_lib.Trainer(model, optax.adam(1e-2), balancer=balancer)
        state = tr.init_state(jax.random.key(0), batch)
        losses = []
        for _ in range(4):
            state, m = tr.train_step(state, batch, jax.random.key(1), task_counts=COUNTS)
            losses.append(float(m["loss"]))
        assert losses[-1] < losses[0], (balancer, losses)
        # The pooler is kept for a later fine-tuning run and gets no gradient here.
        assert state.params["pooler"]["kernel"].shape == (32, 32)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="infusion_beta"):
        EncoderMlmModel(TINY, infusion_beta=-1.0)
    with pytest.raises(ValueError, match="num_tasks"):
        EncoderMlmModel(TINY, num_tasks=0)
    with pytest.raises(ValueError, match="loss_normalization"):
        EncoderMlmModel(TINY, loss_normalization="mean")
    with pytest.raises(TypeError, match="BertConfig"):
        EncoderMlmModel(object())
    model = EncoderMlmModel(TINY)
    with pytest.raises(ValueError, match="mlm_weights"):
        model.task_weights({"input_ids": np.zeros((1, 4), np.int32), "task_id": np.zeros(1, np.int32),
                            "mlm_targets": np.zeros((1, 4), np.int32)})
    with pytest.raises(ValueError, match="max_position"):
        model.input_spec(2, {"inputs": 17})
