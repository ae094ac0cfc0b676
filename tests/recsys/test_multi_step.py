"""The study trains with the trainer's step: `Trainer.train_steps` (K scanned steps)
equals K `Trainer.train_step` calls, sparse table gradients equal dense ones, and
`run_config` does not depend on how many steps one call runs."""

import jax
import numpy as np
import pytest

from ktx import optim
from ktx.studies import recsys as recsys_study
from ktx.data import recsys as R


def _setup(balancer, sparse=True):
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
    tr = recsys_study.study_trainer(model, recsys_study.adam_l2(1e-2), balancer,
                                    sparse_tables=recsys_study.SPARSE_TABLES if sparse else None)
    state = tr.init_state(jax.random.key(0), inp.get_batch(0))
    return model, inp, tr, state


def _close(a, b, rtol=1e-5, atol=1e-7):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


@pytest.mark.parametrize("balancer", ["metabalance", "pcgrad"])
def test_sparse_tables_match_dense(balancer):
    def make():
        return {"metabalance": optim.metabalance(relax_factor=0.5, num_tasks=3),
                "pcgrad": optim.pcgrad(shuffle=False)}[balancer]

    _, inp, dense, s_d = _setup(make(), sparse=False)
    _, _, sparse, s_s = _setup(make(), sparse=True)
    start = jax.device_get(s_s.params)
    rng = jax.random.key(1)
    for step in range(3):
        s_d, _ = dense.train_step(s_d, inp.get_batch(step), rng, inp.task_counts(step))
        s_s, _ = sparse.train_step(s_s, inp.get_batch(step), rng, inp.task_counts(step))
    _close(s_s.params, s_d.params, rtol=1e-4, atol=1e-6)
    # The update moved the embedding tables (the check is not vacuous).
    moved = np.abs(np.asarray(s_s.params["user_embedding"]["embedding"])
                   - np.asarray(start["user_embedding"]["embedding"])).max()
    assert moved > 1e-4


@pytest.mark.parametrize("balancer", [None, "metabalance"])
def test_train_steps_equal_single_steps(balancer):
    def make():
        return None if balancer is None else optim.metabalance(relax_factor=0.7, num_tasks=3)

    _, inp, single, s1 = _setup(make())
    _, _, many, s4 = _setup(make())
    rng = jax.random.key(5)
    losses = []
    for step in range(4):
        s1, m = single.train_step(s1, inp.get_batch(step), rng, inp.task_counts(step))
        losses.append(float(m["loss"]))
    batches = [inp.get_batch(s) for s in range(4)]
    stacked = {k: np.stack([b[k] for b in batches]) for k in batches[0]}
    s4, m4 = many.train_steps(s4, stacked, rng, inp.task_counts(0))
    assert m4["loss"].shape == (4,) and m4["task_losses"].shape == (4, 3)
    np.testing.assert_allclose(np.asarray(m4["loss"]), losses, rtol=1e-5)
    _close(s4.params, s1.params, rtol=1e-5, atol=1e-7)
    _close(s4.opt_state, s1.opt_state, rtol=1e-5, atol=1e-7)
    assert int(s4.step) == 4


def test_train_steps_check_the_task_layout_of_every_step():
    _, inp, tr, state = _setup(optim.metabalance(relax_factor=0.7, num_tasks=3))
    batches = [inp.get_batch(s) for s in range(2)]
    batches[1] = {k: v[::-1].copy() for k, v in batches[1].items()}  # rows no longer grouped
    stacked = {k: np.stack([b[k] for b in batches]) for k in batches[0]}
    with pytest.raises(ValueError, match="task"):
        tr.train_steps(state, stacked, jax.random.key(0), inp.task_counts(0))


def test_run_config_independent_of_steps_per_call():
    model, inp, _, _ = _setup(None)
    data = inp.data
    kw = dict(balancer=optim.vanilla_multi(), seed=2, max_epochs=2, patience=2,
              batch_size=24, learning_rate=1e-2, verbose=False,
              model_kwargs={"embed_dim": 8, "mlp_dims": (8, 4, 2), "tower_dims": (8, 4)})
    a = recsys_study.run_config(data, steps_per_call=1, **kw)
    b = recsys_study.run_config(data, steps_per_call=5, **kw)
    np.testing.assert_allclose(a["history"], b["history"], rtol=1e-5)
    assert a["test"] == pytest.approx(b["test"], rel=1e-5)


def test_run_config_rejects_bad_steps_per_call():
    model, inp, _, _ = _setup(None)
    with pytest.raises(ValueError, match="steps_per_call=0"):
        recsys_study.run_config(inp.data, steps_per_call=0, verbose=False)
