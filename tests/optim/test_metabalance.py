"""MetaBalance: the authors' reference fixture, hand-computed steps, strategies, groups."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ktx.optim import TaskGradients, metabalance

FIXTURE = pathlib.Path(__file__).resolve().parents[3] / "shared" / "fixtures" / "metabalance_reference.json"


def _cases():
    if not FIXTURE.is_file():
        pytest.skip(f"{FIXTURE} not present")
    return json.loads(FIXTURE.read_text())["cases"]


def test_reproduces_reference_fixture():
    for case in _cases():
        tx = metabalance(relax_factor=case["relax_factor"], beta=case["beta"], strategy="both",
                         target_task=case["target_task"], num_tasks=case["num_tasks"])
        first = case["steps"][0]["task_grads"]
        params = {k: jnp.zeros(np.asarray(v).shape[1:], jnp.float32) for k, v in first.items()}
        state = tx.init(params)
        update = jax.jit(tx.update)
        for i, step in enumerate(case["steps"]):
            grads = {k: jnp.asarray(v, jnp.float32) for k, v in step["task_grads"].items()}
            out, state = update(TaskGradients.from_stacked(grads), state)
            for k, want in step["combined"].items():
                want = np.asarray(want, np.float32)
                np.testing.assert_allclose(
                    out[k], want, rtol=1e-5, atol=1e-5 * np.abs(want).max(),
                    err_msg=f"case r={case['relax_factor']} beta={case['beta']} step {i} {k}")


def test_two_steps_by_hand():
    # Task 0 (target) has norm 1, task 1 norm 4 on a 1-d parameter; r=0.5, beta=0.5.
    tx = metabalance(relax_factor=0.5, beta=0.5, num_tasks=2, eps=0.0)
    state = tx.init({"w": jnp.zeros(2)})
    g = {"w": jnp.array([[1.0, 0.0], [0.0, 4.0]])}
    out, state = jax.jit(tx.update)(TaskGradients.from_stacked(g), state)
    # m = (0.5, 2); w1 = 0.5/2*0.5 + 0.5 = 0.625 -> [1, 2.5]
    np.testing.assert_allclose(out["w"], [1.0, 2.5], rtol=1e-6)
    np.testing.assert_allclose(state.moving_norms["w"], [0.5, 2.0])
    g2 = {"w": jnp.array([[3.0, 0.0], [0.0, 2.0]])}
    out, state = jax.jit(tx.update)(TaskGradients.from_stacked(g2), state)
    # m = (0.25+1.5, 1+1) = (1.75, 2); w1 = 1.75/2*0.5 + 0.5 = 0.9375
    np.testing.assert_allclose(out["w"], [3.0, 1.875], rtol=1e-6)
    np.testing.assert_allclose(state.weights["w"], [1.0, 0.9375], rtol=1e-6)
    assert int(state.count) == 2


@pytest.mark.parametrize("strategy,want", [
    ("reduce", [1.0, 0.5 * 0.25 + 0.5, 1.0]),
    ("enlarge", [1.0, 1.0, 0.5 * 2.0 + 0.5]),
    ("both", [1.0, 0.625, 1.5]),
])
def test_strategies(strategy, want):
    # Norms 2 (target), 8 (aux 1, larger), 1 (aux 2, smaller); no moving average.
    tx = metabalance(relax_factor=0.5, strategy=strategy, use_moving_average=False,
                     num_tasks=3, eps=0.0)
    state = tx.init({"w": jnp.zeros(1)})
    g = {"w": jnp.array([[2.0], [8.0], [1.0]])}
    out, state = jax.jit(tx.update)(TaskGradients.from_stacked(g), state)
    np.testing.assert_allclose(state.weights["w"], want, rtol=1e-6)
    np.testing.assert_allclose(out["w"], [np.dot(want, [2.0, 8.0, 1.0])], rtol=1e-6)


def test_groups_share_one_magnitude():
    tx = metabalance(relax_factor=1.0, use_moving_average=False, groups=[r"^dense/"], eps=0.0,
                     num_tasks=2)
    state = tx.init({"dense": {"a": jnp.zeros(1), "b": jnp.zeros(1)}, "c": jnp.zeros(1)})
    g = {"dense": {"a": jnp.array([[3.0], [0.0]]), "b": jnp.array([[4.0], [10.0]])},
         "c": jnp.array([[1.0], [2.0]])}
    out, state = tx.update(TaskGradients.from_stacked(g), state)
    # group norms: target 5, aux 10 -> aux weight 0.5 in both tensors; c alone: 1/2.
    np.testing.assert_allclose(out["dense"]["b"], [4.0 + 5.0])
    np.testing.assert_allclose(out["c"], [1.0 + 1.0])


def test_bad_arguments():
    with pytest.raises(ValueError, match="strategy"):
        metabalance(strategy="shrink")
    with pytest.raises(ValueError, match="relax_factor"):
        metabalance(relax_factor=1.5)
    with pytest.raises(ValueError, match="num_tasks"):
        metabalance().init({"w": jnp.zeros(1)})


def test_absent_task_keeps_its_moving_average():
    """A task with no rows in a batch (all-zero gradient) neither drags its moving
    average towards 0 nor gets a huge logged weight; later steps continue as if the
    step had not happened for it. An absent target leaves the auxiliaries' averages."""
    tx = metabalance(relax_factor=0.7, beta=0.9, num_tasks=3)
    params = {"w": jnp.zeros((2,))}
    state = tx.init(params)
    g = {"w": jnp.array([[3.0, 4.0], [1.0, 0.0], [0.0, 2.0]])}  # norms 5, 1, 2
    _, state = tx.update(TaskGradients.from_stacked(g), state, params)
    m1 = np.asarray(state.moving_norms["w"])
    np.testing.assert_allclose(m1, [0.5, 0.1, 0.2], rtol=1e-6)
    absent = {"w": g["w"].at[1].set(0.0)}
    _, state = tx.update(TaskGradients.from_stacked(absent), state, params)
    m2 = np.asarray(state.moving_norms["w"])
    np.testing.assert_allclose(m2, [0.95, 0.1, 0.38], rtol=1e-6)  # task 1 untouched
    assert np.asarray(state.weights["w"])[1] == 1.0
    # Explicit presence (the trainer's row counts) wins over the zero-norm rule.
    _, state2 = tx.update(TaskGradients.from_stacked(g), state, params, task_present=jnp.array([True, False, True]))
    np.testing.assert_allclose(np.asarray(state2.moving_norms["w"])[1], 0.1, rtol=1e-6)
    # An absent target: auxiliaries' averages move, the target's does not; weights use it.
    no_target = {"w": g["w"].at[0].set(0.0)}
    _, state3 = tx.update(TaskGradients.from_stacked(no_target), state, params)
    m3 = np.asarray(state3.moving_norms["w"])
    np.testing.assert_allclose(m3[0], m2[0], rtol=1e-6)
    w3 = np.asarray(state3.weights["w"])
    np.testing.assert_allclose(w3[2], m3[0] / m3[2] * 0.7 + 0.3, rtol=1e-5)
