"""ktx's Adafactor takes the step T5X took: the fixture's checkpoint_1 is T5X's own train
step from checkpoint_0 (Adafactor, decay 0.8, min_dim_size_to_factor=32, constant learning
rate 1e-3, no dropout); ktx's gradient of T5X's loss, through
`ktx.training.optimizers.adafactor`, reproduces its parameters and second moments."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import serialization

from ktx import convert
from ktx.models import t5
from ktx.training.factoring import matrix_shape
from ktx.training.optimizers import adafactor
from tests.convert.conftest import checkpoint_fixture


def test_matrix_shape():
    assert matrix_shape((64, 4, 16)) == (64, 64)      # query/key/value [E, H, D]
    assert matrix_shape((4, 16, 64)) == (64, 64)      # out [H, D, E]
    assert matrix_shape((4096, 64, 64)) == (4096, 4096)
    assert matrix_shape((64, 64, 4096)) == (4096, 4096)
    assert matrix_shape((512, 64)) == (512, 64) and matrix_shape((7,)) == (7,)


def _t5x_gradient(folder):
    imported = convert.read_t5x(folder / "checkpoint_0")
    inputs = {k: np.asarray(v) for k, v in json.loads((folder / "inputs.json").read_text()).items()}
    enc, dec, tgt = (jnp.asarray(inputs[k], jnp.int32)
                     for k in ("encoder_input_tokens", "decoder_input_tokens", "decoder_target_tokens"))
    weights = jnp.asarray(inputs["decoder_loss_weights"], jnp.float32)
    model = t5.Transformer(imported.config)

    def loss_fn(params):  # T5X's loss: summed cross-entropy + z_loss 1e-4
        logits = model.apply({"params": params}, enc, dec, tgt, enable_dropout=False)
        log_z = jax.nn.logsumexp(logits, -1)
        log_p = jnp.take_along_axis(jax.nn.log_softmax(logits), tgt[..., None], -1)[..., 0]
        return jnp.sum((-log_p + 1e-4 * log_z**2) * weights)

    return imported.params, jax.grad(loss_fn)(imported.params)


def _step(tx, params, grads):
    updates, state = tx.update(grads, tx.init(params), params)
    return optax.apply_updates(params, updates), state


def test_one_adafactor_step_equals_t5x():
    folder = checkpoint_fixture("t5x_t5_1_1_tiny")
    params, grads = _t5x_gradient(folder)
    new, state = _step(adafactor(1e-3, min_dim_size_to_factor=32), params, grads)
    t5x_params = convert.flatten(convert.read_t5x(folder / "checkpoint_1").params)
    before = convert.flatten(params)
    moved = max(float(np.max(np.abs(t5x_params[k] - before[k]))) for k in before)
    err = max(float(np.max(np.abs(np.asarray(v) - t5x_params[k])))
              for k, v in convert.flatten(new).items())
    assert moved > 1e-3 and err < 1e-5, (moved, err)  # measured: moved 1.8e-3, err 1.2e-6

    # The factored second moments are T5X's (v_row / v_col of the flattened kernels).
    ckpt = serialization.msgpack_restore((folder / "checkpoint_1" / "checkpoint").read_bytes())
    t5x_states = convert.flatten(ckpt["optimizer"]["state"]["param_states"])
    factored = next(s for s in jax.tree.leaves(state, is_leaf=lambda x: hasattr(x, "v_row"))
                    if hasattr(s, "v_row"))
    compared, worst = 0, 0.0
    for name, v_row in convert.flatten(factored.v_row).items():
        theirs = t5x_states.get(f"{name}/v_row")
        if theirs is None or np.asarray(theirs).shape == (1,):
            continue
        for ours, ref in ((v_row, theirs), (convert.flatten(factored.v_col)[name],
                                            t5x_states[f"{name}/v_col"])):
            assert np.shape(ours) == np.shape(ref), name
            # float32 gradients of two implementations: relative to the array's scale
            worst = max(worst, float(np.max(np.abs(np.asarray(ours) - ref)) / np.max(np.abs(ref))))
        compared += 1
    print(f"worst v_row/v_col difference (relative to the array max): {worst:.2e}")
    assert worst < 1e-3, worst
    assert compared == 38  # every matrix, attention kernels included


def test_split_heads_without_the_matrix_view_would_not_be_t5x():
    """The reason for `as_matrices`: optax's Adafactor on the split-head layout keeps a
    full second moment for attention kernels and takes another step."""
    folder = checkpoint_fixture("t5x_t5_1_1_tiny")
    params, grads = _t5x_gradient(folder)
    plain = optax.adafactor(1e-3, min_dim_size_to_factor=32, decay_rate=0.8, eps=1e-30,
                            clipping_threshold=1.0, multiply_by_parameter_scale=True)
    new, _ = _step(plain, params, grads)
    t5x_params = convert.flatten(convert.read_t5x(folder / "checkpoint_1").params)
    name = "encoder/layers_0/attention/query/kernel"
    assert float(np.max(np.abs(np.asarray(convert.flatten(new)[name]) - t5x_params[name]))) > 1e-4


@pytest.mark.parametrize("rank3", [(8, 2, 4), (2, 4, 8)])
def test_as_matrices_keeps_shapes_and_passes_extra_args(rank3):
    tx = adafactor(1e-2, min_dim_size_to_factor=2)
    params = {"k": jnp.ones(rank3), "b": jnp.ones((3,))}
    updates, _ = tx.update(jax.tree.map(jnp.ones_like, params), tx.init(params), params, task_present=None)
    assert jax.tree.map(jnp.shape, updates) == jax.tree.map(jnp.shape, params)
