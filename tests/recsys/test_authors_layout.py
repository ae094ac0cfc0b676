"""The MetaBalance authors' layout (gin/experiments/recsys/authors_layout.gin): the NeuMF
model's shapes and full ranking, the shared rows every task's loss sees, and one
MetaBalance step checked by hand (balanced embeddings and MLP, summed towers)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ktx import optim
from ktx.data import recsys as R
from ktx.models.recsys import RecsysModel
from ktx.studies import recsys as recsys_study
from tests.recsys.test_data import _tiny_data


def _neumf(**kw):
    # The authors' proportions at a tiny size: MLP tables 4 x the GMF width, MLP halving.
    fields = dict(num_users=20, num_items=30, num_tasks=3, embed_dim=8, gmf_dim=2,
                  mlp_dims=(8, 4, 2), tower_dims=(), dropout_placement="before",
                  bottom_init="xavier_uniform")
    return RecsysModel(**{**fields, **kw})


def test_neumf_shapes_and_full_ranking():
    model = _neumf()
    batch = {"user": np.zeros(4, np.int32), "item": np.zeros(4, np.int32)}
    shapes = nn.unbox(jax.eval_shape(model.init_variables, jax.random.key(0), batch)["params"])
    assert shapes["user_embedding"]["embedding"].shape == (20, 8)  # MLP tables
    assert shapes["item_embedding"]["embedding"].shape == (30, 8)
    assert shapes["user_gmf"]["embedding"].shape == (20, 2)  # GMF tables
    assert shapes["item_gmf"]["embedding"].shape == (30, 2)
    assert shapes["bottom"]["layer_0"]["kernel"].shape == (16, 8)
    assert shapes["bottom"]["layer_2"]["kernel"].shape == (4, 2)
    # One linear predict layer per task on [mlp_out (2); gmf product (2)].
    assert set(shapes["towers"]) == {"out_kernel", "out_bias"}
    assert shapes["towers"]["out_kernel"].shape == (3, 4)
    with pytest.raises(ValueError, match="gmf_dim=0"):
        _neumf(gmf_dim=0)
    with pytest.raises(ValueError, match="dropout_placement='inside'"):
        RecsysModel(num_users=2, num_items=2, num_tasks=1, dropout_placement="inside")
    # Full ranking's factorised scores equal the network, with and without tower layers.
    uu, ii = np.meshgrid(np.arange(20), np.arange(30), indexing="ij")
    for m in (_neumf(target_task=1), _neumf(target_task=2, tower_dims=(3,))):
        params = nn.unbox(m.init_variables(jax.random.key(1), batch)["params"])
        params = jax.tree.map(lambda x: x + jax.random.normal(jax.random.key(2), x.shape), params)
        scores = m.rank_scores(params, m.rank_user_part(params, jnp.arange(20)),
                               m.rank_item_part(params))
        full = m.module.apply({"params": params}, uu.ravel(), ii.ravel(), False)
        np.testing.assert_allclose(scores, full[:, m.target_task].reshape(20, 30),
                                   rtol=1e-5, atol=1e-5)


def _shared_input(data):
    return R.RecsysTrainInput(data, batch_size=3 * 8, num_negatives=4, seed=1, rows="shared")


def test_every_task_loss_sees_the_same_rows():
    data = _tiny_data()
    inp = _shared_input(data)
    b = inp.get_batch(0)
    blocks = [slice(8 * t, 8 * (t + 1)) for t in range(3)]
    np.testing.assert_array_equal(b["task_id"], np.repeat([0, 1, 2], 8))
    for s in blocks[1:]:  # the same 8 (user, item) pairs in every task's block
        np.testing.assert_array_equal(b["user"][s], b["user"][blocks[0]])
        np.testing.assert_array_equal(b["item"][s], b["item"][blocks[0]])
    pairs = {tuple(p) for p in np.stack([b["user"][:8], b["item"][:8]], 1)}
    for t, name in enumerate(data.behaviours):  # task t's labels: is the pair behaviour t's
        train = {tuple(p) for p in data.train[name]}
        want = [float((u, i) in train) for u, i in zip(b["user"][:8], b["item"][:8])]
        np.testing.assert_array_equal(b["label"][blocks[t]], want)
    # Over an epoch: 4 negatives per training pair of any behaviour, labelled 0 for every
    # behaviour, none of them a training pair of any behaviour.
    stream = inp.epoch_rows(0)[0]
    union = set(map(tuple, np.concatenate([data.train[n] for n in data.behaviours])))
    neg = stream["labels"].sum(1) == 0
    assert neg.sum() == 4 * len(union) == 4 * (~neg).sum()
    assert not {tuple(p) for p in np.stack([stream["user"][neg], stream["item"][neg]], 1)} & union
    assert pairs  # the batch is not empty


def test_one_metabalance_step_by_hand():
    """Shared parameters (the four tables and the MLP) get MetaBalance's combination of the
    task gradients, towers the summed loss's gradient (the authors' two optimizers):
    checked against per-task losses written out here, under SGD (learning rate 1)."""
    data = _tiny_data()
    inp = _shared_input(data)
    model = _neumf(dropout_rate=0.0)
    r = 0.7
    trainer = recsys_study.study_trainer(model, optax.sgd(1.0),
                                         optim.metabalance(relax_factor=r, num_tasks=3))
    batch = inp.get_batch(0)
    state = trainer.init_state(jax.random.key(0), batch)
    params = jax.device_get(state.params)
    new, _ = trainer.train_step(state, batch, jax.random.key(1), inp.task_counts(0))
    new = jax.device_get(new.params)

    u, i = batch["user"][:8], batch["item"][:8]
    labels = batch["label"].reshape(3, 8)

    def task_loss(p, t):  # mean BCE of task t's logit on the shared pairs
        z = model.module.apply({"params": p}, u, i, False)[:, t]
        return optax.sigmoid_binary_cross_entropy(z, labels[t]).mean()

    grads = [jax.grad(task_loss)(params, t) for t in range(3)]
    for top in ("user_embedding", "item_embedding", "user_gmf", "item_gmf", "bottom", "towers"):
        for path, p0 in jax.tree_util.tree_leaves_with_path(params[top]):
            g = [np.asarray(_at(gr[top], path)) for gr in grads]
            if top == "towers":
                want = sum(g)
            else:  # first step: each moving norm is (1 - beta) x the norm, the ratio the norms'
                n = [np.linalg.norm(x) for x in g]
                w = [1.0] + [(n[0] / (n[k] + 1e-8 / 0.1)) * r + 1 - r for k in (1, 2)]
                want = sum(wk * gk for wk, gk in zip(w, g))
            np.testing.assert_allclose(np.asarray(_at(new[top], path)), np.asarray(p0) - want,
                                       rtol=2e-4, atol=1e-7, err_msg=f"{top}{path}")
    # The tables did move (not a vacuous check) and the GMF tables' gradient is not zero.
    assert np.abs(new["user_gmf"]["embedding"] - params["user_gmf"]["embedding"]).max() > 1e-6


def _at(tree, path):
    for k in path:
        tree = tree[k.key]
    return tree
