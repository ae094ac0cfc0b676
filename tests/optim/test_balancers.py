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
