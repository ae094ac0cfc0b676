"""Per-task gradients through task taps (`method="taps"`, `ktx.task_taps`): the same
losses and gradients as the task blocks, under dropout, for T5, BERT and CA-MTL (unrolled
and scanned) and the recommendation model, with equal and unequal task blocks; BERT with
frozen layers; what the method refuses; two Trainer steps on 1 and 8 devices."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ktx import optim, partitioning, task_taps
from ktx.models import bert, camtl, encoder, seq2seq, t5
from ktx.models.base import with_row_ids
from ktx.models.recsys import RecsysModel
from ktx.optim import compute_task_gradients
from ktx.optim.task_gradients import leaf_dense
from ktx.training import trainer as trainer_lib
from tests.models.t5_batches import random_t5_batch

UNEQUAL = (3, 5, 0, 8)  # one absent task
EQUAL = (4, 4, 4, 4)


def _t5(scan: bool):
    return seq2seq.EncoderDecoderModel(
        config=t5.T5Config(vocab_size=64, emb_dim=16, num_heads=2, head_dim=8, mlp_dim=32,
                           num_encoder_layers=2, num_decoder_layers=2, dropout_rate=0.1,
                           scan_layers=scan),
        num_tasks=4)


def _recsys():
    return RecsysModel(num_users=30, num_items=40, num_tasks=4, embed_dim=8, mlp_dims=(8, 4),
                       tower_dims=(6,), dropout_rate=0.5)


def _recsys_batch(counts, seed=0):
    rng = np.random.default_rng(seed)
    n = sum(counts)
    return {"user": rng.integers(0, 30, n).astype(np.int32),
            "item": rng.integers(0, 40, n).astype(np.int32),
            "label": rng.integers(0, 2, n).astype(np.float32),
            "task_id": np.repeat(np.arange(4), counts).astype(np.int32)}


def _bert(scan: bool, frozen_layers: int = 0, camtl_variant: str | None = None):
    config = bert.BertConfig(vocab_size=50, hidden_size=16, num_layers=2, num_heads=2,
                             intermediate_size=32, max_position=16, dropout_rate=0.1,
                             attention_dropout_rate=0.1, scan_layers=scan)
    if camtl_variant:  # CA-MTL's conditioning, every module of it read through taps
        return camtl.CaMtlClassifierModel(
            config, camtl=camtl.CaMtlConfig(variant=camtl_variant, max_seq_length=8),
            num_labels=(3, 2, 1, 2))
    return encoder.EncoderClassifierModel(config, num_labels=(3, 2, 1, 2),
                                          frozen_layers=frozen_layers)


def _bert_batch(counts, seed=0):
    rng = np.random.default_rng(seed)
    n = sum(counts)
    ids = rng.integers(1, 50, (n, 8)).astype(np.int32)
    ids[1::2, 5:] = 0
    task = np.repeat(np.arange(4), counts).astype(np.int32)
    return {"input_ids": ids, "token_type_ids": (rng.random((n, 8)) > 0.5).astype(np.int32),
            "attention_mask": (ids > 0).astype(np.int32),
            "label": np.where(task == 2, rng.random(n), task % 2).astype(np.float32),
            "task_id": task}


MODELS = {"t5": (lambda: _t5(False), random_t5_batch),
          "t5_scanned": (lambda: _t5(True), random_t5_batch),
          "recsys": (_recsys, _recsys_batch),
          "bert": (lambda: _bert(False), _bert_batch),
          "bert_scanned": (lambda: _bert(True), _bert_batch),
          "bert_frozen": (lambda: _bert(False, frozen_layers=1), _bert_batch),
          "camtl": (lambda: _bert(False, camtl_variant="base"), _bert_batch),
          "camtl_scanned": (lambda: _bert(True, camtl_variant="large"), _bert_batch)}
# A parameter whose true gradient is zero (BERT's attention key bias: softmax does not see
# it) has gradients of rounding size, ~1e-14, that differ between the two ways: `ATOL`.
ATOL = 1e-7


def _unbox(tree):
    return jax.tree.map(lambda x: getattr(x, "value", x), tree,
                        is_leaf=lambda x: hasattr(x, "value"))


@functools.cache
def _setup(name, counts):
    model = MODELS[name][0]()
    batch = with_row_ids({k: jnp.asarray(v) for k, v in MODELS[name][1](counts).items()})
    params = _unbox(model.init_variables(jax.random.key(0), batch)["params"])
    return model, batch, params


def _gradients(model, batch, params, method, counts, sparse=True, **kwargs):
    rng = jax.random.key(3)

    @jax.jit
    def f(p, b):
        return compute_task_gradients(
            lambda q, c: model.loss_sums(q, c, rng, True), model.normalizer(b), p, b,
            num_tasks=4, task_counts=counts, method=method,
            sparse_tables=model.sparse_table_patterns if sparse else None, **kwargs)

    return f(params, batch)


def _dense(tree):
    return jax.tree.map(lambda g: None if g is None else leaf_dense(g), tree,
                        is_leaf=lambda x: isinstance(x, optim.SparseRows))


# T5's scanned stack differs from the unrolled one in the taps' shapes only (a layer axis
# before the task axis), not in how the blocks are cut: one block layout each.
@pytest.mark.parametrize("name,counts", [("t5", UNEQUAL), ("t5_scanned", EQUAL),
                                         ("recsys", UNEQUAL), ("recsys", EQUAL),
                                         ("bert", UNEQUAL), ("bert_scanned", EQUAL),
                                         ("camtl", UNEQUAL), ("camtl_scanned", EQUAL)],
                         ids=["t5-unequal", "t5_scanned-equal", "recsys-unequal", "recsys-equal",
                              "bert-unequal", "bert_scanned-equal", "camtl-unequal",
                              "camtl_scanned_large-equal"])
def test_taps_give_the_blocks_losses_and_gradients_under_dropout(name, counts):
    model, batch, params = _setup(name, counts)
    lb, ab, gb = _gradients(model, batch, params, "blocks", counts)
    lt, at, gt = _gradients(model, batch, params, "taps", counts)
    np.testing.assert_allclose(lt, lb, rtol=1e-5, atol=1e-7)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), at, ab)
    assert jax.tree.structure(gt.stacked, is_leaf=lambda x: x is None) == \
        jax.tree.structure(gb.stacked, is_leaf=lambda x: x is None)
    for got, want in ((gt.stacked, gb.stacked), (gt.summed, gb.summed)):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=ATOL),
                     _dense(got), _dense(want))
    # Balanced parameters of every kind have per-task gradients that differ by task.
    if name.startswith("t5"):
        scale = gt.stacked["encoder"]["encoder_norm"]["scale"]
        assert not np.allclose(scale[0], scale[1])
    if name.startswith(("bert", "camtl")):  # a norm, the position table read once per task
        for leaf in (gt.stacked["embeddings"]["layer_norm"]["scale"],
                     gt.stacked["embeddings"]["position_embeddings"]["embedding"]):
            assert not np.allclose(leaf[0], leaf[1])
    if name.startswith("camtl"):  # the task embeddings: each task's own row only
        table = gt.stacked["conditioning"]["task_embeddings"]["embedding"]
        for t, count in enumerate(counts):
            assert np.any(table[t, t]) == (count > 0)
            assert not np.any(np.delete(table[t], t, axis=0))


def test_bert_with_frozen_layers_takes_no_gradient_of_them_through_the_taps():
    """The frozen embeddings and first layer (their gradients stopped in the loss) have
    zero per-task gradients through their taps too, as with the blocks; their word table
    is then no sparse table (whose looked-up rows would not see the stop)."""
    model, batch, params = _setup("bert_frozen", UNEQUAL)
    assert model.sparse_table_patterns == ()
    _, _, gb = _gradients(model, batch, params, "blocks", UNEQUAL)
    _, _, gt = _gradients(model, batch, params, "taps", UNEQUAL)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=ATOL),
                 gt.stacked, gb.stacked)
    for leaf in (gt.stacked["embeddings"], gt.stacked["layers_0"]):
        assert all(not np.any(x) for x in jax.tree.leaves(leaf))
    assert np.any(gt.stacked["layers_1"]["output"]["kernel"])


def test_a_table_also_read_without_its_tap_gets_none():
    """The MLM head reads BERT's word table as it is (`attend`, `task_taps.read_directly`):
    the taps give it no tap, and "taps" balancing it is refused, naming it."""
    from ktx.models.encoder_mlm import EncoderMlmModel
    from tests.models.test_encoder_mlm import COUNTS, TINY
    from tests.models.test_encoder_mlm import _batch as mlm_batch

    model = EncoderMlmModel(TINY, num_tasks=2)
    batch = {k: jnp.asarray(v) for k, v in mlm_batch().items()}
    params = _unbox(model.init_variables(jax.random.key(0), batch)["params"])
    word = encoder.WORD_EMBEDDINGS
    with pytest.raises(ValueError, match=word + r".*not read through a task tap"):
        compute_task_gradients(
            lambda q, c: model.loss_sums(q, c, None, False), model.normalizer(batch), params,
            batch, num_tasks=2, task_counts=COUNTS, method="taps", shared=["^embeddings/.*"])


def test_auto_takes_the_taps_where_every_balanced_parameter_has_one():
    """T5's token embedding is read through a tap only as sparse rows: without
    `sparse_tables` "taps" is refused, naming it, and "auto" takes the blocks."""
    model, batch, params = _setup("t5", EQUAL)
    with pytest.raises(ValueError, match=r"token_embedder/embedding.*not read through a task tap"):
        _gradients(model, batch, params, "taps", EQUAL, sparse=False)
    traced = jax.make_jaxpr(lambda p, b: compute_task_gradients(
        lambda q, c: model.loss_sums(q, c, None, False), model.normalizer(b), p, b,
        num_tasks=4, task_counts=EQUAL, method="auto", sparse_tables=None))(params, batch)
    assert "tri,tro->tio" not in str(traced)  # the blocks: no per-task product
    traced = jax.make_jaxpr(lambda p, b: compute_task_gradients(
        lambda q, c: model.loss_sums(q, c, None, False), model.normalizer(b), p, b,
        num_tasks=4, task_counts=EQUAL, method="auto",
        sparse_tables=model.sparse_table_patterns))(params, batch)
    assert "custom_vjp_call" in str(traced) and "vmap" not in str(traced)


def test_taps_need_static_rows_per_task():
    model, batch, params = _setup("recsys", EQUAL)
    with pytest.raises(ValueError, match=r"static rows per task.*sums to 20.*16 rows"):
        _gradients(model, batch, params, "taps", None, task_capacity=(5, 5, 5, 5),
                   check_layout=False)
    # Capacities that fill the batch are its counts: taps.
    lt, _, gt = _gradients(model, batch, params, "taps", None, task_capacity=EQUAL,
                           check_layout=False)
    lb, _, gb = _gradients(model, batch, params, "blocks", EQUAL)
    np.testing.assert_allclose(lt, lb, rtol=1e-6)


def test_tapped_contract_gives_each_tasks_kernel_gradient():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(6, 3, 5)), jnp.float32)
    kernel = jnp.asarray(rng.normal(size=(5, 4)), jnp.float32)
    sizes = (2, 0, 4)

    def loss(k, tap):
        with task_taps.by_task(sizes):
            return jnp.sum(jnp.sin(task_taps.contract(x, k, 1, tap)))

    dk, dtap = jax.grad(loss, argnums=(0, 1))(kernel, jnp.zeros((3, 5, 4)))
    starts = np.cumsum((0,) + sizes[:-1])
    for t, (a, n) in enumerate(zip(starts, sizes)):
        want = jax.grad(lambda k: jnp.sum(jnp.sin(x[a:a + n] @ k)))(kernel)
        np.testing.assert_allclose(dtap[t], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dk, dtap.sum(0), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="only inside task_taps.by_task"):
        task_taps.contract(x, kernel, 1, jnp.zeros((3, 5, 4)))
    with pytest.raises(ValueError, match="the batch has 6 examples"):
        with task_taps.by_task((2, 2)):
            task_taps.contract(x, kernel, 1, jnp.zeros((2, 5, 4)))


def test_trainer_steps_with_taps_equal_the_blocks():
    """Two MetaBalance steps of the recommendation model's `Trainer` on one device:
    grad_method "taps" and "auto" (there: the taps) give the parameters "blocks" gives, and
    so do the taps on 8 devices, whose `data` axis is wider than any task's 4 rows."""
    model = _recsys()
    batch = _recsys_batch(EQUAL)
    one = partitioning.create_mesh(1, devices=jax.devices()[:1])

    def run(method, mesh=one):
        tr = trainer_lib.Trainer(model, optax.adam(1e-2), mesh=mesh,
                                 balancer=optim.metabalance(num_tasks=4), grad_method=method,
                                 sparse_tables=model.sparse_table_patterns)
        state = tr.init_state(jax.random.key(0), batch)
        for _ in range(2):
            state, _ = tr.train_step(state, batch, jax.random.key(1), task_counts=EQUAL)
        return jax.device_get(state.params)

    want = run("blocks")
    for got in (run("taps"), run("auto"), run("taps", partitioning.create_mesh(1))):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                     got, want)


@pytest.mark.parametrize("sizes", [(2, 2, 2), (1, 0, 5)])
def test_per_task_values_add_to_each_tasks_examples(sizes):
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(6, 2, 3)), jnp.float32)
    values = jnp.asarray(rng.normal(size=(3, 2, 3)), jnp.float32)
    want = x + jnp.repeat(values, np.asarray(sizes), axis=0, total_repeat_length=6)
    got = task_taps.add(x, task_taps.PerTask(values, sizes))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(task_taps.add(x, values[:1]), x + values[:1])
    with pytest.raises(ValueError, match="do not fit"):
        task_taps.add(x[:5], task_taps.PerTask(values, sizes))
