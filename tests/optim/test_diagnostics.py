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


def test_norms_and_cosines_equal_the_gram_of_each_group():
    """Norms and cosines to a target that is not task 0, per tensor and per group, for
    dense leaves and a sparse table (rows with a repeated index), against [T, T] Grams
    of the dense gradients."""
    r = np.random.default_rng(0)
    t, target = 3, 2
    dense = {"a": r.normal(size=(t, 4, 5)), "b": r.normal(size=(t, 6))}
    idx = np.array([[0, 3, 3, 5], [1, 1, 2, 7], [3, 0, 6, 6]], np.int32)
    rows = r.normal(size=(t, 4, 2))
    table = np.zeros((t, 8, 2))
    for k in range(t):
        np.add.at(table[k], idx[k], rows[k])
    stacked = {**{k: jnp.asarray(v, jnp.float32) for k, v in dense.items()},
               "emb": ko.SparseRows(jnp.asarray(idx), jnp.asarray(rows, jnp.float32), num_rows=8)}
    tg = ko.TaskGradients.from_stacked(stacked)
    flat = {**dense, "emb": table}

    def check(d, group, members):
        g = sum(np.reshape(flat[m], (t, -1)) @ np.reshape(flat[m], (t, -1)).T for m in members)
        norms = np.sqrt(np.diag(g))
        for k in range(t):
            np.testing.assert_allclose(d[f"grad_norm/{group}/task{k}"], norms[k], rtol=1e-5)
            np.testing.assert_allclose(d[f"cosine_to_target/{group}/task{k}"],
                                       g[k, target] / (norms[k] * norms[target]), rtol=1e-5,
                                       atol=1e-6)

    d = jax.jit(lambda x: ko.diagnostics(x, target_task=target))(tg)
    for name in flat:
        check(d, name, [name])
    grouped = ko.diagnostics(tg, target_task=target, groups=[r"^(a|emb)$", r"^b$"])
    check(grouped, r"^(a|emb)$", ["a", "emb"])
    check(grouped, r"^b$", ["b"])


def test_packed_diagnostics_are_one_array_under_the_same_names():
    params = {"a": jnp.zeros(2), "b": jnp.zeros(3)}
    stacked = {"a": jnp.array([[3.0, 4.0], [1.0, 0.0]]), "b": jnp.ones((2, 3))}
    tg = ko.split_shared(stacked, params, None)
    flat = ko.diagnostics(tg)
    packed = jax.jit(lambda x: ko.diagnostics(x, packed=True))(tg)
    assert isinstance(packed, ko.PackedScalars) and jax.tree.leaves(packed)[0].shape == (len(flat),)
    assert list(packed) == list(flat) and dict(packed.items()).keys() == flat.keys()
    for name, value in flat.items():
        np.testing.assert_allclose(packed[name], value)
    # As a block of K steps returns it, and as the host fetches and splits it.
    block = jax.tree.map(lambda x: jnp.stack([x, 2 * x]), packed)
    host = jax.device_get(block)
    assert isinstance(host, ko.PackedScalars) and isinstance(host.array, np.ndarray)
    second = jax.tree.map(lambda x: x[1], host)
    for name, value in flat.items():
        np.testing.assert_allclose(host[name], [value, 2 * value])
        np.testing.assert_allclose(float(second[name]), 2 * value)
    assert len(ko.PackedScalars.pack({})) == 0


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
