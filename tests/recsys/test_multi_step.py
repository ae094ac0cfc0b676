"""`recsys_study.train_step` / `multi_step`: same updates as `ktx.trainer.train_step`,
K scanned steps equal K single steps, sparse table gradients equal dense ones."""

import functools

import jax
import numpy as np
import pytest

from ktx import optim, partitioning, recsys_study
from ktx import trainer as trainer_lib
from ktx.data import recsys as R


def _setup(balancer):
    rng = np.random.default_rng(0)
    users = rng.integers(0, 16, 200)
    items = rng.integers(0, 20, 200)
    pairs = np.unique(np.stack([users, items], 1), axis=0)
    data = R.prepare_multibehavior(
        R.Interactions({"buy": pairs, "collect": pairs[::2], "cart": pairs[1::3]}),
        target="buy", auxiliaries=("collect", "cart"), seed=0)
    model = recsys_study.build_model(data, embed_dim=8, mlp_dims=(8, 4, 2), tower_dims=(8, 4),
                                     dropout_rate=0.5)
    inp = R.RecsysTrainInput(data, batch_size=24, seed=3)
    mesh = partitioning.create_mesh(1, devices=jax.local_devices()[:1])
    tr = trainer_lib.Trainer(model, recsys_study.adam_l2(1e-2), mesh=mesh, balancer=balancer,
                             shared=model.shared_param_patterns if balancer is not None else None)
    with optim.num_tasks_scope(model.num_tasks):
        state = tr.init_state(jax.random.key(0), inp.get_batch(0))
    return model, inp, tr, state


def _kwargs(model, inp, tr, sparse):
    return dict(model=model, optimizer=tr.tx_parts[1] if tr.tx_parts else tr.tx,
                balancer=tr.balancer,
                task_counts=inp.task_counts(0) if tr.balancer is not None else None,
                shared=tr.shared, sparse_tables=recsys_study.SPARSE_TABLES if sparse else None)


def _close(a, b, rtol=1e-5, atol=1e-7):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


@pytest.mark.parametrize("balancer", [None, "metabalance"])
def test_train_step_matches_trainer_step(balancer):
    bal = {None: None, "vanilla": optim.vanilla_multi(),
           "metabalance": optim.metabalance(relax_factor=0.5)}[balancer]
    model, inp, tr, state = _setup(bal)
    rng = jax.random.key(7)
    ref = jax.jit(functools.partial(
        trainer_lib.train_step, model=model, tx=tr.tx, balanced=bal is not None,
        task_counts=inp.task_counts(0) if bal is not None else None, shared=tr.shared,
        tx_parts=tr.tx_parts))
    ours = jax.jit(functools.partial(recsys_study.train_step, **_kwargs(model, inp, tr, False)))
    s_ref, s_ours = state, state
    for step in range(3):
        batch = inp.get_batch(step)
        s_ref, m_ref = ref(s_ref, batch, rng)
        s_ours, m_ours = ours(s_ours, batch, rng)
        np.testing.assert_allclose(m_ours["task_losses"], m_ref["task_losses"], rtol=1e-6)
    _close(s_ours.params, s_ref.params)
    assert int(s_ours.step) == 3


@pytest.mark.parametrize("balancer", ["metabalance", "pcgrad"])
def test_sparse_tables_match_dense(balancer):
    bal = {"vanilla": optim.vanilla_multi(), "metabalance": optim.metabalance(relax_factor=0.5),
           "pcgrad": optim.pcgrad(shuffle=False)}[balancer]
    model, inp, tr, state = _setup(bal)
    rng = jax.random.key(1)
    dense = jax.jit(functools.partial(recsys_study.train_step, **_kwargs(model, inp, tr, False)))
    sparse = jax.jit(functools.partial(recsys_study.train_step, **_kwargs(model, inp, tr, True)))
    s_d, s_s = state, state
    for step in range(3):
        s_d, _ = dense(s_d, inp.get_batch(step), rng)
        s_s, _ = sparse(s_s, inp.get_batch(step), rng)
    _close(s_s.params, s_d.params, rtol=1e-4, atol=1e-6)
    # The update moved the embedding tables (the check is not vacuous).
    moved = np.abs(np.asarray(s_s.params["user_embedding"]["embedding"])
                   - np.asarray(state.params["user_embedding"]["embedding"])).max()
    assert moved > 1e-4


@pytest.mark.parametrize("balancer", ["metabalance"])
def test_multi_step_equals_single_steps(balancer):
    bal = None if balancer is None else optim.metabalance(relax_factor=0.7)
    model, inp, tr, state = _setup(bal)
    rng = jax.random.key(5)
    kw = _kwargs(model, inp, tr, True)
    single = jax.jit(functools.partial(recsys_study.train_step, **kw))
    many = jax.jit(functools.partial(recsys_study.multi_step, **kw))
    s1 = state
    losses = []
    for step in range(4):
        s1, m = single(s1, inp.get_batch(step), rng)
        losses.append(float(m["loss"]))
    batches = [inp.get_batch(s) for s in range(4)]
    stacked = {k: np.stack([b[k] for b in batches]) for k in batches[0]}
    s4, m4 = many(state, stacked, rng)
    assert m4["loss"].shape == (4,) and m4["task_losses"].shape == (4, 3)
    np.testing.assert_allclose(np.asarray(m4["loss"]), losses, rtol=1e-5)
    _close(s4.params, s1.params, rtol=1e-5, atol=1e-7)
    _close(s4.opt_state, s1.opt_state, rtol=1e-5, atol=1e-7)
    assert int(s4.step) == 4


def test_run_config_independent_of_steps_per_call():
    model, inp, _, _ = _setup(None)
    data = inp.data
    kw = dict(balancer=optim.vanilla_multi(), seed=2, max_epochs=2, patience=2,
              batch_size=24, learning_rate=1e-2, log=None,
              model_kwargs={"embed_dim": 8, "mlp_dims": (8, 4, 2), "tower_dims": (8, 4)})
    a = recsys_study.run_config(data, steps_per_call=1, **kw)
    b = recsys_study.run_config(data, steps_per_call=5, **kw)
    np.testing.assert_allclose(a["history"], b["history"], rtol=1e-5)
    assert a["test"] == pytest.approx(b["test"], rel=1e-5)


def test_run_config_rejects_bad_steps_per_call():
    model, inp, _, _ = _setup(None)
    with pytest.raises(ValueError, match="steps_per_call=0"):
        recsys_study.run_config(inp.data, steps_per_call=0, log=None)
