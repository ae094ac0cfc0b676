"""Hand-computed two-step tests of every baseline transformation, under jax.jit.

Two tasks, one parameter: g0 = [1, 0] (target), g1 = [-1, 1]; Gram [[1, -1], [-1, 2]].
Also: per-task gradients are explicit (`TaskGradients.from_stacked`), the Gram matrix of
sparse table rows, absent tasks, task-count mismatches and argument checks.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import ktx.optim as ko

G = {"w": jnp.array([[1.0, 0.0], [-1.0, 1.0]])}
PARAMS = {"w": jnp.zeros(2)}


def _tg(tree):
    return ko.TaskGradients.from_stacked(tree)


def _run(tx, steps, losses=None, present=None):
    state = tx.init(PARAMS)
    update = jax.jit(tx.update)
    outs = []
    for i, g in enumerate(steps):
        kw = {} if losses is None else {"task_losses": jnp.asarray(losses[i], jnp.float32)}
        if present is not None:
            kw["task_present"] = jnp.asarray(present[i])
        out, state = update(_tg(g), state, PARAMS, **kw)
        outs.append(np.asarray(out["w"]))
    return outs, state


def _close(got, want):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_fixed_weightings():
    _close(_run(ko.single_loss(), [G, G])[0][1], [1.0, 0.0])
    _close(_run(ko.vanilla_multi(), [G, G])[0][1], [0.0, 1.0])
    _close(_run(ko.fixed_weights([2.0, 0.5]), [G, G])[0][1], [1.5, 0.5])
    with pytest.raises(ValueError, match="2 weights"):
        _run(ko.fixed_weights([1.0, 1.0]), [{"w": jnp.ones((3, 2))}])


def test_pcgrad():
    # g0' = g0 + 0.5 g1 = [0.5, 0.5]; g1' = g1 + g0 = [0, 1]; sum [0.5, 1.5].
    outs, _ = _run(ko.pcgrad(shuffle=False), [G, G])
    _close(outs[0], [0.5, 1.5])
    _close(outs[1], [0.5, 1.5])
    # With two tasks the projection order does not matter.
    _close(_run(ko.pcgrad(seed=3), [G, G])[0][1], [0.5, 1.5])
    # Target-anchored: only g1 is projected: g0 + (g1 + g0) = [1, 1].
    _close(_run(ko.pcgrad(anchor=0), [G, G])[0][1], [1.0, 1.0])
    # No conflict: plain sum.
    agree = {"w": jnp.array([[1.0, 0.0], [1.0, 1.0]])}
    _close(_run(ko.pcgrad(shuffle=False), [agree, agree])[0][1], [2.0, 1.0])


def test_pcgrad_weights_three_tasks():
    g = np.array([[1.0, 0.0], [-1.0, 1.0], [0.0, -1.0]])
    w = ko.pcgrad_weights(jnp.asarray(g @ g.T, jnp.float32))
    # Sequential projections in order 0, 1, 2 for each task, done by hand in numpy.
    want = np.zeros(2)
    for i in range(3):
        gi = g[i].copy()
        for j in range(3):
            d = gi @ g[j]
            if d < 0:
                gi = gi - d / (g[j] @ g[j]) * g[j]
        want += gi
    _close(np.asarray(w) @ g, want)


def test_grad_similarity():
    agree = {"w": jnp.array([[1.0, 0.0], [1.0, 1.0]])}
    outs, _ = _run(ko.grad_similarity(), [G, agree])
    _close(outs[0], [1.0, 0.0])  # cos = -1/sqrt(2) < 0: aux dropped
    _close(outs[1], [2.0, 1.0])
    outs, _ = _run(ko.grad_similarity(weighted=True), [G, agree])
    _close(outs[1], [1.0 + 2 ** -0.5, 2 ** -0.5])


def test_mgda():
    # min-norm point of segment [g0, g1]: alpha = 3/5 -> [0.2, 0.4].
    outs, _ = _run(ko.mgda(), [G, G])
    _close(outs[1], [0.2, 0.4])
    _close(ko.min_norm_weights(jnp.array([[1.0, -1.0], [-1.0, 2.0]])), [0.6, 0.4])
    # l2 normalisation: unit gradients [1,0], [-1,1]/sqrt2 -> symmetric alpha on them.
    outs, _ = _run(ko.mgda(normalization="l2"), [G])
    u = np.array([[1.0, 0.0], [-(2 ** -0.5), 2 ** -0.5]])
    gram = u @ u.T
    alpha0 = (gram[1, 1] - gram[0, 1]) / (gram[0, 0] - 2 * gram[0, 1] + gram[1, 1])
    _close(outs[0], alpha0 * np.array([1.0, 0.0]) + (1 - alpha0) * np.array([-1.0, 1.0]))


def test_dwa():
    losses = [[1.0, 1.0], [0.5, 1.0], [0.4, 1.0]]
    outs, state = _run(ko.dwa(temperature=1.0, num_tasks=2), [G, G, G], losses)
    _close(outs[0], [0.0, 1.0])
    _close(outs[1], [0.0, 1.0])
    w = 2 * np.exp([0.5, 1.0]) / np.exp([0.5, 1.0]).sum()
    _close(outs[2], w[0] * np.array([1.0, 0.0]) + w[1] * np.array([-1.0, 1.0]))
    assert int(state.count) == 3


def test_uncertainty():
    tx = ko.uncertainty(optimizer=optax.sgd(1.0), num_tasks=2)
    outs, state = _run(tx, [G, G], [[1.0, 3.0], [1.0, 3.0]])
    _close(outs[0], [0.0, 0.5])  # s = 0: weights 0.5
    # d/ds = 0.5 - 0.5 L = [0, -1] -> s = [0, 1] -> weights [0.5, 0.5 e^-1]
    w1 = 0.5 * np.exp(-1.0)
    _close(outs[1], [0.5 - w1, w1])
    # second step: d/ds = [0, 0.5 - 1.5 e^-1]
    _close(state.log_vars, [0.0, 1.0 - (0.5 - 1.5 * np.exp(-1.0))])


def test_gradnorm():
    tx = ko.gradnorm(alpha=1.5, optimizer=optax.sgd(0.1), num_tasks=2)
    outs, _ = _run(tx, [G, G], [[1.0, 1.0], [1.0, 1.0]])
    _close(outs[0], [0.0, 1.0])
    # G = [1, sqrt2] vs target mean(G): grad_w = [-1, sqrt2] -> w = [1.1, 1 - 0.1 sqrt2],
    # renormalised to sum 2.
    w = np.array([1.1, 1 - 0.1 * np.sqrt(2)])
    w = 2 * w / w.sum()
    _close(outs[1], w[0] * np.array([1.0, 0.0]) + w[1] * np.array([-1.0, 1.0]))


def test_olaux():
    outs, state = _run(ko.olaux(learning_rate=0.5, horizon=1, num_tasks=2), [G, G])
    _close(outs[0], [0.0, 1.0])
    _close(outs[1], [0.5, 0.5])  # w_aux = 1 + 0.5 * (g0 . g1) = 0.5
    outs, state = _run(ko.olaux(learning_rate=0.5, horizon=2, num_tasks=2), [G, G, G])
    _close(outs[1], [0.0, 1.0])  # not updated before N = 2 steps
    _close(outs[2], [1.0, 0.0])  # w_aux = 1 + 0.5 * (-2) = 0: target only


def test_mtadam():
    # Norms start at the first step's: n = [1, sqrt2]; h0 = g0 = [1, 0], h1 = g1 / sqrt2.
    # Bias-corrected, m_t / bc1 = h_t and the denominators are |h_t|; their element-wise
    # max is [1, 1/sqrt2], so the direction is (h0 + h1) / [1, 1/sqrt2] = [1 - 1/sqrt2, 1]
    # at both steps (same gradients, the corrections cancel).
    outs, state = _run(ko.mtadam(num_tasks=2), [G, G])
    _close(outs[0], [1.0 - 2 ** -0.5, 1.0])
    _close(outs[1], [1.0 - 2 ** -0.5, 1.0])
    np.testing.assert_allclose(state.norms["w"], [1.0, np.sqrt(2)], rtol=1e-6)
    # weights (the reference's ranks) scale the normalised gradients: r = [1, 2] doubles h1,
    # whose denominator then wins the max on both coordinates: [1 - sqrt2, sqrt2]/[sqrt2, sqrt2].
    outs, _ = _run(ko.mtadam(weights=[1.0, 2.0], num_tasks=2), [G])
    _close(outs[0], [(1.0 - np.sqrt(2)) / np.sqrt(2), 1.0])
    # A zero anchor norm: the next task with a norm is the anchor, the zero task unscaled.
    zero0 = {"w": jnp.array([[0.0, 0.0], [-3.0, 4.0]])}
    outs, state = _run(ko.mtadam(num_tasks=2), [zero0], present=[[True, True]])
    _close(outs[0], [-1.0, 1.0])
    np.testing.assert_allclose(state.norms["w"], [0.0, 5.0])


@pytest.mark.parametrize("name", ["metabalance", "pcgrad", "mgda", "grad_similarity",
                                  "mtadam", "olaux"])
def test_sparse_rows_equal_dense(name):
    """Balancers give the same update for a table as SparseRows and as dense [T, V, D]."""
    idx = jnp.array([[0, 3, 0], [2, 3, 0]])
    rows = jnp.array([[[1.0, 2.0], [0.5, -1.0], [0.0, 0.0]],
                      [[-2.0, 1.0], [1.0, 1.0], [3.0, 0.0]]])
    sparse = ko.SparseRows(idx, rows, num_rows=4)
    dense = ko.task_gradients.leaf_dense(sparse)
    make = {"metabalance": lambda: ko.metabalance(num_tasks=2),
            "pcgrad": lambda: ko.pcgrad(shuffle=False), "mgda": ko.mgda,
            "grad_similarity": ko.grad_similarity, "mtadam": lambda: ko.mtadam(num_tasks=2),
            "olaux": lambda: ko.olaux(num_tasks=2, horizon=1)}[name]
    params = {"t": jnp.zeros((4, 2))}
    outs = []
    for g in (sparse, dense):
        tx = make()
        state = tx.init(params)
        for _ in range(2):
            out, state = jax.jit(tx.update)(_tg({"t": g}), state, params)
        outs.append(out["t"])
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-6)


def _brute_force_min_norm(gram: np.ndarray, grid: int) -> float:
    """Smallest alpha^T G alpha over a fine simplex grid, refined by the exact solution
    of every support's KKT system in float64 (independent of ktx's solver)."""
    import itertools

    t = gram.shape[0]
    best = np.inf
    for support in itertools.chain.from_iterable(
            itertools.combinations(range(t), k) for k in range(1, t + 1)):
        s = list(support)
        kkt = np.zeros((len(s) + 1, len(s) + 1))
        kkt[:-1, :-1] = gram[np.ix_(s, s)]
        kkt[:-1, -1] = kkt[-1, :-1] = 1.0
        try:
            sol = np.linalg.solve(kkt, np.r_[np.zeros(len(s)), 1.0])[:-1]
        except np.linalg.LinAlgError:
            continue
        if np.all(sol >= -1e-12):
            a = np.zeros(t)
            a[s] = sol
            best = min(best, a @ gram @ a)
    for c in itertools.product(range(grid + 1), repeat=t - 1):
        if sum(c) <= grid:
            a = np.r_[np.array(c), grid - sum(c)] / grid
            best = min(best, a @ gram @ a)
    return best


@pytest.mark.parametrize("tasks", [2, 3, 4])
def test_min_norm_weights_reach_the_true_minimum(tasks):
    """On random Gram matrices (gradients of dimension 2..5, so singular ones too) the
    weights give the brute-force minimum norm; Frank-Wolfe from the uniform point at 100
    iterations was up to 37% above it."""
    rng = np.random.default_rng(tasks)
    worst = 0.0
    for trial in range(25):
        g = rng.normal(size=(tasks, int(rng.integers(2, 6)))) * rng.uniform(0.1, 10, (tasks, 1))
        gram = g @ g.T
        alpha = np.asarray(ko.min_norm_weights(jnp.asarray(gram)), np.float64)
        assert alpha.min() >= 0 and abs(alpha.sum() - 1) < 1e-5
        got = alpha @ gram @ alpha
        want = _brute_force_min_norm(gram, grid=40 if tasks < 4 else 16)
        worst = max(worst, (got - want) / max(want, 1e-3 * np.trace(gram)))
    assert worst < 1e-3, worst


def test_min_norm_weights_iterative_solver_above_the_exact_size():
    rng = np.random.default_rng(0)
    g = rng.normal(size=(12, 30))
    gram = g @ g.T
    alpha = np.asarray(ko.min_norm_weights(jnp.asarray(gram)), np.float64)
    got = alpha @ gram @ alpha
    # Reference: float64 projected gradient run to convergence.
    x = np.full(12, 1 / 12)
    step = 1 / (2 * np.linalg.eigvalsh(gram).max())
    for _ in range(200_000):
        v = x - step * 2 * gram @ x
        u = np.sort(v)[::-1]
        css = np.cumsum(u) - 1
        rho = np.nonzero(u - css / np.arange(1, 13) > 0)[0][-1]
        x = np.maximum(v - css[rho] / (rho + 1), 0)
    assert got <= x @ gram @ x * (1 + 1e-3) + 1e-6


# --- per-task gradients are explicit -------------------------------------------------

PLAIN_FACTORIES = {
    "metabalance": lambda: ko.metabalance(num_tasks=2),
    "single_loss": ko.single_loss,
    "vanilla_multi": ko.vanilla_multi,
    "fixed_weights": lambda: ko.fixed_weights([1.0, 1.0]),
    "uncertainty": lambda: ko.uncertainty(num_tasks=2),
    "dwa": lambda: ko.dwa(num_tasks=2),
    "gradnorm": lambda: ko.gradnorm(num_tasks=2),
    "mgda": ko.mgda,
    "mtadam": lambda: ko.mtadam(num_tasks=2),
    "grad_similarity": ko.grad_similarity,
    "pcgrad": ko.pcgrad,
    "olaux": lambda: ko.olaux(num_tasks=2),
}


@pytest.mark.parametrize("name", sorted(ko.BALANCERS))
def test_plain_tree_is_a_type_error_naming_from_stacked(name):
    """A plain gradient tree whose leaves start with T (here a [2, 2] kernel for 2 tasks)
    is not taken for per-task gradients; wrapped with from_stacked it is accepted."""
    params = {"kernel": jnp.zeros((2, 2))}
    plain = {"kernel": jnp.ones((2, 2))}
    tx = PLAIN_FACTORIES[name]()
    state = tx.init(params)
    losses = jnp.array([1.0, 2.0])
    with pytest.raises(TypeError, match=r"TaskGradients\.from_stacked"):
        tx.update(plain, state, params, task_losses=losses)
    stacked = {"kernel": jnp.ones((2, 2, 2))}
    out, _ = tx.update(ko.TaskGradients.from_stacked(stacked), state, params, task_losses=losses)
    assert out["kernel"].shape == (2, 2)


def test_from_stacked_rejects_leaves_without_a_task_axis():
    with pytest.raises(ValueError, match="leading task axis"):
        ko.TaskGradients.from_stacked({"w": jnp.float32(1.0)})


# --- the Gram matrix of sparse rows ---------------------------------------------------

def _walk_avals(jaxpr):
    """Every intermediate's abstract value, nested jaxprs (lax.map's scan body) included."""
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            yield v.aval
        for p in eqn.params.values():
            for sub in p if isinstance(p, (list, tuple)) else [p]:
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    yield from _walk_avals(sub)


def test_sparse_gram_equals_dense_and_builds_no_table():
    rng = np.random.default_rng(0)
    idx = jnp.asarray(rng.integers(0, 6, size=(3, 5)), jnp.int32)  # duplicates included
    rows = jnp.asarray(rng.normal(size=(3, 5, 2)), jnp.float32)
    sparse = ko.SparseRows(idx, rows, num_rows=6)
    dense = np.asarray(ko.task_gradients.leaf_dense(sparse)).reshape(3, -1)
    got = jax.jit(ko.task_gradients.leaf_gram)(sparse)
    np.testing.assert_allclose(got, dense @ dense.T, rtol=1e-5, atol=1e-5)

    # A table of 2^31 - 1 rows x 8 (64 GiB as a float32 array): the Gram, PCGrad's and
    # MGDA's weights and the diagnostics are computed from the 6 rows; no intermediate in
    # the compiled program has a table-sized (or even 1M-element) shape.
    big = ko.SparseRows(jnp.array([[5, 2**31 - 2, 5], [2**31 - 2, 7, 0]], jnp.int32),
                        jnp.arange(48, dtype=jnp.float32).reshape(2, 3, 8) / 10,
                        num_rows=2**31 - 1)
    r = np.asarray(big.rows, np.float64)
    want = np.array([[np.sum((r[0, 0] + r[0, 2]) ** 2) + r[0, 1] @ r[0, 1],
                      r[0, 1] @ r[1, 0]], [0.0, np.sum(r[1] ** 2)]])
    want[1, 0] = want[0, 1]
    np.testing.assert_allclose(jax.jit(ko.task_gradients.leaf_gram)(big), want, rtol=1e-5)
    jaxpr = jax.make_jaxpr(ko.task_gradients.leaf_gram)(big).jaxpr
    largest = max(int(np.prod(a.shape)) for a in _walk_avals(jaxpr) if hasattr(a, "shape"))
    assert largest < 1_000, largest
    d = jax.jit(ko.diagnostics)(ko.TaskGradients.from_stacked({"t": big}))
    np.testing.assert_allclose(d["grad_norm/t/task1"], np.sqrt(want[1, 1]), rtol=1e-5)


def test_sparse_gram_by_sort_equals_by_search():
    # Both lowerings of the sparse Gram (`lax.platform_dependent` picks the sort on GPUs,
    # the binary search elsewhere) on rows laid out as the engine builds them: each task
    # sorted and merged, free slots (zero rows) at num_rows - 1, where task 1 also has a
    # real row, and a task whose rows are all zero.
    from ktx.optim.task_gradients import _gram_by_search, _gram_by_sort

    rng = np.random.default_rng(0)
    t, n, d, num_rows = 4, 7, 3, 9
    idx = np.full((t, n), num_rows - 1, np.int32)
    rows = np.zeros((t, n, d), np.float32)
    for task, ids in enumerate([[0, 2, 5], [2, 5, 8], [1, 2, 3, 4, 5, 6], []]):
        idx[task, :len(ids)] = ids
        rows[task, :len(ids)] = rng.normal(size=(len(ids), d))
    x = ko.SparseRows(jnp.asarray(idx), jnp.asarray(rows), num_rows=num_rows, sorted_unique=True)
    dense = np.asarray(ko.task_gradients.leaf_dense(x), np.float64).reshape(t, -1)
    want = dense @ dense.T
    for fn in (_gram_by_sort, _gram_by_search):
        got = jax.jit(fn)(x.indices, x.rows)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=fn.__name__)

    # Several tables in one sort (GPUs): indices offset past the previous tables, rows
    # zero-padded to the widest; the sum of the tables' Grams.
    from ktx.optim.task_gradients import _joined, with_merged_rows

    other = ko.SparseRows(jnp.asarray(rng.integers(0, 4, (t, 5)), jnp.int32),
                          jnp.asarray(rng.normal(size=(t, 5, 2)), jnp.float32), num_rows=4)
    dense_other = np.asarray(ko.task_gradients.leaf_dense(other), np.float64).reshape(t, -1)
    idx_all, rows_all, _ = _joined([x, with_merged_rows(other)])
    got = _gram_by_sort(idx_all, rows_all)
    np.testing.assert_allclose(got, want + dense_other @ dense_other.T, rtol=1e-5, atol=1e-6)


def test_sparse_pairwise_forms_equal_the_dense_ones(monkeypatch):
    # The GPU lowering of `sparse_sq_norms` and of the sparse Gram while rows are few
    # (`lax.platform_dependent`; a CPU runs the merge): every pair of rows of equal index,
    # on rows with duplicates inside each task (one row per lookup, as the engine gives
    # them), two tables of different widths joined into one, a task with only zero rows.
    from ktx.optim import task_gradients as tg

    rng = np.random.default_rng(1)
    t = 3
    a = ko.SparseRows(jnp.asarray(rng.integers(0, 5, (t, 9)), jnp.int32),
                      jnp.asarray(rng.normal(size=(t, 9, 4)), jnp.float32), num_rows=5)
    b_rows = rng.normal(size=(t, 6, 2)).astype(np.float32)
    b_rows[2] = 0.0
    b = ko.SparseRows(jnp.asarray(rng.integers(0, 3, (t, 6)), jnp.int32), jnp.asarray(b_rows),
                      num_rows=3)
    for x in (a, b):
        assert any(len(set(np.asarray(x.indices[k]).tolist())) < x.indices.shape[1]
                   for k in range(t))
    dense = [np.asarray(tg.leaf_dense(x), np.float64).reshape(t, -1) for x in (a, b)]
    idx, rows, bounds = tg._joined([a, b])
    assert bounds == [0, 9, 15] and rows.shape == (t, 15, 4)
    per_row = tg._pairwise_sq_norms(idx, rows)
    for k, d in enumerate(dense):
        np.testing.assert_allclose(per_row[:, bounds[k]:bounds[k + 1]].sum(1), (d * d).sum(1),
                                   rtol=1e-5)
    want = sum(d @ d.T for d in dense)
    np.testing.assert_allclose(tg._pairwise_gram(idx, rows), want, rtol=1e-5, atol=1e-6)
    # The entry points as this machine lowers them (the merge), and as a GPU does.
    from tests.optim.test_mtadam_sparse import gpu_forms

    for forms in ("this_machine", "gpu"):
        if forms == "gpu":
            gpu_forms(monkeypatch)
        np.testing.assert_allclose(tg.global_gram([a, None, b]), want, rtol=1e-5, atol=1e-6)
        for got, d in zip(tg.sparse_sq_norms([a, b]), dense):
            np.testing.assert_allclose(got, (d * d).sum(1), rtol=1e-5)
        u = tg.unique_rows(a)
        np.testing.assert_allclose(tg.leaf_dense(u), tg.leaf_dense(a), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(jnp.sum(jnp.square(u.rows), axis=(1, 2)), (dense[0] ** 2).sum(1),
                                   rtol=1e-5)
        for k in range(t):  # one non-zero row per index
            live = np.asarray(u.indices[k])[np.abs(np.asarray(u.rows[k])).sum(-1) > 0]
            assert len(set(live.tolist())) == len(live), forms
    m = tg.with_merged_rows(a)
    np.testing.assert_allclose(tg._pairwise_gram(m.indices, m.rows.astype(jnp.float32)),
                               dense[0] @ dense[0].T, rtol=1e-5, atol=1e-6)


def test_batched_norms_and_gram_equal_the_per_leaf_ones(monkeypatch):
    # `sq_norms` and `global_gram` reduce the dense leaves together (chunked, padded,
    # concatenated); `leaf_combine` writes out the weighted sum up to 16 tasks. Each equals
    # its one-leaf-at-a-time form, on leaves of every kind: [T] scalars, a leaf of one
    # chunk exactly, ragged ones, a large one (its own GEMM), SparseRows and None.
    from ktx.optim import task_gradients as tg

    monkeypatch.setattr(tg, "NORM_CHUNK", 8)
    monkeypatch.setattr(tg, "BATCH_MAX_ELEMENTS", 40)
    rng = np.random.default_rng(0)
    t = 3
    leaves = [jnp.asarray(rng.normal(size=shape), jnp.float32)
              for shape in [(t,), (t, 8), (t, 3, 5), (t, 50), (t, 2, 2, 3)]]
    sparse = ko.SparseRows(jnp.asarray(rng.integers(0, 5, (t, 4)), jnp.int32),
                           jnp.asarray(rng.normal(size=(t, 4, 2)), jnp.float32), num_rows=5)
    mixed = [leaves[0], None, sparse, *leaves[1:]]
    got = jax.jit(tg.sq_norms)(mixed)
    for g, x in zip(got, mixed):
        if x is None:
            assert g is None
        else:
            np.testing.assert_allclose(g, tg.leaf_sq_norms(x), rtol=1e-6)
    want = sum(np.asarray(tg.leaf_gram(x), np.float64) for x in mixed if x is not None)
    np.testing.assert_allclose(jax.jit(tg.global_gram)(mixed), want, rtol=1e-5, atol=1e-6)

    for tasks in (3, 16, 17):
        x = jnp.asarray(rng.normal(size=(tasks, 4, 5)), jnp.float32)
        w = jnp.asarray(rng.normal(size=tasks), jnp.float32)
        np.testing.assert_allclose(tg.leaf_combine(x, w), np.tensordot(np.asarray(w), np.asarray(x), 1),
                                   rtol=1e-5, atol=1e-6)


# --- absent tasks ---------------------------------------------------------------------

ABSENT1 = {"w": jnp.array([[1.0, 0.0], [0.0, 0.0]])}  # task 1 has no rows: zero gradient


def test_uncertainty_absent_task_keeps_its_log_variance():
    tx = ko.uncertainty(learning_rate=0.1, num_tasks=2)
    outs, state = _run(tx, [G, ABSENT1], [[2.0, 3.0], [2.0, 0.0]])
    _, ref = _run(tx, [G], [[2.0, 3.0]])
    np.testing.assert_array_equal(state.log_vars[1], ref.log_vars[1])  # not pushed down
    assert state.log_vars[0] != ref.log_vars[0]
    np.testing.assert_array_equal(state.opt_state[0].mu[1], ref.opt_state[0].mu[1])
    # Explicit presence wins: the same gradients but task 1 marked absent.
    _, explicit = _run(tx, [G, G], [[2.0, 3.0], [2.0, 3.0]], present=[[1, 1], [1, 0]])
    np.testing.assert_array_equal(explicit.log_vars[1], ref.log_vars[1])


def test_dwa_absent_task_keeps_its_loss_history():
    losses = [[1.0, 1.0], [0.5, 0.8], [0.4, 0.0], [0.2, 0.4]]
    outs, state = _run(ko.dwa(temperature=1.0, num_tasks=2), [G, G, ABSENT1, G], losses)
    # Task 1's history is (0.8, 1.0) from steps 0-1, then 0.4 at step 3; no 0 entered it.
    np.testing.assert_allclose(state.last, [0.2, 0.4])
    np.testing.assert_allclose(state.before_last, [0.4, 0.8])
    np.testing.assert_array_equal(state.observed, [4, 3])
    # Step 3's weights: ratios 0.4/0.5 (task 0) and 0.8/1.0 (task 1, its last two losses).
    w = 2 * np.exp([0.8, 0.8]) / np.exp([0.8, 0.8]).sum()
    _close(outs[3], w[0] * np.array([1.0, 0.0]) + w[1] * np.array([-1.0, 1.0]))
    # A task first seen late has ratio 1 until it has two observed losses.
    _, s2 = _run(ko.dwa(num_tasks=2), [ABSENT1, G, G], [[1.0, 0.0], [0.5, 2.0], [0.5, 1.0]])
    np.testing.assert_array_equal(s2.observed, [3, 2])


def test_gradnorm_absent_task():
    """Initial loss from the first present step; an absent task's weight is untouched and
    the present ones keep their total; the GradNorm loss averages over present tasks."""
    tx = ko.gradnorm(alpha=1.5, optimizer=optax.sgd(0.1), num_tasks=3)
    g3 = {"w": jnp.array([[1.0, 0.0], [0.0, 0.0], [0.0, 2.0]])}
    params = PARAMS
    state = tx.init(params)
    _, state = jax.jit(tx.update)(_tg(g3), state, params, task_losses=jnp.array([1.0, 0.0, 1.0]))
    np.testing.assert_array_equal(state.has_initial, [True, False, True])
    assert float(state.weights[1]) == 1.0
    np.testing.assert_allclose(float(state.weights.sum()), 3.0, rtol=1e-6)
    # Present tasks: G = [1, 2], mean 1.5, ratios 1 -> grad_w = [-1, 2] -> [1.1, 0.8],
    # renormalised to their previous total 2.
    np.testing.assert_allclose(state.weights[jnp.array([0, 2])],
                               2 * np.array([1.1, 0.8]) / 1.9, rtol=1e-6)
    g_all = {"w": jnp.array([[1.0, 0.0], [0.0, 1.0], [0.0, 2.0]])}
    _, state = jax.jit(tx.update)(_tg(g_all), state, params,
                                  task_losses=jnp.array([0.5, 4.0, 1.0]))
    np.testing.assert_allclose(state.initial_losses, [1.0, 4.0, 1.0])


def test_olaux_absent_task_adds_no_alignment():
    tx = ko.olaux(learning_rate=0.5, horizon=3, num_tasks=2)
    _, state = _run(tx, [G, G], present=[[1, 0], [0, 1]])
    np.testing.assert_array_equal(state.dots, [1.0, 0.0])  # g1 never with the target
    _, state = _run(tx, [G, G])
    np.testing.assert_allclose(state.dots, [2.0, -2.0])


def test_mtadam_absent_task_keeps_its_running_norm():
    tx = ko.mtadam(b3=0.5, num_tasks=2)
    outs, state = _run(tx, [G, ABSENT1])
    np.testing.assert_allclose(state.norms["w"], [1.0, np.sqrt(2)], rtol=1e-6)
    np.testing.assert_array_equal(state.seen, [2, 1])
    _, state = _run(tx, [G, G], present=[[1, 1], [1, 0]])
    np.testing.assert_allclose(state.norms["w"], [1.0, np.sqrt(2)], rtol=1e-6)
    # A task absent at its first step starts its norm at its first present step.
    _, state = _run(tx, [ABSENT1, G])
    np.testing.assert_allclose(state.norms["w"], [1.0, np.sqrt(2)], rtol=1e-6)


# --- task counts, indices, learning rates ---------------------------------------------

@pytest.mark.parametrize("name,make", [
    ("uncertainty", lambda: ko.uncertainty(num_tasks=3)),
    ("dwa", lambda: ko.dwa(num_tasks=3)),
    ("gradnorm", lambda: ko.gradnorm(num_tasks=3)),
    ("olaux", lambda: ko.olaux(num_tasks=3)),
    ("mtadam", lambda: ko.mtadam(num_tasks=3)),
])
def test_task_count_mismatch_is_a_clear_error(name, make):
    tx = make()
    state = tx.init(PARAMS)
    with pytest.raises(ValueError, match=rf"{name}: .*3 tasks.* 2; .*{name}\(num_tasks=2\)"):
        tx.update(_tg(G), state, PARAMS, task_losses=jnp.array([1.0, 1.0]))


def test_task_indices_accept_any_integer_type():
    for idx in (np.int64(1), np.int32(1), jnp.int32(1)):
        _close(_run(ko.single_loss(idx), [G])[0][0], [-1.0, 1.0])
        _close(_run(ko.grad_similarity(target_task=idx), [G])[0][0], [-1.0, 1.0])
        _close(_run(ko.pcgrad(anchor=idx), [G])[0][0], [-0.5, 1.5])
        _close(_run(ko.olaux(target_task=idx, num_tasks=2), [G])[0][0], [0.0, 1.0])
        _run(ko.mtadam(anchor=idx, num_tasks=2), [G])
    for bad in (True, 1.0, "0", -1):
        with pytest.raises((TypeError, ValueError), match="target_task"):
            ko.single_loss(bad)
    with pytest.raises(ValueError, match="target_task=2 but num_tasks=2"):
        _run(ko.single_loss(np.int64(2)), [G])


def test_inject_hyperparams():
    """Numeric hyper-parameters (target_task, learning rates, betas) arrive as arrays
    (traced inside jit) under optax.inject_hyperparams."""
    cases = [
        (optax.inject_hyperparams(ko.single_loss)(target_task=1), [-1.0, 1.0]),
        (optax.inject_hyperparams(ko.olaux)(learning_rate=0.5, horizon=1, target_task=0,
                                            num_tasks=2), [0.0, 1.0]),
        (optax.inject_hyperparams(ko.grad_similarity)(target_task=0), [1.0, 0.0]),
        (optax.inject_hyperparams(ko.mtadam)(b1=0.9, anchor=0, num_tasks=2),
         [1.0 - 2 ** -0.5, 1.0]),
        (optax.inject_hyperparams(ko.uncertainty)(learning_rate=0.1, num_tasks=2), [0.0, 0.5]),
    ]
    for tx, want in cases:
        outs, _ = _run(tx, [G, G], [[1.0, 1.0], [1.0, 1.0]])
        _close(outs[0], want)


def test_negative_learning_rates_are_rejected():
    with pytest.raises(ValueError, match=r"uncertainty: learning_rate=-0\.1"):
        ko.uncertainty(learning_rate=-0.1)
    with pytest.raises(ValueError, match=r"gradnorm: learning_rate=-1"):
        ko.gradnorm(learning_rate=-1)
    with pytest.raises(ValueError, match=r"olaux: learning_rate=-0\.5"):
        ko.olaux(learning_rate=-0.5)


def test_mgda_leaves_absent_tasks_out_of_the_simplex():
    """An absent task's zero gradient would be the min-norm point (update 0)."""
    g3 = {"w": jnp.array([[1.0, 0.0], [0.0, 0.0], [-1.0, 1.0]])}
    state = ko.mgda().init(PARAMS)
    out, _ = jax.jit(ko.mgda().update)(_tg(g3), state, PARAMS)
    _close(out["w"], [0.2, 0.4])  # as with tasks 0 and 2 alone (test_mgda)
    out, _ = jax.jit(ko.mgda().update)(_tg(g3), state, PARAMS,
                                       task_present=jnp.array([True, True, True]))
    _close(out["w"], [0.0, 0.0])  # marked present: its zero gradient is the minimum
    gram = jnp.asarray(np.diag([1.0, 2.0, 3.0] * 4), jnp.float32)  # iterative solver (12)
    allowed = jnp.arange(12) % 3 == 1
    w = np.asarray(ko.min_norm_weights(gram, allowed=allowed))
    assert w[~np.asarray(allowed)].max() == 0.0 and abs(w.sum() - 1) < 1e-5


def test_batched_reductions_stay_leaf_by_leaf_on_a_mesh():
    # Concatenating leaves of different shardings makes XLA reshard them every step, so on
    # a mesh of several devices `sq_norms` and `global_gram` reduce leaf by leaf (the same
    # values); with no mesh they concatenate the small leaves.
    import re

    from jax.sharding import NamedSharding, PartitionSpec as P

    from ktx import partitioning
    from ktx.optim import task_gradients as tg

    mesh = partitioning.create_mesh(2, devices=jax.devices()[:8])
    rng = np.random.default_rng(0)
    specs = [P(None, "model", None), P(None, None, "model"), P(None, "data", "model"), P()]
    shapes = [(4, 8, 6), (4, 6, 8), (4, 8, 4), (4, 3)]
    leaves = [jax.device_put(jnp.asarray(rng.normal(size=s), jnp.float32), NamedSharding(mesh, p))
              for s, p in zip(shapes, specs)]

    def both(xs):
        return tg.sq_norms(xs), tg.global_gram(xs)

    want_sq = [np.sum(np.asarray(x, np.float64) ** 2, axis=tuple(range(1, x.ndim))) for x in leaves]
    flat = np.concatenate([np.asarray(x, np.float64).reshape(4, -1) for x in leaves], axis=1)
    with jax.set_mesh(mesh):
        compiled = jax.jit(both).lower(leaves).compile()
        sq, gram = compiled(leaves)
    text = compiled.as_text()
    assert not re.search(r" (all-to-all|collective-permute)(-start)?\(", text)
    for got, want in zip(sq, want_sq):
        np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(gram, flat @ flat.T, rtol=1e-5)
    unsharded = jax.jit(both).lower([np.asarray(x) for x in leaves]).as_text()
    assert "concatenate" in unsharded
