"""ktx's Adafactor: `scale_by_param_rms` by hand, and the chain against optax's own."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ktx.training import optimizers
from ktx.training.factoring import as_matrices


def test_scale_by_param_rms_hand_values():
    tx = optimizers.scale_by_param_rms(min_scale=1e-3)
    params = {"a": jnp.array([3.0, 4.0]), "tiny": jnp.array([1e-5, -1e-5])}
    updates = {"a": jnp.array([1.0, -2.0]), "tiny": jnp.array([2.0, 2.0])}
    state = tx.init(params)
    assert state == optax.EmptyState()
    out, _ = jax.jit(tx.update)(updates, state, params)
    rms = np.sqrt((9.0 + 16.0) / 2)  # 3.5355
    np.testing.assert_allclose(out["a"], [rms, -2 * rms], rtol=1e-6)
    np.testing.assert_allclose(out["tiny"], [2e-3, 2e-3], rtol=1e-6)  # rms below min_scale


def test_adafactor_equals_optax_adafactor_on_matrices():
    rs = np.random.RandomState(0)
    params = {"kernel": jnp.asarray(rs.randn(256, 4, 64), jnp.float32),
              "wide": jnp.asarray(rs.randn(64, 300), jnp.float32),
              "scale": jnp.asarray(rs.rand(64) + 0.5, jnp.float32),
              "zeros": jnp.zeros((130, 140), jnp.float32)}
    for kwargs in ({}, {"momentum": 0.9, "weight_decay_rate": 1e-2, "clipping_threshold": None}):
        ours = optimizers.adafactor(1e-2, **kwargs)
        reference = as_matrices(optax.adafactor(
            1e-2, decay_rate=0.8, eps=1e-30, **{**{"clipping_threshold": 1.0}, **kwargs}))
        s1, s2 = ours.init(params), reference.init(params)
        assert jax.tree.structure(s1) == jax.tree.structure(s2)  # checkpoints unchanged
        p1 = p2 = params
        for step in range(3):
            grads = jax.tree.map(lambda x: jnp.asarray(rs.randn(*x.shape), x.dtype), params)
            u1, s1 = jax.jit(ours.update)(grads, s1, p1)
            u2, s2 = jax.jit(reference.update)(grads, s2, p2)
            jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-9),
                         u1, u2)
            p1, p2 = optax.apply_updates(p1, u1), optax.apply_updates(p2, u2)
