"""`ktx.models.bert` and `ktx.models.encoder.EncoderClassifierModel`: shapes and parameter
counts, a few Trainer steps on a 2-task toy batch (a 3-way classification task and a
regression task), and the same losses on one device and on a 2x4 mesh of fake CPU devices
(tests/conftest.py sets `--xla_force_host_platform_device_count=8`)."""

from __future__ import annotations

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

from ktx.analysis import params as params_lib
from ktx import partitioning
from ktx.training import trainer as trainer_lib
from ktx.models import bert, encoder

TINY = bert.BertConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                       intermediate_size=64, max_position=16)


def _batch():
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 64, (8, 8)).astype(np.int32)
    ids[::2, 6:] = 0
    return {
        "input_ids": ids,
        "token_type_ids": np.zeros_like(ids),
        "attention_mask": (ids > 0).astype(np.int32),
        "label": np.array([0, 0.5, 2, -1.0, 1, 1.5, 0, 0.2], np.float32),
        "task_id": np.array([0, 1] * 4, np.int32),
    }


def _train(mesh, steps=4):
    model = encoder.EncoderClassifierModel(TINY, num_labels=(3, 1))
    tr = trainer_lib.Trainer(model, optax.adam(1e-3), mesh=mesh)
    state = tr.init_state(jax.random.key(0), _batch())
    losses = []
    for _ in range(steps):
        state, metrics = tr.train_step(state, _batch(), jax.random.key(1))
        losses.append(float(metrics["loss"]))
    return state, losses


def test_trains_and_a_2x4_mesh_gives_the_same_losses():
    state1, one = _train(partitioning.create_mesh(1))
    assert one[-1] < one[0], one  # dropout on (0.1): loss still falls on a fixed batch
    state8, eight = _train(partitioning.create_mesh(4))  # 2 (data) x 4 (model)
    np.testing.assert_allclose(eight, one, rtol=1e-5)
    spec = state8.params["layers_0"]["attention"]["query"]["kernel"].sharding.spec
    assert spec == jax.sharding.PartitionSpec(None, "model", None)  # heads sharded
    assert state8.params["layers_0"]["intermediate"]["kernel"].sharding.spec == \
        jax.sharding.PartitionSpec(None, "model")


def test_loss_sums_by_task_hand_computed():
    model = encoder.EncoderClassifierModel(TINY, num_labels=(3, 1))
    batch = _batch()
    params = nn.unbox(model.init_variables(jax.random.key(0), batch)["params"])
    logits = model.logits(params, batch)
    sums, aux = model.loss_sums(params, batch, None, False)
    cls_rows, reg_rows = np.arange(0, 8, 2), np.arange(1, 8, 2)
    logp = jax.nn.log_softmax(logits[0][cls_rows])
    ce = -np.take_along_axis(np.asarray(logp), batch["label"][cls_rows].astype(int)[:, None], 1).sum()
    se = ((np.asarray(logits[1])[reg_rows, 0] - batch["label"][reg_rows]) ** 2).sum()
    np.testing.assert_allclose(sums, [ce, se], rtol=1e-5)
    np.testing.assert_allclose(aux["weight"], [4, 4])
    np.testing.assert_allclose(aux["squared_error"], [0, se], rtol=1e-5)


def test_bert_base_parameter_count():
    """bert-base-uncased's BertModel (embeddings + 12 layers + pooler) = 109,482,240; each
    2-label head adds 768 * 2 + 2."""
    model = encoder.EncoderClassifierModel(bert.BertConfig(), num_labels=2, num_tasks=8)
    report = params_lib.count_parameters(model)
    assert report["total"] == 109_482_240 + 8 * (768 * 2 + 2)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="num_tasks=3 but num_labels=\\(2, 1\\)"):
        encoder.EncoderClassifierModel(TINY, num_labels=(2, 1), num_tasks=3)
    with pytest.raises(ValueError, match="num_labels=\\(2, 0\\)"):
        encoder.EncoderClassifierModel(TINY, num_labels=(2, 0))
    with pytest.raises(ValueError, match="hidden_act='tanh'"):
        bert.BertConfig(hidden_act="tanh")
    with pytest.raises(ValueError, match="hidden_size=30 is not a multiple of num_heads=4"):
        bert.BertConfig(hidden_size=30, num_heads=4)
    with pytest.raises(ValueError, match="max_position=16"):
        encoder.EncoderClassifierModel(TINY).input_spec(2, {"inputs": 32})
