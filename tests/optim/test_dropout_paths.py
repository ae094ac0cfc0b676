"""Dropout keyed per row: with dropout > 0 the blocks path, the one-hot VJP path, the
plain gradient and microbatching all compute the same gradient for the same rng."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ktx import optim
from ktx.training import trainer as trainer_lib
from ktx.models import bert, pals, seq2seq, t5
from ktx.models.base import with_row_ids
from ktx.models.recsys import RecsysModel
from ktx.optim import compute_task_gradients
from ktx.optim.task_gradients import leaf_combine
from tests.models.t5_batches import random_t5_batch

COUNTS = (3, 5, 0, 8)  # unequal blocks, one absent task; 16 rows (8 fake devices)


def _t5(dropout=0.1):
    return seq2seq.EncoderDecoderModel(
        config=t5.T5Config(vocab_size=64, emb_dim=16, num_heads=2, head_dim=8, mlp_dim=32,
                           num_encoder_layers=1, num_decoder_layers=1, dropout_rate=dropout),
        num_tasks=len(COUNTS))


def _t5_batch(seed=0):
    return random_t5_batch(COUNTS, seed)


def _recsys(dropout=0.5):
    return RecsysModel(num_users=30, num_items=40, num_tasks=len(COUNTS), embed_dim=8,
                       mlp_dims=(8, 4), tower_dims=(6,), dropout_rate=dropout,
                       loss_normalization="global")


def _recsys_batch(seed=0):
    rng = np.random.default_rng(seed)
    n = sum(COUNTS)
    return {
        "user": rng.integers(0, 30, n).astype(np.int32),
        "item": rng.integers(0, 40, n).astype(np.int32),
        "label": rng.integers(0, 2, n).astype(np.float32),
        "task_id": np.repeat(np.arange(len(COUNTS)), COUNTS).astype(np.int32),
    }


def _pals(dropout=0.1):
    """PALs on a tiny BERT: an encoder method whose word table is a sparse table."""
    config = bert.BertConfig(vocab_size=50, hidden_size=16, num_layers=2, num_heads=2,
                             intermediate_size=32, max_position=16, dropout_rate=dropout,
                             attention_dropout_rate=dropout)
    return pals.PalsClassifierModel(config, pals_size=6, pals_heads=2, num_labels=(3, 2, 1, 2))


def _pals_batch(seed=0):
    rng = np.random.default_rng(seed)
    n = sum(COUNTS)
    ids = rng.integers(1, 50, (n, 8)).astype(np.int32)
    ids[1::2, 5:] = 0
    task = np.repeat(np.arange(len(COUNTS)), COUNTS).astype(np.int32)
    return {"input_ids": ids, "attention_mask": (ids > 0).astype(np.int32),
            "label": np.where(task == 2, rng.random(n), task % 2).astype(np.float32),
            "task_id": task}


MODELS = {"t5": (_t5, _t5_batch), "recsys": (_recsys, _recsys_batch),
          "pals": (_pals, _pals_batch)}


@pytest.fixture(scope="module", autouse=True)
def _clear_caches():
    """The file's cached models, parameters, references and jitted gradients, dropped after
    its tests."""
    yield
    for fn in (_model, _init_fn, model_batch_params, _references, _per_task_fn, _initial_state):
        fn.cache_clear()


@functools.cache
def _model(name):
    return MODELS[name][0]()


@functools.cache
def _init_fn(name):
    """Jitted `(rng, batch) -> ` `_model(name)`'s unboxed params."""
    model = _model(name)
    return jax.jit(lambda r, b: jax.tree.map(
        lambda x: getattr(x, "value", x), model.init_variables(r, b)["params"],
        is_leaf=lambda x: hasattr(x, "value")))


@functools.cache
def model_batch_params(name):
    """`MODELS[name]`'s model, its batch (numbered rows, jax arrays) and unboxed params
    (built once; read only)."""
    batch = with_row_ids({k: jnp.asarray(v) for k, v in MODELS[name][1]().items()})
    return _model(name), batch, _init_fn(name)(jax.random.key(0), batch)


@functools.cache
def _references(name, seed=7):
    """`(plain, want, no_dropout)` of `model_batch_params(name)` with rng `key(seed)`: the
    plain gradient of the summed task losses, the task losses under dropout, and without."""
    model, batch, params = model_batch_params(name)

    @jax.jit
    def refs(p, b, rng):
        normalizer = model.normalizer(b)
        plain = jax.grad(lambda q: model.task_losses(q, b, rng, True, normalizer=normalizer)[0].sum())(p)
        want = model.task_losses(p, b, rng, True, normalizer=normalizer)[0]
        return plain, want, model.task_losses(p, b, None, False, normalizer=normalizer)[0]

    return refs(params, batch, jax.random.key(seed))


@functools.cache
def _per_task_fn(name, method, sparse):
    """Jitted `(params, batch, rng) -> compute_task_gradients(...)` of `_model(name)` under
    dropout (`shared="all"`; task blocks of COUNTS for "blocks")."""
    model = _model(name)

    @jax.jit
    def per_task(p, b, rng):
        return compute_task_gradients(
            lambda q, c: model.loss_sums(q, c, rng, True), model.normalizer(b), p, b,
            num_tasks=model.num_tasks, task_counts=COUNTS if method == "blocks" else None,
            method=method, shared="all",
            sparse_tables=model.sparse_table_patterns if sparse else None)

    return per_task


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("method,sparse", [("blocks", False), ("vjp", False), ("blocks", True),
                                           ("vjp", True)])
def test_task_gradients_sum_to_the_plain_gradient_under_dropout(name, method, sparse):
    model, batch, params = model_batch_params(name)
    rng = jax.random.key(7)
    plain, want, no_dropout = _references(name, 7)

    losses, _, tg = _per_task_fn(name, method, sparse)(params, batch, rng)
    summed = optim.TaskGradients(stacked=tg.stacked, summed=tg.summed)
    total = jax.tree.map(
        lambda g: leaf_combine(g, jnp.ones((model.num_tasks,))) if isinstance(g, optim.SparseRows)
        else g.sum(0), summed.stacked, is_leaf=lambda x: isinstance(x, optim.SparseRows))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), total, plain)
    np.testing.assert_allclose(losses, want, rtol=1e-5, atol=1e-7)
    # Dropout is active: without it the loss differs.
    assert not np.allclose(no_dropout, want)


@functools.cache
def _initial_state(balanced):
    """The T5 `Trainer`'s initial state (host arrays) with Adam, with a per-task balancer
    (`vanilla_multi`) or without: the same for every step option."""
    kwargs = {"balancer": optim.vanilla_multi()} if balanced else {}
    tr = trainer_lib.Trainer(_t5(0.1), optax.adam(1e-2), **kwargs)
    return jax.device_get(tr.init_state(jax.random.key(0), _t5_batch()))


def _three_steps(model, batch, **trainer_kwargs):
    tr = trainer_lib.Trainer(model, optax.adam(1e-2), **trainer_kwargs)
    tr.create_abstract_state(batch)  # the state, initialized once per optimizer, placed anew
    state = jax.device_put(_initial_state("balancer" in trainer_kwargs), tr.state_shardings)
    losses = []
    for _ in range(3):
        state, m = tr.train_step(state, batch, jax.random.key(3), task_counts=COUNTS)
        losses.append(float(m["loss"]))
    return np.array(losses), jax.device_get(state.params)


def test_trainer_plain_balanced_and_microbatched_agree_under_dropout():
    """The issue's check at unit scale: 3 steps with dropout 0.1, plain vs per-task
    gradients summed (vanilla_multi), blocks and VJP, and 4 microbatches."""
    model = _t5(0.1)
    batch = _t5_batch()
    plain, p_plain = _three_steps(model, batch)
    per_task = {"balancer": optim.vanilla_multi(), "weights_from_losses": False}
    for kwargs in (dict(per_task, grad_method="blocks"), dict(per_task, grad_method="vjp"),
                   {"num_microbatches": 4}):
        got, p_got = _three_steps(model, batch, **kwargs)
        np.testing.assert_allclose(got, plain, rtol=1e-5, err_msg=str(kwargs))
        # Adam's step is g / sqrt(v): an element whose gradient is ~0 turns a rounding
        # difference of the summation order into a step of up to lr (1e-2); 5e-5 is 0.2% of
        # what 3 steps can move a parameter.
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=5e-5), p_got, p_plain)


def _dense_rows(g, task):
    """Task `task`'s gradient of a table from its `SparseRows`."""
    table = jnp.zeros((g.num_rows, g.rows.shape[-1]), g.rows.dtype)
    return table.at[g.indices[task]].add(g.rows[task])


@pytest.mark.parametrize("method", ["blocks", "vjp"])
def test_t5_sparse_token_embedding_rows_equal_the_dense_task_gradients(method):
    """Every task's rows of T5's token embedding (looked up by the encoder and the decoder),
    scattered back, equal its dense per-task gradient, and its other leaves are unchanged."""
    model = _model("t5")  # _t5(0.1)
    batch = with_row_ids({k: jnp.asarray(v) for k, v in _t5_batch(1).items()})
    params = _init_fn("t5")(jax.random.key(0), batch)
    rng = jax.random.key(5)
    assert model.sparse_table_patterns == (r"^token_embedder/embedding$",)

    def grads(sparse):  # the compiles of the test above, on this batch and rng
        return _per_task_fn("t5", method, sparse)(params, batch, rng)[2].stacked

    sparse, dense = grads(True), grads(False)
    rows = sparse["token_embedder"]["embedding"]
    assert isinstance(rows, optim.SparseRows)
    for t in range(len(COUNTS)):
        np.testing.assert_allclose(_dense_rows(rows, t), dense["token_embedder"]["embedding"][t],
                                   rtol=1e-5, atol=1e-7)
    rest = lambda tree: {k: v for k, v in tree.items() if k != "token_embedder"}  # noqa: E731
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                 rest(sparse), rest(dense))


def test_tied_t5_keeps_a_dense_token_embedding():
    """Tied logits read the table through `attend` (a dense gradient): no sparse default,
    and asking for it is an error that names the table."""
    cfg = t5.T5Config(vocab_size=64, emb_dim=16, num_heads=2, head_dim=8, mlp_dim=32,
                      num_encoder_layers=1, num_decoder_layers=1, logits_via_embedding=True)
    model = seq2seq.EncoderDecoderModel(cfg, num_tasks=len(COUNTS))
    assert model.sparse_table_patterns == ()
    batch = with_row_ids({k: jnp.asarray(v) for k, v in _t5_batch().items()})
    params = jax.jit(lambda r: jax.tree.map(  # jitted: one compile, not op by op
        lambda x: getattr(x, "value", x), model.init_variables(r, batch)["params"],
        is_leaf=lambda x: hasattr(x, "value")))(jax.random.key(0))
    with pytest.raises(ValueError, match="token_embedder/embedding is also used by Embed.attend"):
        compute_task_gradients(
            lambda q, b: model.loss_sums(q, b, None, False), model.normalizer(batch), params,
            batch, num_tasks=model.num_tasks, task_counts=COUNTS, method="blocks",
            sparse_tables=(r"^token_embedder/embedding$",))


def test_trainer_takes_the_models_sparse_tables_by_default():
    model = _t5(0.1)
    balanced = trainer_lib.Trainer(model, optax.adam(1e-2), balancer=optim.metabalance(num_tasks=4))
    assert balanced.options.sparse_tables == model.sparse_table_patterns
    off = trainer_lib.Trainer(model, optax.adam(1e-2), balancer=optim.metabalance(num_tasks=4),
                              sparse_tables=())
    assert off.options.sparse_tables == ()
    micro = trainer_lib.Trainer(model, optax.adam(1e-2), balancer=optim.metabalance(num_tasks=4),
                                num_microbatches=2)
    assert micro.options.sparse_tables == ()  # rows are not accumulated over microbatches
    assert trainer_lib.Trainer(model, optax.adam(1e-2)).options.sparse_tables == ()
