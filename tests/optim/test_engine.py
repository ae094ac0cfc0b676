"""Per-task gradients of both engine paths equal jax.grad of each task's loss alone."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ktx.optim import compute_task_gradients, shared_mask
from tests.optim.tiny_model import TinyModel, make_batch


def _reference(model, params, batch):
    """grad of task t's loss (whole-batch normalizer), one jax.grad per task."""
    norm = model.normalizer(batch)
    out = []
    for t in range(model.num_tasks):
        f = lambda p, t=t: model.loss_sums(p, batch)[0][t] / norm[t]  # noqa: E731
        out.append(jax.grad(f)(params))
    return jax.tree.map(lambda *g: jnp.stack(g), *out)


@pytest.mark.parametrize("counts,method,normalization", [
    ((4, 4, 4), "blocks", "global"),  # equal blocks: vmapped
    ((2, 5, 3), "blocks", "per_task"),  # unequal blocks: traced one after another
    ((2, 5, 3), "vjp", "global"),
    ((3, 0, 4), "blocks", "per_task"),  # a task with no rows
    ((3, 0, 4), "vjp", "per_task"),
])
def test_paths_match_per_task_grad(counts, method, normalization):
    model = TinyModel(num_tasks=3, loss_normalization=normalization)
    batch = make_batch(counts)
    params = model.init_variables(jax.random.key(0), batch)["params"]
    ref = _reference(model, params, batch)

    @jax.jit
    def run(params, batch):
        fn = lambda p, b: model.loss_sums(p, b)  # noqa: E731
        return compute_task_gradients(fn, model.normalizer(batch), params, batch,
                                      num_tasks=3, task_counts=counts if method == "blocks" else None,
                                      method=method, shared="all")

    losses, aux, tg = run(params, batch)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6), tg.stacked, ref)
    want_losses, want_aux = model.task_losses(params, batch)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    np.testing.assert_allclose(aux["weight"], np.asarray(counts, np.float32))
    # Per-task gradients add up to the gradient of the plain loss.
    plain = jax.grad(lambda p: model.loss_fn(p, batch)[0])(params)
    jax.tree.map(lambda s, g: np.testing.assert_allclose(s.sum(0), g, rtol=1e-4, atol=1e-6),
                 tg.stacked, plain)


def test_unshared_params_are_summed():
    model = TinyModel(num_tasks=3)
    batch = make_batch((2, 2, 2))
    params = model.init_variables(jax.random.key(1), batch)["params"]
    fn = lambda p, b: model.loss_sums(p, b)  # noqa: E731
    _, _, tg = jax.jit(lambda p, b: compute_task_gradients(
        fn, model.normalizer(b), p, b, num_tasks=3, task_counts=(2, 2, 2),
        shared=[r"^embed/", r"^shared/"]))(params, batch)
    assert tg.stacked["head"]["kernel"] is None and tg.summed["embed"]["embedding"] is None
    assert tg.stacked["shared"]["kernel"].shape == (3,) + params["shared"]["kernel"].shape
    plain = jax.grad(lambda p: model.loss_fn(p, batch)[0])(params)
    np.testing.assert_allclose(tg.summed["head"]["kernel"], plain["head"]["kernel"], rtol=1e-5)


def test_default_shared_excludes_towers():
    params = {"bottom": {"kernel": jnp.ones(2)}, "towers": {"k": jnp.ones(2)},
              "head_1": {"b": jnp.ones(1)}}
    assert shared_mask(params) == {"bottom": {"kernel": True}, "towers": {"k": False},
                                   "head_1": {"b": False}}


def test_errors_name_the_argument():
    model = TinyModel(num_tasks=3)
    batch = make_batch((2, 2, 2))
    params = model.init_variables(jax.random.key(0), batch)["params"]
    fn = lambda p, b: model.loss_sums(p, b)  # noqa: E731
    norm = model.normalizer(batch)
    with pytest.raises(ValueError, match="task_counts"):
        compute_task_gradients(fn, norm, params, batch, num_tasks=3, task_counts=(2, 2, 3))
    with pytest.raises(ValueError, match="method"):
        compute_task_gradients(fn, norm, params, batch, num_tasks=3, method="loop")
    with pytest.raises(ValueError, match="needs task_counts"):
        compute_task_gradients(fn, norm, params, batch, num_tasks=3, method="blocks")
    with pytest.raises(ValueError, match="matches no parameter"):
        shared_mask(params, ["^nothing"])


@pytest.mark.parametrize("counts,method", [((3, 3, 3), "blocks"), ((2, 4, 3), "blocks"),
                                           ((2, 4, 3), "vjp")])
def test_sparse_tables_match_dense(counts, method):
    """SparseRows of the table: same combined gradient and same per-task norms as dense."""
    from ktx.optim.task_gradients import SparseRows, leaf_combine, leaf_dense, leaf_sq_norms

    model = TinyModel(num_tasks=3, vocab=7)  # few ids: many duplicates inside each block
    batch = make_batch(counts, vocab=7, seed=2)
    params = model.init_variables(jax.random.key(0), batch)["params"]
    ref = _reference(model, params, batch)
    fn = lambda p, b: model.loss_sums(p, b)  # noqa: E731

    @jax.jit
    def run(params, batch):
        return compute_task_gradients(
            fn, model.normalizer(batch), params, batch, num_tasks=3,
            task_counts=counts if method == "blocks" else None, method=method,
            shared="all", sparse_tables=[r"^embed/embedding$"])

    losses, _, tg = run(params, batch)
    table = tg.stacked["embed"]["embedding"]
    assert isinstance(table, SparseRows)
    np.testing.assert_allclose(leaf_dense(table), ref["embed"]["embedding"], rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(leaf_sq_norms(table), leaf_sq_norms(ref["embed"]["embedding"]),
                               rtol=2e-5)
    w = jnp.array([1.0, 0.5, 2.0])
    np.testing.assert_allclose(leaf_combine(table, w),
                               jnp.tensordot(w, ref["embed"]["embedding"], 1), rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(tg.stacked["shared"]["kernel"], ref["shared"]["kernel"], rtol=2e-5,
                               atol=1e-6)
    np.testing.assert_allclose(losses, model.task_losses(params, batch)[0], rtol=1e-5)
    # One row per lookup (duplicates inside a task kept); merged, each task's rows come
    # sorted and unique (free slots last, at the last row). The Gram from either equals
    # the dense one.
    from ktx.optim.task_gradients import leaf_gram, with_merged_rows

    assert not table.sorted_unique
    merged = with_merged_rows(table)
    assert merged.sorted_unique
    idx = np.asarray(merged.indices)
    assert (np.diff(idx, axis=1) >= 0).all() and idx.max() < 7
    for t in range(3):
        real = idx[t][np.abs(np.asarray(merged.rows[t])).sum(-1) > 0]
        assert len(set(real.tolist())) == len(real)
        assert len(set(np.asarray(table.indices[t]).tolist())) < table.indices.shape[1]
    np.testing.assert_allclose(leaf_sq_norms(merged), leaf_sq_norms(table), rtol=1e-5)
    np.testing.assert_allclose(leaf_gram(table), leaf_gram(ref["embed"]["embedding"]), rtol=2e-5,
                               atol=1e-7)
    table = merged
    resorted = SparseRows(table.indices, table.rows, num_rows=table.num_rows)
    np.testing.assert_allclose(leaf_gram(table), leaf_gram(resorted), rtol=1e-6, atol=1e-7)


def test_names_of_boxed_params():
    import flax.linen as nn

    params = {"emb": {"embedding": nn.Partitioned(jnp.ones((3, 2)), names=("vocab", "embed"))}}
    assert ko_names(params) == ["emb/embedding"]


def ko_names(params):
    from ktx.optim import param_names

    return param_names(params)


def test_rows_not_grouped_as_the_counts_say_fail_loudly():
    """task_counts promise contiguous task blocks; a batch whose task_id disagrees
    (here: rows interleaved) fails, eagerly and inside a compiled step."""
    from tests.optim.tiny_model import TinyModel, make_batch

    model = TinyModel(num_tasks=3)
    batch = make_batch((2, 3, 2))
    shuffled = dict(batch, task_id=jnp.asarray([0, 1, 0, 1, 2, 1, 2], jnp.int32))
    params = model.init_variables(jax.random.key(0), batch)["params"]

    def run(b):
        return compute_task_gradients(lambda p, x: model.loss_sums(p, x), model.normalizer(b),
                                      params, b, num_tasks=3, task_counts=(2, 3, 2), method="blocks")

    with pytest.raises(ValueError, match="row 1 has task_id 1"):
        run(shuffled)
    with pytest.raises(Exception, match="row 1 has task_id 1"):
        jax.block_until_ready(jax.jit(run)(shuffled))
    jax.block_until_ready(jax.jit(run)(batch))  # a grouped batch passes


@pytest.mark.parametrize("counts", [(2, 5, 3), (4, 0, 6), (3, 3, 4)])
def test_capacity_blocks_equal_exact_blocks_with_one_compile(counts):
    """`task_capacity` (static block sizes >= the counts) reads the counts from task_id
    inside the step: the same losses and gradients as the exact counts, and batches with
    other counts reuse the compiled function."""
    from tests.optim.tiny_model import TinyModel, make_batch

    model = TinyModel(num_tasks=3)
    capacity = (5, 5, 6)
    batch = make_batch(counts)
    params = model.init_variables(jax.random.key(0), batch)["params"]
    fn = lambda p, b: model.loss_sums(p, b)  # noqa: E731
    traces = []

    @jax.jit
    def with_capacity(p, b):
        traces.append(1)
        return compute_task_gradients(fn, model.normalizer(b), p, b, num_tasks=3,
                                      task_capacity=capacity, shared="all")

    exact = compute_task_gradients(fn, model.normalizer(batch), params, batch, num_tasks=3,
                                   task_counts=counts, shared="all")
    got = with_capacity(params, batch)
    np.testing.assert_allclose(got[0], exact[0], rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), got[1], exact[1])
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                 got[2].stacked, exact[2].stacked)
    with_capacity(params, make_batch((5, 1, 4), seed=1))
    assert len(traces) == 1
    with pytest.raises(Exception, match="task_capacity"):
        jax.block_until_ready(with_capacity(params, make_batch((6, 1, 3), seed=2)))
