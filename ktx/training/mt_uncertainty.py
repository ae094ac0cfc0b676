"""MT-uncertainty sampling (Pilault et al., ICLR 2021, "Conditionally Adaptive Multi-Task
Learning", Algorithm 1), inside the compiled train step.

The input gives a *candidate* batch (the authors draw one batch of `b` rows from every
task: `BATCH_SIZE = T x b` with equal mixing); the step scores every candidate with the
current parameters and trains on the `b` highest-scoring rows. With `H_i` the entropy of
row `i`'s own task head over its maximum (`EncoderClassifierModel.normalised_entropy`:
`H(softmax(logits)) / (log n_t + 1e-5)`, deterministic forward, no gradient):

    m_t   = mean of H_i over the candidate rows of task t
    U_i   = H_i * m_{t(i)} / max_t m_t           (the authors' `MtUcertaintyIterator`)
    batch = the rows of the `b` largest U_i      (`lax.top_k`; ties to the lower row)

A regression head has no entropy (`H = 0`): the authors' code lets STS-B's rows borrow
MRPC's (the k-th STS-B row takes the k-th MRPC row's `H_i` and `m_t / max m`, for the rows
both tasks have). `proxies` generalises that: `{regression task: classification task}`,
given by task index; a regression task without a proxy would never be trained on, which
`check_proxies` refuses.

Selection depends only on the parameters and the candidate batch, both restored exactly
from a checkpoint, so a resumed run selects the same rows as an uninterrupted one. The
candidates' forward pass costs about one third of a training step on `T x b` rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["uncertainty_scores", "select_uncertain_rows", "check_proxies", "proxy_indices"]


def _rank_in_task(task_id: jax.Array, num_tasks: int) -> jax.Array:
    """`[B]` position of each row among the rows of its task (0, 1, ... in row order)."""
    onehot = jax.nn.one_hot(task_id, num_tasks, dtype=jnp.int32)
    return jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=1)


def uncertainty_scores(entropy: jax.Array, task_id: jax.Array, num_tasks: int,
                       proxies: Sequence[tuple[int, int]] = ()) -> jax.Array:
    """`[B]` scores `U_i` (module docstring) of candidate rows with normalised entropies
    `entropy [B]` and tasks `task_id [B]`; `proxies` pairs `(regression, classification)`
    task indices."""
    entropy = jnp.asarray(entropy, jnp.float32)
    task_id = jnp.asarray(task_id, jnp.int32)
    counts = jax.ops.segment_sum(jnp.ones_like(entropy), task_id, num_tasks)
    means = jax.ops.segment_sum(entropy, task_id, num_tasks) / jnp.maximum(counts, 1.0)
    top = jnp.max(jnp.where(counts > 0, means, -jnp.inf))
    # All-zero entropies (only regression candidates): every score is 0, top-k keeps order.
    weight = jnp.where(top > 0, means / jnp.where(top > 0, top, 1.0), 0.0)[task_id]
    if proxies:
        rank = _rank_in_task(task_id, num_tasks)
        rows = jnp.arange(task_id.shape[0], dtype=jnp.int32)
        # row_of[t, k]: the k-th row of task t (B where task t has fewer than k + 1 rows).
        row_of = jnp.full((num_tasks, task_id.shape[0] + 1), task_id.shape[0], jnp.int32)
        row_of = row_of.at[task_id, rank].set(rows)
        padded_entropy = jnp.append(entropy, 0.0)
        padded_weight = jnp.append(weight, 0.0)
        for target, source in proxies:
            partner = row_of[source, rank]
            borrow = (task_id == target) & (partner < task_id.shape[0])
            entropy = jnp.where(borrow, padded_entropy[partner], entropy)
            weight = jnp.where(borrow, padded_weight[partner], weight)
    return entropy * weight


def select_uncertain_rows(model: Any, params: Any, batch: Mapping[str, jax.Array],
                          num_rows: int, proxies: Sequence[tuple[int, int]] = ()
                          ) -> tuple[dict[str, jax.Array], jax.Array]:
    """The `num_rows` candidate rows of `batch` with the highest `uncertainty_scores`
    under `params` (every feature gathered, in descending score order), and the `[B]`
    scores of all candidates."""
    size = next(iter(batch.values())).shape[0]
    if not 1 <= num_rows <= size:
        raise ValueError(f"MT-uncertainty sampling keeps num_rows={num_rows} of a candidate "
                         f"batch of {size} rows; accepted: 1 <= num_rows <= {size}")
    entropy = jax.lax.stop_gradient(model.normalised_entropy(params, batch))
    scores = uncertainty_scores(entropy, batch["task_id"], model.num_tasks, proxies)
    _, index = jax.lax.top_k(scores, num_rows)
    return {k: jnp.take(v, index, axis=0) for k, v in batch.items()}, scores


def check_proxies(model: Any, proxies: Sequence[tuple[int, int]] | None,
                  task_names: Sequence[str] | None = None) -> tuple[tuple[int, int], ...]:
    """`proxies` checked against `model` (an encoder classifier with `num_labels` and
    `normalised_entropy`): every regression task borrows from one classification task,
    and only regression tasks borrow."""
    if not callable(getattr(model, "normalised_entropy", None)):
        raise ValueError(
            f"MT-uncertainty sampling scores rows by their task head's entropy; "
            f"{type(model).__name__} has no `normalised_entropy` (accepted: an encoder "
            "classifier, ktx.models.encoder.EncoderClassifierModel and its CA-MTL, PALs and "
            "TEA subclasses)")
    labels = tuple(model.num_labels)
    name = (lambda t: f"{t} ({task_names[t]})") if task_names else str
    proxies = tuple((int(a), int(b)) for a, b in (proxies or ()))
    for target, source in proxies:
        for t in (target, source):
            if not 0 <= t < len(labels):
                raise ValueError(f"mt_uncertainty_proxies: task {t} is not in 0..{len(labels) - 1}")
        if labels[target] != 1:
            raise ValueError(f"mt_uncertainty_proxies: task {name(target)} has a {labels[target]}-"
                             "class head; only regression tasks (1 output) borrow a proxy's "
                             "entropy")
        if labels[source] == 1:
            raise ValueError(f"mt_uncertainty_proxies: proxy task {name(source)} is a regression "
                             "task; accepted: a classification task")
    targets = [t for t, _ in proxies]
    if len(set(targets)) != len(targets):
        raise ValueError(f"mt_uncertainty_proxies={proxies}: a regression task has two proxies")
    missing = [t for t, n in enumerate(labels) if n == 1 and t not in targets]
    if missing:
        raise ValueError(
            f"MT-uncertainty sampling: regression task(s) {', '.join(name(t) for t in missing)} "
            "have no "
            "entropy and would never be selected; give each a classification task to borrow "
            "from, e.g. MT_UNCERTAINTY_PROXIES = {'<regression task>': '<classification "
            "task>'} (the authors pair STS-B with MRPC)")
    return proxies


def proxy_indices(proxies: Mapping[str, str] | Sequence[tuple[int, int]] | None,
                  task_names: Sequence[str]) -> tuple[tuple[int, int], ...]:
    """`{regression task name: classification task name}` (or index pairs) -> index
    pairs; an unknown name is an error listing the run's tasks."""
    if not proxies:
        return ()
    if not isinstance(proxies, Mapping):
        return tuple((int(a), int(b)) for a, b in proxies)
    names = list(task_names)
    out = []
    for target, source in proxies.items():
        for n in (target, source):
            if n not in names:
                raise ValueError(f"mt_uncertainty_proxies names task {n!r}; the run's tasks are "
                                 f"{names}")
        out.append((names.index(target), names.index(source)))
    return tuple(out)
