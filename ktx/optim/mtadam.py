"""MTAdam (Malkiel and Wolf, 2021): Adam with per-loss moments, anchored on one loss.

What the authors' PyTorch `MTAdam` computes, per parameter tensor and task t, at step k
(`r_t` the per-loss weight, the reference's `ranks`; `lambda` the weight decay):

    n_t  = ||g_t||                                   at the task's first step
    n_t <- b3 n_t + (1 - b3) ||g_t||                 afterwards
    a    = the anchor if n_anchor > 1e-10, else the first task (by index) with n > 1e-10
    h_t  = r_t n_a g_t / n_t  if n_t > 1e-10,  else g_t;   h_t <- h_t + lambda * param
    m_t <- b1 m_t + (1 - b1) h_t ;  v_t <- b2 v_t + (1 - b2) h_t^2
    d_t  = sqrt(v_t) / sqrt(1 - b2^k) + eps
    direction = sum_t m_t / (1 - b1^k) / max_t d_t          (element-wise max over tasks)

MTAdam is itself the optimizer: chain it with a learning rate only, e.g.
`optax.chain(ktx.optim.mtadam(), optax.scale_by_learning_rate(1e-3))` (the reference's
step is `-lr * direction`). Unshared parameters take one Adam step on their summed
gradient (second moment in task slot 0).

State, per parameter tensor (the same algorithm, stored so that no step has to touch
`[T, *param]` more than the method needs):

* `mu [*param]`: the *sum over tasks* of the first moments (the direction only uses
  that sum, and the moment update is linear: `sum_t m_t <- b1 sum_t m_t + (1-b1) sum_t h_t`);
* `nu [T, *param]`: every task's second moment (the element-wise max needs each);
* `nu_max [*param]`: `max_t nu_t`;
* `row_step [param.shape[0]]`: the step at which each row (along the first axis) was last
  written. A row's true moments are `b1^(k - row_step) mu`, `b2^(k - row_step) nu` at step
  k: a row no task's gradient touched decays without being written.

A table's gradient given as `SparseRows` (the trainer's `sparse_tables`) is therefore
applied *row-sparsely and exactly*: the reference's moments of a row with zero gradient
only decay (`h = 0` there), so only the looked-up rows of `mu`, `nu`, `nu_max` are
rescaled to step k and updated (`O(T * rows looked up * dim)`), and the direction
`b1^age mu / bc1 / (sqrt(b2^age nu_max) / sqrt(bc2) + eps)` is one pass over `[rows, dim]`,
like Adam's. This needs `weight_decay == 0` (with it, every element's `h` is non-zero every
step): with weight decay the rows are densified and every element is updated, as the
reference does. Results agree with the dense form to float32 rounding.

A task absent from the batch (`task_present=` from the trainer, else every one of its
shared gradients exactly zero) keeps its running norms: a zero norm says nothing about
the scale of its gradients, and averaging it in would inflate `n_a / n_t` when the task
comes back. Its moments advance as the reference's would with a zero gradient (Adam's
momentum decays; weight decay still applies), and it stays a candidate anchor with the
norm it had. A task's norm starts at its first *present* step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from ktx.optim.num_tasks import (
    check_state_tasks,
    check_task_index,
    non_negative,
    present_tasks,
    resolve_num_tasks,
    task_index,
)
from ktx.optim.task_gradients import (
    SparseRows,
    flatten_task_gradients,
    leaf_dense,
    num_tasks_of,
    sq_norms,
    task_max,
    task_sum,
    unique_rows,
)

__all__ = ["MTAdamState", "mtadam", "ANCHOR_THRESHOLD"]

# The reference treats a running norm at or below this as zero (no anchor, no scaling).
ANCHOR_THRESHOLD = 1e-10


class MTAdamState(NamedTuple):
    count: jax.Array  # [] steps taken
    seen: jax.Array  # [T] int32 steps each task was present (its norm starts at the first)
    norms: Any  # params-structured [T] running gradient norms
    mu: Any  # params-structured [*param]: sum over tasks of the first moments
    nu: Any  # params-structured [T, *param]: per-task second moments
    nu_max: Any  # params-structured [*param]: max over tasks of nu
    row_step: Any  # params-structured int32 [param.shape[0]] ([] for a scalar): last write


def _bias_correction(beta: float, count: jax.Array) -> jax.Array:
    """`1 - beta^count` without float32 cancellation (`1 - 0.999f` is 1.3e-5 off; the
    reference computes it in double): `-expm1(count * log(beta))`."""
    if isinstance(beta, jax.core.Tracer):  # optax.inject_hyperparams
        log_beta = jnp.log(jnp.asarray(beta, jnp.float32))
    elif float(beta) == 0.0:
        return jnp.ones([], jnp.float32)
    else:
        log_beta = math.log(float(beta))
    return -jnp.where(count > 0, jnp.expm1(count.astype(jnp.float32) * log_beta), -1.0)


def _decay(beta: Any, age: jax.Array) -> jax.Array:
    """`beta^age` for integer ages >= 0 (exactly `beta` at age 1, the every-step case)."""
    beta = jnp.asarray(beta, jnp.float32)
    powered = jnp.exp(jnp.maximum(age, 1).astype(jnp.float32) * jnp.log(beta))
    return jnp.where(age == 1, beta, jnp.where(age <= 0, 1.0, powered))


def _rows(x: jax.Array, ndim: int) -> jax.Array:
    """A per-row factor `[rows]` shaped to broadcast against `[rows, ...]` (ndim dims)."""
    return x.reshape(x.shape + (1,) * (ndim - x.ndim))


def _check_weights(weights: Sequence[float] | None) -> tuple[float, ...] | None:
    if weights is None:
        return None
    try:
        w = tuple(float(x) for x in weights)
    except (TypeError, ValueError) as e:
        raise TypeError(f"mtadam: weights={weights!r}; expected a list of numbers") from e
    if not w or any(not x >= 0 for x in w):
        raise ValueError(f"mtadam: weights={weights!r}; expected numbers >= 0, one per task")
    return w


def mtadam(
    b1: float = 0.9,
    b2: float = 0.999,
    b3: float = 0.9,
    eps: float = 1e-8,
    anchor: int = 0,
    weights: Sequence[float] | None = None,
    weight_decay: float = 0.0,
    num_tasks: int | None = None,
) -> optax.GradientTransformationExtraArgs:
    """MTAdam's direction (before the learning rate); see the module docstring.

    Args:
      b1, b2: Adam's moment decays; b3: decay of the running gradient norms.
      eps: added to each task's denominator.
      anchor: the task whose running norm every other task is scaled to (when its norm
        is ~0 the first task, by index, with a norm above 1e-10 takes its place).
      weights: per-loss weights `r_t` (the reference's `ranks`), one per task; None: 1.
      weight_decay: `lambda` (L2, added to every task's normalised gradient); needs
        `params` in `update`.
      num_tasks: T; required by `init` (gin: `%NUM_TASKS`).
    """
    for name, v in (("b1", b1), ("b2", b2), ("b3", b3)):
        if not isinstance(v, jax.core.Tracer) and not 0.0 <= float(v) < 1.0:
            raise ValueError(f"mtadam: {name}={v!r}; accepted: [0, 1)")
    non_negative(eps, "eps", "mtadam")
    non_negative(weight_decay, "weight_decay", "mtadam")
    anchor = task_index(anchor, "anchor", "mtadam")
    ranks = _check_weights(weights)

    def _ranks(t: int) -> jax.Array:
        if ranks is None:
            return jnp.ones((t,), jnp.float32)
        if len(ranks) != t:
            raise ValueError(f"mtadam: {len(ranks)} weights {list(ranks)} but num_tasks={t}")
        return jnp.asarray(ranks, jnp.float32)

    def init_fn(params):
        t = resolve_num_tasks(num_tasks, "mtadam")
        params = nn.meta.unbox(params)  # [T]-shaped state takes no logical axes
        check_task_index(anchor, t, "anchor", "mtadam")
        _ranks(t)
        return MTAdamState(
            jnp.zeros([], jnp.int32),
            jnp.zeros((t,), jnp.int32),
            jax.tree.map(lambda _: jnp.zeros((t,), jnp.float32), params),
            jax.tree.map(lambda p: jnp.zeros(p.shape, p.dtype), params),
            jax.tree.map(lambda p: jnp.zeros((t,) + p.shape, p.dtype), params),
            jax.tree.map(lambda p: jnp.zeros(p.shape, p.dtype), params),
            jax.tree.map(lambda p: jnp.zeros(p.shape[:1], jnp.int32), params),
        )

    def update_fn(updates, state, params=None, *, task_present=None, **extra):
        del extra
        stacked, summed, treedef = flatten_task_gradients(updates, "mtadam")
        # `nu` takes h^2 of each task's whole row: one row per task and index, here.
        stacked = [unique_rows(s) if isinstance(s, SparseRows) else s for s in stacked]
        t = num_tasks_of(stacked)
        check_state_tasks("mtadam", state.seen.shape[0], t)
        check_task_index(anchor, t, "anchor", "mtadam")
        r = _ranks(t)
        decay = isinstance(weight_decay, jax.core.Tracer) or float(weight_decay) != 0.0
        if decay:
            if params is None:
                raise ValueError("mtadam: weight_decay needs params= in update")
            p_leaves = jax.tree.leaves(nn.meta.unbox(params))
        else:
            p_leaves = [None] * len(stacked)
        # Every dense leaf's per-task squared norms at once (one reduction, not one each);
        # a table's, the sum of its (unique) rows' squares.
        all_sq = [jnp.sum(jnp.square(s.rows.astype(jnp.float32)), axis=(1, 2))
                  if isinstance(s, SparseRows) else sq
                  for s, sq in zip(stacked, sq_norms(
                      [None if isinstance(s, SparseRows) else s for s in stacked]))]
        known = [sq for sq in all_sq if sq is not None]
        present = present_tasks(task_present, t, "mtadam", sum(known[1:], known[0]) > 0)
        first = state.seen == 0
        count = state.count + 1
        bc1 = _bias_correction(b1, count)
        bc2 = _bias_correction(b2, count)
        # Anchor candidates in order: the anchor, then the others by index.
        ids = jnp.arange(t)
        order = jnp.argsort(jnp.where(ids == anchor, -1, ids))

        def task_scales(sq, n):
            """`(new running norms [T], h_t = scale_t * g_t factors [T])` of one tensor."""
            norm = jnp.sqrt(sq)
            running = jnp.where(first, norm, b3 * n + (1.0 - b3) * norm)
            new_n = jnp.where(present, running, n)  # an absent task keeps its norm
            valid = new_n > ANCHOR_THRESHOLD
            a = order[jnp.argmax(valid[order])]
            safe_n = jnp.where(valid, new_n, 1.0)
            return new_n, jnp.where(valid, r * new_n[a] / safe_n, 1.0)

        def direction(m_sum, v_max, f1, f2):
            denom = jnp.sqrt(f2 * v_max.astype(jnp.float32)) / jnp.sqrt(bc2) + eps
            return f1 * m_sum.astype(jnp.float32) / denom / bc1

        leaves = [jax.tree.leaves(x) for x in
                  (state.norms, state.mu, state.nu, state.nu_max, state.row_step)]
        out, new = [], [[] for _ in leaves]
        for s, sq, u, p, n, m, v, vmax, last in zip(stacked, all_sq, summed, p_leaves, *leaves):
            nd = m.ndim
            if isinstance(s, SparseRows) and not decay:
                d, row_state = _sparse_rows_step(s, sq, n, m, v, vmax, last, count,
                                                 task_scales, direction, b1, b2)
                out.append(d)
                for lst, x in zip(new, row_state):
                    lst.append(x)
                continue
            f1 = _rows(_decay(b1, count - last), nd)
            f2 = _rows(_decay(b2, count - last), nd)
            if s is None:  # unshared: plain Adam in slot 0 (the other slots stay 0)
                g0 = u.astype(jnp.float32)
                if decay:
                    g0 = g0 + weight_decay * p.astype(jnp.float32)
                new_n = n
                new_m = f1 * m.astype(jnp.float32) + (1.0 - b1) * g0
                new_v0 = f2 * v[0].astype(jnp.float32) + (1.0 - b2) * g0 * g0
                new_v = v.at[0].set(new_v0.astype(v.dtype))
                new_vmax = new_v0
            else:
                g = leaf_dense(s).astype(jnp.float32)
                new_n, scale = task_scales(sq, n)
                shape = (t,) + (1,) * nd
                h = scale.reshape(shape) * g
                h_sum = task_sum(h)
                if decay:
                    wd = weight_decay * p.astype(jnp.float32)
                    h = h + wd[None]
                    h_sum = h_sum + t * wd
                new_m = f1 * m.astype(jnp.float32) + (1.0 - b1) * h_sum
                new_v = f2[None] * v.astype(jnp.float32) + (1.0 - b2) * h * h
                new_vmax = task_max(new_v)
                new_v = new_v.astype(v.dtype)
            out.append(direction(new_m, new_vmax, 1.0, 1.0).astype(m.dtype))
            for lst, x in zip(new, (new_n, new_m.astype(m.dtype), new_v,
                                    # = count (every row was at most at count - 1),
                                    # written from `last` so XLA updates it in place
                                    # instead of copying a broadcast over it.
                                    new_vmax.astype(vmax.dtype), jnp.maximum(last, count))):
                lst.append(x)
        sdef = jax.tree.structure(state.norms)
        new_state = MTAdamState(
            count, state.seen + present.astype(jnp.int32),
            *(sdef.unflatten(lst) for lst in new),
        )
        return treedef.unflatten(out), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _sparse_rows_step(x: SparseRows, sq, n, m, v, vmax, last, count, task_scales, direction,
                      b1, b2):
    """One exact MTAdam step of a table from its looked-up rows (no weight decay): `x`
    holds one non-zero row per task and index at most (`unique_rows`), `sq` their `[T]`
    squared norms.

    The looked-up rows (every task's, duplicates across tasks allowed) are brought to
    step `count` (`b^(count - row_step)`, all tasks of a row at once), the tasks' `h` rows
    are added (`mu`: their sum; `nu`: per task, `h^2` of the merged row), `nu_max` is
    recomputed for those rows; every other row only decays, through its `row_step`."""
    t, k, dim = x.rows.shape
    rows = x.rows.astype(jnp.float32)
    new_n, scale = task_scales(sq, n)
    h = scale[:, None, None] * rows  # [T, k, dim]
    idx = x.indices.reshape(-1)  # [T * k]
    age = count - last[idx]
    f1, f2 = _decay(b1, age)[:, None], _decay(b2, age)[:, None]
    # Rescale the touched rows to this step (duplicate indices write equal values).
    m = m.at[idx].set((f1 * m[idx].astype(jnp.float32)).astype(m.dtype))
    v = v.at[:, idx].set((f2[None] * v[:, idx].astype(jnp.float32)).astype(v.dtype))
    last = last.at[idx].set(count)
    m = m.at[idx].add(((1.0 - b1) * h.reshape(t * k, dim)).astype(m.dtype))
    tid = jnp.broadcast_to(jnp.arange(t)[:, None], (t, k))
    v = v.at[tid, x.indices].add(((1.0 - b2) * h * h).astype(v.dtype))
    vmax = vmax.at[idx].set(task_max(v[:, idx]))
    f1_all = _rows(_decay(b1, count - last), 2)
    f2_all = _rows(_decay(b2, count - last), 2)
    d = direction(m, vmax, f1_all, f2_all).astype(m.dtype)
    return d, (new_n, m, v, vmax, last)
