"""The real T5 tiny on a 2x4 (data, model) mesh of 8 fake CPU devices gives the same
losses as on one device for 3 steps (tolerance 1e-4), with parameters actually sharded
over the `model` axis."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from ktx import partitioning
from ktx.training import optimizers
from ktx.training.trainer import Trainer

seq2seq = pytest.importorskip("ktx.models.seq2seq")
t5 = pytest.importorskip("ktx.models.t5")

VOCAB = 64
LE, LD, B = 12, 6, 8


def tiny_model(num_tasks=2):
    config = t5.T5Config(
        vocab_size=VOCAB, emb_dim=16, num_heads=4, num_encoder_layers=2, num_decoder_layers=2,
        head_dim=8, mlp_dim=32, dropout_rate=0.1,
    )
    return seq2seq.EncoderDecoderModel(config, num_tasks=num_tasks)


def synthetic_batch(step, batch_size=B):
    """Copy task with random lengths; rows 0..4 task 0, 5..7 task 1."""
    rng = np.random.default_rng(step)
    enc = rng.integers(3, VOCAB, size=(batch_size, LE)).astype(np.int32)
    lengths = rng.integers(2, LD, size=batch_size)
    tgt = np.zeros((batch_size, LD), np.int32)
    for i, n in enumerate(lengths):
        tgt[i, :n] = enc[i, :n]
        tgt[i, n] = 1  # EOS
        enc[i, LE - 2:] = 0
    dec_in = np.concatenate([np.zeros((batch_size, 1), np.int32), tgt[:, :-1]], axis=1)
    weights = (tgt > 0).astype(np.float32)
    task = np.array([0] * 5 + [1] * (batch_size - 5), np.int32)
    return {
        "encoder_input_tokens": enc,
        "decoder_input_tokens": dec_in,
        "decoder_target_tokens": tgt,
        "decoder_loss_weights": weights,
        "task_id": task,
    }


def train_losses(mesh, steps=3, *, model=None, rules=None):
    """`([steps, T] task losses, final state)` of `steps` Adafactor steps of `model`
    (default `tiny_model()`) on `mesh` with `rules` (default: the standard rules)."""
    model = tiny_model() if model is None else model
    tr = Trainer(model, optimizers.adafactor(learning_rate=0.05), mesh=mesh, rules=rules)
    state = tr.init_state(jax.random.key(0), synthetic_batch(0))
    out = []
    for step in range(steps):
        state, m = tr.train_step(state, synthetic_batch(step), jax.random.key(1))
        out.append(np.asarray(jax.device_get(m["task_losses"])))
    return np.stack(out), state


def test_2x4_mesh_matches_single_device():
    assert jax.device_count() == 8, "conftest sets 8 fake CPU devices"
    single, _ = train_losses(partitioning.create_mesh(1, devices=jax.devices()[:1]))
    mesh = partitioning.create_mesh(4)
    assert dict(mesh.shape) == {"data": 2, "model": 4}
    sharded, state = train_losses(mesh)
    np.testing.assert_allclose(sharded, single, atol=1e-4, rtol=1e-4)
    assert not np.allclose(single[0], single[-1]), "the model must actually train"
    # At least one parameter is split over the model axis.
    specs = [leaf.sharding.spec for leaf in jax.tree.leaves(state.params)]
    assert any("model" in tuple(spec) for spec in specs)


def test_create_mesh_rejects_bad_partitions():
    with pytest.raises(ValueError, match="NUM_PARTITIONS=3"):
        partitioning.create_mesh(3)
