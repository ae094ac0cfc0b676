"""MTAdam on table gradients given as `SparseRows`: the row-sparse step (only looked-up
rows of the moments are written; the others decay through `row_step`) is the same
algorithm as the dense step, to float32 rounding, and reproduces the authors' fixture."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import ktx.optim as ko
from tests.optim.test_mtadam_reference import _cases, _tree


def _rows_of(dense: np.ndarray, rng: np.random.Generator) -> ko.SparseRows:
    """`[T, V, D]` -> SparseRows holding each task's non-zero rows, each split in two rows
    of the same index (as the engine gives a row looked up twice), shuffled, padded with
    zero rows at index 0."""
    t, v, d = dense.shape
    idx = np.zeros((t, 2 * v), np.int32)
    rows = np.zeros((t, 2 * v, d), np.float32)
    for k in range(t):
        nz = np.flatnonzero(np.abs(dense[k]).sum(-1) > 0)
        part = rng.normal(size=(nz.size, d)).astype(np.float32)
        both = np.concatenate([nz, nz])
        order = rng.permutation(both.size)
        idx[k, :both.size] = both[order]
        rows[k, :both.size] = np.concatenate([part, dense[k, nz] - part])[order]
    return ko.SparseRows(jnp.asarray(idx), jnp.asarray(rows), num_rows=v)


def gpu_forms(monkeypatch):
    """Lowers every `lax.platform_dependent` as a GPU would (its `cuda` branch), here."""

    def pick(*args, cuda=None, default=None, **_):
        return cuda(*args)

    monkeypatch.setattr(jax.lax, "platform_dependent", pick)


@pytest.mark.parametrize("forms", ["this_machine", "gpu"])
def test_row_sparse_step_reproduces_the_authors_updates(forms, monkeypatch):
    if forms == "gpu":
        gpu_forms(monkeypatch)
    rng = np.random.default_rng(0)
    worst = 0.0
    for n, case in enumerate(_cases()):
        if case["weight_decay"]:
            continue  # weight decay touches every row: the table is densified
        b1, b2, b3 = case["betas"]
        tx = optax.chain(
            ko.mtadam(b1=b1, b2=b2, b3=b3, weights=case["ranks"], num_tasks=case["num_tasks"]),
            optax.scale_by_learning_rate(case["learning_rate"]))
        params = _tree(case["steps"][0]["params_before"])
        state = tx.init(params)
        update = jax.jit(tx.update)
        for i, step in enumerate(case["steps"]):
            grads = _tree(step["task_grads"])
            grads["embed"] = _rows_of(np.asarray(grads["embed"]), rng)
            out, state = update(ko.TaskGradients.from_stacked(grads), state,
                                _tree(step["params_before"]))
            scale = max(np.abs(np.asarray(v, np.float32)).max() for v in step["update"].values())
            for k, want in step["update"].items():
                err = float(np.abs(np.asarray(out[k]) - np.asarray(want, np.float32)).max()) / scale
                worst = max(worst, err)
                assert err < 1e-5, f"case {n} step {i} {k}: error {err:.2e} of the largest update"
    print(f"largest error (of the largest update): {worst:.2e}")


@pytest.mark.parametrize("forms", ["this_machine", "gpu"])
def test_row_sparse_equals_dense_when_rows_skip_steps(forms, monkeypatch):
    """Rows untouched for several steps (decayed lazily), tasks touching different and
    shared rows, rows looked up twice, an absent task, unshared parameters beside the
    table; the duplicates merged as this machine lowers it, and as a GPU does."""
    if forms == "gpu":
        gpu_forms(monkeypatch)
    t, v, d, steps = 3, 12, 4, 9
    rng = np.random.default_rng(1)
    params = {"table": jnp.zeros((v, d)), "head": jnp.zeros((d,))}
    dense_tx = ko.mtadam(b1=0.8, b2=0.95, b3=0.5, weights=[1.0, 0.5, 2.0], num_tasks=t)
    states = [dense_tx.init(params), dense_tx.init(params)]
    update = jax.jit(dense_tx.update)
    for step in range(steps):
        dense = np.zeros((t, v, d), np.float32)
        for k in range(t):
            if step % 4 == 3 and k == 2:
                continue  # task 2 absent
            touched = rng.choice(v // 2 if k == 0 else v, size=3, replace=False)
            dense[k, touched] = rng.normal(size=(3, d))
        head = jnp.asarray(rng.normal(size=(d,)), jnp.float32)
        outs = []
        for i, table in enumerate((jnp.asarray(dense), _rows_of(dense, rng))):
            tg = ko.TaskGradients(stacked={"head": None, "table": table},
                                  summed={"head": head, "table": None})
            out, states[i] = update(tg, states[i], params)
            outs.append(out)
        for key in params:
            np.testing.assert_allclose(outs[1][key], outs[0][key], rtol=2e-5, atol=1e-6,
                                       err_msg=f"step {step} {key}")
    # Rows last written at different steps: the lazy state differs, the moments agree.
    last = np.asarray(states[1].row_step["table"])
    assert len(set(last.tolist())) > 1
    age = steps - last
    for name, beta in (("mu", 0.8), ("nu_max", 0.95)):
        lazy = np.asarray(getattr(states[1], name)["table"]) * (beta ** age)[:, None]
        np.testing.assert_allclose(lazy, getattr(states[0], name)["table"], rtol=2e-5, atol=1e-7)
