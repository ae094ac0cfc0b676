"""Diagnostics names/values, and the gradient-magnitude plot from metrics.jsonl."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax

import ktx.optim as ko


def test_diagnostics_values_and_metabalance_weights():
    params = {"a": jnp.zeros(2), "tower": {"k": jnp.zeros(1)}}
    stacked = {"a": jnp.array([[3.0, 4.0], [-3.0, -4.0]]), "tower": {"k": jnp.ones((2, 1))}}
    tg = ko.split_shared(stacked, params, None)  # default: the tower is unshared
    tx = optax.chain(ko.metabalance(relax_factor=0.5, use_moving_average=False, eps=0.0,
                                    num_tasks=2), optax.sgd(0.1))
    state = tx.init(params)
    _, state = tx.update(tg, state, params)
    d = jax.jit(ko.diagnostics)(tg, state)
    assert set(d) == {"grad_norm/a/task0", "grad_norm/a/task1", "cosine_to_target/a/task0",
                      "cosine_to_target/a/task1", "metabalance_weight/a/task0",
                      "metabalance_weight/a/task1"}
    np.testing.assert_allclose(d["grad_norm/a/task1"], 5.0)
    np.testing.assert_allclose(d["cosine_to_target/a/task1"], -1.0)
    np.testing.assert_allclose(d["metabalance_weight/a/task1"], 1.0)  # equal norms
    assert all(v.shape == () and v.dtype == jnp.float32 for v in d.values())


def test_plot_gradient_magnitudes(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with path.open("w") as f:
        for step in range(5):
            f.write(json.dumps({"step": step, "split": "train",
                                "grad_norm/embed/task0": 1.0 / (step + 1),
                                "grad_norm/embed/task1": 2.0})
                    + "\n")
    series = ko.read_gradient_magnitudes(path)
    assert series["embed"][1] == [(s, 2.0) for s in range(5)]
    out = ko.plot_gradient_magnitudes(path, tmp_path / "plots" / "grads.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
