"""The loss-weighted shortcut of the balanced step: a balancer whose weights depend on
the losses only (`ktx.optim.LossWeighting`) gets its update from one backward pass of the
weighted loss (`ktx.optim.loss_weighted_gradient`) instead of per-task gradients; the
result must be the per-task path's, step for step, under dropout, with an absent task and
with unshared (tower) parameters summed rather than weighted."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ktx import optim
from ktx.optim.task_gradients import combine_with_weights
from ktx.training import trainer as trainer_lib
from tests.optim.test_dropout_paths import COUNTS, MODELS, model_batch_params

BALANCERS = {
    "single_loss": lambda: optim.single_loss(target_task=1),
    "vanilla_multi": optim.vanilla_multi,
    "fixed_weights": lambda: optim.fixed_weights([0.5, 1.0, 2.0, 0.25]),
    "uncertainty": lambda: optim.uncertainty(learning_rate=0.1, num_tasks=len(COUNTS)),
    "dwa": lambda: optim.dwa(temperature=1.5, num_tasks=len(COUNTS)),
}


def _steps(model, batch, balancer, shortcut, steps=3, diagnostics_period=0, initial=None):
    """`(trainer, task losses per step, final state, diagnostics per step)`; `initial`: a
    host copy of the initial state to start from (the shortcut and the per-task trainer of
    one balancer initialise the same state: one initialisation serves both)."""
    tr = trainer_lib.Trainer(model, optax.adam(1e-2), balancer=balancer,
                             weights_from_losses=shortcut, diagnostics_period=diagnostics_period)
    if initial is None:
        state = tr.init_state(jax.random.key(0), batch)
    else:
        state = jax.device_put(initial, tr.create_abstract_state(batch)[1])
    losses, diagnostics = [], []
    for _ in range(steps):
        state, m = tr.train_step(state, batch, jax.random.key(3), task_counts=COUNTS)
        losses.append(np.asarray(m["task_losses"]))
        diagnostics.append(jax.device_get((m["diagnostics"], m["diagnostics_logged"])))
    return tr, np.stack(losses), jax.device_get(state), diagnostics


# Every balancer on the recommendation model; on T5 (a compile of ~6 s per step) one of
# the three constant-weight balancers, which are one transformation (`weighted_sum`) with
# other constants: fixed_weights, whose unequal weights check what vanilla_multi's ones and
# single_loss's one-hot ones would.
_CASES = [("recsys", name) for name in sorted(BALANCERS)] + [
    ("t5", name) for name in ("dwa", "fixed_weights", "uncertainty")]


@pytest.mark.parametrize("model_name,name", _CASES)
def test_shortcut_equals_the_per_task_path(model_name, name):
    make_model, make_batch = MODELS[model_name]
    model, batch = make_model(), make_batch()
    initial = jax.device_get(
        trainer_lib.Trainer(model, optax.adam(1e-2), balancer=BALANCERS[name]())
        .init_state(jax.random.key(0), batch))
    tr, fast, s_fast, _ = _steps(model, batch, BALANCERS[name](), True, initial=initial)
    assert trainer_lib._weights_from_losses(tr.optimizer, tr.options)
    _, slow, s_slow, _ = _steps(model, batch, BALANCERS[name](), False, initial=initial)
    np.testing.assert_allclose(fast, slow, rtol=1e-5, atol=1e-7)
    # Adam's step is g / sqrt(v): a ~0 gradient element turns summation-order rounding
    # into a step of up to lr (1e-2); 5e-5 is 0.2% of what 3 steps can move a parameter.
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=5e-5),
                 s_fast.params, s_slow.params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 s_fast.opt_state[0], s_slow.opt_state[0])


def test_shortcut_with_diagnostics_takes_the_per_task_path_on_their_steps():
    """Diagnostics every 2nd step: those steps build per-task gradients (the same
    diagnostics as the per-task path's), the others none; the updates stay the same."""
    model, batch = MODELS["recsys"][0](), MODELS["recsys"][1]()
    _, fast, s_fast, d_fast = _steps(model, batch, BALANCERS["uncertainty"](), True, 4, 2)
    _, slow, s_slow, d_slow = _steps(model, batch, BALANCERS["uncertainty"](), False, 4, 2)
    np.testing.assert_allclose(fast, slow, rtol=1e-5, atol=1e-7)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=5e-5),
                 s_fast.params, s_slow.params)
    assert [bool(logged) for _, logged in d_fast] == [False, True, False, True]
    for (a, logged), (b, _) in zip(d_fast, d_slow):
        jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-7), a, b)
        assert any(np.any(v != 0) for v in jax.tree.leaves(a)) == bool(logged)


_WEIGHTS = (0.5, 2.0, 3.0, 0.25)


@functools.cache
def _combined_task_gradients(model_name):
    """`(task losses, Σ_t w_t ∇L_t)` of `model_batch_params(model_name)` under dropout
    (rng `key(7)`), from per-task gradients: jitted once for the dense and the sparse test."""
    model, batch, params = model_batch_params(model_name)
    rng, normalizer = jax.random.key(7), model.normalizer(batch)

    @jax.jit
    def ref(p):
        ref_losses, _, tg = optim.compute_task_gradients(
            lambda q, b: model.loss_sums(q, b, rng, True), normalizer, p, batch, num_tasks=4,
            task_counts=COUNTS)
        return ref_losses, combine_with_weights(tg, jnp.asarray(_WEIGHTS))

    return ref(params)


@pytest.fixture(scope="module", autouse=True)
def _file_caches():
    yield
    _combined_task_gradients.cache_clear()


@pytest.mark.parametrize("model_name,sparse", [("t5", False), ("t5", True), ("recsys", False),
                                               ("recsys", True)])
def test_loss_weighted_gradient_equals_the_combined_task_gradients(model_name, sparse):
    """Shared parameters weighted, unshared ones (the recommendation towers) summed; the
    tables dense or through their looked-up rows."""
    model, batch, params = model_batch_params(model_name)
    rng, normalizer = jax.random.key(7), model.normalizer(batch)
    w = jnp.asarray(_WEIGHTS)
    mask = optim.shared_mask(params)
    if model_name == "recsys":
        assert not all(jax.tree.leaves(mask))  # the towers are unshared

    def loss_sums(p, b):
        return model.loss_sums(p, b, rng, True)

    @jax.jit
    def shortcut(p):
        losses, _, grad, out = optim.loss_weighted_gradient(
            loss_sums, normalizer, p, batch, lambda losses: (w, losses), num_tasks=4,
            sparse_tables=model.sparse_table_patterns if sparse else None)
        return losses, out, grad

    losses, seen, grad = shortcut(params)
    ref_losses, ref = _combined_task_gradients(model_name)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    np.testing.assert_array_equal(seen, losses)  # weights_fn sees the step's losses
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), grad, ref)
    with pytest.raises(ValueError, match=r"weights of shape \(3,\); expected \(4,\)"):
        optim.loss_weighted_gradient(loss_sums, normalizer, params, batch,
                                     lambda losses: (jnp.ones(3), None), num_tasks=4)


def test_which_balancers_take_the_shortcut():
    """The five loss weightings do; a wrapped one, gradient-based ones and microbatched
    steps do not; with diagnostics off a shortcut step compiles once for any counts."""
    for make in BALANCERS.values():
        assert isinstance(make(), optim.LossWeighting)
    for tx in (optim.metabalance(num_tasks=4), optim.gradnorm(num_tasks=4), optim.pcgrad(),
               optax.chain(optim.vanilla_multi())):
        assert not isinstance(tx, optim.LossWeighting)
    model, batch = MODELS["recsys"][0](), MODELS["recsys"][1]()
    micro = trainer_lib.Trainer(model, optax.sgd(0.1), balancer=optim.vanilla_multi(),
                                num_microbatches=2)
    assert not trainer_lib._weights_from_losses(micro.optimizer, micro.options)
    tr = trainer_lib.Trainer(model, optax.sgd(0.1), balancer=optim.vanilla_multi(),
                             diagnostics_period=0)
    state = tr.init_state(jax.random.key(0), batch)
    for counts in (COUNTS, (4, 4, 4, 4), (16, 0, 0, 0)):
        b = dict(batch, task_id=np.repeat(np.arange(4), counts).astype(np.int32))
        state, _ = tr.train_step(state, b, jax.random.key(1), task_counts=counts)
    assert len(tr._compiled) == 1
    with pytest.raises(TypeError, match="weights_from_losses='yes'"):
        trainer_lib.StepOptions(weights_from_losses="yes")


def test_weights_match_update_and_reject_bad_losses():
    tx = optim.dwa(num_tasks=3)
    state = tx.init(None)
    losses = jnp.asarray([1.0, 2.0, 0.5])
    tg = optim.TaskGradients.from_stacked({"w": jnp.ones((3, 2))})
    for _ in range(3):
        w, new = tx.weights(state, losses)
        update, state = tx.update(tg, state, None, task_losses=losses)
        np.testing.assert_allclose(update["w"], jnp.full((2,), w.sum()), rtol=1e-6)
        jax.tree.map(np.testing.assert_array_equal, new, state)
        losses = losses * jnp.asarray([0.5, 0.9, 1.0])
    with pytest.raises(ValueError, match=r"dwa.weights: task_losses has shape \(\); expected"):
        tx.weights(state, jnp.float32(1.0))
    with pytest.raises(ValueError, match=r"the state was initialised for 3 tasks"):
        tx.weights(state, jnp.ones(4))
